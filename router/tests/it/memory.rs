//! Memory of the router binary serving one large chat completion with the
//! built-in tokenizer, disaggregated requests with large bodies, and a
//! hostile prefill engine's answers, read from the child's
//! `/proc/<pid>/status`.
//! Linux only: elsewhere the test prints a skip message and passes.

use crate::support::child;
use std::path::Path;
use std::time::Duration;

use crate::support::{chat, spawn_router, temp_dir, write_endpoints, write_roled_endpoints};
use child::memory_kb;
use serde_json::json;

/// The size of the large request body, about.
const BODY_BYTES: usize = 30 << 20;

/// About `len` bytes of English-like ASCII words separated by spaces.
fn prose(len: usize) -> String {
    let mut text = String::with_capacity(len + 64);
    let mut i = 0;
    while text.len() < len {
        text.push_str(&format!("topic{i} sentence about caching and routing. "));
        i += 1;
    }
    text
}

/// Issue "peak memory per request ≤ 3× its body with the built-in
/// tokenizer": a ~30 MiB chat body may raise the router's peak resident set
/// by at most 3× the body over its resident set before the request.
/// Measured 2.14× (from 9.4× before the hardening): the body and the
/// message texts; the built-in tokenizer's ids go straight into the chain.
/// `cargo test -p kvroute-router --test it memory:: -- --nocapture` prints the
/// measured ratio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_chat_costs_at_most_a_few_times_its_body() {
    if !Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc/self/status to read peak memory from");
        return;
    }
    let mut sim_config = kvroute_engine_sim::Config::test();
    // Room for the ~9M-token prompt, so the engine answers 200.
    sim_config.max_model_len = 1 << 24;
    sim_config.num_gpu_blocks = 1 << 20;
    let sim = kvroute_engine_sim::start(sim_config).await.unwrap();
    let dir = temp_dir("memory");
    write_endpoints(&dir, &[&sim], false);
    let yaml = format!(
        "discovery:\n  static:\n    file: {}\n    reloadMs: 100\n\
         limits:\n  maxBodyBytes: 67108864\n  maxTokenizeBytes: 67108864\n",
        dir.join("endpoints.yaml").display()
    );
    let (router, listen, _) = spawn_router(&dir, &yaml);
    let log = dir.join("router.log");
    let pid = router.0.id();
    let client = reqwest::Client::new();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ready = client.get(format!("http://{listen}/readyz")).send().await;
        if ready.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the router never became ready; its log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url = format!("http://{listen}/v1/chat/completions");
    let small = client
        .post(&url)
        .json(&chat("Be brief.", "hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 200, "{}", small.text().await.unwrap());
    let (baseline_hwm, baseline_rss) = memory_kb(pid);

    let body = serde_json::to_vec(&json!({
        "model": "kvroute-sim",
        "messages": [
            {"role": "system", "content": prose(BODY_BYTES)},
            {"role": "user", "content": "Summarize the above."},
        ],
        "max_tokens": 2,
    }))
    .unwrap();
    let body_len = body.len();
    let large = client
        .post(&url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = large.status();
    let text = large.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    let (peak, _) = memory_kb(pid);

    let increase_kb = peak.saturating_sub(baseline_rss);
    let ratio = (increase_kb * 1024) as f64 / body_len as f64;
    eprintln!(
        "router memory: body {} kB; before it RSS {baseline_rss} kB (peak {baseline_hwm} kB); \
         peak after {peak} kB, an increase of {increase_kb} kB = {ratio:.2}× the body",
        body_len / 1024
    );
    assert!(
        ratio <= 3.0,
        "peak memory rose by {ratio:.2}× the body (at most 3×)"
    );
    drop(router);
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// An engine that answers `/health` and `/v1/models`, reads each
/// completion's whole body, counts it in `bodies`, and then answers with
/// `answer` (`None`: never).
async fn engine(
    bodies: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    answer: Option<bytes::Bytes>,
) -> std::net::SocketAddr {
    use axum::routing::{get, post};
    let completion = move |body: bytes::Bytes| {
        let (bodies, answer) = (bodies.clone(), answer.clone());
        async move {
            drop(body);
            bodies.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            match answer {
                Some(a) => ([("content-type", "application/json")], a),
                None => std::future::pending().await,
            }
        }
    };
    let models = json!({"object": "list", "data": [{"id": "m", "object": "model"}]});
    let app = axum::Router::new()
        .route("/health", get(|| async { "" }))
        .route("/v1/models", get(move || async move { axum::Json(models) }))
        .route("/v1/completions", post(completion))
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// A router child disaggregating every request from `prefill` to `decode`
/// (approximate mode: every prompt uncached), ready: it, its API address,
/// its RSS in kB after one small request, and its directory.
async fn split_router(
    name: &str,
    (prefill, decode): (std::net::SocketAddr, std::net::SocketAddr),
) -> (child::Router, std::net::SocketAddr, u64, std::path::PathBuf) {
    let dir = temp_dir(name);
    write_roled_endpoints(&dir, &[("p", prefill, "prefill"), ("d", decode, "decode")]);
    let yaml = format!(
        "discovery:\n  static:\n    file: {}\n\
         routing:\n  disaggregation:\n    mode: auto\n    minUncachedTokens: 1\n\
         resilience:\n  hungAfterMs: 600000\n\
         limits:\n  firstByteTimeoutMs: 600000\n",
        dir.join("endpoints.yaml").display()
    );
    let (router, listen, admin) = spawn_router(&dir, &yaml);
    let client = reqwest::Client::new();
    // Both endpoints ready: their first health checks passed.
    let pool = format!("http://{admin}/debug/pool");
    kvroute_testkit::eventually("the router is ready", Duration::from_secs(30), || async {
        let pool: serde_json::Value = client.get(&pool).send().await.ok()?.json().await.ok()?;
        let ready = pool.as_array()?.iter().filter(|e| e["ready"] == true);
        (ready.count() == 2).then_some(())
    })
    .await;
    let (_, rss) = memory_kb(router.0.id());
    (router, listen, rss, dir)
}

/// Issue #67 item 2: 16 completions of 1,000,000 token ids (2 MB bodies)
/// whose prefill legs hang cost ≤ 200 MB above idle (607–636 MB when the
/// legs were built from a JSON tree of the body). `-- --nocapture` prints
/// the figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_legs_in_flight_cost_their_bodies_not_trees_of_them() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    if !Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc/self/status to read memory from");
        return;
    }
    let prefilled = std::sync::Arc::new(AtomicUsize::new(0));
    let prefill = engine(prefilled.clone(), None).await;
    let decode = engine(std::sync::Arc::default(), None).await;
    let (router, listen, idle, dir) = split_router("memory-split", (prefill, decode)).await;
    let url = format!("http://{listen}/v1/completions");
    // One at a time: all at once, the body budget refuses what their
    // reading holds together (16 times a body each, for a moment).
    let mut sent = Vec::new();
    for i in 0..16 {
        // 1,000,000 token ids, written as text: a tree of them here would
        // take the test's own threads for seconds.
        let mut body = format!(r#"{{"model": "m", "max_tokens": 2, "prompt": [{i}"#);
        body.push_str(&",7".repeat(999_999));
        body.push_str("]}");
        let r = reqwest::Client::new().post(&url).body(body);
        sent.push(tokio::spawn(
            r.header("content-type", "application/json").send(),
        ));
        kvroute_testkit::eventually(
            "its prefill leg is in flight",
            Duration::from_secs(60),
            || {
                let n = prefilled.load(Ordering::SeqCst);
                async move { (n > i).then_some(()) }
            },
        )
        .await;
    }
    let (peak, rss) = memory_kb(router.0.id());
    let above = rss.saturating_sub(idle) / 1024;
    eprintln!(
        "router memory with 16 prefill legs of 2 MB in flight: idle {idle} kB, now {rss} kB \
         (peak {peak} kB): {above} MB above idle"
    );
    assert!(above <= 200, "{above} MB above idle (at most 200)");
    for s in sent {
        s.abort();
    }
    drop(router);
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue #67 item 6: a prefill engine answering 4 MB of
/// `kv_transfer_params` for a 300-word prompt is not relayed: the 12
/// requests are answered (their decode endpoint prefills), the router's
/// peak < 100 MB above idle (+182–293 MB when they were relayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answer_out_of_proportion_is_not_read_whole_nor_relayed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    if !Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc/self/status to read memory from");
        return;
    }
    let ids = vec![0u8; 2 << 20];
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "127.0.0.1",
                        "remote_port": 5600, "remote_block_ids": ids});
    let hostile = json!({"choices": [{"index": 0, "text": " a"}], "kv_transfer_params": params,
                         "usage": {"prompt_tokens": 400, "completion_tokens": 1}});
    let hostile = bytes::Bytes::from(serde_json::to_vec(&hostile).unwrap());
    let fine = json!({"choices": [{"index": 0, "text": " a"}],
                      "usage": {"prompt_tokens": 400, "completion_tokens": 2}});
    let decoded = std::sync::Arc::new(AtomicUsize::new(0));
    let prefill = engine(std::sync::Arc::default(), Some(hostile)).await;
    let fine = bytes::Bytes::from(serde_json::to_vec(&fine).unwrap());
    let decode = engine(decoded.clone(), Some(fine)).await;
    let (router, listen, idle, dir) = split_router("memory-params", (prefill, decode)).await;
    let url = format!("http://{listen}/v1/completions");
    let sent: Vec<_> = (0..12)
        .map(|i| {
            let prompt = format!("word{i} ").repeat(300);
            let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2});
            let r = reqwest::Client::new().post(&url).json(&body);
            tokio::spawn(async move { r.send().await.unwrap().status() })
        })
        .collect();
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(decoded.load(Ordering::SeqCst), 12);
    let (peak, _) = memory_kb(router.0.id());
    let above = peak.saturating_sub(idle) / 1024;
    eprintln!("router memory: idle {idle} kB, peak {peak} kB: {above} MB above idle");
    assert!(above < 100, "{above} MB above idle (under 100)");
    drop(router);
    let _ = std::fs::remove_dir_all(dir);
}
