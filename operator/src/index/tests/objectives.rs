//! A pool's `InferenceObjective`s in its state: which pools an objective
//! change publishes, the order, and relists.

use super::*;

/// `(name, priority)` of every objective in the state.
fn objectives(rx: &watch::Receiver<PoolState>) -> Vec<(String, i32)> {
    rx.borrow()
        .objectives
        .iter()
        .map(|o| (o.name.clone(), o.priority))
        .collect()
}

fn ob(name: &str, priority: i32) -> (String, i32) {
    (name.to_owned(), priority)
}

/// Pools `llama` and `mistral` and a receiver of each, both seen.
fn two_pools() -> (
    Index,
    watch::Receiver<PoolState>,
    watch::Receiver<PoolState>,
) {
    let (mut index, mut llama) = with_pool(PoolSpec::test("llama"));
    index.apply_pool(PoolSpec::test("mistral"));
    let mut mistral = index.watch_pool(NS, "mistral");
    notified(&mut llama);
    notified(&mut mistral);
    (index, llama, mistral)
}

#[test]
fn an_added_objective_publishes_only_the_pool_it_names() {
    let (mut index, mut llama, mut mistral) = two_pools();
    let before = version(&llama);

    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(10));

    assert!(notified(&mut llama));
    assert_eq!(version(&llama), before + 1);
    assert_eq!(objectives(&llama), [ob("chat", 10)]);
    assert!(!notified(&mut mistral));
    assert!(objectives(&mistral).is_empty());
}

#[test]
fn a_pools_objectives_are_sorted_by_name() {
    let (mut index, llama, _) = two_pools();
    for name in ["zeta", "batch", "chat"] {
        index.apply_objective(ObjectiveSpec::test(name, "llama"));
    }
    index.apply_objective(ObjectiveSpec::test("alpha", "mistral"));
    assert_eq!(
        objectives(&llama),
        [ob("batch", 0), ob("chat", 0), ob("zeta", 0)]
    );
}

#[test]
fn a_priority_change_publishes_and_an_identical_one_does_not() {
    let (mut index, mut llama, _) = two_pools();
    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(10));
    notified(&mut llama);
    let before = version(&llama);

    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(-1));
    assert!(notified(&mut llama));
    assert_eq!(version(&llama), before + 1);
    assert_eq!(objectives(&llama), [ob("chat", -1)]);

    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(-1));
    assert!(!notified(&mut llama));
    assert_eq!(version(&llama), before + 1);
}

#[test]
fn moving_the_pool_ref_publishes_the_old_and_the_new_pool() {
    let (mut index, mut llama, mut mistral) = two_pools();
    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(5));
    index.apply_objective(ObjectiveSpec::test("batch", "llama").priority(-5));
    notified(&mut llama);
    let (llama_before, mistral_before) = (version(&llama), version(&mistral));

    index.apply_objective(ObjectiveSpec::test("chat", "mistral").priority(5));

    assert_eq!(version(&llama), llama_before + 1);
    assert_eq!(objectives(&llama), [ob("batch", -5)]);
    assert_eq!(version(&mistral), mistral_before + 1);
    assert_eq!(objectives(&mistral), [ob("chat", 5)]);

    // A reference to another kind of object: the objective leaves every pool.
    notified(&mut mistral);
    index.apply_objective(ObjectiveSpec::test("chat", "mistral").no_pool());
    assert!(notified(&mut mistral));
    assert!(objectives(&mistral).is_empty());
    assert_eq!(objectives(&llama), [ob("batch", -5)]);
}

#[test]
fn a_deleted_objective_leaves_its_pool() {
    let (mut index, mut llama, _) = two_pools();
    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(10));
    index.apply_objective(ObjectiveSpec::test("batch", "llama"));
    notified(&mut llama);
    let before = version(&llama);

    index.delete_objective(NS, "chat");
    assert_eq!(version(&llama), before + 1);
    assert_eq!(objectives(&llama), [ob("batch", 0)]);
    assert_eq!(index.objective(NS, "chat"), None);

    index.delete_objective(NS, "chat");
    index.delete_objective(NS, "never-there");
    assert!(notified(&mut llama), "the first delete");
    assert!(!notified(&mut llama), "nothing more");
}

#[test]
fn a_relist_replaces_the_objectives() {
    let (mut index, mut llama, mut mistral) = two_pools();
    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(10));
    index.apply_objective(ObjectiveSpec::test("gone", "llama"));
    index.apply_objective(ObjectiveSpec::test("stays", "mistral").priority(1));
    notified(&mut llama);
    notified(&mut mistral);

    index.reset_objectives(vec![
        ObjectiveSpec::test("chat", "llama").priority(20),
        ObjectiveSpec::test("stays", "mistral").priority(1),
    ]);

    assert!(notified(&mut llama));
    assert_eq!(objectives(&llama), [ob("chat", 20)]);
    assert!(!notified(&mut mistral), "its objectives did not change");
    assert_eq!(index.objective(NS, "gone"), None);
}

#[test]
fn a_relist_of_one_namespace_keeps_the_others() {
    let mut index = index();
    index.apply_pool(PoolSpec::test("llama"));
    let mut other_pool = PoolSpec::test("llama");
    other_pool.namespace = "dev".into();
    index.apply_pool(other_pool);
    index.apply_objective(ObjectiveSpec::test("chat", "llama"));
    index.apply_objective(ObjectiveSpec::test("chat", "llama").in_namespace("dev"));
    let (ml, dev) = (
        index.watch_pool(NS, "llama"),
        index.watch_pool("dev", "llama"),
    );

    index.reset_objectives_in(
        NS,
        vec![
            ObjectiveSpec::test("batch", "llama"),
            ObjectiveSpec::test("ignored", "llama").in_namespace("dev"),
        ],
    );

    assert_eq!(objectives(&ml), [ob("batch", 0)]);
    assert_eq!(objectives(&dev), [ob("chat", 0)]);
}

#[test]
fn an_objective_applies_to_a_pool_of_its_own_namespace_only() {
    let (mut index, mut llama, _) = two_pools();
    index.apply_objective(ObjectiveSpec::test("chat", "llama").in_namespace("dev"));
    assert!(!notified(&mut llama));
    assert!(objectives(&llama).is_empty());
}

#[test]
fn an_objective_for_a_missing_pool_waits_for_it() {
    let mut index = index();
    let mut rx = index.watch_pool(NS, "llama");
    rx.borrow_and_update();

    index.apply_objective(ObjectiveSpec::test("chat", "llama").priority(10));
    assert!(!notified(&mut rx), "no pool, nothing to publish");
    assert!(!rx.borrow().pool_exists);
    assert!(objectives(&rx).is_empty());

    index.apply_pool(PoolSpec::test("llama"));
    assert!(notified(&mut rx));
    assert_eq!(objectives(&rx), [ob("chat", 10)]);

    // A deleted pool's state carries none; its objectives stay for its return.
    index.delete_pool(NS, "llama");
    assert!(!rx.borrow().pool_exists);
    assert!(objectives(&rx).is_empty());
    index.apply_pool(PoolSpec::test("llama"));
    assert_eq!(objectives(&rx), [ob("chat", 10)]);
}

#[test]
fn an_objective_of_an_unwatched_missing_pool_keeps_no_channel() {
    let mut index = index();
    index.apply_objective(ObjectiveSpec::test("chat", "ghost"));
    index.delete_objective(NS, "chat");
    assert!(index.states.get(NS, "ghost").is_none());
}
