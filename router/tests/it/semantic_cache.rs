//! The semantic level of the response cache over an engine sim, whose
//! `/v1/embeddings` is a deterministic test double (shared words).

use std::time::Duration;

use crate::response_cache::{ask, engine_requests};
use crate::support::*;
use kvroute_router::config::{Config, Embeddings, Header, ResponseCache, Semantic};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FALSE_HIT: &str = "/v1/kvroute/semantic-cache/false-hit";

fn ask_body(system: &str, user: &str) -> Value {
    json!({
        "model": "kvroute-sim",
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
}

/// A stack whose cache embeds with `url` (the sim's own when `None`).
async fn semantic_stack(name: &str, url: Option<String>) -> Stack {
    semantic_stack_with(name, url, |_| {}).await
}

/// [`semantic_stack`] with the router's config then changed by `f`.
async fn semantic_stack_with(
    name: &str,
    url: Option<String>,
    f: impl FnOnce(&mut Config),
) -> Stack {
    let mut stack = Stack::start(
        name,
        1,
        false,
        |_| {},
        |c| {
            c.tenancy.tenant_header = Some(Header("x-tenant".parse().unwrap()));
        },
    )
    .await;
    let sim = url.is_none();
    let url = url.unwrap_or_else(|| format!("http://{}", stack.sims[0].http_addr));
    let mut config = router_config(&stack.dir);
    config.tenancy.tenant_header = Some(Header("x-tenant".parse().unwrap()));
    config.response_cache = Some(ResponseCache {
        semantic: Some(Semantic {
            embeddings: Embeddings {
                url,
                model: "kvroute-sim".into(),
                api_key_file: None,
                timeout_ms: 500,
            },
            threshold: 0.95,
            max_entries: 100,
            max_bytes: 64 << 20,
            check_interval_s: 60,
        }),
        ..ResponseCache::default()
    });
    f(&mut config);
    stack.router.shutdown().await;
    stack.router = kvroute_router::start(config).await.unwrap();
    if sim {
        metric_at(&stack, HEALTHY, 1.0).await;
    }
    stack
}

#[tokio::test]
async fn a_question_differing_in_case_and_punctuation_is_a_semantic_hit_in_its_context_only() {
    let stack = semantic_stack("sem-hit", None).await;
    let (result, first) = ask(&stack, "a", &ask_body("Be brief.", "What is a KV cache?")).await;
    assert_eq!(result, "miss");
    let first: Value = first.json().await.unwrap();

    let (result, again) = ask(&stack, "a", &ask_body("Be brief.", "what is a kv cache")).await;
    assert_eq!(result, "semantic-hit");
    assert_eq!(again.headers()["x-kvroute-similarity"], "1.0000");
    let again: Value = again.json().await.unwrap();
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    assert_eq!(engine_requests(&stack), 1.0);

    // Anything else different, or another tenant: no hit.
    let (result, _) = ask(&stack, "a", &ask_body("Be verbose.", "what is a kv cache")).await;
    assert_eq!(result, "miss", "the system prompt differs");
    let (result, _) = ask(&stack, "b", &ask_body("Be brief.", "what is a kv cache")).await;
    assert_eq!(result, "miss", "tenants never share entries");
    let (result, _) = ask(&stack, "a", &ask_body("Be brief.", "How do I bake bread?")).await;
    assert_eq!(result, "miss");
    assert_eq!(engine_requests(&stack), 4.0);

    // A client reports the hit wrong: its own tenant, once.
    let report = |tenant: &str, id: &str| {
        let request = (stack.client.post(stack.url(FALSE_HIT)))
            .header("x-tenant", tenant)
            .json(&json!({"id": id}));
        async move {
            let r = request.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let id = again["id"].as_str().unwrap();
    let (status, body) = report("b", id).await;
    assert_eq!(status, 404, "another tenant's report is an unknown id's");
    let (status, unknown) = report("a", "chatcmpl-unknown").await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], unknown["error"]["type"]);
    let (status, body) = report("a", id).await;
    assert_eq!((status, &body["counted"]), (200, &json!(true)));
    for _ in 0..3 {
        let (status, body) = report("a", id).await;
        assert_eq!((status, &body["counted"]), (200, &json!(false)), "once");
    }
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_semantic_cache_false_hits_total"),
        1.0
    );
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_response_cache_requests_total{model=\"kvroute-sim\",result=\"semantic_hit\"}"
        ),
        1.0
    );
    assert_eq!(sum_of(&metrics, "kvroute_semantic_cache_entries"), 4.0);
    stack.stop().await;
}

#[tokio::test]
async fn an_embeddings_server_that_is_down_makes_plain_misses() {
    // Nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let stack = semantic_stack("sem-down", Some(url)).await;
    metric_at(&stack, &check_failed("transport"), 1.0).await;
    for user in ["What is a KV cache?", "what is a kv cache"] {
        let (result, _) = ask(&stack, "a", &ask_body("Be brief.", user)).await;
        assert_eq!(result, "miss");
    }
    let (result, _) = ask(&stack, "a", &ask_body("Be brief.", "what is a kv cache")).await;
    assert_eq!(result, "hit", "the exact level still works");
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_semantic_cache_skipped_total"),
        2.0
    );
    assert_eq!(sum_of(&metrics, HEALTHY), 0.0);
    stack.stop().await;
}

/// What [`fake_embeddings`] answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fake {
    /// engine-sim's embedding of the input (256 dimensions); a text
    /// containing "one dimension" gets a vector of 1.
    Words,
    /// The same, twice over (512 dimensions): another model.
    Wider,
    /// One vector whatever the input.
    Constant,
    /// 200 with a body that is not an embedding.
    Garbage,
    /// Never answers.
    Silent,
}

/// An embeddings server on loopback answering as the mode says; the mode
/// can be changed while it runs.
async fn fake_embeddings(mode: Fake) -> (String, std::sync::Arc<std::sync::Mutex<Fake>>) {
    use axum::extract::State;
    use std::sync::{Arc, Mutex};
    type Mode = Arc<Mutex<Fake>>;
    async fn embeddings(State(mode): State<Mode>, body: axum::Json<Value>) -> axum::Json<Value> {
        let text = body["input"].as_str().unwrap_or_default().to_owned();
        let mode = *mode.lock().unwrap();
        let words = || kvroute_engine_sim::embeddings::embed(&text).unwrap();
        let vector = match mode {
            Fake::Words if text.contains("one dimension") => vec![1.0],
            Fake::Words => words(),
            Fake::Wider => [words(), words()].concat(),
            Fake::Constant => vec![0.6, 0.8],
            Fake::Garbage => return axum::Json(json!({"data": [{"embedding": "no"}]})),
            Fake::Silent => std::future::pending().await,
        };
        axum::Json(json!({"data": [{"embedding": vector}], "model": "fake"}))
    }
    let mode: Mode = Arc::new(Mutex::new(mode));
    let app = axum::Router::new()
        .route("/v1/embeddings", axum::routing::post(embeddings))
        .with_state(mode.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, mode)
}

/// Waits until the router's metrics show `family` at `value`.
async fn metric_at(stack: &Stack, family: &str, value: f64) {
    let what = format!("{family} at {value}");
    kvroute_testkit::eventually(&what, Duration::from_secs(10), || async {
        (sum_of(&stack.metrics().await, family) == value).then_some(())
    })
    .await;
}

const HEALTHY: &str = "kvroute_semantic_cache_embedder_healthy";

fn check_failed(reason: &str) -> String {
    format!("kvroute_semantic_cache_embedder_check_failures_total{{reason=\"{reason}\"}}")
}

#[tokio::test]
async fn a_silent_or_garbage_embeddings_server_turns_the_level_off() {
    for (mode, reason) in [(Fake::Silent, "timeout"), (Fake::Garbage, "garbage")] {
        let (url, _) = fake_embeddings(mode).await;
        let stack = semantic_stack(&format!("sem-{reason}"), Some(url)).await;
        metric_at(&stack, &check_failed(reason), 1.0).await;
        for user in ["What is a KV cache?", "what is a kv cache"] {
            let (result, _) = ask(&stack, "a", &ask_body("Be brief.", user)).await;
            assert_eq!(result, "miss", "{reason}");
        }
        let metrics = stack.metrics().await;
        assert_eq!(sum_of(&metrics, HEALTHY), 0.0, "{reason}");
        let skipped = "kvroute_semantic_cache_skipped_total";
        assert_eq!(sum_of(&metrics, skipped), 2.0, "{reason}");
        stack.stop().await;
    }
}

/// A config whose embedder is checked every second.
fn check_every_second(c: &mut Config) {
    let semantic = c.response_cache.as_mut().and_then(|r| r.semantic.as_mut());
    semantic.unwrap().check_interval_s = 1;
}

#[tokio::test]
async fn a_constant_embedder_turns_the_level_off_until_it_tells_questions_apart() {
    let (url, mode) = fake_embeddings(Fake::Constant).await;
    let stack = semantic_stack_with("sem-constant", Some(url), check_every_second).await;
    metric_at(&stack, &check_failed("similar"), 1.0).await;
    let ask_as = async |user: &str| ask(&stack, "a", &ask_body("Be brief.", user)).await.0;
    assert_eq!(ask_as("What is a KV cache?").await, "miss");
    assert_eq!(ask_as("How do I bake bread?").await, "miss", "unrelated");
    assert_eq!(
        ask_as("What is a KV cache?").await,
        "hit",
        "the exact level works"
    );
    // The embedder is fixed: the level comes back.
    *mode.lock().unwrap() = Fake::Words;
    metric_at(&stack, HEALTHY, 1.0).await;
    assert_eq!(ask_as("How do I reset my password?").await, "miss");
    assert_eq!(ask_as("how do i reset my password").await, "semantic-hit");
    stack.stop().await;
}

#[tokio::test]
async fn the_dimension_is_the_checks_and_a_new_model_empties_the_index() {
    let (url, mode) = fake_embeddings(Fake::Words).await;
    let stack = semantic_stack_with("sem-dimension", Some(url), check_every_second).await;
    let ask_as = async |user: &str| ask(&stack, "a", &ask_body("Be brief.", user)).await.0;
    metric_at(&stack, HEALTHY, 1.0).await;
    // A vector of one dimension first: refused, the index unchanged.
    assert_eq!(ask_as("A question of one dimension?").await, "miss");
    let errors = "kvroute_semantic_cache_embedding_errors_total{reason=\"dimension\"}";
    assert_eq!(sum_of(&stack.metrics().await, errors), 1.0);
    assert_eq!(ask_as("What is a KV cache?").await, "miss");
    assert_eq!(ask_as("what is a kv cache").await, "semantic-hit");
    metric_at(&stack, "kvroute_semantic_cache_entries", 1.0).await;
    // Another model: its check empties the index and adopts its dimension.
    *mode.lock().unwrap() = Fake::Wider;
    metric_at(&stack, "kvroute_semantic_cache_entries", 0.0).await;
    assert_eq!(ask_as("WHAT IS A KV CACHE").await, "miss");
    assert_eq!(ask_as("What is a KV cache!").await, "semantic-hit");
    stack.stop().await;
}

#[tokio::test]
async fn a_similar_question_whose_answer_is_gone_is_remembered_afresh() {
    let stack = semantic_stack("sem-gone", None).await;
    let ask_as = async |user: &str| ask(&stack, "a", &ask_body("Be brief.", user)).await;
    let (result, first) = ask_as("What is a KV cache?").await;
    assert_eq!(result, "miss");
    // Read whole: its answer is stored by then.
    first.text().await.unwrap();
    let url = format!(
        "http://{}/admin/response-cache/purge",
        stack.router.admin_addr
    );
    let purged = stack.client.post(url).send().await.unwrap();
    assert_eq!(purged.status(), 200);
    // The index still finds the first question, whose answer is gone.
    assert_eq!(ask_as("what is a kv cache").await.0, "miss");
    // The second was remembered with its own answer.
    assert_eq!(ask_as("WHAT IS A KV CACHE!").await.0, "semantic-hit");
    assert_eq!(engine_requests(&stack), 2.0);
    stack.stop().await;
}

/// Sends `head` (a request's headers) and `body` on a new connection;
/// returns what the router answered within 10 s (empty if nothing).
async fn raw(stack: &Stack, head: &str, body: &[u8]) -> String {
    let mut tcp = TcpStream::connect(stack.router.addr()).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(body).await.unwrap();
    let mut response = Vec::new();
    let read = tcp.read_to_end(&mut response);
    let _ = tokio::time::timeout(Duration::from_secs(10), read).await;
    String::from_utf8_lossy(&response).into_owned()
}

fn report_head(length: usize) -> String {
    format!(
        "POST {FALSE_HIT} HTTP/1.1\r\nhost: x\r\nx-tenant: a\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    )
}

#[tokio::test]
async fn the_false_hit_route_reads_its_body_within_the_body_limits() {
    let stack = semantic_stack_with("sem-report-limits", None, |c| {
        c.limits.body_read_timeout_ms = 500;
    })
    .await;
    // A trickled body is cut at the body timeout.
    let answer = raw(&stack, &report_head(100), b"{\"id\":").await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    // A body longer than a report is refused before it is sent.
    let answer = raw(&stack, &report_head(1 << 20), b"").await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:?}");
    let metrics = stack.metrics().await;
    for reason in ["timeout", "too_large"] {
        let refused = format!("kvroute_request_bodies_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(sum_of(&metrics, &refused), 1.0, "{reason}");
    }
    stack.stop().await;

    // With the semantic level off, 404 before any byte of the body.
    let stack = Stack::start("sem-report-off", 1, false, |_| {}, |_| {}).await;
    let answer = raw(&stack, &report_head(100), b"").await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer:?}");
    stack.stop().await;
}
