//! Warm-ups (`routing.warmup`) over engine sims: a named prefix is sent to
//! its owner once a period as its tenant's request would be (salted,
//! keyed), not counted as a request; the owner then serves that tenant's
//! requests with the prefix cached, and its warm-ups are skipped while
//! they touch it there; the budget skips warm-ups when they would be too
//! large a share of the prefill.

use std::time::Duration;

use kvroute_core::warmup;
use kvroute_router::Config;
use kvroute_router::config::{Header, Prefix, TenancyMode, Warmup};
use serde_json::{Value, json};

use crate::support::*;

/// A router over three sims warming `support-v3` (for tenant `acme`,
/// salted) every second, warm-ups at most `share` of the prefill.
async fn warmed(name: &str, share: f64) -> Stack {
    let dir = temp_dir(&format!("{name}-secret"));
    std::fs::write(dir.join("secret"), "s3cret").unwrap();
    let stack = Stack::start(
        name,
        3,
        true,
        |_| {},
        |c| {
            c.tenancy.mode = TenancyMode::Salted;
            c.tenancy.tenant_header = Some(Header::from_static("x-tenant"));
            c.tenancy.secret_file = Some(dir.join("secret"));
            c.routing.warmup = Some(Warmup {
                every_seconds: 1,
                max_share_of_prefill: share,
                prefixes: vec![Prefix {
                    name: "support-v3".into(),
                    model: None,
                    tenant: Some("acme".into()),
                    messages: Some(vec![json!({"role": "system", "content": long_text(7)})]),
                    prompt: None,
                    config_map_ref: None,
                }],
                ..Warmup::default()
            });
        },
    )
    .await;
    stack.wait_live().await;
    stack
}

fn warmups(metrics: &str, result: &str) -> f64 {
    sum_of(
        metrics,
        &format!("kvroute_warmups_total{{prefix=\"support-v3\",result=\"{result}\"}}"),
    )
}

/// Requests each sim served.
async fn served(stack: &Stack) -> Vec<f64> {
    let mut n = Vec::new();
    for sim in &stack.sims {
        let text = get_text(&format!("http://{}/metrics", sim.http_addr)).await;
        n.push(sum_of(&text, "vllm:request_success_total"));
    }
    n
}

#[tokio::test]
async fn a_named_prefix_is_kept_warm_on_its_owner_for_its_tenant() {
    let stack = warmed("warmup", 1.0).await;
    let metrics = kvroute_testkit::eventually("three periods", Duration::from_secs(20), || async {
        let metrics = stack.metrics().await;
        (warmups(&metrics, "sent") >= 3.0).then_some(metrics)
    })
    .await;
    // Warm-ups are no requests, and the prefix stayed resident.
    assert_eq!(sum_of(&metrics, "kvroute_requests_total"), 0.0, "{metrics}");
    assert_eq!(warmups(&metrics, "repaired"), 0.0);
    assert_eq!(warmups(&metrics, "failed"), 0.0);
    let cost = sum_of(&metrics, "kvroute_warmup_prefill_tokens_total");
    assert!(cost > 0.0, "{metrics}");
    // One owner got them all.
    let served = served(&stack).await;
    let owner = served.iter().position(|&n| n > 0.0).unwrap();
    assert_eq!(served.iter().filter(|&&n| n > 0.0).count(), 1, "{served:?}");

    // The admin port shows the last period.
    let url = format!("http://{}/debug/warmup", stack.router.admin_addr);
    let status: Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
    let p = &status["prefixes"][0];
    assert_eq!(p["name"], "support-v3", "{status}");
    assert_eq!(
        p["owners"][0]["endpoint"],
        format!("sim-{owner}"),
        "{status}"
    );
    assert_eq!(p["owners"][0]["resident"], true, "{status}");
    assert_eq!(p["owners"][0]["result"], "sent", "{status}");
    assert!(p["prompt_tokens"].as_u64().unwrap() > 1000, "{status}");

    // Its tenant's request with the prefix goes there and finds it cached;
    // another tenant's finds nothing (salted).
    let ask = |tenant: &'static str| {
        let body = chat(&long_text(7), "how do I reset my password?", 2);
        let r = stack.client.post(stack.url("/v1/chat/completions"));
        r.header("x-tenant", tenant).json(&body).send()
    };
    let r = ask("acme").await.unwrap();
    assert_eq!(r.status(), 200);
    let endpoint = r.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(endpoint, format!("sim-{owner}"));
    let done: Value = r.json().await.unwrap();
    let cached = done["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 1000, "{done}");
    let other: Value = ask("globex").await.unwrap().json().await.unwrap();
    assert_eq!(
        other["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{other}"
    );

    // While its tenant's requests touch the prefix on its owner, the
    // owner's warm-ups are skipped as resident.
    kvroute_testkit::eventually("a resident skip", Duration::from_secs(20), || async {
        assert_eq!(ask("acme").await.unwrap().status(), 200);
        (warmups(&stack.metrics().await, "skipped_resident") >= 1.0).then_some(())
    })
    .await;
    stack.stop().await;
}

#[tokio::test]
async fn past_the_budget_warm_ups_are_skipped_but_the_first() {
    // No other traffic, and a budget smaller than one block of the
    // prefix's prefill: every warm-up after the first is over it.
    let stack = warmed("warmup-budget", 0.0001).await;
    let metrics =
        kvroute_testkit::eventually("a skipped period", Duration::from_secs(20), || async {
            let metrics = stack.metrics().await;
            (warmups(&metrics, "skipped_budget") >= 1.0).then_some(metrics)
        })
        .await;
    assert_eq!(warmups(&metrics, "sent"), 1.0, "{metrics}");
    stack.stop().await;
}

/// Two prefixes warmed every second on both of two sims, the first of
/// which (`sim-0`) never answers a completion while its `/health` does;
/// the router configured by `router` besides.
async fn beside_a_hung_owner(name: &str, router: impl FnOnce(&mut Config)) -> Stack {
    let first = std::cell::Cell::new(true);
    let prefix = |name: &str, seed| Prefix {
        name: name.into(),
        model: Some("kvroute-sim".into()),
        tenant: None,
        messages: Some(vec![json!({"role": "system", "content": long_text(seed)})]),
        prompt: None,
        config_map_ref: None,
    };
    Stack::start(
        name,
        2,
        false,
        |c| {
            if first.replace(false) {
                c.stop_after = Some(0);
            }
        },
        |c| {
            c.routing.warmup = Some(Warmup {
                every_seconds: 1,
                owners: 2,
                max_share_of_prefill: 1.0,
                prefixes: vec![prefix("support-v3", 7), prefix("top-docs", 8)],
            });
            router(c);
        },
    )
    .await
}

#[tokio::test]
async fn a_hung_owner_does_not_delay_another_owners_warm_ups() {
    let start = wall_ms();
    let stack = beside_a_hung_owner("warmup-hung", |_| {}).await;
    // A rate over a dozen periods of each prefix: the window is the
    // measurement (nothing to wait for), polled until it has passed.
    kvroute_testkit::eventually("a dozen periods", Duration::from_secs(20), || async {
        (wall_ms() >= start + 12_000).then_some(())
    })
    .await;
    let end = wall_ms();
    let got = served(&stack).await[1];
    // Each prefix falls due at once when the router starts, then once a
    // period.
    let periods: u64 = ["support-v3", "top-docs"]
        .iter()
        .map(|p| 1 + warmup::period(p, 1000, end) - warmup::period(p, 1000, start))
        .sum();
    println!("the healthy owner got {got} warm-ups in {periods} periods");
    // One may still be on its way at the window's end.
    assert!(
        got + 1.0 >= 0.9 * periods as f64,
        "the healthy owner got {got} warm-ups in {periods} periods"
    );
    // The hung owner was an owner: its warm-ups failed.
    let metrics = stack.metrics().await;
    let failed = sum_of(
        &metrics,
        "kvroute_warmups_total{prefix=\"support-v3\",result=\"failed\"}",
    ) + sum_of(
        &metrics,
        "kvroute_warmups_total{prefix=\"top-docs\",result=\"failed\"}",
    );
    assert!(failed >= 1.0, "{metrics}");
    stack.stop().await;
}

#[tokio::test]
async fn a_hung_owner_holds_at_most_four_warm_ups() {
    // A queue never makes the hung owner busy: its warm-ups pile up to
    // the bound, and those beyond it are skipped.
    let stack = beside_a_hung_owner("warmup-bound", |c| {
        c.flow_control.hold_above_ms = Some(3_600_000.0);
    })
    .await;
    let mut most = 0;
    let skipped = "kvroute_warmups_total{prefix=\"support-v3\",result=\"skipped_in_flight\"}";
    kvroute_testkit::eventually("a warm-up skipped", Duration::from_secs(20), || {
        let status = stack.router.pool.status();
        let hung = status
            .iter()
            .find(|e| e.name == "sim-0")
            .map_or(0, |e| e.in_flight);
        most = most.max(hung);
        async { (sum_of(&stack.metrics().await, skipped) >= 1.0).then_some(()) }
    })
    .await;
    assert_eq!(most, 4, "warm-ups in flight to the hung owner at most");
    stack.stop().await;
}

fn wall_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.unwrap().as_millis() as u64
}
