//! Exact mode's prompt: the tokens the engine will compute, hashed into
//! the engines' block chain one token at a time ([`Builder`]), from a parsed
//! body or a chat's raw messages (a message at a time, resumable from a
//! [`Snapshot`]).

use kvroute_core::hash::{BlockExtras, Chain, ChainState};
use kvroute_core::tokenize::{
    ChatMessage, ChatTemplate, Tokenizer, chat_prompt_tokens, completion_prompt_tokens,
    for_each_chat_token,
};
use serde_json::{Map, Value};
use xxhash_rust::xxh3::Xxh3;

use super::body::{Api, chat_messages, no_messages, raw_message};
use super::prefixes;
use super::{Held, Prompt};
use crate::errors::ApiError;
use crate::settings::Settings;

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
    use crate::prompt::body::tests::obj;
    use crate::prompt::body::{parse, skim};

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
            .take(crate::prompt::prefixes::BLOCKS)
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
}
