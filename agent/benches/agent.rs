//! How many KV events one `kvroute-agent` process sustains, and its memory
//! with a million resident blocks.
//!
//! `cargo bench -p kvroute-agent --bench agent` starts the release agent
//! binary, a ZMQ PUB socket publishing vLLM-format batches (tagged
//! `BlockStored` events of 16 blocks with their tokens, as vLLM sends them,
//! and as many `BlockRemoved` once the cache is full), a fake vLLM
//! `/metrics` and `/health`, and one WatchCache subscriber draining the
//! agent's stream, as a router does. It prints the events applied per
//! second (from the agent's own counters) and the agent's resident memory.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_core::hash::{BlockExtras, BlockHasher, HashConfig};
use kvroute_proto::v1::WatchCacheRequest;
use kvroute_proto::v1::cache_reporter_client::CacheReporterClient;
use rmpv::Value;
use zeromq::{Socket, SocketSend, ZmqMessage};

const BLOCKS: u64 = 1 << 20;
const PER_EVENT: u64 = 16;
const EVENTS_PER_BATCH: u64 = 8;
const BLOCK_SIZE: usize = 16;

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

/// Event `e`'s chain: `PER_EVENT` blocks of tokens of its own, hashed as
/// vLLM does by default (sha256, no seed), so the agent's verification
/// recomputes and checks every one.
fn chain(hasher: &BlockHasher, e: u64) -> (Vec<u64>, Vec<u32>) {
    let n = PER_EVENT as usize * BLOCK_SIZE;
    let tokens: Vec<u32> = (0..n).map(|t| (e as usize * n + t) as u32).collect();
    (hasher.hashes(&tokens, BlockExtras::default()), tokens)
}

/// Batch `b`: `EVENTS_PER_BATCH` chains stored, and once the cache is full
/// the chains stored `BLOCKS` blocks earlier removed.
fn batch(hasher: &BlockHasher, b: u64) -> Vec<u8> {
    let mut events = Vec::new();
    for e in b * EVENTS_PER_BATCH..(b + 1) * EVENTS_PER_BATCH {
        let (hashes, tokens) = chain(hasher, e);
        events.push(map(vec![
            ("type", Value::from("BlockStored")),
            (
                "block_hashes",
                Value::Array(hashes.into_iter().map(Value::from).collect()),
            ),
            ("parent_block_hash", Value::Nil),
            (
                "token_ids",
                Value::Array(tokens.into_iter().map(Value::from).collect()),
            ),
            ("block_size", Value::from(BLOCK_SIZE as u32)),
            ("lora_id", Value::Nil),
            ("medium", Value::from("GPU")),
        ]));
        if let Some(old) = e.checked_sub(BLOCKS / PER_EVENT) {
            let (hashes, _) = chain(hasher, old);
            events.push(map(vec![
                ("type", Value::from("BlockRemoved")),
                (
                    "block_hashes",
                    Value::Array(hashes.into_iter().map(Value::from).collect()),
                ),
                ("medium", Value::from("GPU")),
            ]));
        }
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(0.0), Value::Array(events), Value::from(0)]),
    )
    .unwrap();
    out
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// The sum of `family`'s samples, read with the agent's own parser.
fn counter(text: &str, family: &str) -> f64 {
    text.lines()
        .filter_map(kvroute_telemetry::metrics::parse_line)
        .filter(|s| s.name == family)
        .map(|s| s.value)
        .sum()
}

async fn metrics(admin: &str) -> String {
    match reqwest::get(format!("http://{admin}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::main]
async fn main() {
    // A fake vLLM: /health and /metrics with a 2M-block cache.
    let vllm = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let vllm_addr = vllm.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "" }))
        .route(
            "/metrics",
            axum::routing::get(|| async {
                format!("vllm:cache_config_info{{block_size=\"{BLOCK_SIZE}\",num_gpu_blocks=\"{}\"}} 1.0\nvllm:num_requests_running 0\n", 2 * BLOCKS)
            }),
        );
    tokio::spawn(async move { axum::serve(vllm, app).await.unwrap() });

    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let (listen, admin) = (free_port(), free_port());
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-agent"))
        .args(["--kv-events-endpoint", &endpoint])
        .args(["--engine-url", &format!("http://{vllm_addr}")])
        .args(["--listen", &format!("127.0.0.1:{listen}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--block-size", &BLOCK_SIZE.to_string()])
        .args(["--quiet-period-ms", "100"])
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("the agent binary runs");
    let pid = agent.id();
    let admin = format!("127.0.0.1:{admin}");
    let ready = Instant::now();
    while !reqwest::get(format!("http://{admin}/readyz"))
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            ready.elapsed() < Duration::from_secs(20),
            "the agent never got ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idle_kb = rss_kb(pid);

    // One subscriber draining the stream, as a router does.
    let mut client = CacheReporterClient::connect(format!("http://127.0.0.1:{listen}"))
        .await
        .unwrap();
    let mut stream = client
        .watch_cache(WatchCacheRequest {
            subscriber: "bench".into(),
        })
        .await
        .unwrap()
        .into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = stream.message().await {} });

    // Fill to 1M blocks, then keep churning: each batch stores 128 blocks
    // and removes 128. Paced in rounds so the PUB socket never drops.
    let per_batch = EVENTS_PER_BATCH * PER_EVENT;
    let total_batches = 3 * BLOCKS / per_batch;
    let round = 256u64;
    let hasher = BlockHasher::new(HashConfig {
        block_size: BLOCK_SIZE,
        ..HashConfig::default()
    })
    .unwrap();
    let payloads: Vec<Bytes> = (0..total_batches)
        .map(|b| Bytes::from(batch(&hasher, b)))
        .collect();
    let mut full_kb = 0;
    let start = Instant::now();
    let mut seq = 0u64;
    for chunk in payloads.chunks(round as usize) {
        for payload in chunk {
            let frames = vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            publisher
                .send(ZmqMessage::try_from(frames).unwrap())
                .await
                .unwrap();
            seq += 1;
        }
        // Wait for the agent to apply this round before the next.
        loop {
            let text = metrics(&admin).await;
            if counter(&text, "kvroute_agent_batches_total") as u64 >= seq {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if seq * per_batch == BLOCKS {
            full_kb = rss_kb(pid);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let text = metrics(&admin).await;
    let events = counter(&text, "kvroute_agent_events_total") as u64;
    let resident = counter(&text, "kvroute_agent_resident_blocks") as u64;
    let missed = counter(&text, "kvroute_agent_missed_batches_total") as u64;
    let verified = counter(&text, "kvroute_agent_hash_verification_blocks_total") as u64;
    let after_kb = rss_kb(pid);
    println!(
        "kvroute-agent: {seq} batches, {events} events ({} blocks stored) in {elapsed:.2} s",
        seq * per_batch
    );
    println!(
        "  events applied per second: {:.0} ({:.0} blocks/s); batches missed: {missed}",
        events as f64 / elapsed,
        (seq * per_batch) as f64 / elapsed
    );
    println!("  blocks checked by hash verification: {verified}");
    println!(
        "  resident blocks: {resident}; RSS idle {} MB, at 1M blocks {} MB, after churn {} MB",
        idle_kb / 1024,
        full_kb / 1024,
        after_kb / 1024
    );
    let _ = agent.kill();
    let _ = agent.wait();
}
