//! The router's Prometheus metrics, in the text exposition format.
//! Counters and histograms are kept here; per-endpoint gauges are read from
//! the pool at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::pool::Pool;
use kvroute_core::contract::Contract;

/// Metric names with their type and help text.
const FAMILIES: &[(&str, &str, &str)] = &[
    (
        "kvroute_requests_total",
        "counter",
        "Requests answered, by model (a served model, else unknown) and status: the HTTP status, stream_error when the engine's stream broke mid-way, 499 when the client left first.",
    ),
    (
        "kvroute_prompts_not_tokenized_total",
        "counter",
        "Requests whose body exceeded limits.maxTokenizeBytes: routed without reading the prompt.",
    ),
    (
        "kvroute_ejections_total",
        "counter",
        "Endpoints ejected, by the fault that tipped them: connect, status, timeout, stream, health_check.",
    ),
    (
        "kvroute_ejections_refused_total",
        "counter",
        "Ejections not made because resilience.maxEjectedPercent of the endpoints were already ejected, by fault.",
    ),
    (
        "kvroute_restorations_total",
        "counter",
        "Ejected endpoints restored, by reason: expired (on probation) or health_check.",
    ),
    (
        "kvroute_connections_refused_total",
        "counter",
        "Client connections closed before serving a request, by listener and reason: max_connections, accept_error, tls_handshake, tls_timeout.",
    ),
    (
        "kvroute_routing_decisions_total",
        "counter",
        "Routing decisions by reason: warm (longest cached prefix), cold (no cached prefix; rendezvous first choice), spill (first choice over its load bound), retry (a later attempt).",
    ),
    (
        "kvroute_first_choice_total",
        "counter",
        "Requests served by the policy's first choice.",
    ),
    (
        "kvroute_routed_total",
        "counter",
        "Requests sent to an endpoint (first attempts).",
    ),
    (
        "kvroute_prompt_tokens_total",
        "counter",
        "Prompt tokens of routed requests, as the router computed them, by model and tenant.",
    ),
    (
        "kvroute_expected_cached_tokens_total",
        "counter",
        "Prompt tokens the router expected the chosen endpoint to hold cached, by model and tenant. Divided by kvroute_prompt_tokens_total: the expected hit rate.",
    ),
    (
        "kvroute_observed_prompt_tokens_total",
        "counter",
        "Prompt tokens the engines reported (usage.prompt_tokens) in responses that reported cached tokens, by model and tenant.",
    ),
    (
        "kvroute_observed_cached_tokens_total",
        "counter",
        "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens), by model and tenant. Divided by kvroute_observed_prompt_tokens_total: the observed hit rate.",
    ),
    (
        "kvroute_hit_rate_gap",
        "gauge",
        "Expected minus observed hit rate over the model's last 500 requests that reported cached tokens.",
    ),
    (
        "kvroute_hit_rate_gap_alerts_total",
        "counter",
        "Times a model's hit-rate gap was sustained (at least 0.2 over 50 or more requests; at most one per 5 minutes), each logged with an example response id.",
    ),
    (
        "kvroute_volatile_prefix_requests_total",
        "counter",
        "Requests whose chain was new from an early block although most of their later blocks' contents were seen recently (a timestamp or id early in the prompt), by model and tenant; see /debug/prefixes.",
    ),
    (
        "kvroute_upstream_failures_total",
        "counter",
        "Failed attempts by endpoint and kind (connect, status, timeout, stream).",
    ),
    (
        "kvroute_decision_seconds",
        "histogram",
        "Time to parse, tokenize, hash and rank a request.",
    ),
    (
        "kvroute_upstream_ttft_seconds",
        "histogram",
        "From sending a request to the engine to its first response body byte.",
    ),
    (
        "kvroute_endpoint_in_flight",
        "gauge",
        "Requests in flight per endpoint.",
    ),
    (
        "kvroute_endpoint_prefill_tokens",
        "gauge",
        "Estimated uncached prompt tokens not yet past prefill, per endpoint.",
    ),
    (
        "kvroute_endpoint_cached_blocks",
        "gauge",
        "Blocks the occupancy index holds per endpoint.",
    ),
    (
        "kvroute_endpoint_queue_seconds",
        "gauge",
        "Predicted prefill queue per endpoint: how long a new request would wait for its prefill to start (fleet-wide when the engine reports load).",
    ),
    (
        "kvroute_endpoint_load_report_age_seconds",
        "gauge",
        "Age of the engine's last WatchCache load report per endpoint.",
    ),
    (
        "kvroute_endpoint_ejected",
        "gauge",
        "1 while an endpoint is ejected for failures.",
    ),
    (
        "kvroute_endpoint_routable",
        "gauge",
        "1 when an endpoint is ready, not draining and not ejected.",
    ),
    (
        "kvroute_watch_cache_stream",
        "gauge",
        "WatchCache stream state per endpoint (1 for the current state).",
    ),
    (
        "kvroute_endpoint_contract",
        "gauge",
        "Engine contract per endpoint (1 for the current state): whether the engine's block size, hash algorithm and seed match the routing settings.",
    ),
    (
        "kvroute_index_entries",
        "gauge",
        "(block, endpoint) entries in the occupancy index.",
    ),
];

const BUCKETS: [f64; 16] = [
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

type Key = (&'static str, String);

#[derive(Debug, Default)]
struct Registry {
    counters: BTreeMap<Key, f64>,
    histograms: BTreeMap<Key, Histogram>,
}

/// The router's counters and histograms.
#[derive(Debug, Default)]
pub struct Metrics {
    registry: Mutex<Registry>,
}

fn labels(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| {
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{v}\"")
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl Metrics {
    /// Adds `by` to a counter.
    pub fn inc(&self, name: &'static str, pairs: &[(&str, &str)], by: f64) {
        let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        *r.counters.entry((name, labels(pairs))).or_default() += by;
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, pairs: &[(&str, &str)], value: f64) {
        let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        r.counters.insert((name, labels(pairs)), value);
    }

    /// Records a histogram observation, in seconds.
    pub fn observe(&self, name: &'static str, pairs: &[(&str, &str)], seconds: f64) {
        let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let h = r.histograms.entry((name, labels(pairs))).or_default();
        for (bucket, count) in BUCKETS.iter().zip(&mut h.counts) {
            if seconds <= *bucket {
                *count += 1;
            }
        }
        h.sum += seconds;
        h.count += 1;
    }

    /// The exposition text, with the pool's gauges.
    pub fn render(&self, pool: &Pool) -> String {
        let mut samples: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let endpoints = pool.status();
        {
            let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            // Series of endpoints that left the pool go with them.
            let present: Vec<String> = endpoints
                .iter()
                .map(|e| labels(&[("endpoint", &e.name)]))
                .collect();
            r.counters.retain(|(_, l), _| {
                !l.starts_with("endpoint=")
                    || present.iter().any(|p| {
                        l == p
                            || l.strip_prefix(p.as_str())
                                .is_some_and(|t| t.starts_with(','))
                    })
            });
            for ((name, l), v) in &r.counters {
                samples
                    .entry(name)
                    .or_default()
                    .push(format!("{name}{{{l}}} {v}"));
            }
            for ((name, l), h) in &r.histograms {
                let out = samples.entry(name).or_default();
                let sep = if l.is_empty() { "" } else { "," };
                for (bucket, count) in BUCKETS.iter().zip(&h.counts) {
                    out.push(format!("{name}_bucket{{{l}{sep}le=\"{bucket}\"}} {count}"));
                }
                out.push(format!("{name}_bucket{{{l}{sep}le=\"+Inf\"}} {}", h.count));
                let l = if l.is_empty() {
                    String::new()
                } else {
                    format!("{{{l}}}")
                };
                out.push(format!("{name}_sum{l} {}", h.sum));
                out.push(format!("{name}_count{l} {}", h.count));
            }
        }
        for e in endpoints {
            let l = labels(&[("endpoint", &e.name)]);
            let mut gauge = |name: &'static str, v: String| {
                samples
                    .entry(name)
                    .or_default()
                    .push(format!("{name}{{{l}}} {v}"));
            };
            gauge("kvroute_endpoint_in_flight", e.in_flight.to_string());
            gauge(
                "kvroute_endpoint_prefill_tokens",
                e.prefill_tokens.to_string(),
            );
            gauge(
                "kvroute_endpoint_cached_blocks",
                e.cached_blocks.to_string(),
            );
            gauge(
                "kvroute_endpoint_queue_seconds",
                e.queue_seconds.to_string(),
            );
            if let Some(age) = e.load_report_age_seconds {
                gauge("kvroute_endpoint_load_report_age_seconds", age.to_string());
            }
            gauge("kvroute_endpoint_ejected", u8::from(e.ejected).to_string());
            let routable = e.ready && !e.draining && !e.ejected;
            gauge("kvroute_endpoint_routable", u8::from(routable).to_string());
            for state in ["none", "connecting", "live"] {
                let l = labels(&[("endpoint", &e.name), ("state", state)]);
                let v = u8::from(e.stream == state);
                samples
                    .entry("kvroute_watch_cache_stream")
                    .or_default()
                    .push(format!("kvroute_watch_cache_stream{{{l}}} {v}"));
            }
            for state in Contract::STATES {
                let l = labels(&[("endpoint", &e.name), ("state", state)]);
                let v = u8::from(e.contract == state);
                samples
                    .entry("kvroute_endpoint_contract")
                    .or_default()
                    .push(format!("kvroute_endpoint_contract{{{l}}} {v}"));
            }
        }
        samples
            .entry("kvroute_index_entries")
            .or_default()
            .push(format!("kvroute_index_entries {}", pool.index_entries()));

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
    use kvroute_core::policy::PolicyConfig;

    use super::*;
    use crate::config::Resilience;
    use crate::settings::Settings;

    fn pool() -> std::sync::Arc<Pool> {
        Pool::new(
            Settings::builtin(PolicyConfig::default()),
            &Resilience::default(),
            Default::default(),
            8,
            None,
        )
    }

    #[test]
    fn series_of_removed_endpoints_are_dropped() {
        let m = Metrics::default();
        let pool = pool();
        let spec = |name: &str| crate::pool::EndpointSpec {
            name: name.into(),
            http: "127.0.0.1:1".parse().unwrap(),
            cache: None,
            ready: true,
            draining: false,
        };
        pool.set_endpoints(vec![spec("a"), spec("ab")]);
        for e in ["a", "ab"] {
            m.inc(
                "kvroute_upstream_failures_total",
                &[("endpoint", e), ("kind", "connect")],
                1.0,
            );
        }
        assert!(m.render(&pool).contains("endpoint=\"a\",kind"));
        pool.set_endpoints(vec![spec("ab")]);
        let text = m.render(&pool);
        assert!(!text.contains("endpoint=\"a\",kind"), "{text}");
        assert!(text.contains("endpoint=\"ab\",kind"), "{text}");
    }

    #[test]
    fn renders_counters_histograms_and_pool_gauges() {
        let m = Metrics::default();
        m.inc(
            "kvroute_requests_total",
            &[("model", "m\"x"), ("status", "200")],
            1.0,
        );
        m.inc(
            "kvroute_requests_total",
            &[("model", "m\"x"), ("status", "200")],
            1.0,
        );
        m.observe("kvroute_decision_seconds", &[], 0.002);
        let pool = pool();
        let text = m.render(&pool);
        assert!(
            text.contains("kvroute_requests_total{model=\"m\\\"x\",status=\"200\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_decision_seconds_bucket{le=\"0.005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_decision_seconds_bucket{le=\"0.001\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE kvroute_decision_seconds histogram"));
        assert!(text.contains("kvroute_index_entries 0\n"));
    }
}
