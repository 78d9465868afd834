//! What one pass of the status writer does: from the [`Index`] and what the
//! writer remembers, the status patches to send and the Events to publish.
//! Pure, so the decisions are tested without an API.
//!
//! Writes: an object gets a patch when its watched status differs from what
//! the index implies ([`pool_status_patch`], [`policy_status_patch`]), and
//! the writer has not already sent the same status for the same
//! `resourceVersion` (the watch has not yet brought its own write back).
//! Each patch carries the watched `resourceVersion` as a precondition: a
//! status written meanwhile by someone else makes it fail with 409 instead of
//! being overwritten, and the next watch event brings a new pass.
//!
//! Events, for whoever is on call:
//! - a policy's `Accepted` changes (status or reason) from what its watched
//!   status says: Warning `PolicyInvalid`, `PolicyConflicted` or
//!   `TargetNotFound` with the condition's message, or Normal
//!   `PolicyAccepted`;
//! - a pool's spec becomes invalid (its `Accepted` turns False): Warning
//!   `PoolInvalid`;
//! - a valid pool has no ready endpoint: Warning `NoReadyEndpoints` when
//!   first seen so, or when its last ready endpoint goes; Normal
//!   `EndpointsReady` when it has some again.
//!
//! Conditions are compared with the watched status, so a restarted operator
//! repeats none of those Events; ready counts are not in any status, so it
//! repeats `NoReadyEndpoints` once for each pool that still has none.
//!
//! Not here: sending ([`super::writer`]), leader election.

use std::collections::{HashMap, HashSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition as ApiCondition, Time};
use serde_json::{Value, json};

use super::{policy_status_patch, pool_status_patch};
use crate::api::inference_pool::conditions as pool_conditions;
use crate::api::policy::conditions as policy_conditions;
use crate::index::{self, Index, PolicyStatus, PoolStatus, Reason};

#[cfg(test)]
mod tests;

/// The kind of object a write or an Event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// An `InferencePool`.
    Pool,
    /// A `CacheRoutingPolicy`.
    Policy,
}

impl Kind {
    /// The Kubernetes kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Pool => "InferencePool",
            Kind::Policy => "CacheRoutingPolicy",
        }
    }
}

/// One object, by kind, namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    /// What it is.
    pub kind: Kind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// A merge patch for an object's `status` subresource.
#[derive(Clone, Debug, PartialEq)]
pub struct StatusWrite {
    /// The object.
    pub object: ObjectKey,
    /// The patch: `status`, and `metadata.resourceVersion` as a
    /// precondition when the watched object had one.
    pub body: Value,
}

/// A Kubernetes Event to publish about an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// The object.
    pub object: ObjectKey,
    /// Its `metadata.uid`, when known.
    pub uid: Option<String>,
    /// Warning (true) or Normal.
    pub warning: bool,
    /// The Event's reason (`CamelCase`).
    pub reason: &'static str,
    /// The Event's note, for humans.
    pub note: String,
}

/// What one pass decided.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// Patches to send, pools first.
    pub writes: Vec<StatusWrite>,
    /// Events to publish.
    pub notices: Vec<Notice>,
}

/// A status the index implied, as last sent.
#[derive(Clone, Debug, PartialEq)]
enum Desired {
    Pool(PoolStatus),
    Policy(PolicyStatus),
}

/// What the writer remembers between passes. Forgotten when it loses the
/// lease, so a new term starts from what the API says.
#[derive(Debug, Default)]
pub struct Memory {
    /// Per object: the watched `resourceVersion` a patch was based on, and
    /// the status it sent.
    sent: HashMap<ObjectKey, (Option<String>, Desired)>,
    /// Per valid pool: its ready endpoints at the last pass.
    ready: HashMap<ObjectKey, u32>,
}

impl Memory {
    /// Forgets that `write` was sent (it failed), so the next pass sends it
    /// again.
    pub fn failed(&mut self, write: &StatusWrite) {
        self.sent.remove(&write.object);
    }
}

/// The patches and Events that make the API say what `index` implies, at
/// time `now`. Updates `memory` as if every write succeeded; report failures
/// with [`Memory::failed`].
pub fn plan(index: &Index, memory: &mut Memory, now: &Time) -> Plan {
    let mut plan = Plan::default();
    let mut seen = HashSet::new();
    for pool in index.pools() {
        let Some(status) = index.pool_status(&pool.namespace, &pool.name) else {
            continue;
        };
        let object = key(Kind::Pool, &pool.namespace, &pool.name);
        let watched = pool.observed.status.as_ref();
        let old = watched.and_then(|s| {
            s.parents
                .iter()
                .find(|p| p.controller_name.as_deref() == Some(super::CONTROLLER_NAME))
        });
        let old_accepted = old.and_then(|p| find(&p.conditions, pool_conditions::ACCEPTED));
        let patch = pool_status_patch(watched, &status, pool.generation, now.clone());
        let uid = &pool.observed.uid;
        if patch.is_some() && !status.accepted.status && changed(old_accepted, &status.accepted) {
            plan.notices
                .push(notice(&object, uid, true, "PoolInvalid", &status.accepted));
        }
        if status.accepted.status {
            let before = memory.ready.insert(object.clone(), status.ready_endpoints);
            plan.notices
                .extend(readiness(&object, uid, before, status.ready_endpoints));
        } else {
            memory.ready.remove(&object);
        }
        let rv = &pool.observed.resource_version;
        plan.writes
            .extend(write(memory, &object, rv, patch, Desired::Pool(status)));
        seen.insert(object);
    }
    for policy in index.policies() {
        let Some(status) = index.policy_status(&policy.namespace, &policy.name) else {
            continue;
        };
        let object = key(Kind::Policy, &policy.namespace, &policy.name);
        let watched = policy.observed.status.as_ref();
        let old_accepted = watched.and_then(|s| find(&s.conditions, policy_conditions::ACCEPTED));
        let patch = policy_status_patch(watched, &status, now.clone());
        if patch.is_some() && changed(old_accepted, &status.accepted) {
            let reason = match status.accepted.reason {
                Reason::Invalid => "PolicyInvalid",
                Reason::Conflicted => "PolicyConflicted",
                Reason::TargetNotFound => "TargetNotFound",
                _ => "PolicyAccepted",
            };
            let uid = &policy.observed.uid;
            let warning = !status.accepted.status;
            plan.notices
                .push(notice(&object, uid, warning, reason, &status.accepted));
        }
        let rv = &policy.observed.resource_version;
        plan.writes
            .extend(write(memory, &object, rv, patch, Desired::Policy(status)));
        seen.insert(object);
    }
    // Objects that are gone take their memory with them.
    memory.sent.retain(|k, _| seen.contains(k));
    memory.ready.retain(|k, _| seen.contains(k));
    plan
}

fn key(kind: Kind, namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        kind,
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    }
}

fn find<'a>(conditions: &'a [ApiCondition], type_: &str) -> Option<&'a ApiCondition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether `new` differs from the watched condition in status or reason.
fn changed(old: Option<&ApiCondition>, new: &index::Condition) -> bool {
    let status = if new.status { "True" } else { "False" };
    old.is_none_or(|c| c.status != status || c.reason != new.reason.as_str())
}

fn notice(
    object: &ObjectKey,
    uid: &Option<String>,
    warning: bool,
    reason: &'static str,
    condition: &index::Condition,
) -> Notice {
    Notice {
        object: object.clone(),
        uid: uid.clone(),
        warning,
        reason,
        note: condition.message.clone(),
    }
}

/// The Event for a valid pool whose ready count went from `before` (`None`:
/// first seen) to `now`, if any.
fn readiness(
    object: &ObjectKey,
    uid: &Option<String>,
    before: Option<u32>,
    now: u32,
) -> Option<Notice> {
    let (warning, reason, note) = match (before, now) {
        (None | Some(1..), 0) => (
            true,
            "NoReadyEndpoints",
            "no selected pod is Running and Ready with an IP; routers have nowhere to send requests"
                .to_owned(),
        ),
        (Some(0), 1..) => (false, "EndpointsReady", format!("{now} ready endpoints")),
        _ => return None,
    };
    Some(Notice {
        object: object.clone(),
        uid: uid.clone(),
        warning,
        reason,
        note,
    })
}

/// The write for `object`, unless there is nothing to write or the same
/// status was already sent for the same `resourceVersion`.
fn write(
    memory: &mut Memory,
    object: &ObjectKey,
    resource_version: &Option<String>,
    patch: Option<Value>,
    desired: Desired,
) -> Option<StatusWrite> {
    let Some(mut body) = patch else {
        memory.sent.remove(object);
        return None;
    };
    let sent = (resource_version.clone(), desired);
    if memory.sent.get(object) == Some(&sent) {
        return None;
    }
    memory.sent.insert(object.clone(), sent);
    if let Some(rv) = resource_version {
        body["metadata"] = json!({ "resourceVersion": rv });
    }
    Some(StatusWrite {
        object: object.clone(),
        body,
    })
}
