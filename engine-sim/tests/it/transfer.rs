//! Disaggregated prefill between two simulators, with vLLM's
//! `kv_transfer_params`: a producer holds a prefill's blocks, a consumer
//! reads them over a real connection, and falls back to its own prefill
//! when it cannot.

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_engine_sim::Sim;
use kvroute_engine_sim::transfer::Role;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http::{metric, post, sim};

fn prompt() -> String {
    "Disaggregated prefill moves the prompt's blocks between engines. ".repeat(6)
}

/// The client's request.
fn request() -> Value {
    json!({"model": "kvroute-sim", "prompt": prompt(), "max_tokens": 4})
}

/// vLLM's proxy's prefill leg for `request()`.
fn prefill_leg() -> Value {
    let mut body = request();
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    body["stream"] = json!(false);
    body["max_tokens"] = json!(1);
    body
}

async fn transfers(sim: &Sim, result: &str) -> f64 {
    metric(
        sim,
        &format!("kvroute_sim_kv_transfers_total{{result=\"{result}\"}}"),
    )
    .await
}

async fn kv_usage(sim: &Sim) -> f64 {
    metric(sim, "vllm:kv_cache_usage_perc{model_name=\"kvroute-sim\"}").await
}

/// Polls `check` until it holds (at most 10 s).
async fn until<F: Future<Output = bool>>(mut check: impl FnMut() -> F) {
    for _ in 0..1000 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the condition never held");
}

#[tokio::test]
async fn a_consumer_reads_a_producers_blocks_and_caches_them() {
    let producer = sim(|c| c.kv_role = Role::Producer).await;
    let consumer = sim(|c| c.kv_role = Role::Consumer).await;

    let (status, answer) = post(&producer, "/v1/completions", prefill_leg()).await;
    assert_eq!(status, 200, "{answer}");
    let params = answer["kv_transfer_params"].clone();
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = prompt_tokens.div_ceil(16);
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], producer.transfer_addr.port());
    assert_eq!(params["remote_engine_id"], producer.engine.engine_id());
    assert_eq!(
        params["remote_block_ids"].as_array().unwrap().len() as u64,
        blocks
    );
    assert!(kv_usage(&producer).await > 0.0, "the blocks are held");

    let mut decode = request();
    decode["kv_transfer_params"] = params.clone();
    let (status, done) = post(&consumer, "/v1/completions", decode.clone()).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"]["completion_tokens"], 4);
    assert_eq!(
        done["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1,
        "all but the last token loaded"
    );
    assert_eq!(transfers(&consumer, "ok").await, 1.0);
    assert_eq!(kv_usage(&producer).await, 0.0, "freed once read");
    let producer_blocks = producer.engine.resident();
    assert_eq!(
        consumer.engine.resident().len(),
        producer_blocks.len(),
        "the consumer caches the prompt's full blocks (its output fills none)"
    );
    assert!(
        producer_blocks
            .iter()
            .all(|h| consumer.engine.resident().contains(h))
    );

    // Read once: the same leg again fails and the consumer serves it from
    // its own cache now.
    let (status, again) = post(&consumer, "/v1/completions", decode).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(transfers(&consumer, "failed").await, 1.0);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        (prompt_tokens - 1) / 16 * 16
    );
    producer.shutdown().await;
    consumer.shutdown().await;
}

#[tokio::test]
async fn an_unread_hold_expires_and_the_consumer_prefills_itself() {
    let producer = sim(|c| {
        c.kv_role = Role::Producer;
        c.kv_transfer_timeout_s = 0.2;
    })
    .await;
    let consumer = sim(|c| c.kv_role = Role::Consumer).await;
    let (_, answer) = post(&producer, "/v1/chat/completions", {
        let mut leg = prefill_leg();
        leg.as_object_mut().unwrap().remove("prompt");
        leg["messages"] = json!([{"role": "user", "content": prompt()}]);
        leg
    })
    .await;
    assert_eq!(
        answer["kv_transfer_params"]["do_remote_prefill"], true,
        "{answer}"
    );
    until(|| async { transfers(&producer, "expired").await == 1.0 }).await;
    assert_eq!(kv_usage(&producer).await, 0.0);

    let mut decode = json!({"messages": [{"role": "user", "content": prompt()}], "max_tokens": 2});
    decode["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    let (status, done) = post(&consumer, "/v1/chat/completions", decode).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(transfers(&consumer, "failed").await, 1.0);
    producer.shutdown().await;
    consumer.shutdown().await;
}

#[tokio::test]
async fn other_blocks_an_unreachable_producer_and_roles_are_respected() {
    let producer = sim(|c| c.kv_role = Role::Producer).await;
    let consumer = sim(|c| c.kv_role = Role::Consumer).await;
    let (_, answer) = post(&producer, "/v1/completions", prefill_leg()).await;

    // A decode leg with another prompt: the hashes differ, so the consumer
    // prefills itself.
    let mut other = json!({"prompt": "another prompt entirely", "max_tokens": 1});
    other["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    let (status, done) = post(&consumer, "/v1/completions", other).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(transfers(&consumer, "failed").await, 1.0);

    // Nothing listens there.
    let mut unreachable = request();
    unreachable["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    unreachable["kv_transfer_params"]["remote_port"] = json!(1);
    let (status, _) = post(&consumer, "/v1/completions", unreachable).await;
    assert_eq!(status, 200);
    assert_eq!(transfers(&consumer, "failed").await, 2.0);

    // A consumer does not hold blocks; a producer does not read them.
    let (_, plain) = post(&consumer, "/v1/completions", prefill_leg()).await;
    assert_eq!(plain["kv_transfer_params"], Value::Null);
    assert_eq!(kv_usage(&consumer).await, 0.0);
    let mut decode = request();
    decode["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    let (_, local) = post(&producer, "/v1/completions", decode).await;
    assert_eq!(
        transfers(&producer, "ok").await + transfers(&producer, "failed").await,
        0.0
    );
    assert!(local["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // A malformed decode leg is refused naming the field.
    let (status, bad) = post(
        &consumer,
        "/v1/completions",
        json!({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        bad["error"]["message"]
            .as_str()
            .unwrap()
            .contains("remote_port"),
        "{bad}"
    );
    producer.shutdown().await;
    consumer.shutdown().await;
}

/// A connection to `addr` that sent a request's first header lines and
/// never the blank line that ends them.
async fn half_sent(addr: SocketAddr) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /v1/kv/e/1 HTTP/1.1\r\nhost: producer\r\n")
        .await
        .unwrap();
    tcp
}

/// Whether the server closed `tcp` (an end of stream or a reset) by
/// `deadline`.
async fn closed_by(mut tcp: TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// The prefill leg of a prompt of its own on `producer`, then its decode
/// leg on `consumer`: whether the consumer loaded the prompt from the
/// producer.
async fn transfer(producer: &Sim, consumer: &Sim, n: usize) -> bool {
    let text = format!("{n} {}", prompt());
    let mut leg = prefill_leg();
    leg["prompt"] = json!(text);
    let (status, answer) = post(producer, "/v1/completions", leg).await;
    assert_eq!(status, 200, "{answer}");
    let mut decode = request();
    decode["prompt"] = json!(text);
    decode["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    let (status, done) = post(consumer, "/v1/completions", decode).await;
    assert_eq!(status, 200, "{done}");
    done["usage"]["prompt_tokens_details"]["cached_tokens"]
        == answer["usage"]["prompt_tokens"].as_u64().unwrap() - 1
}

#[tokio::test]
async fn half_sent_requests_are_closed_within_10_s_and_transfers_go_on() {
    let producer = sim(|c| c.kv_role = Role::Producer).await;
    let consumer = sim(|c| c.kv_role = Role::Consumer).await;
    // The probe: 300 requests that never finish their headers.
    let sent = Instant::now();
    let mut held = Vec::new();
    for _ in 0..300 {
        held.push(half_sent(producer.transfer_addr).await);
    }
    assert!(
        transfer(&producer, &consumer, 1).await,
        "a transfer beside them"
    );

    // The header-read timeout is 5 s; the bound is 10 s.
    let deadline = sent + Duration::from_secs(10);
    let closed = futures_util::future::join_all(held.into_iter().map(|t| closed_by(t, deadline)));
    let open = closed.await.iter().filter(|c| !**c).count();
    eprintln!("{open} of 300 half-sent connections open 10 s after they were sent");
    assert_eq!(open, 0);

    // The consumer's connection idled out meanwhile; transfers go on.
    assert!(transfer(&producer, &consumer, 2).await);
    assert_eq!(transfers(&consumer, "ok").await, 2.0);
    assert_eq!(transfers(&producer, "refused").await, 0.0);
    producer.shutdown().await;
    consumer.shutdown().await;
}

#[tokio::test]
async fn a_connection_past_the_cap_is_closed_at_once_and_counted() {
    let producer = sim(|c| {
        c.kv_role = Role::Producer;
        c.kv_transfer_max_connections = 4;
    })
    .await;
    let consumer = sim(|c| c.kv_role = Role::Consumer).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(half_sent(producer.transfer_addr).await);
    }
    // The fifth is closed long before the 5 s header-read timeout could.
    let fifth = half_sent(producer.transfer_addr).await;
    until(|| async { transfers(&producer, "refused").await == 1.0 }).await;
    assert!(closed_by(fifth, Instant::now() + Duration::from_secs(1)).await);
    // The transfer that finds the port full reads nothing: its consumer
    // prefills itself.
    assert!(!transfer(&producer, &consumer, 1).await);
    assert_eq!(transfers(&consumer, "failed").await, 1.0);

    // Once the held ones are closed (the header-read timeout), a transfer
    // gets a place.
    let deadline = Instant::now() + Duration::from_secs(10);
    for tcp in held {
        assert!(closed_by(tcp, deadline).await);
    }
    assert!(transfer(&producer, &consumer, 2).await);
    producer.shutdown().await;
    consumer.shutdown().await;
}
