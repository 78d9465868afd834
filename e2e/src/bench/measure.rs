//! What one load run measures: `wrk`'s requests and latency percentiles
//! (printed by a Lua `done` hook as one JSON line), and a process tree's
//! CPU time and peak memory from `/proc`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde::Deserialize;

/// The Lua script wrk runs: a POST of the body in `BENCH_BODY`, with
/// `x-bench-stream: 1` when `BENCH_STREAM` is 1 (the fixed upstream then
/// answers an event stream), and one `BENCH {json}` line at the end.
pub const WRK_SCRIPT: &str = r#"
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
if os.getenv("BENCH_STREAM") == "1" then wrk.headers["x-bench-stream"] = "1" end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests":%d,"duration_us":%d,"errors":%d,"bad_status":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"#;

/// wrk's script for the soak: every request a new prompt (a counter at the
/// start of the first message's content) and a new `prompt_cache_key`, so
/// every cache the router has sees only new keys.
pub const WRK_UNIQUE_SCRIPT: &str = r#"
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
local body = f:read("*a")
f:close()
local head, tail = body:match('^{(.-"content":")(.*)$')
local counter = 0
request = function()
  counter = counter + 1
  local id = tostring(counter) .. "-" .. tostring(math.random(1000000000))
  return wrk.format("POST", nil, {["Content-Type"] = "application/json"},
    '{"prompt_cache_key":"' .. id .. '",' .. head .. id .. ' ' .. tail)
end
"#;

/// One wrk run's figures.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct Wrk {
    /// Completed requests.
    pub requests: u64,
    /// The run's length, µs.
    pub duration_us: u64,
    /// Connect, read, write and timeout errors.
    pub errors: u64,
    /// Responses other than 2xx and 3xx.
    pub bad_status: u64,
    /// Median latency, µs.
    pub p50_us: u64,
    /// 99th percentile latency, µs.
    pub p99_us: u64,
}

impl Wrk {
    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / (self.duration_us.max(1) as f64 / 1e6)
    }
}

/// A wrk run in progress ([`start_wrk`]).
pub struct WrkRun(std::process::Child);

/// Starts wrk (one thread, `connections`, `duration`) against `url`,
/// posting the body in file `body`; [`WrkRun::finish`] waits for it.
pub fn start_wrk(
    script: &Path,
    url: &str,
    body: &Path,
    stream: bool,
    connections: usize,
    duration: Duration,
) -> anyhow::Result<WrkRun> {
    let child = Command::new("wrk")
        .args([
            "-t1".to_owned(),
            format!("-c{connections}"),
            format!("-d{}s", duration.as_secs().max(1)),
            "--timeout=10s".to_owned(),
            "-s".to_owned(),
        ])
        .arg(script)
        .arg(url)
        .env("BENCH_BODY", body)
        .env("BENCH_STREAM", if stream { "1" } else { "0" })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running wrk (apt-get install wrk)")?;
    Ok(WrkRun(child))
}

impl WrkRun {
    /// Waits for the run and reads its figures.
    pub fn finish(self) -> anyhow::Result<Wrk> {
        let out = self.0.wait_with_output().context("waiting for wrk")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("BENCH ")) else {
            bail!(
                "wrk printed no figures ({}): {}{}",
                out.status,
                stdout.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        };
        serde_json::from_str(line).with_context(|| format!("reading wrk's figures {line:?}"))
    }

    /// Ends the run now.
    pub fn kill(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `root` and every process descended from it.
pub fn tree(root: u32) -> Vec<u32> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        if let Some(stat) = stat(pid) {
            parents.push((pid, stat.ppid));
        }
    }
    let mut pids = vec![root];
    let mut i = 0;
    while i < pids.len() {
        let parent = pids[i];
        pids.extend(parents.iter().filter(|p| p.1 == parent).map(|p| p.0));
        i += 1;
    }
    pids
}

struct Stat {
    ppid: u32,
    /// User plus system time, clock ticks.
    ticks: u64,
}

/// Fields of `/proc/<pid>/stat` (proc(5)): after the command name in
/// parentheses, the state is field 3, ppid 4, utime 14, stime 15.
fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        ppid: u32::try_from(field(4)?).ok()?,
        ticks: field(14)? + field(15)?,
    })
}

/// CPU time the processes `pids` have used, µs.
pub fn cpu_us(pids: &[u32]) -> u64 {
    let ticks: u64 = pids.iter().filter_map(|&p| stat(p)).map(|s| s.ticks).sum();
    ticks * 1_000_000 / clock_ticks_per_second()
}

/// `getconf CLK_TCK` (100 on Linux's common architectures).
fn clock_ticks_per_second() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// A memory field of `/proc/<pid>/status` (`VmHWM`: peak resident,
/// `VmRSS`: resident now) summed over `pids`, KiB.
pub fn memory_kib(pids: &[u32], field: &str) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .sum()
}
