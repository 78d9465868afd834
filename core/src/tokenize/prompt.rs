//! Prompt tokens of OpenAI chat and completions requests, as vLLM computes
//! them.

use super::{ChatMessage, ChatTemplate, TokenizeError, Tokenizer};

/// The prompt tokens of a chat completions request: the messages rendered
/// with `add_generation_prompt = true`, then encoded without adding special
/// tokens.
///
/// vLLM's `ChatCompletionRequest` defaults `add_special_tokens` to `False`
/// ("For most models, the chat template takes care of adding the special
/// tokens", `vllm/entrypoints/openai/chat_completion/protocol.py`) and
/// `add_generation_prompt` to `True`. A request that overrides either is not
/// modelled here.
///
/// The messages are dropped once rendered, before encoding, so a large
/// prompt is held at most twice (the prompt and its ids) besides them.
pub fn chat_prompt_tokens(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: Vec<ChatMessage>,
) -> Result<Vec<u32>, TokenizeError> {
    let prompt = template.render(&messages, true)?;
    drop(messages);
    tokenizer.encode(&prompt, false)
}

/// Calls `f` with each prompt token of a chat, in the order
/// [`chat_prompt_tokens`] returns them, holding neither the prompt nor its
/// ids, when the tokenizer and the template are the built-in ones: the
/// built-in tokenizer never joins characters across a template part (every
/// part boundary is next to a character that is a piece of its own), so
/// the parts are encoded one by one. The template renders each message
/// alone, so a chat's tokens are its messages' tokens in order, then (with
/// `add_generation_prompt`) the generation prompt's: a caller may feed a
/// chat a few messages at a time. Returns `false`, calling nothing, for
/// any other tokenizer or template.
pub fn for_each_chat_token(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    mut f: impl FnMut(u32),
) -> bool {
    if !matches!(
        (tokenizer, template),
        (Tokenizer::Builtin, ChatTemplate::Builtin)
    ) {
        return false;
    }
    super::template::builtin_parts(messages, add_generation_prompt, |part| {
        super::builtin::encode_each(part, &mut f)
    });
    true
}

/// The prompt tokens of a completions request with a text prompt: the
/// prompt encoded with special tokens, so a Hugging Face tokenizer's
/// post-processor may prepend a BOS (the built-in tokenizer adds none).
///
/// vLLM's `CompletionRequest` defaults `add_special_tokens` to `True`
/// (`vllm/entrypoints/openai/completion/protocol.py`).
pub fn completion_prompt_tokens(
    tokenizer: &Tokenizer,
    prompt: &str,
) -> Result<Vec<u32>, TokenizeError> {
    tokenizer.encode(prompt, true)
}
