//! Passes over an index built from plain inputs. A write is "applied" the
//! way the API server would: its `status` becomes the object's watched
//! status, under a new `resourceVersion`.

use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

use super::*;
use crate::api::{CacheRoutingPolicyStatus, InferencePoolStatus};
use crate::index::{PodInfo, PolicySpec, PoolSpec};

fn now() -> Time {
    Time(Timestamp::from_second(1_700_000_000).unwrap())
}

/// An index (clock 0) with pool `llama` (resourceVersion "1") and `pods`.
fn index_with(pods: &[PodInfo]) -> Index {
    let mut index = Index::with_clock(|| 0);
    index.apply_pool(pool("1", None));
    for pod in pods {
        index.apply_pod(pod.clone());
    }
    index
}

fn pool(rv: &str, status: Option<InferencePoolStatus>) -> PoolSpec {
    let mut pool = PoolSpec::test("llama");
    pool.generation = 1;
    pool.observed.uid = Some("uid-llama".into());
    pool.observed.resource_version = Some(rv.into());
    pool.observed.status = status;
    pool
}

fn policy(name: &str, rv: &str, status: Option<CacheRoutingPolicyStatus>) -> PolicySpec {
    let mut policy = PolicySpec::test(name, "llama");
    policy.observed.resource_version = Some(rv.into());
    policy.observed.status = status;
    policy
}

fn ready_pod(name: &str) -> PodInfo {
    PodInfo::test(name).ip("10.0.0.1").ready()
}

/// The write for `kind`/`name` in `plan`.
fn write_for<'a>(plan: &'a Plan, kind: Kind, name: &str) -> &'a StatusWrite {
    plan.writes
        .iter()
        .find(|w| w.object.kind == kind && w.object.name == name)
        .unwrap_or_else(|| panic!("no write for {name} in {plan:?}"))
}

fn status<T: serde::de::DeserializeOwned>(write: &StatusWrite) -> T {
    serde_json::from_value(write.body["status"].clone()).unwrap()
}

/// `(reason, warning)` of each notice.
fn notices(plan: &Plan) -> Vec<(&'static str, bool)> {
    plan.notices.iter().map(|n| (n.reason, n.warning)).collect()
}

#[test]
fn a_new_pool_gets_kvroutes_parent_entry_with_its_resource_version() {
    let index = index_with(&[ready_pod("a")]);
    let plan = plan(&index, &mut Memory::default(), &now());
    assert_eq!(plan.writes.len(), 1);
    let write = write_for(&plan, Kind::Pool, "llama");
    assert_eq!(write.object.namespace, "ml");
    assert_eq!(write.body["metadata"]["resourceVersion"], "1");
    let status: InferencePoolStatus = status(write);
    assert_eq!(status.parents.len(), 1);
    assert_eq!(
        status.parents[0].controller_name.as_deref(),
        Some(super::super::CONTROLLER_NAME)
    );
    assert!(
        notices(&plan).is_empty(),
        "a pool with endpoints is news to nobody"
    );
}

#[test]
fn a_status_is_sent_once_per_resource_version_and_not_again_once_watched() {
    let mut index = index_with(&[ready_pod("a")]);
    let mut memory = Memory::default();
    let first = plan(&index, &mut memory, &now());
    let written: InferencePoolStatus = status(write_for(&first, Kind::Pool, "llama"));

    // The watch has not brought the write back yet: nothing to send.
    assert_eq!(plan(&index, &mut memory, &now()), Plan::default());

    // It has: the status says it all, nothing to send, now or after a
    // restart (no memory at all).
    index.apply_pool(pool("2", Some(written)));
    assert_eq!(plan(&index, &mut memory, &now()), Plan::default());
    assert_eq!(plan(&index, &mut Memory::default(), &now()).writes, vec![]);
}

#[test]
fn a_failed_write_is_sent_again() {
    let index = index_with(&[ready_pod("a")]);
    let mut memory = Memory::default();
    let first = plan(&index, &mut memory, &now());
    memory.failed(&first.writes[0]);
    assert_eq!(plan(&index, &mut memory, &now()).writes, first.writes);
}

#[test]
fn a_status_changed_by_someone_else_is_written_again() {
    let mut index = index_with(&[ready_pod("a")]);
    let mut memory = Memory::default();
    plan(&index, &mut memory, &now());
    // Someone cleared the status: a new version without our entry.
    index.apply_pool(pool("5", Some(InferencePoolStatus::default())));
    let again = plan(&index, &mut memory, &now());
    assert_eq!(again.writes[0].body["metadata"]["resourceVersion"], "5");
}

#[test]
fn ready_endpoints_coming_and_going_are_events() {
    let mut index = index_with(&[]);
    let mut memory = Memory::default();
    let first = plan(&index, &mut memory, &now());
    assert_eq!(notices(&first), vec![("NoReadyEndpoints", true)]);
    assert_eq!(first.notices[0].uid.as_deref(), Some("uid-llama"));

    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").running());
    assert_eq!(notices(&plan(&index, &mut memory, &now())), vec![]);

    index.apply_pod(ready_pod("a"));
    let ready = plan(&index, &mut memory, &now());
    assert_eq!(notices(&ready), vec![("EndpointsReady", false)]);
    assert_eq!(ready.notices[0].note, "1 ready endpoints");

    index.apply_pod(ready_pod("a").deleting());
    assert_eq!(
        notices(&plan(&index, &mut memory, &now())),
        vec![("NoReadyEndpoints", true)]
    );
}

#[test]
fn an_invalid_pool_is_one_warning_not_a_readiness_one() {
    let mut index = Index::with_clock(|| 0);
    let mut broken = pool("1", None);
    broken.target_ports = vec![];
    index.apply_pool(broken.clone());
    let mut memory = Memory::default();
    let first = plan(&index, &mut memory, &now());
    assert_eq!(notices(&first), vec![("PoolInvalid", true)]);
    assert!(first.notices[0].note.contains("target ports"));

    // Once the status says so, a restarted writer says nothing more.
    broken.observed.status = Some(status(&first.writes[0]));
    index.apply_pool(broken);
    assert_eq!(
        plan(&index, &mut Memory::default(), &now()),
        Plan::default()
    );
}

#[test]
fn a_rejected_policy_is_a_warning_once() {
    let mut index = index_with(&[ready_pod("a")]);
    let mut memory = Memory::default();
    plan(&index, &mut memory, &now());

    let mut invalid = policy("fast", "7", None);
    invalid.block_size = Some(0);
    index.apply_policy(invalid.clone());
    let rejected = plan(&index, &mut memory, &now());
    assert_eq!(notices(&rejected), vec![("PolicyInvalid", true)]);
    let write = write_for(&rejected, Kind::Policy, "fast");
    assert_eq!(write.body["metadata"]["resourceVersion"], "7");
    let written: CacheRoutingPolicyStatus = status(write);
    assert_eq!(written.conditions[0].type_, "Accepted");
    assert_eq!(written.conditions[0].status, "False");

    invalid.observed = crate::index::Observed {
        resource_version: Some("8".into()),
        status: Some(written),
        uid: None,
    };
    index.apply_policy(invalid);
    let restarted = plan(&index, &mut Memory::default(), &now());
    assert!(restarted.notices.is_empty());
    assert!(restarted.writes.iter().all(|w| w.object.kind == Kind::Pool));

    // Fixed: accepted, and said so.
    let watched = index.policies().next().unwrap().observed.status.clone();
    index.apply_policy(policy("fast", "9", watched));
    let fixed = plan(&index, &mut memory, &now());
    assert_eq!(notices(&fixed), vec![("PolicyAccepted", false)]);
}

#[test]
fn a_conflicted_policy_and_a_missing_target_are_warnings() {
    let mut index = index_with(&[ready_pod("a")]);
    index.apply_policy(policy("old", "1", None).created(1));
    index.apply_policy(policy("new", "2", None).created(2));
    let mut orphan = policy("orphan", "3", None);
    orphan.target_pool = "gone".into();
    index.apply_policy(orphan);
    let plan = plan(&index, &mut Memory::default(), &now());
    let mut reasons: Vec<_> = plan
        .notices
        .iter()
        .map(|n| (n.object.name.as_str(), n.reason))
        .collect();
    reasons.sort_unstable();
    assert_eq!(
        reasons,
        vec![
            ("new", "PolicyConflicted"),
            ("old", "PolicyAccepted"),
            ("orphan", "TargetNotFound"),
        ]
    );
    assert_eq!(plan.writes.len(), 4, "the pool and three policies");
}

#[test]
fn deleted_objects_are_forgotten() {
    let mut index = index_with(&[ready_pod("a")]);
    let mut memory = Memory::default();
    plan(&index, &mut memory, &now());
    index.delete_pool("ml", "llama");
    assert_eq!(plan(&index, &mut memory, &now()), Plan::default());
    assert!(memory.sent.is_empty() && memory.ready.is_empty());

    // Recreated under the same name: written again.
    index.apply_pool(pool("1", None));
    assert_eq!(plan(&index, &mut memory, &now()).writes.len(), 1);
}

#[test]
fn writes_carry_no_precondition_without_a_resource_version() {
    let mut index = Index::with_clock(|| 0);
    index.apply_pool(PoolSpec::test("llama"));
    index.apply_pod(ready_pod("a"));
    let plan = plan(&index, &mut Memory::default(), &now());
    assert_eq!(plan.writes[0].body.get("metadata"), None::<&Value>);
}
