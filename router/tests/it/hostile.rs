//! Hostile input, round two: declared lengths that reserve nothing,
//! trickling and chunked bodies, connection floods on the admin port, and
//! the open-file limit shared between listeners (a router process under a
//! lowered `RLIMIT_NOFILE`).

use std::time::Duration;

use crate::support::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Opens a connection that declares a 32 MiB chat body and sends `sent`
/// bytes of it.
async fn declares_32_mib(addr: std::net::SocketAddr, sent: usize) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 33554432\r\n\r\n";
    c.write_all(head.as_bytes()).await.unwrap();
    c.write_all(&vec![b' '; sent]).await.unwrap();
    c
}

fn gauge(metrics: &str, name: &str) -> f64 {
    sum_of(metrics, name)
}

#[tokio::test]
async fn declared_lengths_reserve_nothing_while_other_clients_are_served() {
    kvroute_router::listener::raise_open_file_limit();
    let stack = Stack::start(
        "declared",
        2,
        false,
        |_| {},
        |c| {
            c.resilience.health_check = None;
            // Slow enough that the held bodies last the whole test.
            c.limits.body_min_bytes_per_s = 1;
        },
    )
    .await;
    let addr = stack.router.addr();
    // 256 HTTP/1 connections, each declaring 32 MiB and sending 64 bytes.
    let mut held = Vec::new();
    for _ in 0..256 {
        held.push(declares_32_mib(addr, 64).await);
    }
    // 16 streams on one HTTP/2 connection doing the same.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..16 {
        let first = futures_util::stream::once(async {
            Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 64]))
        });
        let body = reqwest::Body::wrap_stream(futures_util::StreamExt::chain(
            first,
            futures_util::stream::pending(),
        ));
        let request = h2
            .post(stack.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("content-length", "33554432")
            .body(body);
        streams.push(tokio::spawn(request.send()));
    }
    let admin = format!("http://{}/metrics", stack.router.admin_addr);
    let text = kvroute_testkit::eventually(
        "every stream's body counted",
        Duration::from_secs(10),
        || async {
            let text = get_text(&admin).await;
            (gauge(&text, "kvroute_request_body_bytes") >= 272.0 * 1024.0).then_some(text)
        },
    )
    .await;
    // Each holds what it sent, by the KiB: 272 KiB in all, not 8.5 GiB.
    assert_eq!(
        gauge(&text, "kvroute_request_body_bytes"),
        272.0 * 1024.0,
        "{text}"
    );
    for i in 0..8 {
        let r = stack
            .post("/v1/chat/completions", chat("honest", &format!("q{i}"), 2))
            .await;
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let text = stack.metrics().await;
    assert!(!text.contains("reason=\"budget\""), "{text}");
    drop(held);
    for s in streams {
        s.abort();
    }
    stack.stop().await;
}

/// Bodies without a `Content-Length` hold what arrived (they held 1 MiB
/// each until the engine answered: 32 slow chats filled 32 MiB).
#[tokio::test]
async fn chunked_bodies_to_slow_engines_hold_what_arrived() {
    let stack = Stack::start(
        "chunked",
        2,
        false,
        |c| c.extra_latency_ms = 500,
        |c| {
            c.resilience.health_check = None;
            c.limits.max_body_bytes = 32 << 20;
            c.limits.max_body_bytes_in_flight = 32 << 20;
            c.limits.max_body_bytes_per_tenant = 32 << 20;
        },
    )
    .await;
    let chunked = (0..64).map(|i| {
        let body = serde_json::to_vec(&chat("chunked", &format!("c{i}"), 2)).unwrap();
        let stream = futures_util::stream::iter(
            body.chunks(40)
                .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>(),
        );
        stack
            .client
            .post(stack.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(reqwest::Body::wrap_stream(stream))
            .send()
    });
    for r in futures_util::future::join_all(chunked).await {
        let r = r.unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let text = stack.metrics().await;
    assert!(!text.contains("reason=\"budget\""), "{text}");
    stack.stop().await;
}

#[tokio::test]
async fn a_trickling_body_is_cut_at_the_minimum_rate() {
    let stack = Stack::start(
        "trickle",
        1,
        false,
        |_| {},
        |c| c.resilience.health_check = None,
    )
    .await;
    // Defaults: 16 KiB/s after the first 2 s. One byte, then nothing.
    let mut c = declares_32_mib(stack.router.addr(), 1).await;
    let mut response = Vec::new();
    let read = c.read_to_end(&mut response);
    let _ = tokio::time::timeout(Duration::from_secs(30), read).await;
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    assert!(response.contains("request_too_slow"), "{response}");
    let text = stack.metrics().await;
    assert!(
        text.contains("kvroute_request_bodies_refused_total{reason=\"too_slow\"} 1"),
        "{text}"
    );
    stack.stop().await;
}

#[tokio::test]
async fn one_tenant_cannot_hold_the_others_budget() {
    let stack = Stack::start(
        "tenant-budget",
        1,
        false,
        |_| {},
        |c| {
            c.resilience.health_check = None;
            c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
            c.limits.max_body_bytes = 1 << 20;
            c.limits.max_body_bytes_per_tenant = 1 << 20;
            c.limits.body_min_bytes_per_s = 1;
        },
    )
    .await;
    // Tenant a holds its whole share with one body still arriving.
    let mut c = TcpStream::connect(stack.router.addr()).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-tenant: a\r\ncontent-type: application/json\r\ncontent-length: 1048576\r\n\r\n";
    c.write_all(head.as_bytes()).await.unwrap();
    c.write_all(&vec![b' '; (1 << 20) - 1]).await.unwrap();
    let admin = format!("http://{}/metrics", stack.router.admin_addr);
    kvroute_testkit::eventually(
        "tenant a's body counted",
        Duration::from_secs(10),
        || async {
            let held = gauge(&get_text(&admin).await, "kvroute_request_body_bytes");
            (held >= (1 << 20) as f64).then_some(())
        },
    )
    .await;
    let send = |tenant: &'static str| {
        stack
            .client
            .post(stack.url("/v1/chat/completions"))
            .header("x-tenant", tenant)
            .json(&chat("t", tenant, 2))
            .send()
    };
    let a = send("a").await.unwrap();
    assert_eq!(a.status(), 429);
    assert!(a.headers().contains_key("retry-after"));
    let body: serde_json::Value = a.json().await.unwrap();
    assert_eq!(body["error"]["code"], json!("tenant_saturated"), "{body}");
    assert_eq!(send("b").await.unwrap().status(), 200);
    drop(c);
    stack.stop().await;
}

#[tokio::test]
async fn probes_answer_while_the_admin_port_is_flooded() {
    kvroute_router::listener::raise_open_file_limit();
    let stack = Stack::start(
        "admin-flood",
        1,
        false,
        |_| {},
        |c| c.resilience.health_check = None,
    )
    .await;
    let admin = stack.router.admin_addr;
    // 1,000 connections: half idle, half with half-sent headers.
    let mut flood = Vec::new();
    for i in 0..1000 {
        let mut c = TcpStream::connect(admin).await.unwrap();
        if i % 2 == 1 {
            c.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
        }
        flood.push(c);
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    for path in ["/healthz", "/readyz", "/metrics"] {
        let r = client
            .get(format!("http://{admin}{path}"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(r.status(), 200, "{path}");
    }
    let text = stack.metrics().await;
    assert!(
        sum_of(&text, "kvroute_connections_evicted_total") >= 800.0,
        "{text}"
    );
    drop(flood);
    stack.stop().await;
}
