//! `responseCache`: the exact response cache (absent: off).
//!
//! Owned by the router's YAML alone, never a custom resource: the Redis
//! password and the key material stay in mounted files.
//!
//! Not here: what is cacheable, the key and the stores
//! ([`crate::response_cache`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::validate::invalid;
use super::{ConfigError, MAX_DURATION_MS};

/// Where answers are kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this router's memory (the default): nothing else to run.
    #[default]
    Embedded,
    /// A Redis server shared by every router of the pool.
    Redis,
}

/// The exact response cache. `responseCache: {backend: embedded}` alone is
/// a complete configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ResponseCache {
    /// `embedded` or `redis`. Default: embedded.
    pub backend: Backend,
    /// The Redis server, `redis://host:port[/db]` or `rediss://` (TLS,
    /// verified against the system's roots). Required with `backend:
    /// redis`, refused otherwise.
    pub url: Option<String>,
    /// A file holding the Redis password (a mounted Secret); its trailing
    /// newline is ignored. Default: none, or the URL's.
    pub password_file: Option<PathBuf>,
    /// How long an answer is served, seconds. Default: 3600.
    pub ttl_s: u64,
    /// The embedded store's size bound, bytes of stored answers (keys and
    /// bookkeeping included). Default: 256 MiB.
    pub max_bytes: u64,
    /// The largest answer stored, bytes; larger ones are served but not
    /// stored. Default: 1 MiB.
    pub max_entry_bytes: usize,
    /// Part of every key: bump it to drop every answer at once, e.g. on a
    /// model rollout that keeps the model's name. Default: empty.
    pub version: String,
    /// A file holding the key material entries are keyed with
    /// (HMAC-SHA256). Default: `tenancy.secretFile`, else plain SHA-256.
    /// Routers sharing a Redis store must share it.
    pub secret_file: Option<PathBuf>,
    /// The longest a request waits on Redis for one lookup or store,
    /// milliseconds; past it the request goes on uncached. Default: 50.
    pub timeout_ms: u64,
    /// How long identical requests wait for the first one's answer
    /// before going to an engine themselves, milliseconds; 0: no
    /// coalescing. Default: 30000.
    pub coalesce_wait_ms: u64,
    /// Send the standard `Age` header on a hit. In shared tenancy without
    /// API keys it tells a client when someone else sent the same request.
    /// Default: true.
    pub age_header: bool,
    /// The prefix of every Redis key. Default: `kvroute:response:`.
    pub key_prefix: String,
    /// The semantic level (experimental): a paraphrase of an earlier
    /// question answered with its answer. Unset: off.
    pub semantic: Option<Semantic>,
}

/// The semantic level of the response cache (experimental, opt-in).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Semantic {
    /// The OpenAI-compatible server questions are embedded with.
    pub embeddings: Embeddings,
    /// The least cosine similarity between two questions for one's answer
    /// to serve the other, 0 to 1. Default: [`DEFAULT_THRESHOLD`].
    #[serde(default = "default_threshold")]
    pub threshold: f32,
    /// Questions remembered, over every tenant and model. Default:
    /// 10,000.
    #[serde(default = "default_max_entries")]
    pub max_entries: usize,
    /// The index's size bound, bytes, dead entries waiting in its graphs
    /// included: an entry costs 4 bytes a dimension and about 500 more
    /// (about 1.5 KiB at 256 dimensions, 65 KiB at 16,384), so the oldest
    /// are evicted past either bound. Default: 64 MiB.
    #[serde(default = "default_semantic_max_bytes")]
    pub max_bytes: u64,
    /// How often the embedder is checked, seconds: a few unrelated probe
    /// texts must embed to vectors of one dimension that are not similar
    /// (below `threshold`). The check also runs at start; while it fails
    /// the level is off (plain misses), and a change of dimension (of
    /// embedding model) empties the index. Default: 60.
    #[serde(default = "default_check_interval_s")]
    pub check_interval_s: u64,
}

/// An OpenAI-compatible embeddings server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Embeddings {
    /// Its base URL, `http://host:port`; the router calls
    /// `{url}/v1/embeddings`. Required.
    pub url: String,
    /// The embedding model to ask for. Required.
    pub model: String,
    /// A file holding its API key, sent as `Authorization: Bearer`.
    /// Default: none.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// The longest a request waits for an embedding, milliseconds; past
    /// it the request is a plain miss. Default: 200.
    #[serde(default = "default_embeddings_timeout_ms")]
    pub timeout_ms: u64,
}

/// `semantic.threshold`'s default, measured with engine-sim's test double
/// (docs/response-cache.md): only as good as that measurement.
pub const DEFAULT_THRESHOLD: f32 = 0.99;

fn default_threshold() -> f32 {
    DEFAULT_THRESHOLD
}

fn default_max_entries() -> usize {
    10_000
}

fn default_semantic_max_bytes() -> u64 {
    64 << 20
}

fn default_check_interval_s() -> u64 {
    60
}

fn default_embeddings_timeout_ms() -> u64 {
    200
}

/// The most `semantic.maxEntries` may be: a unit slip beyond it.
pub const MAX_SEMANTIC_ENTRIES: usize = 10_000_000;

impl Default for ResponseCache {
    fn default() -> Self {
        ResponseCache {
            backend: Backend::Embedded,
            url: None,
            password_file: None,
            ttl_s: 3600,
            max_bytes: 256 << 20,
            max_entry_bytes: 1 << 20,
            version: String::new(),
            secret_file: None,
            timeout_ms: 50,
            coalesce_wait_ms: 30_000,
            age_header: true,
            key_prefix: "kvroute:response:".into(),
            semantic: None,
        }
    }
}

impl ResponseCache {
    /// Checks the section, naming the field and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match (self.backend, &self.url) {
            (Backend::Redis, None) => {
                return Err(invalid(
                    "responseCache.url",
                    &"",
                    "is required with backend: redis",
                ));
            }
            (Backend::Redis, Some(url))
                if !(url.starts_with("redis://") || url.starts_with("rediss://"))
                    || url
                        .split_once("://")
                        .is_none_or(|(_, rest)| rest.is_empty()) =>
            {
                return Err(invalid(
                    "responseCache.url",
                    url,
                    "must be redis://host:port or rediss://host:port",
                ));
            }
            (Backend::Embedded, Some(url)) => {
                return Err(invalid(
                    "responseCache.url",
                    url,
                    "is only for backend: redis",
                ));
            }
            _ => {}
        }
        if !(1..=MAX_DURATION_MS / 1000 * 365).contains(&self.ttl_s) {
            return Err(invalid(
                "responseCache.ttlS",
                &self.ttl_s,
                "must be 1 to 31536000 (a year)",
            ));
        }
        if !(1..=MAX_DURATION_MS).contains(&self.timeout_ms) {
            return Err(invalid(
                "responseCache.timeoutMs",
                &self.timeout_ms,
                "must be 1 to 86400000 (one day)",
            ));
        }
        if self.coalesce_wait_ms > MAX_DURATION_MS {
            return Err(invalid(
                "responseCache.coalesceWaitMs",
                &self.coalesce_wait_ms,
                "must be at most one day",
            ));
        }
        if self.max_entry_bytes == 0 || self.max_entry_bytes as u64 > self.max_bytes {
            return Err(invalid(
                "responseCache.maxEntryBytes",
                &self.max_entry_bytes,
                "must be at least 1 and at most maxBytes",
            ));
        }
        if let Some(semantic) = &self.semantic {
            semantic.validate()?;
        }
        if self.backend == Backend::Redis && self.key_prefix.is_empty() {
            return Err(invalid(
                "responseCache.keyPrefix",
                &"",
                "must not be empty: a purge deletes the keys under it",
            ));
        }
        Ok(())
    }
}

impl Semantic {
    /// Checks the section, naming the field and the value.
    fn validate(&self) -> Result<(), ConfigError> {
        let e = &self.embeddings;
        if !e.url.starts_with("http://") || kvroute_telemetry::check_http_url(&e.url).is_err() {
            return Err(invalid(
                "responseCache.semantic.embeddings.url",
                &format!("{:?}", e.url),
                "must be http://host:port (https is not supported yet)",
            ));
        }
        if e.model.is_empty() {
            return Err(invalid(
                "responseCache.semantic.embeddings.model",
                &"",
                "must name the embedding model",
            ));
        }
        if !(1..=MAX_DURATION_MS).contains(&e.timeout_ms) {
            return Err(invalid(
                "responseCache.semantic.embeddings.timeoutMs",
                &e.timeout_ms,
                "must be 1 to 86400000 (one day)",
            ));
        }
        if !(self.threshold > 0.0 && self.threshold <= 1.0) {
            return Err(invalid(
                "responseCache.semantic.threshold",
                &self.threshold,
                "must be above 0 and at most 1",
            ));
        }
        if !(1..=MAX_SEMANTIC_ENTRIES).contains(&self.max_entries) {
            return Err(invalid(
                "responseCache.semantic.maxEntries",
                &self.max_entries,
                "must be 1 to 10000000",
            ));
        }
        if !(1 << 20..=1 << 40).contains(&self.max_bytes) {
            return Err(invalid(
                "responseCache.semantic.maxBytes",
                &self.max_bytes,
                "must be 1 MiB to 1 TiB",
            ));
        }
        if !(1..=MAX_DURATION_MS / 1000).contains(&self.check_interval_s) {
            return Err(invalid(
                "responseCache.semantic.checkIntervalS",
                &self.check_interval_s,
                "must be 1 to 86400 (one day)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_semantic_bounds_default_and_are_checked() {
        let yaml = "embeddings: {url: 'http://e:8000', model: m}";
        let semantic: Semantic = serde_yaml::from_str(yaml).unwrap();
        assert_eq!(
            (semantic.max_bytes, semantic.check_interval_s),
            (64 << 20, 60)
        );
        assert!(semantic.validate().is_ok());
        for (field, set) in [
            (
                "responseCache.semantic.maxBytes",
                (|s: &mut Semantic| s.max_bytes = 1000) as fn(&mut Semantic),
            ),
            ("responseCache.semantic.checkIntervalS", |s| {
                s.check_interval_s = 0
            }),
        ] {
            let mut bad = semantic.clone();
            set(&mut bad);
            match bad.validate() {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
