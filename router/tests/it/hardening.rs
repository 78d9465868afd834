//! The router as an attacker or a flaky network would treat it: aborted
//! requests, spoofed tenants, unreadable bodies under salted tenancy, slow
//! and idle connections, too many connections, partial failure, a hung
//! engine, random model names, paths off the allow-list.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use kvroute_core::policy::PolicyConfig;
use kvroute_router::config::{HealthCheck, TenancyMode};
use proptest::prelude::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn in_flight(stack: &Stack) -> u32 {
    stack.router.pool.status().iter().map(|e| e.in_flight).sum()
}

/// Sends `body` and gives up after `after`, as a client timeout, a closed
/// tab or an HTTP/2 stream reset does. The wait is what is tested (a
/// request abandoned mid-way), not a wait for something to happen.
async fn abort_after(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    after: Duration,
) {
    let send = async {
        let r = client.post(url).json(body).send().await?;
        r.bytes().await
    };
    let _ = tokio::time::timeout(after, send).await;
}

#[tokio::test]
async fn aborted_requests_leave_no_load_over_http1_and_http2() {
    let stack = Stack::start(
        "abort",
        2,
        false,
        |c| c.extra_latency_ms = 300,
        |c| c.resilience.health_check = None,
    )
    .await;
    let url = stack.url("/v1/chat/completions");
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for stream in [false, true] {
        let mut body = chat("abort me", "now", 4);
        body["stream"] = json!(stream);
        for client in [&stack.client, &h2] {
            let aborts =
                (0..20).map(|_| abort_after(client, &url, &body, Duration::from_millis(50)));
            futures_util::future::join_all(aborts).await;
        }
    }
    eventually("every aborted request's load is released", || {
        in_flight(&stack) == 0
    })
    .await;
    assert!(
        stack
            .router
            .pool
            .status()
            .iter()
            .all(|e| e.prefill_tokens == 0)
    );
    let metrics = stack.metrics().await;
    assert!(metrics.contains("status=\"499\""), "{metrics}");
    // Nothing was ejected for what the clients did.
    assert!(!metrics.contains("kvroute_ejections_total"), "{metrics}");
    stack.stop().await;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3, ..ProptestConfig::default() })]

    /// Random aborts, at random points, over both protocols, streaming or
    /// not: once traffic stops every endpoint is back at zero.
    #[test]
    fn random_aborts_leave_every_endpoint_at_zero(
        plan in proptest::collection::vec((0u64..120, any::<bool>(), any::<bool>()), 10..30)
    ) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let stack = Stack::start(
                "random-aborts",
                2,
                false,
                |c| {
                    c.extra_latency_ms = 20;
                    c.itl_ms = 5.0;
                },
                |c| c.resilience.health_check = None,
            )
            .await;
            let url = stack.url("/v1/chat/completions");
            let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
            let requests = plan.iter().enumerate().map(|(i, &(after, stream, use_h2))| {
                let mut body = chat(&format!("prompt {i}"), "go", 8);
                body["stream"] = json!(stream);
                let client = if use_h2 { &h2 } else { &stack.client };
                let url = &url;
                async move { abort_after(client, url, &body, Duration::from_millis(after)).await }
            });
            futures_util::future::join_all(requests).await;
            eventually("in flight back to zero", || in_flight(&stack) == 0).await;
            stack.stop().await;
        });
    }
}

fn keys_file(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("keys.yaml");
    std::fs::write(&path, "k-alice: alice\nk-bob: bob\n").unwrap();
    path
}

#[tokio::test]
async fn a_tenant_header_cannot_override_the_api_key() {
    let dir = temp_dir("spoof-secrets");
    let keys = keys_file(&dir);
    std::fs::write(dir.join("secret"), "s3cret").unwrap();
    let stack = Stack::start(
        "spoof",
        1,
        true,
        |_| {},
        |c| {
            c.tenancy.mode = TenancyMode::Salted;
            c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
            c.tenancy.api_keys_file = Some(keys.clone());
            c.tenancy.secret_file = Some(dir.join("secret"));
        },
    )
    .await;
    stack.wait_live().await;
    let url = stack.url("/v1/chat/completions");
    let system = long_text(7);
    let send = |key: Option<&'static str>, tenant: Option<&'static str>| {
        let mut r = stack.client.post(&url).json(&chat(&system, "hi", 2));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        if let Some(t) = tenant {
            r = r.header("x-tenant", t);
        }
        r.send()
    };
    // Bob warms his prefix, and the router's index sees it.
    let before = stack.router.pool.index_entries();
    let r = send(Some("k-bob"), None).await.unwrap();
    assert_eq!(r.status(), 200);
    eventually("the index sees bob's blocks", || {
        stack.router.pool.index_entries() > before
    })
    .await;
    let cases = [
        (Some("k-alice"), Some("bob"), 403),
        (Some("wrong"), Some("bob"), 401),
        (None, Some("bob"), 401),
        (None, None, 401),
        (Some("k-bob"), Some("bob"), 200),
        (Some("k-alice"), Some("alice"), 200),
        (Some("k-alice"), None, 200),
    ];
    let mut alice_first = true;
    for (key, tenant, status) in cases {
        let r = send(key, tenant).await.unwrap();
        assert_eq!(r.status(), status, "key {key:?}, header {tenant:?}");
        if status == 200 && key == Some("k-alice") && std::mem::take(&mut alice_first) {
            let body: serde_json::Value = r.json().await.unwrap();
            let cached = &body["usage"]["prompt_tokens_details"]["cached_tokens"];
            assert_eq!(
                cached.as_u64().unwrap_or(0),
                0,
                "alice never reads bob's cache"
            );
        }
    }
    // The model list is behind the same rule.
    let models = stack.url("/v1/models");
    let r = stack.client.get(&models).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = stack
        .client
        .get(&models)
        .bearer_auth("k-alice")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    stack.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn salted_mode_refuses_bodies_it_cannot_read_on_every_path() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("salted-paths", upstream);
    std::fs::write(dir.join("secret"), "s3cret").unwrap();
    let mut config = router_config(&dir);
    config.tenancy.mode = TenancyMode::Salted;
    config.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
    config.tenancy.secret_file = Some(dir.join("secret"));
    config.resilience.health_check = None;
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    for body in [
        r#"{"input": "hi", "cache_salt": "mine", "temperature": NaN}"#,
        r#"{"input": "hi", "cache_salt": "mine", "temperature": 1e999}"#,
        r#"["not", "an", "object"]"#,
        "plain text",
    ] {
        let r = client
            .post(format!("http://{}/v1/responses", router.addr()))
            .header("x-tenant", "bob")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
    }
    // A readable body gets the tenant's salt, never the client's.
    let r = client
        .post(format!("http://{}/v1/responses", router.addr()))
        .header("x-tenant", "bob")
        .json(&json!({"input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let head = next_post(&mut heads).await;
    assert!(head.contains("\"cache_salt\":\""), "{head}");
    assert!(heads.try_recv().is_err(), "nothing refused was forwarded");
    router.shutdown().await;
}

#[tokio::test]
async fn private_connection_named_and_router_headers_are_not_forwarded() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("private-headers", upstream);
    let keys = keys_file(&dir);
    let start = |forward: bool| {
        let mut config = router_config(&dir);
        config.tenancy.tenant_header =
            Some(kvroute_router::config::Header::from_static("x-tenant"));
        config.tenancy.api_keys_file = Some(keys.clone());
        config.resilience.health_check = None;
        config.proxy.forward_authorization = forward;
        config.proxy.forward_tenant_header = forward;
        kvroute_router::start(config)
    };
    for forward in [false, true] {
        let router = start(forward).await.unwrap();
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", router.addr()))
            .bearer_auth("k-alice")
            .header("x-tenant", "alice")
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .header("x-kept", "1")
            .header("x-kvroute-admit-within-ms", "0")
            .header("X-Kvroute-Anything", "1")
            .json(&json!({"prompt": "hello"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let head = next_post(&mut heads).await;
        assert_eq!(
            header_of(&head, "authorization").is_some(),
            forward,
            "{head}"
        );
        assert_eq!(header_of(&head, "x-tenant").is_some(), forward, "{head}");
        assert!(header_of(&head, "x-hop").is_none(), "{head}");
        // The router's own headers: never a client's.
        assert!(header_of(&head, "x-kvroute-anything").is_none(), "{head}");
        let bound = header_of(&head, "x-kvroute-admit-within-ms");
        assert_ne!(bound.as_deref(), Some("0"), "{head}");
        assert!(header_of(&head, "x-kept").is_some(), "{head}");
        router.shutdown().await;
    }
}

#[tokio::test]
async fn only_allowed_paths_are_proxied() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("allowed-paths", upstream);
    for listed in [false, true] {
        let mut config = router_config(&dir);
        config.resilience.health_check = None;
        if listed {
            config
                .proxy
                .allowed_paths
                .push("/v1/load_lora_adapter".into());
        }
        let router = kvroute_router::start(config).await.unwrap();
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/load_lora_adapter", router.addr()))
            .json(&json!({"lora_name": "x", "lora_path": "/tmp/x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), if listed { 200 } else { 404 });
        if listed {
            assert!(
                next_post(&mut heads)
                    .await
                    .starts_with("POST /v1/load_lora_adapter")
            );
        } else {
            assert!(heads.try_recv().is_err());
        }
        router.shutdown().await;
    }
}

#[tokio::test]
async fn random_model_names_add_no_series() {
    let stack = Stack::start(
        "models",
        1,
        false,
        |_| {},
        |c| c.resilience.health_check = None,
    )
    .await;
    for i in 0..50 {
        let mut body = chat("hi", "there", 2);
        body["model"] = json!(format!("random-{i}-{}", "x".repeat(100)));
        let r = stack.post("/v1/chat/completions", body).await;
        assert_eq!(r.status(), 404);
    }
    let r = stack
        .post("/v1/chat/completions", chat("hi", "there", 2))
        .await;
    assert_eq!(r.status(), 200);
    let metrics = stack.metrics().await;
    assert!(!metrics.contains("random-"), "{metrics}");
    assert!(
        metrics.contains("kvroute_requests_total{model=\"unknown\",status=\"404\"} 50"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_requests_total{model=\"kvroute-sim\",status=\"200\"} 1"),
        "{metrics}"
    );
    stack.stop().await;
}

/// Reads until the peer closes; `true` when it did before the deadline.
async fn closed_by_peer(tcp: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn slow_idle_and_excess_connections_are_closed() {
    let stack = Stack::start(
        "conns",
        1,
        false,
        |_| {},
        |c| {
            c.resilience.health_check = None;
            c.limits.header_read_timeout_ms = 300;
            c.limits.idle_timeout_ms = 300;
            c.limits.body_read_timeout_ms = 300;
            c.limits.max_connections = 4;
        },
    )
    .await;
    let addr = stack.router.addr();
    // Half-sent headers.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    assert!(
        closed_by_peer(&mut slow).await,
        "half-sent headers time out"
    );
    // A trickled body: 408.
    let mut trickle = TcpStream::connect(addr).await.unwrap();
    trickle
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\":")
        .await
        .unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), trickle.read_to_end(&mut response)).await;
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    // An idle keep-alive connection.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(
        closed_by_peer(&mut idle).await,
        "idle connections are closed"
    );
    stack.stop().await;
}

#[tokio::test]
async fn at_the_cap_a_new_connection_closes_an_idle_one_or_is_closed() {
    let stack = Stack::start(
        "busy-conns",
        1,
        false,
        |c| c.extra_latency_ms = 5_000,
        |c| {
            c.resilience.health_check = None;
            c.limits.max_connections = 4;
        },
    )
    .await;
    // Four connections with no request in progress (half-sent headers):
    // a fifth closes the oldest of them and is served.
    let addr = stack.router.addr();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        held.push(c);
    }
    let mut fifth = TcpStream::connect(addr).await.unwrap();
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), fifth.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    assert!(closed_by_peer(&mut held[0]).await, "the oldest was closed");
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kvroute_connections_evicted_total{listener=\"api\"} 1"),
        "{metrics}"
    );
    drop(held);
    drop(fifth);
    // Four connections with requests in progress: a fifth is closed at
    // once.
    let body = serde_json::to_string(&chat("busy", "hold on", 1)).unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        c.write_all(request.as_bytes()).await.unwrap();
        held.push(c);
    }
    eventually("four requests in flight", || in_flight(&stack) == 4).await;
    let mut excess = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(2), excess.read(&mut buf))
        .await
        .expect("closed at once")
        .unwrap_or(0);
    assert_eq!(n, 0);
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains(
            "kvroute_connections_refused_total{listener=\"api\",reason=\"max_connections\"}"
        ),
        "{metrics}"
    );
    drop(held);
    stack.stop().await;
}

#[tokio::test]
async fn uniform_partial_failure_is_not_an_outage() {
    let stack = Stack::start(
        "partial",
        4,
        false,
        |c| c.fail_rate = 0.5,
        |c| {
            c.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
            c.resilience.health_check = None;
        },
    )
    .await;
    let mut ok = 0;
    let n = 200;
    for i in 0..n {
        let r = stack
            .post(
                "/v1/completions",
                json!({"prompt": format!("p{i}"), "max_tokens": 1}),
            )
            .await;
        ok += usize::from(r.status() == 200);
        let ejected = stack
            .router
            .pool
            .status()
            .iter()
            .filter(|e| e.ejected)
            .count();
        assert!(ejected <= 2, "at most half ejected, got {ejected}");
    }
    let share = ok as f64 / n as f64;
    eprintln!("uniform 50% failure: {ok} of {n} succeeded ({share:.3})");
    // Three attempts at 50 % each, on the two endpoints left when two are
    // ejected: 87.5 % expected (before the cap: about 1 %).
    assert!(share > 0.75, "{ok} of {n}");
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kvroute_ejections_refused_total"),
        "{metrics}"
    );
    stack.stop().await;
}

#[tokio::test]
async fn a_hung_engine_is_ejected_by_health_checks_and_restored() {
    let StuckBesideHealthy {
        hung,
        posts: _,
        healthy,
        dir: _,
        mut config,
    } = StuckBesideHealthy::start("hung", |_| true).await;
    config.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
    config.resilience.health_check = Some(HealthCheck {
        path: "/health".into(),
        interval_ms: 100,
        timeout_ms: 100,
        unhealthy_threshold: 2,
    });
    let router = kvroute_router::start(config).await.unwrap();
    let ejected = |router: &kvroute_router::Running| {
        router
            .pool
            .status()
            .iter()
            .find(|e| e.name == "a-stuck")
            .unwrap()
            .ejected
    };
    eventually("the hung engine is ejected", || ejected(&router)).await;
    for _ in 0..4 {
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", router.addr()))
            .json(&json!({"prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-kvroute-endpoint"], "b-healthy");
    }
    hung.store(false, Ordering::SeqCst);
    eventually("restored once it answers", || !ejected(&router)).await;
    let metrics = reqwest::get(format!("http://{}/metrics", router.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_ejections_total{reason=\"health_check\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_restorations_total{reason=\"health_check\"} 1"),
        "{metrics}"
    );
    router.shutdown().await;
    healthy.shutdown().await;
}

#[tokio::test]
async fn bodies_over_the_tokenize_limit_are_routed_untokenized_and_counted() {
    let stack = Stack::start(
        "tokenize-limit",
        2,
        true,
        |_| {},
        |c| {
            c.resilience.health_check = None;
            c.limits.max_tokenize_bytes = 1024;
        },
    )
    .await;
    stack.wait_live().await;
    let r = stack
        .post("/v1/chat/completions", chat(&long_text(1), "hi", 2))
        .await;
    assert_eq!(r.status(), 200);
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_prompts_not_tokenized_total"),
        1.0,
        "{metrics}"
    );
    stack.stop().await;
}

#[tokio::test]
async fn an_engine_timeout_releases_its_load() {
    let stack = Stack::start(
        "engine-timeout",
        1,
        false,
        |c| c.extra_latency_ms = 2000,
        |c| {
            c.resilience.health_check = None;
            c.resilience.attempts = 1;
            c.limits.first_byte_timeout_ms = 100;
        },
    )
    .await;
    let r = stack
        .post("/v1/chat/completions", chat("slow", "engine", 2))
        .await;
    assert_eq!(r.status(), 504);
    assert_eq!(in_flight(&stack), 0);
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kind=\"timeout\"} 1"),
        "counted against the engine: {metrics}"
    );
    stack.stop().await;
}
