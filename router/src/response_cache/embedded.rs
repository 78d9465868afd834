//! The embedded store: answers in this router's memory, in a bounded
//! concurrent cache (`moka`), weighed by bytes, each kept `ttlS`, the
//! least recently used evicted first. Evictions are counted by cause.
//!
//! Memory: an entry weighs its answer's text, its strings and
//! [`OVERHEAD`] bytes for the key, the map's slot and the answer's fixed
//! fields; `maxBytes` bounds the sum.
//!
//! Not here: what is stored, or when ([`super`]).

use std::sync::Arc;
use std::time::Duration;

use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::answer::Answer;
use super::key::Key;
use crate::metrics::Why;

/// Bytes an entry costs besides its strings.
pub const OVERHEAD: u32 = 256;

/// A stored answer.
#[derive(Clone, Debug)]
struct Entry {
    model: Arc<str>,
    answer: Arc<Answer>,
}

/// The embedded store. See the module doc.
#[derive(Clone)]
pub struct Embedded {
    cache: moka::sync::Cache<[u8; 32], Entry>,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("entries", &self.cache.entry_count())
            .finish_non_exhaustive()
    }
}

impl Embedded {
    /// A store of at most `max_bytes`, each answer kept `ttl`; evictions
    /// counted in `evictions` by reason (`size`, `expired`).
    pub fn new(max_bytes: u64, ttl: Duration, evictions: Family<Why, Counter>) -> Self {
        let cache = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_, e: &Entry| weight(&e.answer))
            .time_to_live(ttl)
            .eviction_policy(EvictionPolicy::lru())
            .eviction_listener(move |_, _, cause| {
                let reason = match cause {
                    RemovalCause::Size => "size",
                    RemovalCause::Expired => "expired",
                    RemovalCause::Explicit | RemovalCause::Replaced => return,
                };
                evictions.get_or_create(&Why { reason }).inc();
            })
            .build();
        Embedded { cache }
    }

    /// The answer stored under `key`.
    pub fn get(&self, key: &Key) -> Option<Arc<Answer>> {
        self.cache.get(&key.digest).map(|e| e.answer)
    }

    /// Stores `answer` under `key`.
    pub fn put(&self, key: &Key, answer: Arc<Answer>) {
        let entry = Entry {
            model: Arc::from(key.model.as_str()),
            answer,
        };
        self.cache.insert(key.digest, entry);
    }

    /// Drops every answer, or those of `model`; returns how many.
    pub fn purge(&self, model: Option<&str>) -> u64 {
        let mut n = 0;
        for (digest, entry) in &self.cache {
            if model.is_none_or(|m| *entry.model == *m) {
                self.cache.invalidate(&*digest);
                n += 1;
            }
        }
        self.cache.run_pending_tasks();
        n
    }

    /// Bytes held, as weighed (settled lazily by the cache).
    pub fn bytes(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }
}

/// What an answer weighs (see the module doc).
pub fn weight(a: &Answer) -> u32 {
    let strings = a.content.len()
        + a.model.len()
        + a.reasoning.as_ref().map_or(0, String::len)
        + a.finish_reason.len()
        + a.system_fingerprint.as_ref().map_or(0, String::len)
        + (a.tool_calls.iter())
            .map(|c| c.id.len() + c.name.len() + c.arguments.len() + 72)
            .sum::<usize>();
    OVERHEAD.saturating_add(u32::try_from(strings).unwrap_or(u32::MAX))
}
