//! Approximate mode's prompts: no tokenizer. Without WatchCache the chain
//! is matched only against this router's own memory, so it need not be
//! the engines' hashes, only the same for the same prompt prefix. The
//! prompt's text (each chat message's role and content, a completion's
//! prompt) is read as 4-byte pseudo-tokens, `blockSize` of them a block,
//! and each block hashed with XXH3 seeded by its parent's hash: one pass
//! at memory speed, where the model's tokenizer costs microseconds a
//! token. Four bytes is about a token of English, so prompt lengths and
//! cached prefixes keep their units for the policy's predictions.

use kvroute_core::hash::BlockExtras;
use serde_json::{Map, Value};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::Prompt;
use super::body::{self, Api};
use super::prefixes;
use crate::errors::ApiError;
use crate::settings::Settings;

/// Bytes per pseudo-token.
pub const TOKEN_BYTES: usize = 4;

/// Builds a [`Prompt`] from bytes; a clone taken between messages resumes
/// the prompt from there ([`chat_from`]).
#[derive(Clone, Debug)]
pub struct Chunker {
    block: usize,
    head_bytes: usize,
    parent: u64,
    buf: Vec<u8>,
    head: Vec<u8>,
    len: usize,
    prompt: Prompt,
}

impl Chunker {
    fn new(settings: &Settings, extras: BlockExtras<'_>) -> Self {
        let block = settings.hasher.config().block_size * TOKEN_BYTES;
        // The adapter and the salt seed the chain, as they key the
        // engines' blocks.
        let mut seed = Vec::new();
        if let Some(l) = extras.lora {
            seed.extend_from_slice(l.name.as_bytes());
            seed.push(0);
            seed.extend_from_slice(l.path.as_bytes());
        }
        seed.push(0);
        seed.extend_from_slice(extras.cache_salt.unwrap_or_default().as_bytes());
        Chunker {
            block,
            head_bytes: settings.key.prefix_tokens * TOKEN_BYTES,
            parent: xxh3_64(&seed),
            buf: Vec::with_capacity(block),
            head: Vec::new(),
            len: 0,
            prompt: Prompt::default(),
        }
    }

    fn push(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len();
        if self.head.len() < self.head_bytes {
            let take = (self.head_bytes - self.head.len()).min(bytes.len());
            self.head.extend_from_slice(&bytes[..take]);
        }
        if !self.buf.is_empty() {
            let take = (self.block - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.buf.len() < self.block {
                return;
            }
            let buf = std::mem::take(&mut self.buf);
            self.full_block(&buf);
            self.buf = buf;
            self.buf.clear();
        }
        let mut blocks = bytes.chunks_exact(self.block);
        for b in blocks.by_ref() {
            self.full_block(b);
        }
        self.buf.extend_from_slice(blocks.remainder());
    }

    fn full_block(&mut self, block: &[u8]) {
        self.parent = xxh3_64_with_seed(block, self.parent);
        self.prompt.chain.push(self.parent);
        if self.prompt.contents.len() < prefixes::BLOCKS {
            self.prompt.contents.push(xxh3_64(block));
        }
    }

    fn finish(mut self) -> Prompt {
        self.prompt.tokens = self.len.div_ceil(TOKEN_BYTES) as u64;
        // A last partial pseudo-token is padded with zeros.
        self.head
            .resize(self.head.len().next_multiple_of(TOKEN_BYTES), 0);
        self.prompt.head = self
            .head
            .chunks_exact(TOKEN_BYTES)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        self.prompt
    }

    /// Full blocks of the prompt so far.
    pub fn blocks(&self) -> usize {
        self.prompt.chain.len()
    }

    fn message(&mut self, role: &str, content: &str) {
        self.push(role.as_bytes());
        self.push(b"\n");
        self.push(content.as_bytes());
        self.push(b"\0");
    }
}

/// A chat's approximate prompt from its raw `messages` (see
/// [`body::scan`]), starting after the first `from.0` of them from chunker
/// `from.1` when given; also returns the chunker after the last message,
/// to resume the next turn from. `Ok(None)` when a message has content the
/// router cannot read.
pub fn chat_from(
    raw: &[&[u8]],
    settings: &Settings,
    extras: BlockExtras<'_>,
    from: Option<(usize, Chunker)>,
) -> Result<Option<(Prompt, Chunker)>, ApiError> {
    if raw.is_empty() {
        return Err(body::no_messages());
    }
    let (skip, mut c) = from.unwrap_or_else(|| (0, Chunker::new(settings, extras)));
    for (i, r) in raw.iter().enumerate().skip(skip) {
        let Some(message) = body::raw_message(i, r)? else {
            return Ok(None);
        };
        c.message(&message.role, &message.content);
    }
    let snapshot = c.clone();
    Ok(Some((c.finish(), snapshot)))
}

/// The approximate prompt of a parsed body (as [`super::tokens::prompt`]).
pub fn prompt(
    api: Api,
    obj: &mut Map<String, Value>,
    settings: &Settings,
    extras: BlockExtras<'_>,
) -> Result<Option<Prompt>, ApiError> {
    let mut c = Chunker::new(settings, extras);
    let prompt = match api {
        Api::Chat => {
            let Some(messages) = body::chat_messages(obj)? else {
                return Ok(None);
            };
            messages.iter().for_each(|m| c.message(&m.role, &m.content));
            return Ok(Some(c.finish()));
        }
        Api::Completion => match obj.get("prompt") {
            Some(p @ (Value::String(_) | Value::Array(_))) => p,
            _ => {
                return Err(ApiError::BadRequest(
                    "'prompt' is required and must be a string or a list".into(),
                ));
            }
        },
        Api::Other => match obj.get("input").or_else(|| obj.get("prompt")) {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    match prompt {
        Value::String(p) => c.push(p.as_bytes()),
        Value::Array(items) => match items.as_slice() {
            [Value::String(p)] => c.push(p.as_bytes()),
            _ if !items.is_empty() && items.iter().all(Value::is_u64) => {
                for t in items.iter().filter_map(Value::as_u64) {
                    c.push(&t.to_le_bytes()[..TOKEN_BYTES]);
                }
            }
            _ => return Ok(None),
        },
        _ => return Ok(None),
    }
    Ok(Some(c.finish()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn prompt_of(api: Api, body: Value) -> Option<Prompt> {
        let Value::Object(mut obj) = body else {
            panic!()
        };
        prompt(api, &mut obj, &Settings::test(), BlockExtras::default()).unwrap()
    }

    #[test]
    fn a_prompt_is_its_bytes_in_blocks_of_pseudo_tokens() {
        let text = "x".repeat(200);
        let p = prompt_of(Api::Completion, json!({"prompt": text})).unwrap();
        // 200 bytes: 50 pseudo-tokens, 3 full blocks of 16 (64 bytes).
        assert_eq!(p.tokens, 50);
        assert_eq!(p.chain.len(), 3);
        assert_eq!(p.head.len(), 50);
        assert_eq!(p.head[0], u32::from_le_bytes(*b"xxxx"));
        // Each block is chained to its parent: equal blocks, other hashes.
        assert_ne!(p.chain[0], p.chain[1]);
        assert_eq!(p.contents[0], p.contents[1]);
        // A one-string list is the same prompt; fed in pieces, the same chain.
        let listed = prompt_of(Api::Completion, json!({"prompt": [text]})).unwrap();
        assert_eq!(listed, p);
        let mut c = Chunker::new(&Settings::test(), BlockExtras::default());
        for piece in text.as_bytes().chunks(7) {
            c.push(piece);
        }
        assert_eq!(c.finish(), p);
        // A last partial pseudo-token is padded with zeros.
        let p = prompt_of(Api::Completion, json!({"prompt": "abcdefg"})).unwrap();
        assert_eq!(p.tokens, 2);
        assert_eq!(
            p.head,
            [u32::from_le_bytes(*b"abcd"), u32::from_le_bytes(*b"efg\0")]
        );
    }

    #[test]
    fn token_ids_other_apis_and_unreadable_bodies() {
        let ids = prompt_of(Api::Completion, json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(ids.tokens, 3);
        assert_eq!(ids.head, [1, 2, 3]);
        let input = prompt_of(Api::Other, json!({"input": "hello"})).unwrap();
        assert_eq!(input.tokens, 2);
        assert!(prompt_of(Api::Other, json!({"nothing": 1})).is_none());
        assert!(prompt_of(Api::Completion, json!({"prompt": [1, "a"]})).is_none());
        let Value::Object(mut obj) = json!({"prompt": 5}) else {
            panic!()
        };
        let e = prompt(
            Api::Completion,
            &mut obj,
            &Settings::test(),
            BlockExtras::default(),
        );
        assert_eq!(e.unwrap_err().status().as_u16(), 400);
    }
}
