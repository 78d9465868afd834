//! `PolicySpec`, the index's view of a `CacheRoutingPolicy`; validation;
//! which policy attaches to a pool; and the effective [`RoutingSpec`] and
//! [`v1::RoutingPolicy`] routers receive.
//!
//! Defaults: what a policy leaves out is the core's
//! ([`RoutingSpec::default`]), filled in by [`PolicySpec::routing_spec`]
//! alone; a pool with no policy gets every one of them.
//!
//! Attachment: a policy targets a pool of its own namespace by name. Of the
//! valid policies targeting one pool the oldest wins (equal creation times:
//! the lowest name); the others are conflicted. An invalid policy never
//! attaches and never conflicts. A pool with no policy gets the defaults.
//!
//! Not here: converting the `CacheRoutingPolicy` object (the watchers do
//! that), or writing its status ([`super::status`] computes it).

use kvroute_core::hash::{BlockHasher, HashAlgo, HashConfig};
use kvroute_core::keys::{KeyConfig, KeyMode};
use kvroute_core::policy::{PolicyConfig, PolicyParameters};
use kvroute_core::spec::{Disaggregation, RoutingSpec, TenancyMode};
use kvroute_core::warmup::Warmup;
use kvroute_proto::v1;

use super::observed::Observed;
use crate::api::CacheRoutingPolicyStatus;

/// What the index needs of a `CacheRoutingPolicy`. Every `None` means "the
/// default" ([`RoutingSpec::default`]'s; no hash seed, no cache port, no
/// tenant header).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicySpec {
    /// The policy's namespace; it can target pools of this namespace only.
    pub namespace: String,
    /// The policy's name; breaks ties between policies created in the same
    /// second.
    pub name: String,
    /// `metadata.creationTimestamp` as Unix seconds: the oldest policy
    /// targeting a pool wins.
    pub created: i64,
    /// `metadata.generation`, reported back as `observedGeneration`.
    pub generation: i64,
    /// `spec.targetRef.name`: the `InferencePool` in the same namespace.
    pub target_pool: String,
    /// The routing policy's name, one of [`PolicyConfig::NAMES`].
    pub policy: Option<String>,
    /// What routing keys are derived from.
    pub key_mode: Option<KeyMode>,
    /// How many leading prompt tokens a prefix key covers; at least 1.
    pub prefix_tokens: Option<u32>,
    /// ε of the rendezvous-bounded policy's in-flight bound; finite and at
    /// least 0. `None`: the policy's own default.
    pub load_bound: Option<f64>,
    /// The kvroute policy's latency slack; at least 0.
    pub latency_slack: Option<f64>,
    /// An offloaded block's worth against a GPU block; 0 to 1.
    pub offload_weight: Option<f64>,
    /// The engines' prefill rate, tokens per second; positive.
    pub prefill_tokens_per_second: Option<f64>,
    /// The engines' fixed cost per prefill, milliseconds; at least 0.
    pub prefill_overhead_ms: Option<f64>,
    /// The engines' block size in tokens; at least 1.
    pub block_size: Option<u32>,
    /// The engines' block hash algorithm.
    pub hash_algorithm: Option<HashAlgo>,
    /// The engines' `PYTHONHASHSEED`; `None` when they run without one.
    pub hash_seed: Option<String>,
    /// The engines' WatchCache port; `None` when they report no cache
    /// (routers then estimate cache contents).
    pub cache_port: Option<u16>,
    /// Whether tenants share cached blocks.
    pub tenancy_mode: Option<TenancyMode>,
    /// The slow-start window, seconds; at most
    /// [`kvroute_core::slow_start::MAX_WINDOW_SECONDS`].
    pub slow_start_seconds: Option<u32>,
    /// Prefill/decode disaggregation.
    pub disaggregation: Option<Disaggregation>,
    /// Named prefixes kept warm, references unresolved.
    pub warmup: Option<Warmup>,
    /// The header carrying the authenticated tenant; not empty when set.
    pub tenant_header: Option<String>,
    /// The object as last watched, for the status writer.
    pub observed: Observed<CacheRoutingPolicyStatus>,
}

impl PolicySpec {
    /// The block hashing the policy tells routers to use; `None` when its
    /// block size is invalid.
    pub fn hasher(&self) -> Option<BlockHasher> {
        BlockHasher::new(self.hash_config(&RoutingSpec::default().hash)).ok()
    }

    /// The hashing the policy sets, `default`'s where it sets none.
    fn hash_config(&self, default: &HashConfig) -> HashConfig {
        HashConfig {
            algo: self.hash_algorithm.unwrap_or(default.algo),
            block_size: self
                .block_size
                .map_or(default.block_size, |size| size as usize),
            seed: self.hash_seed.clone(),
            ..default.clone()
        }
    }

    /// The policy parameters the policy sets.
    fn parameters(&self) -> PolicyParameters {
        PolicyParameters {
            latency_slack: self.latency_slack,
            load_bound: self.load_bound,
            prefill_tokens_per_second: self.prefill_tokens_per_second,
            prefill_overhead_ms: self.prefill_overhead_ms,
        }
    }

    /// Why the policy cannot take effect, naming the field and its value.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(name) = &self.policy
            && !PolicyConfig::NAMES.contains(&name.as_str())
        {
            return Err(format!(
                "policy {name:?} is not one of {}",
                PolicyConfig::NAMES.join(", ")
            ));
        }
        if self.prefix_tokens == Some(0) {
            return Err("prefix tokens 0: must be at least 1".to_owned());
        }
        if let Some(bound) = self.load_bound
            && !(bound.is_finite() && bound >= 0.0)
        {
            return Err(format!(
                "load bound {bound}: must be a number of at least 0"
            ));
        }
        // The slack and the prefill model are checked whatever the policy,
        // as the kvroute policy would take them.
        PolicyConfig::with_parameters("kvroute", &self.parameters())
            .expect("kvroute is a policy")
            .validate()?;
        if let Some(size) = self.block_size
            && !(1..=kvroute_core::hash::MAX_BLOCK_SIZE).contains(&(size as usize))
        {
            // The CRD's schema says so too, but not every API server
            // enforces it (and `convert` maps a negative size to 0).
            return Err(format!("block size {size}: must be 1 to 4096"));
        }
        if let Some(w) = self.offload_weight
            && !(0.0..=1.0).contains(&w)
        {
            return Err(format!("offload weight {w}: must be within 0 to 1"));
        }
        if self.cache_port == Some(0) {
            return Err("cache port 0: must be 1 to 65535 (omit it for no cache)".to_owned());
        }
        if self.tenant_header.as_deref() == Some("") {
            return Err("tenant header \"\": must not be empty (omit it for none)".to_owned());
        }
        if let Some(s) = self.slow_start_seconds
            && s > kvroute_core::slow_start::MAX_WINDOW_SECONDS
        {
            return Err(format!("slow start seconds {s}: must be 0 to 3600"));
        }
        if let Some(d) = self.disaggregation
            && d.min_uncached_tokens > kvroute_core::spec::MAX_MIN_UNCACHED_TOKENS
        {
            return Err(format!(
                "disaggregation min uncached tokens {}: must be 0 to 10000000",
                d.min_uncached_tokens
            ));
        }
        if let Some(w) = &self.warmup {
            let salted = self.tenancy_mode == Some(TenancyMode::Salted);
            w.validate(salted, true)
                .map_err(|e| format!("spec.warmup.{} {}: {}", e.field, e.value, e.reason))?;
        }
        Ok(())
    }

    /// What this policy says, with the core's defaults where it says
    /// nothing: the one place they are filled in.
    pub fn routing_spec(&self) -> RoutingSpec {
        let default = RoutingSpec::default();
        let name = self.policy.as_deref().unwrap_or(default.policy.name());
        RoutingSpec {
            policy: PolicyConfig::with_parameters(name, &self.parameters())
                .unwrap_or_else(|| default.policy.clone()),
            key: KeyConfig {
                mode: self.key_mode.unwrap_or(default.key.mode),
                prefix_tokens: self
                    .prefix_tokens
                    .map_or(default.key.prefix_tokens, |t| t as usize),
                ..default.key.clone()
            },
            hash: self.hash_config(&default.hash),
            offload_weight: self
                .offload_weight
                .map_or(default.offload_weight, |w| w as f32),
            tenancy: self.tenancy_mode.unwrap_or(default.tenancy),
            slow_start_seconds: self
                .slow_start_seconds
                .unwrap_or(default.slow_start_seconds),
            disaggregation: self.disaggregation.unwrap_or(default.disaggregation),
        }
    }

    /// The routing policy routers receive: [`Self::routing_spec`] on the
    /// wire, with the cache port and the tenant header.
    pub fn routing_policy(&self) -> v1::RoutingPolicy {
        v1::RoutingPolicy {
            cache_port: self.cache_port.map_or(0, u32::from),
            tenant_header: self.tenant_header.clone().unwrap_or_default(),
            ..v1::RoutingPolicy::from(&self.routing_spec())
        }
    }

    /// Whether this policy would win a pool over `other` (it is older, or as
    /// old with a lower name).
    fn precedes(&self, other: &PolicySpec) -> bool {
        (self.created, &self.name) < (other.created, &other.name)
    }
}

/// The routing policy of a pool with no `CacheRoutingPolicy`: every default.
pub fn default_policy() -> v1::RoutingPolicy {
    PolicySpec::default().routing_policy()
}

/// The policy attached to pool `pool` among `policies` (of the pool's
/// namespace): the oldest valid one targeting it, ties broken by name.
pub(super) fn attached<'a>(
    policies: impl IntoIterator<Item = &'a PolicySpec>,
    pool: &str,
) -> Option<&'a PolicySpec> {
    policies
        .into_iter()
        .filter(|p| p.target_pool == pool && p.validate().is_ok())
        .reduce(|best, p| if p.precedes(best) { p } else { best })
}
