//! Policy defaults, attachment, conflicts and policy status.

use kvroute_core::hash::HashAlgo;
use kvroute_core::keys::KeyMode;
use kvroute_core::spec::TenancyMode;
use kvroute_proto::v1;

use super::*;

#[test]
fn a_pool_without_a_policy_gets_the_documented_defaults() {
    let (_index, rx) = with_pool(PoolSpec::test("llama"));
    let policy = rx.borrow().policy.clone().unwrap();
    assert_eq!(
        policy,
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
            latency_slack: Some(1.0),
            prefill_tokens_per_second: Some(10_000.0),
            prefill_overhead_ms: Some(20.0),
            offload_weight: Some(0.5),
            slow_start_seconds: Some(30),
            disaggregation: Some(v1::Disaggregation {
                mode: v1::DisaggregationMode::Disabled.into(),
                min_uncached_tokens: 256,
            }),
            warmup: None,
        }
    );
}

#[test]
fn a_policy_attaches_and_detaches() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    let policy = PolicySpec::test("p", "llama")
        .policy("round-robin")
        .key_mode(KeyMode::Prefix)
        .cache_port(9000);
    index.apply_policy(policy);

    let state = rx.borrow().clone();
    let p = state.policy.unwrap();
    assert_eq!(p.policy, "round-robin");
    assert_eq!(p.key_mode, i32::from(v1::KeyMode::Prefix));
    assert_eq!(p.cache_port, 9000);
    assert_eq!(
        state.endpoints[0].cache_port, 9000,
        "the cache port fills endpoints"
    );
    let status = index.policy_status(NS, "p").unwrap();
    assert!(status.accepted.status);
    assert_eq!(status.ready_endpoints, 1);
    assert_eq!(
        index.pool_status(NS, "llama").unwrap().policy.as_deref(),
        Some("p")
    );

    index.delete_policy(NS, "p");
    assert_eq!(rx.borrow().policy, Some(default_policy()));
    assert_eq!(rx.borrow().endpoints[0].cache_port, 0);
}

#[test]
fn retargeting_a_policy_detaches_it_from_the_old_pool() {
    let mut index = index();
    index.apply_pool(PoolSpec::test("llama"));
    index.apply_pool(PoolSpec::test("mistral"));
    let llama = index.watch_pool(NS, "llama");
    let mistral = index.watch_pool(NS, "mistral");
    index.apply_policy(PolicySpec::test("p", "llama").policy("random"));
    index.apply_policy(PolicySpec::test("p", "mistral").policy("random"));
    assert_eq!(policy_name(&llama), "kvroute");
    assert_eq!(policy_name(&mistral), "random");
}

#[test]
fn the_oldest_policy_wins_and_the_others_are_conflicted() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_policy(
        PolicySpec::test("new", "llama")
            .created(2000)
            .policy("random"),
    );
    index.apply_policy(
        PolicySpec::test("old", "llama")
            .created(1000)
            .policy("modulo"),
    );
    assert_eq!(policy_name(&rx), "modulo");

    let winner = index.policy_status(NS, "old").unwrap();
    assert!(winner.accepted.status);
    assert!(!winner.conflicted.status);
    let loser = index.policy_status(NS, "new").unwrap();
    assert!(!loser.accepted.status);
    assert_eq!(loser.accepted.reason, Reason::Conflicted);
    assert!(loser.conflicted.status);
    assert!(
        loser.conflicted.message.contains("old"),
        "{}",
        loser.conflicted.message
    );
    assert!(loser.target_found.status);
    assert_eq!(loser.ready_endpoints, 0);
}

#[test]
fn equal_creation_times_are_broken_by_name() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_policy(PolicySpec::test("b", "llama").policy("random"));
    index.apply_policy(PolicySpec::test("a", "llama").policy("modulo"));
    assert_eq!(policy_name(&rx), "modulo");
    assert_eq!(
        index.policy_status(NS, "b").unwrap().accepted.reason,
        Reason::Conflicted
    );
}

#[test]
fn deleting_the_winner_hands_the_pool_over() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_policy(
        PolicySpec::test("old", "llama")
            .created(1000)
            .policy("modulo"),
    );
    index.apply_policy(
        PolicySpec::test("new", "llama")
            .created(2000)
            .policy("random"),
    );
    index.delete_policy(NS, "old");
    assert_eq!(policy_name(&rx), "random");
    let status = index.policy_status(NS, "new").unwrap();
    assert!(status.accepted.status);
    assert!(!status.conflicted.status);
}

#[test]
fn a_policy_whose_target_is_missing_is_not_found_until_it_appears() {
    let mut index = index();
    index.apply_policy(PolicySpec::test("p", "llama").policy("random"));
    let status = index.policy_status(NS, "p").unwrap();
    assert!(!status.target_found.status);
    assert_eq!(status.target_found.reason, Reason::TargetNotFound);
    assert_eq!(status.accepted.reason, Reason::TargetNotFound);

    index.apply_pool(PoolSpec::test("llama"));
    let status = index.policy_status(NS, "p").unwrap();
    assert!(status.target_found.status && status.accepted.status);
    assert_eq!(policy_name(&index.watch_pool(NS, "llama")), "random");
}

#[test]
fn an_invalid_policy_is_not_accepted_and_does_not_attach() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_policy(
        PolicySpec::test("old", "llama")
            .created(1)
            .policy("fastest"),
    );
    index.apply_policy(
        PolicySpec::test("nan", "llama")
            .created(2)
            .latency_slack(f64::NAN),
    );
    index.apply_policy(PolicySpec::test("new", "llama").created(3).policy("random"));
    assert_eq!(policy_name(&rx), "random");

    let old = index.policy_status(NS, "old").unwrap();
    assert_eq!(old.accepted.reason, Reason::Invalid);
    assert!(
        old.accepted.message.contains("\"fastest\""),
        "{}",
        old.accepted.message
    );
    assert!(
        !old.conflicted.status,
        "an invalid policy competes for nothing"
    );
    let nan = index.policy_status(NS, "nan").unwrap();
    assert!(
        nan.accepted
            .message
            .contains("latencySlack must be 0 or more, got NaN"),
        "{}",
        nan.accepted.message
    );
    assert!(index.policy_status(NS, "new").unwrap().accepted.status);
}

#[test]
fn policy_status_reports_the_observed_generation() {
    let (mut index, _rx) = with_pool(PoolSpec::test("llama"));
    index.apply_policy(PolicySpec::test("p", "llama").generation(7));
    assert_eq!(index.policy_status(NS, "p").unwrap().observed_generation, 7);
    assert_eq!(index.policy_statuses().len(), 1);
    assert!(index.policy_status(NS, "missing").is_none());
}

#[test]
fn a_policy_may_set_every_field() {
    let policy = PolicySpec {
        policy: Some("kvroute".into()),
        key_mode: Some(KeyMode::Tenant),
        prefix_tokens: Some(64),
        load_bound: Some(0.25),
        latency_slack: Some(3.0),
        offload_weight: Some(0.25),
        prefill_tokens_per_second: Some(40_000.0),
        prefill_overhead_ms: Some(5.0),
        block_size: Some(32),
        hash_algorithm: Some(HashAlgo::XxhashCbor),
        hash_seed: Some("0".into()),
        cache_port: Some(9000),
        tenancy_mode: Some(TenancyMode::Salted),
        tenant_header: Some("x-tenant".into()),
        slow_start_seconds: Some(5),
        disaggregation: Some(kvroute_core::spec::Disaggregation {
            mode: kvroute_core::spec::DisaggregationMode::Auto,
            min_uncached_tokens: 128,
        }),
        ..PolicySpec::test("p", "llama")
    };
    assert_eq!(policy.validate(), Ok(()));
    assert_eq!(
        policy.routing_policy(),
        v1::RoutingPolicy {
            policy: "kvroute".into(),
            key_mode: v1::KeyMode::Tenant.into(),
            prefix_tokens: 64,
            load_bound: 0.0, // not kvroute's: see below
            block_size: 32,
            hash_algorithm: v1::HashAlgorithm::XxhashCbor.into(),
            hash_seed: Some("0".into()),
            cache_port: 9000,
            tenancy: v1::TenancyMode::Salted.into(),
            tenant_header: "x-tenant".into(),
            latency_slack: Some(3.0),
            prefill_tokens_per_second: Some(40_000.0),
            prefill_overhead_ms: Some(5.0),
            offload_weight: Some(0.25),
            slow_start_seconds: Some(5),
            disaggregation: Some(v1::Disaggregation {
                mode: v1::DisaggregationMode::Auto.into(),
                min_uncached_tokens: 128,
            }),
            warmup: None,
        }
    );
    // The parameters a policy does not have are not sent; each policy gets
    // its own.
    let bounded = PolicySpec {
        policy: Some("rendezvous-bounded".into()),
        ..policy.clone()
    };
    let wire = bounded.routing_policy();
    assert_eq!(wire.load_bound, 0.25);
    assert_eq!(
        (wire.latency_slack, wire.prefill_tokens_per_second),
        (None, None)
    );
    let min_ttft = PolicySpec {
        policy: Some("min-ttft".into()),
        ..policy
    };
    let wire = min_ttft.routing_policy();
    assert_eq!(
        (
            wire.latency_slack,
            wire.prefill_tokens_per_second,
            wire.prefill_overhead_ms
        ),
        (None, Some(40_000.0), Some(5.0))
    );
}

#[test]
fn a_block_size_over_4096_is_invalid() {
    let mut spec = PolicySpec::test("big", "llama");
    for (size, ok) in [
        (Some(4096), true),
        (Some(4097), false),
        (Some(u32::MAX), false),
    ] {
        spec.block_size = size;
        assert_eq!(spec.validate().is_ok(), ok, "{size:?}");
        assert_eq!(spec.hasher().is_some(), ok, "{size:?}");
    }
    spec.block_size = Some(u32::MAX);
    assert_eq!(
        spec.validate().unwrap_err(),
        "block size 4294967295: must be 1 to 4096"
    );
}
