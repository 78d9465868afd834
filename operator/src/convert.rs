//! Kubernetes objects to the index's inputs: `InferencePool` to
//! [`PoolSpec`], `Pod` to [`PodInfo`], `CacheRoutingPolicy` to
//! [`PolicySpec`], `Service` to [`ServiceInfo`], `InferenceObjective` to
//! [`ObjectiveSpec`]. Pure functions, so the watchers stay thin and the mapping
//! is tested without an API server.
//!
//! Nothing is validated here: a value the index's types cannot hold becomes
//! one the index rejects (a port dropped, a number turned to 0), so the
//! problem shows up in the object's status rather than disappearing.
//!
//! Not here: watching the API, or deciding anything about the objects (the
//! index does).

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::ObjectMeta;
use kvroute_core::role::Role;

use crate::api::policy::{TARGET_GROUP, TARGET_KIND};
use crate::api::{CacheRoutingPolicy, InferenceObjective, InferencePool};
use crate::index::{
    self, ConfigMapInfo, ObjectiveSpec, Observed, PickerRef, PodInfo, PolicySpec, PoolSpec,
    ServiceInfo,
};

#[cfg(test)]
mod tests;

/// The index's view of `pool`; `None` if it has no namespace or name.
///
/// A target port outside 1 to 65535 (which the CRD schema rejects, so only a
/// broken object has one) is dropped; a pool left with no port is reported
/// invalid by the index (`Accepted` False, reason `Invalid`), not silently
/// served on a wrapped-around port.
pub fn pool(pool: &InferencePool) -> Option<PoolSpec> {
    let (namespace, name) = namespace_name(&pool.metadata)?;
    Some(PoolSpec {
        namespace,
        name,
        selector: pool.spec.selector.match_labels.clone(),
        target_ports: pool
            .spec
            .target_ports
            .iter()
            .filter_map(|p| u16::try_from(p.number).ok().filter(|&n| n != 0))
            .collect(),
        picker: pool.spec.endpoint_picker_ref.as_ref().map(|r| PickerRef {
            group: r.group.clone(),
            kind: r.kind.clone(),
            name: r.name.clone(),
            port: r
                .port
                .as_ref()
                .and_then(|p| u16::try_from(p.number).ok().filter(|&n| n != 0)),
        }),
        generation: pool.metadata.generation.unwrap_or(0),
        observed: observed(&pool.metadata, pool.status.as_ref()),
    })
}

/// The index's view of `service`; `None` if it has no namespace or name.
/// Ports outside 1 to 65535 are dropped.
pub fn service(service: &Service) -> Option<ServiceInfo> {
    let (namespace, name) = namespace_name(&service.metadata)?;
    let spec = service.spec.as_ref();
    Some(ServiceInfo {
        namespace,
        name,
        ports: spec
            .and_then(|s| s.ports.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|p| u16::try_from(p.port).ok().filter(|&n| n != 0))
            .collect(),
        external_name: spec.and_then(|s| s.type_.as_deref()) == Some("ExternalName"),
    })
}

/// The index's view of `pod`; `None` if it has no namespace or name.
///
/// An absent or unparsable `status.podIP` gives no IP (the pod then has no
/// endpoint); a missing status reads as not running and not ready. A
/// `Ready` condition that is `True` gives its `lastTransitionTime` as the
/// time the pod became ready (none when the condition has none).
pub fn pod(pod: &Pod) -> Option<PodInfo> {
    let (namespace, name) = namespace_name(&pod.metadata)?;
    let status = pod.status.as_ref();
    let ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    let phase_running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
    let ready_condition = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    let ready = ready_condition.is_some_and(|c| c.status == "True");
    let ready_since_ms = ready_condition
        .filter(|_| ready)
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0.as_millisecond());
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let role = Role::from_labels(&labels).unwrap_or_else(|(label, value)| {
        warn_unknown_role(&namespace, &name, label, &value);
        Role::Both
    });
    Some(PodInfo {
        namespace,
        name,
        labels,
        role,
        ip,
        phase_running,
        ready,
        deleting: pod.metadata.deletion_timestamp.is_some(),
        ready_since_ms,
    })
}

/// Warns that pod `namespace/name`'s `label` has an unknown role `value`:
/// once per pod and value (a bounded memory of the last 1,024 warned),
/// however often the pod is read.
fn warn_unknown_role(namespace: &str, name: &str, label: &str, value: &str) {
    static WARNED: std::sync::Mutex<BTreeSet<(String, String)>> =
        std::sync::Mutex::new(BTreeSet::new());
    let key = (format!("{namespace}/{name}"), value.to_owned());
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if warned.contains(&key) {
        return;
    }
    if warned.len() >= 1024 {
        warned.clear();
    }
    tracing::warn!(pod = %key.0, label, value, "unknown role (not prefill, decode or both): the pod serves as both");
    warned.insert(key);
}

/// The index's view of `policy`; `None` if it has no namespace or name.
///
/// - `created` is `metadata.creationTimestamp` in Unix seconds, 0 when
///   absent (such a policy then wins ties it should not; only objects not
///   yet stored by the API server lack it).
/// - The target is `spec.targetRef.name` only when the reference is to an
///   `InferencePool` of `inference.networking.k8s.io`. Any other reference
///   becomes `Kind.group/name`, which contains a `/` no object name can
///   contain, so the index never finds the target and reports
///   `TargetNotFound` naming it.
/// - Every spec field is mapped, as `Some` (the CRD's defaults fill them
///   in). A number the index's type cannot hold (negative, or a cache port
///   above 65535) becomes `Some(0)` (a negative `slowStartSeconds`, where 0
///   means off: `Some(u32::MAX)`), which [`PolicySpec::validate`] rejects,
///   so the policy is reported `Invalid` instead of taking effect with a
///   different value.
pub fn policy(policy: &CacheRoutingPolicy) -> Option<PolicySpec> {
    let (namespace, name) = namespace_name(&policy.metadata)?;
    let spec = &policy.spec;
    let target = &spec.target_ref;
    let target_pool = if target.group == TARGET_GROUP && target.kind == TARGET_KIND {
        target.name.clone()
    } else {
        unknown_target(&target.group, &target.kind, &target.name)
    };
    Some(PolicySpec {
        namespace,
        name,
        created: policy
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second()),
        generation: policy.metadata.generation.unwrap_or(0),
        target_pool,
        policy: Some(spec.policy.as_str().to_owned()),
        key_mode: Some(spec.routing_key.mode.into()),
        prefix_tokens: Some(u32::try_from(spec.routing_key.prefix_tokens).unwrap_or(0)),
        load_bound: spec.load_bound,
        latency_slack: Some(spec.latency_slack),
        offload_weight: spec.offload_weight,
        prefill_tokens_per_second: Some(spec.engine.prefill_tokens_per_second),
        prefill_overhead_ms: Some(spec.engine.prefill_overhead_ms),
        block_size: Some(u32::try_from(spec.engine.block_size).unwrap_or(0)),
        hash_algorithm: Some(spec.engine.hash_algorithm.into()),
        hash_seed: spec.engine.hash_seed.clone(),
        cache_port: spec
            .engine
            .cache_port
            .map(|p| u16::try_from(p).unwrap_or(0)),
        tenancy_mode: Some(spec.tenancy.mode),
        slow_start_seconds: Some(u32::try_from(spec.slow_start_seconds).unwrap_or(u32::MAX)),
        disaggregation: Some(kvroute_core::spec::Disaggregation {
            mode: spec.disaggregation.mode,
            min_uncached_tokens: u64::try_from(spec.disaggregation.min_uncached_tokens)
                .unwrap_or(u64::MAX),
        }),
        warmup: spec.warmup.clone(),
        tenant_header: spec.tenancy.tenant_header.clone(),
        observed: observed(&policy.metadata, policy.status.as_ref()),
    })
}

/// The index's view of a labelled ConfigMap; `None` if it has no
/// namespace or name. A ConfigMap's data past
/// [`index::MAX_CONFIG_MAP_BYTES`] (the API allows no more) is cut at a key.
pub fn config_map(map: &ConfigMap) -> Option<ConfigMapInfo> {
    let (namespace, name) = namespace_name(&map.metadata)?;
    let mut bytes = 0;
    let data = (map.data.iter().flatten())
        .take_while(|(k, v)| {
            bytes += k.len() + v.len();
            bytes <= index::MAX_CONFIG_MAP_BYTES
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Some(ConfigMapInfo {
        namespace,
        name,
        data,
    })
}

/// The index's view of `objective`; `None` if it has no namespace or name.
///
/// The pool is `spec.poolRef.name` only when the reference is to an
/// `InferencePool` of `inference.networking.k8s.io` (an empty group reads as
/// that default); any other reference gives no pool, so the objective
/// applies to none. An unset priority is 0. (A priority outside `i32` never
/// gets here: the object does not deserialize.)
pub fn objective(objective: &InferenceObjective) -> Option<ObjectiveSpec> {
    let (namespace, name) = namespace_name(&objective.metadata)?;
    Some(ObjectiveSpec {
        namespace,
        name,
        pool: objective.spec.pool_ref.pool().map(str::to_owned),
        priority: objective.spec.priority.unwrap_or(0),
    })
}

/// The target name of a reference to something other than an
/// `InferencePool`: `Kind.group/name` (`Kind/name` for the core group).
fn unknown_target(group: &str, kind: &str, name: &str) -> String {
    if group.is_empty() {
        format!("{kind}/{name}")
    } else {
        format!("{kind}.{group}/{name}")
    }
}

fn observed<S: Clone>(meta: &ObjectMeta, status: Option<&S>) -> Observed<S> {
    Observed {
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        status: status.cloned(),
    }
}

fn namespace_name(meta: &ObjectMeta) -> Option<(String, String)> {
    Some((meta.namespace.clone()?, meta.name.clone()?))
}
