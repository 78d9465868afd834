//! The exact response cache: a deterministic request answered before gets
//! the stored answer without an engine call. On when `responseCache` is
//! configured; the HTTP front end only (the picker passes through).
//!
//! A request is classified ([`key`]); a cacheable one is looked up in the
//! store (embedded, [`embedded`], or Redis, [`redis`]); a miss joins the
//! identical requests in flight ([`coalesce`]) and goes to an engine, and
//! its answer is read as it streams ([`capture`]) and stored, in the
//! stored form ([`answer`]), before its last byte reaches the client
//! (embedded) or just after (Redis). The store failing or slow is a miss,
//! counted, never an error for the client.
//!
//! A hit is its own kind: not routed, so never counted as engine cached
//! tokens, in the expected-vs-observed gap or as missed tokens.
//!
//! Not here: the HTTP glue ([`crate::http`]).

pub mod answer;
mod breaker;
pub mod capture;
pub mod coalesce;
pub mod embedded;
pub mod key;
pub mod metrics;
pub mod redis;
pub mod semantic;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use self::answer::Answer;
use self::coalesce::Inflight;
use self::embedded::Embedded;
use self::key::{Key, Keying};
use self::metrics::CacheMetrics;
use crate::config::{Backend, ConfigError, ResponseCache as Config};
use crate::metrics::Why;
use crate::tenancy::Tenancy;

/// The header every answer carries while the cache is on.
pub const RESULT_HEADER: &str = "x-kvroute-response-cache";

/// A store failure: the request goes on uncached.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No answer within `responseCache.timeoutMs`.
    #[error("the response cache store did not answer within {0} ms")]
    Timeout(u64),
    /// Skipped: the circuit breaker is open.
    #[error("the response cache store is skipped while its circuit breaker is open")]
    BreakerOpen,
    /// The store answered with an error.
    #[error("the response cache store failed: {0}")]
    Failed(String),
}

impl StoreError {
    /// The `reason` label.
    pub fn reason(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::BreakerOpen => "breaker_open",
            StoreError::Failed(_) => "error",
        }
    }
}

/// Where answers are kept.
#[derive(Debug)]
pub enum Store {
    /// In this router's memory.
    Embedded(Embedded),
    /// In a Redis server the pool's routers share.
    Redis(redis::RedisStore),
}

/// The response cache. See the module doc.
#[derive(Debug)]
pub struct ResponseCache {
    /// The configuration.
    pub config: Config,
    keying: Keying,
    store: Store,
    /// Identical requests in flight.
    pub inflight: Arc<Inflight>,
    /// Its metrics (registered with the router's).
    pub metrics: Arc<CacheMetrics>,
    /// The semantic level, when on.
    pub semantic: Option<Arc<semantic::Semantic>>,
}

impl ResponseCache {
    /// The cache `config` describes, keyed with `responseCache.secretFile`,
    /// else `tenancy`'s secret, counting into `metrics`.
    pub fn new(
        config: &Config,
        tenancy: &Tenancy,
        limits: &crate::config::Limits,
        metrics: Arc<CacheMetrics>,
    ) -> Result<Self, ConfigError> {
        let secret = match &config.secret_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::file("responseCache.secretFile", path, e))?;
                let secret = text.trim_end().as_bytes().to_vec();
                if secret.is_empty() {
                    return Err(ConfigError::Invalid {
                        field: "responseCache.secretFile",
                        value: path.display().to_string(),
                        reason: "the key material must not be empty",
                    });
                }
                secret
            }
            None => tenancy.secret().to_vec(),
        };
        let ttl = Duration::from_secs(config.ttl_s);
        let store = match config.backend {
            Backend::Embedded => Store::Embedded(Embedded::new(
                config.max_bytes,
                ttl,
                metrics.evictions.clone(),
            )),
            Backend::Redis => Store::Redis(redis::RedisStore::new(config, metrics.clone())?),
        };
        let semantic = (config.semantic.as_ref())
            .map(|s| semantic::Semantic::new(s, limits, metrics.clone()).map(Arc::new))
            .transpose()?;
        Ok(ResponseCache {
            semantic,
            keying: Keying {
                secret,
                version: config.version.clone(),
                semantic: config.semantic.is_some(),
                credentials: false,
            },
            config: config.clone(),
            store,
            inflight: Arc::default(),
            metrics,
        })
    }

    /// Starts what the store needs before the first request: a Redis
    /// connection (see [`redis::RedisStore::connect_soon`]).
    pub fn start(&self) {
        if let Store::Redis(r) = &self.store {
            r.connect_soon();
        }
    }

    /// Keys answers on the `Authorization` header too: it is forwarded to
    /// the engines (`proxy.forwardAuthorization`), whose own
    /// authentication then decides what they answer.
    pub fn keyed_on_credentials(mut self, forwarded: bool) -> Self {
        self.keying.credentials = forwarded;
        self
    }

    /// What the key is computed with.
    pub fn keying(&self) -> &Keying {
        &self.keying
    }

    /// The answer stored under `key`; a store failure is counted and is
    /// `Err`.
    pub async fn get(&self, key: &Key) -> Result<Option<Arc<Answer>>, StoreError> {
        let got = match &self.store {
            Store::Embedded(e) => Ok(e.get(key)),
            Store::Redis(r) => r.get(key).await.map(|a| a.map(Arc::new)),
        };
        if let Err(e) = &got {
            self.count_error(e);
        }
        got
    }

    /// Stores `answer` under `key`: at once when embedded; with Redis, in
    /// a task (bounded by the timeout), so the client never waits for it.
    pub fn put(&self, key: Key, answer: Arc<Answer>) {
        let stored = Why { reason: "stored" };
        match &self.store {
            Store::Embedded(e) => {
                e.put(&key, answer);
                self.metrics.stores.get_or_create(&stored).inc();
            }
            Store::Redis(r) => {
                let (r, metrics) = (r.clone(), self.metrics.clone());
                tokio::spawn(async move {
                    match r.put(&key, &answer).await {
                        Ok(()) => {
                            metrics.stores.get_or_create(&stored).inc();
                        }
                        Err(e) => {
                            metrics.stores.get_or_create(&Why { reason: "error" }).inc();
                            count_error(&metrics, &e);
                        }
                    }
                });
            }
        }
    }

    /// Drops every stored answer, or those of `model`; returns how many.
    pub async fn purge(&self, model: Option<&str>) -> Result<u64, StoreError> {
        let n = match &self.store {
            Store::Embedded(e) => e.purge(model),
            Store::Redis(r) => r.purge(model).await?,
        };
        self.metrics.purged.inc_by(n);
        Ok(n)
    }

    /// Sets the bytes gauge (at scrape time).
    pub fn refresh_gauges(&self) {
        if let Store::Embedded(e) = &self.store {
            self.metrics.bytes.set(e.bytes() as i64);
        }
        if let Some(s) = &self.semantic {
            s.refresh_gauges();
        }
    }

    fn count_error(&self, e: &StoreError) {
        count_error(&self.metrics, e);
    }
}

fn count_error(metrics: &CacheMetrics, e: &StoreError) {
    metrics
        .store_errors
        .get_or_create(&Why { reason: e.reason() })
        .inc();
}

/// Now, Unix milliseconds.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderMap;
    use proptest::prelude::*;

    use super::key::{Classified, classify};
    use super::*;

    proptest! {
        /// Whatever tenants send, in any order, each gets only answers
        /// stored for its own requests: never another tenant's.
        #[test]
        fn no_tenant_is_served_another_tenants_answer(
            asks in proptest::collection::vec(
                (proptest::option::of(0..4u8), 0..6u8, proptest::option::of("[a-z]{0,3}")),
                1..40,
            ),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let tenancy = Tenancy::load(&crate::config::Tenancy::default()).unwrap();
            let limits = crate::config::Limits::default();
            let cache = ResponseCache::new(&Config::default(), &tenancy, &limits, Arc::default()).unwrap();
            for (tenant, body, key_header) in asks {
                let tenant = tenant.map(|t| format!("tenant-{t}"));
                let mut headers = HeaderMap::new();
                if let Some(k) = key_header {
                    headers.insert("authorization", format!("Bearer {k}").parse().unwrap());
                }
                let body = format!(r#"{{"model":"m","temperature":0,"prompt":"q{body}"}}"#);
                let Classified::Cacheable(c) = classify(cache.keying(), "/v1/completions", &headers, tenant.as_deref(), body.as_bytes(), |_| Vec::new()) else {
                    panic!("cacheable")
                };
                let owner = format!("{tenant:?} {body}");
                match runtime.block_on(cache.get(&c.key)).unwrap() {
                    Some(found) => prop_assert_eq!(&found.content, &owner),
                    None => cache.put(c.key, Arc::new(Answer { content: owner, ..Answer::default() })),
                }
            }
        }
    }
}
