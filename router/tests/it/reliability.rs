//! Retries, ejection, broken streams, disconnects and the error paths.

use crate::support::*;
use futures_util::StreamExt;
use kvroute_core::policy::PolicyConfig;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_failing_endpoint_is_retried_then_ejected_then_readmitted() {
    let mut config = kvroute_engine_sim::Config::test();
    config.fail_rate = 1.0;
    let failing = kvroute_engine_sim::start(config).await.unwrap();
    let healthy = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let dir = temp_dir("eject");
    write_endpoints(&dir, &[&failing, &healthy], false);
    let mut config = router_config(&dir);
    config.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
    config.resilience.eject_after_failures = 2;
    config.resilience.ejection_base_ms = 2000;
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", router.addr());
    for _ in 0..4 {
        let r = client
            .post(&url)
            .json(&json!({"prompt": "hello", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "retried on the healthy endpoint");
        assert_eq!(r.headers()["x-kvroute-endpoint"], "sim-1");
    }
    let ejected = |router: &kvroute_router::Running| {
        router
            .pool
            .status()
            .iter()
            .find(|e| e.name == "sim-0")
            .unwrap()
            .ejected
    };
    assert!(ejected(&router), "two failures in a row eject");
    eventually("re-admitted once the ejection passes", || !ejected(&router)).await;
    let metrics = reqwest::get(format!("http://{}/metrics", router.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_routing_decisions_total{reason=\"retry\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_upstream_failures_total{endpoint=\"sim-0\",kind=\"status\"} 2")
    );
    router.shutdown().await;
    failing.shutdown().await;
    healthy.shutdown().await;
}

/// An upstream that answers with headers and one SSE event, then dies.
async fn dying_upstream() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = vec![0u8; 65536];
            let _ = socket.read(&mut buf).await;
            let event = "data: {\"choices\": [{\"index\": 0, \"text\": \" one\"}]}\n\n";
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let chunk = format!("{:x}\r\n{event}\r\n", event.len());
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(chunk.as_bytes()).await;
            let _ = socket.flush().await;
            // Die mid-stream: close without the final chunk.
        }
    });
    addr
}

#[tokio::test]
async fn a_stream_that_breaks_is_not_retried_ends_with_an_error_event_and_ejects() {
    let dying = dying_upstream().await;
    let healthy = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let dir = temp_dir("dying");
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!("endpoints:\n  - {{name: a-dying, address: {dying}}}\n  - {{name: b-healthy, address: {}}}\n", healthy.http_addr),
    )
    .unwrap();
    let mut config = router_config(&dir);
    config.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
    // Passive ejection alone: a passing check would restore it.
    config.resilience.health_check = None;
    let router = kvroute_router::start(config).await.unwrap();
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", router.addr()))
        .json(&json!({"prompt": "hello", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-endpoint"], "a-dying");
    let text = r.text().await.unwrap();
    assert!(
        text.starts_with("data: {\"choices\""),
        "the first event passed through: {text}"
    );
    assert!(
        text.contains("\"code\":\"upstream_stream_error\""),
        "{text}"
    );
    assert!(!text.contains("[DONE]"));
    let status = router.pool.status();
    assert!(status.iter().find(|e| e.name == "a-dying").unwrap().ejected);
    // Nothing was retried on the healthy engine after the first byte.
    let m = reqwest::get(format!("http://{}/metrics", healthy.http_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("vllm:prompt_tokens_total{model_name=\"kvroute-sim\"} 0"),
        "{m}"
    );
    // The broken stream is counted as an error, not as its 200.
    let ours = reqwest::get(format!("http://{}/metrics", router.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(ours.contains("status=\"stream_error\"} 1"), "{ours}");
    assert!(!ours.contains("status=\"200\""), "{ours}");
    router.shutdown().await;
    healthy.shutdown().await;
}

#[tokio::test]
async fn streaming_passes_through_incrementally() {
    let stack = Stack::start("stream", 1, false, |c| c.itl_ms = 300.0, |_| {}).await;
    let r = stack
        .post("/v1/completions", json!({"prompt": "hello", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}))
        .await;
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"));
    let engine = &stack.sims[0];
    let produced = engine.engine.metrics_text();
    let generated: u64 = produced
        .lines()
        .find_map(|l| l.strip_prefix("vllm:generation_tokens_total{model_name=\"kvroute-sim\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        generated < 5,
        "{generated} tokens generated before the first chunk reached the client"
    );
    let mut rest = first.to_vec();
    while let Some(chunk) = body.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(rest).unwrap();
    // Unchanged: the engine's own events, in order.
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 5 + 1 + 1, "5 tokens, usage, [DONE]: {text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let usage: Value = serde_json::from_str(events[5].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    stack.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_frees_its_slot_upstream() {
    let stack = Stack::start("leave", 1, false, |c| c.itl_ms = 200.0, |_| {}).await;
    let r = stack
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 50, "stream": true}),
        )
        .await;
    let mut body = r.bytes_stream();
    body.next().await.unwrap().unwrap();
    assert_eq!(stack.router.pool.status()[0].in_flight, 1);
    drop(body);
    let pool = stack.router.pool.clone();
    eventually("the router's slot is freed", || {
        pool.status()[0].in_flight == 0
    })
    .await;
    let engine = stack.sims[0].engine.clone();
    eventually("the engine stops the request", || {
        engine
            .metrics_text()
            .contains("vllm:num_requests_running{model_name=\"kvroute-sim\"} 0")
    })
    .await;
    stack.stop().await;
}

#[tokio::test]
async fn error_paths_have_openai_bodies() {
    let stack = Stack::start(
        "errors",
        1,
        false,
        |c| c.itl_ms = 400.0,
        |c| {
            c.limits.max_body_bytes = 2048;
            c.limits.endpoint_concurrency = 1;
            c.flow_control.max_queued = 0;
        },
    )
    .await;
    let check = |status: u16, code: &'static str| {
        move |(s, body): (u16, Value)| {
            assert_eq!(s, status, "{body}");
            assert_eq!(body["error"]["code"], code, "{body}");
            assert!(body["error"]["message"].is_string());
            assert!(body["error"]["type"].is_string());
        }
    };
    async fn send(stack: &Stack, path: &str, body: String) -> (u16, Value) {
        let r = stack
            .client
            .post(stack.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }
    check(400, "invalid_request")(send(&stack, "/v1/chat/completions", "{not json".into()).await);
    check(400, "invalid_request")(
        send(
            &stack,
            "/v1/chat/completions",
            "{\"model\": \"kvroute-sim\"}".into(),
        )
        .await,
    );
    check(404, "not_found")(
        send(
            &stack,
            "/v1/completions",
            json!({"model": "nope", "prompt": "x"}).to_string(),
        )
        .await,
    );
    check(404, "not_found")(send(&stack, "/nope", "{}".into()).await);
    check(413, "request_too_large")(
        send(
            &stack,
            "/v1/completions",
            json!({"prompt": "x".repeat(4096)}).to_string(),
        )
        .await,
    );

    // One slow stream holds the only slot; with no room to hold it, the next is 429.
    let hold = stack
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 20, "stream": true}),
        )
        .await;
    let mut held = hold.bytes_stream();
    held.next().await.unwrap().unwrap();
    let r = stack
        .post("/v1/completions", json!({"prompt": "y", "max_tokens": 1}))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    check(429, "flow_queue_full")((429, r.json().await.unwrap()));
    drop(held);
    stack.stop().await;

    // No endpoint at all: 503 with Retry-After, and not ready.
    let dir = temp_dir("empty");
    std::fs::write(dir.join("endpoints.yaml"), "endpoints: []\n").unwrap();
    let router = kvroute_router::start(router_config(&dir)).await.unwrap();
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", router.addr()))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    check(503, "no_ready_endpoint")((503, r.json().await.unwrap()));
    let ready = reqwest::get(format!("http://{}/readyz", router.addr()))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    router.shutdown().await;
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish() {
    let stack = Stack::start("shutdown", 1, false, |c| c.itl_ms = 100.0, |_| {}).await;
    let r = stack
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 8, "stream": true}),
        )
        .await;
    let mut body = r.bytes_stream();
    let mut text = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    let Stack {
        sims, router, dir, ..
    } = stack;
    let stopping = tokio::spawn(router.shutdown());
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "the stream finished: {text}"
    );
    stopping.await.unwrap();
    for s in sims {
        s.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}
