//! Rules every policy keeps.

use super::testing::*;
use super::*;

fn all() -> Vec<Box<dyn Policy>> {
    PolicyConfig::NAMES
        .iter()
        .map(|n| {
            PolicyConfig::by_name(n)
                .expect("every listed name builds")
                .build()
        })
        .collect()
}

#[test]
fn names_round_trip() {
    for (name, p) in PolicyConfig::NAMES.iter().zip(all()) {
        assert_eq!(p.name(), *name);
    }
    assert_eq!(PolicyConfig::by_name("nope"), None);
    assert_eq!(PolicyConfig::default().build().name(), "kvroute");
}

#[test]
fn no_endpoints_gives_an_empty_ranking() {
    let pool = Pool::test();
    for mut p in all() {
        for cx in [pool.cx(), pool.approximate()] {
            let d = p.rank(&request(1, &[1, 2]), &[], &cx);
            assert!(d.ranked.is_empty(), "{}", p.name());
        }
    }
}

#[test]
fn every_ranking_is_a_permutation() {
    let chain: Vec<u64> = (1..=8).collect();
    let pool = Pool::test()
        .replicas(7)
        .holds(2, &chain[..3])
        .holds(5, &chain)
        .prefill(5, 100_000)
        .in_flight(3, 9);
    for mut p in all() {
        for key in 0..30 {
            let req = request(key, &chain);
            let d = p.rank(&req, &pool.endpoints, &pool.cx());
            assert_permutation(&d, 7);
            p.routed(&req, &pool.endpoints[d.ranked[0]]);
        }
    }
}

#[test]
fn a_clone_carries_state() {
    let pool = Pool::test().replicas(3);
    for mut p in all() {
        for key in 0..5 {
            let chain = [key];
            let req = request(key, &chain);
            let d = p.rank(&req, &pool.endpoints, &pool.cx());
            p.routed(&req, &pool.endpoints[d.ranked[0]]);
        }
        let mut copy = p.boxed_clone();
        for key in 0..10 {
            let chain = [key];
            let req = request(key, &chain);
            assert_eq!(
                p.rank(&req, &pool.endpoints, &pool.cx()),
                copy.rank(&req, &pool.endpoints, &pool.cx()),
                "{}",
                p.name()
            );
        }
    }
}

#[test]
fn configs_parse_with_documented_defaults() {
    let c: PolicyConfig = serde_json::from_str(
        r#"{"name": "kvroute", "latencySlack": 2.5, "engine": {"prefillTokensPerSecond": 5000}}"#,
    )
    .unwrap();
    let PolicyConfig::Kvroute(k) = c else {
        panic!("{c:?}")
    };
    assert_eq!(k.latency_slack, 2.5);
    assert_eq!(k.engine.prefill_tokens_per_second, 5000.0);
    assert_eq!(k.engine.prefill_overhead_ms, 20.0);
    assert_eq!(k.memory_blocks, KvrouteConfig::default().memory_blocks);
    let c: PolicyConfig = serde_json::from_str(r#"{"name": "round-robin"}"#).unwrap();
    assert_eq!(c, PolicyConfig::RoundRobin);
    let err = serde_json::from_str::<PolicyConfig>(r#"{"name": "kvroute", "loadBound": 1}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("loadBound"), "{err}");
    for name in PolicyConfig::NAMES {
        let c = PolicyConfig::by_name(name).unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            serde_json::from_str::<PolicyConfig>(&json).unwrap(),
            c,
            "{json}"
        );
    }
}

#[test]
fn every_policy_round_trips_and_refuses_unknown_parameters() {
    for name in PolicyConfig::NAMES {
        let config = PolicyConfig::by_name(name).unwrap();
        let written = serde_json::to_value(&config).unwrap();
        assert_eq!(written["name"], name);
        let read: PolicyConfig = serde_json::from_value(written).unwrap();
        assert_eq!(read, config, "{name}");
        let err =
            serde_json::from_value::<PolicyConfig>(serde_json::json!({"name": name, "bogus": 2}))
                .unwrap_err()
                .to_string();
        assert!(err.contains("unknown field `bogus`"), "{name}: {err}");
    }
    let bare: PolicyConfig =
        serde_json::from_value(serde_json::json!({"name": "round-robin"})).unwrap();
    assert_eq!(bare, PolicyConfig::RoundRobin);
}
