//! The Redis store: answers shared by every router of a pool.
//! (Being written: connects to nothing yet.)

use std::sync::Arc;

use super::StoreError;
use super::answer::Answer;
use super::key::Key;
use super::metrics::CacheMetrics;
use crate::config::{ConfigError, ResponseCache as Config};

/// The Redis store.
#[derive(Clone, Debug)]
pub struct RedisStore {
    metrics: Arc<CacheMetrics>,
}

impl RedisStore {
    /// A store for `config`'s `url`; connects lazily.
    pub fn new(_config: &Config, metrics: Arc<CacheMetrics>) -> Result<Self, ConfigError> {
        Ok(RedisStore { metrics })
    }

    /// The answer under `key`.
    pub async fn get(&self, _key: &Key) -> Result<Option<Answer>, StoreError> {
        let _ = &self.metrics;
        Err(StoreError::Failed("not connected".into()))
    }

    /// Stores `answer` under `key`.
    pub async fn put(&self, _key: &Key, _answer: &Answer) -> Result<(), StoreError> {
        Err(StoreError::Failed("not connected".into()))
    }

    /// Deletes every answer, or `model`'s.
    pub async fn purge(&self, _model: Option<&str>) -> Result<u64, StoreError> {
        Err(StoreError::Failed("not connected".into()))
    }
}
