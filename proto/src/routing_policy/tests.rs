use kvroute_core::hash::{ExtraKeysForm, HashAlgo};
use kvroute_core::keys::KeyConfig;
use kvroute_core::policy::{KvrouteConfig, MinTtftConfig, RendezvousBoundedConfig};

use super::*;

/// The wire's policy of a pool with every default, as the operator sends it.
fn policy() -> v1::RoutingPolicy {
    v1::RoutingPolicy {
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
        slow_start_seconds: None,
        disaggregation: None,
        warmup: None,
    }
}

#[test]
fn warm_ups_survive_the_wire_and_a_config_map_ref_left_unresolved_is_left_out() {
    let w: Warmup = serde_json::from_value(serde_json::json!({
        "everySeconds": 60, "owners": 2, "maxShareOfPrefill": 0.1, "prefixes": [
            {"name": "a", "tenant": "t", "messages": [{"role": "system", "content": "hi"}]},
            {"name": "b", "model": "m", "prompt": "hello"},
            {"name": "c", "configMapRef": {"name": "prompts", "key": "support"}}]}))
    .unwrap();
    let wire = v1::Warmup::from(&w);
    assert_eq!(wire.prefixes.len(), 2, "c is unresolved");
    let back = wire.to_warmup().unwrap();
    assert_eq!(back.prefixes, w.prefixes[..2]);
    assert_eq!((back.every_seconds, back.owners), (60, 2));
    let broken = v1::Warmup {
        prefixes: vec![v1::WarmupPrefix {
            name: "x".into(),
            text: Some(v1::warmup_prefix::Text::MessagesJson("[{".into())),
            ..Default::default()
        }],
        ..wire
    };
    assert!(
        broken
            .to_warmup()
            .unwrap_err()
            .starts_with("prefix x: messages:")
    );
}

/// `wire` read over the default spec, which must be wholly usable.
fn read(wire: &v1::RoutingPolicy) -> RoutingSpec {
    let (spec, unusable) = wire.to_spec(&RoutingSpec::default());
    assert_eq!(unusable, [], "{wire:?}");
    spec
}

#[test]
fn the_default_spec_is_the_documented_wire_policy() {
    assert_eq!(
        v1::RoutingPolicy::from(&RoutingSpec::default()),
        v1::RoutingPolicy {
            latency_slack: Some(1.0),
            prefill_tokens_per_second: Some(10_000.0),
            prefill_overhead_ms: Some(20.0),
            offload_weight: Some(0.5),
            slow_start_seconds: Some(30),
            disaggregation: Some(v1::Disaggregation {
                mode: v1::DisaggregationMode::Disabled.into(),
                min_uncached_tokens: 256,
            }),
            ..policy()
        }
    );
    assert_eq!(read(&policy()), RoutingSpec::default());
}

#[test]
fn every_spec_round_trips() {
    let mut specs = vec![RoutingSpec::default()];
    for name in PolicyConfig::NAMES {
        specs.push(RoutingSpec {
            policy: PolicyConfig::by_name(name).unwrap(),
            ..RoutingSpec::default()
        });
    }
    let mut kvroute = KvrouteConfig {
        latency_slack: 2.5,
        ..KvrouteConfig::default()
    };
    kvroute.engine.prefill_tokens_per_second = 30_000.0;
    kvroute.engine.prefill_overhead_ms = 5.0;
    let mut min_ttft = MinTtftConfig::default();
    min_ttft.engine.prefill_tokens_per_second = 4_000.0;
    for policy in [
        PolicyConfig::Kvroute(kvroute),
        PolicyConfig::MinTtft(min_ttft),
        PolicyConfig::RendezvousBounded(RendezvousBoundedConfig { slack: 1.5 }),
    ] {
        specs.push(RoutingSpec {
            policy,
            ..RoutingSpec::default()
        });
    }
    for mode in [KeyMode::Conversation, KeyMode::Prefix, KeyMode::Tenant] {
        specs.push(RoutingSpec {
            key: KeyConfig {
                mode,
                prefix_tokens: 64,
                ..KeyConfig::default()
            },
            ..RoutingSpec::default()
        });
    }
    for algo in HashAlgo::ALL {
        specs.push(RoutingSpec {
            hash: HashConfig {
                algo,
                block_size: 32,
                seed: Some("0".into()),
                ..HashConfig::default()
            },
            ..RoutingSpec::default()
        });
    }
    for offload_weight in [0.0, 0.25, 1.0] {
        specs.push(RoutingSpec {
            offload_weight,
            ..RoutingSpec::default()
        });
    }
    for tenancy in TenancyMode::ALL {
        specs.push(RoutingSpec {
            tenancy,
            ..RoutingSpec::default()
        });
    }
    for slow_start_seconds in [0, 5, 3600] {
        specs.push(RoutingSpec {
            slow_start_seconds,
            ..RoutingSpec::default()
        });
    }
    for spec in specs {
        assert_eq!(read(&v1::RoutingPolicy::from(&spec)), spec);
    }
}

#[test]
fn policies_by_name_with_their_parameters() {
    let mut p = policy();
    assert_eq!(read(&p).policy, PolicyConfig::default());
    p.latency_slack = Some(2.5);
    p.prefill_tokens_per_second = Some(30_000.0);
    p.load_bound = 0.5; // not kvroute's
    let PolicyConfig::Kvroute(c) = read(&p).policy else {
        panic!("kvroute expected")
    };
    assert_eq!(c.latency_slack, 2.5);
    assert_eq!(c.engine.prefill_tokens_per_second, 30_000.0);
    assert_eq!(c.engine.prefill_overhead_ms, 20.0);
    p.policy = "rendezvous-bounded".into();
    let PolicyConfig::RendezvousBounded(c) = read(&p).policy else {
        panic!("rendezvous-bounded expected")
    };
    assert_eq!(c.slack, 1.5);
    p.policy = "round-robin".into();
    assert_eq!(read(&p).policy, PolicyConfig::RoundRobin);

    // An unusable policy keeps the current one.
    let current = RoutingSpec {
        policy: PolicyConfig::Modulo,
        ..RoutingSpec::default()
    };
    p.policy = "kvroute".into();
    p.prefill_tokens_per_second = Some(0.0);
    let (spec, unusable) = p.to_spec(&current);
    assert_eq!(
        spec.policy,
        PolicyConfig::Modulo,
        "an unusable rate is refused"
    );
    assert!(
        matches!(&unusable[..], [Unusable::Policy { name, .. }] if name == "kvroute"),
        "{unusable:?}"
    );
    p.policy = "fastest".into();
    p.prefill_tokens_per_second = None;
    let (spec, unusable) = p.to_spec(&current);
    assert_eq!(spec.policy, PolicyConfig::Modulo);
    assert!(matches!(&unusable[..], [Unusable::Policy { .. }]));
}

#[test]
fn key_mode_and_prefix_tokens() {
    let mut p = policy();
    p.key_mode = v1::KeyMode::Prefix.into();
    p.prefix_tokens = 64;
    let k = read(&p).key;
    assert_eq!((k.mode, k.prefix_tokens), (KeyMode::Prefix, 64));
    // Unknown mode and zero tokens keep what there is.
    let current = RoutingSpec {
        key: KeyConfig {
            scope_by_tenant: true,
            ..k.clone()
        },
        ..RoutingSpec::default()
    };
    for mode in [0, 42] {
        p.key_mode = mode;
        p.prefix_tokens = 0;
        let (spec, unusable) = p.to_spec(&current);
        assert_eq!(spec.key, current.key);
        assert_eq!(unusable, [Unusable::KeyMode(mode)]);
    }
}

#[test]
fn hashing_changes_only_when_it_differs_and_is_valid() {
    let current = RoutingSpec {
        hash: HashConfig {
            extra_keys: ExtraKeysForm::Legacy,
            ..HashConfig::default()
        },
        ..RoutingSpec::default()
    };
    assert_eq!(policy().to_spec(&current).0.hash, current.hash);
    let mut p = policy();
    p.block_size = 32;
    p.hash_algorithm = v1::HashAlgorithm::XxhashCbor.into();
    p.hash_seed = Some("0".into());
    assert_eq!(
        p.to_spec(&current).0.hash,
        HashConfig {
            algo: HashAlgo::XxhashCbor,
            block_size: 32,
            seed: Some("0".into()),
            extra_keys: ExtraKeysForm::Legacy,
        }
    );
    for (block_size, hash_algorithm) in [(0, 1), (4097, 1), (16, 0), (16, 42)] {
        p.block_size = block_size;
        p.hash_algorithm = hash_algorithm;
        let (spec, unusable) = p.to_spec(&current);
        assert_eq!(spec.hash, current.hash);
        assert!(
            matches!(&unusable[..], [Unusable::Hashing { .. }]),
            "{unusable:?}"
        );
    }
}

#[test]
fn offload_weight_and_tenancy() {
    let current = RoutingSpec {
        offload_weight: 0.75,
        ..RoutingSpec::default()
    };
    let mut p = policy();
    assert_eq!(
        p.to_spec(&current).0.offload_weight,
        0.5,
        "absent: the default"
    );
    p.offload_weight = Some(1.5);
    let (spec, unusable) = p.to_spec(&current);
    assert_eq!(spec.offload_weight, 0.75);
    assert_eq!(unusable, [Unusable::OffloadWeight(1.5)]);
    for (wire, mode) in [
        (v1::TenancyMode::Salted as i32, TenancyMode::Salted),
        (v1::TenancyMode::Shared as i32, TenancyMode::Shared),
        (0, TenancyMode::Shared),
        (7, TenancyMode::Shared),
    ] {
        p.tenancy = wire;
        assert_eq!(p.to_spec(&current).0.tenancy, mode, "{wire}");
    }
}

#[test]
fn disaggregation_comes_from_the_wire_and_an_unknown_mode_keeps_the_current_one() {
    let current = RoutingSpec {
        disaggregation: Disaggregation {
            mode: DisaggregationMode::Auto,
            min_uncached_tokens: 64,
        },
        ..RoutingSpec::default()
    };
    let mut p = policy();
    assert_eq!(
        p.to_spec(&current).0.disaggregation,
        current.disaggregation,
        "absent (an older operator): the router's own"
    );
    p.disaggregation = Some(v1::Disaggregation {
        mode: v1::DisaggregationMode::Disabled.into(),
        min_uncached_tokens: 1024,
    });
    let (spec, unusable) = p.to_spec(&current);
    assert_eq!(
        (spec.disaggregation.mode, unusable),
        (DisaggregationMode::Disabled, vec![])
    );
    assert_eq!(spec.disaggregation.min_uncached_tokens, 1024);
    p.disaggregation = Some(v1::Disaggregation {
        mode: 9,
        min_uncached_tokens: 1,
    });
    let (spec, unusable) = p.to_spec(&current);
    assert_eq!(spec.disaggregation, current.disaggregation);
    assert_eq!(unusable, [Unusable::Disaggregation(9, 1)]);
}

#[test]
fn a_slow_start_window_over_the_maximum_keeps_the_current_one() {
    let current = RoutingSpec {
        slow_start_seconds: 7,
        ..RoutingSpec::default()
    };
    let mut p = policy();
    p.slow_start_seconds = Some(3601);
    let (spec, unusable) = p.to_spec(&current);
    assert_eq!(spec.slow_start_seconds, 7);
    assert_eq!(unusable, [Unusable::SlowStartSeconds(3601)]);
    p.slow_start_seconds = None;
    assert_eq!(
        p.to_spec(&current).0.slow_start_seconds,
        30,
        "absent: the default"
    );
}
