//! Prefill/decode disaggregation through the HTTP front end: the prefill
//! leg on a prefill endpoint, the decode leg on a decode endpoint that
//! reads its blocks, over real engine sims; the legs as vLLM's proxy sends
//! them; fallbacks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use kvroute_core::spec::{Disaggregation, DisaggregationMode};
use kvroute_engine_sim::transfer::Role;
use kvroute_engine_sim::{Config as SimConfig, Sim};
use kvroute_router::config::Config;
use serde_json::{Value, json};

use crate::support::*;

/// A prefill sim and a decode sim (exact mode), and a router disaggregating
/// from `min_uncached_tokens` (`None`: disabled).
async fn split_stack(name: &str, min_uncached_tokens: Option<u64>) -> Stack {
    split_stack_with(name, min_uncached_tokens, |_| {}, |_| {}).await
}

/// [`split_stack`] with the prefill sim's and the router's configuration
/// tuned.
async fn split_stack_with(
    name: &str,
    min_uncached_tokens: Option<u64>,
    prefill: impl FnOnce(&mut SimConfig),
    tune: impl FnOnce(&mut Config),
) -> Stack {
    let sim = |role, tune: Box<dyn FnOnce(&mut SimConfig)>| async move {
        let mut c = SimConfig::test();
        c.kv_role = role;
        tune(&mut c);
        kvroute_engine_sim::start(c).await.unwrap()
    };
    let sims = vec![
        sim(Role::Producer, Box::new(prefill)).await,
        sim(Role::Consumer, Box::new(|_| {})).await,
    ];
    let dir = temp_dir(name);
    write_roles(&dir, &[(&sims[0], "prefill"), (&sims[1], "decode")]);
    let mut config = router_config(&dir);
    tune(&mut config);
    if let Some(min) = min_uncached_tokens {
        config.routing.disaggregation = Disaggregation {
            mode: DisaggregationMode::Auto,
            min_uncached_tokens: min,
        };
    }
    let router = kvroute_router::start(config).await.unwrap();
    let stack = Stack {
        sims,
        router,
        dir,
        client: reqwest::Client::new(),
    };
    stack.wait_live().await;
    stack
}

/// The endpoints file: each sim (`prefill-0`, `decode-1`, …) with its role.
fn write_roles(dir: &std::path::Path, sims: &[(&Sim, &str)]) {
    let mut yaml = String::from("endpoints:\n");
    for (i, (s, role)) in sims.iter().enumerate() {
        yaml += &format!(
            "  - {{name: {role}-{i}, address: '{}', cachePort: {}, role: {role}}}\n",
            s.http_addr,
            s.cache_addr.port()
        );
    }
    std::fs::write(dir.join("endpoints.yaml"), yaml).unwrap();
}

/// A sample of `sample` (name and labels) on `sim`'s /metrics, or 0.
async fn sim_metric(sim: &Sim, sample: &str) -> f64 {
    let text = get_text(&format!("http://{}/metrics", sim.http_addr)).await;
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn requests_seen(sim: &Sim) -> f64 {
    sim_metric(
        sim,
        "vllm:request_success_total{model_name=\"kvroute-sim\",finished_reason=\"length\"}",
    )
    .await
}

fn disaggregated(metrics: &str, result: &str) -> f64 {
    sum_of(
        metrics,
        &format!("kvroute_disaggregated_requests_total{{result=\"{result}\"}}"),
    )
}

#[tokio::test]
async fn a_long_prompt_is_prefilled_on_a_prefill_endpoint_and_decoded_where_its_blocks_go() {
    let stack = split_stack("split", Some(64)).await;
    let body = chat(&long_text(1), "hi", 3);
    // Explain shows both choices.
    let explained: Value = stack
        .client
        .post(format!("http://{}/debug/explain", stack.router.admin_addr))
        .json(&json!({"path": "/v1/chat/completions", "body": body}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        explained["decision"]["ranked"],
        json!(["decode-1"]),
        "{explained}"
    );
    assert_eq!(
        explained["decision"]["prefill"]["ranked"],
        json!(["prefill-0"])
    );
    assert_eq!(explained["decision"]["prefill"]["min_uncached_tokens"], 64);
    let r = stack.post("/v1/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-endpoint"], "decode-1");
    let done: Value = r.json().await.unwrap();
    let prompt_tokens = done["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(done["usage"]["completion_tokens"], 3);
    assert_eq!(
        done["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1,
        "the decode endpoint loaded the prompt: {done}"
    );
    assert_eq!(done.get("kv_transfer_params"), Some(&Value::Null));
    let (prefill, decode) = (&stack.sims[0], &stack.sims[1]);
    assert_eq!(
        sim_metric(decode, "kvroute_sim_kv_transfers_total{result=\"ok\"}").await,
        1.0
    );
    assert_eq!(requests_seen(prefill).await, 1.0);
    // What the cache saved is the prefill leg's: the prefill endpoint
    // computed the cold prompt (its missed tokens are attributed there);
    // the decode leg loaded it and is not counted again.
    let missed =
        kvroute_testkit::eventually("the prefill leg", Duration::from_secs(10), || async {
            let metrics = stack.metrics().await;
            let total = sum_of(&metrics, "kvroute_missed_prompt_tokens_total");
            (total == prompt_tokens as f64).then_some(metrics)
        })
        .await;
    let observed = |family| sum_of(&missed, family);
    assert_eq!(
        observed("kvroute_observed_prompt_tokens_total"),
        prompt_tokens as f64
    );
    assert_eq!(observed("kvroute_observed_cached_tokens_total"), 0.0);
    let cold = (missed.lines())
        .filter(|l| {
            l.starts_with("kvroute_missed_prompt_tokens_total{") && l.contains("cause=\"cold\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert!(cold >= (prompt_tokens - 16) as f64, "{missed}");

    // Streamed: the decode leg streams back.
    let mut streamed = chat(&long_text(2), "hi", 3);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = stack.post("/v1/chat/completions", streamed).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains("\"cached_tokens\""), "{text}");
    assert_eq!(
        sim_metric(decode, "kvroute_sim_kv_transfers_total{result=\"ok\"}").await,
        2.0
    );

    // A short prompt runs whole on the decode endpoint.
    let r = stack
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 1}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        requests_seen(prefill).await,
        2.0,
        "the prefill endpoint saw no third leg"
    );

    // n > 1 is not disaggregated.
    let mut many = chat(&long_text(3), "hi", 1);
    many["n"] = json!(2);
    stack.post("/v1/chat/completions", many).await;
    assert_eq!(requests_seen(prefill).await, 2.0);

    let metrics = stack.metrics().await;
    assert_eq!(disaggregated(&metrics, "disaggregated"), 2.0, "{metrics}");
    assert_eq!(disaggregated(&metrics, "local_below_threshold"), 1.0);
    assert_eq!(sum_of(&metrics, "kvroute_prefill_leg_seconds_count"), 2.0);
    assert_eq!(
        sum_of(&metrics, "kvroute_kv_transfer_ttft_share_count"),
        2.0,
        "each disaggregated request's decode leg share of its TTFT"
    );
    let share = sum_of(&metrics, "kvroute_kv_transfer_ttft_share_sum");
    assert!(share > 0.0 && share < 2.0, "{share}");

    // A client's own kv_transfer_params is refused, naming the field.
    let mut hostile = chat("x", "y", 1);
    hostile["kv_transfer_params"] =
        json!({"do_remote_prefill": true, "remote_host": "169.254.169.254", "remote_port": 80});
    let r = stack.post("/v1/chat/completions", hostile).await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("kv_transfer_params"));
    stack.stop().await;
}

#[tokio::test]
async fn disabled_sends_nothing_to_prefill_endpoints() {
    let stack = split_stack("split-off", None).await;
    for i in 0..6 {
        let r = stack
            .post("/v1/chat/completions", chat(&long_text(i), "hi", 1))
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kvroute-endpoint"], "decode-1");
    }
    assert_eq!(requests_seen(&stack.sims[0]).await, 0.0);
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_disaggregated_requests_total"),
        0.0
    );
    stack.stop().await;
}

#[tokio::test]
async fn a_failed_prefill_leg_falls_back_to_a_local_prefill() {
    let stack = split_stack("split-fallback", Some(64)).await;
    let mut stack = stack;
    let prefill = stack.sims.remove(0);
    prefill.shutdown().await;
    let r = stack
        .post("/v1/chat/completions", chat(&long_text(4), "hi", 2))
        .await;
    assert_eq!(r.status(), 200);
    let done: Value = r.json().await.unwrap();
    assert_eq!(done["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let metrics = stack.metrics().await;
    assert_eq!(disaggregated(&metrics, "fallback_local"), 1.0, "{metrics}");
    stack.stop().await;
}

#[tokio::test]
async fn with_flow_control_a_prefill_leg_waits_for_its_prefill_endpoint() {
    // One seat per endpoint, and a prefill that takes 600 ms.
    let stack = split_stack_with(
        "split-flow",
        Some(64),
        |c| c.prefill_overhead_ms = 600.0,
        |c| {
            c.flow_control.enabled = true;
            c.limits.endpoint_concurrency = 1;
        },
    )
    .await;
    let send = |i: usize| {
        let (client, url) = (stack.client.clone(), stack.url("/v1/chat/completions"));
        tokio::spawn(async move {
            let r = client.post(url).json(&chat(&long_text(i), "hi", 1));
            r.send().await.unwrap().status().as_u16()
        })
    };
    let first = send(10);
    eventually("the first prefill leg runs", || {
        stack.router.pool.status().iter().any(|e| e.in_flight == 1)
    })
    .await;
    // The second's decode endpoint is free, its prefill endpoint is not.
    let second = send(11);
    kvroute_testkit::eventually("the second is held", Duration::from_secs(10), || async {
        let metrics = stack.metrics().await;
        (sum_of(&metrics, "kvroute_flow_queued") == 1.0).then_some(())
    })
    .await;
    assert_eq!((first.await.unwrap(), second.await.unwrap()), (200, 200));
    let metrics = stack.metrics().await;
    assert_eq!(disaggregated(&metrics, "disaggregated"), 2.0, "{metrics}");
    assert_eq!(requests_seen(&stack.sims[0]).await, 2.0);
    // The second's prefill leg, and maybe the first's decode leg, planned
    // again behind it.
    let after_wait = "kvroute_flow_dispatched_total{reason=\"after_wait\"}";
    assert!(sum_of(&metrics, after_wait) >= 1.0, "{metrics}");
    stack.stop().await;
}

/// What a fake engine received: each request's path, headers and body.
type Legs = Arc<Mutex<Vec<(String, HeaderMap, Value)>>>;

/// A fake engine that records what it receives and answers as vLLM with
/// NixlConnector would: a prefill leg with `kv_transfer_params` naming
/// itself (127.0.0.1), a decode leg with a completion.
async fn recording_engine(legs: Legs) -> std::net::SocketAddr {
    let params = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [1, 2],
                        "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "127.0.0.1",
                        "remote_port": 5600, "tp_size": 1});
    answering_engine(legs, params).await
}

/// [`recording_engine`] answering prefill legs with `params`.
async fn answering_engine(legs: Legs, params: Value) -> std::net::SocketAddr {
    use axum::extract::{Json, Request};
    let app = axum::Router::new().fallback(move |request: Request| {
        let (legs, params) = (legs.clone(), params.clone());
        async move {
            let (parts, body) = request.into_parts();
            let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let prefill = body["kv_transfer_params"]["do_remote_decode"] == true;
            legs.lock()
                .unwrap()
                .push((parts.uri.path().to_owned(), parts.headers, body));
            let params = if prefill { params } else { Value::Null };
            Json(json!({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": " a"}],
                        "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301},
                        "kv_transfer_params": params}))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// A prefill endpoint `p` and a decode endpoint `d`.
fn pd(
    prefill: std::net::SocketAddr,
    decode: std::net::SocketAddr,
) -> [(&'static str, std::net::SocketAddr, &'static str); 2] {
    [("p", prefill, "prefill"), ("d", decode, "decode")]
}

/// A router disaggregating every prompt (approximate mode: every prompt
/// uncached) among `endpoints` (name, address, role).
async fn legs_router(
    name: &str,
    endpoints: &[(&str, std::net::SocketAddr, &str)],
    tune: impl FnOnce(&mut Config),
) -> (kvroute_router::Running, std::path::PathBuf) {
    let dir = temp_dir(name);
    write_roled_endpoints(&dir, endpoints);
    let mut config: Config = router_config(&dir);
    config.routing.disaggregation = Disaggregation {
        mode: DisaggregationMode::Auto,
        min_uncached_tokens: 1,
    };
    tune(&mut config);
    let router = kvroute_router::start(config).await.unwrap();
    eventually("the endpoints are loaded", || {
        router.pool.status().len() == endpoints.len()
    })
    .await;
    (router, dir)
}

#[tokio::test]
async fn the_legs_are_vllms_proxys_legs() {
    let legs: Legs = Arc::default();
    let prefill = recording_engine(legs.clone()).await;
    let decode = recording_engine(legs.clone()).await;
    let (router, dir) = legs_router("split-legs", &pd(prefill, decode), |_| {}).await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", router.addr());

    // The client's request, with every field the proxy changes.
    let request = json!({
        "model": "m", "prompt": "a long prompt ".repeat(40), "stream": true,
        "stream_options": {"include_usage": true}, "max_tokens": 50, "max_completion_tokens": 50,
        "min_tokens": 5, "min_completion_tokens": 5, "temperature": 0.5,
    });
    let r = client
        .post(&url)
        .header("x-request-id", "req-42")
        // llm-d's headers naming where to prefill are the picker's.
        .header("x-prefiller-host-port", "10.9.9.9:8000")
        .header("x-prefiller-url", "http://10.9.9.9:8000")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let legs: Vec<_> = (legs.lock().unwrap().iter())
        .filter(|(path, ..)| path.starts_with("/v1/completions"))
        .cloned()
        .collect();
    assert_eq!(legs.len(), 2, "{legs:?}");
    // vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/
    // toy_proxy_server.py): the prefill leg ...
    let mut want_prefill = request.clone();
    let p = want_prefill.as_object_mut().unwrap();
    p.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    p.insert("stream".into(), json!(false));
    p.insert("max_tokens".into(), json!(1));
    p.insert("max_completion_tokens".into(), json!(1));
    for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
        p.remove(field);
    }
    // ... and the decode leg: the client's request with the prefill
    // answer's kv_transfer_params.
    let mut want_decode = request.clone();
    want_decode["kv_transfer_params"] = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [1, 2], "remote_engine_id": "e1", "remote_request_id": "r1",
        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1});
    assert_eq!(legs[0].0, "/v1/completions");
    assert_eq!(legs[0].2, want_prefill);
    assert_eq!(legs[1].0, "/v1/completions");
    assert_eq!(legs[1].2, want_decode);
    for (_, headers, _) in &legs {
        assert_eq!(headers["x-request-id"], "req-42");
        assert!(
            !headers.contains_key("x-prefiller-host-port"),
            "{headers:?}"
        );
        assert!(!headers.contains_key("x-prefiller-url"), "{headers:?}");
    }
    router.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn without_a_decode_capable_endpoint_a_request_is_503_with_retry_after() {
    let sim = kvroute_engine_sim::start(SimConfig::test()).await.unwrap();
    let dir = temp_dir("split-no-decode");
    write_roles(&dir, &[(&sim, "prefill")]);
    let mut config = router_config(&dir);
    config.routing.disaggregation = Disaggregation {
        mode: DisaggregationMode::Auto,
        min_uncached_tokens: 0,
    };
    let router = kvroute_router::start(config).await.unwrap();
    eventually("the endpoint is loaded", || router.pool.status().len() == 1).await;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", router.addr()))
        .json(&chat(&long_text(5), "hi", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    router.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_short_chat_an_idle_endpoint_can_start_is_not_held_behind_many_prefill_legs() {
    // The prefill endpoint's one seat taken by a prefill that lasts; the
    // decode endpoint idle.
    const HELD: usize = 300;
    let stack = split_stack_with(
        "split-head-of-line",
        Some(64),
        |c| c.prefill_overhead_ms = 120_000.0,
        |c| {
            c.flow_control.enabled = true;
            c.flow_control.max_wait_ms = 60_000;
            c.limits.endpoint_concurrency = 1;
        },
    )
    .await;
    let send = |body: Value| {
        let (client, url) = (stack.client.clone(), stack.url("/v1/chat/completions"));
        tokio::spawn(async move {
            client
                .post(url)
                .json(&body)
                .send()
                .await
                .map(|r| r.status())
        })
    };
    let mut long = vec![send(chat(&long_text(0), "hi", 1))];
    eventually("the first prefill leg runs", || {
        stack.router.pool.status().iter().any(|e| e.in_flight == 1)
    })
    .await;
    long.extend((1..=HELD).map(|i| send(chat(&long_text(i), "hi", 1))));
    // Each past its decode endpoint's gate (the first's prefill leg too),
    // and held for its prefill leg.
    kvroute_testkit::eventually("all are held", Duration::from_secs(60), || async {
        let metrics = stack.metrics().await;
        let dispatched = sum_of(&metrics, "kvroute_flow_dispatched_total");
        let queued = sum_of(&metrics, "kvroute_flow_queued");
        (dispatched == (HELD + 2) as f64 && queued == HELD as f64).then_some(())
    })
    .await;
    // Too short to split: only the decode endpoint, idle, is needed; it is
    // answered while every prefill leg is still held.
    let sent = std::time::Instant::now();
    let short = send(chat("short", "hi", 1)).await.unwrap().unwrap();
    assert_eq!(short, 200);
    eprintln!("the short chat behind {HELD} held: {:?}", sent.elapsed());
    let metrics = stack.metrics().await;
    assert_eq!(sum_of(&metrics, "kvroute_flow_queued"), HELD as f64);
    assert_eq!(sum_of(&metrics, "kvroute_flow_shed_total"), 0.0);
    for l in long {
        l.abort();
    }
    stack.stop().await;
}

/// A fake prefill engine that answers `/health` and never answers a
/// completion.
async fn hung_engine() -> std::net::SocketAddr {
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "" }))
        .fallback(std::future::pending::<()>);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// What a fake engine received at `/v1/completions`.
fn completions(legs: &Legs) -> Vec<(String, HeaderMap, Value)> {
    (legs.lock().unwrap().iter())
        .filter(|(path, ..)| path == "/v1/completions")
        .cloned()
        .collect()
}

fn fallbacks(metrics: &str, reason: &str) -> f64 {
    sum_of(
        metrics,
        &format!("kvroute_disaggregated_fallbacks_total{{reason=\"{reason}\"}}"),
    )
}

#[tokio::test]
async fn a_prefill_answer_naming_another_host_is_not_relayed() {
    let legs: Legs = Arc::default();
    // The prefill engine names a host that is not its own.
    let params = json!({"do_remote_prefill": true, "remote_block_ids": [1], "remote_engine_id": "e1",
                        "remote_host": "127.0.0.2", "remote_port": 5600});
    let prefill = answering_engine(legs.clone(), params).await;
    let decode = recording_engine(legs.clone()).await;
    let (router, dir) = legs_router("split-foreign-host", &pd(prefill, decode), |_| {}).await;
    let url = format!("http://{}/v1/completions", router.addr());
    let request = json!({"model": "m", "prompt": "a long prompt ".repeat(40), "max_tokens": 5});
    let r = reqwest::Client::new()
        .post(&url)
        .json(&request)
        .send()
        .await;
    assert_eq!(r.unwrap().status(), 200);
    let legs = completions(&legs);
    assert_eq!(legs.len(), 2, "{legs:?}");
    // The decode engine prefilled the client's request itself.
    assert_eq!(legs[1].2, request);
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(fallbacks(&metrics, "foreign_remote_host"), 1.0, "{metrics}");
    assert_eq!(disaggregated(&metrics, "fallback_local"), 1.0, "{metrics}");
    router.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn hung_prefill_legs_are_cut_at_a_one_token_deadline_and_the_decode_endpoint_prefills() {
    let legs: Legs = Arc::default();
    let (hung_a, hung_b) = (hung_engine().await, hung_engine().await);
    let decode = recording_engine(legs.clone()).await;
    let endpoints = [
        ("p0", hung_a, "prefill"),
        ("p1", hung_b, "prefill"),
        ("d", decode, "decode"),
    ];
    let (router, dir) = legs_router("split-hung", &endpoints, |c| {
        c.resilience.hung_after_ms = 1_000;
        c.limits.first_byte_timeout_ms = 120_000;
    })
    .await;
    let url = format!("http://{}/v1/completions", router.addr());
    let request = json!({"model": "m", "prompt": "a long prompt ".repeat(40), "max_tokens": 5});
    // Well before firstByteTimeoutMs: each leg is cut at its own deadline.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let sent = std::time::Instant::now();
    let r = client.post(&url).json(&request).send().await.unwrap();
    assert_eq!(r.status(), 200);
    eprintln!(
        "answered after two hung prefill legs in {:?}",
        sent.elapsed()
    );
    assert_eq!(completions(&legs)[0].2, request);
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(fallbacks(&metrics, "prefill_failed"), 1.0, "{metrics}");
    router.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_decode_legs_seat_is_taken_when_it_starts() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let legs: Legs = Arc::default();
    let prefill = recording_engine(legs.clone()).await;
    // A decode engine that answers in 100 ms and counts the most it held.
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let app = {
        let (now, most) = (now.clone(), most.clone());
        let completions = move || {
            let (now, most) = (now.clone(), most.clone());
            async move {
                most.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                axum::Json(json!({"id": "x", "object": "text_completion",
                    "choices": [{"index": 0, "text": " a"}],
                    "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301}}))
            }
        };
        axum::Router::new().route("/v1/completions", axum::routing::post(completions))
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let decode = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (router, dir) = legs_router("split-seats", &pd(prefill, decode), |c| {
        c.limits.endpoint_concurrency = 2;
        c.flow_control.enabled = true;
    })
    .await;
    let url = format!("http://{}/v1/completions", router.addr());
    let sent: Vec<_> = (0..12)
        .map(|i| {
            let body =
                json!({"model": "m", "prompt": format!("prompt {i} ").repeat(60), "max_tokens": 5});
            let r = reqwest::Client::new().post(&url).json(&body);
            tokio::spawn(async move { r.send().await.unwrap().status() })
        })
        .collect();
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    let most = most.load(Ordering::SeqCst);
    eprintln!("12 split requests: at most {most} at the decode endpoint at once");
    assert!(most <= 2, "{most} at once");
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(disaggregated(&metrics, "disaggregated"), 12.0, "{metrics}");
    router.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_body_the_router_cannot_read_is_refused_while_disaggregation_is_on() {
    let legs: Legs = Arc::default();
    let prefill = recording_engine(legs.clone()).await;
    let decode = recording_engine(legs.clone()).await;
    let (router, dir) = legs_router("split-unreadable", &pd(prefill, decode), |_| {}).await;
    // Python's JSON reads NaN; the router's does not.
    let body = r#"{"model": "m", "input": "hi", "temperature": NaN,
                   "kv_transfer_p\u0061rams": {"do_remote_prefill": true, "remote_host": "10.9.9.9"}}"#;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/responses", router.addr()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let sent = legs.lock().unwrap().clone();
    assert!(
        sent.iter().all(|(path, ..)| path != "/v1/responses"),
        "{sent:?}"
    );
    router.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
