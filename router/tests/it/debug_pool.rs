//! `/debug/pool`'s shares of the last decisions over real engine sims:
//! each endpoint's share of the requests routed, and of the cold ones.

use std::collections::HashMap;

use crate::support::*;

/// The value of `kvroute_routing_decisions_total{reason="<reason>"}`.
fn decisions(metrics: &str, reason: &str) -> f64 {
    let series = format!("kvroute_routing_decisions_total{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str())?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn debug_pool_shows_each_endpoint_s_share_of_decisions_and_of_cold_keys() {
    let stack = Stack::start("debug-pool", 3, true, |_| {}, |_| {}).await;
    stack.wait_live().await;
    // Per endpoint: requests routed there, and the cold ones among them.
    let mut routed: HashMap<String, (u32, u32)> = HashMap::new();
    // Twelve prompts no engine holds: cold keys, placed by rendezvous.
    for seed in 0..12 {
        stack.wait_idle().await;
        let r = stack
            .post("/v1/chat/completions", chat(&long_text(100 + seed), "q", 1))
            .await;
        assert_eq!(r.status(), 200);
        let e = r.headers()["x-kvroute-endpoint"].to_str().unwrap();
        let entry = routed.entry(e.to_owned()).or_default();
        entry.0 += 1;
        entry.1 += 1;
    }
    // One more cold, then six warm on its holder.
    stack.wait_idle().await;
    let holder = stack.warm(&long_text(7)).await;
    routed.entry(holder.clone()).or_default().0 += 7;
    routed.entry(holder.clone()).or_default().1 += 1;
    for turn in 0..6 {
        let body = chat(&long_text(7), &format!("again {turn}"), 1);
        let r = stack.post("/v1/chat/completions", body).await;
        assert_eq!(r.headers()["x-kvroute-endpoint"], holder.as_str());
    }
    let metrics = stack.metrics().await;
    assert_eq!(
        (decisions(&metrics, "cold"), decisions(&metrics, "warm")),
        (13.0, 6.0),
        "the prompts were cold and warm as planned"
    );

    let pool = get_json(&format!("http://{}/debug/pool", stack.router.admin_addr)).await;
    let pool = pool.as_array().unwrap();
    assert_eq!(pool.len(), 3);
    let (mut decision_total, mut cold_total) = (0.0, 0.0);
    for e in pool {
        let name = e["name"].as_str().unwrap();
        let (all, cold) = routed.get(name).copied().unwrap_or_default();
        let decision_share = e["decision_share"].as_f64().unwrap();
        let cold_share = e["cold_share"].as_f64().unwrap();
        assert!(
            (decision_share - f64::from(all) / 19.0).abs() < 1e-9,
            "{name}: {e}"
        );
        assert!(
            (cold_share - f64::from(cold) / 13.0).abs() < 1e-9,
            "{name}: {e}"
        );
        decision_total += decision_share;
        cold_total += cold_share;
    }
    assert!((decision_total - 1.0).abs() < 1e-9 && (cold_total - 1.0).abs() < 1e-9);
    stack.stop().await;
}
