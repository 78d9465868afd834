//! `routing.warmup`: named prefixes the router keeps warm on their owners
//! (`docs/warmup.md`). The schedule and its rules are the core's
//! ([`kvroute_core::warmup`]); the sending is [`crate::warmup`]'s.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ConfigError;
use super::validate::invalid;

/// The most named prefixes.
pub const MAX_PREFIXES: usize = 64;
/// The longest prefix name (a metric label).
pub const MAX_NAME_BYTES: usize = 63;

/// `routing.warmup`.
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

/// One named prefix: exactly one of `messages` and `prompt`.
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
    /// With the operator only: a ConfigMap key holding the prompt.
    #[serde(default)]
    pub config_map_ref: Option<Value>,
}

impl Warmup {
    /// Checks every rule, naming the field of the first it breaks;
    /// `salted`: tenancy is salted.
    pub fn validate(&self, salted: bool) -> Result<(), ConfigError> {
        if self.every_seconds < 1 {
            return Err(invalid(
                "routing.warmup.everySeconds",
                &self.every_seconds,
                "must be at least 1",
            ));
        }
        if self.owners < 1 {
            return Err(invalid(
                "routing.warmup.owners",
                &self.owners,
                "must be at least 1",
            ));
        }
        let share = self.max_share_of_prefill;
        if !(share > 0.0 && share <= 1.0) {
            return Err(invalid(
                "routing.warmup.maxShareOfPrefill",
                &share,
                "must be in (0, 1]",
            ));
        }
        if self.prefixes.is_empty() || self.prefixes.len() > MAX_PREFIXES {
            return Err(invalid(
                "routing.warmup.prefixes",
                &self.prefixes.len(),
                "must name 1 to 64 prefixes",
            ));
        }
        for (i, p) in self.prefixes.iter().enumerate() {
            let name = &p.name;
            let valid = |b: u8| b.is_ascii_alphanumeric() || b"._-".contains(&b);
            if name.is_empty() || name.len() > MAX_NAME_BYTES || !name.bytes().all(valid) {
                return Err(invalid(
                    "routing.warmup.prefixes[].name",
                    &format!("{name:?}"),
                    "must be 1 to 63 letters, digits, '.', '_' or '-'",
                ));
            }
            if self.prefixes[..i].iter().any(|q| q.name == *name) {
                return Err(invalid(
                    "routing.warmup.prefixes[].name",
                    name,
                    "is named twice",
                ));
            }
            if p.config_map_ref.is_some() {
                return Err(invalid(
                    "routing.warmup.prefixes[].configMapRef",
                    name,
                    "needs the operator: give messages or prompt",
                ));
            }
            if p.messages.is_some() == p.prompt.is_some() {
                return Err(invalid(
                    "routing.warmup.prefixes[].messages",
                    name,
                    "give exactly one of messages and prompt",
                ));
            }
            if p.messages.as_ref().is_some_and(Vec::is_empty) {
                return Err(invalid(
                    "routing.warmup.prefixes[].messages",
                    name,
                    "must not be empty",
                ));
            }
            if salted && p.tenant.is_none() {
                return Err(invalid(
                    "routing.warmup.prefixes[].tenant",
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
    /// one token.
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
}
