//! Rendering a model's Jinja chat template the way transformers'
//! `apply_chat_template` does (`_compile_jinja_template` and `render` in
//! `transformers/utils/chat_template_utils.py`), which is what vLLM calls.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Enumerator, Object, ObjectRepr};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior, Value};

use super::{ChatMessage, TokenizeError, pyjson, strftime};

const NAME: &str = "chat_template";

/// A compiled chat template with the model's special tokens.
#[derive(Clone)]
pub struct JinjaTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl JinjaTemplate {
    pub(super) fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True,
        // lstrip_blocks=True, extensions=[..., loopcontrols]); jinja2's
        // defaults otherwise (no autoescape, trailing newline dropped,
        // lenient undefined).
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(TokenizeError::InvalidTemplate)?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime::strftime_now);
        env.add_filter("tojson", pyjson::tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(TokenizeError::InvalidTemplate)?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
        })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` the template sees, if the model has one.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The `eos_token` the template sees, if the model has one.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| Value::from_object(Message(m.clone())))
            .collect();
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        // transformers passes `tools` and `documents` explicitly, as None
        // when the request has none: a template's `tools is defined` is true
        // and `tools is not none` false, exactly as in Python.
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        // Special tokens come from `special_tokens_map`, which leaves unset
        // ones out, so a missing token is undefined (renders empty).
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        let template = self.env.get_template(NAME).map_err(TokenizeError::Render)?;
        template
            .render(Value::from(ctx))
            .map_err(|err| match raised(&err) {
                Some(message) => TokenizeError::TemplateRaised(message),
                None => TokenizeError::Render(err),
            })
    }
}

impl fmt::Debug for JinjaTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JinjaTemplate")
            .field("source_len", &self.source().len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// A message as the template sees it: a map with `role` then `content`, the
/// key order of the Python dict transformers passes.
#[derive(Debug)]
struct Message(ChatMessage);

impl Object for Message {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.0.role.as_str())),
            "content" => Some(Value::from(self.0.content.as_str())),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// Marks the error of `raise_exception` so rendering can report the
/// template's own message.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// The message of a `raise_exception` call anywhere in `err`'s chain.
fn raised(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        if let Some(Raised(message)) = current.downcast_ref::<Raised>() {
            return Some(message.clone());
        }
        source = current.source();
    }
    None
}
