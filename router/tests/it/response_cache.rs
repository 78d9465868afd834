//! The exact response cache with the embedded store, over an engine sim:
//! what is a hit, how a hit looks in either form, tenants kept apart,
//! identical requests coalesced, purges, and what is counted.

use crate::support::*;
use kvroute_router::config::{Header, ResponseCache};
use serde_json::{Value, json};

const HEADER: &str = "x-kvroute-response-cache";

fn greedy(user: &str) -> Value {
    json!({
        "model": "kvroute-sim",
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": user}],
    })
}

async fn cached_stack(name: &str, sim: impl Fn(&mut kvroute_engine_sim::Config)) -> Stack {
    Stack::start(name, 1, false, sim, |c| {
        c.response_cache = Some(ResponseCache::default());
        c.tenancy.tenant_header = Some(Header("x-tenant".parse().unwrap()));
    })
    .await
}

/// Requests the engine answered.
pub(crate) fn engine_requests(stack: &Stack) -> f64 {
    sum_of(
        &stack.sims[0].engine.metrics_text(),
        "vllm:request_success_total",
    )
}

/// Posts `body` as `tenant`; returns the cache header and the body.
pub(crate) async fn ask(stack: &Stack, tenant: &str, body: &Value) -> (String, reqwest::Response) {
    let r = (stack.client.post(stack.url("/v1/chat/completions")))
        .header("x-tenant", tenant)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let result = r.headers()[HEADER].to_str().unwrap().to_owned();
    (result, r)
}

/// The JSON objects of an event stream, and whether it ended with `[DONE]`.
fn events(text: &str) -> (Vec<Value>, bool) {
    let mut chunks = Vec::new();
    let mut done = false;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("a data event");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).unwrap());
        }
    }
    (chunks, done)
}

fn streamed_content(chunks: &[Value]) -> String {
    (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

#[tokio::test]
async fn a_deterministic_answer_is_served_from_the_cache_in_either_form() {
    let stack = cached_stack("rc-forms", |_| {}).await;
    let body = greedy("What is a KV cache?");
    let (result, r) = ask(&stack, "a", &body).await;
    assert_eq!(result, "miss");
    let first: Value = r.json().await.unwrap();
    assert_eq!(engine_requests(&stack), 1.0);

    let (result, r) = ask(&stack, "a", &body).await;
    assert_eq!(result, "hit");
    assert!(r.headers().contains_key("age"), "a hit says its age");
    let hit: Value = r.json().await.unwrap();
    assert_eq!(engine_requests(&stack), 1.0, "a hit costs no engine call");
    assert_eq!(hit["object"], "chat.completion");
    assert_ne!(hit["id"], first["id"], "a fresh id");
    assert_eq!(
        hit["choices"][0]["message"],
        json!({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
    );
    assert_eq!(
        hit["choices"][0]["finish_reason"],
        first["choices"][0]["finish_reason"]
    );
    let usage = &hit["usage"];
    assert_eq!(usage["prompt_tokens"], first["usage"]["prompt_tokens"]);
    assert_eq!(
        usage["completion_tokens"],
        first["usage"]["completion_tokens"]
    );
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"]
    );

    // The same request streamed, without and with usage.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (result, r) = ask(&stack, "a", &streamed).await;
    assert_eq!(result, "hit", "stream is not part of the key");
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let (chunks, done) = events(&r.text().await.unwrap());
    assert!(done);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        streamed_content(&chunks),
        first["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert!(
        chunks.iter().all(|c| c["usage"].is_null()),
        "usage only when asked"
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    streamed["stream_options"] = json!({"include_usage": true});
    let (_, r) = ask(&stack, "a", &streamed).await;
    let (chunks, _) = events(&r.text().await.unwrap());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"]
    );
    assert_eq!(engine_requests(&stack), 1.0);

    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_response_cache_requests_total{model=\"kvroute-sim\",result=\"hit\"}"
        ),
        3.0
    );
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_response_cache_requests_total{model=\"kvroute-sim\",result=\"miss\"}"
        ),
        1.0
    );
    assert_eq!(
        sum_of(&metrics, "kvroute_routed_total"),
        1.0,
        "hits are not routed"
    );
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_requests_total{model=\"kvroute-sim\",status=\"200\"}"
        ),
        4.0
    );
    assert!(sum_of(&metrics, "kvroute_response_cache_bytes") > 0.0);
    stack.stop().await;
}

#[tokio::test]
async fn a_streamed_miss_is_stored_whole_and_the_client_gets_what_it_asked_for() {
    let stack = cached_stack("rc-stream", |_| {}).await;
    let mut body = greedy("Explain prefix caching.");
    body["stream"] = json!(true);
    let (result, r) = ask(&stack, "a", &body).await;
    assert_eq!(result, "miss");
    let (chunks, done) = events(&r.text().await.unwrap());
    assert!(done);
    assert!(
        chunks.iter().all(|c| c["usage"].is_null()),
        "the usage the router asked for is taken out"
    );
    let content = streamed_content(&chunks);
    assert!(!content.is_empty());

    // Stored before the stream's last byte reached the client.
    body["stream"] = json!(false);
    let (result, r) = ask(&stack, "a", &body).await;
    assert_eq!(result, "hit");
    let hit: Value = r.json().await.unwrap();
    assert_eq!(hit["choices"][0]["message"]["content"], content);
    assert_eq!(engine_requests(&stack), 1.0);
    stack.stop().await;
}

#[tokio::test]
async fn only_deterministic_answers_are_cached_and_cache_control_is_obeyed() {
    let stack = cached_stack("rc-rules", |_| {}).await;
    let mut sampled = greedy("sampled");
    sampled.as_object_mut().unwrap().remove("temperature");
    for _ in 0..2 {
        assert_eq!(ask(&stack, "a", &sampled).await.0, "bypass");
    }
    let r = (stack.client.post(stack.url("/v1/chat/completions")))
        .header("x-tenant", "a")
        .header("x-kvroute-cache-sampled", "1")
        .json(&sampled)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers()[HEADER],
        "miss",
        "a client may opt a sampled request in"
    );

    let body = greedy("no-store");
    for _ in 0..2 {
        let r = (stack.client.post(stack.url("/v1/chat/completions")))
            .header("x-tenant", "a")
            .header("cache-control", "no-store")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()[HEADER], "bypass");
    }
    let before = engine_requests(&stack);
    let fresh = || async {
        let r = (stack.client.post(stack.url("/v1/chat/completions")))
            .header("x-tenant", "a")
            .header("cache-control", "no-cache")
            .json(&body)
            .send()
            .await
            .unwrap();
        r.headers()[HEADER].to_str().unwrap().to_owned()
    };
    assert_eq!(fresh().await, "miss");
    assert_eq!(
        fresh().await,
        "miss",
        "no-cache is never served from the cache"
    );
    assert_eq!(ask(&stack, "a", &body).await.0, "hit", "but it stores");
    assert_eq!(engine_requests(&stack), before + 2.0);

    stack.stop().await;
}

#[tokio::test]
async fn tenants_never_get_each_others_answers() {
    let stack = cached_stack("rc-tenants", |_| {}).await;
    let body = greedy("the same question");
    assert_eq!(ask(&stack, "a", &body).await.0, "miss");
    assert_eq!(ask(&stack, "b", &body).await.0, "miss");
    assert_eq!(ask(&stack, "a", &body).await.0, "hit");
    assert_eq!(ask(&stack, "b", &body).await.0, "hit");
    assert_eq!(engine_requests(&stack), 2.0);
    stack.stop().await;
}

#[tokio::test]
async fn identical_requests_in_flight_share_one_engine_call() {
    let stack = cached_stack("rc-coalesce", |c| c.itl_ms = 50.0).await;
    let body = greedy("asked five times at once");
    let asks = (0..5).map(|_| ask(&stack, "a", &body));
    let results = futures_util::future::join_all(asks).await;
    let mut contents = Vec::new();
    for (_, r) in results {
        let v: Value = r.json().await.unwrap();
        contents.push(v["choices"][0]["message"]["content"].clone());
    }
    assert!(contents.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(
        engine_requests(&stack),
        1.0,
        "one engine call for five requests"
    );
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_response_cache_coalesced_total"),
        4.0
    );
    stack.stop().await;
}

#[tokio::test]
async fn the_admin_port_purges_all_or_one_model() {
    let stack = cached_stack("rc-purge", |_| {}).await;
    let body = greedy("purge me");
    let (result, first) = ask(&stack, "a", &body).await;
    assert_eq!(result, "miss");
    // Read whole: its answer is stored by then (a follower of the lead
    // would be a hit before the store, and the purge would find nothing).
    first.text().await.unwrap();
    assert_eq!(ask(&stack, "a", &body).await.0, "hit");
    let purge = |query: &'static str| {
        let url = format!(
            "http://{}/admin/response-cache/purge{query}",
            stack.router.admin_addr
        );
        let client = stack.client.clone();
        async move {
            let r = client.post(url).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()["purged"].as_u64().unwrap()
        }
    };
    assert_eq!(purge("?model=another").await, 0);
    assert_eq!(ask(&stack, "a", &body).await.0, "hit");
    assert_eq!(purge("?model=kvroute-sim").await, 1);
    let (result, again) = ask(&stack, "a", &body).await;
    assert_eq!(result, "miss");
    again.text().await.unwrap();
    assert_eq!(purge("").await, 1);
    assert_eq!(ask(&stack, "a", &body).await.0, "miss");
    stack.stop().await;
}
