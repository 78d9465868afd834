//! `PolicySpec`, the index's view of a `CacheRoutingPolicy`; the documented
//! defaults; validation; which policy attaches to a pool; and the effective
//! [`v1::RoutingPolicy`] routers receive.
//!
//! Attachment: a policy targets a pool of its own namespace by name. Of the
//! valid policies targeting one pool the oldest wins (equal creation times:
//! the lowest name); the others are conflicted. An invalid policy never
//! attaches and never conflicts. A pool with no policy gets the defaults.
//!
//! Not here: converting the `CacheRoutingPolicy` object (the watchers do
//! that), or writing its status ([`super::status`] computes it).

use kvroute_core::hash::{BlockHasher, HashAlgo, HashConfig};
use kvroute_core::keys::KeyMode;
use kvroute_core::load::PrefillModel;
use kvroute_core::policy::{KvrouteConfig, PolicyConfig};
use kvroute_proto::v1;

use super::observed::Observed;
use crate::api::CacheRoutingPolicyStatus;

// The defaults of a pool with no `CacheRoutingPolicy`: the core's.

/// The routing policy: the core's default, `kvroute`.
pub const DEFAULT_POLICY: &str = PolicyConfig::NAMES[0];
/// Key mode: [`kvroute_core::keys::DEFAULT_KEY_MODE`].
pub const DEFAULT_KEY_MODE: KeyMode = kvroute_core::keys::DEFAULT_KEY_MODE;
/// Prefix length of a routing key, in tokens:
/// [`kvroute_core::keys::DEFAULT_PREFIX_TOKENS`].
pub const DEFAULT_PREFIX_TOKENS: u32 = kvroute_core::keys::DEFAULT_PREFIX_TOKENS as u32;
/// Engine block size, in tokens: [`kvroute_core::hash::DEFAULT_BLOCK_SIZE`].
pub const DEFAULT_BLOCK_SIZE: u32 = kvroute_core::hash::DEFAULT_BLOCK_SIZE as u32;
/// Engine block hash: [`kvroute_core::hash::DEFAULT_HASH_ALGO`].
pub const DEFAULT_HASH_ALGORITHM: HashAlgo = kvroute_core::hash::DEFAULT_HASH_ALGO;

/// Whether tenants share cached blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TenancyMode {
    /// All tenants share the cache (the default).
    #[default]
    Shared,
    /// Routers salt each request's cache with its tenant; tenants never
    /// share blocks or routing keys.
    Salted,
}

impl From<TenancyMode> for v1::TenancyMode {
    fn from(mode: TenancyMode) -> Self {
        match mode {
            TenancyMode::Shared => v1::TenancyMode::Shared,
            TenancyMode::Salted => v1::TenancyMode::Salted,
        }
    }
}

/// What the index needs of a `CacheRoutingPolicy`. Every `None` means "the
/// default" (the `DEFAULT_*` constants; no hash seed, no cache port, shared
/// tenancy, no tenant header).
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
    /// The header carrying the authenticated tenant; not empty when set.
    pub tenant_header: Option<String>,
    /// The object as last watched, for the status writer.
    pub observed: Observed<CacheRoutingPolicyStatus>,
}

impl PolicySpec {
    /// The block hashing the policy tells routers to use; `None` when its
    /// block size is invalid.
    pub fn hasher(&self) -> Option<BlockHasher> {
        BlockHasher::new(HashConfig {
            algo: self.hash_algorithm.unwrap_or(DEFAULT_HASH_ALGORITHM),
            block_size: self.block_size.unwrap_or(DEFAULT_BLOCK_SIZE) as usize,
            seed: self.hash_seed.clone(),
            ..HashConfig::default()
        })
        .ok()
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
        let engine = PrefillModel {
            prefill_tokens_per_second: self
                .prefill_tokens_per_second
                .unwrap_or(PrefillModel::default().prefill_tokens_per_second),
            prefill_overhead_ms: self
                .prefill_overhead_ms
                .unwrap_or(PrefillModel::default().prefill_overhead_ms),
            ..PrefillModel::default()
        };
        let kvroute = KvrouteConfig {
            latency_slack: self
                .latency_slack
                .unwrap_or(KvrouteConfig::default().latency_slack),
            engine,
            ..KvrouteConfig::default()
        };
        kvroute.validate()?;
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
        Ok(())
    }

    /// The routing policy this spec asks for, with defaults filled in.
    pub fn routing_policy(&self) -> v1::RoutingPolicy {
        v1::RoutingPolicy {
            policy: self.policy.as_deref().unwrap_or(DEFAULT_POLICY).to_owned(),
            key_mode: key_mode(self.key_mode.unwrap_or(DEFAULT_KEY_MODE)).into(),
            prefix_tokens: self.prefix_tokens.unwrap_or(DEFAULT_PREFIX_TOKENS),
            load_bound: self.load_bound.unwrap_or(0.0),
            latency_slack: Some(
                self.latency_slack
                    .unwrap_or(KvrouteConfig::default().latency_slack),
            ),
            prefill_tokens_per_second: Some(
                self.prefill_tokens_per_second
                    .unwrap_or(PrefillModel::default().prefill_tokens_per_second),
            ),
            prefill_overhead_ms: Some(
                self.prefill_overhead_ms
                    .unwrap_or(PrefillModel::default().prefill_overhead_ms),
            ),
            offload_weight: Some(
                self.offload_weight
                    .unwrap_or(f64::from(kvroute_core::index::DEFAULT_OFFLOAD_WEIGHT)),
            ),
            block_size: self.block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
            hash_algorithm: v1::HashAlgorithm::from(
                self.hash_algorithm.unwrap_or(DEFAULT_HASH_ALGORITHM),
            )
            .into(),
            hash_seed: self.hash_seed.clone(),
            cache_port: self.cache_port.map_or(0, u32::from),
            tenancy: v1::TenancyMode::from(self.tenancy_mode.unwrap_or_default()).into(),
            tenant_header: self.tenant_header.clone().unwrap_or_default(),
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

fn key_mode(mode: KeyMode) -> v1::KeyMode {
    match mode {
        KeyMode::Conversation => v1::KeyMode::Conversation,
        KeyMode::Prefix => v1::KeyMode::Prefix,
        KeyMode::Tenant => v1::KeyMode::Tenant,
    }
}
