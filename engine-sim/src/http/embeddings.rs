//! `POST /v1/embeddings`, OpenAI's embeddings API over the
//! [`crate::embeddings`] test double, so the semantic response cache's
//! tests and the demo need no embedding model. The vectors mean nothing
//! about meaning beyond shared words (see that module).
//!
//! 1. The model is the sim's `--model` (a missing or null `model` too);
//!    any other name, a LoRA adapter's included, is a 404 shaped as for
//!    completions.
//! 2. `input` is a string or a list of 1 to [`MAX_INPUTS`] strings, each at
//!    most [`MAX_INPUT_BYTES`] bytes of UTF-8 with at least one word; token
//!    id inputs are refused. The body is at most [`MAX_BODY_BYTES`]. Every
//!    input is checked before any is embedded, so a refused request costs
//!    no more than its parse.
//! 3. `encoding_format` is `"float"` (the default); `"base64"` is refused.
//!    `dimensions`, if given, must be [`DIM`].
//! 4. `usage.prompt_tokens` (and `total_tokens`) counts words: the double
//!    has no tokenizer of its own.
//!
//! Not here: the engine. Embeddings take no KV cache, scheduling or
//! metrics, and the fault knobs (`--fail-rate`, `--stop-after`,
//! `--extra-latency-ms`) do not apply to them.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{App, bad_request, error, unknown_model};
use crate::embeddings::{DIM, embed_words, words};

/// Inputs in one request, at most (OpenAI's API allows 2,048).
pub const MAX_INPUTS: usize = 256;

/// Bytes of UTF-8 in one input, at most: a long question with room to
/// spare, and a bound on the work one client can ask for.
pub const MAX_INPUT_BYTES: usize = 32 * 1024;

/// Bytes in a request body, at most: twice the largest valid request's
/// text, room for JSON's quoting and escapes as clients usually write them.
/// (The sim's other endpoints, like vLLM, set no limit.)
pub const MAX_BODY_BYTES: usize = 2 * MAX_INPUTS * MAX_INPUT_BYTES;

/// The handler.
pub(super) async fn embeddings(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            return error(
                rejection.status(),
                "BadRequestError",
                format!(
                    "{}; /v1/embeddings accepts bodies of at most {MAX_BODY_BYTES} bytes",
                    rejection.body_text()
                ),
            );
        }
    };
    match respond(&app, &body) {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(Refusal::UnknownModel(model)) => unknown_model(&model),
        Err(Refusal::BadRequest(message)) => bad_request(message),
    }
}

/// Why a request is refused; [`embeddings`] gives each its status and body.
#[derive(Debug)]
enum Refusal {
    /// The request named a model the sim does not serve.
    UnknownModel(String),
    /// Anything else wrong with it: the message says what.
    BadRequest(String),
}

fn bad(message: impl Into<String>) -> Refusal {
    Refusal::BadRequest(message.into())
}

fn respond(app: &App, body: &[u8]) -> Result<Value, Refusal> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(bad("the request body must be a JSON object"));
    };
    let model = &app.engine.config().model;
    match obj.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == model => {}
        Some(Value::String(m)) => return Err(Refusal::UnknownModel(m.clone())),
        Some(_) => return Err(bad("'model' must be a string")),
    }
    match obj.get("encoding_format") {
        None | Some(Value::Null) => {}
        Some(Value::String(f)) if f == "float" => {}
        Some(Value::String(f)) if f == "base64" => {
            return Err(bad(
                "encoding_format \"base64\" is not supported by the simulator; use \"float\"",
            ));
        }
        Some(other) => {
            return Err(bad(format!(
                "encoding_format must be \"float\", got {other}"
            )));
        }
    }
    match obj.get("dimensions") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_u64() == Some(DIM as u64) => {}
        Some(d) => {
            return Err(bad(format!(
                "the simulator's embeddings have {DIM} dimensions; 'dimensions' must be {DIM} if given, got {d}"
            )));
        }
    }
    let (texts, single) = inputs(obj.get("input"))?;
    for (i, text) in texts.iter().enumerate() {
        if text.len() > MAX_INPUT_BYTES {
            return Err(bad(format!(
                "{} is {} bytes; the simulator embeds at most {MAX_INPUT_BYTES}",
                name(i, single),
                text.len()
            )));
        }
    }
    let mut data = Vec::with_capacity(texts.len());
    let mut word_count = 0;
    for (i, text) in texts.iter().enumerate() {
        let words = words(text);
        if words.is_empty() {
            return Err(bad(format!("{} has no words", name(i, single))));
        }
        let Some(embedding) = embed_words(&words) else {
            return Err(bad(format!(
                "{}'s features cancel out to the zero vector, which has no direction",
                name(i, single)
            )));
        };
        word_count += words.len();
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": word_count, "total_tokens": word_count},
    }))
}

/// The texts to embed, and whether `input` was one string.
fn inputs(input: Option<&Value>) -> Result<(Vec<&str>, bool), Refusal> {
    const SHAPE: &str = "'input' is required and must be a string or a list of strings (the simulator embeds no token ids)";
    match input {
        Some(Value::String(s)) => Ok((vec![s.as_str()], true)),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(bad("'input' must not be an empty list"))
        }
        Some(Value::Array(items)) if items.len() > MAX_INPUTS => Err(bad(format!(
            "'input' has {} items; the simulator embeds at most {MAX_INPUTS} per request",
            items.len()
        ))),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().ok_or_else(|| bad(SHAPE)))
            .collect::<Result<_, _>>()
            .map(|texts| (texts, false)),
        _ => Err(bad(SHAPE)),
    }
}

/// How errors name an input: `input`, or `input[i]` in a list.
fn name(i: usize, single: bool) -> String {
    if single {
        "input".to_owned()
    } else {
        format!("input[{i}]")
    }
}
