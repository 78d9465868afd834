use kvroute_core::policy::PolicyConfig;

use super::*;
use crate::config::Resilience;
use crate::pool::Fault;
use crate::settings::Settings;

fn pool() -> std::sync::Arc<Pool> {
    Pool::new(
        Settings::builtin(PolicyConfig::default()),
        &Resilience::default(),
        8,
    )
}

fn spec(name: &str) -> crate::pool::EndpointSpec {
    crate::pool::EndpointSpec {
        name: name.into(),
        http: "127.0.0.1:1".parse().unwrap(),
        cache: None,
        ready: true,
        draining: false,
        ready_since_ms: None,
        role: Default::default(),
    }
}

#[tokio::test(start_paused = true)]
async fn health_events_are_counted_by_reason() {
    let m = Metrics::default();
    let pool = Pool::new(
        Settings::builtin(PolicyConfig::default()),
        &Resilience {
            eject_after_failures: 1,
            health_check: None,
            ..Resilience::default()
        },
        8,
    );
    pool.set_endpoints(["a", "b", "c", "d"].map(spec).to_vec());
    for name in ["a", "b", "c", "d"] {
        m.health(pool.failed(name, Fault::Connect));
    }
    tokio::time::advance(std::time::Duration::from_millis(5001)).await;
    m.health(pool.tick());
    let text = m.render(&pool);
    assert!(
        text.contains("kvroute_ejections_total{reason=\"connect\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("kvroute_ejections_refused_total{reason=\"connect\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("kvroute_restorations_total{reason=\"expired\"} 2"),
        "{text}"
    );
}

#[test]
fn series_of_removed_endpoints_are_dropped() {
    let m = Metrics::default();
    let pool = pool();
    pool.set_endpoints(vec![spec("a"), spec("ab")]);
    for e in ["a", "ab"] {
        m.upstream_failure(e, "connect");
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
    let labels = ModelStatus {
        model: "m\"x".into(),
        status: "200".into(),
    };
    m.requests.get_or_create(&labels).inc();
    m.requests.get_or_create(&labels).inc();
    m.decision_seconds.observe(0.002);
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
    assert!(text.contains("# TYPE kvroute_requests counter"));
    assert!(
        text.contains("kvroute_index_entries{medium=\"gpu\"} 0\n"),
        "{text}"
    );
    assert!(
        text.contains("kvroute_index_dropped_blocks_total{medium=\"offloaded\"} 0\n"),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "one exposition: {text}");
    assert_eq!(text.matches("# EOF").count(), 1);
}
