//! [`ChatTemplate`]: turns chat messages into the prompt text an engine
//! tokenizes.

use super::jinja::JinjaTemplate;
use super::{ChatMessage, TokenizeError, config};

/// How an engine renders chat messages into prompt text.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ChatTemplate {
    /// The ChatML-like template `kvroute-engine-sim` uses (see the
    /// [module docs](super)).
    Builtin,
    /// A model's Jinja chat template, rendered as transformers renders it.
    Jinja(Box<JinjaTemplate>),
}

impl ChatTemplate {
    /// The built-in template.
    pub fn builtin() -> Self {
        Self::Builtin
    }

    /// The chat template of a model's `tokenizer_config.json`: its
    /// `chat_template` (a string, or a list of `{name, template}` of which
    /// the one named `default` is used) and its `bos_token` and `eos_token`
    /// (strings or `{"content": ...}` objects; absent or `null` leaves them
    /// undefined in the template). Models that ship the template as a
    /// separate `chat_template.jinja` file go through [`Self::from_source`].
    pub fn from_tokenizer_config(json: &[u8]) -> Result<Self, TokenizeError> {
        let config = config::TemplateConfig::parse(json)?;
        Self::from_source(
            &config.chat_template,
            config.bos_token.as_deref(),
            config.eos_token.as_deref(),
        )
    }

    /// A Jinja chat template from its source and the model's special tokens.
    pub fn from_source(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TokenizeError> {
        JinjaTemplate::new(source, bos_token, eos_token).map(|t| Self::Jinja(Box::new(t)))
    }

    /// Renders `messages`; `add_generation_prompt` appends the header of the
    /// assistant turn the model is to write.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        match self {
            Self::Builtin => Ok(render_builtin(messages, add_generation_prompt)),
            Self::Jinja(template) => template.render(messages, add_generation_prompt),
        }
    }
}

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>\n";
const GENERATION_PROMPT: &str = "<|im_start|>assistant\n";

/// The built-in (ChatML) template's output, part by part: the one
/// definition of its layout, for rendering and for streaming.
pub(super) fn builtin_parts<'a>(
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    mut f: impl FnMut(&'a str),
) {
    for message in messages {
        f(IM_START);
        f(&message.role);
        f("\n");
        f(&message.content);
        f(IM_END);
    }
    if add_generation_prompt {
        f(GENERATION_PROMPT);
    }
}

fn render_builtin(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    // Sized exactly: grown by doubling, a large prompt's String would end
    // with up to its size again allocated (30 MiB more address space on a
    // 30 MiB prompt; untouched, so not resident, but a peak all the same).
    let mut len = 0;
    builtin_parts(messages, add_generation_prompt, |part| len += part.len());
    let mut out = String::with_capacity(len);
    builtin_parts(messages, add_generation_prompt, |part| out.push_str(part));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_is_chatml() {
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
        ];
        let template = ChatTemplate::builtin();
        assert_eq!(
            template.render(&messages, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        assert_eq!(
            template.render(&messages, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(
            template.render(&[], true).unwrap(),
            "<|im_start|>assistant\n"
        );
    }
}
