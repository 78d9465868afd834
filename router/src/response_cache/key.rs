//! What is cacheable, and the key an answer is stored under. Pure: a
//! request's path, headers, tenant and body in; a [`Classified`] out.
//!
//! The rules, in order (the first that applies decides):
//! 1. Only `/v1/chat/completions` and `/v1/completions` are cached.
//! 2. `Cache-Control: no-store`: neither read nor stored. `no-cache`: not
//!    served from the cache, but the new answer is stored.
//! 3. The body is a JSON object naming a `model`.
//! 4. Only deterministic answers: `temperature` 0 (absent means the API's
//!    default of 1), unless the client opts a sampled request in with
//!    `x-kvroute-cache-sampled: 1`; and always `n` 1 (or absent) and no
//!    `logprobs` or `top_logprobs` (they are not stored).
//! 5. The key is a hash of the tenant, the model, the model's roots as the
//!    engines list them in `/v1/models`, `responseCache.version`, the path
//!    and the body's canonical JSON without [`EXCLUDED`]: fields that
//!    change how the answer is delivered or accounted, not what it says.
//!    Keyed (HMAC-SHA256) with the configured key material, else plain
//!    SHA-256. Each part is length-prefixed, so no two different
//!    requests hash the same bytes.
//!
//! A streamed request without `stream_options.include_usage` is forwarded
//! with it, so its answer can be stored whole; the usage chunk is then
//! taken out of what the client gets ([`super::capture`]).
//!
//! Not here: the stores, and reading and serving answers.

use axum::http::HeaderMap;
use axum::http::header::CACHE_CONTROL;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// The header opting a sampled request (`temperature` not 0) in.
pub const SAMPLED_HEADER: &str = "x-kvroute-cache-sampled";

/// Body fields left out of the key: they change how an answer is
/// delivered or accounted, never what it says.
pub const EXCLUDED: [&str; 8] = [
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "request_id",
    "priority",
];

/// The two cached APIs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

impl Api {
    /// The API at `path`, if cached.
    pub fn of(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completion),
            _ => None,
        }
    }
}

/// The key an answer is stored under.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// The hash of every part.
    pub digest: [u8; 32],
    /// The model the request named (a purge's scope).
    pub model: String,
}

impl Key {
    /// The digest in hex.
    pub fn hex(&self) -> String {
        self.digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// How a cacheable request asked to be answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Form {
    /// Its API.
    pub api: Api,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage: true` (as the client sent it).
    pub include_usage: bool,
}

/// What the semantic level matches a request by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    /// The last user message (chat) or the prompt (completions).
    pub text: String,
    /// The hash of everything else the key hashes: a stored answer serves
    /// a similar question only when this is equal.
    pub context: [u8; 32],
}

/// A request the cache may answer.
#[derive(Debug)]
pub struct Cacheable {
    /// Where its answer is stored.
    pub key: Key,
    /// How it wants its answer.
    pub form: Form,
    /// Whether the cache may answer it (false with `no-cache`).
    pub read: bool,
    /// The body to forward instead of the client's: with
    /// `stream_options.include_usage` added, for a stream without it.
    pub forward: Option<Bytes>,
    /// With the semantic level on: its question, when it has one in text.
    pub question: Option<Question>,
}

/// What the cache does with a request.
#[derive(Debug)]
pub enum Classified {
    /// Passed by: the reason (a bounded label for logs and tests).
    Bypass(&'static str),
    /// Looked up and stored.
    Cacheable(Cacheable),
}

/// What the key is computed with, besides the request.
#[derive(Debug, Default)]
pub struct Keying {
    /// HMAC key material; empty: plain SHA-256.
    pub secret: Vec<u8>,
    /// `responseCache.version`.
    pub version: String,
    /// Whether requests' [`Question`]s are wanted (the semantic level).
    pub semantic: bool,
}

/// Classifies a request to `path` with `headers` and `body` from `tenant`;
/// `roots` lists the model's roots as the engines report them (see the
/// module doc for the rules).
pub fn classify(
    keying: &Keying,
    path: &str,
    headers: &HeaderMap,
    tenant: Option<&str>,
    body: &[u8],
    roots: impl Fn(&str) -> Vec<String>,
) -> Classified {
    let Some(api) = Api::of(path) else {
        return Classified::Bypass("path");
    };
    let control = directives(headers);
    if control.iter().any(|d| d == "no-store") {
        return Classified::Bypass("no_store");
    }
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(body) else {
        return Classified::Bypass("body");
    };
    let Some(model) = fields
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_owned)
    else {
        return Classified::Bypass("body");
    };
    if let Some(reason) = nondeterministic(&fields, api, sampled(headers)) {
        return Classified::Bypass(reason);
    }
    let stream = fields.get("stream").and_then(Value::as_bool) == Some(true);
    let include_usage = fields
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true);
    let forward = (stream && !include_usage).then(|| with_usage(&fields));
    for field in EXCLUDED {
        fields.remove(field);
    }
    let canonical = serde_json::to_vec(&fields).unwrap_or_default();
    let roots = roots(&model).join("\n");
    let head: [&[u8]; 5] = [
        tenant.unwrap_or("").as_bytes(),
        model.as_bytes(),
        roots.as_bytes(),
        keying.version.as_bytes(),
        path.as_bytes(),
    ];
    // The tenant's presence is a part too: no tenant and an empty one
    // never share a key.
    let present = [u8::from(tenant.is_some())];
    let key_digest = digest(&keying.secret, KEY_TAG, &present, &head, &canonical);
    let question = (keying.semantic)
        .then(|| question(&fields, api))
        .flatten()
        .map(|(text, rest)| {
            let rest = serde_json::to_vec(&rest).unwrap_or_default();
            let context = digest(&keying.secret, CONTEXT_TAG, &present, &head, &rest);
            Question { text, context }
        });
    Classified::Cacheable(Cacheable {
        key: Key {
            digest: key_digest,
            model,
        },
        form: Form {
            api,
            stream,
            include_usage,
        },
        read: !control.iter().any(|d| d == "no-cache"),
        forward,
        question,
    })
}

/// The question in `fields` (the last user message, or the prompt) and
/// the fields without it; `None` when it is not all text.
fn question(fields: &Map<String, Value>, api: Api) -> Option<(String, Map<String, Value>)> {
    let mut rest = fields.clone();
    let slot = match api {
        Api::Completion => rest.get_mut("prompt")?,
        Api::Chat => {
            let messages = rest.get_mut("messages")?.as_array_mut()?;
            let last = (messages.iter_mut())
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))?;
            last.get_mut("content")?
        }
    };
    let text = match slot.take() {
        Value::String(text) => text,
        // Content parts: text only (an image is not a question in text).
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                if part.get("type").and_then(Value::as_str) != Some("text") {
                    return None;
                }
                text.push_str(part.get("text")?.as_str()?);
            }
            text
        }
        _ => return None,
    };
    (!text.trim().is_empty()).then_some((text, rest))
}

/// Why the answer would not be deterministic, if it would not be.
fn nondeterministic(fields: &Map<String, Value>, api: Api, sampled: bool) -> Option<&'static str> {
    let absent = |v: Option<&Value>| v.is_none_or(Value::is_null);
    if !absent(fields.get("n")) && fields.get("n").and_then(Value::as_u64) != Some(1) {
        return Some("n");
    }
    let logprobs = match (api, fields.get("logprobs")) {
        (_, None | Some(Value::Null)) => false,
        (Api::Chat, Some(v)) => v.as_bool() != Some(false),
        (Api::Completion, Some(_)) => true,
    };
    if logprobs || !absent(fields.get("top_logprobs")) {
        return Some("logprobs");
    }
    let greedy = fields.get("temperature").and_then(Value::as_f64) == Some(0.0);
    if !greedy && !sampled {
        return Some("sampled");
    }
    None
}

/// The body with `stream_options.include_usage: true`.
fn with_usage(fields: &Map<String, Value>) -> Bytes {
    let mut fields = fields.clone();
    let options = fields
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if !options.is_object() {
        *options = Value::Object(Map::new());
    }
    if let Value::Object(o) = options {
        o.insert("include_usage".into(), Value::Bool(true));
    }
    Bytes::from(serde_json::to_vec(&Value::Object(fields)).unwrap_or_default())
}

/// The request's `Cache-Control` directives, lower-cased.
fn directives(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.trim().to_ascii_lowercase())
        .collect()
}

/// Whether the client opted a sampled request in.
fn sampled(headers: &HeaderMap) -> bool {
    headers
        .get(SAMPLED_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1" || v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// The domain of exact keys.
const KEY_TAG: &[u8] = b"kvroute-response-cache/1";
/// The domain of semantic contexts.
const CONTEXT_TAG: &[u8] = b"kvroute-semantic-context/1";

/// HMAC-SHA256 under `secret` (plain SHA-256 when empty) of `tag`,
/// `present`, each part of `head` and `body`, length-prefixed.
fn digest(secret: &[u8], tag: &[u8], present: &[u8], head: &[&[u8]], body: &[u8]) -> [u8; 32] {
    let feed = |update: &mut dyn FnMut(&[u8])| {
        update(tag);
        update(present);
        for part in head.iter().copied().chain([body]) {
            update(&(part.len() as u64).to_le_bytes());
            update(part);
        }
    };
    if secret.is_empty() {
        let mut h = Sha256::new();
        feed(&mut |b| h.update(b));
        h.finalize().into()
    } else {
        let mut h = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
        feed(&mut |b| h.update(b));
        h.finalize().into_bytes().into()
    }
}

#[cfg(test)]
mod tests;
