//! Incremental prompts for conversations. A follow-up turn sends the
//! conversation so far again, byte for byte, and appends to it: the
//! router keeps, per conversation key, where the previous request's prompt
//! stood after its last message (the block chain's state, see
//! [`Snapshot`]) together with a hash of the exact body bytes up to that
//! message's end. When a request of the same conversation starts with
//! those bytes, only the messages after them are parsed, tokenized and
//! hashed. Anything else (an edited history, other settings, salt or
//! adapter) misses and is computed whole.
//!
//! Bounded by conversations and by the blocks their chains hold; the least
//! recently used go first, and evictions are counted.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

use kvroute_core::lru::Lru;
use kvroute_core::tokenize::ChatMessage;
use prometheus_client::metrics::counter::Counter;
use xxhash_rust::xxh3::Xxh3;

use super::{At, Prompt, Reader, Resume, Scope, tokens};
use crate::errors::ApiError;

/// Conversations remembered at most.
pub const MAX_CONVERSATIONS: usize = 16_384;

/// Chain blocks the remembered conversations hold at most, in total (8
/// bytes each: 16 MiB).
pub const MAX_BLOCKS: usize = 1 << 21;

/// The conversations' prompt snapshots.
#[derive(Debug)]
pub struct Conversations {
    inner: Mutex<Inner>,
    evictions: Counter,
}

#[derive(Debug, Default)]
struct Inner {
    lru: Lru,
    entries: HashMap<u64, Entry>,
    blocks: usize,
}

#[derive(Clone, Debug)]
struct Entry {
    /// The body's bytes up to the end of the last message (of the rendered
    /// prompt's, up to the snapshot, for [`Resume::Rendered`]).
    prefix_len: usize,
    prefix_hash: u128,
    /// Messages the snapshot covers (none counted for a rendered prompt).
    messages: usize,
    snapshot: Resume,
}

/// Whether a chat's prompt was resumed from a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memo {
    /// Resumed: only the new messages were tokenized.
    Hit,
    /// Computed whole (and remembered).
    Miss,
}

/// A chat's prompt, and whether it was resumed.
#[derive(Debug)]
pub struct Chat {
    /// The prompt; `None` when its messages cannot be tokenized.
    pub prompt: Option<Prompt>,
    /// Whether it resumed a snapshot; `None` without a conversation.
    pub memo: Option<Memo>,
}

/// A conversation: its tenant and key.
#[derive(Debug)]
pub struct Conversation<'a> {
    /// The tenant.
    pub tenant: Option<&'a str>,
    /// `prompt_cache_key` or the conversation header.
    pub key: &'a str,
}

impl Conversation<'_> {
    /// Its snapshot's identity: the conversation, and everything a chain
    /// depends on besides the tokens (the mode, the hashing, the key's head
    /// length, the adapter and the salt).
    fn id(&self, at: &At<'_>, reader: Reader) -> u64 {
        let (settings, extras) = (at.settings, at.extras);
        let mut h = Xxh3::new();
        h.update(&[u8::from(reader.exact())]);
        let field = |h: &mut Xxh3, s: &str| {
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        };
        field(&mut h, self.tenant.unwrap_or("\0"));
        field(&mut h, self.key);
        settings.hasher.config().hash(&mut h);
        settings.key.prefix_tokens.hash(&mut h);
        if let Some(l) = extras.lora {
            field(&mut h, &l.name);
            field(&mut h, &l.path);
        }
        field(&mut h, extras.cache_salt.unwrap_or("\0"));
        h.digest()
    }
}

impl Conversations {
    /// The prompt of a chat from its raw `messages` within `body`, read by
    /// `reader` (one that [reads messages](Reader::messages)) at `at`.
    /// Resumed from the conversation's snapshot when `body` starts as the
    /// one it was taken from, and remembered for the next turn. Without a
    /// conversation (or with [`Scope::KeepTokens`]): read whole, not
    /// remembered. `None` when `scope` is [`Scope::ResumedWithin`] and the
    /// prompt does not resume that way.
    pub(crate) fn chat(
        &self,
        reader: Reader,
        (body, raw): (&[u8], &[&[u8]]),
        conversation: Option<Conversation<'_>>,
        at: &At<'_>,
        scope: Scope,
    ) -> Result<Option<Chat>, ApiError> {
        let within = match scope {
            Scope::ResumedWithin(n) => Some(n),
            _ => None,
        };
        let keep_all = scope == Scope::KeepTokens;
        let (Some(c), Some(ends), false) = (conversation, message_ends(body, raw), keep_all) else {
            if within.is_some() {
                return Ok(None);
            }
            let prompt = reader.messages(raw, at, None)?.map(|(p, _)| p);
            return Ok(Some(Chat { prompt, memo: None }));
        };
        let id = c.id(at, reader);
        // One pass over the body's messages: the hash up to the
        // remembered end checks the entry, the hash up to the last
        // message's end is remembered.
        let mut hasher = Xxh3::new();
        let entry = self.get(id).filter(|e| {
            e.messages <= raw.len()
                && e.snapshot.read_by(reader)
                && ends.get(e.messages.wrapping_sub(1)) == Some(&e.prefix_len)
                && {
                    hasher.update(&body[..e.prefix_len]);
                    hasher.digest128() == e.prefix_hash
                }
        });
        let (memo, hashed, from) = match entry {
            Some(e) if within.is_some_and(|n| body.len().saturating_sub(e.prefix_len) > n) => {
                return Ok(None);
            }
            Some(e) => (Memo::Hit, e.prefix_len, Some((e.messages, e.snapshot))),
            None if within.is_some() => return Ok(None),
            None => {
                hasher.reset();
                (Memo::Miss, 0, None)
            }
        };
        let memo = Some(memo);
        // A remembered prompt is hashed whole, to be resumed from.
        let whole = At { held: None, ..*at };
        let Some((prompt, snapshot)) = reader.messages(raw, &whole, from)? else {
            return Ok(Some(Chat { prompt: None, memo }));
        };
        if let Some(&end) = ends.last() {
            self.put(
                id,
                Entry {
                    prefix_len: end,
                    prefix_hash: {
                        hasher.update(&body[hashed..end]);
                        hasher.digest128()
                    },
                    messages: raw.len(),
                    snapshot,
                },
            );
        }
        Ok(Some(Chat {
            prompt: Some(prompt),
            memo,
        }))
    }

    /// The prompt of a chat read by [`Reader::Rendered`] (exact mode with
    /// the model's tokenizer or template): rendered whole; when the
    /// rendering starts with the text the conversation's snapshot was taken
    /// after, only the rest is tokenized and hashed. The snapshot kept for
    /// the next turn is taken before the prompt's last special token
    /// ([`Tokenizer::encode_cut`](kvroute_core::tokenize::Tokenizer::encode_cut)):
    /// usually the generation prompt's, which the next turn renders as the
    /// start of the assistant's answer. `prompt: None` when the template or
    /// the tokenizer fails: the request is routed without a chain.
    pub(crate) fn rendered(
        &self,
        messages: Vec<ChatMessage>,
        conversation: Conversation<'_>,
        at: &At<'_>,
    ) -> Chat {
        let (settings, extras) = (at.settings, at.extras);
        let id = conversation.id(at, Reader::Rendered);
        let Ok(text) = settings.template.render(&messages, true) else {
            return Chat {
                prompt: None,
                memo: None,
            };
        };
        drop(messages);
        let mut hasher = Xxh3::new();
        let resumed = self.get(id).and_then(|e| match e.snapshot {
            Resume::Rendered(s) => text.get(..e.prefix_len).and_then(|done| {
                hasher.update(done.as_bytes());
                (hasher.digest128() == e.prefix_hash).then_some((e.prefix_len, *s))
            }),
            _ => None,
        });
        let (memo, done, from) = match resumed {
            Some((done, s)) => (Memo::Hit, done, Some(s)),
            None => {
                hasher.reset();
                (Memo::Miss, 0, None)
            }
        };
        let memo = Some(memo);
        let Ok((tokens, cut)) = settings.tokenizer.encode_cut(&text[done..]) else {
            return Chat { prompt: None, memo };
        };
        let snapshot_at = cut.map(|c| c.tokens);
        let (prompt, snapshot) =
            tokens::tokens_prompt(&tokens, settings, extras, from, snapshot_at);
        if let (Some(cut), Some(snapshot)) = (cut, snapshot) {
            let end = done + cut.at;
            hasher.update(&text.as_bytes()[done..end]);
            self.put(
                id,
                Entry {
                    prefix_len: end,
                    prefix_hash: hasher.digest128(),
                    messages: 0,
                    snapshot: Resume::Rendered(Box::new(snapshot)),
                },
            );
        }
        Chat {
            prompt: Some(prompt),
            memo,
        }
    }

    /// A cache counting its evictions in `evictions`.
    pub fn new(evictions: Counter) -> Self {
        Conversations {
            inner: Mutex::default(),
            evictions,
        }
    }

    fn get(&self, id: u64) -> Option<Entry> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let entry = inner.entries.get(&id).cloned()?;
        inner.lru.touch(id);
        Some(entry)
    }

    /// Remembers `entry`, evicting the least recently used beyond the
    /// bounds.
    fn put(&self, id: u64, entry: Entry) {
        let blocks = entry.snapshot.blocks();
        if blocks > MAX_BLOCKS {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *inner;
        if let Some(old) = inner.entries.insert(id, entry) {
            inner.blocks -= old.snapshot.blocks();
        }
        inner.blocks += blocks;
        inner.lru.touch(id);
        while inner.entries.len() > MAX_CONVERSATIONS || inner.blocks > MAX_BLOCKS {
            let Some(oldest) = inner.lru.pop_lru() else {
                break;
            };
            if let Some(old) = inner.entries.remove(&oldest) {
                inner.blocks -= old.snapshot.blocks();
                self.evictions.inc();
            }
        }
    }
}

/// Where each raw message ends within `body`, or `None` if one is not in
/// it.
fn message_ends(body: &[u8], raw: &[&[u8]]) -> Option<Vec<usize>> {
    raw.iter()
        .map(|r| {
            let start = (r.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
            Some(start + r.len()).filter(|&end| end <= body.len())
        })
        .collect()
}
