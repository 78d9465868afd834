//! `POST /debug/explain` over real engine sims: what the router computes
//! for a request and the decision it would make, with no state changed.

use crate::support::*;
use kvroute_router::explain::Explanation;
use serde_json::{Value, json};

async fn explain(stack: &Stack, body: Value) -> reqwest::Response {
    stack
        .client
        .post(format!("http://{}/debug/explain", stack.router.admin_addr))
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn explains_a_warm_decision_without_changing_anything() {
    let stack = Stack::start("explain", 3, true, |_| {}, |_| {}).await;
    stack.wait_live().await;
    let system = long_text(5);
    let holder = stack.warm(&system).await;
    let body = chat(&system, "first", 2);
    let entries = stack.router.pool.index_entries();

    // A bare chat body, then the same wrapped with a path and headers.
    let bare: Value = explain(&stack, body.clone()).await.json().await.unwrap();
    let wrapped = json!({"path": "/v1/chat/completions",
        "headers": {"x-conversation-id": "c-1"}, "body": body});
    let r = explain(&stack, wrapped).await;
    assert_eq!(r.status(), 200);
    let keyed: Value = r.json().await.unwrap();
    // `kvroute explain` reads the answer as the router's own type.
    for v in [&bare, &keyed] {
        let typed: Explanation = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&typed).unwrap(), *v);
    }

    for v in [&bare, &keyed] {
        let chain = v["chain"].as_array().unwrap();
        let tokens = v["tokens"].as_array().unwrap();
        assert_eq!(tokens.len() as u64, v["prompt_tokens"].as_u64().unwrap());
        assert_eq!(chain.len(), tokens.len() / 16);
        assert_eq!(
            (v["block_size"].as_u64(), v["hash_algo"].as_str()),
            (Some(16), Some("sha256"))
        );
        let d = &v["decision"];
        assert_eq!(d["policy"], "kvroute");
        assert_eq!(d["reason"], "warm");
        assert_eq!(d["ranked"][0], holder.as_str());
        assert_eq!(d["cached_blocks"].as_u64(), Some(chain.len() as u64));
        // The sims report no prefill rate: the pool is compared at the
        // configured default.
        assert_eq!(d["prefill_tokens_per_second"].as_f64(), Some(10_000.0));
        for e in d["endpoints"].as_array().unwrap() {
            let expected = if e["name"] == holder.as_str() {
                chain.len()
            } else {
                0
            };
            assert_eq!(e["cached_blocks"].as_u64(), Some(expected as u64), "{e}");
            assert_eq!(e["contract"], "match");
            assert_eq!(e["in_flight"], 0);
            assert!(e["predicted_ttft_seconds"].as_f64().unwrap() >= 0.0);
        }
    }
    // The conversation header changes the key, not the chain.
    assert_ne!(bare["key"], keyed["key"]);
    assert_eq!(bare["chain"], keyed["chain"]);
    // Nothing was sent or counted.
    assert_eq!(stack.router.pool.index_entries(), entries);
    assert!(stack.router.pool.status().iter().all(|e| e.in_flight == 0));
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_routed_total"),
        1.0,
        "only the warming request was routed"
    );
    stack.stop().await;
}

#[tokio::test]
async fn the_policys_memory_is_not_touched() {
    let stack = Stack::start(
        "explain-rr",
        3,
        false,
        |_| {},
        |c| c.routing.policy = kvroute_core::policy::PolicyConfig::by_name("round-robin").unwrap(),
    )
    .await;
    let first = |v: &Value| v["decision"]["ranked"][0].clone();
    let body = chat("hello", "there", 2);
    let a: Value = explain(&stack, body.clone()).await.json().await.unwrap();
    let b: Value = explain(&stack, body).await.json().await.unwrap();
    assert_eq!(first(&a), first(&b), "round robin did not advance");
    assert_eq!(a["decision"]["reason"], "cold");
    stack.stop().await;
}

#[tokio::test]
async fn bad_requests_get_clear_errors() {
    let stack = Stack::start("explain-bad", 1, false, |_| {}, |_| {}).await;
    let cases = [
        (
            json!({"body": {}, "headers": ["x"]}),
            400,
            "'headers' must be an object",
        ),
        (
            json!({"body": {}, "path": 3}),
            400,
            "'path' must be a string",
        ),
        (json!({"body": {}, "path": "/admin"}), 404, "is not proxied"),
        (json!({"body": {"messages": "hi"}}), 400, "'messages'"),
        (
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "does not exist",
        ),
    ];
    for (body, status, message) in cases {
        let r = explain(&stack, body.clone()).await;
        assert_eq!(r.status(), status, "{body}");
        let v: Value = r.json().await.unwrap();
        let text = v["error"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{body}: {text}");
    }
    stack.stop().await;
}
