//! The response cache's metrics, registered with the router's.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::Why;

/// `{model, result}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelResult {
    /// A served model, or `unknown`.
    pub model: String,
    /// `hit`, `semantic_hit`, `miss`, `bypass` or `error`.
    pub result: &'static str,
}

/// The response cache's counters and gauges.
#[derive(Debug)]
pub struct CacheMetrics {
    /// `kvroute_response_cache_requests_total{model,result}`.
    pub requests: Family<ModelResult, Counter>,
    /// `kvroute_response_cache_bytes`, set at each scrape.
    pub bytes: Gauge,
    /// `kvroute_response_cache_evictions_total{reason}`.
    pub evictions: Family<Why, Counter>,
    /// `kvroute_response_cache_coalesced_total`.
    pub coalesced: Counter,
    /// `kvroute_response_cache_slow_leaders_total`.
    pub slow_leaders: Counter,
    /// `kvroute_response_cache_stores_total{reason}`.
    pub stores: Family<Why, Counter>,
    /// `kvroute_response_cache_store_errors_total{reason}`.
    pub store_errors: Family<Why, Counter>,
    /// `kvroute_response_cache_breaker_opened_total`.
    pub breaker_opened: Counter,
    /// `kvroute_response_cache_purged_total`.
    pub purged: Counter,
    /// `kvroute_semantic_cache_embedding_seconds`.
    pub embedding_seconds: Histogram,
    /// `kvroute_semantic_cache_embedding_errors_total{reason}`.
    pub embedding_errors: Family<Why, Counter>,
    /// `kvroute_semantic_cache_similarity`: of the nearest question found.
    pub similarity: Histogram,
    /// `kvroute_semantic_cache_false_hits_total{model}`.
    pub false_hits: Family<crate::metrics::Model, Counter>,
    /// `kvroute_semantic_cache_entries`, set at each scrape.
    pub semantic_entries: Gauge,
    /// `kvroute_semantic_cache_bytes`, set at each scrape.
    pub semantic_bytes: Gauge,
    /// `kvroute_semantic_cache_embedder_healthy`: 1 while the last check
    /// of the embedder passed.
    pub embedder_healthy: Gauge,
    /// `kvroute_semantic_cache_embedder_check_failures_total{reason}`.
    pub check_failures: Family<Why, Counter>,
    /// `kvroute_semantic_cache_skipped_total`: lookups skipped while the
    /// embedder's check fails.
    pub semantic_skipped: Counter,
}

impl Default for CacheMetrics {
    fn default() -> Self {
        CacheMetrics {
            requests: Family::default(),
            bytes: Gauge::default(),
            evictions: Family::default(),
            coalesced: Counter::default(),
            slow_leaders: Counter::default(),
            stores: Family::default(),
            store_errors: Family::default(),
            breaker_opened: Counter::default(),
            purged: Counter::default(),
            embedding_seconds: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
            embedding_errors: Family::default(),
            similarity: Histogram::new([
                0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0,
            ]),
            false_hits: Family::default(),
            semantic_entries: Gauge::default(),
            semantic_bytes: Gauge::default(),
            embedder_healthy: Gauge::default(),
            check_failures: Family::default(),
            semantic_skipped: Counter::default(),
        }
    }
}

impl CacheMetrics {
    /// Registers every metric with `r`.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvroute_response_cache_requests",
            "Requests to the cached APIs while responseCache is on, by model and result: hit (answered from the cache, coalesced ones included), semantic_hit (answered with a similar question's answer), miss (sent to an engine), bypass (not cacheable: sampled, n, logprobs, no-store, another path), error (the store failed or timed out: sent to an engine)",
            self.requests.clone(),
        );
        r.register(
            "kvroute_response_cache_bytes",
            "Bytes of answers in the embedded store, as weighed (0 with Redis)",
            self.bytes.clone(),
        );
        r.register(
            "kvroute_response_cache_evictions",
            "Answers the embedded store dropped, by reason: size (responseCache.maxBytes) or expired (responseCache.ttlS)",
            self.evictions.clone(),
        );
        r.register(
            "kvroute_response_cache_coalesced",
            "Requests answered with an identical request's answer while it was in flight (also counted as hits)",
            self.coalesced.clone(),
        );
        r.register(
            "kvroute_response_cache_slow_leaders",
            "Requests that identical ones waited for whose client fell more than responseCache.maxEntryBytes behind the engine's answer: the waiting requests went to an engine",
            self.slow_leaders.clone(),
        );
        r.register(
            "kvroute_response_cache_stores",
            "Answers offered to the store, by reason: stored, too_large (responseCache.maxEntryBytes), incomplete (an error, a broken or truncated answer), cache_control (the engine's Cache-Control said no-store or private), error (the store failed)",
            self.stores.clone(),
        );
        r.register(
            "kvroute_response_cache_store_errors",
            "Redis operations that failed, by reason: timeout (responseCache.timeoutMs), error, breaker_open (skipped while the circuit breaker is open)",
            self.store_errors.clone(),
        );
        r.register(
            "kvroute_response_cache_breaker_opened",
            "Times the Redis circuit breaker opened after consecutive failures",
            self.breaker_opened.clone(),
        );
        r.register(
            "kvroute_response_cache_purged",
            "Answers purged through the admin port",
            self.purged.clone(),
        );
        r.register(
            "kvroute_semantic_cache_embedding_seconds",
            "Time to embed a question for the semantic cache (responseCache.semantic), failures included",
            self.embedding_seconds.clone(),
        );
        r.register(
            "kvroute_semantic_cache_embedding_errors",
            "Questions the embeddings server gave no usable vector for (each a plain miss), by reason: timeout, transport, status, garbage, dimension (not the dimension the embedder's check established)",
            self.embedding_errors.clone(),
        );
        r.register(
            "kvroute_semantic_cache_similarity",
            "Cosine similarity of the nearest stored question with the same context, per semantic lookup that found one",
            self.similarity.clone(),
        );
        r.register(
            "kvroute_semantic_cache_false_hits",
            "Semantic hits a client reported wrong (POST /v1/kvroute/semantic-cache/false-hit), by model",
            self.false_hits.clone(),
        );
        r.register(
            "kvroute_semantic_cache_entries",
            "Questions the semantic cache remembers (at most responseCache.semantic.maxEntries)",
            self.semantic_entries.clone(),
        );
        r.register(
            "kvroute_semantic_cache_bytes",
            "About how many bytes the semantic cache's index holds: vectors, graphs and bookkeeping (answers are in the exact cache's bytes)",
            self.semantic_bytes.clone(),
        );
        r.register(
            "kvroute_semantic_cache_embedder_healthy",
            "1 while the last check of the embedder passed (its probe texts embed to vectors of one dimension that are not similar), else 0: the semantic level is off",
            self.embedder_healthy.clone(),
        );
        r.register(
            "kvroute_semantic_cache_embedder_check_failures",
            "Checks of the embedder that failed (the semantic level off until one passes), by reason: timeout, transport, status, garbage (a probe got no usable vector), dimension (the probes' vectors differ in dimension), similar (unrelated probes embed at or above the threshold: a constant embedder)",
            self.check_failures.clone(),
        );
        r.register(
            "kvroute_semantic_cache_skipped",
            "Semantic lookups skipped while the embedder's check fails (each a plain miss)",
            self.semantic_skipped.clone(),
        );
    }
}
