use kvroute_core::hash::{ExtraKeysForm, HashAlgo};

use super::*;

fn policy() -> RoutingPolicy {
    RoutingPolicy {
        policy: "kvroute".into(),
        key_mode: v1::KeyMode::Conversation.into(),
        prefix_tokens: 256,
        load_bound: 0.0,
        block_size: 16,
        hash_algorithm: v1::HashAlgorithm::Sha256.into(),
        hash_seed: None,
        cache_port: 0,
        tenancy: v1::TenancyMode::Shared.into(),
        tenant_header: String::new(),
        latency_slack: None,
        prefill_tokens_per_second: None,
        prefill_overhead_ms: None,
        offload_weight: None,
    }
}

fn ep(name: &str, address: &str, http_port: u32, cache_port: u32) -> v1::Endpoint {
    v1::Endpoint {
        name: name.into(),
        address: address.into(),
        http_port,
        cache_port,
        ready: true,
        draining: false,
    }
}

#[test]
fn endpoints_take_the_policy_cache_port_when_they_have_none() {
    let state = PoolState {
        endpoints: vec![
            ep("a:8000", "10.0.0.1", 8000, 0),
            ep("b:8000", "fd00::2", 8000, 7000),
        ],
        ..Default::default()
    };
    let mut p = policy();
    let specs = endpoints(&state, &p);
    assert_eq!(specs[0].http, "10.0.0.1:8000".parse().unwrap());
    assert_eq!(specs[0].cache, None);
    assert_eq!(specs[1].cache, Some("[fd00::2]:7000".parse().unwrap()));
    p.cache_port = 50051;
    let specs = endpoints(&state, &p);
    assert_eq!(specs[0].cache, Some("10.0.0.1:50051".parse().unwrap()));
    assert_eq!(specs[1].cache, Some("[fd00::2]:7000".parse().unwrap()));
}

#[test]
fn unaddressable_endpoints_are_skipped() {
    let state = PoolState {
        endpoints: vec![
            ep("host", "pod.example", 8000, 0),
            ep("no-port", "10.0.0.1", 0, 0),
            ep("big-port", "10.0.0.1", 70000, 0),
            ep("big-cache-port", "10.0.0.1", 8000, 70000),
            ep("", "10.0.0.1", 8000, 0),
            ep("ok", "10.0.0.3", 8000, 0),
        ],
        ..Default::default()
    };
    let names: Vec<String> = endpoints(&state, &policy())
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["ok"]);
}

#[test]
fn policies_by_name_with_their_parameters() {
    let mut p = policy();
    assert_eq!(policy_config(&p), Some(PolicyConfig::default()));
    p.latency_slack = Some(2.5);
    p.prefill_tokens_per_second = Some(30_000.0);
    p.load_bound = 0.5; // not kvroute's
    let PolicyConfig::Kvroute(c) = policy_config(&p).unwrap() else {
        panic!("kvroute expected")
    };
    assert_eq!(c.latency_slack, 2.5);
    assert_eq!(c.engine.prefill_tokens_per_second, 30_000.0);
    assert_eq!(c.engine.prefill_overhead_ms, 20.0);
    p.policy = "rendezvous-bounded".into();
    let PolicyConfig::RendezvousBounded(c) = policy_config(&p).unwrap() else {
        panic!("rendezvous-bounded expected")
    };
    assert_eq!(c.slack, 1.5);
    p.policy = "kvroute".into();
    p.prefill_tokens_per_second = Some(0.0);
    assert_eq!(policy_config(&p), None, "an unusable rate is refused");
    p.policy = "round-robin".into();
    assert_eq!(policy_config(&p), Some(PolicyConfig::RoundRobin));
    p.policy = "fastest".into();
    assert_eq!(policy_config(&p), None);
}

#[test]
fn key_mode_and_prefix_tokens() {
    let current = KeyConfig::default();
    let mut p = policy();
    p.key_mode = v1::KeyMode::Prefix.into();
    p.prefix_tokens = 64;
    let k = key_config(&p, &current);
    assert_eq!((k.mode, k.prefix_tokens), (KeyMode::Prefix, 64));
    // Unknown mode and zero tokens keep what there is.
    p.key_mode = 0;
    p.prefix_tokens = 0;
    assert_eq!(key_config(&p, &k), k);
    p.key_mode = 42;
    assert_eq!(key_config(&p, &k), k);
}

#[test]
fn hashing_changes_only_when_it_differs_and_is_valid() {
    let current = HashConfig::default();
    assert!(hasher(&policy(), &current).unwrap().is_none());
    let mut p = policy();
    p.block_size = 32;
    p.hash_algorithm = v1::HashAlgorithm::XxhashCbor.into();
    p.hash_seed = Some("0".into());
    let h = hasher(&p, &current).unwrap().unwrap();
    assert_eq!(
        h.config(),
        &HashConfig {
            algo: HashAlgo::XxhashCbor,
            block_size: 32,
            seed: Some("0".into()),
            extra_keys: ExtraKeysForm::Tagged,
        }
    );
    p.block_size = 0;
    assert!(hasher(&p, &current).is_err());
    p.block_size = 16;
    p.hash_algorithm = 0;
    assert!(hasher(&p, &current).is_err());
}
