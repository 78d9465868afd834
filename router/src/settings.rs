//! The routing settings: how a request becomes tokens, a block chain and a
//! routing key, and which policy ranks the endpoints. One value, owned by
//! the [`Pool`](crate::pool::Pool) and replaced there as a whole when
//! discovery changes it (the operator's policy can change the key mode, the
//! engines' hashing and the policy).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::HeaderName;
use kvroute_core::hash::{BlockHasher, Lora};
use kvroute_core::keys::KeyConfig;
use kvroute_core::policy::PolicyConfig;
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
    /// The pool's policy asks for salted tenancy (the router's own
    /// `tenancy` configuration salts; a router that does not refuses).
    pub salting_required: bool,
}

impl Settings {
    /// The built-in tokenizer and chat template, vLLM's default hashing and
    /// the default key, with `policy`.
    pub fn builtin(policy: PolicyConfig) -> Self {
        Settings {
            key: KeyConfig::default(),
            hasher: BlockHasher::new(kvroute_core::hash::HashConfig::default())
                .expect("the default hashing is valid"),
            tokenizer: Arc::new(Tokenizer::builtin()),
            template: Arc::new(ChatTemplate::builtin()),
            conversation_header: HeaderName::from_static(
                crate::config::DEFAULT_CONVERSATION_HEADER,
            ),
            policy,
            lora_adapters: BTreeMap::new(),
            offload_weight: kvroute_core::index::DEFAULT_OFFLOAD_WEIGHT,
            salting_required: false,
        }
    }

    /// [`builtin`](Self::builtin) with the default policy.
    #[cfg(test)]
    pub(crate) fn test() -> Self {
        Self::builtin(PolicyConfig::default())
    }
}
