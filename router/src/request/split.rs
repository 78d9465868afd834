//! Prefill/decode disaggregation: whether a decided request is split into
//! a prefill leg on a prefill-capable endpoint and a decode leg on its
//! decode endpoint ([`Service::split`]), and what the legs count
//! ([`SplitMetrics`]). The decision already chose the decode endpoint
//! among the decode-capable ones (its cache, memory and seats, and the
//! conversation's affinity); the prefill endpoint is the policy's choice
//! among the prefill-capable ones. The front ends run the legs: the HTTP
//! forwarder itself, the picker by naming the prefill endpoint to llm-d's
//! routing sidecar.

use std::net::SocketAddr;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use kvroute_core::spec::DisaggregationMode;

use super::{Decision, Service};
use crate::errors::ApiError;
use crate::pool::{Leg, Plan};
use crate::prompt::body::Api;

/// How a request was served, as `kvroute_disaggregated_requests_total`'s
/// `result`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Prefilled on a prefill endpoint, decoded on its decode endpoint.
    Disaggregated,
    /// Whole on its decode endpoint: too little to prefill there.
    BelowThreshold,
    /// Whole: the best prefill endpoint is its decode endpoint (`both`).
    SameEndpoint,
    /// Whole, its decode endpoint prefilling: no prefill endpoint could.
    FallbackLocal,
    /// Whole: the prefill endpoint answered without `kv_transfer_params`
    /// (an engine without a KV connector).
    NoConnector,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Disaggregated => "disaggregated",
            Outcome::BelowThreshold => "local_below_threshold",
            Outcome::SameEndpoint => "local_same_endpoint",
            Outcome::FallbackLocal => "fallback_local",
            Outcome::NoConnector => "no_connector",
        }
    }
}

/// Why a request eligible for disaggregation was prefilled by its decode
/// endpoint (`fallback_local`), as
/// `kvroute_disaggregated_fallbacks_total`'s `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fallback {
    /// No prefill-capable endpoint is routable.
    NoPrefillEndpoint,
    /// Its prefill leg was shed while held (flow control).
    Shed,
    /// Every prefill leg failed (connection, 5xx, no answer in time).
    PrefillFailed,
    /// Its body could not be edited into the legs' bodies.
    BodyUnreadable,
    /// The prefill answer was longer than its bound.
    AnswerTooLarge,
    /// Its `kv_transfer_params` named more block ids than the prompt has
    /// blocks.
    TooManyBlocks,
    /// Its `kv_transfer_params` besides the block ids were over their
    /// bound.
    ParamsTooLarge,
    /// Its `kv_transfer_params` were not what vLLM sends.
    BadParams,
    /// Its `remote_host` is not the prefill endpoint's own.
    ForeignHost,
}

impl Fallback {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Fallback::NoPrefillEndpoint => "no_prefill_endpoint",
            Fallback::Shed => "shed",
            Fallback::PrefillFailed => "prefill_failed",
            Fallback::BodyUnreadable => "body_unreadable",
            Fallback::AnswerTooLarge => "answer_too_large",
            Fallback::TooManyBlocks => "too_many_block_ids",
            Fallback::ParamsTooLarge => "params_too_large",
            Fallback::BadParams => "bad_params",
            Fallback::ForeignHost => "foreign_remote_host",
        }
    }
}

/// llm-d's header naming a disaggregated request's prefill endpoint,
/// `host:port`: the picker's to set, never a client's to pass on.
pub(crate) const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// Older llm-d versions' spelling (a URL); removed from every request.
pub(crate) const OLD_PREFILLER_HEADER: &str = "x-prefiller-url";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Result {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// Prefill leg buckets, seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Share buckets.
const SHARES: [f64; 10] = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9];

/// Disaggregation's metrics.
#[derive(Debug)]
pub struct SplitMetrics {
    requests: Family<Result, Counter>,
    fallbacks: Family<Reason, Counter>,
    /// `kvroute_prefill_leg_seconds`: from sending a prefill leg to its
    /// whole answer.
    pub(crate) prefill_seconds: Histogram,
    /// `kvroute_prefill_leg_prompt_tokens_total`.
    pub(crate) prompt_tokens: Counter,
    /// `kvroute_prefill_leg_cached_tokens_total`.
    pub(crate) cached_tokens: Counter,
    /// `kvroute_kv_transfer_ttft_share`: of a disaggregated request's time
    /// to first token, the decode leg's share (see `register`).
    pub(crate) transfer_share: Histogram,
}

impl Default for SplitMetrics {
    fn default() -> Self {
        SplitMetrics {
            requests: Family::default(),
            fallbacks: Family::default(),
            prefill_seconds: Histogram::new(BUCKETS),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            transfer_share: Histogram::new(SHARES),
        }
    }
}

impl SplitMetrics {
    /// Counts a request served as `outcome`.
    pub(crate) fn count(&self, outcome: Outcome) {
        let result = outcome.as_str();
        self.requests.get_or_create(&Result { result }).inc();
    }

    /// Counts a request prefilled by its decode endpoint for `why`.
    pub(crate) fn fallback(&self, why: Fallback) {
        self.count(Outcome::FallbackLocal);
        let reason = why.as_str();
        self.fallbacks.get_or_create(&Reason { reason }).inc();
    }

    /// Registers the families in `r`.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvroute_disaggregated_requests",
            "Requests eligible for disaggregation (routing.disaggregation auto), by how they were served: disaggregated, local_below_threshold, local_same_endpoint, fallback_local, no_connector",
            self.requests.clone(),
        );
        r.register(
            "kvroute_disaggregated_fallbacks",
            "Of those served fallback_local, why: no_prefill_endpoint, shed, prefill_failed, body_unreadable, answer_too_large, too_many_block_ids, params_too_large, bad_params, foreign_remote_host",
            self.fallbacks.clone(),
        );
        r.register(
            "kvroute_prefill_leg_seconds",
            "Disaggregated requests' prefill legs, from sending to the prefill endpoint's whole answer",
            self.prefill_seconds.clone(),
        );
        r.register(
            "kvroute_prefill_leg_prompt_tokens",
            "Prompt tokens of the prefill legs the prefill endpoints answered",
            self.prompt_tokens.clone(),
        );
        r.register(
            "kvroute_prefill_leg_cached_tokens",
            "Of those, the prefill endpoints found cached",
            self.cached_tokens.clone(),
        );
        r.register(
            "kvroute_kv_transfer_ttft_share",
            "Of each disaggregated request's time to first token at the router (prefill leg, then the decode leg's first byte), the decode leg's share: the KV transfer, with the decode endpoint's queue and first step",
            self.transfer_share.clone(),
        );
    }
}

/// Where a disaggregated request's prefill leg goes.
#[derive(Debug)]
pub(crate) struct Prefill {
    /// The prefill-capable endpoints, best first, and what the engines'
    /// reports said of the prompt there.
    pub(crate) plan: Plan,
    /// Prompt tokens the first is expected to hold.
    pub(crate) cached: u64,
}

impl Service {
    /// Where `decision` (a request to `path`) is prefilled when it is
    /// disaggregated: `routing.disaggregation` is `auto`, the request is a
    /// chat or completion with one choice, it would prefill at least
    /// `minUncachedTokens` uncached tokens on its decode endpoint, and the
    /// best prefill-capable endpoint is another. With flow control, the
    /// prefill leg is held as any request is, until that endpoint can
    /// start it. `None`, counted when it was eligible, when it runs whole.
    pub(crate) async fn split(&self, path: &str, decision: &Decision) -> Option<Prefill> {
        let settings = self.pool.settings();
        let d = settings.disaggregation;
        let a = &decision.analysis;
        if d.mode == DisaggregationMode::Disabled || Api::of(path) == Api::Other || a.choices > 1 {
            return None;
        }
        let metrics = &self.accounting.metrics.split;
        if decision.expected_uncached() < d.min_uncached_tokens {
            metrics.count(Outcome::BelowThreshold);
            return None;
        }
        let request = a.request();
        let mut plan = (self.pool).plan_except(&request, a.readable, &|_| true, &[], Leg::Prefill);
        let mut local = self.local(&plan, decision);
        if local.is_none() && self.flow.enabled() {
            let leg = (&request, a.readable, Leg::Prefill);
            local = match (self
                .flow
                .plan(&self.pool, leg, &|_| true, &decision.who, true))
            .await
            {
                Ok((gated, _)) => {
                    plan = gated;
                    self.local(&plan, decision)
                }
                Err(e) => {
                    tracing::debug!(error = %e, "the prefill leg was not held to the end");
                    metrics.fallback(Fallback::Shed);
                    return None;
                }
            };
        }
        match local {
            Some(Outcome::FallbackLocal) => metrics.fallback(Fallback::NoPrefillEndpoint),
            Some(outcome) => metrics.count(outcome),
            None => {
                return Some(Prefill {
                    cached: a.expected_cached(plan.cached_blocks),
                    plan,
                });
            }
        }
        None
    }

    /// Plans `decision`'s decode leg again once its prefill leg is done,
    /// so its endpoint's seat is taken when it starts, never while its
    /// prefill runs: through flow control, as on arrival (it waits here
    /// until a decode-capable endpoint can start it; an error, shed or
    /// shutting down, is the request's answer). A decode leg prefilled on
    /// `prefilled_on` goes to another endpoint. Without flow control, a
    /// fresh plan, kept only when it has a target.
    pub(crate) async fn plan_decode(
        &self,
        decision: &mut Decision,
        prefilled_on: Option<SocketAddr>,
    ) -> std::result::Result<(), ApiError> {
        let among = |a: &SocketAddr| Some(*a) != prefilled_on;
        let a = &decision.analysis;
        let (plan, held) = if self.flow.enabled() {
            let request = (&a.request(), a.readable, Leg::Decode);
            (self
                .flow
                .plan(&self.pool, request, &among, &decision.who, true))
            .await?
        } else {
            (self.pool.plan_among(&a.request(), a.readable, &among), None)
        };
        decision.planned(plan, held);
        Ok(())
    }

    /// Why `decision` runs whole with the prefill ranking `plan`: no
    /// prefill endpoint can take it (with flow control: none is routable;
    /// it waits for a full one), or the best is its decode endpoint.
    fn local(&self, plan: &Plan, decision: &Decision) -> Option<Outcome> {
        match (plan.targets.first(), decision.targets().first()) {
            (None, _) if plan.full == 0 || !self.flow.enabled() => Some(Outcome::FallbackLocal),
            (None, _) => None,
            (Some(p), Some(d)) if p.slot == d.slot => Some(Outcome::SameEndpoint),
            _ => None,
        }
    }
}
