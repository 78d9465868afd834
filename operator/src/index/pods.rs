//! `PodInfo`, the index's view of a pod, and how a pool's pods become its
//! endpoints: one per pod IP × target port, flagged ready or draining.
//!
//! Not here: converting `Pod` objects (the watchers do that), or deciding
//! which pool a pod belongs to ([`PoolSpec::selects`]).

use std::collections::BTreeMap;
use std::net::IpAddr;

use kvroute_core::role::Role;
use kvroute_proto::v1;

use super::pool::PoolSpec;

/// What the index needs of a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodInfo {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name; endpoint names start with it.
    pub name: String,
    /// The pod's labels, matched against pool selectors.
    pub labels: BTreeMap<String, String>,
    /// `status.podIP`; a pod without one has no endpoint.
    pub ip: Option<IpAddr>,
    /// `status.phase` is `Running`.
    pub phase_running: bool,
    /// The pod's `Ready` condition is `True`.
    pub ready: bool,
    /// `metadata.deletionTimestamp` is set: the pod is terminating.
    pub deleting: bool,
    /// When the `Ready` condition last changed (`lastTransitionTime`), Unix
    /// milliseconds, while it is `True`: when the pod became ready, the
    /// start of its slow-start ramp on every router.
    pub ready_since_ms: Option<i64>,
    /// Its role in a disaggregated pool, from its labels.
    pub role: Role,
}

/// The label naming the pool a router pod routes for.
pub const ROUTER_FOR: &str = "kvroute.dev/router-for";
/// The label naming that pool's namespace, when not the pod's own.
pub const ROUTER_FOR_NAMESPACE: &str = "kvroute.dev/router-for-namespace";

impl PodInfo {
    /// Whether the pod can take new requests: Running, Ready, with an IP and
    /// not terminating.
    pub fn serves(&self) -> bool {
        self.phase_running && self.ready && self.ip.is_some() && !self.deleting
    }

    /// The pool `(namespace, name)` it is a router of, by its labels
    /// ([`ROUTER_FOR`], [`ROUTER_FOR_NAMESPACE`]).
    pub fn router_for(&self) -> Option<(&str, &str)> {
        let pool = self.labels.get(ROUTER_FOR)?;
        let namespace = self.labels.get(ROUTER_FOR_NAMESPACE);
        Some((namespace.unwrap_or(&self.namespace), pool))
    }
}

/// The names of pool `namespace/pool`'s routers that serve, sorted.
pub(super) fn routers<'a>(
    pods: impl Iterator<Item = &'a PodInfo>,
    namespace: &str,
    pool: &str,
) -> Vec<String> {
    let mut names: Vec<String> = pods
        .filter(|p| p.serves() && p.router_for() == Some((namespace, pool)))
        .map(|p| p.name.clone())
        .collect();
    names.sort_unstable();
    names
}

/// The endpoints `pool` makes of `pods` (any pods: those it does not select
/// are skipped), sorted by name. `cache_port` is the effective policy's
/// WatchCache port (0 for none).
///
/// A pod with an IP is listed even when it does not serve, so routers can
/// tell "not ready yet" and "draining" from "gone": a terminating pod is
/// `draining` and never `ready`.
pub(super) fn endpoints<'a>(
    pool: &PoolSpec,
    pods: impl IntoIterator<Item = &'a PodInfo>,
    cache_port: u32,
) -> Vec<v1::Endpoint> {
    let ports = pool.ports();
    let mut out = Vec::new();
    for pod in pods {
        let Some(ip) = pod.ip.filter(|_| pool.selects(pod)) else {
            continue;
        };
        let address = ip.to_string();
        for &port in &ports {
            out.push(v1::Endpoint {
                name: format!("{}:{port}", pod.name),
                address: address.clone(),
                http_port: port.into(),
                cache_port,
                ready: pod.serves(),
                draining: pod.deleting,
                ready_since_unix_ms: pod.ready_since_ms.filter(|_| pod.serves()),
                role: v1::EndpointRole::from(pod.role).into(),
            });
        }
    }
    // Pods come sorted by name, but "a-b:80" sorts before "a:80": sort the
    // endpoint names themselves.
    out.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    out
}
