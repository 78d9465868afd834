//! Volatile prefixes over engine sims (exact mode: offsets are in the
//! engines' tokens): a system prompt that starts with a timestamp is
//! flagged, with the offset where it diverges; a stable one is not.

use crate::support::*;
use serde_json::Value;

fn timestamped(i: usize) -> String {
    format!(
        "Current time: 2026-11-30T12:{:02}:{:02}Z. {}",
        i / 60,
        i % 60,
        long_text(3)
    )
}

async fn get(stack: &Stack, path: &str) -> Value {
    get_json(&format!("http://{}{path}", stack.router.admin_addr)).await
}

#[tokio::test]
async fn a_timestamped_system_prompt_is_flagged_where_it_diverges() {
    let stack = Stack::start("volatile", 2, true, |_| {}, |_| {}).await;
    // Stable prompts first: nothing to flag.
    for i in 0..6 {
        let r = stack
            .post(
                "/v1/chat/completions",
                chat(&long_text(3), &format!("q{i}"), 1),
            )
            .await;
        assert_eq!(r.status(), 200);
    }
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_volatile_prefix_requests_total"),
        0.0
    );

    for i in 0..20 {
        let r = stack
            .post(
                "/v1/chat/completions",
                chat(&timestamped(i), "what changed?", 1),
            )
            .await;
        assert_eq!(r.status(), 200);
    }
    let metrics = stack.metrics().await;
    let flagged = sum_of(&metrics, "kvroute_volatile_prefix_requests_total");
    assert!(flagged >= 19.0, "{metrics}");

    // Where two variants first differ, by the router's own tokens.
    let tokens = |v: &Value| v["tokens"].as_array().unwrap().clone();
    let explain = |i| {
        let body = chat(&timestamped(i), "what changed?", 1);
        let client = stack.client.clone();
        let url = format!("http://{}/debug/explain", stack.router.admin_addr);
        async move {
            client
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let (a, b) = (tokens(&explain(100).await), tokens(&explain(101).await));
    let first_difference = a.iter().zip(&b).position(|(x, y)| x != y).unwrap();
    let offenders = get(&stack, "/debug/prefixes").await;
    let top = &offenders[0];
    assert_eq!(top["requests"].as_f64(), Some(flagged), "{offenders}");
    assert_eq!(
        top["diverges_at_token"].as_u64(),
        Some((first_difference / 16 * 16) as u64),
        "{offenders}"
    );
    assert_eq!(top["model"], "kvroute-sim");
    assert_eq!(top["anchor"].as_str().unwrap().len(), 16, "hashes only");
    stack.stop().await;
}
