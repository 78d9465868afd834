//! Reading the chat-template fields of a `tokenizer_config.json`.

use serde_json::{Map, Value};

use super::TokenizeError;

/// What a chat template needs from `tokenizer_config.json`.
#[derive(Debug, PartialEq, Eq)]
pub struct TemplateConfig {
    pub chat_template: String,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl TemplateConfig {
    pub fn parse(json: &[u8]) -> Result<Self, TokenizeError> {
        let value: Value = serde_json::from_slice(json).map_err(TokenizeError::ConfigJson)?;
        let Value::Object(config) = value else {
            return Err(invalid("(root)", "must be a JSON object"));
        };
        Ok(Self {
            chat_template: chat_template(&config)?,
            bos_token: special_token(&config, "bos_token")?,
            eos_token: special_token(&config, "eos_token")?,
        })
    }
}

/// `chat_template` as a string, or the `default` entry of the named-template
/// list form (`[{"name": ..., "template": ...}]`), as transformers reads it.
fn chat_template(config: &Map<String, Value>) -> Result<String, TokenizeError> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Err(TokenizeError::NoChatTemplate),
        Some(Value::String(source)) => Ok(source.clone()),
        Some(Value::Array(templates)) => {
            for entry in templates {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(template)) => return Ok(template.to_owned()),
                    (Some(_), Some(_)) => {}
                    _ => {
                        return Err(invalid(
                            "chat_template",
                            "list entries must be {\"name\": string, \"template\": string}",
                        ));
                    }
                }
            }
            Err(TokenizeError::NoChatTemplate)
        }
        Some(_) => Err(invalid(
            "chat_template",
            "must be a string or a list of named templates",
        )),
    }
}

/// A special token given as a string or as an `AddedToken` object
/// (`{"content": ..., "lstrip": ..., ...}`).
fn special_token(
    config: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, TokenizeError> {
    match config.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(token)) => Ok(Some(token.clone())),
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(content)) => Ok(Some(content.clone())),
            _ => Err(invalid(field, "object form needs a string `content`")),
        },
        Some(_) => Err(invalid(field, "must be a string, an object or null")),
    }
}

fn invalid(field: &'static str, reason: &str) -> TokenizeError {
    TokenizeError::InvalidConfig {
        field,
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<TemplateConfig, TokenizeError> {
        TemplateConfig::parse(json.as_bytes())
    }

    #[test]
    fn string_template_and_string_tokens() {
        let config = parse(r#"{"chat_template": "T", "bos_token": "<s>", "eos_token": "</s>"}"#);
        assert_eq!(
            config.unwrap(),
            TemplateConfig {
                chat_template: "T".into(),
                bos_token: Some("<s>".into()),
                eos_token: Some("</s>".into()),
            }
        );
    }

    #[test]
    fn added_token_objects_and_null_tokens() {
        let config = parse(
            r#"{"chat_template": "T", "bos_token": null,
                "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": false}}"#,
        )
        .unwrap();
        assert_eq!(config.bos_token, None);
        assert_eq!(config.eos_token.as_deref(), Some("<|im_end|>"));
    }

    #[test]
    fn named_templates_pick_default() {
        let config = parse(
            r#"{"chat_template": [{"name": "tool_use", "template": "A"},
                                  {"name": "default", "template": "B"}]}"#,
        )
        .unwrap();
        assert_eq!(config.chat_template, "B");
        let none = parse(r#"{"chat_template": [{"name": "rag", "template": "A"}]}"#);
        assert!(matches!(none, Err(TokenizeError::NoChatTemplate)));
    }

    #[test]
    fn errors_name_the_field() {
        assert!(matches!(parse("{}"), Err(TokenizeError::NoChatTemplate)));
        assert!(matches!(
            parse("not json"),
            Err(TokenizeError::ConfigJson(_))
        ));
        let err = parse(r#"{"chat_template": 3}"#).unwrap_err();
        assert!(err.to_string().contains("chat_template"), "{err}");
        let err = parse(r#"{"chat_template": "T", "eos_token": 5}"#).unwrap_err();
        assert!(err.to_string().contains("eos_token"), "{err}");
        let err = parse(r#"{"chat_template": [{"name": "default"}]}"#).unwrap_err();
        assert!(err.to_string().contains("chat_template"), "{err}");
    }
}
