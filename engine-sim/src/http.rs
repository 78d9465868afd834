//! vLLM's OpenAI-compatible HTTP surface: completions and chat completions
//! (streaming and not), models, health and metrics, with vLLM's error
//! bodies. Requests are tokenized here (the same way the router computes
//! tokens) and handed to the [`Engine`]. Also `/v1/embeddings`, which
//! vLLM serves only for embedding models: here a test double
//! ([`embeddings`]).

pub mod embeddings;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream;
use kvroute_core::admission;
use kvroute_core::engine::Transfer;
use kvroute_core::hash::{BlockExtras, Lora, validate_cache_salt};
use kvroute_core::tokenize::{
    ChatMessage, ChatTemplate, Tokenizer, chat_prompt_tokens, completion_prompt_tokens,
    content_text,
};
use serde_json::{Value, json};
use xxhash_rust::xxh3::xxh3_64;

use crate::engine::{Engine, EngineError, Generation, Job};
use crate::transfer;

/// What the HTTP handlers share.
#[derive(Debug)]
pub struct App {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Prompt tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template.
    pub template: ChatTemplate,
    requests: AtomicU64,
    /// Seeds `--fail-rate` draws, so sims fail independently of each other.
    fail_seed: u64,
    /// The KV transfer server as producers name it (host, port).
    transfer_at: (String, u16),
    /// Reads blocks from producers.
    client: reqwest::Client,
}

impl App {
    /// Handlers over `engine`.
    /// `transfer_at` is where this engine's KV transfer server is reached.
    pub fn new(
        engine: Arc<Engine>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        transfer_at: (String, u16),
    ) -> Arc<Self> {
        Arc::new(App {
            transfer_at,
            // Idle connections are dropped before a producer closes them
            // (its header-read timeout), so none is reused as it closes.
            client: reqwest::Client::builder()
                .pool_idle_timeout(transfer::HEADER_READ_TIMEOUT / 2)
                .build()
                .unwrap_or_default(),
            engine,
            tokenizer,
            template,
            requests: AtomicU64::new(0),
            fail_seed: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
        })
    }
}

/// The HTTP routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route(
            "/v1/embeddings",
            post(embeddings::embeddings).layer(axum::extract::DefaultBodyLimit::max(
                embeddings::MAX_BODY_BYTES,
            )),
        )
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/restart-cache", post(restart_cache))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                "Not Found".to_owned(),
            )
        })
        // vLLM (uvicorn) sets no body limit; neither does the sim, but for
        // the embeddings double (its route's own limit wins).
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app)
}

/// A vLLM error response: `{"error": {"message", "type", "param", "code"}}`.
fn error(status: StatusCode, kind: &str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

/// vLLM's answer to a request naming a model it does not serve.
fn unknown_model(model: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        format!("The model `{model}` does not exist."),
    )
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message.into())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let c = app.engine.config();
    let created = now_secs();
    // As vLLM lists them: adapters with their path as root and the base
    // model as parent.
    let mut data = vec![json!({
        "id": c.model, "object": "model", "created": created, "owned_by": "vllm",
        "root": c.model, "parent": null, "max_model_len": c.max_model_len, "permission": [],
    })];
    data.extend(c.lora_modules.iter().map(|l| {
        json!({
            "id": l.name, "object": "model", "created": created, "owned_by": "vllm",
            "root": l.path, "parent": c.model, "max_model_len": null, "permission": [],
        })
    }));
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            kvroute_telemetry::metrics::CONTENT_TYPE,
        )],
        app.engine.metrics_text(),
    )
        .into_response()
}

async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    if app.engine.reset_prefix_cache() {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "Failed to reset prefix cache: requests are running".to_owned(),
        )
    }
}

async fn restart_cache(State(app): State<Arc<App>>) -> StatusCode {
    app.engine.restart_cache();
    StatusCode::OK
}

/// Fields both endpoints share.
struct Common {
    max_tokens: u64,
    stream: bool,
    include_usage: bool,
    cache_salt: Option<String>,
    /// The router's admission bound, if it sent one.
    admit_within_ms: Option<u64>,
    /// The room the router asks to leave free with it.
    admit_room_blocks: u64,
    /// The model the request named: the base model or an adapter.
    model: String,
    lora: Option<Lora>,
    /// Disaggregated prefill ([`transfer`]).
    kv: Option<transfer::Params>,
}

/// Parses the body as a JSON object, checks the model and the shared
/// fields, and applies the fault knobs.
async fn prologue(
    app: &App,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(serde_json::Map<String, Value>, Common), Response> {
    let config = app.engine.config();
    let n = app.requests.fetch_add(1, Ordering::Relaxed) + 1;
    if config.stop_after.is_some_and(|limit| n > limit) {
        std::future::pending::<()>().await;
    }
    if config.extra_latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(config.extra_latency_ms)).await;
    }
    if config.fail_rate > 0.0 {
        let draw = xxh3_64(&(n ^ app.fail_seed).to_le_bytes()) as f64 / u64::MAX as f64;
        if draw < config.fail_rate {
            return Err(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "simulated engine failure (--fail-rate)".to_owned(),
            ));
        }
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| bad_request(format!("invalid JSON body: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(bad_request("the request body must be a JSON object"));
    };
    let (model, lora) = match obj.get("model") {
        None | Some(Value::Null) => (config.model.clone(), None),
        Some(Value::String(m)) if *m == config.model => (m.clone(), None),
        Some(Value::String(m)) if config.lora(m).is_some() => (m.clone(), config.lora(m).cloned()),
        Some(Value::String(m)) => return Err(unknown_model(m)),
        Some(_) => return Err(bad_request("'model' must be a string")),
    };
    let max_tokens = match obj
        .get("max_completion_tokens")
        .or_else(|| obj.get("max_tokens"))
    {
        None | Some(Value::Null) => config.default_max_tokens,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n,
            _ => {
                return Err(bad_request(format!(
                    "max_tokens must be at least 1, got {v}."
                )));
            }
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad_request("'stream' must be a boolean")),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            validate_cache_salt(s).map_err(|e| bad_request(e.to_string()))?;
            Some(s.clone())
        }
        Some(_) => {
            return Err(bad_request(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ));
        }
    };
    let kv = transfer::parse(obj.get("kv_transfer_params").unwrap_or(&Value::Null))
        .map_err(bad_request)?;
    // A bound that is not a number asks for no check, as vLLM ignores it.
    let admit_within_ms = headers
        .get(admission::ADMIT_WITHIN_HEADER)
        .and_then(|v| v.to_str().ok()?.trim().parse().ok());
    let admit_room_blocks = headers
        .get(admission::ROOM_HEADER)
        .and_then(|v| v.to_str().ok()?.trim().parse().ok())
        .unwrap_or(0);
    Ok((
        obj,
        Common {
            admit_within_ms,
            admit_room_blocks,
            max_tokens,
            stream,
            include_usage,
            cache_salt,
            model,
            lora,
            kv,
        },
    ))
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let (obj, common) = match prologue(&app, &headers, &body).await {
        Ok(parsed) => parsed,
        Err(response) => return response,
    };
    let prompt = match obj.get("prompt") {
        Some(Value::String(p)) => completion_prompt_tokens(&app.tokenizer, p),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            completion_prompt_tokens(&app.tokenizer, items[0].as_str().unwrap_or_default())
        }
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            Ok(items
                .iter()
                .filter_map(Value::as_u64)
                .map(|t| t.min(u64::from(u32::MAX)) as u32)
                .collect())
        }
        Some(Value::Array(_)) => {
            return bad_request(
                "'prompt' must be a string, one string, or a list of token ids; batches are not supported",
            );
        }
        _ => {
            return bad_request("'prompt' is required and must be a string or a list of token ids");
        }
    };
    let prompt = match prompt {
        Ok(p) => p,
        Err(e) => return bad_request(e.to_string()),
    };
    respond(&app, prompt, common, Kind::Completion).await
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (obj, common) = match prologue(&app, &headers, &body).await {
        Ok(parsed) => parsed,
        Err(response) => return response,
    };
    let Some(Value::Array(raw)) = obj.get("messages") else {
        return bad_request("'messages' is required and must be a list");
    };
    if raw.is_empty() {
        return bad_request("'messages' must not be empty");
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return bad_request(format!(
                "messages[{i}].role is required and must be a string"
            ));
        };
        let content = match content_text(m.get("content").unwrap_or(&Value::Null)) {
            Ok(c) => c,
            Err(e) => return bad_request(format!("messages[{i}].content: {e}")),
        };
        messages.push(ChatMessage {
            role: role.to_owned(),
            content,
        });
    }
    match chat_prompt_tokens(&app.tokenizer, &app.template, messages) {
        Ok(prompt) => respond(&app, prompt, common, Kind::Chat).await,
        Err(e) => bad_request(e.to_string()),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

fn usage(g: &Generation, completion_tokens: u64) -> Value {
    json!({
        "prompt_tokens": g.prompt_tokens,
        "total_tokens": g.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
    })
}

async fn respond(app: &App, prompt: Vec<u32>, common: Common, kind: Kind) -> Response {
    let role = app.engine.config().kv_role;
    let kv = common.kv.unwrap_or_default();
    let hold = kv.remote_decode && role.produces() && !common.stream;
    let loaded_tokens = match &kv.remote_prefill {
        Some(remote) if role.consumes() => {
            let extras = BlockExtras {
                lora: common.lora.as_ref(),
                cache_salt: common.cache_salt.as_deref(),
            };
            transfer::load(&app.engine, &app.client, remote, &prompt, extras).await
        }
        _ => 0,
    };
    let job = Job {
        prompt,
        max_tokens: common.max_tokens,
        cache_salt: common.cache_salt,
        lora: common.lora,
        admit_within_ms: common.admit_within_ms,
        admit_room_blocks: common.admit_room_blocks,
        transfer: Transfer {
            loaded_tokens,
            hold,
        },
    };
    let generation = match app.engine.generate(job).await {
        Ok(g) => g,
        Err(e @ EngineError::Stopped) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                e.to_string(),
            );
        }
        Err(e @ EngineError::Busy { load, .. }) => {
            let mut response = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                e.to_string(),
            );
            let header = kvroute_proto::load::to_header(&load.to_proto());
            if let Ok(value) = HeaderValue::from_str(&header) {
                response.headers_mut().insert(admission::LOAD_HEADER, value);
            }
            return response;
        }
        Err(e) => return bad_request(e.to_string()),
    };
    let model = common.model;
    let created = now_secs();
    let id = format!(
        "{}-{:016x}{:016x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        xxh3_64(&created.to_le_bytes()),
        xxh3_64(&app.requests.load(Ordering::Relaxed).to_le_bytes())
    );
    let mut generation = generation;
    if common.stream {
        // Like vLLM, the response (headers and the role chunk) starts with
        // the first token, after prefill.
        let first = generation.tokens.recv().await;
        return stream_response(
            generation,
            first,
            kind,
            id,
            model,
            created,
            common.include_usage,
        );
    }
    let mut text = String::new();
    let mut n = 0u64;
    while let Some(token) = generation.tokens.recv().await {
        text.push_str(token.text);
        n += 1;
    }
    let usage = usage(&generation, n);
    let (host, port) = &app.transfer_at;
    let kv_transfer_params = hold
        .then(|| transfer::answer(&app.engine, generation.id, host, *port))
        .flatten();
    let mut body = match kind {
        Kind::Completion => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null}],
            "usage": usage,
        }),
        Kind::Chat => json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                         "logprobs": null, "finish_reason": "length", "stop_reason": null}],
            "usage": usage,
        }),
    };
    body["kv_transfer_params"] = kv_transfer_params.unwrap_or(Value::Null);
    axum::Json(body).into_response()
}

/// The token held back for the first chunk, else the next one generated.
async fn next_token(
    first: &mut Option<crate::engine::Token>,
    g: &mut Generation,
) -> Option<crate::engine::Token> {
    match first.take() {
        Some(token) => Some(token),
        None => g.tokens.recv().await,
    }
}

fn usage_chunk(
    chunk: &impl Fn(Value) -> Value,
    g: &Generation,
    n: u64,
) -> Result<Bytes, Infallible> {
    let mut v = chunk(json!([]));
    v["usage"] = usage(g, n);
    sse(&v)
}

fn sse(value: &Value) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("data: {value}\n\n")))
}

/// Server-sent events, one chunk per token as it is generated.
fn stream_response(
    generation: Generation,
    first: Option<crate::engine::Token>,
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
) -> Response {
    let chunk = move |choices: Value| -> Value {
        let object = match kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({"id": id, "object": object, "created": created, "model": model, "choices": choices})
    };
    enum Phase {
        Start,
        Tokens,
        Done,
        End,
    }
    let body = stream::unfold(
        (generation, Phase::Start, 0u64, first),
        move |(mut g, phase, n, mut first)| {
            let chunk = chunk.clone();
            async move {
                let (bytes, next) = match phase {
                    Phase::Start if kind == Kind::Chat => {
                        let delta = json!({"role": "assistant", "content": ""});
                        let choices = json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]);
                        (sse(&chunk(choices)), Phase::Tokens)
                    }
                    Phase::Start | Phase::Tokens => match next_token(&mut first, &mut g).await {
                        Some(token) => {
                            let finish = if token.last {
                                json!("length")
                            } else {
                                Value::Null
                            };
                            let choices = match kind {
                                Kind::Completion => {
                                    json!([{"index": 0, "text": token.text, "logprobs": null, "finish_reason": finish, "stop_reason": null}])
                                }
                                Kind::Chat => {
                                    json!([{"index": 0, "delta": {"content": token.text}, "logprobs": null, "finish_reason": finish, "stop_reason": null}])
                                }
                            };
                            let bytes = sse(&chunk(choices));
                            return Some((bytes, (g, Phase::Tokens, n + 1, None)));
                        }
                        None if include_usage => {
                            return Some((usage_chunk(&chunk, &g, n), (g, Phase::Done, n, None)));
                        }
                        None => (Ok(Bytes::from_static(b"data: [DONE]\n\n")), Phase::End),
                    },
                    Phase::Done => (Ok(Bytes::from_static(b"data: [DONE]\n\n")), Phase::End),
                    Phase::End => return None,
                };
                Some((bytes, (g, next, n, first)))
            }
        },
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
