//! The routing settings a request needs, swappable at run time (the
//! operator's policy can change the key mode or the engines' hashing).

use std::sync::{Arc, RwLock};

use axum::http::HeaderName;
use kvroute_core::hash::BlockHasher;
use kvroute_core::keys::KeyConfig;
use kvroute_core::tokenize::{ChatTemplate, Tokenizer};

/// What the request path uses to turn a request into tokens, a block
/// chain and a routing key.
#[derive(Debug)]
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
}

#[cfg(test)]
impl Settings {
    /// The defaults: built-in tokenizer and template, vLLM's hashing.
    pub(crate) fn test() -> Self {
        Settings {
            key: KeyConfig::default(),
            hasher: BlockHasher::new(kvroute_core::hash::HashConfig::default())
                .expect("the default hashing is valid"),
            tokenizer: Arc::new(Tokenizer::builtin()),
            template: Arc::new(ChatTemplate::builtin()),
            conversation_header: HeaderName::from_static("x-conversation-id"),
        }
    }
}

/// Settings shared by every request, replaced as a whole.
#[derive(Debug)]
pub struct SharedSettings(RwLock<Arc<Settings>>);

impl SharedSettings {
    /// Wraps `settings`.
    pub fn new(settings: Settings) -> Self {
        SharedSettings(RwLock::new(Arc::new(settings)))
    }

    /// The current settings.
    pub fn get(&self) -> Arc<Settings> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the settings with `f(current)`.
    pub fn update(&self, f: impl FnOnce(&Settings) -> Settings) {
        let mut guard = self.0.write().unwrap_or_else(|e| e.into_inner());
        *guard = Arc::new(f(&guard));
    }
}
