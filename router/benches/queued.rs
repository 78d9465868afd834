//! What a request held by flow control costs in memory: the router's
//! decision service over 8 endpoints, every one at its concurrency limit
//! (nothing listens; no request is sent), so each request it is asked to
//! route is held. After one decision (what it builds once is not a held
//! request's), 10,000 chats of about 1 KiB, each a different prompt,
//! are held at once; printed: the resident set before and after, and the
//! difference per held request (its body included).
//!
//! `cargo bench -p kvroute-router --bench queued [-- --held N]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use kvroute_core::keys::RoutingKey;
use kvroute_core::policy::{PolicyConfig, Request};
use kvroute_router::config::Config;
use kvroute_router::metrics::Metrics;
use kvroute_router::pool::{EndpointSpec, Pool};
use kvroute_router::request::Service;
use kvroute_router::settings::Settings;
use kvroute_router::tenancy::Tenancy;
use serde_json::json;

const ENDPOINTS: usize = 8;
const CONCURRENCY: u32 = 64;
const CHAT: &str = "/v1/chat/completions";

/// The resident set of this process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// The sum of `kvroute_flow_queued` in `metrics`.
fn queued(metrics: &str) -> usize {
    (metrics.lines())
        .filter_map(kvroute_telemetry::metrics::parse_line)
        .filter(|m| m.name == "kvroute_flow_queued")
        .map(|m| m.value)
        .sum::<f64>() as usize
}

fn main() {
    let mut args = std::env::args().skip_while(|a| a != "--held").skip(1);
    let held: usize = args.next().map_or(10_000, |n| n.parse().expect("--held N"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut config = Config::default();
        config.flow_control.max_queued = held;
        config.flow_control.max_wait_ms = 600_000;
        let settings = Settings::builtin(PolicyConfig::default());
        let pool = Pool::new(settings, &config.resilience, CONCURRENCY);
        let tenancy = Tenancy::load(&config.tenancy).unwrap();
        let metrics = Arc::new(Metrics::default());
        let service = Arc::new(Service::new(pool.clone(), metrics, tenancy, &config));
        pool.set_endpoints(
            (0..ENDPOINTS)
                .map(|i| EndpointSpec {
                    name: format!("engine-{i}"),
                    http: SocketAddr::from(([127, 0, 0, 1], 9)),
                    cache: None,
                    ready: true,
                    draining: false,
                    ready_since_ms: None,
                    role: Default::default(),
                })
                .collect(),
        );
        let request = Request {
            key: RoutingKey(1),
            chain: &[],
            prompt_tokens: 1,
            key_prefix_blocks: None,
            output_tokens: 0,
        };
        let body = |i: usize| {
            let content = format!("request {i}: {}", "lorem ipsum ".repeat(85));
            let body = json!({"model": "bench", "max_tokens": 16,
                "messages": [{"role": "user", "content": content}]});
            Bytes::from(body.to_string())
        };
        // One decision first: what it builds once (the tokenizer, the
        // template) is not a held request's.
        let headers = HeaderMap::new();
        service.measure(CHAT, &headers, body(held)).await.unwrap();
        let seats: Vec<_> = (pool.plan(&request, true).targets.iter())
            .flat_map(|t| (0..CONCURRENCY).map(|_| pool.hold(t, 1, 1)))
            .collect();
        let before = rss();
        let tasks: Vec<_> = (0..held)
            .map(|i| {
                let (service, body) = (service.clone(), body(i));
                tokio::spawn(async move {
                    let headers = HeaderMap::new();
                    service.measure(CHAT, &headers, body).await
                })
            })
            .collect();
        while queued(&service.render_metrics()) < held {
            assert!(
                !tasks.iter().any(|t| t.is_finished()),
                "a request was not held"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let after = rss();
        println!(
            "held {held}: resident {:.1} MiB before, {:.1} MiB after; {:.0} bytes per held request",
            before as f64 / (1 << 20) as f64,
            after as f64 / (1 << 20) as f64,
            (after.saturating_sub(before)) as f64 / held as f64,
        );
        for t in &tasks {
            t.abort();
        }
        drop(seats);
    });
}
