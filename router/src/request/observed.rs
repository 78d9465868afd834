//! What a served request's usage tells, after its response: its missed
//! tokens counted by cause ([`super::missed`]), the pressure window behind
//! `kvroute_cache_pressure`, and the ring of recent requests behind
//! `GET /debug/requests/{id}`.

use tokio::time::Instant;

use super::Service;
use super::guard::Expected;
use super::hit_rate::Usage;
use super::labels::Labels;
use super::missed::{self, Cause};
use crate::admin::explain::Recorded;
use crate::metrics::{Model, ModelReason, ModelTenantCause};

impl Service {
    /// Attributes the missed tokens of a request `labels` sent to
    /// `endpoint` expecting `e`, whose engine reported `usage` in its
    /// response `response_id` ([`missed`]): counted, in the pressure
    /// window, and recorded for `/debug/requests`.
    pub(crate) fn missed(
        &self,
        labels: &Labels,
        endpoint: &str,
        e: &Expected,
        usage: Usage,
        response_id: Option<String>,
    ) {
        let split = missed::attribute(&e.known, usage.prompt_tokens, usage.cached_tokens);
        let m = &self.metrics;
        let (model, tenant) = (&labels.model, &labels.tenant);
        for (cause, tokens) in split.causes() {
            m.missed_prompt_tokens
                .get_or_create(&ModelTenantCause {
                    model: model.clone(),
                    tenant: tenant.clone(),
                    cause: cause.as_str(),
                })
                .inc_by(tokens);
        }
        if let Some(lost) = split.lost {
            m.routed_elsewhere_tokens
                .get_or_create(&ModelReason {
                    model: model.clone(),
                    reason: lost.as_str(),
                })
                .inc_by(split.of(Cause::RoutedElsewhere));
        }
        let mut pressure = self.pressure.lock().unwrap_or_else(|e| e.into_inner());
        pressure.entry(model.clone()).or_default().record(
            Instant::now().into_std(),
            split.of(Cause::Evicted),
            usage.prompt_tokens,
        );
        drop(pressure);
        let hex = |h: u64| format!("{h:016x}");
        self.recent.push(Recorded {
            request_id: e.id.as_str().to_owned(),
            response_id,
            at_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.clone(),
            tenant: tenant.clone(),
            endpoint: endpoint.to_owned(),
            key: hex(e.key),
            first_block: e.first_block.map(hex),
            block_size: e.known.block_tokens,
            router_prompt_tokens: e.prompt_tokens,
            prompt_tokens: usage.prompt_tokens,
            expected_cached_tokens: e.cached,
            cached_tokens: usage.cached_tokens,
            missed: (split.causes().iter())
                .map(|(c, n)| (c.as_str().to_owned(), *n))
                .collect(),
            routed_elsewhere_reason: split.lost.map(|l| l.as_str().to_owned()),
        });
    }

    /// The exposition text of `/metrics`, with `kvroute_cache_pressure`
    /// as of now.
    pub fn render_metrics(&self) -> String {
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
        drop(p);
        self.metrics.render(&self.pool)
    }

    /// A recent request's record, by its `x-request-id` or the engine's
    /// response id.
    pub fn recorded(&self, id: &str) -> Option<Recorded> {
        self.recent.find(id)
    }
}
