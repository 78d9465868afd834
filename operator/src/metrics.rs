//! The operator's Prometheus metrics: typed families on
//! `prometheus-client`, in the OpenMetrics text format. Counters live here
//! and are bumped by the status writer, the watchers, the lease and the
//! event publisher; gauges (pools, ready endpoints, WatchPool subscribers,
//! leadership, readiness) are read by the caller at scrape time and passed
//! to [`Metrics::render`], so they can never go stale.
//!
//! Not here: serving the text ([`crate::admin`]) or deciding when the
//! operator is ready.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct What {
    what: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Refused {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    namespace: String,
    pool: String,
}

/// The operator's counters. Cheap to bump from any task; render at scrape
/// time with the current [`Gauges`].
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    errors: Family<What, Counter>,
    status_patches: Family<Kind, Counter>,
    watch_restarts: Family<Kind, Counter>,
    events: Family<Reason, Counter>,
    warmup_reports_refused: Family<Refused, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            registry: Registry::default(),
            reconciles: Counter::default(),
            errors: Family::default(),
            status_patches: Family::default(),
            watch_restarts: Family::default(),
            events: Family::default(),
            warmup_reports_refused: Family::default(),
        };
        let mut registry = Registry::default();
        // Counters are registered without `_total`, which the encoder adds.
        registry.register(
            "kvroute_operator_reconciles",
            "Passes of the status writer over every pool and policy",
            m.reconciles.clone(),
        );
        registry.register(
            "kvroute_operator_errors",
            "Failed API calls by what was attempted (status_patch, event, lease, watch), watched objects kvroute could not read (decode), and watches of an optional kind whose CRD is not installed (crd_missing, once per attempt)",
            m.errors.clone(),
        );
        registry.register(
            "kvroute_operator_status_patches",
            "Status patches sent, by kind (InferencePool, CacheRoutingPolicy)",
            m.status_patches.clone(),
        );
        registry.register(
            "kvroute_operator_watch_restarts",
            "Watches relisted after their first list or failed, by kind (InferencePool, CacheRoutingPolicy, Service, Pod, InferenceObjective)",
            m.watch_restarts.clone(),
        );
        registry.register(
            "kvroute_operator_events",
            "Kubernetes Events published, by reason",
            m.events.clone(),
        );
        registry.register(
            "kvroute_operator_warmup_reports_refused",
            "ReportWarmups calls refused, status unchanged, by reason: unknown_router (the pool's state names no ready router by the report's name), wrong_address (not from that router pod's IP), too_large (over 4,096 entries or a name over 256 bytes)",
            m.warmup_reports_refused.clone(),
        );
        Metrics { registry, ..m }
    }
}

/// Values read at scrape time.
#[derive(Debug, Default)]
pub struct Gauges {
    /// Ready endpoints of every pool the operator knows.
    pub pools: Vec<PoolGauge>,
    /// Open WatchPool streams.
    pub subscribers: usize,
    /// Whether this replica holds the lease.
    pub leader: bool,
    /// Whether the initial lists are in (see [`crate::watch`]).
    pub ready: bool,
}

/// One pool's gauge.
#[derive(Debug)]
pub struct PoolGauge {
    /// The pool's namespace.
    pub namespace: String,
    /// The pool's name.
    pub name: String,
    /// Endpoints ready to receive traffic.
    pub ready_endpoints: u32,
}

impl Metrics {
    /// One pass of the status writer over every pool and policy.
    pub fn reconcile(&self) {
        self.reconciles.inc();
    }

    /// A failed API call, an object that could not be read, or a watch
    /// attempt that found its optional CRD missing; `what` is one of
    /// "status_patch", "event", "lease", "watch", "decode", "crd_missing".
    pub fn error(&self, what: &'static str) {
        self.errors.get_or_create(&What { what }).inc();
    }

    /// A status patch sent; kind is "InferencePool" or "CacheRoutingPolicy".
    pub fn status_patch(&self, kind: &'static str) {
        self.status_patches.get_or_create(&Kind { kind }).inc();
    }

    /// A watch of `kind` (InferencePool, CacheRoutingPolicy, Service, Pod,
    /// InferenceObjective) restarted: relisted after the first list, or
    /// failed (not for a missing optional CRD: that is `crd_missing`).
    pub fn watch_restart(&self, kind: &'static str) {
        self.watch_restarts.get_or_create(&Kind { kind }).inc();
    }

    /// An Event published; `reason` is the event's reason (one of the
    /// operator's own, so the label stays bounded).
    pub fn event(&self, reason: &str) {
        let reason = reason.to_owned();
        self.events.get_or_create(&Reason { reason }).inc();
    }

    /// A `ReportWarmups` call refused; `reason` is one of "unknown_router",
    /// "wrong_address", "too_large".
    pub fn warmup_report_refused(&self, reason: &'static str) {
        let refused = Refused { reason };
        self.warmup_reports_refused.get_or_create(&refused).inc();
    }

    /// The exposition text. Gauges are passed in at scrape time.
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut r = Registry::default();
        let gauge = |v: usize| {
            let g = Gauge::<i64>::default();
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
            g
        };
        r.register(
            "kvroute_operator_pools",
            "InferencePools the operator knows",
            gauge(gauges.pools.len()),
        );
        let ready = Family::<PoolLabels, Gauge>::default();
        for p in &gauges.pools {
            let labels = PoolLabels {
                namespace: p.namespace.clone(),
                pool: p.name.clone(),
            };
            ready
                .get_or_create(&labels)
                .set(i64::from(p.ready_endpoints));
        }
        r.register(
            "kvroute_operator_ready_endpoints",
            "Ready endpoints per InferencePool, as sent to routers",
            ready,
        );
        r.register(
            "kvroute_operator_watchpool_subscribers",
            "Routers subscribed over EndpointDiscovery.WatchPool",
            gauge(gauges.subscribers),
        );
        r.register(
            "kvroute_operator_leader",
            "1 while this replica holds the lease and writes status",
            gauge(usize::from(gauges.leader)),
        );
        r.register(
            "kvroute_operator_ready",
            "1 once the initial lists of pools, policies, Services, pods and (when their CRD is installed) objectives are in",
            gauge(usize::from(gauges.ready)),
        );
        kvroute_telemetry::metrics::encode(&[&self.registry, &r])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(namespace: &str, name: &str, ready_endpoints: u32) -> PoolGauge {
        PoolGauge {
            namespace: namespace.into(),
            name: name.into(),
            ready_endpoints,
        }
    }

    #[test]
    fn a_fresh_operator_shows_zero_reconciles_and_its_gauges() {
        let text = Metrics::default().render(&Gauges::default());
        for line in [
            "# TYPE kvroute_operator_reconciles counter",
            "kvroute_operator_reconciles_total 0",
            "kvroute_operator_pools 0",
            "kvroute_operator_watchpool_subscribers 0",
            "kvroute_operator_leader 0",
            "kvroute_operator_ready 0",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(!text.contains("kvroute_operator_errors_total"), "{text}");
    }

    #[test]
    fn counters_count_per_label_and_gauges_show_what_was_passed_in() {
        let m = Metrics::default();
        m.reconcile();
        m.reconcile();
        m.error("watch");
        m.error("watch");
        m.error("lease");
        m.status_patch("InferencePool");
        m.watch_restart("Pod");
        m.event("PoolReady");
        let text = m.render(&Gauges {
            pools: vec![pool("prod", "llama", 3), pool("dev", "qwen", 0)],
            subscribers: 4,
            leader: true,
            ready: true,
        });
        for line in [
            "kvroute_operator_reconciles_total 2",
            "kvroute_operator_errors_total{what=\"lease\"} 1",
            "kvroute_operator_errors_total{what=\"watch\"} 2",
            "kvroute_operator_status_patches_total{kind=\"InferencePool\"} 1",
            "kvroute_operator_watch_restarts_total{kind=\"Pod\"} 1",
            "kvroute_operator_events_total{reason=\"PoolReady\"} 1",
            "kvroute_operator_pools 2",
            "kvroute_operator_ready_endpoints{namespace=\"dev\",pool=\"qwen\"} 0",
            "kvroute_operator_ready_endpoints{namespace=\"prod\",pool=\"llama\"} 3",
            "kvroute_operator_watchpool_subscribers 4",
            "kvroute_operator_leader 1",
            "kvroute_operator_ready 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let m = Metrics::default();
        m.event("a\"b\\c\nd");
        let text = m.render(&Gauges {
            pools: vec![pool("ns", "we\"ird", 1)],
            ..Gauges::default()
        });
        assert!(
            text.lines()
                .any(|l| l == r#"kvroute_operator_events_total{reason="a\"b\\c\nd"} 1"#),
            "{text}"
        );
        assert!(
            text.lines().any(
                |l| l == r#"kvroute_operator_ready_endpoints{namespace="ns",pool="we\"ird"} 1"#
            ),
            "{text}"
        );
    }
}
