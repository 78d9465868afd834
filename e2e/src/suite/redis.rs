//! A `redis-server` for the suite: found on `PATH`, started on a loopback
//! port with no persistence (so a restart starts empty, as a Redis pod
//! without a volume does), and ready when it answers `PING`.
//!
//! Not here: what a scenario does with it ([`super::response_cache`]).

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;

use super::procs::Proc;
use super::system::free_ports;

/// The longest a started `redis-server` may take to answer `PING`.
const STARTUP: Duration = Duration::from_secs(10);

/// `redis-server` on `PATH`, if there is one.
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file())
}

/// A running `redis-server`, killed when dropped.
#[derive(Debug)]
pub struct Redis {
    exe: PathBuf,
    logs: PathBuf,
    port: u16,
    proc: Option<Proc>,
}

impl Redis {
    /// Starts `exe` on a free port, its log `logs/redis.log`, and waits
    /// until it answers; a port taken in between is replaced by another.
    pub async fn start(exe: &Path, logs: &Path) -> anyhow::Result<Redis> {
        let mut last = None;
        for _ in 0..3 {
            let port = free_ports(1)?.next().expect("one port");
            let mut redis = Redis {
                exe: exe.to_owned(),
                logs: logs.to_owned(),
                port,
                proc: None,
            };
            match redis.restart().await {
                Ok(()) => return Ok(redis),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// Its port, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// SIGKILL: no shutdown, no save; its clients' connections are reset.
    pub fn kill(&mut self) {
        if let Some(proc) = self.proc.take() {
            proc.kill();
        }
    }

    /// Starts it (again) on its port and waits until it answers `PING`.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        let args: Vec<String> = [
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        .map(str::to_owned)
        .into();
        let mut proc = Proc::spawn_program(&self.logs, "redis", &self.exe, &args, &[])?;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let start = Instant::now();
        loop {
            // Exited first: a PONG is then not from another server on the port.
            let exited = proc.exited();
            if !exited && tokio::task::spawn_blocking(move || ping(addr)).await? {
                self.proc = Some(proc);
                return Ok(());
            }
            if exited || start.elapsed() >= STARTUP {
                bail!(
                    "redis-server did not answer PING on {addr}; see {}",
                    proc.log().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Whether a Redis server on `addr` answers `PING` with `+PONG`.
fn ping(addr: SocketAddr) -> bool {
    let answer = || -> std::io::Result<bool> {
        let timeout = Duration::from_millis(500);
        let mut conn = TcpStream::connect_timeout(&addr, timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.write_all(b"PING\r\n")?;
        let mut buf = [0; 7];
        conn.read_exact(&mut buf)?;
        Ok(&buf == b"+PONG\r\n")
    };
    answer().unwrap_or(false)
}
