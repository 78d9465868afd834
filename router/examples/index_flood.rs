//! Benchmark: routing while one engine floods the router's occupancy index
//! (issue #30, item 4), with the router's default limits.
//!
//! The router binary runs as a child process (its peak memory is its own,
//! `VmHWM`); two engine sims serve chats, and a fake WatchCache server
//! (`tests/it/support/fake_cache.rs`) announces 2^62 blocks for one of them.
//! Four clients send small chats back to back: first for 5 s alone, then
//! during the attack. Prints p50, p99 and max of the chats in both phases,
//! the index's entries and drops per tier, and the router's peak memory.
//!
//! - `snapshot [BLOCKS]`: one snapshot of BLOCKS fresh hashes (default 25
//!   million, under the 256 MiB message cap); the attack phase lasts until
//!   the router has applied it.
//! - `flood gpu|cpu [SECONDS]`: `BlocksStored` of fresh hashes, 10,000 a
//!   message, on the GPU or on medium `CPU`, for SECONDS (default 15).
//!
//! ```sh
//! cargo build --release -p kvroute-router --bin kvroute-router --example index_flood
//! target/release/examples/index_flood snapshot
//! target/release/examples/index_flood flood gpu
//! ```

#[path = "../tests/it/support/child.rs"]
mod child;
#[path = "../tests/it/support/fake_cache.rs"]
mod fake_cache;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use child::memory_kb;
use fake_cache::{Attack, FakeCache};
use serde_json::json;

const CLIENTS: usize = 4;

fn value(exposition: &str, series: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn metrics(admin: SocketAddr) -> String {
    match reqwest::get(format!("http://{admin}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Small chats from `CLIENTS` clients until `stop`; latencies, ms, and
/// failures.
async fn chats(listen: SocketAddr, stop: Arc<AtomicBool>) -> (Vec<f64>, usize) {
    let url = format!("http://{listen}/v1/chat/completions");
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let (mut times, mut failed) = (Vec::new(), 0);
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let body = json!({
                        "model": "kvroute-sim",
                        "messages": [
                            {"role": "system", "content": format!("Client {c}, chat {i}: be brief.")},
                            {"role": "user", "content": "hi"},
                        ],
                        "max_tokens": 2,
                    });
                    let start = Instant::now();
                    match client.post(&url).json(&body).send().await {
                        Ok(r) if r.status() == 200 => {
                            let _ = r.bytes().await;
                            times.push(start.elapsed().as_secs_f64() * 1000.0);
                        }
                        _ => failed += 1,
                    }
                }
                (times, failed)
            })
        })
        .collect();
    let (mut all, mut failed) = (Vec::new(), 0);
    for t in tasks {
        let (times, f) = t.await.unwrap();
        all.extend(times);
        failed += f;
    }
    (all, failed)
}

fn summary(name: &str, mut ms: Vec<f64>, failed: usize, seconds: f64) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms.get(((ms.len() as f64 * q) as usize).min(ms.len().saturating_sub(1)));
    println!(
        "{name:<8} {:>6} chats in {seconds:>5.1} s, {failed} failed; p50 {:>7.1} ms, p99 {:>7.1} ms, max {:>7.1} ms",
        ms.len(),
        at(0.5).copied().unwrap_or(0.0),
        at(0.99).copied().unwrap_or(0.0),
        ms.last().copied().unwrap_or(0.0),
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map_or("snapshot", String::as_str).to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(mode, args));
}

async fn run(mode: String, args: Vec<String>) {
    let attack = match mode.as_str() {
        "snapshot" => Attack::Snapshot {
            blocks: args
                .get(1)
                .map_or(25_000_000, |a| a.parse().expect("BLOCKS")),
        },
        "flood" => Attack::Flood {
            medium: match args.get(1).map(String::as_str) {
                Some("cpu") => "CPU".into(),
                _ => String::new(),
            },
            per_message: 10_000,
            messages: usize::MAX,
        },
        _ => panic!("usage: index_flood snapshot [BLOCKS] | flood gpu|cpu [SECONDS]"),
    };
    let seconds: u64 = args.get(2).map_or(15, |a| a.parse().expect("SECONDS"));
    let a = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let b = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let fake = FakeCache::start(a.engine.cache_config()).await;
    let dir = std::env::temp_dir().join(format!("kvroute-index-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!(
            "endpoints:\n\
             \x20 - name: sim-a\n    address: {}\n    cachePort: {}\n\
             \x20 - name: sim-b\n    address: {}\n    cachePort: {}\n\
             \x20 - name: hostile\n    address: {}\n    cachePort: {}\n",
            a.http_addr,
            a.cache_addr.port(),
            b.http_addr,
            b.cache_addr.port(),
            b.http_addr,
            fake.addr.port()
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("router.yaml"),
        format!(
            "listen: 127.0.0.1:0\nadminListen: 127.0.0.1:0\n\
             discovery:\n  static:\n    file: {}\n    reloadMs: 1000\n\
             telemetry:\n  logFormat: text\n",
            dir.join("endpoints.yaml").display()
        ),
    )
    .unwrap();
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("kvroute-router");
    assert!(
        binary.exists(),
        "{} is missing: build it (see the module docs)",
        binary.display()
    );
    let (router, listen, admin) =
        child::spawn(&binary, &dir.join("router.yaml"), &dir.join("router.log"));
    let pid = router.0.id();
    let live = |text: &str| {
        ["sim-a", "sim-b", "hostile"].iter().all(|e| {
            value(
                text,
                &format!("kvroute_watch_cache_stream{{endpoint=\"{e}\",state=\"live\"}}"),
            ) == 1.0
        })
    };
    while !live(&metrics(admin).await) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let alone = tokio::spawn(chats(listen, stop.clone()));
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    let (ms, failed) = alone.await.unwrap();
    summary("alone", ms, failed, started.elapsed().as_secs_f64());
    let peak_before = peak_mib_of(pid);

    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let during = tokio::spawn(chats(listen, stop.clone()));
    fake.attack(attack.clone());
    match attack {
        Attack::Snapshot { blocks } => {
            // Until every block is indexed or counted as dropped.
            loop {
                let text = metrics(admin).await;
                let seen = value(&text, "kvroute_index_dropped_blocks_total{medium=\"gpu\"}")
                    + value(&text, "kvroute_index_entries{medium=\"gpu\"}");
                if seen >= blocks as f64 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Attack::Flood { .. } => tokio::time::sleep(Duration::from_secs(seconds)).await,
    }
    stop.store(true, Ordering::Relaxed);
    let (ms, failed) = during.await.unwrap();
    summary(&mode, ms, failed, started.elapsed().as_secs_f64());
    let text = metrics(admin).await;
    for medium in ["gpu", "offloaded"] {
        println!(
            "{medium:<9} entries {:>10}, dropped {:>11}",
            value(
                &text,
                &format!("kvroute_index_entries{{medium=\"{medium}\"}}")
            ),
            value(
                &text,
                &format!("kvroute_index_dropped_blocks_total{{medium=\"{medium}\"}}")
            ),
        );
    }
    println!(
        "sent {} blocks in {} messages; router peak RSS {:.0} MiB before the attack, {:.0} MiB after",
        fake.sent.load(Ordering::Relaxed),
        fake.messages.load(Ordering::Relaxed),
        peak_before,
        peak_mib_of(pid),
    );
    drop(router);
    let _ = std::fs::remove_dir_all(dir);
}

/// `VmHWM` of `pid`, MiB.
fn peak_mib_of(pid: u32) -> f64 {
    memory_kb(pid).0 as f64 / 1024.0
}
