//! The routing spec: what a routing policy says about one pool, as one
//! value with one documented default. Every representation of a policy
//! derives from [`RoutingSpec`]:
//!
//! 1. The router's YAML (`routing` and `tenancy.mode`) takes its defaults
//!    from [`RoutingSpec::default`] and is read into a spec, from which the
//!    router builds its settings.
//! 2. The `CacheRoutingPolicy` CRD's schema defaults are the spec's
//!    defaults, in the CRD's spelling (`Shared` where the YAML says
//!    `shared`: the same [`TenancyMode`], spelled by serde attributes).
//! 3. The operator's index fills what a policy leaves out from the spec's
//!    defaults.
//! 4. The wire's `RoutingPolicy` converts to and from a spec by one pair of
//!    conversions (`kvroute-proto`).
//!
//! Not here: what only one component has, such as the router's tokenizer,
//! conversation header and LoRA adapters, or the operator's target pool,
//! cache port and tenant header.

use serde::{Deserialize, Serialize};

use crate::hash::HashConfig;
use crate::keys::KeyConfig;
use crate::policy::PolicyConfig;

/// What a routing policy says: the policy and its parameters, how routing
/// keys are made, how the engines hash their blocks, what an offloaded
/// block is worth and whether tenants share caches.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingSpec {
    /// The policy and its parameters. Default: `kvroute` with its defaults
    /// ([`PolicyConfig::default`]).
    pub policy: PolicyConfig,
    /// How routing keys are made. Default: the conversation key, else a
    /// prefix of 256 tokens ([`KeyConfig::default`]). `scope_by_tenant`
    /// is the router's own (set when its tenancy is salted); the operator
    /// does not send it.
    pub key: KeyConfig,
    /// How the engines hash their blocks. Default: vLLM's, `sha256` over
    /// blocks of 16 tokens with no `PYTHONHASHSEED`
    /// ([`HashConfig::default`]). The extra-key form is the router's own;
    /// the operator does not send it.
    pub hash: HashConfig,
    /// What a block an engine keeps offloaded is worth in a cached prefix,
    /// as a share of a GPU block, 0 to 1. Default: 0.5
    /// ([`crate::index::DEFAULT_OFFLOAD_WEIGHT`]).
    pub offload_weight: f32,
    /// Whether tenants share cached blocks. Default: shared.
    pub tenancy: TenancyMode,
    /// Seconds over which an endpoint that became ready ramps up to its
    /// full share of new keys ([`crate::slow_start`]); 0: off, at most
    /// [`crate::slow_start::MAX_WINDOW_SECONDS`]. Default: 30.
    pub slow_start_seconds: u32,
    /// Prefill/decode disaggregation. Default: off.
    pub disaggregation: Disaggregation,
}

/// Prefill/decode disaggregation: whether a request is prefilled on a
/// prefill-capable endpoint and decoded on another, which reads its KV
/// blocks (vLLM's `kv_transfer_params`). Serde spells it as the router's
/// YAML does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Disaggregation {
    /// `disabled` (the default: prefill endpoints take no requests) or
    /// `auto`.
    pub mode: DisaggregationMode,
    /// With `auto`, a request is disaggregated when it would prefill at
    /// least this many uncached tokens on its decode endpoint. Default:
    /// 256.
    pub min_uncached_tokens: u64,
}

impl Default for Disaggregation {
    fn default() -> Self {
        Disaggregation {
            mode: DisaggregationMode::Disabled,
            min_uncached_tokens: 256,
        }
    }
}

/// Whether requests are disaggregated. Not `off`/`on`: YAML 1.1, which
/// kubectl and Helm read, takes those for booleans.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DisaggregationMode {
    /// Never: every request runs whole on a decode-capable endpoint.
    #[default]
    Disabled,
    /// When the uncached prefill reaches `minUncachedTokens`.
    Auto,
}

impl DisaggregationMode {
    /// Every mode, in the order they are listed to users.
    pub const ALL: [DisaggregationMode; 2] =
        [DisaggregationMode::Disabled, DisaggregationMode::Auto];

    /// The mode's name, as the router's YAML spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            DisaggregationMode::Disabled => "disabled",
            DisaggregationMode::Auto => "auto",
        }
    }
}

/// The most `minUncachedTokens` may be (longer than any model's context).
pub const MAX_MIN_UNCACHED_TOKENS: u64 = 10_000_000;

impl Default for RoutingSpec {
    /// Every default of a pool with no policy of its own: see each field.
    fn default() -> Self {
        RoutingSpec {
            policy: PolicyConfig::default(),
            key: KeyConfig::default(),
            hash: HashConfig::default(),
            offload_weight: crate::index::DEFAULT_OFFLOAD_WEIGHT,
            tenancy: TenancyMode::default(),
            slow_start_seconds: crate::slow_start::DEFAULT_WINDOW.as_secs() as u32,
            disaggregation: Disaggregation::default(),
        }
    }
}

/// Whether tenants share the engines' caches. Serde spells it as the
/// router's YAML does (`shared`, `salted`); other formats choose their own
/// spelling of [`TenancyMode::as_str`] with serde attributes where they use
/// it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenancyMode {
    /// One cache for all: equal prompts hit the same blocks and get the
    /// same routing keys whoever sends them (the default).
    #[default]
    Shared,
    /// Each tenant's blocks are salted apart (vLLM's `cache_salt`) and its
    /// routing keys scoped by the tenant: no sharing, no timing side
    /// channel.
    Salted,
}

impl TenancyMode {
    /// Every mode, in the order they are listed to users.
    pub const ALL: [TenancyMode; 2] = [TenancyMode::Shared, TenancyMode::Salted];

    /// The mode's name, as the router's YAML spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TenancyMode::Shared => "shared",
            TenancyMode::Salted => "salted",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let spec = RoutingSpec::default();
        assert_eq!(spec.policy.name(), "kvroute");
        assert_eq!(spec.policy.parameters().latency_slack, Some(1.0));
        assert_eq!(spec.key.mode, crate::keys::KeyMode::Conversation);
        assert_eq!(spec.key.prefix_tokens, 256);
        assert!(!spec.key.scope_by_tenant);
        assert_eq!(spec.hash.algo, crate::hash::HashAlgo::Sha256);
        assert_eq!(spec.hash.block_size, 16);
        assert_eq!(spec.hash.seed, None);
        assert_eq!(spec.offload_weight, 0.5);
        assert_eq!(spec.tenancy, TenancyMode::Shared);
        assert_eq!(spec.slow_start_seconds, 30);
        assert_eq!(spec.disaggregation.mode, DisaggregationMode::Disabled);
        assert_eq!(DisaggregationMode::Disabled.as_str(), "disabled");
        assert_eq!(spec.disaggregation.min_uncached_tokens, 256);
    }

    #[test]
    fn serde_spells_tenancy_modes_by_their_names() {
        for mode in TenancyMode::ALL {
            let json = serde_json::to_value(mode).unwrap();
            assert_eq!(json, serde_json::json!(mode.as_str()));
            assert_eq!(serde_json::from_value::<TenancyMode>(json).unwrap(), mode);
        }
    }
}
