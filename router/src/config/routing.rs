//! `routing`: how requests are placed, and the model's files. Its routing
//! part (policy, key, hashing, offload weight) is the core's
//! [`RoutingSpec`] written out, with the spec's defaults; with
//! `tenancy.mode` it is read back into one by [`Config::routing_spec`], the
//! spec the router's settings are built from.
//!
//! Not here: the settings the request path uses ([`crate::settings`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvroute_core::hash::{HashAlgo, HashConfig};
use kvroute_core::keys::KeyConfig;
use kvroute_core::policy::PolicyConfig;
use kvroute_core::spec::{Disaggregation, RoutingSpec, TenancyMode};
use serde::{Deserialize, Deserializer, Serialize};

use super::{Config, Header};

/// The default `routing.conversationHeader`.
pub const DEFAULT_CONVERSATION_HEADER: &str = "x-conversation-id";

/// Routing settings. With the operator, its policy replaces these.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Routing {
    /// The policy and its parameters. Default: `{name: kvroute}`.
    pub policy: PolicyConfig,
    /// How routing keys are made. Default: conversation, K = 256.
    pub key: KeyConfig,
    /// Header carrying a conversation key, besides the body's
    /// `prompt_cache_key`. Default: `x-conversation-id`.
    pub conversation_header: Header,
    /// The engines' KV block size, tokens, 1 to 4096
    /// ([`kvroute_core::hash::MAX_BLOCK_SIZE`]: vLLM's block sizes are
    /// small, and a larger one is a typing mistake). Default: 16 (vLLM's).
    pub block_size: usize,
    /// The engines' `--prefix-caching-hash-algo`. Default: sha256.
    pub hash_algo: HashAlgo,
    /// The engines' `PYTHONHASHSEED`; unset by default.
    pub hash_seed: Option<String>,
    /// The model's Hugging Face `tokenizer.json` for exact mode; default:
    /// the built-in tokenizer (what kvroute-engine-sim uses).
    pub tokenizer: Option<PathBuf>,
    /// The model's `tokenizer_config.json` (its chat template); default:
    /// the built-in ChatML template.
    pub tokenizer_config: Option<PathBuf>,
    /// LoRA adapters by served name, with their path on the engines (vLLM's
    /// `--lora-modules name=path`); adapters the engines list in
    /// `/v1/models` need no entry. Each path is a YAML string: quote one
    /// that reads as a number or a boolean (`{a: "5"}`). Default: none.
    #[serde(deserialize_with = "lora_paths")]
    pub lora_adapters: BTreeMap<String, String>,
    /// What a block the engine keeps offloaded (vLLM KV offloading to CPU
    /// or disk) is worth in a cached prefix, as a share of a GPU block,
    /// 0 to 1. Default: 0.5.
    pub offload_weight: f32,
    /// Seconds over which an endpoint that became ready ramps up to its
    /// full share of new keys (slow start), 0 (off) to 3600. When it became
    /// ready: the static endpoints file's `readySince`, else when this
    /// router saw it turn ready (see `docs/routing.md`). Default: 30.
    pub slow_start_seconds: u32,
    /// Prefill/decode disaggregation (`docs/disaggregation.md`): `{mode:
    /// disabled|auto, minUncachedTokens}`. Default: `{mode: disabled,
    /// minUncachedTokens: 256}`.
    pub disaggregation: Disaggregation,
    /// Named prefixes kept warm on their owners (`docs/warmup.md`).
    /// Default: none.
    pub warmup: Option<super::Warmup>,
}

/// `routing.loraAdapters` as written: every path a YAML string. YAML would
/// read a plain `5` as the path "5" otherwise, which nothing downstream
/// catches: the adapter's blocks would hash apart from the engines'.
fn lora_paths<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    struct Path(String);
    impl<'de> Deserialize<'de> for Path {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Text;
            impl serde::de::Visitor<'_> for Text {
                type Value = Path;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("the adapter's path as a string (quote one that reads as a number)")
                }
                fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Path, E> {
                    Ok(Path(v.to_owned()))
                }
            }
            // `any`, not `str`: a YAML deserializer hands a plain `5` to
            // `deserialize_str` as text, and to `deserialize_any` as a number.
            d.deserialize_any(Text)
        }
    }
    let paths = BTreeMap::<String, Path>::deserialize(d)?;
    Ok(paths.into_iter().map(|(name, Path(p))| (name, p)).collect())
}

impl Default for Routing {
    /// [`RoutingSpec::default`]'s routing, the built-in tokenizer and
    /// template, no adapters.
    fn default() -> Self {
        let spec = RoutingSpec::default();
        Routing {
            policy: spec.policy,
            key: spec.key,
            conversation_header: Header::from_static(DEFAULT_CONVERSATION_HEADER),
            block_size: spec.hash.block_size,
            hash_algo: spec.hash.algo,
            hash_seed: spec.hash.seed,
            tokenizer: None,
            tokenizer_config: None,
            lora_adapters: BTreeMap::new(),
            offload_weight: spec.offload_weight,
            slow_start_seconds: spec.slow_start_seconds,
            disaggregation: spec.disaggregation,
            warmup: None,
        }
    }
}

impl Config {
    /// The routing spec this configuration says: `routing` with
    /// `tenancy.mode`, keys scoped by the tenant when tenancy is salted (so
    /// tenants never share keys).
    pub fn routing_spec(&self) -> RoutingSpec {
        let r = &self.routing;
        let salted = self.tenancy.mode == TenancyMode::Salted;
        RoutingSpec {
            policy: r.policy.clone(),
            key: KeyConfig {
                scope_by_tenant: r.key.scope_by_tenant || salted,
                ..r.key.clone()
            },
            hash: HashConfig {
                algo: r.hash_algo,
                block_size: r.block_size,
                seed: r.hash_seed.clone(),
                ..HashConfig::default()
            },
            offload_weight: r.offload_weight,
            tenancy: self.tenancy.mode,
            slow_start_seconds: r.slow_start_seconds,
            disaggregation: r.disaggregation,
        }
    }
}
