//! Missed prompt tokens attributed to causes over engine sims: per request
//! (the `x-request-id`, the cache header, `/debug/requests`) and fleet-wide
//! (the metrics sum to what the engines computed).

use crate::support::*;
use serde_json::{Value, json};

/// A system prompt of about 15 blocks.
fn short_text(seed: usize) -> String {
    (0..20)
        .map(|i| format!("topic{seed} line {i} on caches. "))
        .collect()
}

/// Sends `body` with `x-request-id: id`; returns the response's headers
/// and usage.
async fn send(stack: &Stack, id: &str, body: Value) -> (reqwest::header::HeaderMap, Value) {
    let r = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .header("x-request-id", id)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let headers = r.headers().clone();
    let body: Value = r.json().await.unwrap();
    (headers, body)
}

/// The router's record of request `id`.
async fn recorded(stack: &Stack, id: &str) -> Value {
    let url = format!("http://{}/debug/requests/{id}", stack.router.admin_addr);
    let r = reqwest::get(&url).await.unwrap();
    assert_eq!(r.status(), 200, "{id}");
    r.json().await.unwrap()
}

/// `record`'s missed tokens by cause.
fn causes(record: &Value) -> Vec<(String, u64)> {
    serde_json::from_value(record["missed"].clone()).unwrap()
}

/// The leading blocks of `body`'s prompt the router sees held (the index,
/// or the policy's memory of prefixes in flight), by `POST /debug/explain`.
async fn held(stack: &Stack, body: &Value) -> u64 {
    let url = format!("http://{}/debug/explain", stack.router.admin_addr);
    let ask = json!({"path": "/v1/chat/completions", "headers": {}, "body": body.to_string()});
    let answer: Value = (stack.client.post(&url).json(&ask).send().await.unwrap())
        .json()
        .await
        .unwrap();
    let endpoints = answer["decision"]["endpoints"].as_array().unwrap().clone();
    (endpoints.iter())
        .map(|e| e["cached_blocks"].as_u64().unwrap())
        .chain(answer["decision"]["cached_blocks"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Polls until `body`'s prompt is held (or not) as `want` says.
async fn until_held(stack: &Stack, body: &Value, want: bool) {
    kvroute_testkit::eventually(
        "the index sees the prompt's blocks come or go",
        std::time::Duration::from_secs(10),
        || async { ((held(stack, body).await > 0) == want).then_some(()) },
    )
    .await;
}

fn of(causes: &[(String, u64)], cause: &str) -> u64 {
    causes.iter().find(|(c, _)| c == cause).map_or(0, |c| c.1)
}

#[tokio::test]
async fn every_missed_token_has_a_cause_per_request_and_in_the_metrics() {
    let stack = Stack::start(
        "missed",
        2,
        true,
        |_| {},
        |c| c.telemetry.cache_header = true,
    )
    .await;
    stack.wait_live().await;

    // First sight: cold, but for the block vLLM always computes.
    let (headers, body) = send(&stack, "cold-1", chat(&short_text(1), "q", 2)).await;
    assert_eq!(headers["x-request-id"], "cold-1");
    let expected = headers["x-kvroute-cache"].to_str().unwrap();
    assert!(
        expected.contains("expected-cached=0; expected-missed=cold:"),
        "{expected}"
    );
    let record = recorded(&stack, "cold-1").await;
    let c = causes(&record);
    let usage = &body["usage"];
    let missed = usage["prompt_tokens"].as_u64().unwrap()
        - usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    assert_eq!(c.iter().map(|c| c.1).sum::<u64>(), missed);
    assert!(of(&c, "cold") > 0 && of(&c, "partial_block") > 0, "{c:?}");
    assert_eq!(of(&c, "cold") + of(&c, "partial_block"), missed);
    // The engine's response id finds it too.
    let by_response = recorded(&stack, body["id"].as_str().unwrap()).await;
    assert_eq!(by_response["request_id"], "cold-1");

    // A timestamp at the top: every request's chain is new from block 0,
    // while the rest recurs.
    for i in 0..3 {
        let system = format!("Now: 12:00:0{i}. {}", short_text(2));
        send(&stack, &format!("ts-{i}"), chat(&system, "q", 2)).await;
    }
    let c = causes(&recorded(&stack, "ts-2").await);
    assert!(of(&c, "diverged") > 0, "{c:?}");
    assert_eq!(of(&c, "cold") + of(&c, "unknown"), 0, "{c:?}");

    // A request without an id gets one.
    let r = stack
        .post("/v1/chat/completions", chat(&short_text(3), "q", 2))
        .await;
    assert_eq!(r.headers()["x-request-id"].len(), 32);
    r.text().await.unwrap();

    // A stream without usage is not guessed.
    let mut body = chat(&short_text(4), "no usage", 2);
    body["stream"] = json!(true);
    stack
        .post("/v1/chat/completions", body)
        .await
        .text()
        .await
        .unwrap();

    // Fleet-wide, the causes sum to what the engines computed.
    let metrics = stack.metrics().await;
    let mut computed = 0.0;
    for sim in &stack.sims {
        let text = get_text(&format!("http://{}/metrics", sim.http_addr)).await;
        computed += sum_of(&text, "vllm:prompt_tokens_total")
            - sum_of(&text, "vllm:prefix_cache_hits_total");
    }
    let unreported = sum_of(&metrics, "kvroute_unreported_prompt_tokens_total");
    assert!(unreported > 0.0, "{metrics}");
    assert_eq!(
        sum_of(&metrics, "kvroute_missed_prompt_tokens_total") + unreported,
        computed
    );
    assert!(
        metrics.contains(
            "kvroute_missed_prompt_tokens_total{model=\"kvroute-sim\",tenant=\"none\",cause=\"diverged\"}"
        ),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_cache_pressure{model=\"kvroute-sim\"} 0.0"));

    let missing = format!("http://{}/debug/requests/nope", stack.router.admin_addr);
    assert_eq!(reqwest::get(&missing).await.unwrap().status(), 404);
    stack.stop().await;
}

#[tokio::test]
async fn blocks_evicted_for_room_come_back_as_evicted() {
    // One engine with room for about four of these prompts.
    let stack = Stack::start("evicted", 1, true, |c| c.num_gpu_blocks = 64, |_| {}).await;
    stack.wait_live().await;
    let first = chat(&short_text(10), "first", 2);
    for i in 0..6 {
        let body = chat(&short_text(10 + i), "first", 2);
        send(&stack, &format!("fill-{i}"), body.clone()).await;
        until_held(&stack, &body, true).await;
    }
    until_held(&stack, &first, false).await;
    send(&stack, "again", first).await;
    let c = causes(&recorded(&stack, "again").await);
    assert!(of(&c, "evicted") > 0, "{c:?}");
    assert_eq!(
        of(&c, "cold") + of(&c, "unknown") + of(&c, "engine_shortfall"),
        0,
        "{c:?}"
    );
    let metrics = stack.metrics().await;
    let pressure = sum_of(&metrics, "kvroute_cache_pressure");
    assert!(pressure > 0.0, "{metrics}");
    stack.stop().await;
}
