//! Everything the router counts and records of the requests it routes,
//! whichever front end sent them: the metrics, the expected-against-
//! observed hit-rate gap ([`super::hit_rate`]), volatile prefixes
//! ([`crate::prompt::prefixes`]), the cache-pressure window and the ring
//! of recent requests ([`super::observed`]), the throttled per-request
//! warnings, and the hang deadline each attempt is sent with
//! ([`super::hang`]). A [`Decision`](super::Decision), its
//! [`Guard`](super::Guard) and their [`Labels`] hold it
//! (with the pool), not the decision service.
//!
//! Not here: admitting, reading and planning a request ([`super::Service`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::hang;
use super::hit_rate::Gap;
use super::labels::Labels;
use super::missed::Pressure;
use super::recent::Recent;
use crate::config::Config;
use crate::metrics::{Metrics, ModelTenant};
use crate::pool::{Fault, Pool};
use crate::prompt::Analysis;
use crate::prompt::prefixes::{Offender, Volatility};
use crate::tenancy::Tenancy;
use crate::throttle::Warnings;

/// The counters and records of routed requests.
#[derive(Debug)]
pub struct Accounting {
    /// Counters and histograms.
    pub metrics: Arc<Metrics>,
    /// Tenants named in metrics.
    tenant_labels: HashSet<String>,
    /// Expected against observed hit rate, per model.
    pub(super) gap: Mutex<Gap>,
    /// Volatile prefix detection.
    prefixes: Mutex<Volatility>,
    /// The `evicted` share of prompt tokens, per model label.
    pub(super) pressure: Mutex<HashMap<String, Pressure>>,
    /// Recent requests' missed tokens.
    pub(super) recent: Recent,
    /// `telemetry.cacheHeader`.
    pub(crate) cache_header: bool,
    /// When an attempt counts as hung.
    pub(super) hang: hang::Deadline,
    /// Per-request warnings, throttled per endpoint and reason.
    pub(crate) warnings: Warnings,
    /// Prompt tokens the engines computed (prompt − cached) in responses
    /// with usage: all prefill, for the warm-ups' budget.
    pub(crate) prefilled: AtomicU64,
}

impl Accounting {
    /// Accounting into `metrics`, naming the tenants of `tenancy` and
    /// `telemetry.tenantLabels` of `config`.
    pub fn new(metrics: Arc<Metrics>, tenancy: &Tenancy, config: &Config) -> Self {
        Accounting {
            metrics,
            tenant_labels: tenancy
                .tenants()
                .chain(config.telemetry.tenant_labels.iter().cloned())
                .collect(),
            gap: Mutex::default(),
            prefixes: Mutex::default(),
            pressure: Mutex::default(),
            recent: Recent::default(),
            cache_header: config.telemetry.cache_header,
            hang: hang::Deadline::new(&config.resilience, &config.limits),
            warnings: Warnings::default(),
            prefilled: AtomicU64::new(0),
        }
    }

    /// The longest an attempt waits for its first byte ([`hang::Deadline::cap`]).
    pub(crate) fn hang_cap(&self) -> Duration {
        self.hang.cap()
    }

    /// When a prefill leg predicted to answer after `ttft` counts as hung:
    /// as a request for one token, not streamed.
    pub(crate) fn prefill_leg_deadline(&self, ttft: Duration) -> Duration {
        (self.hang.of(false, Some(1), ttft)).unwrap_or(self.hang.cap())
    }

    /// `tenant` as a metric label: a tenant of the API-key map or of
    /// `telemetry.tenantLabels`, `none` without one, else `other`.
    pub(crate) fn tenant_label(&self, tenant: Option<&str>) -> String {
        match tenant {
            None => "none".into(),
            Some(t) if self.tenant_labels.contains(t) => t.into(),
            Some(_) => "other".into(),
        }
    }

    /// Counts a request's `{model, tenant}` labels as routed with its
    /// prompt tokens.
    pub(super) fn count_routed(&self, by: &ModelTenant, prompt_tokens: u64) {
        self.metrics.routed.inc();
        self.metrics
            .prompt_tokens
            .get_or_create(by)
            .inc_by(prompt_tokens);
    }

    /// Counts a failed attempt at endpoint `name` (`kind`), and tells
    /// `pool` of the endpoint's `fault` when it is one, counting what that
    /// did to its health.
    pub(crate) fn failure(
        &self,
        pool: &Pool,
        name: &str,
        kind: &'static str,
        fault: Option<Fault>,
    ) {
        if let Some(fault) = fault {
            self.metrics.health(pool.failed(name, fault));
        }
        self.metrics.upstream_failure(name, kind);
    }

    /// Looks for where a routed request of `tenant` (a hash) left a recent
    /// prompt whose later contents recur (see
    /// [`prefixes`](crate::prompt::prefixes)), and returns that block;
    /// counts an early one as a volatile prefix.
    pub(super) fn volatile(
        &self,
        analysis: &Analysis,
        labels: &Labels,
        tenant: u64,
    ) -> Option<u32> {
        let mut v = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        let first = analysis.chain.first().copied();
        let d = v.observe(tenant, first, &analysis.contents)?;
        if !d.early() {
            return Some(d.block as u32);
        }
        v.record(
            &d,
            analysis.block_tokens as usize,
            &labels.model,
            &labels.tenant,
        );
        drop(v);
        self.metrics
            .volatile_prefix_requests
            .get_or_create(&labels.model_tenant())
            .inc();
        Some(d.block as u32)
    }

    /// The recurring volatile prefixes, most frequent first.
    pub fn volatile_prefixes(&self) -> Vec<Offender> {
        self.prefixes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .offenders()
    }
}
