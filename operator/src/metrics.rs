//! The operator's Prometheus metrics, in the text exposition format (0.0.4).
//! Counters live here and are bumped by the status writer, the watchers, the
//! lease and the event publisher; gauges (pools, ready endpoints, WatchPool
//! subscribers, leadership, readiness) are read by the caller at scrape time
//! and passed to [`Metrics::render`], so they can never go stale.
//!
//! Not here: serving the text ([`crate::admin`]) or deciding when the
//! operator is ready.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

const RECONCILES: &str = "kvroute_operator_reconciles_total";
const ERRORS: &str = "kvroute_operator_errors_total";
const STATUS_PATCHES: &str = "kvroute_operator_status_patches_total";
const WATCH_RESTARTS: &str = "kvroute_operator_watch_restarts_total";
const EVENTS: &str = "kvroute_operator_events_total";
const POOLS: &str = "kvroute_operator_pools";
const READY_ENDPOINTS: &str = "kvroute_operator_ready_endpoints";
const SUBSCRIBERS: &str = "kvroute_operator_watchpool_subscribers";
const LEADER: &str = "kvroute_operator_leader";
const READY: &str = "kvroute_operator_ready";

/// Metric names with their type and help text, in the order they render.
const FAMILIES: &[(&str, &str, &str)] = &[
    (
        RECONCILES,
        "counter",
        "Passes of the status writer over every pool and policy.",
    ),
    (
        ERRORS,
        "counter",
        "Failed API calls by what was attempted (status_patch, event, lease, watch), and watched objects kvroute could not read (decode).",
    ),
    (
        STATUS_PATCHES,
        "counter",
        "Status patches sent, by kind (InferencePool, CacheRoutingPolicy).",
    ),
    (
        WATCH_RESTARTS,
        "counter",
        "Watches relisted after their first list or failed, by kind (InferencePool, CacheRoutingPolicy, Pod).",
    ),
    (EVENTS, "counter", "Kubernetes Events published, by reason."),
    (POOLS, "gauge", "InferencePools the operator knows."),
    (
        READY_ENDPOINTS,
        "gauge",
        "Ready endpoints per InferencePool, as sent to routers.",
    ),
    (
        SUBSCRIBERS,
        "gauge",
        "Routers subscribed over EndpointDiscovery.WatchPool.",
    ),
    (
        LEADER,
        "gauge",
        "1 while this replica holds the lease and writes status.",
    ),
    (
        READY,
        "gauge",
        "1 once the initial lists of pools, policies and pods are in.",
    ),
];

/// The operator's counters. Cheap to bump from any task; render at scrape
/// time with the current [`Gauges`].
#[derive(Debug, Default)]
pub struct Metrics {
    // Unlabelled, so it is kept apart and always rendered, even at 0.
    reconciles: AtomicU64,
    // (family, rendered labels) -> count; a BTreeMap keeps output stable.
    labelled: Mutex<BTreeMap<(&'static str, String), u64>>,
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
    /// Whether the initial lists of pools, policies and pods are in.
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

/// Renders `name{k="v",...}`, escaping values as the format requires, or
/// just `name` without labels.
fn series(name: &str, pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return name.to_owned();
    }
    let labels: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{v}\"")
        })
        .collect();
    format!("{name}{{{}}}", labels.join(","))
}

impl Metrics {
    /// One pass of the status writer over every pool and policy.
    pub fn reconcile(&self) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
    }

    /// A failed API call, or an object that could not be read; `what` is
    /// one of "status_patch", "event", "lease", "watch", "decode".
    pub fn error(&self, what: &'static str) {
        self.inc(ERRORS, "what", what);
    }

    /// A status patch sent; kind is "InferencePool" or "CacheRoutingPolicy".
    pub fn status_patch(&self, kind: &'static str) {
        self.inc(STATUS_PATCHES, "kind", kind);
    }

    /// A watch of `kind` (InferencePool, CacheRoutingPolicy, Pod) restarted:
    /// relisted after the first list, or failed.
    pub fn watch_restart(&self, kind: &'static str) {
        self.inc(WATCH_RESTARTS, "kind", kind);
    }

    /// An Event published; `reason` is the event's reason.
    pub fn event(&self, reason: &str) {
        self.inc(EVENTS, "reason", reason);
    }

    fn inc(&self, family: &'static str, label: &str, value: &str) {
        // A panic elsewhere while holding the lock leaves the counts valid.
        let mut labelled = self.labelled.lock().unwrap_or_else(|e| e.into_inner());
        *labelled
            .entry((family, series(family, &[(label, value)])))
            .or_default() += 1;
    }

    /// The exposition text. Gauges are passed in at scrape time.
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut samples: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut sample = |family: &'static str, series: String, value: String| {
            samples
                .entry(family)
                .or_default()
                .push(format!("{series} {value}"));
        };
        let reconciles = self.reconciles.load(Ordering::Relaxed);
        sample(RECONCILES, RECONCILES.to_owned(), reconciles.to_string());
        {
            let labelled = self.labelled.lock().unwrap_or_else(|e| e.into_inner());
            for ((family, series), count) in labelled.iter() {
                sample(family, series.clone(), count.to_string());
            }
        }
        sample(POOLS, POOLS.to_owned(), gauges.pools.len().to_string());
        let mut pools: Vec<&PoolGauge> = gauges.pools.iter().collect();
        pools.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        for p in pools {
            let labels = [
                ("namespace", p.namespace.as_str()),
                ("pool", p.name.as_str()),
            ];
            sample(
                READY_ENDPOINTS,
                series(READY_ENDPOINTS, &labels),
                p.ready_endpoints.to_string(),
            );
        }
        sample(
            SUBSCRIBERS,
            SUBSCRIBERS.to_owned(),
            gauges.subscribers.to_string(),
        );
        sample(
            LEADER,
            LEADER.to_owned(),
            u8::from(gauges.leader).to_string(),
        );
        sample(READY, READY.to_owned(), u8::from(gauges.ready).to_string());

        let mut out = String::new();
        for (name, kind, help) in FAMILIES {
            if let Some(lines) = samples.get(name) {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
                for line in lines {
                    let _ = writeln!(out, "{line}");
                }
            }
        }
        out
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
    fn a_fresh_operator_shows_zero_reconciles_and_its_gauges_only() {
        let text = Metrics::default().render(&Gauges::default());
        assert_eq!(
            text,
            "\
# HELP kvroute_operator_reconciles_total Passes of the status writer over every pool and policy.
# TYPE kvroute_operator_reconciles_total counter
kvroute_operator_reconciles_total 0
# HELP kvroute_operator_pools InferencePools the operator knows.
# TYPE kvroute_operator_pools gauge
kvroute_operator_pools 0
# HELP kvroute_operator_watchpool_subscribers Routers subscribed over EndpointDiscovery.WatchPool.
# TYPE kvroute_operator_watchpool_subscribers gauge
kvroute_operator_watchpool_subscribers 0
# HELP kvroute_operator_leader 1 while this replica holds the lease and writes status.
# TYPE kvroute_operator_leader gauge
kvroute_operator_leader 0
# HELP kvroute_operator_ready 1 once the initial lists of pools, policies and pods are in.
# TYPE kvroute_operator_ready gauge
kvroute_operator_ready 0
"
        );
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
        // Sorted by namespace, then name, whatever order they came in.
        let dev = text.find("namespace=\"dev\"").unwrap();
        let prod = text.find("namespace=\"prod\"").unwrap();
        assert!(dev < prod, "{text}");
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

    #[test]
    fn help_and_type_appear_once_per_family_before_its_samples() {
        let m = Metrics::default();
        for reason in ["A", "B", "C"] {
            m.event(reason);
        }
        m.error("event");
        m.error("status_patch");
        let text = m.render(&Gauges {
            pools: vec![pool("a", "x", 1), pool("b", "y", 2)],
            ..Gauges::default()
        });
        let mut typed = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(!typed.contains(&name), "TYPE twice for {name}:\n{text}");
                typed.push(name);
            } else if !line.starts_with("# HELP ") {
                let name = line.split(['{', ' ']).next().unwrap();
                assert_eq!(typed.last(), Some(&name), "{line:?} outside its family");
            }
        }
        let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!(helps, typed.len(), "{text}");
        assert!(typed.contains(&EVENTS) && typed.contains(&READY_ENDPOINTS));
    }
}
