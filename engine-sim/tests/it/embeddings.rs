//! `/v1/embeddings`, the embedding-model test double, as an OpenAI client
//! sees it.

use kvroute_engine_sim::embeddings::{DIM, cosine, embed};
use kvroute_engine_sim::http::embeddings::{MAX_INPUT_BYTES, MAX_INPUTS};
use serde_json::{Value, json};

use crate::http::{invalid_json_is_refused, post, sim};

fn vector(item: &Value) -> Vec<f32> {
    item["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[tokio::test]
async fn embeddings_are_openai_shaped_and_ignore_case_and_punctuation() {
    let sim = sim(|_| {}).await;
    let (status, body) = post(
        &sim,
        "/v1/embeddings",
        json!({"model": "kvroute-sim", "input": ["What is a KV cache?", "what is a kv cache", "How do I exit Vim?"]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], "kvroute-sim");
    // Words count as tokens: 5 + 5 + 5.
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 15, "total_tokens": 15})
    );
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    for (i, item) in data.iter().enumerate() {
        assert_eq!(item["object"], "embedding");
        assert_eq!(item["index"], i);
    }
    let (a, b, c) = (vector(&data[0]), vector(&data[1]), vector(&data[2]));
    assert_eq!(a.len(), DIM);
    assert_eq!(a, b);
    assert_eq!(
        Some(a.clone()),
        embed("What is a KV cache?"),
        "the library's vectors"
    );
    assert!(cosine(&a, &c) < 0.5);

    // One string, no model named.
    let (status, body) = post(
        &sim,
        "/v1/embeddings",
        json!({"input": "What is a KV cache?"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(vector(&body["data"][0]), a);
    sim.shutdown().await;
}

#[tokio::test]
async fn embedding_errors() {
    let sim = sim(|_| {}).await;
    let (status, body) = post(
        &sim,
        "/v1/embeddings",
        json!({"model": "other", "input": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "NotFoundError");
    assert_eq!(
        body["error"]["message"],
        "The model `other` does not exist."
    );

    let too_long = "a ".repeat(MAX_INPUT_BYTES / 2 + 1);
    for (input, message) in [
        (json!(" ?! "), "input has no words"),
        (json!(["fine", ""]), "input[1] has no words"),
        (json!([]), "must not be an empty list"),
        (json!(vec!["x"; MAX_INPUTS + 1]), "at most 256 per request"),
        (json!(too_long), "at most 32768"),
        (json!([1, 2, 3]), "no token ids"),
    ] {
        let (status, body) = post(&sim, "/v1/embeddings", json!({"input": input})).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["type"], "BadRequestError");
        let got = body["error"]["message"].as_str().unwrap();
        assert!(got.contains(message), "{got}");
    }
    let (status, _) = post(
        &sim,
        "/v1/embeddings",
        json!({"input": "x", "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(status, 400);

    invalid_json_is_refused(&sim, "/v1/embeddings").await;
    sim.shutdown().await;
}
