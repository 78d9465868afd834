//! Chat messages and flattening OpenAI message `content` to text.

use serde_json::Value;

use super::TokenizeError;

/// One chat message as a chat template sees it: a role and text content
/// (see [`content_text`] for flattening OpenAI content parts).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...: passed to the template as
    /// given.
    pub role: String,
    /// The message text, already flattened.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Flattens an OpenAI message `content` to the text a chat template sees.
///
/// A string is itself; `null` is empty; an array of parts is the texts of
/// its parts joined with `"\n"`, as vLLM does for text-only content when the
/// template takes string content (`_parse_chat_message_content_parts` in
/// `vllm/entrypoints/chat_utils.py`: `text_prompt = "\n".join(texts)`). A
/// part is `{"type": "text", "text": ...}` or a bare string; a text part
/// whose `text` is `null` is skipped, as vLLM skips it. Any other part type
/// (images, audio, ...) is [`TokenizeError::Unsupported`]: the engine would
/// add placeholder tokens this module does not compute.
pub fn content_text(content: &Value) -> Result<String, TokenizeError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (index, part) in parts.iter().enumerate() {
                if let Some(text) = part_text(index, part)? {
                    texts.push(text);
                }
            }
            Ok(texts.join("\n"))
        }
        other => Err(TokenizeError::InvalidContent(format!(
            "content must be a string, an array of parts or null, not {}",
            json_type(other)
        ))),
    }
}

/// The text of one content part, or `None` for a text part without text.
fn part_text(index: usize, part: &Value) -> Result<Option<&str>, TokenizeError> {
    let part = match part {
        Value::String(text) => return Ok(Some(text)),
        Value::Object(part) => part,
        other => {
            return Err(TokenizeError::InvalidContent(format!(
                "content part {index} must be an object or a string, not {}",
                json_type(other)
            )));
        }
    };
    match part.get("type").and_then(Value::as_str) {
        Some("text") => match part.get("text") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(other) => Err(TokenizeError::InvalidContent(format!(
                "content part {index}: `text` must be a string, not {}",
                json_type(other)
            ))),
        },
        Some(kind) => Err(TokenizeError::Unsupported(format!(
            "content part {index} has type {kind:?}; only \"text\" parts are supported"
        ))),
        None => Err(TokenizeError::InvalidContent(format!(
            "content part {index} has no string `type`"
        ))),
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn strings_and_null() {
        assert_eq!(content_text(&json!("hi there")).unwrap(), "hi there");
        assert_eq!(content_text(&Value::Null).unwrap(), "");
    }

    #[test]
    fn text_parts_join_with_newlines() {
        let content = json!([
            {"type": "text", "text": "first"},
            "second",
            {"type": "text", "text": null},
            {"type": "text", "text": "third"},
        ]);
        assert_eq!(content_text(&content).unwrap(), "first\nsecond\nthird");
        assert_eq!(content_text(&json!([])).unwrap(), "");
    }

    #[test]
    fn image_parts_are_unsupported_and_named() {
        let content = json!([
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        ]);
        let err = content_text(&content).unwrap_err();
        assert!(matches!(err, TokenizeError::Unsupported(_)), "{err:?}");
        assert!(err.to_string().contains("\"image_url\""), "{err}");
    }

    #[test]
    fn malformed_content_is_invalid() {
        for bad in [
            json!(7),
            json!({"text": "x"}),
            json!([{"text": "x"}]),
            json!([3]),
        ] {
            let err = content_text(&bad).unwrap_err();
            assert!(
                matches!(err, TokenizeError::InvalidContent(_)),
                "{bad}: {err:?}"
            );
        }
    }
}
