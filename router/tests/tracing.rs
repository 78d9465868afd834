//! W3C trace context: with OTLP tracing on, the engine's parent span is the
//! router's, in the client's trace. (Its own test binary, beside `tests/it`:
//! it installs the global subscriber, which would capture every other
//! test's spans and logs in a shared process.)

#[path = "it/support/mod.rs"]
mod support;

use kvroute_router::config::Telemetry;
use serde_json::json;
use support::*;

#[tokio::test]
async fn the_engine_sees_the_routers_span_in_the_clients_trace() {
    let _guard = kvroute_router::telemetry::init(&Telemetry {
        // Nothing listens there: spans are dropped, propagation still works.
        otlp_endpoint: Some("http://127.0.0.1:9".into()),
        ..Telemetry::default()
    })
    .unwrap();
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("tracing", upstream);
    let router = kvroute_router::start(router_config(&dir)).await.unwrap();
    let client_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", router.addr()))
        .header("traceparent", client_parent)
        .json(&json!({"prompt": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let head = next_post(&mut heads).await;
    let forwarded = header_of(&head, "traceparent").expect("a traceparent is sent upstream");
    let parts: Vec<&str> = forwarded.split('-').collect();
    assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736", "same trace");
    assert_ne!(
        parts[2], "00f067aa0ba902b7",
        "the router's own span is the parent"
    );
    router.shutdown().await;
}
