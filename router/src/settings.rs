//! The routing settings: how a request becomes tokens, a block chain and a
//! routing key, and which policy ranks the endpoints. One value, owned by
//! the [`Pool`](crate::pool::Pool) and replaced there as a whole when
//! discovery changes it (the operator's policy can change the key mode, the
//! engines' hashing and the policy). Built from a
//! [`RoutingSpec`](kvroute_core::spec::RoutingSpec) in one place
//! ([`Settings::new`] and [`Settings::with_spec`] share it).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::HeaderName;
use kvroute_core::hash::{BlockHasher, HashError, Lora};
use kvroute_core::keys::KeyConfig;
use kvroute_core::policy::PolicyConfig;
use kvroute_core::spec::{Disaggregation, RoutingSpec, TenancyMode};
use kvroute_core::tokenize::{ChatTemplate, Tokenizer};

/// What the request path uses to turn a request into tokens, a block
/// chain and a routing key.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How keys are made.
    pub key: KeyConfig,
    /// The engines' block hashing.
    pub hasher: BlockHasher,
    /// The model's tokenizer (or the built-in one).
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template (or the built-in one).
    pub template: Arc<ChatTemplate>,
    /// Header carrying a conversation key.
    pub conversation_header: HeaderName,
    /// The policy.
    pub policy: PolicyConfig,
    /// LoRA adapters by served name (`routing.loraAdapters`); others are
    /// learned from the engines' `/v1/models`.
    pub lora_adapters: BTreeMap<String, Lora>,
    /// An offloaded block's worth against a GPU block, 0 to 1.
    pub offload_weight: f32,
    /// The slow-start window: a newly ready endpoint's share of new keys
    /// ramps up over it (`ZERO`: off).
    pub slow_start: std::time::Duration,
    /// The spec's tenancy is salted: the configuration's own (which salts)
    /// or the operator's policy's, which a router that does not salt
    /// answers by refusing requests.
    pub salting_required: bool,
    /// Prefill/decode disaggregation.
    pub disaggregation: Disaggregation,
}

impl Settings {
    /// The settings of `spec` with the router's own model files, header and
    /// adapters. `Err` when the spec's hashing is invalid.
    pub fn new(
        spec: &RoutingSpec,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        conversation_header: HeaderName,
        lora_adapters: BTreeMap<String, Lora>,
    ) -> Result<Self, HashError> {
        Settings {
            key: spec.key.clone(),
            hasher: BlockHasher::new(spec.hash.clone())?,
            tokenizer: Arc::new(tokenizer),
            template: Arc::new(template),
            conversation_header,
            policy: spec.policy.clone(),
            lora_adapters,
            offload_weight: spec.offload_weight,
            slow_start: std::time::Duration::ZERO,
            salting_required: false,
            disaggregation: spec.disaggregation,
        }
        .routing_by(spec)
    }

    /// These settings routing as `spec` says (the operator's policy
    /// replacing the configuration's); the model files, header and
    /// adapters stay. `Err` when the spec's hashing is invalid.
    pub fn with_spec(&self, spec: &RoutingSpec) -> Result<Self, HashError> {
        self.clone().routing_by(spec)
    }

    /// The one place a spec becomes settings. The hasher is kept when the
    /// hashing is unchanged.
    fn routing_by(mut self, spec: &RoutingSpec) -> Result<Self, HashError> {
        if self.hasher.config() != &spec.hash {
            self.hasher = BlockHasher::new(spec.hash.clone())?;
        }
        self.key = spec.key.clone();
        self.policy = spec.policy.clone();
        self.offload_weight = spec.offload_weight;
        self.slow_start = std::time::Duration::from_secs(spec.slow_start_seconds.into());
        self.salting_required = spec.tenancy == TenancyMode::Salted;
        self.disaggregation = spec.disaggregation;
        Ok(self)
    }

    /// The spec these settings route by.
    pub fn spec(&self) -> RoutingSpec {
        RoutingSpec {
            policy: self.policy.clone(),
            key: self.key.clone(),
            hash: self.hasher.config().clone(),
            offload_weight: self.offload_weight,
            tenancy: if self.salting_required {
                TenancyMode::Salted
            } else {
                TenancyMode::Shared
            },
            slow_start_seconds: self.slow_start.as_secs() as u32,
            disaggregation: self.disaggregation,
        }
    }

    /// The built-in tokenizer and chat template, and every default of
    /// [`RoutingSpec::default`] but `policy`.
    pub fn builtin(policy: PolicyConfig) -> Self {
        let spec = RoutingSpec {
            policy,
            ..RoutingSpec::default()
        };
        Settings::new(
            &spec,
            Tokenizer::builtin(),
            ChatTemplate::builtin(),
            HeaderName::from_static(crate::config::DEFAULT_CONVERSATION_HEADER),
            BTreeMap::new(),
        )
        .expect("the default hashing is valid")
    }

    /// [`builtin`](Self::builtin) with the default policy.
    #[cfg(test)]
    pub(crate) fn test() -> Self {
        Self::builtin(PolicyConfig::default())
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::hash::HashAlgo;

    use super::*;

    #[test]
    fn settings_route_as_their_spec_says() {
        let builtin = Settings::test();
        assert_eq!(builtin.spec(), RoutingSpec::default());
        let spec = RoutingSpec {
            policy: PolicyConfig::RoundRobin,
            tenancy: TenancyMode::Salted,
            offload_weight: 0.25,
            slow_start_seconds: 5,
            ..RoutingSpec::default()
        };
        let settings = builtin.with_spec(&spec).unwrap();
        assert_eq!(settings.spec(), spec);
        assert!(settings.salting_required);
        let mut bad = spec.clone();
        bad.hash.block_size = 0;
        assert!(builtin.with_spec(&bad).is_err());
        bad.hash.block_size = 32;
        bad.hash.algo = HashAlgo::XxhashCbor;
        assert_eq!(builtin.with_spec(&bad).unwrap().hasher.config(), &bad.hash);
    }
}
