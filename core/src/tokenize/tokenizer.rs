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

    /// `"builtin"` or `"huggingface"`, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Builtin => "builtin",
            Self::HuggingFace(_) => "huggingface",
        }
    }
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
