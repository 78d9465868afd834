//! WatchCache over gRPC: what a router's subscriber receives.

use std::time::Duration;

use kvroute_engine_sim::{Config, start};
use kvroute_proto::v1::cache_reporter_client::CacheReporterClient;
use kvroute_proto::v1::{CacheUpdate, HashAlgorithm, WatchCacheRequest, cache_update::Update};
use kvroute_proto::{SequenceCheck, Verdict};
use serde_json::json;
use tonic::Streaming;

async fn watch(addr: std::net::SocketAddr) -> Streaming<CacheUpdate> {
    // Small HTTP/2 windows, so a subscriber that stops reading makes the
    // engine's buffer fill soon instead of after megabytes in transit.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(1024)
        .initial_connection_window_size(1024)
        .connect()
        .await
        .unwrap();
    let mut client = CacheReporterClient::new(channel);
    client
        .watch_cache(WatchCacheRequest {
            subscriber: "test".into(),
        })
        .await
        .unwrap()
        .into_inner()
}

async fn complete(http: std::net::SocketAddr, prompt: &str) {
    let r = reqwest::Client::new()
        .post(format!("http://{http}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The next message, failing the test after 10 s.
async fn next(stream: &mut Streaming<CacheUpdate>) -> Option<CacheUpdate> {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("no message within 10 s")
        .unwrap()
}

/// The next update that is not a load report.
async fn next_change(
    stream: &mut Streaming<CacheUpdate>,
    check: &mut SequenceCheck,
) -> CacheUpdate {
    loop {
        let u = next(stream).await.expect("stream open");
        assert_eq!(check.observe(&u), Verdict::Apply, "{u:?}");
        if !matches!(u.update, Some(Update::Load(_))) {
            return u;
        }
    }
}

#[tokio::test]
async fn snapshot_then_ordered_deltas_and_load() {
    let mut config = Config::test();
    config.load_interval_ms = 20;
    config.num_gpu_blocks = 64;
    let sim = start(config).await.unwrap();
    complete(
        sim.http_addr,
        &"warm up the cache with a prompt. ".repeat(10),
    )
    .await;
    let mut stream = watch(sim.cache_addr).await;
    let mut check = SequenceCheck::new();
    let first = next(&mut stream).await.unwrap();
    assert_eq!(check.observe(&first), Verdict::Apply);
    let Some(Update::Snapshot(snap)) = &first.update else {
        panic!("first message must be a snapshot: {first:?}")
    };
    let config = snap.config.as_ref().unwrap();
    assert_eq!(config.block_size, 16);
    assert_eq!(config.capacity_blocks, 64);
    assert_eq!(config.hash_algorithm(), HashAlgorithm::Sha256);
    assert!(!config.hash_seed_set);
    // vLLM's NONE_HASH for the default algorithm and no seed.
    let default_hasher =
        kvroute_core::hash::BlockHasher::new(kvroute_core::hash::HashConfig::default()).unwrap();
    assert_eq!(config.none_hash, Some(default_hasher.none_hash().to_u64()));
    assert_eq!(config.model, "kvroute-sim");
    let mut resident: Vec<u64> = sim.engine.resident();
    let mut snapshot = snap.block_hashes.clone();
    resident.sort_unstable();
    snapshot.sort_unstable();
    assert_eq!(snapshot, resident);
    assert!(!snapshot.is_empty());

    complete(
        sim.http_addr,
        &"a different prompt, long enough to fill blocks. ".repeat(4),
    )
    .await;
    let stored = next_change(&mut stream, &mut check).await;
    assert_eq!(stored.sequence, first.sequence + 1);
    let Some(Update::Stored(s)) = stored.update else {
        panic!("{stored:?}")
    };
    assert!(!s.block_hashes.is_empty());
    assert_eq!(s.parent_block_hash, None, "a chain from block 0");

    // Load reports keep coming, at the current sequence, and show the
    // engine idle again (one sent on the request's arrival may show it
    // running).
    loop {
        let u = next(&mut stream).await.unwrap();
        assert_eq!(check.observe(&u), Verdict::Apply);
        if let Some(Update::Load(load)) = u.update
            && load.running == 0
        {
            break;
        }
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn an_arrival_is_reported_at_once_not_an_interval_later() {
    let mut config = Config::test();
    config.load_interval_ms = 600_000;
    config.prefill_tokens_per_s = 20.0; // a few seconds of prefill
    let sim = start(config).await.unwrap();
    let mut stream = watch(sim.cache_addr).await;
    let first = next(&mut stream).await.unwrap();
    assert!(matches!(first.update, Some(Update::Snapshot(_))));
    let http = sim.http_addr;
    let request = tokio::spawn(async move { complete(http, &"slow prefill ".repeat(8)).await });
    // The interval's first tick (at start) may also reach the subscriber,
    // from before the request: skip reports of an idle engine. Without a
    // report on arrival the next would come an interval (10 min) later,
    // and `next` gives up after 10 s.
    let load = loop {
        let u = next(&mut stream).await.unwrap();
        if let Some(Update::Load(load)) = u.update
            && load.running > 0
        {
            break load;
        }
    };
    assert_eq!(load.running, 1, "{load:?}");
    assert!(load.queued_prefill_tokens.unwrap() > 0, "{load:?}");
    request.abort();
    sim.shutdown().await;
}

#[tokio::test]
async fn a_restart_ends_streams_and_starts_a_new_incarnation() {
    let sim = start(Config::test()).await.unwrap();
    let mut stream = watch(sim.cache_addr).await;
    let first = next(&mut stream).await.unwrap();
    sim.engine.restart_cache();
    // The old stream ends (after any queued messages).
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while stream.message().await.ok().flatten().is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "the stream must end");
    let mut again = watch(sim.cache_addr).await;
    let second = next(&mut again).await.unwrap();
    assert_ne!(second.incarnation, first.incarnation);
    let mut check = SequenceCheck::new();
    assert_eq!(check.observe(&first), Verdict::Apply);
    assert!(
        matches!(check.observe(&second), Verdict::Apply),
        "a snapshot is always accepted"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_subscriber_that_falls_behind_is_cut_off() {
    let mut config = Config::test();
    config.subscriber_buffer = 4;
    config.load_interval_ms = 1;
    let sim = start(config).await.unwrap();
    let mut stream = watch(sim.cache_addr).await;
    assert!(next(&mut stream).await.is_some());
    // Don't read: reports pile up past the buffer (and past what the
    // transport buffers), so the engine drops the subscriber.
    let dropped = tokio::time::timeout(Duration::from_secs(10), async {
        while sim.engine.subscribers() > 0 {
            complete(
                sim.http_addr,
                "some prompt long enough to store a block or two of tokens",
            )
            .await;
        }
    })
    .await;
    assert!(dropped.is_ok(), "the slow subscriber was never dropped");
    sim.shutdown().await;
}
