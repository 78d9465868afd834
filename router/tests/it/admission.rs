//! Admission checks ([`kvroute_core::admission`]): an engine busier than
//! the router knows (its queue, or its KV memory) refuses the request with
//! its load, and the router sends it elsewhere at once, counting neither a
//! failure nor an attempt.

use crate::support::*;
use serde_json::Value;

#[tokio::test]
async fn a_busy_engine_refuses_and_the_router_decides_again() {
    // Approximate mode: no load reports, so the router knows only what it
    // sent itself.
    let slow = |c: &mut kvroute_engine_sim::Config| {
        c.prefill_tokens_per_s = 2000.0;
        c.prefill_overhead_ms = 0.0;
    };
    let stack = Stack::start("admission", 2, false, slow, |_| {}).await;
    let body = chat("You answer briefly.", "Which endpoint?", 2);
    let explain = format!("http://{}/debug/explain", stack.router.admin_addr);
    let answer: Value = (stack
        .client
        .post(&explain)
        .json(&body)
        .send()
        .await
        .unwrap())
    .json()
    .await
    .unwrap();
    let first = answer["decision"]["ranked"][0].as_str().unwrap().to_owned();
    let busy = if first == "sim-0" { 0 } else { 1 };
    // Seconds of prefill sent to the first choice behind the router's back.
    let direct = format!("http://{}/v1/chat/completions", stack.sims[busy].http_addr);
    let client = stack.client.clone();
    let hog = tokio::spawn(async move {
        let long = chat(&long_text(7).repeat(4), "go", 1);
        client
            .post(&direct)
            .json(&long)
            .send()
            .await
            .unwrap()
            .status()
    });
    let metrics = format!("http://{}/metrics", stack.sims[busy].http_addr);
    kvroute_testkit::eventually(
        "the hog is in prefill",
        std::time::Duration::from_secs(10),
        || {
            let url = metrics.clone();
            async move {
                let text = get_text(&url).await;
                (sum_of(&text, "vllm:num_requests_running") >= 1.0).then_some(())
            }
        },
    )
    .await;
    let r = stack.post("/v1/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    let served_by = r.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_ne!(served_by, first, "refused by the busy first choice");
    let text = stack.metrics().await;
    assert_eq!(sum_of(&text, "kvroute_admission_refusals_total"), 1.0);
    assert_eq!(sum_of(&text, "kvroute_upstream_failures_total"), 0.0);
    assert_eq!(hog.await.unwrap(), 200);
    stack.stop().await;
}

#[tokio::test]
async fn an_engine_without_the_blocks_refuses_and_the_router_learns_its_memory() {
    // 180 blocks of 16 tokens. A prompt of `long_text` is about 100
    // blocks: beside one that decodes for seconds, another does not fit.
    let small = |c: &mut kvroute_engine_sim::Config| {
        c.num_gpu_blocks = 180;
        c.itl_ms = 20.0;
    };
    let stack = Stack::start("admission-memory", 2, false, small, |_| {}).await;
    let body = chat(&long_text(1), "Which endpoint?", 2);
    let explain = format!("http://{}/debug/explain", stack.router.admin_addr);
    let answer: Value = (stack.client.post(&explain).json(&body).send().await)
        .unwrap()
        .json()
        .await
        .unwrap();
    let first = answer["decision"]["ranked"][0].as_str().unwrap().to_owned();
    let busy = if first == "sim-0" { 0 } else { 1 };
    // A long decode sent to the first choice behind the router's back
    // holds most of its blocks; its queue is empty.
    let direct = format!("http://{}/v1/chat/completions", stack.sims[busy].http_addr);
    let client = stack.client.clone();
    let hog = tokio::spawn(async move {
        let long = chat(&long_text(7), "go", 300);
        client.post(&direct).json(&long).send().await
    });
    let metrics = format!("http://{}/metrics", stack.sims[busy].http_addr);
    kvroute_testkit::eventually(
        "the hog is decoding",
        std::time::Duration::from_secs(10),
        || {
            let url = metrics.clone();
            async move {
                let text = get_text(&url).await;
                (sum_of(&text, "vllm:generation_tokens_total") >= 2.0).then_some(())
            }
        },
    )
    .await;
    let r = stack.post("/v1/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    let served_by = r.headers()["x-kvroute-endpoint"].to_str().unwrap();
    assert_ne!(served_by, first, "refused by the first choice for memory");
    let text = stack.metrics().await;
    assert_eq!(sum_of(&text, "kvroute_admission_refusals_total"), 1.0);
    assert_eq!(sum_of(&text, "kvroute_upstream_failures_total"), 0.0);
    hog.abort();
    stack.stop().await;
}
