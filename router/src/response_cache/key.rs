//! What is cacheable, and the key an answer is stored under. Pure: a
//! request's path, headers, tenant and body in; a [`Classified`] out.
//!
//! The rules, in order (the first that applies decides):
//! 1. Only `/v1/chat/completions` and `/v1/completions` are cached: the
//!    prompt reader's [`Api`] says which API a path is, and
//!    [`Api::Other`] is passed by.
//! 2. `Cache-Control: no-store`: neither read nor stored. `no-cache`: not
//!    served from the cache, but the new answer is stored.
//! 3. The body is a JSON object naming a `model`, with a canonical form
//!    ([`canon`]: no repeated key, at most [`canon::MAX_MEMBERS`] members
//!    an object, no integral number too large to be exact).
//! 4. Only deterministic answers: `temperature` 0 (absent means the API's
//!    default of 1), unless the client opts a sampled request in with
//!    `x-kvroute-cache-sampled: 1`; and always `n` 1 (or absent).
//! 5. Only answers the stored form reproduces whole: no `logprobs`,
//!    `top_logprobs` or `prompt_logprobs`, no `return_token_ids`, no
//!    `kv_transfer_params`.
//! 6. The key is a hash of the tenant, the model, the model's roots as the
//!    engines list them in `/v1/models`, `responseCache.version`, the path,
//!    the `Authorization` header when it is forwarded to the engines
//!    (`proxy.forwardAuthorization`: the engine's own authentication
//!    decides the answer, so a request is never served what its own
//!    credential would not have obtained), and the canonical form of the
//!    body without [`EXCLUDED`]: fields that change how the answer is
//!    delivered or accounted, not what it says. Keyed (HMAC-SHA256) with
//!    the configured key material, else plain SHA-256. Each part is
//!    length-prefixed, so no two different requests hash the same bytes.
//!
//! The body is read without building a tree of it ([`canon`], [`chat`]):
//! classifying a body costs about its own size, whatever it holds.
//!
//! A streamed request without `stream_options.include_usage` is forwarded
//! with it, so its answer can be stored whole; the usage chunk is then
//! taken out of what the client gets ([`super::capture`]).
//!
//! Not here: the stores, and reading and serving answers.

mod canon;
mod chat;

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL};
use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use self::canon::Members;
use crate::prompt::body::Api;
use crate::prompt::json_skim;

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
    /// Its API: chat or completions, never [`Api::Other`] ([`classify`]
    /// passes it by).
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
    /// Whether `Authorization` is forwarded to the engines
    /// (`proxy.forwardAuthorization`), and so is part of the key.
    pub credentials: bool,
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
    let api = Api::of(path);
    if api == Api::Other {
        return Classified::Bypass("path");
    }
    let control = directives(headers);
    if control.iter().any(|d| d == "no-store") {
        return Classified::Bypass("no_store");
    }
    let read = match Read::of(body, api, keying.semantic) {
        Ok(read) => read,
        Err(reason) => return Classified::Bypass(reason),
    };
    let Some(model) = read
        .field("model")
        .and_then(|raw| serde_json::from_slice::<String>(raw).ok())
    else {
        return Classified::Bypass("body");
    };
    if let Some(reason) = nondeterministic(&read, api, sampled(headers)) {
        return Classified::Bypass(reason);
    }
    let stream = read.scalar("stream") == Some(Value::Bool(true));
    let options = read.field("stream_options");
    let include_usage = options
        .filter(|raw| raw.len() <= MAX_SCALAR_BYTES)
        .and_then(|raw| serde_json::from_slice::<Value>(raw).ok())
        .and_then(|o| o.get("include_usage")?.as_bool())
        == Some(true);
    let forward = match (stream && !include_usage).then(|| with_usage(body, options)) {
        Some(Some(forward)) => Some(forward),
        Some(None) => return Classified::Bypass("body"),
        None => None,
    };
    let roots = roots(&model).join("\n");
    // A credential forwarded to the engines decides what they answer.
    let credential = if keying.credentials {
        (headers.get_all(AUTHORIZATION).iter().map(|v| v.as_bytes()))
            .collect::<Vec<_>>()
            .join(&b'\n')
    } else {
        Vec::new()
    };
    let head: [&[u8]; 6] = [
        tenant.unwrap_or("").as_bytes(),
        model.as_bytes(),
        roots.as_bytes(),
        keying.version.as_bytes(),
        path.as_bytes(),
        &credential,
    ];
    // The tenant's presence is a part too: no tenant and an empty one
    // never share a key.
    let present = [u8::from(tenant.is_some())];
    let Read {
        mut members,
        question,
        ..
    } = read;
    let Some(canonical) = body_digest(&mut members) else {
        return Classified::Bypass(canon::DUPLICATE);
    };
    let key_digest = digest(&keying.secret, KEY_TAG, &present, &head, &canonical);
    let question = question
        .filter(|_| keying.semantic)
        .and_then(|(context, text)| {
            let asked = members.iter_mut().find(|(k, _)| Some(&**k) == asked(api))?;
            asked.1 = context;
            let rest = body_digest(&mut members)?;
            let context = digest(&keying.secret, CONTEXT_TAG, &present, &head, &rest);
            Some(Question {
                text: text?,
                context,
            })
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

/// The digest of the body's canonical form: its kept `members`.
fn body_digest(members: &mut Members<'_>) -> Option<[u8; 32]> {
    let mut out = Sha256::new();
    canon::object(&mut out, members).ok()?;
    Some(out.finalize().into())
}

/// Values longer than this are never what a rule looks for (a number, a
/// flag, a short object): they are read as "present", never parsed.
const MAX_SCALAR_BYTES: usize = 4096;

/// The top-level fields the rules read.
const RULES: [&str; 10] = [
    "model",
    "n",
    "temperature",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "prompt_logprobs",
    "return_token_ids",
    "kv_transfer_params",
];

/// The member holding an API's question (none for an API not cached).
fn asked(api: Api) -> Option<&'static str> {
    match api {
        Api::Chat => Some("messages"),
        Api::Completion => Some("prompt"),
        Api::Other => None,
    }
}

/// What classifying reads of a body, in one pass over its members.
struct Read<'b> {
    /// Every member but [`EXCLUDED`]: its key and its value's digest.
    members: Members<'b>,
    /// The question's member (`messages` or `prompt`): its digest with
    /// the question left out, and the question if it is text.
    question: Option<([u8; 32], Option<String>)>,
    /// The raw values of [`RULES`], by index.
    rules: [Option<&'b [u8]>; RULES.len()],
}

impl<'b> Read<'b> {
    /// Reads `body`, a request to `api`, with its question when `asking`:
    /// refused when it is not a JSON object with a canonical form.
    fn of(body: &'b [u8], api: Api, asking: bool) -> Result<Self, canon::Refused> {
        let mut read = Read {
            members: Members::new(),
            question: None,
            rules: [None; RULES.len()],
        };
        let mut refused = "body";
        let walked = json_skim::members(body, |key, value| {
            if let Some(i) = RULES.iter().position(|r| *r == key) {
                read.rules[i] = Some(value);
            }
            if EXCLUDED.contains(&&*key) {
                return Ok(());
            }
            if read.members.len() == canon::MAX_MEMBERS {
                refused = canon::MEMBERS;
                return Err(json_skim::Rejected);
            }
            let read_as = (Some(&*key) == asked(api)).then_some(api);
            let digested = match read_as {
                Some(Api::Chat) => chat::messages(value, asking),
                Some(Api::Completion) => canon::digest(value).map(|d| {
                    let text = asking.then(|| chat::text_of(value)).flatten();
                    (d, Some((chat::BLANK, text)))
                }),
                Some(Api::Other) | None => canon::digest(value).map(|d| (d, None)),
            };
            let (digest, question) = digested.map_err(|why| {
                refused = why;
                json_skim::Rejected
            })?;
            if question.is_some() {
                read.question = question;
            }
            read.members.push((key, digest));
            Ok(())
        });
        walked.map_err(|_| refused)?;
        Ok(read)
    }

    /// The raw value of `field`, one of [`RULES`].
    fn field(&self, field: &str) -> Option<&'b [u8]> {
        self.rules[RULES.iter().position(|r| *r == field)?]
    }

    /// `field` as a value, when present; a long one is read as an empty
    /// string (present, and neither null, a number nor a flag).
    fn scalar(&self, field: &str) -> Option<Value> {
        let raw = self.field(field)?;
        if raw.len() > MAX_SCALAR_BYTES {
            return Some(Value::String(String::new()));
        }
        serde_json::from_slice(raw).ok()
    }
}

/// Why the answer would not be deterministic, or not reproducible from
/// what is stored, if so.
fn nondeterministic(read: &Read<'_>, api: Api, sampled: bool) -> Option<&'static str> {
    let present = |field| read.scalar(field).is_some_and(|v| !v.is_null());
    let n = read.scalar("n");
    if n.as_ref().is_some_and(|v| !v.is_null()) && n.and_then(|v| v.as_u64()) != Some(1) {
        return Some("n");
    }
    let logprobs = match (api, read.scalar("logprobs")) {
        (_, None | Some(Value::Null)) => false,
        (Api::Chat, Some(v)) => v.as_bool() != Some(false),
        (Api::Completion | Api::Other, Some(_)) => true,
    };
    if logprobs || present("top_logprobs") || present("prompt_logprobs") {
        return Some("logprobs");
    }
    // What the stored answer does not hold: the prompt's token ids, the
    // engine's KV transfer handle.
    let token_ids = read
        .scalar("return_token_ids")
        .is_some_and(|v| v != Value::Bool(false));
    if token_ids || present("kv_transfer_params") {
        return Some("unreproducible");
    }
    let greedy = read.scalar("temperature").and_then(|v| v.as_f64()) == Some(0.0);
    if !greedy && !sampled {
        return Some("sampled");
    }
    None
}

/// `body` with `stream_options` (its raw value, `options`) asking for
/// `include_usage`; `None` when it cannot be rewritten.
fn with_usage(body: &[u8], options: Option<&[u8]>) -> Option<Bytes> {
    let mut options = match options {
        Some(raw) if raw.len() > MAX_SCALAR_BYTES => return None,
        Some(raw) => match serde_json::from_slice(raw) {
            Ok(Value::Object(o)) => o,
            _ => Map::new(),
        },
        None => Map::new(),
    };
    options.insert("include_usage".into(), Value::Bool(true));
    let options = serde_json::to_vec(&options).ok()?;
    json_skim::replaced(body, "stream_options", &options)
        .ok()
        .map(Bytes::from)
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
const KEY_TAG: &[u8] = b"kvroute-response-cache/2";
/// The domain of semantic contexts.
const CONTEXT_TAG: &[u8] = b"kvroute-semantic-context/2";

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
