//! What the endpoint picker (Envoy ext_proc) adds per request: a tonic
//! client plays Envoy against a router over 4 engine sims, on loopback, one
//! request at a time. Per request it sends the headers, the body in 16 KiB
//! messages (as Envoy streams it), then a response of one chunk. Reported,
//! p50 and p99 over the requests:
//!
//! - `decision`: from the last body chunk sent to the headers answer (the
//!   pick) received: the latency the picker adds before the gateway can
//!   forward;
//! - `request phase`: from the request headers sent to the whole body back.
//!
//! For 1 KiB and 200 KiB chats (each prompt unique), in approximate and in
//! exact mode (the engines' WatchCache streams, the built-in tokenizer).
//!
//! `cargo bench -p kvroute-router --bench picker [-- --requests N]`

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, body_mutation::Mutation,
    processing_request::Request as Message, processing_response::Response as Answer,
};
use kvroute_router::config::{Config, Discovery, ExtProc, StaticDiscovery};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const ENGINES: usize = 4;
const CHUNK: usize = 16 << 10;

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    })
}

fn message(request: Message) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

/// A chat of about `bytes`, unique per `seed`.
fn body(seed: usize, bytes: usize) -> Vec<u8> {
    let text: String = (0..)
        .map(|i| format!("request {seed} line {i}: routing text for the picker. "))
        .scan(0, |len, line| {
            *len += line.len();
            (*len <= bytes).then_some(line)
        })
        .collect();
    serde_json::to_vec(&json!({
        "model": "kvroute-sim",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "go"}],
        "max_tokens": 1,
    }))
    .expect("JSON")
}

/// A router with the picker over fresh engine sims; its picker address.
async fn router(exact: bool, name: &str) -> std::net::SocketAddr {
    let mut endpoints = String::from("endpoints:\n");
    for i in 0..ENGINES {
        let sim = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
            .await
            .expect("engine sim");
        endpoints += &format!("  - name: sim-{i}\n    address: {}\n", sim.http_addr);
        if exact {
            endpoints += &format!("    cachePort: {}\n", sim.cache_addr.port());
        }
        std::mem::forget(sim);
    }
    let dir = std::env::temp_dir().join(format!("kvroute-picker-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("endpoints.yaml"), endpoints).expect("endpoints file");
    let mut config = Config {
        admin_listen: "127.0.0.1:0".parse().expect("addr"),
        ext_proc: Some(ExtProc {
            listen: "127.0.0.1:0".parse().expect("addr"),
            ..ExtProc::default()
        }),
        ..Config::default()
    };
    config.discovery = Discovery::Static(StaticDiscovery::file(dir.join("endpoints.yaml")));
    let running = kvroute_router::start(config).await.expect("router");
    let deadline = Instant::now() + Duration::from_secs(10);
    while running.pool.routable() < ENGINES
        || (exact && running.pool.status().iter().any(|e| e.stream != "live"))
    {
        assert!(
            Instant::now() < deadline,
            "the engines never became routable"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let addr = running.ext_proc_addr.expect("picker address");
    std::mem::forget(running);
    addr
}

/// One exchange; returns (decision, request phase).
async fn exchange(
    client: &mut ExternalProcessorClient<Channel>,
    body: &[u8],
) -> (Duration, Duration) {
    let (to, rx) = mpsc::channel(body.len() / CHUNK + 8);
    let start = Instant::now();
    to.send(message(Message::RequestHeaders(HttpHeaders {
        headers: headers(&[(":method", "POST"), (":path", "/v1/chat/completions")]),
        end_of_stream: false,
        ..HttpHeaders::default()
    })))
    .await
    .expect("send");
    let mut from = client
        .process(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        to.send(message(Message::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream: i + 1 == chunks.len(),
            ..HttpBody::default()
        })))
        .await
        .expect("send");
    }
    let last_sent = Instant::now();
    let mut decision = None;
    let mut back = 0;
    while back < body.len() {
        let answer = from.message().await.expect("no error").expect("an answer");
        match answer.response.expect("a response") {
            Answer::RequestHeaders(_) => decision = Some(last_sent.elapsed()),
            Answer::RequestBody(b) => {
                if let Some(Mutation::StreamedResponse(chunk)) = b
                    .response
                    .and_then(|r| r.body_mutation)
                    .and_then(|m| m.mutation)
                {
                    back += chunk.body.len();
                }
            }
            other => panic!("unexpected answer {other:?}"),
        }
    }
    let phase = start.elapsed();
    to.send(message(Message::ResponseHeaders(HttpHeaders {
        headers: headers(&[(":status", "200"), ("content-type", "application/json")]),
        end_of_stream: false,
        ..HttpHeaders::default()
    })))
    .await
    .expect("send");
    to.send(message(Message::ResponseBody(HttpBody {
        body: b"{\"choices\":[]}".to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    })))
    .await
    .expect("send");
    while from.message().await.expect("no error").is_some() {}
    (decision.expect("a decision"), phase)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut requests = 500;
    while let Some(a) = args.next() {
        if a == "--requests" {
            requests = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--requests N");
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        println!(
            "ext_proc picker, {requests} requests per row, one at a time, body in {} KiB messages",
            CHUNK >> 10
        );
        println!(
            "| mode | body | decision p50 | decision p99 | request phase p50 | request phase p99 |"
        );
        println!("|---|---|---|---|---|---|");
        for (exact, mode) in [(false, "approximate"), (true, "exact")] {
            let addr = router(exact, mode).await;
            let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            for kib in [1, 200] {
                let bodies: Vec<Vec<u8>> = (0..requests + 20).map(|i| body(i, kib << 10)).collect();
                let mut decisions = Vec::new();
                let mut phases = Vec::new();
                for (i, b) in bodies.iter().enumerate() {
                    let (d, p) = exchange(&mut client, b).await;
                    // The first 20 warm the connection and the caches.
                    if i >= 20 {
                        decisions.push(d);
                        phases.push(p);
                    }
                }
                decisions.sort();
                phases.sort();
                println!(
                    "| {mode} | {kib} KiB | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} µs |",
                    percentile(&decisions, 0.5),
                    percentile(&decisions, 0.99),
                    percentile(&phases, 0.5),
                    percentile(&phases, 0.99),
                );
            }
        }
    });
}
