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

/// The policies that order cold keys by rendezvous.
const RENDEZVOUS_ORDERED: [&str; 5] = [
    "kvroute",
    "rendezvous",
    "rendezvous-bounded",
    "min-ttft",
    "exact-prefix-load",
];

#[test]
fn a_ramping_endpoint_is_first_for_its_weights_share_of_cold_keys() {
    // Four at 1, the fifth at 0.25: it is first for 0.25 / 4.25 of the keys.
    let pool = Pool::test().replicas(5).weight(4, 0.25);
    let keys = 20_000u64;
    for name in RENDEZVOUS_ORDERED {
        let mut p = PolicyConfig::by_name(name).unwrap().build();
        let firsts = (0..keys)
            .filter(|&k| p.rank(&request(k, &[]), &pool.endpoints, &pool.cx()).ranked[0] == 4)
            .count();
        let share = firsts as f64 / keys as f64;
        assert!((share - 0.25 / 4.25).abs() < 0.01, "{name}: {share}");
    }
}

#[test]
fn full_weights_rank_as_plain_rendezvous_and_a_ramp_moves_keys_only_to_its_endpoint() {
    let full = Pool::test().replicas(5);
    let ids: Vec<u64> = full.endpoints.iter().map(|e| e.id).collect();
    for name in RENDEZVOUS_ORDERED {
        let mut p = PolicyConfig::by_name(name).unwrap().build();
        let mut first: Vec<usize> = (0..2_000u64)
            .map(|k| p.rank(&request(k, &[]), &full.endpoints, &full.cx()).ranked[0])
            .collect();
        for (k, &f) in first.iter().enumerate() {
            assert_eq!(f, crate::rendezvous::rank(k as u64, &ids)[0], "{name}");
        }
        for w in [1.0, 0.6, 0.2, 0.01] {
            let ramping = Pool::test().replicas(5).weight(4, w);
            for (k, was) in first.iter_mut().enumerate() {
                let d = p.rank(&request(k as u64, &[]), &ramping.endpoints, &ramping.cx());
                assert!(
                    d.ranked[0] == *was || *was == 4,
                    "{name}: key {k} moved from {was} to {} at weight {w}",
                    d.ranked[0]
                );
                *was = d.ranked[0];
            }
        }
    }
}

#[test]
fn a_warm_prefix_stays_on_a_ramping_holder() {
    let chain: Vec<u64> = (1..=8).collect();
    let pool = Pool::test()
        .replicas(4)
        .holds(3, &chain)
        .weight(3, crate::slow_start::MIN_WEIGHT);
    let mut p = PolicyConfig::default().build();
    for key in 0..50 {
        let d = p.rank(&request(key, &chain), &pool.endpoints, &pool.cx());
        assert_eq!((d.ranked[0], d.reason), (3, Reason::Warm));
    }
}
