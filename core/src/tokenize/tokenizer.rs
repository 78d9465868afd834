//! [`Tokenizer`]: the built-in tokenizer or a Hugging Face `tokenizer.json`.

use std::fmt;

use super::{TokenizeError, builtin};

/// Turns text into the token ids an engine computes for it.
#[derive(Clone)]
#[non_exhaustive]
pub enum Tokenizer {
    /// The vocabulary-free tokenizer `kvroute-engine-sim` uses (see the
    /// [module docs](super)).
    Builtin,
    /// A model's `tokenizer.json`, as vLLM's fast tokenizer runs it.
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The built-in tokenizer.
    pub fn builtin() -> Self {
        Self::Builtin
    }

    /// A Hugging Face tokenizer from the bytes of its `tokenizer.json`.
    ///
    /// Truncation and padding configured in the file are switched off:
    /// transformers' fast tokenizer switches them off for every call that
    /// does not ask for them, and vLLM does not.
    pub fn from_tokenizer_json(bytes: &[u8]) -> Result<Self, TokenizeError> {
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(TokenizeError::InvalidTokenizerJson)?;
        tokenizer
            .with_truncation(None)
            .map_err(TokenizeError::InvalidTokenizerJson)?
            .with_padding(None);
        Ok(Self::HuggingFace(Box::new(tokenizer)))
    }

    /// Encodes `text`. `add_special_tokens` runs the tokenizer's
    /// post-processor (which typically prepends a BOS); the built-in
    /// tokenizer has no special tokens and ignores it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Self::Builtin => Ok(builtin::encode(text)),
            Self::HuggingFace(tokenizer) => tokenizer
                .encode_fast(text, add_special_tokens)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(TokenizeError::Encode),
        }
    }

    /// Encodes `text` as [`encode`](Self::encode) does without special
    /// tokens, and says where it may be cut: the [`Cut`] before its last
    /// token that is a special added token not stripping the whitespace on
    /// its left. A Hugging Face tokenizer splits its input on added tokens
    /// before normalizing, pre-tokenizing or encoding any of it, so the
    /// first `cut.tokens` ids are those of `text[..cut.at]` encoded alone,
    /// whatever follows: a chat rendered again with more turns after
    /// the same text encodes only what follows. The tail is encoded again to
    /// check the cut, so a cut is only offered past the text's start and
    /// with at most [`MAX_CUT_TAIL`] bytes after it. `None` for the built-in
    /// tokenizer, whose ids the router reads a message at a time instead,
    /// and when no token qualifies.
    pub fn encode_cut(&self, text: &str) -> Result<(Vec<u32>, Option<Cut>), TokenizeError> {
        let Self::HuggingFace(tokenizer) = self else {
            return self.encode(text, false).map(|ids| (ids, None));
        };
        let encoding = tokenizer
            .encode(text, false)
            .map_err(TokenizeError::Encode)?;
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        let ids = encoding.get_ids();
        let cut = ids
            .iter()
            .zip(encoding.get_offsets())
            .enumerate()
            .rev()
            .find(|(_, (id, _))| added.get(id).is_some_and(|t| t.special && !t.lstrip))
            .map(|(i, (_, &(at, _)))| Cut { tokens: i, at })
            .filter(|c| c.at > 0 && text.len().saturating_sub(c.at) <= MAX_CUT_TAIL)
            .filter(|c| {
                text.get(c.at..).is_some_and(|tail| {
                    tokenizer
                        .encode_fast(tail, false)
                        .is_ok_and(|e| e.get_ids() == &ids[c.tokens..])
                })
            });
        Ok((ids.to_vec(), cut))
    }

    /// `"builtin"` or `"huggingface"`, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Builtin => "builtin",
            Self::HuggingFace(_) => "huggingface",
        }
    }
}

/// The most bytes after a [`Cut`]: its check encodes them again. A chat
/// template's last special token usually opens the generation prompt.
pub const MAX_CUT_TAIL: usize = 16 * 1024;

/// Where an encoded text may be cut ([`Tokenizer::encode_cut`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Tokens before the cut.
    pub tokens: usize,
    /// The cut's byte offset in the text.
    pub at: usize,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Builtin => f.write_str("Tokenizer::Builtin"),
            Self::HuggingFace(tokenizer) => f
                .debug_struct("Tokenizer::HuggingFace")
                .field("vocab_size", &tokenizer.get_vocab_size(true))
                .finish(),
        }
    }
}
