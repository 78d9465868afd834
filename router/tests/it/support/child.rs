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

/// A loopback address nothing listens on right now.
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
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
