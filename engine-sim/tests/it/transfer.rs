//! Disaggregated prefill between two simulators, with vLLM's
//! `kv_transfer_params`: a producer holds a prefill's blocks, a consumer
//! reads them over a real connection, and falls back to its own prefill
//! when it cannot.

use std::time::Duration;

use kvroute_engine_sim::Sim;
use kvroute_engine_sim::transfer::Role;
use serde_json::{Value, json};

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
