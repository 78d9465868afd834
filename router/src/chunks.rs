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
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::errors::ApiError;
use crate::features::{self, Api, Prompt};
use crate::prefixes;
use crate::settings::Settings;

/// Bytes per pseudo-token.
pub const TOKEN_BYTES: usize = 4;

/// Builds a [`Prompt`] from bytes.
struct Chunker {
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
        self.prompt.head = self
            .head
            .chunks(TOKEN_BYTES)
            .map(|c| {
                let mut t = [0; TOKEN_BYTES];
                t[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(t)
            })
            .collect();
        self.prompt
    }

    fn message(&mut self, m: &kvroute_core::tokenize::ChatMessage) {
        self.push(m.role.as_bytes());
        self.push(b"\n");
        self.push(m.content.as_bytes());
        self.push(b"\0");
    }
}

/// A chat's approximate prompt from its raw `messages` (see [`features::scan`]);
/// `Ok(None)` when a message has content the router cannot read.
pub fn chat(
    raw: &[&RawValue],
    settings: &Settings,
    extras: BlockExtras<'_>,
) -> Result<Option<Prompt>, ApiError> {
    if raw.is_empty() {
        return Err(ApiError::BadRequest("'messages' must not be empty".into()));
    }
    let mut c = Chunker::new(settings, extras);
    for (i, r) in raw.iter().enumerate() {
        let mut m: Value = serde_json::from_str(r.get())
            .map_err(|e| ApiError::BadRequest(format!("messages[{i}]: {e}")))?;
        let Some(message) = features::chat_message(i, &mut m)? else {
            return Ok(None);
        };
        c.message(&message);
    }
    Ok(Some(c.finish()))
}

/// The approximate prompt of a parsed body (as [`features::prompt`]).
pub fn prompt(
    api: Api,
    obj: &mut Map<String, Value>,
    settings: &Settings,
    extras: BlockExtras<'_>,
) -> Result<Option<Prompt>, ApiError> {
    let mut c = Chunker::new(settings, extras);
    let prompt = match api {
        Api::Chat => {
            let Some(messages) = features::chat_messages(obj)? else {
                return Ok(None);
            };
            messages.iter().for_each(|m| c.message(m));
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
