//! Hostile clients against the response cache's surfaces: headers only
//! the router may send, a forwarded credential, bodies whose parse would
//! cost many times their size, and numbers or fields the key must read
//! as the engine does.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::child::memory_kb;
use crate::support::*;
use kvroute_core::policy::PolicyConfig;
use kvroute_router::config::ResponseCache;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RESULT: &str = "x-kvroute-response-cache";

/// A complete chat answer, storable by the cache.
const ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"kvroute-sim","choices":[{"index":0,"message":{"role":"assistant","content":"the answer"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#;

/// An engine that reads each request whole and answers with what
/// `answer` makes of its head: a status line's rest, extra headers and a
/// body. Counts the `POST`s.
async fn engine(
    answer: fn(&str) -> (&'static str, &'static str, &'static str),
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                let head_end = loop {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_lowercase();
                let length: usize = header_of(&head, "content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let mut left = (head_end + length).saturating_sub(got.len());
                while left > 0 {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    left = left.saturating_sub(n);
                }
                if head.starts_with("post ") {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
                let (status, headers, body) = answer(&head);
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{headers}connection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    (addr, count)
}

fn greedy(user: &str) -> serde_json::Value {
    json!({
        "model": "kvroute-sim",
        "temperature": 0,
        "messages": [{"role": "user", "content": user}],
    })
}

#[tokio::test]
async fn an_admission_refusal_the_router_did_not_ask_for_ejects_no_engine() {
    // Engines that refuse as if a bound had been asked for.
    let refusing = |_: &str| {
        // A LoadReport: 9 waiting, 100,000 tokens queued.
        let headers = "x-kvroute-load: CAkooI0G\r\n";
        ("503 Service Unavailable", headers, "{}")
    };
    let (a, _) = engine(refusing).await;
    let (b, _) = engine(refusing).await;
    let dir = temp_dir("unasked-refusal");
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!("endpoints:\n  - address: {a}\n  - address: {b}\n"),
    )
    .unwrap();
    let mut config = router_config(&dir);
    config.resilience.health_check = None;
    config.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
    let router = kvroute_router::start(config).await.unwrap();
    eventually("both endpoints", || router.pool.routable() == 2).await;
    let client = reqwest::Client::new();
    for _ in 0..12 {
        let r = client
            .post(format!("http://{}/v1/completions", router.addr()))
            .header("x-kvroute-admit-within-ms", "0")
            .json(&json!({"prompt": "hello"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
    }
    let ejected = router.pool.status().iter().filter(|e| e.ejected).count();
    assert_eq!(
        ejected, 0,
        "a refusal the router did not ask for is no fault"
    );
    router.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_hit_is_served_only_with_the_credential_the_engine_took() {
    // An engine with its own key (vLLM's --api-key).
    let (upstream, answered) = engine(|head| match header_of(head, "authorization") {
        Some(a) if a == "bearer good" => ("200 OK", "", ANSWER),
        _ => ("401 Unauthorized", "", r#"{"error":"bad key"}"#),
    })
    .await;
    let dir = upstream_dir("forwarded-credential", upstream);
    let mut config = router_config(&dir);
    config.resilience.health_check = None;
    config.proxy.forward_authorization = true;
    config.response_cache = Some(ResponseCache::default());
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    let ask = |key: Option<&'static str>| {
        let mut r = client
            .post(format!("http://{}/v1/chat/completions", router.addr()))
            .json(&greedy("the secret"));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        async move {
            let r = r.send().await.unwrap();
            let result = r
                .headers()
                .get(RESULT)
                .map(|v| v.to_str().unwrap().to_owned());
            (r.status().as_u16(), result)
        }
    };
    assert_eq!(ask(Some("good")).await, (200, Some("miss".into())));
    assert_eq!(ask(Some("good")).await, (200, Some("hit".into())));
    assert_eq!(ask(None).await, (401, Some("miss".into())), "no key");
    assert_eq!(ask(Some("wrong")).await, (401, Some("miss".into())));
    assert_eq!(
        answered.load(Ordering::SeqCst),
        3,
        "the engine judged each key"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn numbers_equal_as_values_share_an_answer_and_unreproducible_fields_bypass() {
    let (upstream, answered) = engine(|_| ("200 OK", "", ANSWER)).await;
    let dir = upstream_dir("cache-numbers", upstream);
    let mut config = router_config(&dir);
    config.resilience.health_check = None;
    config.response_cache = Some(ResponseCache::default());
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    let ask = |body: String| {
        let r = client
            .post(format!("http://{}/v1/chat/completions", router.addr()))
            .header("content-type", "application/json")
            .body(body);
        async move {
            let r = r.send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.headers()[RESULT].to_str().unwrap().to_owned()
        }
    };
    let body = |temperature: &str, max: &str, extra: &str| {
        format!(
            r#"{{"model":"kvroute-sim","temperature":{temperature},"max_tokens":{max}{extra},"messages":[{{"role":"user","content":"numbers"}}]}}"#
        )
    };
    assert_eq!(ask(body("0", "8", "")).await, "miss");
    assert_eq!(ask(body("0.0", "8.0", "")).await, "hit");
    assert_eq!(ask(body("-0", "8", "")).await, "hit");
    assert_eq!(
        ask(body("0", "8", r#","prompt_logprobs":1"#)).await,
        "bypass"
    );
    assert_eq!(
        ask(body("0", "8", r#","return_token_ids":true"#)).await,
        "bypass"
    );
    assert_eq!(answered.load(Ordering::SeqCst), 3);
    router.shutdown().await;
}

/// A legal body of about `len` bytes padded with JSON numbers: about a
/// value per two bytes, the most a tree of it costs.
fn padded(len: usize) -> Vec<u8> {
    let mut body = br#"{"model":"kvroute-sim","temperature":0,"messages":[{"role":"user","content":"What is a KV cache?"}],"pad":["#.to_vec();
    while body.len() < len {
        body.extend_from_slice(b"0,");
    }
    body.extend_from_slice(b"0]}");
    body
}

/// The issue's goal, in peak resident memory of the router process (its
/// own `/proc` status): a ~30 MiB body padded with numbers costs at most
/// 64 MiB over idle with the response cache and its semantic level on
/// (1,064 MiB before), and four at once stay under half the chart's
/// 1 GiB limit. `cargo test -p kvroute-router --test it hostile_cache::
/// -- --nocapture` prints the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_padded_with_numbers_cost_about_their_size() {
    if !Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc/self/status to read peak memory from");
        return;
    }
    // The engine reads and drops the body; a sim serves the embeddings.
    let (upstream, _) = engine(|_| ("200 OK", "", ANSWER)).await;
    let embedder = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let dir = upstream_dir("padded-bodies", upstream);
    let yaml = format!(
        "discovery:\n  static:\n    file: {}\n    reloadMs: 100\n\
         resilience:\n  healthCheck: null\n\
         limits:\n  bodyReadTimeoutMs: 600000\n  bodyMinBytesPerS: 1\n\
         responseCache:\n  backend: embedded\n  semantic:\n    embeddings:\n      url: http://{}\n      model: kvroute-sim\n",
        dir.join("endpoints.yaml").display(),
        embedder.http_addr,
    );
    let (router, listen, _) = spawn_router(&dir, &yaml);
    let pid = router.0.id();
    let client = reqwest::Client::new();
    let url = format!("http://{listen}/v1/chat/completions");
    kvroute_testkit::eventually("the router is ready", Duration::from_secs(30), || {
        let ready = client.get(format!("http://{listen}/readyz")).send();
        async move { ready.await.is_ok_and(|r| r.status() == 200).then_some(()) }
    })
    .await;
    let post = |body: Vec<u8>| {
        let r = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send();
        async move {
            let r = r.await.expect("an answer");
            let status = r.status();
            let result = r
                .headers()
                .get(RESULT)
                .map(|v| v.to_str().unwrap().to_owned());
            (status, result, r.text().await.unwrap())
        }
    };
    let (status, _, text) = post(serde_json::to_vec(&greedy("warm up")).unwrap()).await;
    assert_eq!(status, 200, "{text}");
    let (_, idle) = memory_kb(pid);

    let body = padded(30 << 20);
    let len = body.len();
    let (status, result, text) = post(body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(result.as_deref(), Some("miss"), "classified and looked up");
    let (one, _) = memory_kb(pid);

    let four = (0..4).map(|_| post(padded(30 << 20)));
    for (status, _, text) in futures_util::future::join_all(four).await {
        assert_eq!(status, 200, "{text}");
    }
    let (peak, _) = memory_kb(pid);
    let mib = |kb: u64| kb as f64 / 1024.0;
    eprintln!(
        "padded body of {:.1} MiB, cache and semantic level on: idle {:.1} MiB; one body: \
         peak {:.1} MiB ({:.1} MiB over idle); four at once: peak {:.1} MiB",
        len as f64 / (1 << 20) as f64,
        mib(idle),
        mib(one),
        mib(one.saturating_sub(idle)),
        mib(peak),
    );
    assert!(
        one.saturating_sub(idle) <= 64 << 10,
        "one body: {:.1} MiB over idle (at most 64)",
        mib(one.saturating_sub(idle))
    );
    assert!(
        peak <= 512 << 10,
        "four bodies: peak {:.1} MiB (under 512)",
        mib(peak)
    );
    drop(router);
    embedder.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn what_a_parse_may_cost_counts_in_the_body_budget() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("parse-budget", upstream);
    let mut config = router_config(&dir);
    config.resilience.health_check = None;
    config.limits.max_body_bytes = 4 << 20;
    config.limits.max_body_bytes_per_tenant = 8 << 20;
    config.limits.max_body_bytes_in_flight = 8 << 20;
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    let post = |path: &str, body: serde_json::Value| {
        client
            .post(format!("http://{}{path}", router.addr()))
            .json(&body)
            .send()
    };
    let text = "word ".repeat(200_000);
    // A completion's prompt is parsed whole: 1 MiB may cost 16 more.
    let r = post("/v1/completions", json!({"prompt": text}))
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "{}", r.text().await.unwrap());
    // A chat is read a message at a time, never whole.
    let chat = json!({"messages": [{"role": "user", "content": text}]});
    let r = post("/v1/chat/completions", chat).await.unwrap();
    assert_eq!(r.status(), 200);
    next_post(&mut heads).await;
    assert!(
        heads.try_recv().is_err(),
        "the refused one was not forwarded"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn a_salted_body_too_large_to_read_gets_the_tenants_salt_in_place_of_the_clients() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("salted-unread", upstream);
    std::fs::write(dir.join("secret"), "s3cret").unwrap();
    let mut config = router_config(&dir);
    config.tenancy.mode = kvroute_router::config::TenancyMode::Salted;
    config.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
    config.tenancy.secret_file = Some(dir.join("secret"));
    config.tenancy.client_salt = kvroute_router::config::ClientSalt::Overwrite;
    config.resilience.health_check = None;
    // Past this the prompt is not read, and the body not parsed whole.
    config.limits.max_tokenize_bytes = 1024;
    let router = kvroute_router::start(config).await.unwrap();
    let body = json!({
        "cache_salt": "mine",
        "model": "m",
        "messages": [{"role": "user", "content": "x".repeat(4000)}],
    });
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", router.addr()))
        .header("x-tenant", "bob")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let head = next_post(&mut heads).await;
    let sent: serde_json::Value = serde_json::from_str(&head[head.find("\r\n\r\n").unwrap() + 4..])
        .expect("the forwarded body is JSON");
    let salt = sent["cache_salt"].as_str().unwrap();
    assert!(salt != "mine" && !salt.is_empty(), "{salt}");
    assert_eq!(head.matches("\"cache_salt\"").count(), 1, "one salt");
    assert_eq!(sent["messages"], body["messages"], "the rest as it was");
    router.shutdown().await;
}
