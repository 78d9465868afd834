//! Errors from tokenizing and rendering chat templates.

/// The error type of the `tokenizers` crate.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a prompt could not be turned into tokens, or a tokenizer or template
/// could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// `tokenizer.json` did not load.
    #[error("invalid tokenizer.json: {0}")]
    InvalidTokenizerJson(#[source] BoxError),
    /// The Hugging Face tokenizer failed on the input.
    #[error("tokenizer failed to encode the prompt: {0}")]
    Encode(#[source] BoxError),
    /// `tokenizer_config.json` is not JSON.
    #[error("tokenizer_config.json is not valid JSON: {0}")]
    ConfigJson(#[source] serde_json::Error),
    /// A field of `tokenizer_config.json` has the wrong shape.
    #[error("invalid tokenizer_config.json field `{field}`: {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer_config.json` has no usable `chat_template` (absent, null,
    /// or a list of named templates without one named `default`); newer
    /// models ship it as `chat_template.jinja` instead.
    #[error(
        "tokenizer_config.json has no chat_template (nor a template named \"default\"); \
         pass the model's chat_template.jinja instead"
    )]
    NoChatTemplate,
    /// The chat template does not compile.
    #[error("invalid chat template: {0}")]
    InvalidTemplate(#[source] minijinja::Error),
    /// The chat template called `raise_exception(message)`: it rejects
    /// these messages (roles out of order, say).
    #[error("chat template rejected the messages: {0}")]
    TemplateRaised(String),
    /// Rendering the chat template failed for another reason.
    #[error("chat template failed to render: {0}")]
    Render(#[source] minijinja::Error),
    /// Request content this module cannot flatten to text (an image part,
    /// say): the engine would see tokens the router cannot compute.
    #[error("unsupported message content: {0}")]
    Unsupported(String),
    /// Request content that is not of the OpenAI shape.
    #[error("invalid message content: {0}")]
    InvalidContent(String),
}
