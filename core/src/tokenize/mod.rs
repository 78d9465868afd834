//! Prompt tokenization: the exact token ids an engine computes for a request.
//!
//! The router hashes a request's KV blocks ([`crate::hash`]) from the token
//! ids the engine will see, so it must tokenize exactly as the engine does.
//! Engines are either `kvroute-engine-sim`, which uses the built-in
//! [`Tokenizer::Builtin`] and [`ChatTemplate::Builtin`] from this module, or
//! vLLM, which uses the model's Hugging Face `tokenizer.json`
//! ([`Tokenizer::from_tokenizer_json`]) and the chat template of its
//! `tokenizer_config.json` ([`ChatTemplate::from_tokenizer_config`]). Both
//! the simulator and the router call this module, so they agree by
//! construction; [`chat_prompt_tokens`] and [`completion_prompt_tokens`]
//! apply vLLM's per-endpoint `add_special_tokens` defaults.
//!
//! Not here: reading files (constructors take bytes or strings), images and
//! other non-text content ([`content_text`] rejects them), tool definitions,
//! `chat_template_kwargs`, `continue_final_message`, and Mistral's own
//! tokenizer format.
//!
//! # The built-in tokenizer
//!
//! Deterministic, without a vocabulary, about four characters per token.
//! The text is split into pieces, left to right:
//!
//! 1. A *word*: an optional single ASCII space (U+0020) followed by a
//!    maximal run of one or more ASCII alphanumerics (`[0-9A-Za-z]`), cut
//!    into chunks of at most 4 alphanumerics each; the leading space, if
//!    any, stays on the first chunk (so the first chunk can be 5 bytes).
//! 2. Otherwise one Unicode scalar value is a piece of its own: a space not
//!    followed by an alphanumeric, a newline, punctuation, any non-ASCII
//!    character.
//!
//! So `"Hello, world"` is `["Hell", "o", ",", " worl", "d"]` and
//! `" über"` is `[" ", "ü", "ber"]`. A piece's token id is
//! `256 + xxh3_64(piece as UTF-8) % 99_744` (XXH3 64-bit, seed 0), so ids
//! lie in `256..100_000`; ids below 256 are reserved and never produced.
//! There are no special tokens: `add_special_tokens` has no effect.
//!
//! # The built-in chat template
//!
//! ChatML-like: each message renders as
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, and `add_generation_prompt`
//! appends `<|im_start|>assistant\n`. The markers are plain text to the
//! built-in tokenizer (`<|im_start|>` is 8 pieces).
//!
//! # Jinja chat templates
//!
//! Rendered with minijinja configured as transformers configures jinja2 for
//! `apply_chat_template` (`transformers/utils/chat_template_utils.py`),
//! which is what vLLM calls: `trim_blocks` and `lstrip_blocks` on, the
//! trailing newline of the source dropped, `break`/`continue` enabled, no
//! autoescaping, undefined values lenient (they render empty, are falsy and
//! iterate as empty; an attribute of an undefined value is an error, as in
//! jinja2). Python string, list and dict methods (`strip`, `startswith`,
//! `items`, ...) come from `minijinja_contrib::pycompat`.
//!
//! The template sees `messages` (a list of `{role, content}` maps, content
//! always a string: vLLM's "string" content format), `add_generation_prompt`,
//! `bos_token` and `eos_token` (undefined when the model has none), and
//! `tools` and `documents` set to `none`, as transformers passes them for a
//! request without tools. Globals: `raise_exception(message)`, which fails
//! rendering with [`TokenizeError::TemplateRaised`], and
//! `strftime_now(format)` (UTC; `%Y %m %d %b %B %%` only). The `tojson`
//! filter is transformers' one, Python's `json.dumps` with
//! `ensure_ascii=False` (no HTML escaping, unlike minijinja's own).
//!
//! Known gaps: the `{% generation %}` tag (assistant masks for training) does
//! not compile; a map literal written in a template iterates sorted by key
//! where Python keeps insertion order; special tokens other than BOS and EOS
//! (`pad_token`, `unk_token`, ...) are not passed to the template.
//!
//! # Hugging Face tokenizers
//!
//! A `tokenizer.json` runs through the `tokenizers` crate, the library behind
//! transformers' fast tokenizers that vLLM uses. Truncation and padding set
//! in the file are switched off, as transformers does for a plain call.

mod builtin;
mod config;
mod content;
mod error;
mod jinja;
mod prompt;
mod pyjson;
mod strftime;
mod template;
mod tokenizer;

pub use content::{ChatMessage, content_text};
pub use error::TokenizeError;
pub use jinja::JinjaTemplate;
pub use prompt::{chat_prompt_tokens, completion_prompt_tokens, for_each_chat_token};
pub use template::ChatTemplate;
pub use tokenizer::{Cut, MAX_CUT_TAIL, Tokenizer};

#[cfg(test)]
mod tests;
