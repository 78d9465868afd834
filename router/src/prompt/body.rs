//! Reading a request body for routing, and nothing more: the top-level
//! fields routing needs (the model, `stream`, the conversation key, the
//! client's `cache_salt`, `max_tokens`), the body parsed whole, or a chat's
//! messages kept as raw JSON and read one at a time. Turning messages into
//! a prompt is the readers' job ([`super::tokens`], [`super::chunks`]). The
//! body itself is forwarded unchanged (except where tenancy rewrites
//! `cache_salt`).

use std::borrow::Cow;

use kvroute_core::tokenize::{ChatMessage, TokenizeError, content_text};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::json_skim;
use crate::errors::ApiError;

/// Which API a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
    /// Any other `/v1/*` POST (embeddings, responses, …).
    Other,
}

impl Api {
    /// The API of a request path.
    pub fn of(path: &str) -> Self {
        match path {
            "/v1/chat/completions" => Api::Chat,
            "/v1/completions" => Api::Completion,
            _ => Api::Other,
        }
    }
}

/// The routing-relevant fields of a body.
#[derive(Clone, Debug, Default)]
pub struct Features {
    /// `model`.
    pub model: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// `prompt_cache_key`.
    pub prompt_cache_key: Option<String>,
    /// `cache_salt` as the client sent it.
    pub cache_salt: Option<String>,
    /// `max_completion_tokens`, else `max_tokens`, when a whole number
    /// (the engine judges other values).
    pub max_tokens: Option<u64>,
    /// `n`, the choices asked for, when a whole number.
    pub n: Option<u64>,
}

/// Parses `body` as a JSON object. Chat and completions bodies must be one,
/// and so must every body when `strict` (salted tenancy: a body the router
/// cannot read could carry a `cache_salt` the engine reads); other APIs may
/// carry anything (`Ok(None)` when it is not JSON).
pub fn parse(api: Api, body: &[u8], strict: bool) -> Result<Option<Map<String, Value>>, ApiError> {
    let strict = strict || api != Api::Other;
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(obj)) => Ok(Some(obj)),
        Ok(_) if strict => Err(ApiError::BadRequest(
            "the request body must be a JSON object".into(),
        )),
        Err(e) if strict => Err(ApiError::BadRequest(format!("invalid JSON body: {e}"))),
        _ => Ok(None),
    }
}

/// The top-level fields [`features`] reads, and only those: what a policy
/// that reads no prompt needs. The other values are skipped as they are
/// scanned, never built, so a large prompt costs one pass over its bytes.
/// With `messages`, a chat's messages are kept too, each as its raw JSON
/// within `body`. Chat and completions bodies must be JSON objects; other
/// APIs' bodies may be anything (`Ok(None)`).
pub fn scan(api: Api, body: &[u8], messages: bool) -> Result<Option<Scanned<'_>>, ApiError> {
    if let Ok(scanned) = skim(body, messages) {
        return Ok(Some(scanned));
    }
    match scan_with_serde(body, messages) {
        Ok(s) => Ok(Some(s)),
        Err(_) if api == Api::Other => Ok(None),
        Err(e) => Err(ApiError::BadRequest(format!("invalid JSON body: {e}"))),
    }
}

/// [`scan`] at memchr speed ([`json_skim`]); any body it rejects is read
/// again by [`scan_with_serde`].
pub(crate) fn skim(body: &[u8], messages: bool) -> Result<Scanned<'_>, json_skim::Rejected> {
    let mut scanned = Scanned {
        fields: Map::new(),
        messages: None,
    };
    json_skim::members(body, |key, value| {
        if let Some(name) = feature(&key) {
            let value = serde_json::from_slice(value).map_err(|_| json_skim::Rejected)?;
            scanned.fields.insert(name.into(), value);
        } else if messages && key == "messages" {
            scanned.messages = json_skim::elements(value);
        }
        Ok(())
    })?;
    Ok(scanned)
}

/// [`scan`] by serde_json alone, whose errors name what is wrong.
pub(crate) fn scan_with_serde(body: &[u8], messages: bool) -> serde_json::Result<Scanned<'_>> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde::de::Deserializer::deserialize_map(&mut de, Fields { messages })
        .and_then(|s| de.end().map(|()| s))
}

/// What [`scan`] keeps of a body.
#[derive(Debug)]
pub struct Scanned<'a> {
    /// The [`FEATURES`] fields.
    pub fields: Map<String, Value>,
    /// The chat's messages, each its JSON text, when asked for and a list.
    pub messages: Option<Vec<&'a [u8]>>,
}

/// A `messages` value: the raw elements of a list, else `None` (skipped).
struct RawList<'a>(Option<Vec<&'a [u8]>>);

impl<'de> serde::Deserialize<'de> for RawList<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct List;
        impl<'de> serde::de::Visitor<'de> for List {
            type Value = RawList<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = a.next_element::<&'de RawValue>()? {
                    items.push(item.get().as_bytes());
                }
                Ok(RawList(Some(items)))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Self::Value, A::Error> {
                while a
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(RawList(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(RawList(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(RawList(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(RawList(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(RawList(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(RawList(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(RawList(None))
            }
        }
        d.deserialize_any(List)
    }
}

/// The fields [`features`] reads.
const FEATURES: [&str; 8] = [
    "model",
    "stream",
    "prompt_cache_key",
    "cache_salt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    KV_TRANSFER_PARAMS,
];

/// vLLM's disaggregated-prefill field: the router's to set, never a
/// client's.
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// `key` as one of [`FEATURES`].
fn feature(key: &str) -> Option<&'static str> {
    FEATURES.iter().find(|f| **f == key).copied()
}

/// [`scan`]'s visitor: keeps [`FEATURES`] (and the raw messages when
/// asked), skips the rest.
struct Fields {
    messages: bool,
}

impl<'de> serde::de::Visitor<'de> for Fields {
    type Value = Scanned<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Scanned<'de>, A::Error> {
        let mut scanned = Scanned {
            fields: Map::new(),
            messages: None,
        };
        while let Some(key) = a.next_key::<Key>()? {
            match key {
                Key::Feature(name) => {
                    scanned.fields.insert(name.into(), a.next_value::<Value>()?);
                }
                Key::Messages if self.messages => {
                    scanned.messages = a.next_value::<RawList<'de>>()?.0;
                }
                _ => {
                    a.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(scanned)
    }
}

/// A top-level key as [`Fields`] sees it, matched without allocating.
enum Key {
    Feature(&'static str),
    Messages,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, key: &str) -> Result<Key, E> {
                Ok(match feature(key) {
                    Some(name) => Key::Feature(name),
                    None if key == "messages" => Key::Messages,
                    None => Key::Other,
                })
            }
        }
        d.deserialize_str(Visitor)
    }
}

fn string_field(obj: &Map<String, Value>, field: &str) -> Result<Option<String>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::BadRequest(format!("'{field}' must be a string"))),
    }
}

/// The routing fields of a parsed body.
pub fn features(obj: &Map<String, Value>) -> Result<Features, ApiError> {
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::BadRequest("'stream' must be a boolean".into())),
    };
    if obj.get(KV_TRANSFER_PARAMS).is_some_and(|v| !v.is_null()) {
        return Err(ApiError::BadRequest(format!(
            "'{KV_TRANSFER_PARAMS}' is not accepted from clients: it names a host an engine would connect to"
        )));
    }
    Ok(Features {
        model: string_field(obj, "model")?,
        stream,
        prompt_cache_key: string_field(obj, "prompt_cache_key")?,
        cache_salt: string_field(obj, "cache_salt")?,
        max_tokens: obj
            .get("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| obj.get("max_tokens").and_then(Value::as_u64)),
        n: obj.get("n").and_then(Value::as_u64),
    })
}

/// A chat's messages, their texts moved out of `obj`; `Ok(None)` when one
/// has content the router cannot tokenize.
pub(crate) fn chat_messages(
    obj: &mut Map<String, Value>,
) -> Result<Option<Vec<ChatMessage>>, ApiError> {
    let Some(Value::Array(raw)) = obj.get_mut("messages") else {
        return Err(messages_required());
    };
    if raw.is_empty() {
        return Err(no_messages());
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter_mut().enumerate() {
        match chat_message(i, m)? {
            Some(m) => messages.push(m),
            None => return Ok(None),
        }
    }
    Ok(Some(messages))
}

/// A chat without a list of messages.
pub(crate) fn messages_required() -> ApiError {
    ApiError::BadRequest("'messages' is required and must be a list".into())
}

/// A chat with an empty list of messages.
pub(crate) fn no_messages() -> ApiError {
    ApiError::BadRequest("'messages' must not be empty".into())
}

/// A chat message's role and text, borrowed from the body when they need
/// no unescaping.
pub(crate) struct RawMessage<'a> {
    pub(crate) role: Cow<'a, str>,
    pub(crate) content: Cow<'a, str>,
}

/// Message `i` of a chat from its JSON text (see [`chat_message`]).
pub(crate) fn raw_message(i: usize, raw: &[u8]) -> Result<Option<RawMessage<'_>>, ApiError> {
    // The common message, a string role and a string content, read without
    // building a map; anything else (and every error) the general way.
    if let Some([role, content]) = json_skim::plain_strings(raw, ["role", "content"]) {
        return Ok(Some(RawMessage {
            role: Cow::Borrowed(role),
            content: Cow::Borrowed(content),
        }));
    }
    #[derive(serde::Deserialize)]
    struct Plain<'a> {
        #[serde(borrow)]
        role: Cow<'a, str>,
        #[serde(borrow)]
        content: Cow<'a, str>,
    }
    if let Ok(m) = serde_json::from_slice::<Plain<'_>>(raw) {
        return Ok(Some(RawMessage {
            role: m.role,
            content: m.content,
        }));
    }
    let mut m: Value = serde_json::from_slice(raw)
        .map_err(|e| ApiError::BadRequest(format!("messages[{i}]: {e}")))?;
    Ok(chat_message(i, &mut m)?.map(|m| RawMessage {
        role: Cow::Owned(m.role),
        content: Cow::Owned(m.content),
    }))
}

/// Message `i` of a chat, its text moved out of `m`; `Ok(None)` when it
/// has content the router cannot tokenize.
fn chat_message(i: usize, m: &mut Value) -> Result<Option<ChatMessage>, ApiError> {
    let Some(role) = m.get("role").and_then(Value::as_str).map(str::to_owned) else {
        return Err(ApiError::BadRequest(format!(
            "messages[{i}].role is required and must be a string"
        )));
    };
    let text = match m.get_mut("content") {
        Some(Value::String(text)) => Ok(std::mem::take(text)),
        content => content_text(content.map_or(&Value::Null, |c| &*c)),
    };
    match text {
        Ok(content) => Ok(Some(ChatMessage::new(role, content))),
        Err(TokenizeError::Unsupported(_)) => Ok(None),
        Err(e) => Err(ApiError::BadRequest(format!("messages[{i}].content: {e}"))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;

    use super::*;

    /// `v`, a JSON object, as a map.
    pub(crate) fn obj(v: Value) -> Map<String, Value> {
        let Value::Object(o) = v else { panic!() };
        o
    }

    #[test]
    fn features_are_typed() {
        let f = features(&obj(
            json!({"model": "m", "stream": true, "prompt_cache_key": "c", "cache_salt": "s"}),
        ))
        .unwrap();
        assert_eq!(f.model.as_deref(), Some("m"));
        assert!(f.stream);
        assert_eq!(f.prompt_cache_key.as_deref(), Some("c"));
        assert!(features(&obj(json!({"stream": "yes"}))).is_err());
        let e = features(&obj(
            json!({"kv_transfer_params": {"remote_host": "10.0.0.1"}}),
        ));
        assert!(e.unwrap_err().to_string().contains("kv_transfer_params"));
        assert!(features(&obj(json!({"kv_transfer_params": null}))).is_ok());
        assert!(features(&obj(json!({"model": 3}))).is_err());
    }
}
