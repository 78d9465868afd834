//! The agent against a scripted vLLM: load and capacity from `/metrics`, a
//! restart seen through `/health`, and data-parallel ranks on consecutive
//! ports, each served as its own endpoint.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvroute_proto::v1::cache_reporter_client::CacheReporterClient;
use kvroute_proto::v1::{CacheUpdate, WatchCacheRequest, cache_update::Update};
use rmpv::Value;
use tonic::Streaming;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// A vLLM's HTTP side: `/health` as `healthy` says (counting its failed
/// answers in `failures`), `/metrics` with a 1,000-block cache and rank 0
/// and 1's queues.
async fn fake_vllm(healthy: Arc<AtomicBool>, failures: Arc<AtomicUsize>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route(
            "/health",
            axum::routing::get(move || {
                let ok = healthy.load(Ordering::Relaxed);
                if !ok {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                async move {
                    if ok {
                        axum::http::StatusCode::OK
                    } else {
                        axum::http::StatusCode::SERVICE_UNAVAILABLE
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(|| async {
                "# TYPE vllm:num_requests_waiting gauge\n\
                 vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
                 vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 7.0\n\
                 vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
                 vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
                 vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0\n\
                 vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"1000\"} 1.0\n"
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn subscribe(addr: std::net::SocketAddr) -> Streaming<CacheUpdate> {
    let mut client = CacheReporterClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    client
        .watch_cache(WatchCacheRequest::default())
        .await
        .unwrap()
        .into_inner()
}

async fn next(stream: &mut Streaming<CacheUpdate>) -> CacheUpdate {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a message within 10 s")
        .unwrap()
        .expect("the stream is open")
}

async fn ready(agent: &kvroute_agent::Agent) {
    for _ in 0..500 {
        if agent.ranks.iter().all(|r| r.not_ready().is_none()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "never ready: {:?}",
        agent
            .ranks
            .iter()
            .map(|r| r.not_ready())
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn load_comes_from_metrics_and_a_health_recovery_is_a_restart() {
    let healthy = Arc::new(AtomicBool::new(true));
    let failures = Arc::new(AtomicUsize::new(0));
    let url = fake_vllm(healthy.clone(), failures.clone()).await;
    // A publisher that stays quiet: the quiet period makes the rank ready.
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let agent = kvroute_agent::start(kvroute_agent::Config::loopback(endpoint.to_string(), url))
        .await
        .unwrap();
    ready(&agent).await;
    let mut stream = subscribe(agent.cache_addrs[0]).await;
    let first = next(&mut stream).await;
    let Some(Update::Snapshot(s)) = &first.update else {
        panic!("{first:?}")
    };
    assert_eq!(s.config.as_ref().unwrap().capacity_blocks, 1000);
    let load = loop {
        if let Some(Update::Load(l)) = next(&mut stream).await.update {
            break l;
        }
    };
    // One rank followed: the whole server's queue (both engines' samples).
    assert_eq!((load.waiting, load.running, load.used_blocks), (10, 2, 500));
    assert_eq!(load.queued_prefill_tokens, None, "no prompt histogram");

    healthy.store(false, Ordering::Relaxed);
    kvroute_testkit::eventually(
        "the agent sees /health fail",
        Duration::from_secs(10),
        || {
            let seen = failures.load(Ordering::Relaxed) > 0;
            async move { seen.then_some(()) }
        },
    )
    .await;
    healthy.store(true, Ordering::Relaxed);
    // The restart ends the stream; a new subscription sees a new incarnation.
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .unwrap()
    {}
    let mut again = subscribe(agent.cache_addrs[0]).await;
    assert_ne!(next(&mut again).await.incarnation, first.incarnation);
    agent.shutdown().await;
}

/// Two PUB sockets on consecutive ports, and two free consecutive ports for
/// the agent's WatchCache listeners.
async fn consecutive() -> (Vec<zeromq::PubSocket>, u16, u16) {
    for _ in 0..50 {
        let base = 20_000 + (std::process::id() as u16 % 20_000) + fastrand_port();
        let mut sockets = Vec::new();
        for r in 0..2 {
            let mut s = zeromq::PubSocket::new();
            if s.bind(&format!("tcp://127.0.0.1:{}", base + r))
                .await
                .is_err()
            {
                break;
            }
            sockets.push(s);
        }
        let listen = base + 2;
        let free = (0..2).all(|r| std::net::TcpListener::bind(("127.0.0.1", listen + r)).is_ok());
        if sockets.len() == 2 && free {
            return (sockets, base, listen);
        }
    }
    panic!("no consecutive free ports");
}

fn fastrand_port() -> u16 {
    (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        % 10_000) as u16
}

fn stored(hashes: &[u64]) -> Bytes {
    let event = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(Vec::new())),
        (Value::from("block_size"), Value::from(16)),
    ]);
    let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event])]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    Bytes::from(out)
}

#[tokio::test]
async fn each_data_parallel_rank_is_its_own_endpoint() {
    let url = fake_vllm(Arc::new(AtomicBool::new(true)), Arc::default()).await;
    let (mut publishers, base, listen) = consecutive().await;
    let mut config = kvroute_agent::Config::loopback(format!("tcp://127.0.0.1:{base}"), url);
    config.data_parallel_size = 2;
    config.listen = format!("127.0.0.1:{listen}").parse().unwrap();
    let agent = kvroute_agent::start(config).await.unwrap();
    ready(&agent).await;
    assert_eq!(
        agent
            .cache_addrs
            .iter()
            .map(|a| a.port())
            .collect::<Vec<_>>(),
        [listen, listen + 1]
    );
    // Rank r publishes block 100 + r (until the agent has it: PUB drops
    // what it sends before the subscription reaches it).
    for (r, publisher) in publishers.iter_mut().enumerate() {
        for _ in 0..200 {
            let frames = vec![
                Bytes::new(),
                Bytes::copy_from_slice(&0u64.to_be_bytes()),
                stored(&[100 + r as u64]),
            ];
            publisher
                .send(ZmqMessage::try_from(frames).unwrap())
                .await
                .unwrap();
            if !agent.ranks[r].stats().0.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for r in 0..2 {
        let mut stream = subscribe(agent.cache_addrs[r]).await;
        let Some(Update::Snapshot(s)) = next(&mut stream).await.update else {
            panic!("a snapshot first")
        };
        assert_eq!(s.block_hashes, [100 + r as u64], "rank {r}");
        let load = loop {
            if let Some(Update::Load(l)) = next(&mut stream).await.update {
                break l;
            }
        };
        assert_eq!(load.waiting, [3, 7][r], "rank {r}'s own queue");
    }
    agent.shutdown().await;
}
