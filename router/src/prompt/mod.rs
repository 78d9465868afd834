//! Reading a request for routing: its body's fields, its tenant's salt and
//! adapter, and its prompt as a block chain and routing key. One entry,
//! [`Prompts::read`], and one [`Reader`] chosen per request by the pool's
//! mode:
//!
//! 1. A policy that reads no prompt ([`Reader::Unread`]) scans only the
//!    body's top-level fields; so does a body over
//!    `limits.maxTokenizeBytes` ([`Reader::TooLarge`]), routed without a
//!    chain.
//! 2. Approximate mode ([`Reader::Chunks`]) reads text in byte chunks
//!    ([`chunks`]); exact mode tokenizes as the engines do ([`tokens`]): a
//!    chat a message at a time with the built-in tokenizer and template
//!    ([`Reader::Tokens`]), else rendered whole by the model's
//!    ([`Reader::Rendered`]).
//! 3. A chat's messages are read from their raw JSON ([`body::scan`])
//!    unless tenancy is salted, when every body is parsed whole (one the
//!    router cannot read could carry a salt the engine would read).
//! 4. A chat that names a conversation is resumed from where its previous
//!    turn left the prompt ([`Conversations`], which wraps the readers and
//!    never parses a body itself).
//! 5. Small bodies and short follow-up turns are read on the async worker
//!    that received them; the rest on the bounded tokenizer pool
//!    ([`workers`]), so a large prompt never stalls the workers that carry
//!    streams.
//!
//! Not here: what the request is then routed to ([`crate::request`]).

pub mod body;
pub mod chunks;
pub mod conversations;
pub(crate) mod json_skim;
pub mod prefixes;
#[cfg(test)]
mod tests;
pub mod tokens;
mod workers;

use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::hash::BlockExtras;
use kvroute_core::keys::{KeyInput, RoutingKey};
use kvroute_core::policy::Request as RouteRequest;
use kvroute_core::spec::DisaggregationMode;

use self::body::{Api, Scanned};
use self::chunks::Chunker;
use self::conversations::{Conversation, Conversations, Memo};
use self::tokens::Snapshot;
use crate::errors::ApiError;
use crate::models::ModelList;
use crate::settings::Settings;
use crate::tenancy::Tenancy;

pub(crate) use self::workers::Workers;

/// Bodies up to this size are read on the async worker that received them
/// (microseconds); larger ones on the bounded tokenizer pool.
const INLINE_BODY_BYTES: usize = 16 << 10;

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

/// Whether any engine holds a block (exact mode's index). Given it, a
/// [`Prompt`]'s chain stops at the first block [asked about](tokens) that
/// none holds: no held prefix reaches past it, and a policy that
/// [reads only held prefixes](kvroute_core::policy::PolicyConfig::reads_held_prefix_only)
/// looks no further, so hashing the rest of a prompt nobody has seen would
/// be wasted. Tokens are still counted, and the first blocks' contents
/// hashed for the volatile-prefix sketch.
pub type Held<'a> = &'a dyn Fn(u64) -> bool;

/// What a request asks [`Held`] of: the pool's index of what engines hold.
pub trait Holds: Send + Sync {
    /// Whether any engine holds `block`, or held it until recently (so a
    /// missed block can be told evicted from never seen:
    /// [`crate::request::missed`]).
    fn holds_any(&self, block: u64) -> bool;
}

/// How a request's prompt is read, chosen once per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// The policy reads no prompt: only the body's top-level fields.
    Unread,
    /// The body is over `limits.maxTokenizeBytes`: not read (routed as
    /// unreadable, to the least loaded endpoint).
    TooLarge,
    /// Approximate mode: text in byte chunks ([`chunks`]).
    Chunks,
    /// Exact mode with the built-in tokenizer and template: a chat a
    /// message at a time ([`tokens::streamed_chat`]).
    Tokens,
    /// Exact mode with a model's tokenizer or template: a chat rendered
    /// whole.
    Rendered,
}

impl Reader {
    /// The reader for a body of `len` bytes under `settings`, in exact mode
    /// when `exact`, with bodies over `max_tokenize` bytes left unread.
    pub fn of(settings: &Settings, exact: bool, len: usize, max_tokenize: usize) -> Self {
        if !settings.policy.reads_request() {
            Reader::Unread
        } else if len > max_tokenize {
            Reader::TooLarge
        } else if !exact {
            Reader::Chunks
        } else if tokens::streams_chats(settings) {
            Reader::Tokens
        } else {
            Reader::Rendered
        }
    }

    /// Whether it tokenizes as the engines do.
    pub fn exact(self) -> bool {
        matches!(self, Reader::Tokens | Reader::Rendered)
    }

    /// Whether it reads a chat from its raw messages, a message at a time.
    fn reads_messages(self) -> bool {
        matches!(self, Reader::Chunks | Reader::Tokens)
    }

    /// Whether reading a body to `api` parses it into a tree (what that
    /// may cost counts in the body budget while it is read,
    /// [`TREE_EXPANSION`]): a completion's prompt and a rendered chat. A
    /// body it does not read is never parsed whole.
    pub fn builds_tree(self, api: Api) -> bool {
        match self {
            Reader::Unread | Reader::TooLarge => false,
            Reader::Chunks | Reader::Tokens => api != Api::Chat,
            Reader::Rendered => true,
        }
    }

    /// A chat's prompt from its raw messages (when
    /// [`reads_messages`](Self::reads_messages)), going on after the first
    /// `from.0` of them from where `from.1` left it; with where it stands
    /// after the last one. `Ok(None)` when a message has content the router
    /// cannot read.
    pub(crate) fn messages(
        self,
        raw: &[&[u8]],
        at: &At<'_>,
        from: Option<(usize, Resume)>,
    ) -> Result<Option<(Prompt, Resume)>, ApiError> {
        let (settings, extras) = (at.settings, at.extras);
        match (self, from) {
            (Reader::Chunks, Some((n, Resume::Chunks(c)))) => {
                chunks::chat_from(raw, settings, extras, Some((n, c)))
                    .map(|r| r.map(|(p, c)| (p, Resume::Chunks(c))))
            }
            (Reader::Chunks, _) => chunks::chat_from(raw, settings, extras, None)
                .map(|r| r.map(|(p, c)| (p, Resume::Chunks(c)))),
            (_, Some((n, Resume::Tokens(s)))) => {
                tokens::streamed_chat(raw, settings, extras, false, Some((n, *s)), None)
                    .map(|r| r.map(|(p, s)| (p, Resume::Tokens(Box::new(s)))))
            }
            (_, _) => tokens::streamed_chat(raw, settings, extras, at.keep_all, None, at.held)
                .map(|r| r.map(|(p, s)| (p, Resume::Tokens(Box::new(s))))),
        }
    }

    /// The prompt of a parsed body; `Ok(None)` for content the router
    /// cannot read.
    fn parsed(
        self,
        api: Api,
        obj: &mut serde_json::Map<String, serde_json::Value>,
        at: &At<'_>,
    ) -> Result<Option<Prompt>, ApiError> {
        match self {
            Reader::Unread | Reader::TooLarge => Ok(None),
            Reader::Chunks => chunks::prompt(api, obj, at.settings, at.extras),
            Reader::Tokens | Reader::Rendered => {
                tokens::prompt(api, obj, at.settings, at.extras, at.keep_all, at.held)
            }
        }
    }
}

/// What a JSON tree may cost, as a multiple of its text: a value per two
/// bytes at worst (`[0,0,…]`), 32 bytes each. A body read into a tree
/// holds this much more of the body budget while it is read.
pub const TREE_EXPANSION: usize = 16;

/// What a prompt is hashed with and how much of it is kept: the same for
/// every reader.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    pub(crate) settings: &'a Settings,
    pub(crate) extras: BlockExtras<'a>,
    /// Keep every token ([`Scope::KeepTokens`]).
    pub(crate) keep_all: bool,
    pub(crate) held: Option<Held<'a>>,
}

/// Where a prompt stood after some of a conversation's messages, by the
/// reader that read it.
#[derive(Clone, Debug)]
pub(crate) enum Resume {
    /// [`Reader::Tokens`]: tokens and the engines' hashes.
    Tokens(Box<Snapshot>),
    /// [`Reader::Rendered`]: the same, after a prefix of the rendered
    /// prompt rather than of the body.
    Rendered(Box<Snapshot>),
    /// [`Reader::Chunks`]: byte chunks.
    Chunks(Chunker),
}

impl Resume {
    /// Full blocks of the prompt so far.
    pub(crate) fn blocks(&self) -> usize {
        match self {
            Resume::Tokens(s) | Resume::Rendered(s) => s.blocks(),
            Resume::Chunks(c) => c.blocks(),
        }
    }

    /// Whether `reader` goes on from it.
    pub(crate) fn read_by(&self, reader: Reader) -> bool {
        matches!(
            (self, reader),
            (Resume::Tokens(_), Reader::Tokens)
                | (Resume::Rendered(_), Reader::Rendered)
                | (Resume::Chunks(_), Reader::Chunks)
        )
    }
}

/// How much of a prompt [`Prompts::read`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// All of it, resumed when it can be: a request to route.
    Whole,
    /// All of it, every token kept: computed whole, not remembered (an
    /// explain).
    KeepTokens,
    /// Only a chat resuming a known conversation with at most this many
    /// body bytes after its snapshot; anything else is left unread.
    ResumedWithin(usize),
}

/// What [`Prompts::read`] takes from a request besides its body.
#[derive(Clone)]
pub(crate) struct Input {
    pub(crate) api: Api,
    /// The tenant the credentials name.
    pub(crate) tenant: Option<String>,
    /// The conversation header's value.
    pub(crate) conversation: Option<String>,
    pub(crate) reader: Reader,
    pub(crate) scope: Scope,
    /// Ends a chain early ([`Held`]): in exact mode, for a policy that
    /// reads only held prefixes, unless every token is kept.
    pub(crate) held: Option<Arc<dyn Holds>>,
}

/// What routing takes from a request, computed by [`Prompts::read`].
#[derive(Debug)]
pub(crate) struct Analysis {
    /// The body to forward (rewritten when tenancy sets `cache_salt`).
    pub(crate) bytes: Bytes,
    pub(crate) model: Option<String>,
    pub(crate) chain: Vec<u64>,
    pub(crate) key: RoutingKey,
    /// Blocks the key's tokens span when it was made from the prompt's
    /// first tokens ([`RouteRequest::key_prefix_blocks`]).
    pub(crate) key_prefix_blocks: Option<u32>,
    pub(crate) prompt_tokens: u64,
    /// Whether the policy can rank it: the router read its prompt, or the
    /// policy reads none (else the least loaded endpoint serves it).
    pub(crate) readable: bool,
    /// Whether the router read and tokenized its prompt.
    pub(crate) tokenized: bool,
    pub(crate) block_tokens: u64,
    /// The LoRA adapter the prompt was hashed with.
    pub(crate) lora: Option<String>,
    /// Every prompt token, with [`Scope::KeepTokens`].
    pub(crate) tokens: Vec<u32>,
    /// Content hashes of the leading blocks ([`Prompt::contents`]).
    pub(crate) contents: Vec<u64>,
    /// Whether a conversation's prompt was resumed.
    pub(crate) memo: Option<Memo>,
    /// Whether the client asked for a streamed response.
    pub(crate) stream: bool,
    /// The output tokens the client asked for at most.
    pub(crate) max_tokens: Option<u64>,
    /// The choices it asked for (`n`; 1 when unset).
    pub(crate) choices: u64,
}

impl Analysis {
    /// A request without a body: nothing to rank it by.
    pub(crate) fn bodiless() -> Self {
        Analysis {
            bytes: Bytes::new(),
            model: None,
            chain: Vec::new(),
            key: RoutingKey(0),
            key_prefix_blocks: None,
            prompt_tokens: 0,
            readable: false,
            tokenized: false,
            block_tokens: 1,
            lora: None,
            tokens: Vec::new(),
            contents: Vec::new(),
            memo: None,
            stream: false,
            max_tokens: None,
            choices: 1,
        }
    }

    /// What the policy ranks.
    pub(crate) fn request(&self) -> RouteRequest<'_> {
        RouteRequest {
            key: self.key,
            chain: &self.chain,
            prompt_tokens: self.prompt_tokens,
            key_prefix_blocks: self.key_prefix_blocks,
            output_tokens: self.max_tokens.unwrap_or(0),
        }
    }

    /// Prompt tokens the engine is expected to find cached with `cached_blocks`
    /// leading blocks: as vLLM counts a hit, full blocks, and the last
    /// prompt token is always computed.
    pub(crate) fn expected_cached(&self, cached_blocks: u32) -> u64 {
        let cap = self.prompt_tokens.saturating_sub(1) / self.block_tokens * self.block_tokens;
        (u64::from(cached_blocks) * self.block_tokens).min(cap)
    }
}

/// The prompt reader every request shares: tenancy (which may rewrite the
/// body), the conversations' snapshots and the tokenizer pool.
#[derive(Debug)]
pub(crate) struct Prompts {
    tenancy: Tenancy,
    conversations: Arc<Conversations>,
    workers: Workers,
    retry_after: u64,
}

impl Prompts {
    /// A reader applying `tenancy`, remembering conversations in
    /// `conversations`, with at most `queue` bodies waiting for the
    /// tokenizer pool (503 with `retry_after` beyond).
    pub(crate) fn new(
        tenancy: Tenancy,
        conversations: Conversations,
        queue: usize,
        retry_after: u64,
    ) -> Self {
        Prompts {
            tenancy,
            conversations: Arc::new(conversations),
            workers: Workers::new(queue),
            retry_after,
        }
    }

    /// The tenancy requests are read with.
    pub(crate) fn tenancy(&self) -> &Tenancy {
        &self.tenancy
    }

    /// Runs `job` on the tokenizer pool.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        retry_after: u64,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.workers.run(retry_after, job).await
    }

    /// Reads a request's body `bytes` (see the module doc) with the
    /// endpoints' `models`: on this worker when it is small or a short
    /// follow-up turn, else on the tokenizer pool.
    pub(crate) async fn read(
        &self,
        bytes: Bytes,
        input: Input,
        settings: Arc<Settings>,
        models: Arc<ModelList>,
    ) -> Result<Analysis, ApiError> {
        let small = bytes.len() <= INLINE_BODY_BYTES;
        // Scanning a body's top-level fields is one fast pass: inline.
        let scan_only = input.reader == Reader::Unread && !self.tenancy.salted();
        if small || scan_only || input.scope == Scope::KeepTokens {
            // (`KeepTokens`: an explain, on a thread of its own.)
            let conversations = &self.conversations;
            return read_whole(
                bytes,
                input,
                &self.tenancy,
                &settings,
                &models,
                conversations,
            );
        }
        // So is a follow-up turn with little new in it (exact mode): a
        // scan, and a hash of the body up to the conversation's snapshot.
        // Only a request that names a conversation can be one.
        let conversation_named = || {
            input.conversation.is_some()
                || memchr::memmem::find(&bytes, b"\"prompt_cache_key\"").is_some()
        };
        if input.reader.exact() && conversation_named() {
            let resumed = Input {
                scope: Scope::ResumedWithin(INLINE_BODY_BYTES),
                ..input.clone()
            };
            if let Some(analysis) = read(
                bytes.clone(),
                resumed,
                &self.tenancy,
                &settings,
                &models,
                &self.conversations,
            )? {
                return Ok(analysis);
            }
        }
        let tenancy = self.tenancy.clone();
        let conversations = self.conversations.clone();
        self.workers
            .run(self.retry_after, move || {
                read_whole(bytes, input, &tenancy, &settings, &models, &conversations)
            })
            .await?
    }
}

/// [`read`] of a scope that reads every prompt ([`Scope::Whole`] or
/// [`Scope::KeepTokens`]).
fn read_whole(
    bytes: Bytes,
    input: Input,
    tenancy: &Tenancy,
    settings: &Settings,
    models: &ModelList,
    conversations: &Conversations,
) -> Result<Analysis, ApiError> {
    let read = read(bytes, input, tenancy, settings, models, conversations)?;
    Ok(read.expect("only ResumedWithin leaves a prompt unread"))
}

/// Reads a request: parses its body as its reader needs, applies tenancy,
/// and computes the prompt's tokens, block chain and routing key. `None`
/// only with [`Scope::ResumedWithin`], for a prompt that does not resume
/// within it. Synchronous: large bodies run it on the tokenizer pool.
fn read(
    bytes: Bytes,
    input: Input,
    tenancy: &Tenancy,
    settings: &Settings,
    models: &ModelList,
    conversations: &Conversations,
) -> Result<Option<Analysis>, ApiError> {
    let Input {
        api,
        tenant,
        conversation: conversation_header,
        reader,
        scope,
        held,
    } = input;
    let salted = tenancy.salted();
    // With disaggregation on, engines run a KV connector: a body the
    // router cannot read could carry `kv_transfer_params` they read.
    let disaggregated = settings.disaggregation.mode != DisaggregationMode::Disabled;
    let strict = salted || disaggregated;
    // A chat's messages are read from their raw JSON; the body is parsed
    // whole only where the reader needs it (bounded by maxTokenizeBytes).
    let by_message = api == Api::Chat && reader.reads_messages();
    let tree = reader.builds_tree(api);
    let mut raw_messages = None;
    let mut obj = if by_message {
        body::scan(api, &bytes, true)?.map(|s: Scanned<'_>| {
            raw_messages = s.messages;
            s.fields
        })
    } else if tree {
        body::parse(api, &bytes, strict)?
    } else {
        body::scan(api, &bytes, false)?.map(|s| s.fields)
    };
    if strict && obj.is_none() {
        // A body the router cannot read could carry a salt, or KV transfer
        // parameters, the engine reads.
        return Err(ApiError::BadRequest(
            "the request body must be a JSON object the router can read".into(),
        ));
    }
    let feats = obj
        .as_ref()
        .map(body::features)
        .transpose()?
        .unwrap_or_default();
    let mut forwarded = None;
    if let Some(o) = obj.as_mut()
        && tenancy.apply(tenant.as_deref(), o)?
    {
        let body = if tree {
            serde_json::to_vec(o).expect("a JSON map serializes")
        } else {
            // Only the top-level fields were read: the body is copied
            // with the salt in place of the client's.
            let salt = o.get("cache_salt").unwrap_or(&serde_json::Value::Null);
            let salt = serde_json::to_vec(salt).expect("a JSON value serializes");
            json_skim::replaced(&bytes, "cache_salt", &salt)
                .map_err(|_| ApiError::BadRequest("invalid JSON body".into()))?
        };
        forwarded = Some(Bytes::from(body));
    }
    let salt = obj
        .as_ref()
        .and_then(|o| o.get("cache_salt"))
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    // A request naming a LoRA adapter is hashed with it, as the engine
    // hashes its blocks.
    let lora = feats.model.as_deref().and_then(|m| {
        settings
            .lora_adapters
            .get(m)
            .or_else(|| models.adapters.get(m).map(|a| &a.lora))
    });
    let holds = |block| held.as_ref().is_some_and(|h| h.holds_any(block));
    let at = At {
        settings,
        extras: BlockExtras {
            lora,
            cache_salt: salt.as_deref(),
        },
        keep_all: scope == Scope::KeepTokens,
        held: held.is_some().then_some(&holds),
    };
    let conversation = feats.prompt_cache_key.or(conversation_header);
    let named = conversation.as_deref().map(|key| Conversation {
        tenant: tenant.as_deref(),
        key,
    });
    let mut memo = None;
    let prompt = match obj.as_mut() {
        Some(_) if by_message => {
            let raw = raw_messages
                .as_deref()
                .ok_or_else(body::messages_required)?;
            let Some(chat) = conversations.chat(reader, (&bytes[..], raw), named, &at, scope)?
            else {
                return Ok(None);
            };
            memo = chat.memo;
            chat.prompt
        }
        _ if matches!(scope, Scope::ResumedWithin(_)) => return Ok(None),
        // A model's tokenizer or template: resumed by the rendered prompt.
        Some(o) if reader == Reader::Rendered && api == Api::Chat && scope == Scope::Whole => {
            match named {
                Some(c) => body::chat_messages(o)?.and_then(|messages| {
                    let chat = conversations.rendered(messages, c, &at);
                    memo = chat.memo;
                    chat.prompt
                }),
                None => reader.parsed(api, o, &at)?,
            }
        }
        Some(o) => reader.parsed(api, o, &at)?,
        None => None,
    }
    .unwrap_or_default();
    drop(raw_messages);
    drop(obj);
    let bytes = forwarded.unwrap_or(bytes);
    let input = KeyInput {
        tenant: tenant.as_deref(),
        conversation: conversation.as_deref(),
        tokens: &prompt.head,
    };
    let key = settings.key.key(&input);
    let block_tokens = settings.hasher.config().block_size as u64;
    let key_prefix_blocks = settings.key.from_prefix(&input).then(|| {
        let blocks = (settings.key.prefix_tokens as u64).div_ceil(block_tokens.max(1));
        u32::try_from(blocks).unwrap_or(u32::MAX)
    });
    let prompt_tokens = if prompt.tokens == 0 {
        // No tokens (not JSON, or content we cannot tokenize): about
        // four bytes per token.
        bytes.len() as u64 / 4
    } else {
        prompt.tokens
    };
    Ok(Some(Analysis {
        bytes,
        model: feats.model,
        stream: feats.stream,
        max_tokens: feats.max_tokens,
        choices: feats.n.unwrap_or(1),
        chain: prompt.chain,
        key,
        key_prefix_blocks,
        prompt_tokens,
        readable: prompt.tokens > 0 || reader == Reader::Unread,
        tokenized: prompt.tokens > 0 && reader.exact(),
        block_tokens,
        lora: lora.map(|l| l.name.clone()),
        tokens: prompt.all,
        contents: prompt.contents,
        memo,
    }))
}
