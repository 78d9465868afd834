//! Benchmark: latency of small requests while large prompts are in flight.
//!
//! The router runs on a 2-worker runtime, as on a 2-core pod; two engine
//! sims (no delays) run on a runtime of their own with 8 workers, so that
//! their parsing of large bodies does not stall the small requests they
//! serve (vLLM parses in its own process); the clients on a third. First
//! small chat completions alone, then the same while `LARGE` clients each
//! send `MIB`-MiB chat bodies back to back. Prints p50, p99 and max of the
//! small requests for both phases, and how many failed. On a 2-core
//! machine the sims' parsing competes for the same cores: compare runs
//! made on one machine, not absolute figures.
//!
//! ```sh
//! cargo run --release -p kvroute-router --example large_bodies [LARGE] [MIB]
//! ```

use std::time::{Duration, Instant};

use kvroute_router::config::{Config, Discovery, StaticDiscovery};
use serde_json::json;

const SMALL: usize = 1000;
const SMALL_CLIENTS: usize = 4;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("LARGE and MIB are numbers"))
        .collect();
    let large = args.first().copied().unwrap_or(20);
    let mib = args.get(1).copied().unwrap_or(30);
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sims = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(8)
        .enable_all()
        .build()
        .unwrap();
    let endpoints = sims.block_on(start_sims());
    let router = server.block_on(start_router(endpoints, mib));
    let clients = tokio::runtime::Runtime::new().unwrap();
    clients.block_on(async move {
        let url = format!("http://{router}/v1/chat/completions");
        let alone = small_requests(&url).await;
        let body = large_body(mib);
        let stop = tokio_util_stop();
        let senders: Vec<_> = (0..large)
            .map(|_| {
                let (url, body, stop) = (url.clone(), body.clone(), stop.clone());
                tokio::spawn(async move {
                    let client = reqwest::Client::new();
                    let mut sent = 0u32;
                    while !*stop.borrow() {
                        let r = client
                            .post(&url)
                            .header("content-type", "application/json")
                            .body(body.clone())
                            .send()
                            .await;
                        if let Ok(r) = r {
                            let _ = r.bytes().await;
                        }
                        sent += 1;
                    }
                    sent
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let loaded = small_requests(&url).await;
        stop.send_replace(true);
        let mut large_done = 0;
        for s in senders {
            large_done += s.await.unwrap();
        }
        println!("small chat completions ({SMALL}, {SMALL_CLIENTS} clients), milliseconds:");
        println!("| phase | p50 | p99 | max | failed |");
        println!("|---|---|---|---|---|");
        print_row("alone", &alone);
        print_row(
            &format!("with {large} clients sending {mib} MiB bodies ({large_done} sent)"),
            &loaded,
        );
    });
}

fn tokio_util_stop() -> std::sync::Arc<tokio::sync::watch::Sender<bool>> {
    std::sync::Arc::new(tokio::sync::watch::channel(false).0)
}

fn print_row(name: &str, (latencies, failed): &(Vec<Duration>, usize)) {
    let ms = |q: f64| {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies[i].as_secs_f64() * 1000.0
    };
    println!(
        "| {name} | {:.1} | {:.1} | {:.1} | {failed} |",
        ms(0.5),
        ms(0.99),
        ms(1.0)
    );
}

/// Latencies of the small requests, sorted, and how many failed.
async fn small_requests(url: &str) -> (Vec<Duration>, usize) {
    let client = reqwest::Client::new();
    let per_client = SMALL / SMALL_CLIENTS;
    let tasks = (0..SMALL_CLIENTS).map(|c| {
        let (client, url) = (client.clone(), url.to_owned());
        async move {
            let mut out = Vec::with_capacity(per_client);
            for i in 0..per_client {
                let body = json!({
                    "model": "kvroute-sim",
                    "messages": [{"role": "user", "content": format!("small request {c}-{i}")}],
                    "max_tokens": 1,
                });
                let start = Instant::now();
                let ok = match client.post(&url).json(&body).send().await {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                out.push((start.elapsed(), ok));
            }
            out
        }
    });
    let all: Vec<(Duration, bool)> = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .flatten()
        .collect();
    let failed = all.iter().filter(|(_, ok)| !ok).count();
    let mut latencies: Vec<Duration> = all.into_iter().map(|(d, _)| d).collect();
    latencies.sort();
    (latencies, failed)
}

fn large_body(mib: usize) -> bytes::Bytes {
    let mut text = String::with_capacity(mib << 20);
    let mut i = 0;
    while text.len() < mib << 20 {
        text.push_str(&format!("topic{i} sentence about caching and routing. "));
        i += 1;
    }
    let body = json!({
        "model": "kvroute-sim",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "go"}],
        "max_tokens": 1,
    });
    serde_json::to_vec(&body).unwrap().into()
}

/// Two sims, left running; their endpoints file.
async fn start_sims() -> String {
    let mut endpoints = String::from("endpoints:\n");
    for i in 0..2 {
        let mut c = kvroute_engine_sim::Config::test();
        c.max_model_len = 1 << 26;
        c.num_gpu_blocks = 1 << 20;
        let sim = kvroute_engine_sim::start(c).await.unwrap();
        endpoints += &format!("  - name: sim-{i}\n    address: {}\n", sim.http_addr);
        std::mem::forget(sim);
    }
    endpoints
}

/// A router over `endpoints`, left running; its address.
async fn start_router(endpoints: String, mib: usize) -> std::net::SocketAddr {
    let dir = std::env::temp_dir().join(format!("kvroute-large-bodies-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("endpoints.yaml"), endpoints).unwrap();
    let mut config = Config {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    config.discovery = Discovery::Static(StaticDiscovery::file(dir.join("endpoints.yaml")));
    config.limits.max_body_bytes = (mib + 1) << 20;
    // The worst case: large prompts are tokenized, not skipped.
    config.limits.max_tokenize_bytes = config.limits.max_body_bytes;
    let running = kvroute_router::start(config).await.unwrap();
    let addr = running.addr();
    std::mem::forget(running);
    addr
}
