//! What routing needs from a request body, and nothing more: the model,
//! `stream`, the conversation key, the client's `cache_salt`, and the
//! prompt as the engine will tokenize it. The body itself is forwarded
//! unchanged (except where tenancy rewrites `cache_salt`).

use std::borrow::Cow;

use kvroute_core::hash::{BlockExtras, Chain, ChainState};
use kvroute_core::tokenize::{
    ChatMessage, ChatTemplate, TokenizeError, Tokenizer, chat_prompt_tokens,
    completion_prompt_tokens, content_text, for_each_chat_token,
};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use xxhash_rust::xxh3::Xxh3;

use crate::errors::ApiError;
use crate::json_skim;
use crate::prefixes;
use crate::settings::Settings;

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
const FEATURES: [&str; 6] = [
    "model",
    "stream",
    "prompt_cache_key",
    "cache_salt",
    "max_tokens",
    "max_completion_tokens",
];

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
    Ok(Features {
        model: string_field(obj, "model")?,
        stream,
        prompt_cache_key: string_field(obj, "prompt_cache_key")?,
        cache_salt: string_field(obj, "cache_salt")?,
        max_tokens: obj
            .get("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| obj.get("max_tokens").and_then(Value::as_u64)),
    })
}

/// What routing keeps of a prompt: its length in tokens, its first tokens
/// (the routing key's), and its block chain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    /// Prompt tokens.
    pub tokens: u64,
    /// The first tokens, up to the key's `prefixTokens`.
    pub head: Vec<u32>,
    /// The block hashes of its full blocks; given [`Held`], only up to a
    /// block no engine holds.
    pub chain: Vec<u64>,
    /// Every token, when asked for (`kvroute explain`); else empty.
    pub all: Vec<u32>,
    /// The content hash (XXH3 of the token ids alone, unchained) of each
    /// of the first [`prefixes::BLOCKS`] full blocks, for spotting
    /// volatile prefixes.
    pub contents: Vec<u64>,
}

/// The prompt as the engine will tokenize it, when the router can know it.
/// `Ok(None)` when the request has content the router cannot tokenize
/// (images, say): it is then routed by its key alone. Missing or mistyped
/// fields are a 400.
///
/// Message texts are moved out of `obj`. With the built-in tokenizer and
/// template the chat's tokens go straight into the chain, one at a time,
/// so a large prompt is held about twice (the body and its texts); other
/// tokenizers hold the rendered prompt and its ids as well.
/// With `keep_all`, [`Prompt::all`] holds every token.
pub fn prompt(
    api: Api,
    obj: &mut Map<String, Value>,
    settings: &Settings,
    extras: BlockExtras<'_>,
    keep_all: bool,
    held: Option<Held<'_>>,
) -> Result<Option<Prompt>, ApiError> {
    let mut builder = Builder::new(settings, extras, keep_all, held);
    let tokens = if api == Api::Chat {
        let Some(messages) = chat_messages(obj)? else {
            return Ok(None);
        };
        let (tokenizer, template) = (&settings.tokenizer, &settings.template);
        if for_each_chat_token(tokenizer, template, &messages, true, |t| builder.push(t)) {
            return Ok(Some(builder.prompt));
        }
        // A template or tokenizer failure is the router's limit, not the
        // client's error: route without a chain.
        chat_prompt_tokens(tokenizer, template, messages).ok()
    } else {
        prompt_tokens(api, obj, settings)?
    };
    Ok(tokens.map(|tokens| {
        tokens.into_iter().for_each(|t| builder.push(t));
        builder.prompt
    }))
}

/// Whether any engine holds a block (exact mode's index). Given it, a
/// [`Prompt`]'s chain stops at the first block [asked about](asks) that
/// none holds: no held prefix reaches past it, and a policy that
/// [reads only held prefixes](kvroute_core::policy::PolicyConfig::reads_held_prefix_only)
/// looks no further, so hashing the rest of a prompt nobody has seen would
/// be wasted. Tokens are still counted, and the first blocks' contents
/// hashed for the volatile-prefix sketch.
pub type Held<'a> = &'a dyn Fn(u64) -> bool;

/// Blocks between two questions to [`Held`] once past the first few.
const HELD_EVERY: usize = 64;

/// Whether [`Held`] is asked about a chain's last block when it has
/// `blocks`: after 1, 2, 4, ... 64 blocks, then every 64. An unseen prompt
/// costs one block's hash, a held prefix of `n` blocks at most `2n` (and
/// 63 more past 64), and a long held prompt a lock every 64 blocks.
fn asks(blocks: usize) -> bool {
    blocks.is_power_of_two() || blocks.is_multiple_of(HELD_EVERY)
}

/// Builds a [`Prompt`] one token at a time.
struct Builder<'a> {
    chain: Chain<'a>,
    /// Whether to go on hashing, when [`asks`] says to ask.
    held: Option<Held<'a>>,
    /// Set once [`held`](Self::held) said no: tokens are only counted.
    stopped: bool,
    block_size: u64,
    head_len: usize,
    keep_all: bool,
    /// The current block's content hash, while contents are wanted.
    content: Xxh3,
    prompt: Prompt,
}

impl<'a> Builder<'a> {
    fn new(
        settings: &'a Settings,
        extras: BlockExtras<'a>,
        keep_all: bool,
        held: Option<Held<'a>>,
    ) -> Self {
        Builder {
            chain: settings.hasher.chain(extras),
            held,
            stopped: false,
            block_size: settings.hasher.config().block_size as u64,
            head_len: settings.key.prefix_tokens,
            keep_all,
            content: Xxh3::new(),
            prompt: Prompt::default(),
        }
    }

    /// Goes on from `s`.
    fn resume(settings: &'a Settings, extras: BlockExtras<'a>, s: Snapshot) -> Self {
        Builder {
            chain: settings.hasher.resume(s.chain, extras),
            content: s.content,
            prompt: s.prompt,
            ..Builder::new(settings, extras, false, None)
        }
    }

    /// Where the prompt stands, to resume from.
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            chain: self.chain.state(),
            content: self.content.clone(),
            prompt: self.prompt.clone(),
        }
    }

    fn push(&mut self, token: u32) {
        self.prompt.tokens += 1;
        if self.prompt.head.len() < self.head_len {
            self.prompt.head.push(token);
        }
        if self.keep_all {
            self.prompt.all.push(token);
        }
        let want_content = self.prompt.contents.len() < prefixes::BLOCKS;
        if want_content {
            self.content.update(&token.to_le_bytes());
        }
        if !self.stopped
            && let Some(digest) = self.chain.push(token)
        {
            let hash = digest.to_u64();
            self.prompt.chain.push(hash);
            if asks(self.prompt.chain.len()) && self.held.is_some_and(|h| !h(hash)) {
                self.stopped = true;
            }
        }
        if want_content && self.prompt.tokens.is_multiple_of(self.block_size) {
            self.prompt.contents.push(self.content.digest());
            self.content.reset();
        }
    }
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

/// Whether chats are tokenized a message at a time ([`streamed_chat`]):
/// with the built-in tokenizer and template.
pub fn streams_chats(settings: &Settings) -> bool {
    matches!(
        (&*settings.tokenizer, &*settings.template),
        (Tokenizer::Builtin, ChatTemplate::Builtin)
    )
}

/// Where a chat's prompt stood after some of its messages (before the
/// generation prompt), to resume it from ([`streamed_chat`]).
#[derive(Clone)]
pub struct Snapshot {
    chain: ChainState,
    content: Xxh3,
    prompt: Prompt,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("tokens", &self.prompt.tokens)
            .finish_non_exhaustive()
    }
}

impl Snapshot {
    /// Full blocks of the prompt so far.
    pub fn blocks(&self) -> usize {
        self.prompt.chain.len()
    }
}

/// A chat's prompt from its raw `messages` when [`streams_chats`]: each
/// message parsed, rendered and tokenized alone (the built-in template and
/// tokenizer give the same tokens fed a message at a time), starting after
/// the first `from.0` messages from snapshot `from.1` when given. Returns
/// the prompt and the snapshot after the last message; `Ok(None)` when a
/// message has content the router cannot tokenize. Given `held` (and no
/// snapshot to resume), the chain may stop early and the snapshot is not
/// one to resume from.
pub fn streamed_chat(
    raw: &[&[u8]],
    settings: &Settings,
    extras: BlockExtras<'_>,
    keep_all: bool,
    from: Option<(usize, Snapshot)>,
    held: Option<Held<'_>>,
) -> Result<Option<(Prompt, Snapshot)>, ApiError> {
    if raw.is_empty() {
        return Err(no_messages());
    }
    let (skip, mut builder) = match from {
        Some((skip, s)) => (skip, Builder::resume(settings, extras, s)),
        None => (0, Builder::new(settings, extras, keep_all, held)),
    };
    let (tokenizer, template) = (&settings.tokenizer, &settings.template);
    for (i, r) in raw.iter().enumerate().skip(skip) {
        let Some(message) = raw_message(i, r)? else {
            return Ok(None);
        };
        let one = &[ChatMessage::new(message.role, message.content)];
        for_each_chat_token(tokenizer, template, one, false, |t| builder.push(t));
    }
    let snapshot = builder.snapshot();
    for_each_chat_token(tokenizer, template, &[], true, |t| builder.push(t));
    Ok(Some((builder.prompt, snapshot)))
}

/// The prompt of `tokens`, which follow snapshot `from` when given, and
/// the snapshot after the first `snapshot_at` of them when asked.
pub fn tokens_prompt(
    tokens: &[u32],
    settings: &Settings,
    extras: BlockExtras<'_>,
    from: Option<Snapshot>,
    snapshot_at: Option<usize>,
) -> (Prompt, Option<Snapshot>) {
    let mut builder = match from {
        Some(s) => Builder::resume(settings, extras, s),
        None => Builder::new(settings, extras, false, None),
    };
    let (before, after) = tokens.split_at(snapshot_at.unwrap_or(0).min(tokens.len()));
    before.iter().for_each(|&t| builder.push(t));
    let snapshot = snapshot_at.map(|_| builder.snapshot());
    after.iter().for_each(|&t| builder.push(t));
    (builder.prompt, snapshot)
}

/// The prompt's token ids as the engine computes them (see [`prompt`]).
fn prompt_tokens(
    api: Api,
    obj: &mut Map<String, Value>,
    settings: &Settings,
) -> Result<Option<Vec<u32>>, ApiError> {
    let tokens = match api {
        Api::Chat => match chat_messages(obj)? {
            Some(messages) => chat_prompt_tokens(&settings.tokenizer, &settings.template, messages),
            None => return Ok(None),
        },
        Api::Completion => match obj.get("prompt") {
            Some(Value::String(p)) => completion_prompt_tokens(&settings.tokenizer, p),
            Some(Value::Array(items)) => return Ok(array_tokens(items, settings)),
            _ => {
                return Err(ApiError::BadRequest(
                    "'prompt' is required and must be a string or a list".into(),
                ));
            }
        },
        Api::Other => {
            return Ok(match obj.get("input").or_else(|| obj.get("prompt")) {
                Some(Value::String(p)) => completion_prompt_tokens(&settings.tokenizer, p).ok(),
                Some(Value::Array(items)) => array_tokens(items, settings),
                _ => None,
            });
        }
    };
    // A template or tokenizer failure is the router's limit, not the
    // client's error: route without a chain.
    Ok(tokens.ok())
}

/// A prompt given as a list: one string, or token ids. Batches of several
/// prompts have no single chain.
fn array_tokens(items: &[Value], settings: &Settings) -> Option<Vec<u32>> {
    match items {
        [Value::String(p)] => completion_prompt_tokens(&settings.tokenizer, p).ok(),
        _ if !items.is_empty() && items.iter().all(Value::is_u64) => items
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::tokenize::{ChatTemplate, Tokenizer};
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        let Value::Object(o) = v else { panic!() };
        o
    }

    #[test]
    fn chat_tokens_match_the_engine_sim() {
        let s = Settings::test();
        let mut body = obj(json!({"messages": [{"role": "user", "content": "Hello there"}]}));
        let tokens = prompt_tokens(Api::Chat, &mut body, &s).unwrap().unwrap();
        let expected = chat_prompt_tokens(
            &Tokenizer::builtin(),
            &ChatTemplate::builtin(),
            vec![ChatMessage::new("user", "Hello there")],
        )
        .unwrap();
        assert_eq!(tokens, expected);
    }

    #[test]
    fn a_streamed_prompt_equals_the_tokenized_one() {
        let s = Settings::test();
        let text = "You route requests to the replica that holds their prefix. ".repeat(20);
        let body = json!({"messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": "Hello  there, friend"},
        ]});
        let salt = "s4lt";
        let extras = BlockExtras {
            lora: None,
            cache_salt: Some(salt),
        };
        let streamed = prompt(Api::Chat, &mut obj(body.clone()), &s, extras, true, None)
            .unwrap()
            .unwrap();
        let tokens = prompt_tokens(Api::Chat, &mut obj(body), &s)
            .unwrap()
            .unwrap();
        assert_eq!(streamed.tokens, tokens.len() as u64);
        assert_eq!(streamed.all, tokens);
        let contents: Vec<u64> = tokens
            .chunks_exact(s.hasher.config().block_size)
            .take(crate::prefixes::BLOCKS)
            .map(|b| {
                xxhash_rust::xxh3::xxh3_64(
                    &b.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>(),
                )
            })
            .collect();
        assert_eq!(streamed.contents, contents);
        assert_eq!(
            streamed.head,
            tokens[..s.key.prefix_tokens.min(tokens.len())]
        );
        assert_eq!(streamed.chain, s.hasher.hashes(&tokens, extras));
        assert!(streamed.chain.len() > 10);
    }

    #[test]
    fn a_chain_ends_past_a_block_no_engine_holds() {
        let s = Settings::test();
        let text = "Prefill is where the time to first token goes. ".repeat(400);
        let body = json!({"messages": [{"role": "user", "content": text}]});
        let bytes = body.to_string();
        let raw = skim(bytes.as_bytes(), true).unwrap().messages.unwrap();
        let extras = BlockExtras::default();
        let of = |held: Option<Held<'_>>| {
            let parsed = prompt(Api::Chat, &mut obj(body.clone()), &s, extras, false, held)
                .unwrap()
                .unwrap();
            let streamed = streamed_chat(&raw, &s, extras, false, None, held)
                .unwrap()
                .unwrap()
                .0;
            assert_eq!(parsed, streamed);
            parsed
        };
        let whole = of(None);
        assert!(whole.chain.len() > 3 * HELD_EVERY, "{}", whole.chain.len());
        // Asked after 1, 2, 4, ... 64 blocks, then every 64: nothing held
        // ends the chain at 1, 3 held blocks at 4, 100 at 128, a held
        // prompt nowhere.
        for (held_blocks, kept) in [
            (0, 1),
            (3, 4),
            (100, 2 * HELD_EVERY),
            (whole.chain.len(), whole.chain.len()),
        ] {
            let holds = |h| whole.chain[..held_blocks].contains(&h);
            let ended = of(Some(&holds));
            assert_eq!(ended.chain, whole.chain[..kept], "{held_blocks} held");
            assert_eq!(
                (ended.tokens, &ended.head, &ended.contents),
                (whole.tokens, &whole.head, &whole.contents)
            );
        }
    }

    #[test]
    fn bad_bodies_are_400_and_unknown_content_routes_without_a_chain() {
        let s = Settings::test();
        assert!(matches!(
            parse(Api::Chat, b"{oops", false),
            Err(ApiError::BadRequest(_))
        ));
        assert!(matches!(
            parse(Api::Completion, b"[1]", false),
            Err(ApiError::BadRequest(_))
        ));
        assert!(parse(Api::Other, b"not json", false).unwrap().is_none());
        assert!(
            matches!(
                parse(Api::Other, b"{\"x\": NaN}", true),
                Err(ApiError::BadRequest(_))
            ),
            "salted: every body must be readable"
        );
        let mut no_messages = obj(json!({"model": "m"}));
        assert!(prompt_tokens(Api::Chat, &mut no_messages, &s).is_err());
        let mut image = obj(
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        );
        assert_eq!(prompt_tokens(Api::Chat, &mut image, &s).unwrap(), None);
        let mut ids = obj(json!({"prompt": [1, 2, 3]}));
        assert_eq!(
            prompt_tokens(Api::Completion, &mut ids, &s).unwrap(),
            Some(vec![1, 2, 3])
        );
        let mut batch = obj(json!({"prompt": ["a", "b"]}));
        assert_eq!(
            prompt_tokens(Api::Completion, &mut batch, &s).unwrap(),
            None
        );
        let mut embed = obj(json!({"input": "hello"}));
        assert!(prompt_tokens(Api::Other, &mut embed, &s).unwrap().is_some());
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
        assert!(features(&obj(json!({"model": 3}))).is_err());
    }
}
