//! A real `redis-server` on loopback for the Redis store's tests: started
//! on a free port without persistence, polled until it answers, killed
//! when dropped. Not installed: the test is skipped, with a message,
//! unless `KVROUTE_REQUIRE_REDIS=1` makes that a failure.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server gets to answer after it starts.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// How the server listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// Plain TCP.
    Plain,
    /// TLS only, with the certificates in `tests/fixtures/tls` (clients
    /// need no certificate).
    Tls,
}

/// A running `redis-server`; killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    listen: Listen,
    extra: Vec<String>,
}

impl RedisServer {
    /// A plain server with the `extra` arguments (e.g. `--requirepass`);
    /// `None`, said on stderr, when `redis-server` is not installed.
    pub fn start(extra: &[&str]) -> Option<Self> {
        Self::start_listening(Listen::Plain, extra)
    }

    /// A server listening as `listen`, with the `extra` arguments.
    pub fn start_listening(listen: Listen, extra: &[&str]) -> Option<Self> {
        if !installed() {
            assert!(
                std::env::var("KVROUTE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "redis-server is not on PATH and KVROUTE_REQUIRE_REDIS=1"
            );
            eprintln!(
                "skipped: redis-server is not on PATH (KVROUTE_REQUIRE_REDIS=1 fails instead)"
            );
            return None;
        }
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        // The port is free when picked, not necessarily when the server
        // binds it: a lost race is a server that exits, and another port.
        for _ in 0..3 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                listen,
                extra: extra.clone(),
            };
            if server.spawn_and_wait() {
                return Some(server);
            }
        }
        panic!("redis-server exited at start three times");
    }

    /// `redis://127.0.0.1:port` (`rediss://` with TLS).
    pub fn url(&self) -> String {
        let scheme = match self.listen {
            Listen::Plain => "redis",
            Listen::Tls => "rediss",
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Kills the server (its data goes with it).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the process (`SIGSTOP`): connections are still accepted,
    /// nothing is answered.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Resumes a paused server (`SIGCONT`).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("a running server");
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal} {}", child.id());
    }

    /// Starts it again, empty, on the same port.
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn_and_wait(),
            "redis-server did not start again on port {}",
            self.port
        );
    }

    /// Starts the server; whether it answers within [`READY_WITHIN`]
    /// (false: it exited, its port taken).
    fn spawn_and_wait(&mut self) -> bool {
        let port = self.port.to_string();
        let mut args: Vec<String> = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            .map(String::from)
            .into();
        match self.listen {
            Listen::Plain => args.extend(["--port".into(), port]),
            Listen::Tls => {
                let tls = |name: &str| fixture(name).display().to_string();
                args.extend([
                    "--port".into(),
                    "0".into(),
                    "--tls-port".into(),
                    port,
                    "--tls-cert-file".into(),
                    tls("server.crt"),
                    "--tls-key-file".into(),
                    tls("server.key"),
                    "--tls-ca-cert-file".into(),
                    tls("ca.crt"),
                    "--tls-auth-clients".into(),
                    "no".into(),
                ]);
            }
        }
        args.extend(self.extra.iter().cloned());
        let child = Command::new("redis-server")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let until = Instant::now() + READY_WITHIN;
        loop {
            let exited = (self.child.as_mut()).is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            if exited {
                self.child = None;
                return false;
            }
            if answers(addr, self.listen) {
                return true;
            }
            assert!(
                Instant::now() < until,
                "redis-server on {addr} did not answer within {READY_WITHIN:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `redis-server` runs here.
fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether the server on `addr` answers: a `PING` gets a reply (`+PONG`,
/// or `-NOAUTH` with a password); with TLS, a connection is accepted.
fn answers(addr: SocketAddr, listen: Listen) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    if listen == Listen::Tls {
        return true;
    }
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = [0u8; 1];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && matches!(reply[0], b'+' | b'-')
}

/// A loopback port nothing listens on right now.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A file of `tests/fixtures/tls`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}
