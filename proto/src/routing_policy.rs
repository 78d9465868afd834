//! The one pair of conversions between the wire's [`v1::RoutingPolicy`] and
//! the core's [`RoutingSpec`]: the operator writes a spec with
//! `From<&RoutingSpec>`, a router reads one with
//! [`v1::RoutingPolicy::to_spec`].
//!
//! Reading keeps a router routing when a part of a policy is unusable (a
//! newer operator's policy name, an unknown key mode, an invalid block
//! size): that part stays as it is in the router's current spec, and is
//! reported ([`Unusable`]) for the router to log. In detail:
//!
//! 1. The policy by name with the parameters it has
//!    ([`PolicyConfig::with_parameters`]); an unknown name or parameters
//!    it refuses keep the current policy.
//! 2. The key mode; unspecified or unknown keeps the current mode. A prefix
//!    length of 0 keeps the current length.
//! 3. The hashing (algorithm, block size, seed) with the current
//!    extra-key form; an unknown algorithm or an invalid block size keeps
//!    the current hashing.
//! 4. The offload weight; absent is the default, outside 0 to 1 keeps the
//!    current weight.
//! 5. Tenancy salted when the wire says so; shared otherwise.
//! 6. The slow-start window; absent is the default, over the maximum keeps
//!    the current window.
//!
//! The key's `scope_by_tenant` is the router's own and kept from the
//! current spec. The wire's `cache_port` and `tenant_header` are not part
//! of a spec: the operator sets them on what `From` gives, routers read them
//! from the message.

use kvroute_core::hash::{BlockHasher, HashConfig};
use kvroute_core::keys::KeyMode;
use kvroute_core::policy::{PolicyConfig, PolicyParameters};
use kvroute_core::slow_start::MAX_WINDOW_SECONDS;
use kvroute_core::spec::{
    Disaggregation, DisaggregationMode, MAX_MIN_UNCACHED_TOKENS, RoutingSpec, TenancyMode,
};

use kvroute_core::warmup::{Prefix, Warmup};

use crate::hash_algo_from_i32;
use crate::v1;

impl From<&RoutingSpec> for v1::RoutingPolicy {
    /// The spec on the wire, with no cache port and no tenant header.
    fn from(spec: &RoutingSpec) -> Self {
        let parameters = spec.policy.parameters();
        v1::RoutingPolicy {
            policy: spec.policy.name().to_owned(),
            key_mode: v1::KeyMode::from(spec.key.mode).into(),
            prefix_tokens: u32::try_from(spec.key.prefix_tokens).unwrap_or(u32::MAX),
            load_bound: parameters.load_bound.unwrap_or(0.0),
            latency_slack: parameters.latency_slack,
            prefill_tokens_per_second: parameters.prefill_tokens_per_second,
            prefill_overhead_ms: parameters.prefill_overhead_ms,
            offload_weight: Some(f64::from(spec.offload_weight)),
            block_size: u32::try_from(spec.hash.block_size).unwrap_or(u32::MAX),
            hash_algorithm: v1::HashAlgorithm::from(spec.hash.algo).into(),
            hash_seed: spec.hash.seed.clone(),
            cache_port: 0,
            tenancy: v1::TenancyMode::from(spec.tenancy).into(),
            tenant_header: String::new(),
            slow_start_seconds: Some(spec.slow_start_seconds),
            disaggregation: Some(v1::Disaggregation {
                mode: match spec.disaggregation.mode {
                    DisaggregationMode::Disabled => v1::DisaggregationMode::Disabled,
                    DisaggregationMode::Auto => v1::DisaggregationMode::Auto,
                }
                .into(),
                min_uncached_tokens: spec.disaggregation.min_uncached_tokens,
            }),
            warmup: None,
        }
    }
}

impl From<&Warmup> for v1::Warmup {
    /// The warm-ups on the wire; a `configMapRef` the operator did not
    /// resolve into messages is left out.
    fn from(w: &Warmup) -> Self {
        let prefix = |p: &Prefix| {
            let text = match (&p.messages, &p.prompt) {
                (Some(m), _) => v1::warmup_prefix::Text::MessagesJson(
                    serde_json::to_string(m).unwrap_or_default(),
                ),
                (None, Some(prompt)) => v1::warmup_prefix::Text::Prompt(prompt.clone()),
                (None, None) => return None,
            };
            Some(v1::WarmupPrefix {
                name: p.name.clone(),
                model: p.model.clone(),
                tenant: p.tenant.clone(),
                text: Some(text),
            })
        };
        v1::Warmup {
            every_seconds: w.every_seconds,
            owners: w.owners,
            max_share_of_prefill: w.max_share_of_prefill,
            prefixes: w.prefixes.iter().filter_map(prefix).collect(),
        }
    }
}

impl v1::Warmup {
    /// The warm-ups it asks for, or why they cannot be read (not checked
    /// against the rules: [`Warmup::validate`] does that).
    pub fn to_warmup(&self) -> Result<Warmup, String> {
        let prefix = |p: &v1::WarmupPrefix| {
            let (messages, prompt) = match &p.text {
                Some(v1::warmup_prefix::Text::MessagesJson(json)) => {
                    let messages = serde_json::from_str(json)
                        .map_err(|e| format!("prefix {}: messages: {e}", p.name))?;
                    (Some(messages), None)
                }
                Some(v1::warmup_prefix::Text::Prompt(prompt)) => (None, Some(prompt.clone())),
                None => return Err(format!("prefix {}: no text", p.name)),
            };
            Ok(Prefix {
                name: p.name.clone(),
                model: p.model.clone(),
                tenant: p.tenant.clone(),
                messages,
                prompt,
                config_map_ref: None,
            })
        };
        Ok(Warmup {
            every_seconds: self.every_seconds,
            owners: self.owners,
            max_share_of_prefill: self.max_share_of_prefill,
            prefixes: self.prefixes.iter().map(prefix).collect::<Result<_, _>>()?,
        })
    }
}

/// A part of a wire policy a router cannot use; it keeps its current one.
#[derive(Clone, Debug, PartialEq)]
pub enum Unusable {
    /// A policy name this build does not know, or parameters the policy
    /// refuses (the reason).
    Policy {
        /// The name sent.
        name: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// An unspecified or unknown key mode (the raw value).
    KeyMode(i32),
    /// An unknown hash algorithm or an invalid block size.
    Hashing {
        /// The block size sent.
        block_size: u32,
        /// The raw hash algorithm sent.
        hash_algorithm: i32,
        /// Why it cannot be used.
        reason: String,
    },
    /// An offload weight outside 0 to 1.
    OffloadWeight(f64),
    /// A slow-start window over
    /// [`kvroute_core::slow_start::MAX_WINDOW_SECONDS`].
    SlowStartSeconds(u32),
    /// An unspecified or unknown disaggregation mode (the raw value), or a
    /// threshold over [`MAX_MIN_UNCACHED_TOKENS`].
    Disaggregation(i32, u64),
}

impl v1::RoutingPolicy {
    /// The spec this policy says, each unusable part kept from `current`
    /// and reported (see the module docs).
    pub fn to_spec(&self, current: &RoutingSpec) -> (RoutingSpec, Vec<Unusable>) {
        let mut unusable = Vec::new();
        let policy = self.policy_config().unwrap_or_else(|reason| {
            unusable.push(Unusable::Policy {
                name: self.policy.clone(),
                reason,
            });
            current.policy.clone()
        });
        let mut key = current.key.clone();
        match self.core_key_mode() {
            Some(mode) => key.mode = mode,
            None => unusable.push(Unusable::KeyMode(self.key_mode)),
        }
        if self.prefix_tokens > 0 {
            key.prefix_tokens = self.prefix_tokens as usize;
        }
        let hash = self.hash_config(&current.hash).unwrap_or_else(|reason| {
            unusable.push(Unusable::Hashing {
                block_size: self.block_size,
                hash_algorithm: self.hash_algorithm,
                reason,
            });
            current.hash.clone()
        });
        let offload_weight = match self.offload_weight {
            Some(w) if (0.0..=1.0).contains(&w) => w as f32,
            Some(w) => {
                unusable.push(Unusable::OffloadWeight(w));
                current.offload_weight
            }
            None => RoutingSpec::default().offload_weight,
        };
        let tenancy = if self.tenancy == v1::TenancyMode::Salted as i32 {
            TenancyMode::Salted
        } else {
            TenancyMode::Shared
        };
        let slow_start_seconds = match self.slow_start_seconds {
            Some(s) if s <= MAX_WINDOW_SECONDS => s,
            Some(s) => {
                unusable.push(Unusable::SlowStartSeconds(s));
                current.slow_start_seconds
            }
            None => RoutingSpec::default().slow_start_seconds,
        };
        let disaggregation = match &self.disaggregation {
            None => current.disaggregation,
            Some(d) => {
                let mode = match v1::DisaggregationMode::try_from(d.mode) {
                    Ok(v1::DisaggregationMode::Disabled) => Some(DisaggregationMode::Disabled),
                    Ok(v1::DisaggregationMode::Auto) => Some(DisaggregationMode::Auto),
                    _ => None,
                };
                match mode.filter(|_| d.min_uncached_tokens <= MAX_MIN_UNCACHED_TOKENS) {
                    Some(mode) => Disaggregation {
                        mode,
                        min_uncached_tokens: d.min_uncached_tokens,
                    },
                    None => {
                        unusable.push(Unusable::Disaggregation(d.mode, d.min_uncached_tokens));
                        current.disaggregation
                    }
                }
            }
        };
        let spec = RoutingSpec {
            policy,
            key,
            hash,
            offload_weight,
            tenancy,
            slow_start_seconds,
            disaggregation,
        };
        (spec, unusable)
    }

    /// The policy by name with its parameters, validated.
    fn policy_config(&self) -> Result<PolicyConfig, String> {
        let parameters = PolicyParameters {
            latency_slack: self.latency_slack,
            load_bound: Some(self.load_bound),
            prefill_tokens_per_second: self.prefill_tokens_per_second,
            prefill_overhead_ms: self.prefill_overhead_ms,
        };
        let config = PolicyConfig::with_parameters(&self.policy, &parameters)
            .ok_or_else(|| "not a policy this router knows".to_owned())?;
        config.validate()?;
        Ok(config)
    }

    /// The key mode; `None` when unspecified or unknown.
    fn core_key_mode(&self) -> Option<KeyMode> {
        match v1::KeyMode::try_from(self.key_mode) {
            Ok(v1::KeyMode::Conversation) => Some(KeyMode::Conversation),
            Ok(v1::KeyMode::Prefix) => Some(KeyMode::Prefix),
            Ok(v1::KeyMode::Tenant) => Some(KeyMode::Tenant),
            Ok(v1::KeyMode::Unspecified) | Err(_) => None,
        }
    }

    /// The hashing, with `current`'s extra-key form, checked as a hasher
    /// checks it.
    fn hash_config(&self, current: &HashConfig) -> Result<HashConfig, String> {
        let config = HashConfig {
            algo: hash_algo_from_i32(self.hash_algorithm).map_err(|e| e.to_string())?,
            block_size: self.block_size as usize,
            seed: self.hash_seed.clone(),
            extra_keys: current.extra_keys,
        };
        if &config != current {
            BlockHasher::new(config.clone()).map_err(|e| e.to_string())?;
        }
        Ok(config)
    }
}

impl From<KeyMode> for v1::KeyMode {
    fn from(mode: KeyMode) -> Self {
        match mode {
            KeyMode::Conversation => v1::KeyMode::Conversation,
            KeyMode::Prefix => v1::KeyMode::Prefix,
            KeyMode::Tenant => v1::KeyMode::Tenant,
        }
    }
}

impl From<TenancyMode> for v1::TenancyMode {
    fn from(mode: TenancyMode) -> Self {
        match mode {
            TenancyMode::Shared => v1::TenancyMode::Shared,
            TenancyMode::Salted => v1::TenancyMode::Salted,
        }
    }
}

#[cfg(test)]
mod tests;
