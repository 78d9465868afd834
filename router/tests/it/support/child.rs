//! A router binary run as a child process, so that what it holds (memory,
//! descriptors) is its own: for the tests and examples that measure it.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::Child;

/// Kills the router when dropped, a panicking test's included.
pub struct Router(pub Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the router `program` with the configuration file `config`
/// (its listeners on port 0), its stderr into `log`, and waits for it to
/// print where it listens: the router, its API address and its admin
/// address. Chosen by the router, they cannot be taken by another test
/// in between. Panics with the log if it exits first.
pub fn spawn(
    program: &std::path::Path,
    config: &std::path::Path,
    log: &std::path::Path,
) -> (Router, SocketAddr, SocketAddr) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(program)
        .arg("--config")
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let router = Router(child);
    let mut lines = std::io::BufReader::new(stdout).lines();
    let (mut api, mut admin) = (None, None);
    while api.is_none() || admin.is_none() {
        let Some(Ok(line)) = lines.next() else {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!("the router exited before it listened; its log:\n{log}");
        };
        let at = |prefix: &str| line.strip_prefix(prefix)?.parse::<SocketAddr>().ok();
        api = api.or(at("kvroute-router: API on http://"));
        admin = admin.or(at("kvroute-router: admin on http://"));
    }
    // Read on, so that the router never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (router, api.unwrap(), admin.unwrap())
}

/// `VmHWM` (peak resident set) and `VmRSS` of `pid`, in kB.
pub fn memory_kb(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmHWM:"), field("VmRSS:"))
}
