//! When a pool's state is published, with which version, and what
//! subscribers and relists see.

use super::*;

#[test]
fn an_identical_recomputation_neither_bumps_nor_notifies() {
    let (mut index, mut rx) = with_pool(PoolSpec::test("llama"));
    let pod = PodInfo::test("a").ip("10.0.0.1").ready();
    index.apply_pod(pod.clone());
    index.apply_policy(PolicySpec::test("p", "llama").policy("random"));
    notified(&mut rx);
    let before = version(&rx);

    index.apply_pod(pod.clone());
    index.apply_pod(pod.clone().label("irrelevant", "yes"));
    index.apply_pool(PoolSpec::test("llama"));
    index.apply_policy(
        PolicySpec::test("p", "llama")
            .policy("random")
            .generation(2),
    );
    index.apply_policy(PolicySpec::test("other", "mistral"));
    index.reset_pods(vec![pod.label("irrelevant", "yes")]);
    index.reset_pools(vec![PoolSpec::test("llama")]);
    index.reset_policies(vec![
        PolicySpec::test("p", "llama")
            .policy("random")
            .generation(2),
    ]);

    assert!(!notified(&mut rx));
    assert_eq!(version(&rx), before);
}

#[test]
fn each_change_adds_one_to_the_version() {
    let mut index = index();
    let rx = index.watch_pool(NS, "llama");
    assert_eq!(version(&rx), 0);
    index.apply_pool(PoolSpec::test("llama"));
    assert_eq!(version(&rx), 1);
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    assert_eq!(version(&rx), 2);
    index.apply_policy(PolicySpec::test("p", "llama").policy("random"));
    assert_eq!(version(&rx), 3);
}

#[test]
fn versions_are_floored_by_the_clock() {
    let mut index = Index::with_clock(|| 1_700_000_000_000_000);
    index.apply_pool(PoolSpec::test("llama"));
    let rx = index.watch_pool(NS, "llama");
    assert_eq!(version(&rx), 1_700_000_000_000_000);
    assert_eq!(state::next_version(41, 7), 42, "never backwards");
    assert_eq!(state::next_version(u64::MAX, 0), u64::MAX);
}

#[test]
fn a_router_subscribed_before_the_pool_exists_sees_it_appear() {
    let mut index = index();
    let mut rx = index.watch_pool(NS, "llama");
    {
        let state = rx.borrow_and_update();
        assert!(!state.pool_exists);
        assert!(state.endpoints.is_empty() && state.policy.is_none());
        assert_eq!(
            (state.namespace.as_str(), state.pool.as_str()),
            (NS, "llama")
        );
    }
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    assert!(!notified(&mut rx), "pods alone make no pool");

    index.apply_pool(PoolSpec::test("llama"));
    assert!(notified(&mut rx));
    assert!(rx.borrow().pool_exists);
    assert_eq!(endpoints(&rx), [ep("a:8000", true, false)]);
    assert_eq!(rx.borrow().policy, Some(default_policy()));
}

#[test]
fn deleting_a_pool_publishes_its_absence_with_a_higher_version() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    let before = version(&rx);
    index.delete_pool(NS, "llama");
    let state = rx.borrow().clone();
    assert!(!state.pool_exists);
    assert!(state.endpoints.is_empty() && state.policy.is_none());
    assert_eq!(state.version, before + 1);
    assert!(index.pool_status(NS, "llama").is_none());
}

#[test]
fn resets_drop_what_is_gone() {
    let mut index = index();
    index.apply_pool(PoolSpec::test("llama"));
    index.apply_pool(PoolSpec::test("mistral").selector("app", "mistral"));
    let llama = index.watch_pool(NS, "llama");
    let mistral = index.watch_pool(NS, "mistral");
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    index.apply_pod(PodInfo::test("b").ip("10.0.0.2").ready());
    index.apply_policy(PolicySpec::test("p", "llama").policy("random"));

    index.reset_pods(vec![PodInfo::test("b").ip("10.0.0.2").ready()]);
    assert_eq!(endpoints(&llama), [ep("b:8000", true, false)]);

    index.reset_policies(Vec::new());
    assert_eq!(policy_name(&llama), "kvroute");
    assert!(index.policy_status(NS, "p").is_none());

    index.reset_pools(vec![PoolSpec::test("llama")]);
    assert!(llama.borrow().pool_exists);
    assert!(!mistral.borrow().pool_exists);
    assert_eq!(index.pool_statuses().len(), 1);
}

#[test]
fn a_namespace_reset_leaves_other_namespaces_alone() {
    let mut index = index();
    let in_ns = |mut pool: PoolSpec, ns: &str| {
        pool.namespace = ns.into();
        pool
    };
    let pod_in = |mut pod: PodInfo, ns: &str| {
        pod.namespace = ns.into();
        pod
    };
    index.apply_pool(PoolSpec::test("llama"));
    index.apply_pool(in_ns(PoolSpec::test("llama"), "other"));
    let here = index.watch_pool(NS, "llama");
    let there = index.watch_pool("other", "llama");
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    index.apply_pod(pod_in(PodInfo::test("b").ip("10.0.0.2").ready(), "other"));
    let mut policy = PolicySpec::test("p", "llama").policy("random");
    policy.namespace = "other".into();
    index.apply_policy(policy);

    // A relist of `ml` that also carries an `other` object ignores it.
    let stray = pod_in(PodInfo::test("c").ip("10.0.0.3").ready(), "other");
    index.reset_pods_in(NS, vec![stray]);
    assert_eq!(endpoints(&here), []);
    assert_eq!(endpoints(&there), [ep("b:8000", true, false)]);

    index.reset_policies_in(NS, Vec::new());
    assert_eq!(policy_name(&there), "random");

    index.reset_pools_in(NS, Vec::new());
    assert!(!here.borrow().pool_exists);
    assert!(there.borrow().pool_exists);

    index.reset_pods_in("other", Vec::new());
    assert_eq!(endpoints(&there), []);
}

#[test]
fn unwatched_absent_pools_are_forgotten() {
    let mut index = index();
    for i in 0..10 {
        drop(index.watch_pool(NS, &format!("made-up-{i}")));
    }
    let kept = index.watch_pool(NS, "llama");
    assert_eq!(index.states.keys(), [(NS.to_owned(), "llama".to_owned())]);
    drop(kept);

    index.apply_pool(PoolSpec::test("llama"));
    index.delete_pool(NS, "llama");
    assert!(index.states.keys().is_empty());
}
