//! The index's statuses ([`index::PoolStatus`], [`index::PolicyStatus`]) as
//! merge-patch bodies for the `status` subresource of `InferencePool` and
//! `CacheRoutingPolicy`. Pure functions: given what the object's status says
//! now, they return the patch, or `None` when the status already says it, so
//! the writer sends nothing and the object's `resourceVersion` does not churn.
//!
//! Condition timestamps follow the Kubernetes convention: a condition's
//! `lastTransitionTime` moves only when its status flips (True ↔ False);
//! a new reason or message keeps the old time.
//!
//! Submodules: [`plan`] decides what one pass writes and which Events it
//! publishes; [`writer`] is the task that does it while holding the lease.
//!
//! Not here: computing statuses (the index).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};

use crate::api::inference_pool::{MAX_PARENTS, conditions as pool_conditions};
use crate::api::policy::conditions as policy_conditions;
use crate::api::{
    CacheRoutingPolicyStatus, InferencePoolStatus, OwnerWarmupStatus, ParentReference,
    ParentStatus, PrefixWarmupStatus, WarmupStatus,
};
use crate::index;

pub mod plan;
#[cfg(test)]
mod tests;
pub mod writer;

pub use self::writer::StatusWriter;

/// The `controllerName` of kvroute's entry in an `InferencePool`'s
/// `status.parents`; the entry is found by it.
pub const CONTROLLER_NAME: &str = "kvroute.dev/operator";

/// API group of the `parentRef` of kvroute's `status.parents` entry.
pub const PARENT_GROUP: &str = "kvroute.dev";
/// Kind of the `parentRef` of kvroute's `status.parents` entry.
pub const PARENT_KIND: &str = "CacheRoutingPolicy";
/// Name of the `parentRef` of kvroute's `status.parents` entry when no
/// `CacheRoutingPolicy` is in effect and the pool routes with the defaults.
pub const DEFAULTS_PARENT_NAME: &str = "default";

/// The merge patch that makes pool `status`'s entry in `status.parents` say
/// what the index says, or `None` if it already does.
///
/// `status.parents` is an atomic list, so the patch carries the whole list:
/// other controllers' entries (those with another `controllerName`) are kept
/// as they are, in place; kvroute's entry replaces its earlier one (any
/// duplicates are dropped) or is appended. If the list already holds
/// [`MAX_PARENTS`] other entries there is no room without dropping someone
/// else's, and the result is `None`.
///
/// The parent: upstream's `parentRef` defaults to a Gateway, which kvroute
/// is not; what attaches kvroute to a pool is a `CacheRoutingPolicy`, so the
/// entry's parent is `kvroute.dev/CacheRoutingPolicy` named for the policy in
/// effect ([`DEFAULTS_PARENT_NAME`] when none is), in the pool's namespace.
///
/// Conditions: `Accepted` and `ResolvedRefs`, with the index's reasons and
/// messages, `observedGeneration = generation`, and `lastTransitionTime =
/// now` only for a condition that is new or whose status flipped.
pub fn pool_status_patch(
    existing: Option<&InferencePoolStatus>,
    status: &index::PoolStatus,
    generation: i64,
    now: Time,
) -> Option<Value> {
    let parents = existing.map_or(&[][..], |s| &s.parents[..]);
    let old = parents
        .iter()
        .find(|p| is_ours(p))
        .map_or(&[][..], |p| &p.conditions[..]);
    let entry = ParentStatus {
        conditions: vec![
            condition(
                old,
                pool_conditions::ACCEPTED,
                &status.accepted,
                generation,
                &now,
            ),
            condition(
                old,
                pool_conditions::RESOLVED_REFS,
                &status.resolved_refs,
                generation,
                &now,
            ),
        ],
        parent_ref: ParentReference {
            group: PARENT_GROUP.to_owned(),
            kind: PARENT_KIND.to_owned(),
            name: status
                .policy
                .clone()
                .unwrap_or_else(|| DEFAULTS_PARENT_NAME.to_owned()),
            namespace: None,
        },
        controller_name: Some(CONTROLLER_NAME.to_owned()),
    };

    let mut entry = Some(entry);
    let mut updated = Vec::with_capacity(parents.len() + 1);
    for parent in parents {
        if !is_ours(parent) {
            updated.push(parent.clone());
        } else if let Some(entry) = entry.take() {
            updated.push(entry);
        }
    }
    if let Some(entry) = entry {
        if updated.len() >= MAX_PARENTS {
            return None;
        }
        updated.push(entry);
    }
    if updated == parents {
        return None;
    }
    Some(json!({ "status": { "parents": updated } }))
}

/// The merge patch that makes a policy's status say what the index says
/// (`observedGeneration`, the conditions `Accepted`, `TargetFound` and
/// `Conflicted`, `readyEndpoints`, `warmup`), or `None` if it already does.
///
/// The conditions list is kvroute's alone and is replaced whole;
/// `lastTransitionTime` is `now` only for a condition that is new or whose
/// status flipped. A ready count beyond `i32::MAX` is written as `i32::MAX`.
pub fn policy_status_patch(
    existing: Option<&CacheRoutingPolicyStatus>,
    status: &index::PolicyStatus,
    now: Time,
) -> Option<Value> {
    let old = existing.map_or(&[][..], |s| &s.conditions[..]);
    let generation = status.observed_generation;
    let mut conditions = vec![
        condition(
            old,
            policy_conditions::ACCEPTED,
            &status.accepted,
            generation,
            &now,
        ),
        condition(
            old,
            policy_conditions::TARGET_FOUND,
            &status.target_found,
            generation,
            &now,
        ),
        condition(
            old,
            policy_conditions::CONFLICTED,
            &status.conflicted,
            generation,
            &now,
        ),
    ];
    let optional = [
        (policy_conditions::ENGINES_CONSISTENT, &status.engines),
        (policy_conditions::WARMUP_READY, &status.warmup),
    ];
    for (type_, c) in optional {
        if let Some(c) = c {
            conditions.push(condition(old, type_, c, generation, &now));
        }
    }
    let updated = CacheRoutingPolicyStatus {
        observed_generation: Some(generation),
        conditions,
        ready_endpoints: Some(i32::try_from(status.ready_endpoints).unwrap_or(i32::MAX)),
        warmup: warmup_status(existing.and_then(|s| s.warmup.as_ref()), status),
    };
    if existing == Some(&updated) {
        return None;
    }
    let mut patch = json!({ "status": updated });
    // A merge patch keeps what it leaves out: `null` removes.
    if updated.warmup.is_none() {
        patch["status"]["warmup"] = Value::Null;
    }
    Some(patch)
}

/// Most owners `status.warmup` lists per prefix.
const MAX_WARMUP_OWNERS: usize = 16;

/// `status.warmup`: the warm-ups routers reported, merged with those the
/// status already lists, so a new leader (which has no reports yet) keeps
/// them. Per prefix of the spec and owner the newer send wins, at a
/// second's precision (a `metav1.Time`'s), the status's on a tie so an
/// unchanged report writes nothing. `None` while no prefix was sent.
fn warmup_status(
    existing: Option<&WarmupStatus>,
    status: &index::PolicyStatus,
) -> Option<WarmupStatus> {
    let mut prefixes = Vec::new();
    for name in &status.warmup_prefixes {
        let mut owners: Vec<OwnerWarmupStatus> = (existing.iter())
            .flat_map(|w| &w.prefixes)
            .filter(|p| &p.name == name)
            .flat_map(|p| p.owners.iter().cloned())
            .collect();
        for sent in status.warmups_sent.iter().filter(|s| &s.prefix == name) {
            let secs = i64::try_from(sent.unix_ms / 1000).unwrap_or(i64::MAX);
            let Ok(time) = k8s_openapi::jiff::Timestamp::from_second(secs) else {
                continue;
            };
            let reported = OwnerWarmupStatus {
                endpoint: sent.endpoint.clone(),
                last_sent_time: Time(time),
                sent_by: sent.router.clone(),
            };
            match owners.iter_mut().find(|o| o.endpoint == sent.endpoint) {
                Some(o) if o.last_sent_time.0 < time => *o = reported,
                Some(_) => {}
                None => owners.push(reported),
            }
        }
        owners.sort_by_key(|o| std::cmp::Reverse(o.last_sent_time.0));
        owners.truncate(MAX_WARMUP_OWNERS);
        if let Some(newest) = owners.first() {
            prefixes.push(PrefixWarmupStatus {
                name: name.clone(),
                last_sent_time: newest.last_sent_time.clone(),
                owners,
            });
        }
    }
    (!prefixes.is_empty()).then_some(WarmupStatus { prefixes })
}

fn is_ours(parent: &ParentStatus) -> bool {
    parent.controller_name.as_deref() == Some(CONTROLLER_NAME)
}

/// Condition `type_` as `condition` says, keeping the `lastTransitionTime`
/// of the same-typed condition in `old` if its status is unchanged.
fn condition(
    old: &[Condition],
    type_: &str,
    condition: &index::Condition,
    generation: i64,
    now: &Time,
) -> Condition {
    let status = if condition.status { "True" } else { "False" };
    let last_transition_time = old
        .iter()
        .find(|c| c.type_ == type_)
        .filter(|c| c.status == status)
        .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
    Condition {
        last_transition_time,
        message: condition.message.clone(),
        observed_generation: Some(generation),
        reason: condition.reason.as_str().to_owned(),
        status: status.to_owned(),
        type_: type_.to_owned(),
    }
}
