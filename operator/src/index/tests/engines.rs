//! Probe targets and the `EnginesConsistent` condition.

use kvroute_core::contract::EngineCache;
use kvroute_core::hash::HashAlgo;

use super::builders::NS;
use super::*;

/// What an engine with the policy defaults reports, with `block_size`.
fn engine(policy: &PolicySpec, block_size: u32) -> EngineCache {
    let hasher = policy.hasher().unwrap();
    EngineCache {
        block_size,
        hash_algo: Some(hasher.config().algo),
        hash_seed_set: false,
        none_hash: Some(hasher.none_hash().to_u64()),
        hashes_unverified: false,
    }
}

#[test]
fn serving_pods_of_pools_with_a_cache_port_are_probe_targets() {
    let (mut index, _rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    index.apply_pod(PodInfo::test("b").ip("10.0.0.2").running());
    assert!(index.engine_targets().is_empty(), "no cache port yet");
    let mut policy = PolicySpec::test("p", "llama");
    policy.cache_port = Some(50051);
    index.apply_policy(policy);
    let targets = index.engine_targets();
    assert_eq!(
        targets,
        [EngineTarget {
            namespace: NS.into(),
            pod: "a".into(),
            addr: "10.0.0.1:50051".parse().unwrap(),
        }],
        "only the serving pod"
    );
}

#[test]
fn engines_that_hash_otherwise_make_the_policy_inconsistent() {
    let (mut index, _rx) = with_pool(PoolSpec::test("llama"));
    for (pod, ip) in [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")] {
        index.apply_pod(PodInfo::test(pod).ip(ip).ready());
    }
    let mut policy = PolicySpec::test("p", "llama");
    policy.cache_port = Some(50051);
    index.apply_policy(policy.clone());
    assert_eq!(
        index.policy_status(NS, "p").unwrap().engines,
        None,
        "none probed"
    );

    let mut changes = index.changes();
    changes.borrow_and_update();
    index.set_engine(NS, "a", engine(&policy, 16));
    assert!(changes.has_changed().unwrap(), "the status writer wakes");
    let ok = index.policy_status(NS, "p").unwrap().engines.unwrap();
    assert!(
        ok.status && ok.reason == Reason::EnginesConsistent,
        "{ok:?}"
    );
    assert_eq!(
        ok.message,
        "all 1 probed engines hash their blocks as this policy says"
    );

    index.set_engine(NS, "b", engine(&policy, 32));
    let mut seeded = engine(&policy, 16);
    seeded.none_hash = Some(1);
    index.set_engine(NS, "c", seeded);
    let bad = index.policy_status(NS, "p").unwrap().engines.unwrap();
    assert!(!bad.status && bad.reason == Reason::EnginesInconsistent);
    assert!(
        bad.message.starts_with("2 of 3 probed engines"),
        "{}",
        bad.message
    );
    assert!(
        bad.message.contains("b: blockSize 32 (policy 16)"),
        "{}",
        bad.message
    );
    assert!(
        bad.message.contains("c: hashSeed NONE_HASH"),
        "{}",
        bad.message
    );

    // The policy follows the engines: block size 32 now suits b only.
    policy.block_size = Some(32);
    index.apply_policy(policy.clone());
    let bad = index.policy_status(NS, "p").unwrap().engines.unwrap();
    assert!(
        bad.message.contains("a: blockSize 16 (policy 32)"),
        "{}",
        bad.message
    );
    // An algorithm the engines do not use.
    policy.block_size = None;
    policy.hash_algorithm = Some(HashAlgo::XxhashCbor);
    index.apply_policy(policy);
    let bad = index.policy_status(NS, "p").unwrap().engines.unwrap();
    assert!(bad.message.starts_with("3 of 3"), "{}", bad.message);

    // Gone pods take their engines with them.
    index.delete_pod(NS, "b");
    assert!(index.engine(NS, "b").is_none());
    index.reset_pods(vec![PodInfo::test("a").ip("10.0.0.1").ready()]);
    assert!(index.engine(NS, "c").is_none());
    assert!(index.engine(NS, "a").is_some());
}
