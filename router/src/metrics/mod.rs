//! The router's Prometheus metrics: typed families on `prometheus-client`,
//! exposed in the OpenMetrics text format. Each metric is a field of
//! [`Metrics`], named once where it is registered; label sets are structs.
//! Per-endpoint gauges are read from the pool at scrape time. The pool's
//! health events are logged and counted here ([`Metrics::health`]), by
//! whoever reported the outcome that caused them.
//!
//! Bounded: `model` comes from the served models, `tenant` from a
//! configured list, `endpoint` from the pool; the failure series of an
//! endpoint that left the pool are dropped at the next scrape.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use kvroute_core::contract::Contract;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::pool::{EndpointStatus, Event, HealthEvents, Pool, TierStats};
use crate::throttle::Warnings;

/// The target the health events are logged under: the pool's, where they
/// happen, so log filters on it see them.
const HEALTH_TARGET: &str = "kvroute_router::pool";

/// Histogram buckets, seconds.
const BUCKETS: [f64; 16] = [
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Every `kind` of `kvroute_upstream_failures_total`.
const FAILURE_KINDS: [&str; 6] = [
    "connect",
    "status",
    "timeout",
    "stream",
    "health_check",
    "transport",
];

/// `{model, status}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelStatus {
    /// A served model, or `unknown`.
    pub model: String,
    /// The HTTP status, `stream_error` or `499`.
    pub status: String,
}

/// `{model, tenant}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelTenant {
    /// A served model, or `unknown`.
    pub model: String,
    /// A listed tenant, `none` or `other`.
    pub tenant: String,
}

/// `{model, tenant, cause}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelTenantCause {
    /// A served model, or `unknown`.
    pub model: String,
    /// A listed tenant, `none` or `other`.
    pub tenant: String,
    /// A [`Cause`](crate::request::missed::Cause).
    pub cause: &'static str,
}

/// `{model, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelReason {
    /// A served model, or `unknown`.
    pub model: String,
    /// A [`Lost`](crate::pool::Lost).
    pub reason: &'static str,
}

/// `{currency}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Currency {
    /// `telemetry.pricing.currency`.
    pub currency: String,
}

/// `{model}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Model {
    /// A served model, or `unknown`.
    pub model: String,
}

/// `{reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Why {
    /// The reason.
    pub reason: &'static str,
}

/// `{result}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// `hit` or `miss`.
    pub result: &'static str,
}

/// `{listener, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerReason {
    /// `api`, `admin` or `picker`.
    pub listener: &'static str,
    /// Why the connection was closed.
    pub reason: &'static str,
}

/// `{listener}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Listener {
    /// `api`, `admin` or `picker`.
    pub listener: &'static str,
}

/// `{endpoint, kind}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointKind {
    /// The endpoint's name.
    pub endpoint: String,
    /// connect, status, timeout, stream, health_check or transport.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Medium {
    medium: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointState {
    endpoint: String,
    state: &'static str,
}

/// The router's counters and histograms. See the module docs.
pub struct Metrics {
    registry: Registry,
    /// `kvroute_requests_total{model,status}`.
    pub requests: Family<ModelStatus, Counter>,
    /// `kvroute_prompts_not_tokenized_total`.
    pub prompts_not_tokenized: Counter,
    /// `kvroute_ejections_total{reason}`.
    pub ejections: Family<Why, Counter>,
    /// `kvroute_ejections_refused_total{reason}`.
    pub ejections_refused: Family<Why, Counter>,
    /// `kvroute_restorations_total{reason}`.
    pub restorations: Family<Why, Counter>,
    /// `kvroute_connections_refused_total{listener,reason}`.
    pub connections_refused: Family<ListenerReason, Counter>,
    /// `kvroute_connections_evicted_total{listener}`.
    pub connections_evicted: Family<Listener, Counter>,
    /// `kvroute_routing_decisions_total{reason}`.
    pub routing_decisions: Family<Why, Counter>,
    /// `kvroute_request_bodies_refused_total{reason}`.
    pub bodies_refused: Family<Why, Counter>,
    /// `kvroute_request_body_bytes`.
    pub body_bytes: Gauge,
    /// `kvroute_first_choice_total`.
    pub first_choice: Counter,
    /// `kvroute_admission_refusals_total`.
    pub admission_refusals: Counter,
    /// `kvroute_routed_total`.
    pub routed: Counter,
    /// `kvroute_prompt_tokens_total{model,tenant}`.
    pub prompt_tokens: Family<ModelTenant, Counter>,
    /// `kvroute_expected_cached_tokens_total{model,tenant}`.
    pub expected_cached_tokens: Family<ModelTenant, Counter>,
    /// `kvroute_observed_prompt_tokens_total{model,tenant}`.
    pub observed_prompt_tokens: Family<ModelTenant, Counter>,
    /// `kvroute_observed_cached_tokens_total{model,tenant}`.
    pub observed_cached_tokens: Family<ModelTenant, Counter>,
    /// `kvroute_observed_requests_total{model,tenant}`.
    pub observed_requests: Family<ModelTenant, Counter>,
    /// `kvroute_requests_with_cache_hit_total{model,tenant}`.
    pub requests_with_cache_hit: Family<ModelTenant, Counter>,
    /// `kvroute_prefill_seconds_saved_total{model,tenant}`.
    pub prefill_seconds_saved: Family<ModelTenant, Counter<f64, AtomicU64>>,
    /// `kvroute_hit_rate_gap{model}`.
    pub hit_rate_gap: Family<Model, Gauge<f64, AtomicU64>>,
    /// `kvroute_hit_rate_gap_alerts_total{model}`.
    pub hit_rate_gap_alerts: Family<Model, Counter>,
    /// `kvroute_volatile_prefix_requests_total{model,tenant}`.
    pub volatile_prefix_requests: Family<ModelTenant, Counter>,
    /// `kvroute_missed_prompt_tokens_total{model,tenant,cause}`.
    pub missed_prompt_tokens: Family<ModelTenantCause, Counter>,
    /// `kvroute_routed_elsewhere_tokens_total{model,reason}`.
    pub routed_elsewhere_tokens: Family<ModelReason, Counter>,
    /// `kvroute_unreported_prompt_tokens_total{model}`.
    pub unreported_prompt_tokens: Family<Model, Counter>,
    /// `kvroute_cache_pressure{model}`, set at each scrape.
    pub cache_pressure: Family<Model, Gauge<f64, AtomicU64>>,
    /// Warm-ups' (`routing.warmup`).
    pub(crate) warmup: crate::warmup::WarmupMetrics,
    /// `kvroute_pricing_engine_hour_cost{currency}`, with
    /// `telemetry.pricing`.
    pub engine_hour_cost: Family<Currency, Gauge<f64, AtomicU64>>,
    /// `kvroute_conversation_prompts_total{result}`.
    pub conversation_prompts: Family<Outcome, Counter>,
    /// `kvroute_conversation_evictions_total`.
    pub conversation_evictions: Counter,
    /// `kvroute_snapshot_waits_expired_total`.
    pub snapshot_waits_expired: Counter,
    /// `kvroute_upstream_failures_total{endpoint,kind}`; use
    /// [`Metrics::upstream_failure`], which keeps the series bounded.
    upstream_failures: Family<EndpointKind, Counter>,
    /// Endpoints with failure series.
    failed_endpoints: Mutex<BTreeSet<String>>,
    /// Refused ejections repeat with every failure: logged throttled.
    refused_ejections: Warnings,
    /// `kvroute_decision_seconds`.
    pub decision_seconds: Histogram,
    /// `kvroute_upstream_ttft_seconds`.
    pub upstream_ttft_seconds: Histogram,
    /// The response cache's.
    pub response_cache: std::sync::Arc<crate::response_cache::metrics::CacheMetrics>,
    /// Flow control's.
    pub flow: crate::flow::metrics::FlowMetrics,
    /// Disaggregation's.
    pub split: crate::request::split::SplitMetrics,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(std::sync::Arc::default())
    }
}

impl Metrics {
    /// The router's metrics, the response cache's `response_cache` among
    /// them.
    pub fn new(
        response_cache: std::sync::Arc<crate::response_cache::metrics::CacheMetrics>,
    ) -> Self {
        let mut m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            prompts_not_tokenized: Counter::default(),
            ejections: Family::default(),
            ejections_refused: Family::default(),
            restorations: Family::default(),
            connections_refused: Family::default(),
            connections_evicted: Family::default(),
            routing_decisions: Family::default(),
            bodies_refused: Family::default(),
            body_bytes: Gauge::default(),
            first_choice: Counter::default(),
            admission_refusals: Counter::default(),
            routed: Counter::default(),
            prompt_tokens: Family::default(),
            expected_cached_tokens: Family::default(),
            observed_prompt_tokens: Family::default(),
            observed_cached_tokens: Family::default(),
            observed_requests: Family::default(),
            requests_with_cache_hit: Family::default(),
            prefill_seconds_saved: Family::default(),
            hit_rate_gap: Family::default(),
            hit_rate_gap_alerts: Family::default(),
            volatile_prefix_requests: Family::default(),
            missed_prompt_tokens: Family::default(),
            routed_elsewhere_tokens: Family::default(),
            unreported_prompt_tokens: Family::default(),
            cache_pressure: Family::default(),
            engine_hour_cost: Family::default(),
            warmup: Default::default(),
            conversation_prompts: Family::default(),
            conversation_evictions: Counter::default(),
            snapshot_waits_expired: Counter::default(),
            upstream_failures: Family::default(),
            failed_endpoints: Mutex::default(),
            refused_ejections: Warnings::default(),
            decision_seconds: Histogram::new(BUCKETS.iter().copied()),
            upstream_ttft_seconds: Histogram::new(BUCKETS.iter().copied()),
            response_cache,
            flow: Default::default(),
            split: Default::default(),
        };
        let r = &mut m.registry;
        // Counters are registered without `_total`, which the encoder adds.
        r.register(
            "kvroute_requests",
            "Requests answered, by model (a served model, else unknown) and status: the HTTP status, stream_error when the engine's stream broke mid-way, 499 when the client left first",
            m.requests.clone(),
        );
        r.register(
            "kvroute_prompts_not_tokenized",
            "Requests whose body exceeded limits.maxTokenizeBytes: routed without reading the prompt",
            m.prompts_not_tokenized.clone(),
        );
        r.register(
            "kvroute_ejections",
            "Endpoints ejected, by the fault that tipped them: connect, status, timeout, stream, health_check",
            m.ejections.clone(),
        );
        r.register(
            "kvroute_ejections_refused",
            "Ejections not made because resilience.maxEjectedPercent of the endpoints were already ejected, by fault",
            m.ejections_refused.clone(),
        );
        r.register(
            "kvroute_restorations",
            "Ejected endpoints restored, by reason: expired (on probation) or health_check",
            m.restorations.clone(),
        );
        r.register(
            "kvroute_connections_refused",
            "Client connections closed before serving a request, by listener and reason: max_connections, accept_error, tls_handshake, tls_timeout",
            m.connections_refused.clone(),
        );
        r.register(
            "kvroute_connections_evicted",
            "Connections with no request in progress closed to make room for a new one at the listener's cap, by listener",
            m.connections_evicted.clone(),
        );
        r.register(
            "kvroute_routing_decisions",
            "Routing decisions by reason: warm (longest cached prefix), cold (no cached prefix; rendezvous first choice), spill (first choice over its load bound), retry (a later attempt)",
            m.routing_decisions.clone(),
        );
        r.register(
            "kvroute_request_bodies_refused",
            "Request bodies refused while they arrived, by reason: too_large (limits.maxBodyBytes), budget (limits.maxBodyBytesInFlight), tenant_budget (limits.maxBodyBytesPerTenant), too_slow (limits.bodyMinBytesPerS), timeout (limits.bodyReadTimeoutMs)",
            m.bodies_refused.clone(),
        );
        r.register(
            "kvroute_request_body_bytes",
            "Bytes of request bodies held in memory (counted by the KiB as they arrive)",
            m.body_bytes.clone(),
        );
        r.register(
            "kvroute_snapshot_waits_expired",
            "Starts after which the router reported ready without every ready engine's first WatchCache snapshot, because resilience.snapshotWaitMs passed",
            m.snapshot_waits_expired.clone(),
        );
        r.register(
            "kvroute_first_choice",
            "Requests served by the policy's first choice",
            m.first_choice.clone(),
        );
        r.register(
            "kvroute_admission_refusals",
            "Attempts an engine refused because it could not start them within the wait the router predicted (the request was decided again)",
            m.admission_refusals.clone(),
        );
        r.register(
            "kvroute_routed",
            "Requests sent to an endpoint (first attempts)",
            m.routed.clone(),
        );
        r.register(
            "kvroute_prompt_tokens",
            "Prompt tokens of routed requests, as the router computed them, by model and tenant",
            m.prompt_tokens.clone(),
        );
        r.register(
            "kvroute_expected_cached_tokens",
            "Prompt tokens the router expected the chosen endpoint to hold cached, by model and tenant. Divided by kvroute_prompt_tokens_total: the expected hit rate",
            m.expected_cached_tokens.clone(),
        );
        r.register(
            "kvroute_observed_prompt_tokens",
            "Prompt tokens the engines reported (usage.prompt_tokens) in responses that reported cached tokens, by model and tenant",
            m.observed_prompt_tokens.clone(),
        );
        r.register(
            "kvroute_observed_cached_tokens",
            "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens), by model and tenant. Divided by kvroute_observed_prompt_tokens_total: the observed hit rate",
            m.observed_cached_tokens.clone(),
        );
        r.register(
            "kvroute_observed_requests",
            "Responses whose engine reported usage, by model and tenant",
            m.observed_requests.clone(),
        );
        r.register(
            "kvroute_requests_with_cache_hit",
            "Of those, responses with at least one cached prompt token, by model and tenant. Divided by kvroute_observed_requests_total: the request hit rate (not the share of tokens or of compute saved)",
            m.requests_with_cache_hit.clone(),
        );
        r.register(
            "kvroute_prefill_seconds_saved",
            "Engine seconds of prefill the cached prompt tokens saved (kvroute_observed_cached_tokens_total at the pool's prefill rate when each response ended), by model and tenant",
            m.prefill_seconds_saved.clone(),
        );
        r.register(
            "kvroute_hit_rate_gap",
            "Expected minus observed hit rate over the model's last 500 requests that reported cached tokens",
            m.hit_rate_gap.clone(),
        );
        r.register(
            "kvroute_hit_rate_gap_alerts",
            "Times a model's hit-rate gap was sustained (at least 0.2 over 50 or more requests; at most one per 5 minutes), each logged with an example response id",
            m.hit_rate_gap_alerts.clone(),
        );
        r.register(
            "kvroute_conversation_prompts",
            "Chat prompts with a conversation key (built-in tokenizer and template), by result: hit (resumed after the previous turn's messages: only the new ones tokenized) or miss (computed whole)",
            m.conversation_prompts.clone(),
        );
        r.register(
            "kvroute_conversation_evictions",
            format!(
                "Conversations forgotten to keep the prompt snapshots within {} conversations and {} chain blocks",
                crate::prompt::conversations::MAX_CONVERSATIONS,
                crate::prompt::conversations::MAX_BLOCKS
            ),
            m.conversation_evictions.clone(),
        );
        r.register(
            "kvroute_volatile_prefix_requests",
            "Requests whose chain was new from an early block although most of their later blocks' contents were seen recently (a timestamp or id early in the prompt), by model and tenant; see /debug/prefixes",
            m.volatile_prefix_requests.clone(),
        );
        r.register(
            "kvroute_missed_prompt_tokens",
            "Prompt tokens the engine computed (usage.prompt_tokens minus prompt_tokens_details.cached_tokens), by model, tenant and cause: contract, partial_block, routed_elsewhere, engine_shortfall, evicted, diverged, cold, unknown (docs/missed-tokens.md)",
            m.missed_prompt_tokens.clone(),
        );
        r.register(
            "kvroute_routed_elsewhere_tokens",
            "Missed prompt tokens another endpoint held, by model and why it lost: load, queue, health, ejection, subset, retry",
            m.routed_elsewhere_tokens.clone(),
        );
        r.register(
            "kvroute_unreported_prompt_tokens",
            "Prompt tokens of successful responses without usage (a stream without stream_options.include_usage, an engine without --enable-prompt-tokens-details): not attributed",
            m.unreported_prompt_tokens.clone(),
        );
        r.register(
            "kvroute_pricing_engine_hour_cost",
            "What an engine's GPUs cost an hour (telemetry.pricing: gpuHourCost times gpusPerEngine), to price kvroute_prefill_seconds_saved_total",
            m.engine_hour_cost.clone(),
        );
        r.register(
            "kvroute_cache_pressure",
            "The evicted share of prompt tokens over the last 60 s at this router: the pool's cache-capacity pressure",
            m.cache_pressure.clone(),
        );
        r.register(
            "kvroute_upstream_failures",
            "Failed attempts by endpoint and kind (connect, status, timeout, stream, transport)",
            m.upstream_failures.clone(),
        );
        r.register(
            "kvroute_decision_seconds",
            "Time to parse, tokenize, hash and rank a request",
            m.decision_seconds.clone(),
        );
        r.register(
            "kvroute_upstream_ttft_seconds",
            "From sending a request to the engine to its first response body byte",
            m.upstream_ttft_seconds.clone(),
        );
        m.response_cache.register(r);
        m.flow.register(r);
        m.split.register(r);
        m.warmup.register(r);
        m
    }
}

impl Metrics {
    /// Counts a failed attempt at `endpoint`.
    pub fn upstream_failure(&self, endpoint: &str, kind: &'static str) {
        self.failed_endpoints
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(endpoint.to_owned());
        self.upstream_failures
            .get_or_create(&EndpointKind {
                endpoint: endpoint.to_owned(),
                kind,
            })
            .inc();
    }

    /// Logs and counts the pool's health events: each ejection, refused
    /// ejection and restoration.
    pub fn health(&self, events: HealthEvents) {
        for event in events {
            match event {
                Event::Ejected {
                    endpoint,
                    fault,
                    duration,
                } => {
                    let ms = duration.map(|d| d.as_millis() as u64);
                    tracing::warn!(target: HEALTH_TARGET, %endpoint, reason = fault.as_str(), ejected_for_ms = ms, "endpoint ejected");
                    let reason = fault.as_str();
                    self.ejections.get_or_create(&Why { reason }).inc();
                }
                Event::Refused { endpoint, fault } => {
                    let reason = fault.as_str();
                    if let Some(n) = self.refused_ejections.admit(&endpoint, reason) {
                        tracing::warn!(target: HEALTH_TARGET, %endpoint, reason, times = n, "endpoint not ejected: the ejected share is at resilience.maxEjectedPercent");
                    }
                    self.ejections_refused.get_or_create(&Why { reason }).inc();
                }
                Event::Restored { endpoint, why } => {
                    tracing::info!(target: HEALTH_TARGET, %endpoint, reason = why.as_str(), "endpoint restored");
                    let reason = why.as_str();
                    self.restorations.get_or_create(&Why { reason }).inc();
                }
            }
        }
    }

    /// The exposition text without the pool's gauges.
    #[cfg(test)]
    pub(crate) fn render_text(&self) -> String {
        kvroute_telemetry::metrics::encode(&[&self.registry])
    }

    /// The exposition text, with the pool's gauges.
    pub fn render(&self, pool: &Pool) -> String {
        let endpoints = pool.status();
        {
            // Series of endpoints that left the pool go with them.
            let mut failed = self
                .failed_endpoints
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            failed.retain(|name| {
                let present = endpoints.iter().any(|e| &e.name == name);
                if !present {
                    for kind in FAILURE_KINDS {
                        self.upstream_failures.remove(&EndpointKind {
                            endpoint: name.clone(),
                            kind,
                        });
                    }
                }
                present
            });
        }
        let gauges = pool_gauges(&endpoints, &pool.index_stats(), pool.evicted_overflow());
        kvroute_telemetry::metrics::encode(&[&self.registry, &gauges])
    }
}

/// The pool's gauges as of now, in a registry of their own.
fn pool_gauges(
    endpoints: &[EndpointStatus],
    index: &[TierStats],
    evicted_overflow: u64,
) -> Registry {
    let mut r = Registry::default();
    let mut per_endpoint =
        |name: &str, help: &str, value: &dyn Fn(&EndpointStatus) -> Option<f64>| {
            let family = Family::<EndpointLabel, Gauge<f64, AtomicU64>>::default();
            for e in endpoints {
                if let Some(v) = value(e) {
                    family
                        .get_or_create(&EndpointLabel {
                            endpoint: e.name.clone(),
                        })
                        .set(v);
                }
            }
            r.register(name, help, family);
        };
    let flag = |b: bool| f64::from(u8::from(b));
    per_endpoint(
        "kvroute_endpoint_in_flight",
        "Requests in flight per endpoint",
        &|e| Some(f64::from(e.in_flight)),
    );
    per_endpoint(
        "kvroute_endpoint_prefill_tokens",
        "Estimated uncached prompt tokens not yet past prefill, per endpoint",
        &|e| Some(e.prefill_tokens as f64),
    );
    per_endpoint(
        "kvroute_endpoint_cached_blocks",
        "Blocks the occupancy index holds per endpoint",
        &|e| Some(e.cached_blocks as f64),
    );
    per_endpoint(
        "kvroute_endpoint_queue_seconds",
        "Predicted prefill queue per endpoint: how long a new request would wait for its prefill to start (fleet-wide when the engine reports load)",
        &|e| Some(e.queue_seconds),
    );
    per_endpoint(
        "kvroute_endpoint_load_report_age_seconds",
        "Age of the engine's last WatchCache load report per endpoint",
        &|e| e.load_report_age_seconds,
    );
    per_endpoint(
        "kvroute_endpoint_ejected",
        "1 while an endpoint is ejected for failures",
        &|e| Some(flag(e.ejected)),
    );
    per_endpoint(
        "kvroute_endpoint_routable",
        "1 when an endpoint is ready, not draining and not ejected",
        &|e| Some(flag(e.ready && !e.draining && !e.ejected)),
    );
    let mut per_state = |name: &str,
                         help: &str,
                         states: &[&'static str],
                         current: &dyn Fn(&EndpointStatus) -> &str| {
        let family = Family::<EndpointState, Gauge>::default();
        for e in endpoints {
            for &state in states {
                family
                    .get_or_create(&EndpointState {
                        endpoint: e.name.clone(),
                        state,
                    })
                    .set(i64::from(current(e) == state));
            }
        }
        r.register(name, help, family);
    };
    per_state(
        "kvroute_watch_cache_stream",
        "WatchCache stream state per endpoint (1 for the current state)",
        &["none", "connecting", "live"],
        &|e| e.stream,
    );
    per_state(
        "kvroute_endpoint_contract",
        "Engine contract per endpoint (1 for the current state): whether the engine's block size, hash algorithm and seed match the routing settings",
        &Contract::STATES,
        &|e| e.contract,
    );
    let entries = Family::<Medium, Gauge>::default();
    let dropped = Family::<Medium, Counter>::default();
    for t in index {
        let medium = Medium {
            medium: t.tier.as_str(),
        };
        let n = i64::try_from(t.entries).unwrap_or(i64::MAX);
        entries.get_or_create(&medium).set(n);
        dropped.get_or_create(&medium).inc_by(t.dropped);
    }
    r.register(
        "kvroute_index_entries",
        "(block, endpoint) entries in the occupancy index, by medium: gpu, or offloaded (every other medium)",
        entries,
    );
    r.register(
        "kvroute_index_dropped_blocks",
        "Blocks engines reported stored that the occupancy index dropped to hold at most limits.maxIndexBlocksPerEndpoint (gpu) or limits.maxOffloadedBlocksPerEndpoint (offloaded) per endpoint: misses, never false hits",
        dropped,
    );
    let overflow = Counter::<u64>::default();
    overflow.inc_by(evicted_overflow);
    r.register(
        "kvroute_evicted_set_overflow",
        "Evicted blocks forgotten to make room in the recently evicted set (limits.maxEvictedBlocks): some evicted misses are then called cold",
        overflow,
    );
    r
}

#[cfg(test)]
mod tests;
