//! The binaries under test and the processes started from them: each
//! process writes its stdout and stderr to its own log file, and is killed
//! when its [`Proc`] is dropped, so a failing scenario leaves nothing
//! running. A process that exited because a port it was given was taken
//! says so ([`Proc::port_taken`]), so that the system can start it again.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// The binaries the suite starts.
pub const BINARIES: [&str; 4] = [
    "kvroute-engine-sim",
    "kvroute-agent",
    "kvroute-operator",
    "kvroute-router",
];

/// Where the binaries are.
#[derive(Clone, Debug)]
pub struct Bins {
    dir: PathBuf,
}

impl Bins {
    /// `dir`, or else the directory of this executable. Run by `cargo run`
    /// without `dir`, the binaries are built first, in this executable's
    /// profile (cargo builds only this package's binaries for `cargo run`).
    pub fn locate(dir: Option<PathBuf>) -> anyhow::Result<Bins> {
        let dir = match dir {
            Some(dir) => dir,
            None => {
                let exe = std::env::current_exe().context("locating this executable")?;
                let dir = exe
                    .parent()
                    .context("this executable's directory")?
                    .to_owned();
                if let Some(cargo) = std::env::var_os("CARGO") {
                    build(&cargo, &dir)?;
                }
                dir
            }
        };
        for name in BINARIES {
            let path = dir.join(name);
            if !path.is_file() {
                bail!(
                    "{} is missing: build the binaries (cargo build -p kvroute-engine-sim -p kvroute-agent -p kvroute-operator -p kvroute-router) or pass --bin-dir",
                    path.display()
                );
            }
        }
        Ok(Bins { dir })
    }

    /// The path of binary `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// `cargo build` of [`BINARIES`] in the profile whose directory is `dir`.
fn build(cargo: &std::ffi::OsStr, dir: &Path) -> anyhow::Result<()> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut command = Command::new(cargo);
    command.arg("build").arg("--manifest-path").arg(&manifest);
    if dir.file_name().is_some_and(|n| n == "release") {
        command.arg("--release");
    }
    for name in BINARIES {
        command.args(["--bin", name]);
    }
    eprintln!("kvroute-e2e: building the binaries under test");
    let status = command.status().context("running cargo build")?;
    if !status.success() {
        bail!("cargo build of the binaries under test failed: {status}");
    }
    Ok(())
}

/// What the operating system says of a port in use (`EADDRINUSE`), which
/// every binary's listen or bind error carries, e.g. `cannot listen on
/// 127.0.0.1:8000: Address already in use (os error 98)`.
const ADDR_IN_USE: &str = "Address already in use";

/// A running process, killed on drop.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    /// Stopped with SIGTERM on drop (a process whose children outlive a
    /// SIGKILL, as nginx's workers do).
    graceful: bool,
    /// Its log, and the log's length when it started (a restarted
    /// process appends to its predecessor's): its own output follows.
    log: PathBuf,
    log_start: u64,
}

impl Proc {
    /// Starts binary `bin` with `args` and `env`, its output appended to
    /// `logs/<name>.log`.
    pub fn spawn(
        bins: &Bins,
        logs: &Path,
        name: &str,
        bin: &str,
        args: &[String],
        env: &[(&str, String)],
    ) -> anyhow::Result<Proc> {
        Self::spawn_program(logs, name, &bins.path(bin), args, env)
    }

    /// Starts `program` as [`spawn`](Self::spawn) starts a binary.
    pub fn spawn_program(
        logs: &Path,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, String)],
    ) -> anyhow::Result<Proc> {
        let path = logs.join(format!("{name}.log"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let log_start = log.metadata().map_or(0, |m| m.len());
        let child = Command::new(program)
            .args(args)
            .env_remove("PYTHONHASHSEED")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("duplicating a log file")?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} ({name})", program.display()))?;
        Ok(Proc {
            name: name.to_owned(),
            child,
            graceful: false,
            log: path,
            log_start,
        })
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Whether it has exited because an address it was to listen on was in
    /// use, as its output says.
    pub fn port_taken(&mut self) -> bool {
        self.exited() && self.output().contains(ADDR_IN_USE)
    }

    /// What it has written to its log.
    fn output(&self) -> String {
        let mut bytes = Vec::new();
        if let Ok(mut file) = File::open(&self.log)
            && file.seek(SeekFrom::Start(self.log_start)).is_ok()
        {
            let _ = file.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its name in the logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether it has exited.
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// How it exited, once it has.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILL, as a node failure or the OOM killer does, and reaps it.
    pub fn kill(mut self) {
        self.reap();
    }

    /// Makes dropping it a [`terminate`](Self::terminate) with 5 s of grace.
    pub fn graceful(mut self) -> Proc {
        self.graceful = true;
        self
    }

    /// SIGTERM, as Kubernetes stops a container; SIGKILL if it has not
    /// exited after `grace`.
    pub fn terminate(mut self, grace: Duration) {
        self.term(grace);
    }

    fn term(&mut self, grace: Duration) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && !self.exited() {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.reap();
    }

    fn reap(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.graceful {
            self.term(Duration::from_secs(5));
        }
        self.reap();
    }
}

/// Executable `exe` of package `spec` in `venv`, installed there first
/// (a venv made by `python`) when missing; `Err` says why it cannot be had.
pub fn pip_install(venv: &Path, python: &Path, spec: &str, exe: &str) -> Result<PathBuf, String> {
    let exe = venv.join("bin").join(exe);
    if exe.is_file() {
        return Ok(exe);
    }
    eprintln!("kvroute-e2e: installing {spec} into {}", venv.display());
    let run = |cmd: &mut Command, what: &str| -> Result<(), String> {
        let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            Err(format!("{what} failed: {}", tail.join(" / ")))
        }
    };
    run(
        Command::new(python).arg("-m").arg("venv").arg(venv),
        "creating the venv",
    )?;
    run(
        Command::new(venv.join("bin/pip")).args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            spec,
        ]),
        &format!("pip install {spec}"),
    )?;
    if !exe.is_file() {
        return Err(format!("pip installed no {} executable", exe.display()));
    }
    Ok(exe)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sh -c script` as process `name`, run to its end.
    fn exited(logs: &Path, name: &str, script: &str) -> Proc {
        let args = ["-c".to_owned(), script.to_owned()];
        let mut proc = Proc::spawn_program(logs, name, Path::new("sh"), &args, &[]).unwrap();
        proc.child.wait().unwrap();
        proc
    }

    #[test]
    fn a_process_refused_its_port_says_so_and_only_that_one() {
        let logs = std::env::temp_dir().join(format!("kvroute-e2e-procs-{}", std::process::id()));
        std::fs::create_dir_all(&logs).unwrap();
        let refused = "echo 'Error: cannot listen on 127.0.0.1:8000: \
            Address already in use (os error 98)' >&2; exit 1";

        assert!(exited(&logs, "router", refused).port_taken());
        // Started again under the same name, its log follows the first's:
        // what the first wrote is not held against it.
        assert!(!exited(&logs, "router", "echo 'Error: no such file' >&2; exit 1").port_taken());
        assert!(!exited(&logs, "sim", "echo listening; exit 0").port_taken());
        // Running, it has not been refused anything yet.
        let args = ["-c".to_owned(), format!("echo '{ADDR_IN_USE}'; sleep 30")];
        let mut running = Proc::spawn_program(&logs, "agent", Path::new("sh"), &args, &[]).unwrap();
        assert!(!running.port_taken());
        running.kill();
        let _ = std::fs::remove_dir_all(&logs);
    }
}
