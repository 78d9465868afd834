//! What warm-ups are asked for: `routing.warmup` in a router's file, and
//! `CacheRoutingPolicy.spec.warmup` through the operator, with one set of
//! rules ([`Warmup::validate`]) for both; each names the field under its
//! own root.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most named prefixes.
pub const MAX_PREFIXES: usize = 64;
/// The longest prefix name (a metric label).
pub const MAX_NAME_BYTES: usize = 63;

/// The warm-ups of a pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Warmup {
    /// Each prefix is warmed once per this many seconds, at its own offset
    /// into the period. Default: 240.
    pub every_seconds: u64,
    /// Warmed on the first this many ready endpoints in the rendezvous
    /// order of the routing key a request starting with the prefix gets.
    /// Default: 1.
    pub owners: u32,
    /// Warm-ups' prefill over the last 10 minutes stays at most this share
    /// of all prefill, (0, 1]; a prefix's first warm-up is always sent.
    /// Default: 0.02.
    pub max_share_of_prefill: f64,
    /// The prefixes, at most [`MAX_PREFIXES`].
    pub prefixes: Vec<Prefix>,
}

impl Default for Warmup {
    fn default() -> Self {
        Warmup {
            every_seconds: 240,
            owners: 1,
            max_share_of_prefill: 0.02,
            prefixes: Vec::new(),
        }
    }
}

/// One named prefix: exactly one of `messages`, `prompt` and
/// `configMapRef`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Prefix {
    /// Its name, in `kvroute_warmups_total{prefix}`: 1 to
    /// [`MAX_NAME_BYTES`] letters, digits, `.`, `_` or `-`, unique.
    pub name: String,
    /// The model it is sent to; default: the one model the endpoints serve
    /// (required when they serve several).
    #[serde(default)]
    pub model: Option<String>,
    /// The tenant it is warmed for (its salt and routing key, as that
    /// tenant's requests get); required under salted tenancy.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Chat messages: sent to `/v1/chat/completions`, rendered by the
    /// engine's chat template as a chat request with them is.
    #[serde(default)]
    pub messages: Option<Vec<Value>>,
    /// A prompt: sent to `/v1/completions`.
    #[serde(default)]
    pub prompt: Option<String>,
    /// With the operator only: a ConfigMap key whose text is the content
    /// of the prefix's one `system` message.
    #[serde(default)]
    pub config_map_ref: Option<ConfigMapRef>,
}

/// A key of a ConfigMap in the policy's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigMapRef {
    pub name: String,
    pub key: String,
}

/// A broken rule: the field (relative to the warm-up's root, `[]` for any
/// prefix), the value and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    pub field: &'static str,
    pub value: String,
    pub reason: &'static str,
}

fn invalid(field: &'static str, value: impl std::fmt::Display, reason: &'static str) -> Invalid {
    Invalid {
        field,
        value: value.to_string(),
        reason,
    }
}

impl Warmup {
    /// Checks every rule, naming the field of the first it breaks.
    /// `salted`: tenancy is salted; `config_maps`: the operator resolves
    /// `configMapRef` (a router on its own cannot).
    pub fn validate(&self, salted: bool, config_maps: bool) -> Result<(), Invalid> {
        if self.every_seconds < 1 {
            return Err(invalid(
                "everySeconds",
                self.every_seconds,
                "must be at least 1",
            ));
        }
        if self.owners < 1 {
            return Err(invalid("owners", self.owners, "must be at least 1"));
        }
        let share = self.max_share_of_prefill;
        if !(share > 0.0 && share <= 1.0) {
            return Err(invalid("maxShareOfPrefill", share, "must be in (0, 1]"));
        }
        if self.prefixes.is_empty() || self.prefixes.len() > MAX_PREFIXES {
            return Err(invalid(
                "prefixes",
                self.prefixes.len(),
                "must name 1 to 64 prefixes",
            ));
        }
        for (i, p) in self.prefixes.iter().enumerate() {
            let name = &p.name;
            let valid = |b: u8| b.is_ascii_alphanumeric() || b"._-".contains(&b);
            if name.is_empty() || name.len() > MAX_NAME_BYTES || !name.bytes().all(valid) {
                return Err(invalid(
                    "prefixes[].name",
                    format!("{name:?}"),
                    "must be 1 to 63 letters, digits, '.', '_' or '-'",
                ));
            }
            if self.prefixes[..i].iter().any(|q| q.name == *name) {
                return Err(invalid("prefixes[].name", name, "is named twice"));
            }
            if p.config_map_ref.is_some() && !config_maps {
                return Err(invalid(
                    "prefixes[].configMapRef",
                    name,
                    "needs the operator: give messages or prompt",
                ));
            }
            let given = [
                p.messages.is_some(),
                p.prompt.is_some(),
                p.config_map_ref.is_some(),
            ];
            if given.iter().filter(|&&g| g).count() != 1 {
                let reason = if config_maps {
                    "give exactly one of messages, prompt and configMapRef"
                } else {
                    "give exactly one of messages and prompt"
                };
                return Err(invalid("prefixes[].messages", name, reason));
            }
            if p.messages.as_ref().is_some_and(Vec::is_empty) {
                return Err(invalid("prefixes[].messages", name, "must not be empty"));
            }
            if (p.config_map_ref.as_ref()).is_some_and(|r| r.name.is_empty() || r.key.is_empty()) {
                return Err(invalid(
                    "prefixes[].configMapRef",
                    name,
                    "needs a name and a key",
                ));
            }
            if salted && p.tenant.is_none() {
                return Err(invalid(
                    "prefixes[].tenant",
                    name,
                    "is required under salted tenancy",
                ));
            }
        }
        Ok(())
    }
}

impl Prefix {
    /// The path it is sent to and the body of its warm-up for `model`:
    /// one token. A `configMapRef` not resolved yet reads as no prompt.
    pub fn request(&self, model: &str) -> (&'static str, Value) {
        match (&self.messages, &self.prompt) {
            (Some(messages), _) => (
                "/v1/chat/completions",
                serde_json::json!({"model": model, "messages": messages, "max_tokens": 1}),
            ),
            (None, prompt) => (
                "/v1/completions",
                serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1}),
            ),
        }
    }

    /// The prefix a ConfigMap's `text` gives: one system message.
    pub fn system_message(text: &str) -> Vec<Value> {
        vec![serde_json::json!({"role": "system", "content": text})]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(p: Prefix) -> Warmup {
        Warmup {
            prefixes: vec![p],
            ..Warmup::default()
        }
    }

    fn prompt(name: &str) -> Prefix {
        Prefix {
            name: name.into(),
            model: None,
            tenant: None,
            messages: None,
            prompt: Some("x".into()),
            config_map_ref: None,
        }
    }

    #[test]
    fn a_config_map_ref_is_one_source_with_the_operator_only() {
        let by_ref = Prefix {
            prompt: None,
            config_map_ref: Some(ConfigMapRef {
                name: "prompts".into(),
                key: "support".into(),
            }),
            ..prompt("a")
        };
        assert_eq!(one(by_ref.clone()).validate(false, true), Ok(()));
        let refused = one(by_ref.clone()).validate(false, false).unwrap_err();
        assert_eq!(refused.field, "prefixes[].configMapRef");
        let both = Prefix {
            prompt: Some("x".into()),
            ..by_ref.clone()
        };
        let e = one(both).validate(false, true).unwrap_err();
        assert_eq!(
            (e.field, e.reason),
            (
                "prefixes[].messages",
                "give exactly one of messages, prompt and configMapRef"
            )
        );
        let keyless = Prefix {
            config_map_ref: Some(ConfigMapRef {
                name: "prompts".into(),
                key: String::new(),
            }),
            ..by_ref
        };
        assert_eq!(
            one(keyless).validate(false, true).unwrap_err().reason,
            "needs a name and a key"
        );
        let e = one(prompt("a")).validate(true, true).unwrap_err();
        assert_eq!(e.field, "prefixes[].tenant");
    }
}
