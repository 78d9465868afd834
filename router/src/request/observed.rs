//! What a served request's usage tells, after its response: its missed
//! tokens counted by cause ([`super::missed`]), the pressure window behind
//! `kvroute_cache_pressure`, and the ring of recent requests behind
//! `GET /debug/requests/{id}`, all kept by the [`Accounting`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::Accounting;
use super::guard::Expected;
use super::hit_rate::Usage;
use super::labels::Labels;
use super::missed::{self, Cause};
use super::recent::Entry;
use crate::explain::Recorded;
use crate::metrics::{Model, ModelReason, ModelTenantCause};
use crate::pool::Pool;

impl Accounting {
    /// What the engine at `endpoint` reported of a request `labels` sent
    /// there expecting `e`: its missed tokens attributed ([`missed`](Self::missed))
    /// and its usage counted against what was expected ([`observed`](Self::observed)).
    pub(crate) fn usage(
        &self,
        (labels, pool): (&Labels, &Pool),
        endpoint: &Arc<str>,
        e: &Expected,
        usage: Usage,
        response_id: Option<String>,
    ) {
        self.missed(labels, endpoint, e, usage, response_id.clone());
        self.observed((labels, pool), e, usage, response_id);
    }

    /// Counts what the engine reported of a request `labels` sent
    /// expecting `e` against what was expected, and what its cached tokens
    /// saved at `pool`'s prefill rate; logs a sustained gap.
    fn observed(
        &self,
        (labels, pool): (&Labels, &Pool),
        e: &Expected,
        usage: Usage,
        id: Option<String>,
    ) {
        let by = labels.model_tenant();
        let m = &self.metrics;
        m.observed_requests.get_or_create(&by).inc();
        let computed = usage.prompt_tokens.saturating_sub(usage.cached_tokens);
        self.prefilled.fetch_add(computed, Ordering::Relaxed);
        m.observed_prompt_tokens
            .get_or_create(&by)
            .inc_by(usage.prompt_tokens);
        m.observed_cached_tokens
            .get_or_create(&by)
            .inc_by(usage.cached_tokens);
        // Every series exists from a model and tenant's first response.
        let (hits, saved) = (
            m.requests_with_cache_hit.get_or_create(&by),
            m.prefill_seconds_saved.get_or_create(&by),
        );
        if usage.cached_tokens > 0 {
            hits.inc();
            saved.inc_by(usage.cached_tokens as f64 / pool.prefill_rate());
        }
        let mut gap = self.gap.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now().into_std();
        let model = labels.model.as_str();
        let (value, alert) = gap.record(model, e.cached, e.prompt_tokens, usage, id, now);
        drop(gap);
        let label = Model {
            model: model.to_owned(),
        };
        m.hit_rate_gap.get_or_create(&label).set(value);
        if let Some(a) = alert {
            m.hit_rate_gap_alerts.get_or_create(&label).inc();
            tracing::warn!(model = %a.model, gap = a.gap, requests = a.requests,
                example = %a.example.as_deref().unwrap_or("-"),
                "the engines report far fewer cached tokens than the router expects: \
                 check that the router's tokenizer, chat template and hashing match the engines' \
                 (kvroute explain shows what the router computes)");
        }
    }

    /// Attributes the missed tokens of a request `labels` sent to
    /// `endpoint` expecting `e`, whose engine reported `usage` in its
    /// response `response_id` ([`missed`]): counted, in the pressure
    /// window, and recorded for `/debug/requests`.
    pub(crate) fn missed(
        &self,
        labels: &Labels,
        endpoint: &Arc<str>,
        e: &Expected,
        usage: Usage,
        response_id: Option<String>,
    ) {
        let split = missed::attribute(&e.known, usage.prompt_tokens, usage.cached_tokens);
        let m = &self.metrics;
        let mut by = ModelTenantCause {
            model: labels.model.clone(),
            tenant: labels.tenant.clone(),
            cause: "",
        };
        for cause in Cause::ALL {
            let tokens = split.of(cause);
            if tokens > 0 {
                by.cause = cause.as_str();
                m.missed_prompt_tokens.get_or_create(&by).inc_by(tokens);
            }
        }
        let ModelTenantCause { model, tenant, .. } = by;
        let elsewhere = split.of(Cause::RoutedElsewhere);
        if let Some(lost) = split.lost.filter(|_| elsewhere > 0) {
            let by = ModelReason {
                model: model.clone(),
                reason: lost.as_str(),
            };
            m.routed_elsewhere_tokens
                .get_or_create(&by)
                .inc_by(elsewhere);
        }
        let mut pressure = self.pressure.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now().into_std();
        let evicted = split.of(Cause::Evicted);
        match pressure.get_mut(&model) {
            Some(w) => w.record(now, evicted, usage.prompt_tokens),
            None => {
                let mut w = missed::Pressure::default();
                w.record(now, evicted, usage.prompt_tokens);
                pressure.insert(model.clone(), w);
            }
        }
        drop(pressure);
        self.recent.push(Entry {
            id: e.id.clone(),
            response_id,
            at: std::time::SystemTime::now(),
            model,
            tenant,
            endpoint: endpoint.clone(),
            key: e.key,
            first_block: e.first_block,
            block_size: e.known.block_tokens,
            prompt_tokens: e.prompt_tokens,
            expected_cached: e.cached,
            usage,
            split,
            held: e.held,
        });
    }

    /// Sets `kvroute_cache_pressure` as of now.
    pub(super) fn set_pressure(&self) {
        let now = Instant::now().into_std();
        let mut p = self.pressure.lock().unwrap_or_else(|e| e.into_inner());
        for (model, window) in p.iter_mut() {
            self.metrics
                .cache_pressure
                .get_or_create(&Model {
                    model: model.clone(),
                })
                .set(window.share(now));
        }
    }

    /// A recent request's record, by its `x-request-id` or the engine's
    /// response id.
    pub fn recorded(&self, id: &str) -> Option<Recorded> {
        self.recent.find(id)
    }
}
