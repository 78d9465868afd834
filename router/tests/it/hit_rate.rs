//! Observed against expected hit rate over engine sims: the router counts
//! exactly the cached tokens the engines report, and a sustained gap is
//! measured, alerted and logged.

use crate::support::*;
use serde_json::{Value, json};

/// The engines' own figure for `family`, summed over the sims.
async fn engines(stack: &Stack, family: &str) -> f64 {
    let mut total = 0.0;
    for sim in &stack.sims {
        let text = get_text(&format!("http://{}/metrics", sim.http_addr)).await;
        total += sum_of(&text, family);
    }
    total
}

#[tokio::test]
async fn observed_cached_tokens_equal_the_engines_figures() {
    let stack = Stack::start(
        "observed",
        3,
        true,
        |_| {},
        |c| {
            c.telemetry.pricing = Some(kvroute_router::config::Pricing {
                gpu_hour_cost: 2.5,
                currency: "USD".into(),
                gpus_per_engine: 2,
            })
        },
    )
    .await;
    stack.wait_live().await;
    let (mut seen, mut hits) = (0, 0);
    for i in 0..24 {
        let mut body = chat(&long_text(i % 3), &format!("question {i}"), 3);
        match i % 3 {
            0 => {}
            1 => {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            _ => body["prompt_cache_key"] = json!(format!("conv-{}", i % 2)),
        }
        let r = stack.post("/v1/chat/completions", body).await;
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        let usage: Value = if i % 3 == 1 {
            let last = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .rfind(|l| l.contains("\"usage\":{"))
                .unwrap();
            serde_json::from_str::<Value>(last).unwrap()["usage"].clone()
        } else {
            serde_json::from_str::<Value>(&text).unwrap()["usage"].clone()
        };
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        seen += cached;
        hits += u64::from(cached > 0);
    }
    let metrics = stack.metrics().await;
    let observed = sum_of(&metrics, "kvroute_observed_cached_tokens_total");
    assert!(seen > 0);
    assert_eq!(observed, seen as f64);
    assert_eq!(
        observed,
        engines(&stack, "vllm:prefix_cache_hits_total").await
    );
    assert_eq!(
        sum_of(&metrics, "kvroute_observed_prompt_tokens_total"),
        engines(&stack, "vllm:prompt_tokens_total").await
    );
    // The request hit rate, and the prefill those tokens saved at the
    // pool's rate (the sims report none: the configured 10,000 a second).
    assert_eq!(sum_of(&metrics, "kvroute_observed_requests_total"), 24.0);
    assert!(hits > 0 && hits < 24, "{hits}");
    assert_eq!(
        sum_of(&metrics, "kvroute_requests_with_cache_hit_total"),
        hits as f64
    );
    let saved = sum_of(&metrics, "kvroute_prefill_seconds_saved_total");
    assert!((saved - seen as f64 / 10_000.0).abs() < 1e-9, "{saved}");
    // What saved time costs, to price it.
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_pricing_engine_hour_cost{currency=\"USD\"}"
        ),
        5.0
    );
    assert!(
        metrics.contains(
            "kvroute_observed_cached_tokens_total{model=\"kvroute-sim\",tenant=\"none\"}"
        ),
        "{metrics}"
    );
    // Exact mode never expects more than the engines then report (it may
    // expect less: a request can overtake the cache events of the one
    // before it).
    let gap = sum_of(&metrics, "kvroute_hit_rate_gap");
    assert!(gap < 0.01, "gap {gap}");
    assert!(!metrics.contains("kvroute_hit_rate_gap_alerts_total"));

    // A stream without usage is routed and counted, not observed.
    let mut body = chat(&long_text(0), "no usage", 2);
    body["stream"] = json!(true);
    stack
        .post("/v1/chat/completions", body)
        .await
        .text()
        .await
        .unwrap();
    let after = sum_of(
        &stack.metrics().await,
        "kvroute_observed_cached_tokens_total",
    );
    assert_eq!(after, observed);
    stack.stop().await;
}

#[tokio::test]
async fn a_sustained_gap_is_alerted_with_an_example() {
    let (logs, _guard) = Logs::capture();
    // Approximate mode remembers where prefixes went; engines that lose
    // their caches behind its back are the gap.
    let stack = Stack::start("gap", 2, false, |_| {}, |_| {}).await;
    let system = long_text(4);
    for i in 0..60 {
        for sim in &stack.sims {
            let r = stack
                .client
                .post(format!("http://{}/reset_prefix_cache", sim.http_addr))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
        let r = stack
            .post("/v1/chat/completions", chat(&system, &format!("q{i}"), 1))
            .await;
        assert_eq!(r.status(), 200);
    }
    let metrics = stack.metrics().await;
    let gap = sum_of(&metrics, "kvroute_hit_rate_gap");
    assert!(gap > 0.5, "gap {gap}\n{metrics}");
    assert_eq!(
        sum_of(&metrics, "kvroute_observed_cached_tokens_total"),
        0.0
    );
    assert_eq!(sum_of(&metrics, "kvroute_hit_rate_gap_alerts_total"), 1.0);
    assert_eq!(
        logs.count("far fewer cached tokens than the router expects"),
        1
    );
    assert_eq!(
        logs.count("example=chatcmpl-"),
        1,
        "the log names a response"
    );
    stack.stop().await;
}
