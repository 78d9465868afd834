//! Flow control over real engine sims: requests held at the router until
//! an endpoint can start them, in priority order, shed with 429, and
//! nothing left behind by a client that goes away.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvroute_router::config::Objective;
use serde_json::{Value, json};

use crate::support::*;

fn objective(name: &str, priority: i32) -> Objective {
    Objective {
        name: name.into(),
        priority,
        tenants: None,
    }
}

async fn gauge(stack: &Stack, series: &str) -> f64 {
    sum_of(&stack.metrics().await, series)
}

/// Polls the router's metrics until `series` reads `value`.
async fn metric_reaches(stack: &Stack, series: &str, value: f64) {
    kvroute_testkit::eventually(series, Duration::from_secs(10), || async {
        (gauge(stack, series).await == value).then_some(())
    })
    .await;
}

/// Sends a short completion naming `objective` in the background; resolves
/// to its status and when its answer was read whole.
fn send(stack: &Stack, objective: &str) -> tokio::task::JoinHandle<(u16, Instant)> {
    send_as(stack, objective, None)
}

/// [`send`] from `tenant` (`x-tenant`).
fn send_as(
    stack: &Stack,
    objective: &str,
    tenant: Option<&str>,
) -> tokio::task::JoinHandle<(u16, Instant)> {
    let mut r = stack
        .client
        .post(stack.url("/v1/completions"))
        .json(&json!({"prompt": format!("a request of {objective}"), "max_tokens": 3}));
    if !objective.is_empty() {
        r = r.header("x-gateway-inference-objective", objective);
    }
    if let Some(t) = tenant {
        r = r.header("x-tenant", t);
    }
    r = r.header("x-request-id", format!("held-{objective}"));
    tokio::spawn(async move {
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        r.bytes().await.unwrap();
        (status, Instant::now())
    })
}

/// An engine whose KV memory one long decode nearly fills.
fn small_memory(c: &mut kvroute_engine_sim::Config) {
    c.num_gpu_blocks = 180;
    c.itl_ms = 20.0;
}

/// Sends a long decode straight to the first engine, behind the router's
/// back (no load reports: the router does not know), and waits until it
/// has generated `tokens`; resolves to its status and when it ended.
async fn hog(stack: &Stack, tokens: f64) -> tokio::task::JoinHandle<(u16, Instant)> {
    const GENERATED: &str = "vllm:generation_tokens_total";
    let metrics = format!("http://{}/metrics", stack.sims[0].http_addr);
    // Earlier requests' tokens are not the hog's.
    let tokens = tokens + sum_of(&get_text(&metrics).await, GENERATED);
    let direct = format!("http://{}/v1/chat/completions", stack.sims[0].http_addr);
    let r = (stack.client.post(&direct)).json(&chat(&long_text(7), "go", 100));
    let hog = tokio::spawn(async move {
        let status = r.send().await.unwrap().status().as_u16();
        (status, Instant::now())
    });
    kvroute_testkit::eventually("the hog is decoding", Duration::from_secs(10), || {
        let url = metrics.clone();
        async move {
            let text = get_text(&url).await;
            (sum_of(&text, GENERATED) >= tokens).then_some(())
        }
    })
    .await;
    hog
}

/// A stream that holds one seat until dropped, its first chunk read.
async fn hold_a_seat(
    stack: &Stack,
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + use<> {
    let holder = stack
        .post(
            "/v1/completions",
            json!({"prompt": "hold", "max_tokens": 500, "stream": true}),
        )
        .await;
    let mut holding = Box::pin(holder.bytes_stream());
    holding.next().await.unwrap().unwrap();
    holding
}

#[tokio::test]
async fn held_requests_go_by_priority_and_leave_nothing_when_abandoned() {
    let stack = Stack::start(
        "flow-priority",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 1;
            c.objectives = vec![objective("interactive", 10), objective("batch", -1)];
            // One seat: kept for priority 10, no lower request would go
            // while it had requests in the window.
            c.flow_control.reserve_window_ms = 0;
        },
    )
    .await;
    // A stream holds the one seat until it is dropped.
    let holding = hold_a_seat(&stack).await;

    let low = send(&stack, "");
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"0\"}", 1.0).await;
    let high = send(&stack, "interactive");
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"10\"}", 1.0).await;

    // Sheddable: refused at once rather than held.
    let r = stack
        .client
        .post(stack.url("/v1/completions"))
        .header("x-gateway-inference-objective", "batch")
        .json(&json!({"prompt": "b", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["code"], "flow_sheddable");

    // A client that gives up while held leaves nothing behind.
    let gone = send(&stack, "");
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"0\"}", 2.0).await;
    gone.abort();
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"0\"}", 1.0).await;

    drop(holding);
    let (high, low) = (high.await.unwrap(), low.await.unwrap());
    assert_eq!((high.0, low.0), (200, 200));
    assert!(high.1 < low.1, "the higher priority went first");
    // Its record says how long it was held, and why.
    let url = format!(
        "http://{}/debug/requests/held-interactive",
        stack.router.admin_addr
    );
    let record: Value = kvroute_testkit::eventually("the record", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let r = reqwest::get(&url).await.ok()?;
            (r.status() == 200).then_some(())?;
            r.json().await.ok()
        }
    })
    .await;
    assert!(record["held_seconds"].as_f64().unwrap() > 0.0, "{record}");
    let because = record["held_because"].as_str().unwrap();
    assert!(
        ["endpoints_full", "predicted_wait"].contains(&because),
        "{record}"
    );
    let metrics = stack.metrics().await;
    assert_eq!(sum_of(&metrics, "kvroute_flow_queued"), 0.0);
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_flow_dispatched_total{reason=\"after_wait\"}"
        ),
        2.0
    );
    assert_eq!(sum_of(&metrics, "kvroute_flow_wait_seconds_count"), 2.0);
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_flow_shed_total{priority=\"-1\",reason=\"flow_sheddable\"}"
        ),
        1.0
    );
    eventually("every body's budget is back", || {
        stack.router.pool.status().iter().all(|e| e.in_flight == 0)
    })
    .await;
    metric_reaches(&stack, "kvroute_request_body_bytes", 0.0).await;
    stack.stop().await;
}

#[tokio::test]
async fn lower_priorities_leave_a_seat_for_a_recent_higher_one() {
    let stack = Stack::start(
        "flow-room",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 2;
            c.objectives = vec![objective("interactive", 10)];
        },
    )
    .await;
    // A priority-10 request in the window: lower ones keep a seat for it.
    assert_eq!(send(&stack, "interactive").await.unwrap().0, 200);
    let holding = hold_a_seat(&stack).await;
    // One seat is free, but taking it would leave none for priority 10.
    let low = send(&stack, "");
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"0\"}", 1.0).await;
    let high = send(&stack, "interactive").await.unwrap();
    assert_eq!(high.0, 200, "the seat kept was there for it");
    assert_eq!(
        gauge(&stack, "kvroute_flow_queued{priority=\"0\"}").await,
        1.0
    );
    drop(holding);
    assert_eq!(low.await.unwrap().0, 200);
    stack.stop().await;
}

#[tokio::test]
async fn a_tenant_far_over_its_share_leaves_a_seat_for_the_others() {
    let stack = Stack::start(
        "flow-share",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 2;
            c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
        },
    )
    .await;
    assert_eq!(send_as(&stack, "", Some("quiet")).await.unwrap().0, 200);
    for _ in 0..4 {
        assert_eq!(send_as(&stack, "", Some("noisy")).await.unwrap().0, 200);
    }
    let first = stack
        .client
        .post(stack.url("/v1/completions"))
        .header("x-tenant", "noisy")
        .json(&json!({"prompt": "hold", "max_tokens": 500, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut holding = first.bytes_stream();
    holding.next().await.unwrap().unwrap();
    // One seat is free, but noisy is far over its share: it is kept.
    let noisy = send_as(&stack, "", Some("noisy"));
    metric_reaches(&stack, "kvroute_flow_queued", 1.0).await;
    let quiet = send_as(&stack, "", Some("quiet")).await.unwrap();
    assert_eq!(quiet.0, 200, "the seat kept was there for quiet");
    drop(holding);
    let noisy = noisy.await.unwrap();
    assert_eq!(noisy.0, 200);
    assert!(
        quiet.1 < noisy.1,
        "quiet went ahead of noisy's held request"
    );
    stack.stop().await;
}

#[tokio::test]
async fn tenants_take_turns_whoever_queued_more() {
    let stack = Stack::start(
        "flow-fair",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 1;
            c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
            // Turns alone: with one seat, room kept for the lighter tenant
            // would hold noisy back until the window passes.
            c.flow_control.reserve_window_ms = 0;
        },
    )
    .await;
    let holding = hold_a_seat(&stack).await;
    let mut noisy = Vec::new();
    for n in 1..=3 {
        noisy.push(send_as(&stack, "", Some("noisy")));
        metric_reaches(&stack, "kvroute_flow_queued", f64::from(n)).await;
    }
    let quiet = send_as(&stack, "", Some("quiet"));
    metric_reaches(&stack, "kvroute_flow_queued", 4.0).await;
    drop(holding);
    let quiet = quiet.await.unwrap();
    let mut noisy_done = Vec::new();
    for n in noisy {
        noisy_done.push(n.await.unwrap());
    }
    assert!(noisy_done.iter().chain([&quiet]).all(|(s, _)| *s == 200));
    // noisy's first, then quiet's, then noisy's others.
    assert!(noisy_done[0].1 < quiet.1, "noisy's first went first");
    assert!(
        quiet.1 < noisy_done[1].1,
        "quiet's went before noisy's second"
    );
    stack.stop().await;
}

#[tokio::test]
async fn a_request_no_endpoint_can_start_within_its_wait_limit_gets_429() {
    let stack = Stack::start(
        "flow-wait",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 1;
            c.flow_control.max_wait_ms = 200;
        },
    )
    .await;
    let holding = hold_a_seat(&stack).await;
    let r = stack
        .post(
            "/v1/completions",
            json!({"prompt": "late", "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["code"], "flow_wait_limit");
    drop(holding);
    stack.stop().await;
}

#[tokio::test]
async fn a_request_waits_at_the_router_while_the_engine_is_predicted_busy() {
    // One engine prefilling a long prompt for about a second: a second
    // request would wait there; it waits at the router instead, under no
    // concurrency limit, and is sent when the prefill is done.
    let stack = Stack::start(
        "flow-predicted",
        1,
        true,
        |c| c.prefill_tokens_per_s = 2000.0,
        |_| {},
    )
    .await;
    stack.wait_live().await;
    let long = tokio::spawn({
        let r = stack
            .client
            .post(stack.url("/v1/chat/completions"))
            .json(&chat(&long_text(1), "summarize", 1));
        async move { r.send().await.unwrap().status().as_u16() }
    });
    eventually("the long prompt is in flight", || {
        stack.router.pool.status().iter().any(|e| e.in_flight == 1)
    })
    .await;
    let short = send(&stack, "");
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"0\"}", 1.0).await;
    assert_eq!(long.await.unwrap(), 200);
    assert_eq!(short.await.unwrap().0, 200);
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_flow_dispatched_total{reason=\"after_wait\"}"
        ),
        1.0
    );
    stack.stop().await;
}

#[tokio::test]
async fn a_held_request_gets_503_with_retry_after_when_the_router_shuts_down() {
    let stack = Stack::start(
        "flow-shutdown",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 1;
            c.flow_control.reserve_window_ms = 0;
        },
    )
    .await;
    let mut holding = hold_a_seat(&stack).await;
    let held = stack
        .client
        .post(stack.url("/v1/completions"))
        .json(&json!({"prompt": "held", "max_tokens": 1}))
        .send();
    let held = tokio::spawn(held);
    metric_reaches(&stack, "kvroute_flow_queued{priority=\"0\"}", 1.0).await;

    let Stack {
        sims, router, dir, ..
    } = stack;
    let shutdown = tokio::spawn(router.shutdown());
    let r = held.await.unwrap().unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["code"], "router_shutting_down");
    // The stream in flight still flows while the router drains.
    holding.next().await.unwrap().unwrap();
    drop(holding);
    shutdown.await.unwrap();
    for s in sims {
        s.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_request_an_engine_refuses_for_memory_waits_at_the_router() {
    // One engine whose KV memory a long decode sent behind the router's
    // back fills (no load reports: the router does not know). The request
    // is refused with the engine's load, and then waits here, not in the
    // engine, until the prediction says the blocks are free.
    let stack = Stack::start("flow-refused", 1, false, small_memory, |_| {}).await;
    let hog = hog(&stack, 2.0).await;
    let r = stack
        .post("/v1/chat/completions", chat(&long_text(1), "go", 2))
        .await;
    assert_eq!(r.status(), 200);
    let metrics = stack.metrics().await;
    // On a loaded machine the engine can free the hog's blocks later than
    // its own report predicts: then it refuses again, and the request
    // is planned again (held, or sent at once if the new report says so).
    let refusals = sum_of(&metrics, "kvroute_admission_refusals_total");
    let waited = sum_of(
        &metrics,
        "kvroute_flow_dispatched_total{reason=\"after_wait\"}",
    );
    assert!(
        refusals >= 1.0 && waited >= 1.0 && waited <= refusals,
        "{metrics}"
    );
    assert_eq!(hog.await.unwrap().0, 200);
    stack.stop().await;
}

#[tokio::test]
async fn a_held_request_spills_once_waiting_costs_what_its_warm_endpoint_saves() {
    // A `latencySlack` of 0: waiting is worth no saved prefill. The warm
    // endpoint is the fastest by prediction, but busy prefilling; the
    // request is held for it only until another endpoint can start it.
    let stack = Stack::start(
        "flow-spill",
        2,
        true,
        |c| c.prefill_tokens_per_s = 2000.0,
        |c| {
            let slack = kvroute_core::policy::KvrouteConfig {
                latency_slack: 0.0,
                ..Default::default()
            };
            c.routing.policy = kvroute_core::policy::PolicyConfig::Kvroute(slack);
        },
    )
    .await;
    stack.wait_live().await;
    let system = long_text(3);
    let warm = stack.warm(&system).await;
    stack.wait_idle().await;
    // A shorter prefill than the whole prompt's, behind the same prefix:
    // it goes to the warm endpoint and keeps it busy for a while.
    let busy = tokio::spawn({
        let suffix = &long_text(4)[..2000];
        let r = (stack.client.post(stack.url("/v1/chat/completions"))).json(&chat(
            &format!("{system}{suffix}"),
            "busy",
            1,
        ));
        async move {
            let r = r.send().await.unwrap();
            r.headers()["x-kvroute-endpoint"]
                .to_str()
                .unwrap()
                .to_owned()
        }
    });
    eventually("the warm endpoint is predicted busy", || {
        let status = stack.router.pool.status();
        status
            .iter()
            .any(|e| e.in_flight == 1 && e.queue_seconds > 0.0)
    })
    .await;
    let r = stack
        .post("/v1/chat/completions", chat(&system, "next", 1))
        .await;
    assert_eq!(r.status(), 200);
    let endpoint = r.headers()["x-kvroute-endpoint"].to_str().unwrap();
    assert_ne!(
        endpoint, warm,
        "spilled to the endpoint that could start it"
    );
    assert_eq!(busy.await.unwrap(), warm);
    let metrics = stack.metrics().await;
    let spilled = "kvroute_flow_dispatched_total{reason=\"spilled\"}";
    assert_eq!(sum_of(&metrics, spilled), 1.0);
    stack.stop().await;
}

#[tokio::test]
async fn an_engine_refuses_a_lower_priority_that_would_take_the_room_kept() {
    // One engine whose KV memory a long decode sent behind the router's
    // back fills (no load reports), as another router replica's requests
    // do. A priority-10 request in the window: a lower one must leave room
    // for one as large. The router, not knowing, sends it with that room;
    // the engine refuses it (its own blocks fit, the room does not), and
    // it waits at the router until the blocks are free.
    let objectives = |c: &mut kvroute_router::config::Config| {
        c.objectives = vec![objective("interactive", 10)];
    };
    let stack = Stack::start("flow-room-refused", 1, false, small_memory, objectives).await;
    let high = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .header("x-gateway-inference-objective", "interactive")
        .json(&chat(&long_text(1), "go", 2));
    assert_eq!(high.send().await.unwrap().status(), 200);
    let hog = hog(&stack, 4.0).await;
    let (status, _) = send(&stack, "").await.unwrap();
    assert_eq!(status, 200, "{}", stack.metrics().await);
    let metrics = stack.metrics().await;
    let refusals = sum_of(&metrics, "kvroute_admission_refusals_total");
    let waited = sum_of(
        &metrics,
        "kvroute_flow_dispatched_total{reason=\"after_wait\"}",
    );
    assert!(refusals >= 1.0 && waited >= 1.0, "{metrics}");
    assert_eq!(hog.await.unwrap().0, 200);
    stack.stop().await;
}

#[tokio::test]
async fn a_tenant_over_its_share_waiting_for_memory_does_not_hold_back_the_others() {
    // One engine whose KV memory a long decode sent behind the router's
    // back fills. The noisy tenant's large request waits for it; a quiet
    // tenant's small one, which fits beside the decode, goes ahead.
    let tenancy = |c: &mut kvroute_router::config::Config| {
        c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
    };
    // The decode leaves a few blocks free: too few for the noisy one's
    // 15, enough for the quiet one's 1.
    let smaller = |c: &mut kvroute_engine_sim::Config| {
        small_memory(c);
        c.num_gpu_blocks = 110;
    };
    let stack = Stack::start("flow-share-memory", 1, false, smaller, tenancy).await;
    assert_eq!(send_as(&stack, "", Some("quiet")).await.unwrap().0, 200);
    // Far over its share, even after the quiet tenant's next request.
    for _ in 0..10 {
        assert_eq!(send_as(&stack, "", Some("noisy")).await.unwrap().0, 200);
    }
    let hog = hog(&stack, 4.0).await;
    let large = (stack.client.post(stack.url("/v1/chat/completions")))
        .header("x-tenant", "noisy")
        .json(&chat(&long_text(1)[..800], "go", 2));
    let noisy = tokio::spawn(async move { large.send().await.unwrap().status().as_u16() });
    metric_reaches(&stack, "kvroute_flow_queued", 1.0).await;
    let quiet = send_as(&stack, "", Some("quiet")).await.unwrap();
    assert_eq!(quiet.0, 200);
    let (status, ended) = hog.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        quiet.1 < ended,
        "the quiet request waited for the decode the noisy one waits for"
    );
    assert_eq!(noisy.await.unwrap(), 200);
    stack.stop().await;
}

#[tokio::test]
async fn a_tenant_that_fills_the_queue_makes_room_for_another_of_its_priority() {
    let stack = Stack::start(
        "flow-displace",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| {
            c.limits.endpoint_concurrency = 1;
            c.flow_control.max_queued = 20;
            c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
        },
    )
    .await;
    let holding = hold_a_seat(&stack).await;
    let noisy: Vec<_> = (0..20)
        .map(|_| send_as(&stack, "", Some("noisy")))
        .collect();
    metric_reaches(&stack, "kvroute_flow_queued", 20.0).await;
    // Each of quiet's takes the place of noisy's newest.
    let quiet: Vec<_> = (0..5).map(|_| send_as(&stack, "", Some("quiet"))).collect();
    metric_reaches(
        &stack,
        "kvroute_flow_shed_total{priority=\"0\",reason=\"flow_queue_full\"}",
        5.0,
    )
    .await;
    assert_eq!(gauge(&stack, "kvroute_flow_queued").await, 20.0);
    drop(holding);
    for q in quiet {
        assert_eq!(q.await.unwrap().0, 200);
    }
    let mut statuses = Vec::new();
    for n in noisy {
        statuses.push(n.await.unwrap().0);
    }
    statuses.sort();
    assert_eq!(statuses, [[200; 15].as_slice(), &[429; 5]].concat());
    stack.stop().await;
}
