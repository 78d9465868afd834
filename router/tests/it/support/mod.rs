//! Test fixtures: engine sims and a router over them, on loopback.

#![allow(dead_code)]

pub mod child;
pub mod fake_cache;
pub mod redis_server;

use std::path::PathBuf;

use kvroute_engine_sim::{Config as SimConfig, Sim};
use kvroute_router::config::{Config, Discovery, StaticDiscovery};
use kvroute_router::{Running, start};
use serde_json::{Value, json};

/// Engines and a router in front of them.
pub struct Stack {
    pub sims: Vec<Sim>,
    pub router: Running,
    pub dir: PathBuf,
    pub client: reqwest::Client,
}

/// A router config on free ports, reading `endpoints.yaml` in `dir`.
pub fn router_config(dir: &std::path::Path) -> Config {
    let mut c = Config {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    c.discovery = Discovery::Static(StaticDiscovery {
        file: dir.join("endpoints.yaml"),
        reload_ms: 100,
    });
    c
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-router-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A temporary directory whose endpoints file lists `upstream` alone.
pub fn upstream_dir(name: &str, upstream: std::net::SocketAddr) -> PathBuf {
    let dir = temp_dir(name);
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!("endpoints:\n  - address: {upstream}\n"),
    )
    .unwrap();
    dir
}

/// Runs the router binary with `yaml` (without listeners: both on port 0)
/// in `dir`, its log in `dir/router.log`: the child, its API address and
/// its admin address.
pub fn spawn_router(
    dir: &std::path::Path,
    yaml: &str,
) -> (child::Router, std::net::SocketAddr, std::net::SocketAddr) {
    let config = dir.join("router.yaml");
    let yaml = format!("listen: 127.0.0.1:0\nadminListen: 127.0.0.1:0\n{yaml}");
    std::fs::write(&config, yaml).unwrap();
    let program = std::path::Path::new(env!("CARGO_BIN_EXE_kvroute-router"));
    child::spawn(program, &config, &dir.join("router.log"))
}

/// The static endpoints file in `dir`: each endpoint's name, address and
/// disaggregation role.
pub fn write_roled_endpoints(
    dir: &std::path::Path,
    endpoints: &[(&str, std::net::SocketAddr, &str)],
) {
    let mut yaml = String::from("endpoints:\n");
    for (name, address, role) in endpoints {
        yaml += &format!("  - {{name: {name}, address: '{address}', role: {role}}}\n");
    }
    std::fs::write(dir.join("endpoints.yaml"), yaml).unwrap();
}

/// Polls `check` until it holds; fails the test after 10 s.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    kvroute_testkit::eventually(what, std::time::Duration::from_secs(10), || {
        let holds = check();
        async move { holds.then_some(()) }
    })
    .await;
}

/// Writes the endpoints file for `sims` (with their WatchCache ports when
/// `exact`).
pub fn write_endpoints(dir: &std::path::Path, sims: &[&Sim], exact: bool) {
    let mut yaml = String::from("endpoints:\n");
    for (i, s) in sims.iter().enumerate() {
        yaml += &format!("  - name: sim-{i}\n    address: {}\n", s.http_addr);
        if exact {
            yaml += &format!("    cachePort: {}\n", s.cache_addr.port());
        }
    }
    std::fs::write(dir.join("endpoints.yaml"), yaml).unwrap();
}

impl Stack {
    /// `n` sims configured by `sim`, and a router configured by `router`.
    pub async fn start(
        name: &str,
        n: usize,
        exact: bool,
        sim: impl Fn(&mut SimConfig),
        router: impl FnOnce(&mut Config),
    ) -> Stack {
        let mut sims = Vec::new();
        for _ in 0..n {
            let mut c = SimConfig::test();
            sim(&mut c);
            sims.push(kvroute_engine_sim::start(c).await.unwrap());
        }
        let dir = temp_dir(name);
        write_endpoints(&dir, &sims.iter().collect::<Vec<_>>(), exact);
        let mut config = router_config(&dir);
        router(&mut config);
        let router = start(config).await.unwrap();
        Stack {
            sims,
            router,
            dir,
            client: reqwest::Client::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.router.addr())
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// Waits until every WatchCache stream is live.
    pub async fn wait_live(&self) {
        eventually("every WatchCache stream is live", || {
            let status = self.router.pool.status();
            !status.is_empty() && status.iter().all(|e| e.stream == "live")
        })
        .await;
    }

    /// Waits until no endpoint has a request in flight or a queue by its
    /// engine's last report: a report taken while the previous request
    /// queued would make its endpoint look busy to the next one.
    pub async fn wait_idle(&self) {
        eventually("the pool is idle", || {
            let status = self.router.pool.status();
            status
                .iter()
                .all(|e| e.in_flight == 0 && e.queue_seconds == 0.0)
        })
        .await;
    }

    /// Sends one chat with `system` and waits until the blocks it left on
    /// its endpoint reach the router's index; returns that endpoint.
    pub async fn warm(&self, system: &str) -> String {
        let before = self.router.pool.index_entries();
        let r = self
            .post("/v1/chat/completions", chat(system, "first", 2))
            .await;
        let holder = r.headers()["x-kvroute-endpoint"]
            .to_str()
            .unwrap()
            .to_owned();
        eventually("the index sees the blocks", || {
            self.router.pool.index_entries() > before
        })
        .await;
        holder
    }

    pub async fn metrics(&self) -> String {
        get_text(&format!("http://{}/metrics", self.router.admin_addr)).await
    }

    pub async fn stop(self) {
        self.router.shutdown().await;
        for s in self.sims {
            s.shutdown().await;
        }
        let _ = std::fs::remove_dir_all(self.dir);
    }
}

/// A chat request body.
pub fn chat(system: &str, user: &str, max_tokens: u64) -> Value {
    json!({
        "model": "kvroute-sim",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
    })
}

/// A long system prompt, distinct per `seed`.
pub fn long_text(seed: usize) -> String {
    (0..120)
        .map(|i| format!("topic{seed} sentence {i} about caching and routing. "))
        .collect()
}

/// An upstream that records each request's headers (and up to 64 KiB of
/// it) and answers a minimal completion once it has read the whole body,
/// so closing the connection resets nothing the router still sends.
pub async fn recording_upstream() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let length = (head.to_ascii_lowercase().lines())
                    .find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok())
                    .unwrap_or(0usize);
                let read = (buf[..n].windows(4))
                    .position(|w| w == b"\r\n\r\n")
                    .map_or(0, |at| n - (at + 4));
                let mut rest = length.saturating_sub(read);
                while rest > 0 {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(m) => rest = rest.saturating_sub(m),
                    }
                }
                let _ = tx.send(head);
                let body = "{\"choices\": []}";
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    (addr, rx)
}

/// An engine that, while `hung` and for requests whose first bytes
/// `hangs` selects, holds the connection and answers nothing (until the
/// router closes it); otherwise it answers a minimal completion. Counts
/// the `POST`s it received.
pub async fn hangable_upstream(
    hung: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hangs: fn(&[u8]) -> bool,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let posts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = posts.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (hung, posts) = (hung.clone(), counted.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if buf[..n].starts_with(b"POST ") {
                        posts.fetch_add(1, Ordering::SeqCst);
                    }
                    if hung.load(Ordering::SeqCst) && hangs(&buf[..n]) {
                        while socket.read(&mut buf).await.is_ok_and(|n| n > 0) {}
                        return;
                    }
                    let body = "{\"choices\": []}";
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if socket.write_all(response.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, posts)
}

/// A hangable upstream named `a-stuck` (see [`hangable_upstream`]) and
/// an engine sim named `b-healthy`, both in the endpoints file of a
/// router config in a temporary directory named `name`.
pub struct StuckBesideHealthy {
    pub hung: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub posts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub healthy: Sim,
    pub dir: PathBuf,
    pub config: Config,
}

impl StuckBesideHealthy {
    pub async fn start(name: &str, hangs: fn(&[u8]) -> bool) -> Self {
        let hung = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (stuck, posts) = hangable_upstream(hung.clone(), hangs).await;
        let healthy = kvroute_engine_sim::start(SimConfig::test()).await.unwrap();
        let dir = temp_dir(name);
        std::fs::write(
            dir.join("endpoints.yaml"),
            format!(
                "endpoints:\n  - {{name: a-stuck, address: {stuck}}}\n  - {{name: b-healthy, address: {}}}\n",
                healthy.http_addr
            ),
        )
        .unwrap();
        let config = router_config(&dir);
        StuckBesideHealthy {
            hung,
            posts,
            healthy,
            dir,
            config,
        }
    }
}

/// The next proxied request a recording upstream saw, skipping health
/// checks and model listings.
pub async fn next_post(heads: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    loop {
        let head = heads.recv().await.unwrap();
        if head.starts_with("POST ") {
            return head;
        }
    }
}

/// The value of `header` in a raw HTTP request head.
pub fn header_of(head: &str, header: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(header).then(|| v.trim().to_owned())
    })
}

/// GET `url`'s body as JSON.
pub async fn get_json(url: &str) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// GET `url`'s body as text.
pub async fn get_text(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// The sum of every series of `family` in a Prometheus text `exposition`
/// (`family{...} value` lines; not `family_sum` and the like).
pub fn sum_of(exposition: &str, family: &str) -> f64 {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix(family))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The router's log lines, captured for this test's thread (the tests run
/// on a current-thread runtime, so spawned tasks log here too).
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    pub fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("kvroute_router=debug")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    pub fn count(&self, needle: &str) -> usize {
        let text = self.0.lock().unwrap();
        String::from_utf8_lossy(&text).matches(needle).count()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
