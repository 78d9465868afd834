//! Statuses in, patches out; a patch is "applied" by reading its `status`
//! back as the object's status, as the API server would store it.

use k8s_openapi::jiff::Timestamp;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::*;
use crate::index::Reason;

const T1: i64 = 1_700_000_000;
const T2: i64 = 1_700_000_600;

fn at(second: i64) -> Time {
    Time(Timestamp::from_second(second).unwrap())
}

fn cond(status: bool, reason: Reason, message: &str) -> index::Condition {
    index::Condition {
        status,
        reason,
        message: message.to_owned(),
    }
}

fn pool_status() -> index::PoolStatus {
    index::PoolStatus {
        namespace: "ml".into(),
        name: "llama".into(),
        accepted: cond(true, Reason::Accepted, "kvroute serves the pool"),
        resolved_refs: cond(true, Reason::ResolvedRefs, "routing with the defaults"),
        policy: None,
        ready_endpoints: 2,
    }
}

fn policy_status() -> index::PolicyStatus {
    index::PolicyStatus {
        namespace: "ml".into(),
        name: "fast".into(),
        observed_generation: 3,
        accepted: cond(true, Reason::Accepted, "applies to llama"),
        target_found: cond(true, Reason::TargetFound, "InferencePool llama exists"),
        conflicted: cond(false, Reason::NoConflict, "no other policy wins the target"),
        ready_endpoints: 2,
        engines: None,
        warmup: None,
        warmups_sent: Vec::new(),
        warmup_prefixes: Vec::new(),
    }
}

/// The object's status after the patch.
fn applied<T: DeserializeOwned>(patch: &Value) -> T {
    serde_json::from_value(patch["status"].clone()).unwrap()
}

/// `(type, status, reason, lastTransitionTime second)` of each condition.
fn summary(conditions: &[Condition]) -> Vec<(String, String, String, i64)> {
    conditions
        .iter()
        .map(|c| {
            (
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                c.last_transition_time.0.as_second(),
            )
        })
        .collect()
}

fn row(type_: &str, status: &str, reason: &str, time: i64) -> (String, String, String, i64) {
    (type_.into(), status.into(), reason.into(), time)
}

fn gateway_parent() -> ParentStatus {
    serde_json::from_value(json!({
        "parentRef": {"name": "inference-gateway"},
        "controllerName": "example.com/gateway",
        "conditions": [{
            "type": "Accepted",
            "status": "True",
            "reason": "Accepted",
            "message": "",
            "lastTransitionTime": "2023-01-01T00:00:00Z",
        }],
    }))
    .unwrap()
}

#[test]
fn first_pool_write_adds_kvroutes_parent() {
    let patch = pool_status_patch(None, &pool_status(), 4, at(T1)).unwrap();
    assert_eq!(
        patch,
        json!({"status": {"parents": [{
            "parentRef": {
                "group": "kvroute.dev",
                "kind": "CacheRoutingPolicy",
                "name": "default",
            },
            "controllerName": "kvroute.dev/operator",
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True",
                    "reason": "Accepted",
                    "message": "kvroute serves the pool",
                    "observedGeneration": 4,
                    "lastTransitionTime": "2023-11-14T22:13:20Z",
                },
                {
                    "type": "ResolvedRefs",
                    "status": "True",
                    "reason": "ResolvedRefs",
                    "message": "routing with the defaults",
                    "observedGeneration": 4,
                    "lastTransitionTime": "2023-11-14T22:13:20Z",
                },
            ],
        }]}})
    );
}

#[test]
fn unchanged_pool_status_is_not_patched() {
    let patch = pool_status_patch(None, &pool_status(), 4, at(T1)).unwrap();
    let existing: InferencePoolStatus = applied(&patch);
    assert_eq!(
        pool_status_patch(Some(&existing), &pool_status(), 4, at(T2)),
        None
    );
    // The ready count is not part of a pool's status.
    let mut status = pool_status();
    status.ready_endpoints = 7;
    assert_eq!(pool_status_patch(Some(&existing), &status, 4, at(T2)), None);
}

#[test]
fn a_flipped_pool_condition_moves_only_its_own_time() {
    let existing: InferencePoolStatus =
        applied(&pool_status_patch(None, &pool_status(), 4, at(T1)).unwrap());
    let mut status = pool_status();
    status.accepted = cond(false, Reason::Invalid, "target ports []: need at least one");
    let updated: InferencePoolStatus =
        applied(&pool_status_patch(Some(&existing), &status, 5, at(T2)).unwrap());
    assert_eq!(
        summary(&updated.parents[0].conditions),
        [
            row("Accepted", "False", "Invalid", T2),
            row("ResolvedRefs", "True", "ResolvedRefs", T1),
        ]
    );
    assert!(
        updated.parents[0]
            .conditions
            .iter()
            .all(|c| c.observed_generation == Some(5))
    );
}

#[test]
fn a_new_message_or_generation_keeps_the_time() {
    let existing: InferencePoolStatus =
        applied(&pool_status_patch(None, &pool_status(), 4, at(T1)).unwrap());
    let mut status = pool_status();
    status.policy = Some("fast".into());
    status.resolved_refs.message = "routing with CacheRoutingPolicy fast".into();
    let updated: InferencePoolStatus =
        applied(&pool_status_patch(Some(&existing), &status, 5, at(T2)).unwrap());
    let ours = &updated.parents[0];
    assert_eq!(ours.parent_ref.name, "fast");
    assert_eq!(
        summary(&ours.conditions),
        [
            row("Accepted", "True", "Accepted", T1),
            row("ResolvedRefs", "True", "ResolvedRefs", T1),
        ]
    );
    assert_eq!(
        ours.conditions[1].message,
        "routing with CacheRoutingPolicy fast"
    );
}

#[test]
fn other_controllers_parents_are_kept() {
    let ours = applied::<InferencePoolStatus>(
        &pool_status_patch(None, &pool_status(), 4, at(T1)).unwrap(),
    )
    .parents
    .remove(0);
    let existing = InferencePoolStatus {
        parents: vec![gateway_parent(), ours.clone(), ours, gateway_parent()],
    };
    let mut status = pool_status();
    status.accepted = cond(false, Reason::Invalid, "no port");
    let updated: InferencePoolStatus =
        applied(&pool_status_patch(Some(&existing), &status, 4, at(T2)).unwrap());
    assert_eq!(updated.parents.len(), 3);
    assert_eq!(updated.parents[0], gateway_parent());
    assert_eq!(
        updated.parents[1].controller_name.as_deref(),
        Some(CONTROLLER_NAME)
    );
    assert_eq!(updated.parents[1].conditions[0].status, "False");
    assert_eq!(updated.parents[2], gateway_parent());

    // First write next to a gateway's entry: appended after it.
    let existing = InferencePoolStatus {
        parents: vec![gateway_parent()],
    };
    let updated: InferencePoolStatus =
        applied(&pool_status_patch(Some(&existing), &pool_status(), 4, at(T1)).unwrap());
    assert_eq!(updated.parents.len(), 2);
    assert_eq!(updated.parents[0], gateway_parent());
    assert_eq!(
        updated.parents[1].controller_name.as_deref(),
        Some(CONTROLLER_NAME)
    );
}

#[test]
fn a_full_parents_list_is_left_alone() {
    let existing = InferencePoolStatus {
        parents: vec![gateway_parent(); MAX_PARENTS],
    };
    assert_eq!(
        pool_status_patch(Some(&existing), &pool_status(), 4, at(T1)),
        None
    );
}

#[test]
fn first_policy_write_sets_everything() {
    let patch = policy_status_patch(None, &policy_status(), at(T1)).unwrap();
    let status: CacheRoutingPolicyStatus = applied(&patch);
    assert_eq!(status.observed_generation, Some(3));
    assert_eq!(status.ready_endpoints, Some(2));
    assert_eq!(
        summary(&status.conditions),
        [
            row("Accepted", "True", "Accepted", T1),
            row("TargetFound", "True", "TargetFound", T1),
            row("Conflicted", "False", "NoConflict", T1),
        ]
    );
    assert!(
        status
            .conditions
            .iter()
            .all(|c| c.observed_generation == Some(3))
    );
    assert_eq!(
        patch["status"]["conditions"][0]["message"],
        "applies to llama"
    );
}

#[test]
fn unchanged_policy_status_is_not_patched() {
    let existing: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(None, &policy_status(), at(T1)).unwrap());
    assert_eq!(
        policy_status_patch(Some(&existing), &policy_status(), at(T2)),
        None
    );
}

#[test]
fn a_ready_count_change_is_patched_with_the_same_times() {
    let existing: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(None, &policy_status(), at(T1)).unwrap());
    let mut status = policy_status();
    status.ready_endpoints = 5;
    let updated: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(Some(&existing), &status, at(T2)).unwrap());
    assert_eq!(updated.ready_endpoints, Some(5));
    assert_eq!(updated.conditions, existing.conditions);
}

#[test]
fn engines_consistent_appears_once_probed_and_flips_with_its_own_time() {
    let existing: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(None, &policy_status(), at(T1)).unwrap());
    let mut status = policy_status();
    let message = "1 of 2 probed engines hash their blocks otherwise, so routers give them no cache credit: b: blockSize 32 (policy 16)";
    status.engines = Some(cond(false, Reason::EnginesInconsistent, message));
    let patch = policy_status_patch(Some(&existing), &status, at(T2)).unwrap();
    let updated: CacheRoutingPolicyStatus = applied(&patch);
    assert_eq!(
        summary(&updated.conditions),
        [
            row("Accepted", "True", "Accepted", T1),
            row("TargetFound", "True", "TargetFound", T1),
            row("Conflicted", "False", "NoConflict", T1),
            row("EnginesConsistent", "False", "EnginesInconsistent", T2),
        ]
    );
    assert_eq!(patch["status"]["conditions"][3]["message"], message);
}

#[test]
fn a_conflicted_policy_moves_only_the_flipped_times() {
    let existing: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(None, &policy_status(), at(T1)).unwrap());
    let mut status = policy_status();
    let message = "CacheRoutingPolicy old is older and applies to llama";
    status.accepted = cond(false, Reason::Conflicted, message);
    status.conflicted = cond(true, Reason::Conflicted, message);
    status.ready_endpoints = 0;
    status.observed_generation = 4;
    let updated: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(Some(&existing), &status, at(T2)).unwrap());
    assert_eq!(updated.observed_generation, Some(4));
    assert_eq!(updated.ready_endpoints, Some(0));
    assert_eq!(
        summary(&updated.conditions),
        [
            row("Accepted", "False", "Conflicted", T2),
            row("TargetFound", "True", "TargetFound", T1),
            row("Conflicted", "True", "Conflicted", T2),
        ]
    );
}

fn sent(prefix: &str, endpoint: &str, second: i64, router: &str) -> index::WarmupSent {
    index::WarmupSent {
        prefix: prefix.into(),
        endpoint: endpoint.into(),
        unix_ms: u64::try_from(second).unwrap() * 1000 + 999,
        router: router.into(),
    }
}

/// `(endpoint, lastSentTime second, sentBy)`.
type Owner = (String, i64, String);

/// `(prefix, lastSentTime second, owners)`.
fn warmups(status: &CacheRoutingPolicyStatus) -> Vec<(String, i64, Vec<Owner>)> {
    let prefixes = status.warmup.iter().flat_map(|w| &w.prefixes);
    prefixes
        .map(|p| {
            let owners = (p.owners.iter())
                .map(|o| {
                    (
                        o.endpoint.clone(),
                        o.last_sent_time.0.as_second(),
                        o.sent_by.clone(),
                    )
                })
                .collect();
            (p.name.clone(), p.last_sent_time.0.as_second(), owners)
        })
        .collect()
}

#[test]
fn warmups_sent_are_merged_into_the_status_newest_first_and_kept_by_a_new_leader() {
    let mut status = policy_status();
    status.warmup_prefixes = vec!["support".into(), "unsent".into()];
    status.warmups_sent = vec![
        sent("support", "pod-a:8000", T1, "router-0"),
        sent("support", "pod-b:8000", T2, "router-1"),
    ];
    let existing: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(None, &status, at(T1)).unwrap());
    let own = |e: &str, t: i64, r: &str| (e.to_owned(), t, r.to_owned());
    assert_eq!(
        warmups(&existing),
        [(
            "support".to_owned(),
            T2,
            vec![
                own("pod-b:8000", T2, "router-1"),
                own("pod-a:8000", T1, "router-0")
            ]
        )]
    );
    // The same sends again (to the millisecond within their second): nothing.
    assert_eq!(policy_status_patch(Some(&existing), &status, at(T2)), None);

    // A new leader has no reports: the status keeps what it says.
    let mut fresh = policy_status();
    fresh.warmup_prefixes = status.warmup_prefixes.clone();
    assert_eq!(policy_status_patch(Some(&existing), &fresh, at(T2)), None);
    // Its first report updates one owner and keeps the other.
    fresh.warmups_sent = vec![sent("support", "pod-a:8000", T2 + 5, "router-1")];
    let updated: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(Some(&existing), &fresh, at(T2)).unwrap());
    assert_eq!(
        warmups(&updated),
        [(
            "support".to_owned(),
            T2 + 5,
            vec![
                own("pod-a:8000", T2 + 5, "router-1"),
                own("pod-b:8000", T2, "router-1")
            ]
        )]
    );

    // A prefix gone from the spec leaves the status.
    fresh.warmup_prefixes = vec!["unsent".into()];
    let updated: CacheRoutingPolicyStatus =
        applied(&policy_status_patch(Some(&updated), &fresh, at(T2)).unwrap());
    assert_eq!(updated.warmup, None);
}
