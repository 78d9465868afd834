//! The simulator over HTTP, as vLLM's clients see it.

use std::time::Duration;

use futures_util::StreamExt;
use kvroute_engine_sim::{Config, Sim, start};
use serde_json::{Value, json};

pub(crate) async fn sim(configure: impl FnOnce(&mut Config)) -> Sim {
    let mut config = Config::test();
    configure(&mut config);
    start(config).await.unwrap()
}

pub(crate) async fn post(sim: &Sim, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{}{path}", sim.http_addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// A body that is not JSON posted to `path` is a 400 saying so.
pub(crate) async fn invalid_json_is_refused(sim: &Sim, path: &str) {
    let r = reqwest::Client::new()
        .post(format!("http://{}{path}", sim.http_addr))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("invalid JSON"), "{message}");
}

/// Reads an SSE response into its `data:` payloads.
async fn events(sim: &Sim, path: &str, body: Value) -> Vec<String> {
    let r = reqwest::Client::new()
        .post(format!("http://{}{path}", sim.http_addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is data")
                .to_owned()
        })
        .collect()
}

fn long_prompt() -> String {
    "The quick brown fox jumps over the lazy dog near the riverbank. ".repeat(8)
}

#[tokio::test]
async fn completions_report_cached_tokens_and_salts_isolate() {
    let sim = sim(|_| {}).await;
    let body = json!({"model": "kvroute-sim", "prompt": long_prompt(), "max_tokens": 5});
    let (status, first) = post(&sim, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["total_tokens"], prompt_tokens + 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (_, second) = post(&sim, "/v1/completions", body.clone()).await;
    let full_blocks = (prompt_tokens - 1) / 16 * 16;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        full_blocks
    );
    assert_eq!(
        second["choices"][0]["text"], first["choices"][0]["text"],
        "deterministic"
    );

    let mut salted = body.clone();
    salted["cache_salt"] = json!("tenant-b");
    let (_, third) = post(&sim, "/v1/completions", salted).await;
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    sim.shutdown().await;
}

#[tokio::test]
async fn chat_completions_stream_with_usage() {
    let sim = sim(|_| {}).await;
    let body = json!({
        "model": "kvroute-sim",
        "messages": [{"role": "system", "content": long_prompt()}, {"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let events = events(&sim, "/v1/chat/completions", body).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // Role, three tokens, usage.
    assert_eq!(chunks.len(), 5, "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks[1..4] {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .starts_with(' ')
        );
    }
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 3);
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_sends_tokens_as_they_are_produced() {
    // 5 tokens 300 ms apart: when the first chunk arrives, the engine must
    // not have produced them all.
    let sim = sim(|c| c.itl_ms = 300.0).await;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", sim.http_addr))
        .json(&json!({"prompt": "hello", "max_tokens": 5, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"));
    let produced = generation_tokens(&sim).await;
    assert!(
        produced < 5,
        "{produced} tokens were generated before the first arrived"
    );
    let mut rest = Vec::new();
    while let Some(chunk) = body.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert!(
        String::from_utf8(rest)
            .unwrap()
            .ends_with("data: [DONE]\n\n")
    );
    sim.shutdown().await;
}

/// A sample of `metric` (its full name and labels) on `sim`'s /metrics.
pub(crate) async fn metric(sim: &Sim, sample: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", sim.http_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {sample} in\n{text}"))
        .parse()
        .unwrap()
}

async fn generation_tokens(sim: &Sim) -> u64 {
    metric(
        sim,
        "vllm:generation_tokens_total{model_name=\"kvroute-sim\"}",
    )
    .await as u64
}

#[tokio::test]
async fn errors_are_vllm_shaped() {
    let sim = sim(|c| c.max_model_len = 64).await;
    let (status, body) = post(
        &sim,
        "/v1/completions",
        json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "NotFoundError");
    assert_eq!(body["error"]["code"], 404);
    assert_eq!(
        body["error"]["message"],
        "The model `other` does not exist."
    );

    let (status, body) = post(
        &sim,
        "/v1/completions",
        json!({"prompt": "x", "cache_salt": "a/b"}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "BadRequestError");

    let (status, body) = post(
        &sim,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 64")
    );

    let (status, _) = post(&sim, "/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!(status, 400);
    let (status, _) = post(
        &sim,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    )
    .await;
    assert_eq!(status, 400);

    invalid_json_is_refused(&sim, "/v1/completions").await;
    sim.shutdown().await;
}

#[tokio::test]
async fn models_health_and_metrics() {
    let sim = sim(|_| {}).await;
    let models: Value = reqwest::get(format!("http://{}/v1/models", sim.http_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "kvroute-sim");
    let health = reqwest::get(format!("http://{}/health", sim.http_addr))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    post(
        &sim,
        "/v1/completions",
        json!({"prompt": long_prompt(), "max_tokens": 1}),
    )
    .await;
    post(
        &sim,
        "/v1/completions",
        json!({"prompt": long_prompt(), "max_tokens": 1}),
    )
    .await;
    let text = reqwest::get(format!("http://{}/metrics", sim.http_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}{{model_name=\"kvroute-sim\"}} ")))
            .unwrap_or_else(|| panic!("{name} missing"))
            .parse()
            .unwrap()
    };
    assert!(value("vllm:prefix_cache_hits_total") > 0.0);
    assert!(value("vllm:prefix_cache_queries_total") > value("vllm:prefix_cache_hits_total"));
    assert_eq!(value("vllm:time_to_first_token_seconds_count"), 2.0);
    assert_eq!(value("vllm:num_requests_running"), 0.0);
    assert!(text.contains("vllm:cache_config_info{block_size=\"16\""));
    sim.shutdown().await;
}

#[tokio::test]
async fn fault_knobs() {
    let failing = sim(|c| c.fail_rate = 1.0).await;
    let (status, body) = post(&failing, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, 500);
    assert_eq!(body["error"]["type"], "InternalServerError");
    failing.shutdown().await;

    let stopping = sim(|c| c.stop_after = Some(1)).await;
    let (status, _) = post(&stopping, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, 200);
    let hung = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", stopping.http_addr))
        .json(&json!({"prompt": "x"}))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    stopping.shutdown().await;
}
