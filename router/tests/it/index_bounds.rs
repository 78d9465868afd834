//! Issue #30, item 4: an engine that claims a huge cache and floods fresh
//! block hashes, on the GPU and then on an offloaded medium, cannot make
//! the router hold more than its own bounds. The router binary runs as a
//! child process, so its peak memory is its own (`/proc/<pid>/status`); the
//! bounds are small here so that a debug build floods past them quickly.
//! Linux only: elsewhere the test prints a skip message and passes.

use crate::support::child;
use crate::support::fake_cache;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::support::{chat, spawn_router, temp_dir};
use child::memory_kb;
use fake_cache::{Attack, FakeCache};

/// The router's bound per endpoint and tier in this test.
const BOUND: u64 = 100_000;
/// Hashes per flooding message, and messages per tier.
const PER_MESSAGE: usize = 20_000;
const MESSAGES: usize = 125;

/// The value of the series `series` (name and labels, as exposed).
fn value(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

struct Client {
    http: reqwest::Client,
    listen: SocketAddr,
    admin: SocketAddr,
}

impl Client {
    async fn metrics(&self) -> String {
        let url = format!("http://{}/metrics", self.admin);
        match self.http.get(url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Sends a small chat and returns the endpoint that served it.
    async fn chat(&self, i: usize) -> String {
        let r = self
            .http
            .post(format!("http://{}/v1/chat/completions", self.listen))
            .json(&chat(&format!("Short system prompt number {i}."), "hi", 2))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.headers()["x-kvroute-endpoint"]
            .to_str()
            .unwrap()
            .to_owned()
    }

    /// Polls `/metrics` until `done` holds of it, sending small chats in
    /// between (each must succeed); returns the exposition and the
    /// endpoints that served the chats.
    async fn chat_until(&self, what: &str, done: impl Fn(&str) -> bool) -> (String, Vec<String>) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut served = Vec::new();
        loop {
            let text = self.metrics().await;
            if done(&text) {
                return (text, served);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "never: {what}; metrics:\n{text}"
            );
            served.push(self.chat(served.len()).await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_engine_is_held_to_the_routers_bounds() {
    if !Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc/self/status to read peak memory from");
        return;
    }
    let honest = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    // The hostile endpoint's HTTP API is a sim; its WatchCache is the fake.
    let serving = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let fake = FakeCache::start(honest.engine.cache_config()).await;
    let dir = temp_dir("index-bounds");
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!(
            "endpoints:\n\
             \x20 - name: honest\n    address: {}\n    cachePort: {}\n\
             \x20 - name: hostile\n    address: {}\n    cachePort: {}\n",
            honest.http_addr,
            honest.cache_addr.port(),
            serving.http_addr,
            fake.addr.port()
        ),
    )
    .unwrap();
    let yaml = format!(
        "discovery:\n  static:\n    file: {}\n    reloadMs: 100\n\
         limits:\n  maxIndexBlocksPerEndpoint: {BOUND}\n  maxOffloadedBlocksPerEndpoint: {BOUND}\n",
        dir.join("endpoints.yaml").display()
    );
    let (router, listen, admin) = spawn_router(&dir, &yaml);
    let log = dir.join("router.log");
    let pid = router.0.id();
    let client = Client {
        http: reqwest::Client::new(),
        listen,
        admin,
    };
    let live = |text: &str| {
        ["honest", "hostile"].iter().all(|e| {
            value(
                text,
                &format!("kvroute_watch_cache_stream{{endpoint=\"{e}\",state=\"live\"}}"),
            ) == Some(1.0)
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !live(&client.metrics().await) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the streams never went live; the router's log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    client.chat(0).await;
    let (_, baseline_rss) = memory_kb(pid);

    let flooded = (PER_MESSAGE * MESSAGES) as u64;
    let mut served = Vec::new();
    for (medium, label) in [("", "gpu"), ("CPU", "offloaded")] {
        fake.attack(Attack::Flood {
            medium: medium.into(),
            per_message: PER_MESSAGE,
            messages: MESSAGES,
        });
        let dropped = format!("kvroute_index_dropped_blocks_total{{medium=\"{label}\"}}");
        let (text, chats) = client
            .chat_until(&format!("the {label} flood is dropped"), |text| {
                value(text, &dropped).is_some_and(|d| d >= (flooded - BOUND) as f64)
            })
            .await;
        served.extend(chats);
        let entries = value(
            &text,
            &format!("kvroute_index_entries{{medium=\"{label}\"}}"),
        )
        .unwrap();
        // The honest sim's few blocks of small chats come on top (GPU).
        assert!(
            entries <= (BOUND + 10_000) as f64,
            "{label}: {entries} entries"
        );
        assert!(entries >= BOUND as f64, "{label}: filled to its bound");
        assert_eq!(value(&text, &dropped), Some((flooded - BOUND) as f64));
    }
    // Routing goes on, to the other endpoint too: every chat shares the
    // chat template's first block, so while one the router sent the
    // flooding endpoint is in flight (never reported: the fake reports
    // only its flood) the next follow it there, for one window of at most
    // the predicted first token plus `maxReportAgeMs`.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut i = 1000;
    while !served.iter().any(|e| e == "honest") {
        assert!(tokio::time::Instant::now() < deadline, "{served:?}");
        served.push(client.chat(i).await);
        i += 1;
    }
    assert!(
        value(
            &client.metrics().await,
            "kvroute_watch_cache_stream{endpoint=\"hostile\",state=\"live\"}"
        ) == Some(1.0),
        "the flooding engine was not resynced: its stream stayed live"
    );

    let (peak, _) = memory_kb(pid);
    let rise_mib = peak.saturating_sub(baseline_rss) / 1024;
    eprintln!(
        "router memory: {baseline_rss} kB before the floods, peak {peak} kB (+{rise_mib} MiB) after {} fresh blocks",
        2 * flooded
    );
    // Unbounded, 5 million entries would cost ~250-300 MiB.
    assert!(rise_mib <= 150, "peak rose by {rise_mib} MiB");
    drop(router);
    honest.shutdown().await;
    serving.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
