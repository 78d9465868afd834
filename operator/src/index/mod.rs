//! The index: a synchronous, in-memory model of the pools, pods, policies,
//! Services and objectives the operator watches, and the per-pool states it
//! publishes.
//!
//! Watch events become calls: `apply_*` for an added or changed object,
//! `delete_*` for a removed one, `reset_*` for a relist (the watch
//! restarted: everything not in the list is gone). After each call the index
//! recomputes the pools the change can affect and publishes each pool whose
//! state ([`PoolState`]: endpoints, effective policy and objectives) actually
//! changed,
//! with a higher version, on that pool's [`watch`] channel
//! ([`Index::watch_pool`]). Status for the status writer is computed on
//! demand ([`Index::pool_status`], [`Index::policy_status`]).
//!
//! Inputs are plain structs ([`PoolSpec`], [`PodInfo`], [`PolicySpec`],
//! [`ServiceInfo`], [`ObjectiveSpec`]), so the index and its tests need no
//! Kubernetes API.
//!
//! Not here: watching the API and converting objects (the watchers), writing
//! status, serving routers ([`crate::grpc`]), locking (callers share it as
//! `Arc<Mutex<Index>>`).
//!
//! Readiness: until the first `reset_*` of each kind, the index knows only
//! part of the cluster (every pool looks absent or empty), so the operator
//! should serve routers only once every initial list is in. Objectives are
//! the exception the watchers make: without their (alpha) CRD there is no
//! list to wait for, and pools carry none.

mod objectives;
mod observed;
mod pods;
mod policy;
mod pool;
mod services;
mod state;
mod status;
mod store;
#[cfg(test)]
mod tests;
mod warmups;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use kvroute_core::contract::EngineCache;
use kvroute_proto::v1::PoolState;
use tokio::sync::watch;

pub use self::objectives::ObjectiveSpec;
pub use self::observed::Observed;
pub use self::pods::PodInfo;
pub use self::policy::{PolicySpec, default_policy};
pub use self::pool::PoolSpec;
pub use self::services::{PickerRef, ServiceInfo};
pub use self::state::{Clock, wall_clock_micros};
pub use self::status::{Condition, PolicyStatus, PoolStatus, Reason};
pub use self::warmups::{
    ConfigMapInfo, MAX_CONFIG_MAP_BYTES, WARMUP_SELECTOR, WarmupRefused, WarmupSent,
};

use self::state::Content;
use self::store::Namespaced;

/// Pools, pods, policies, Services and objectives, and the state published
/// for each pool.
#[derive(Debug)]
pub struct Index {
    pools: Namespaced<PoolSpec>,
    pods: Namespaced<PodInfo>,
    policies: Namespaced<PolicySpec>,
    /// Services, for the pools' endpoint picker references.
    services: Namespaced<ServiceInfo>,
    /// `InferenceObjective`s, for the pools they name.
    objectives: Namespaced<ObjectiveSpec>,
    /// ConfigMaps matching [`WARMUP_SELECTOR`], for warm-ups' references.
    config_maps: Namespaced<ConfigMapInfo>,
    /// One channel per existing or watched pool.
    states: Namespaced<watch::Sender<PoolState>>,
    /// Bumped on every change that can alter a status.
    changes: watch::Sender<u64>,
    clock: Clock,
    /// Each pod's engine cache settings, as its WatchCache stream reported
    /// them (the operator's probes), by namespace and pod.
    engines: HashMap<(String, String), EngineCache>,
    /// Where routers report warm-ups: the status writer's advertised
    /// address.
    status_writer: Option<String>,
    /// Each pool's warm-ups as routers reported them, by namespace and pool.
    warmups_sent: HashMap<(String, String), warmups::Reported>,
}

/// A pod whose engine the operator should probe: it serves in a pool whose
/// policy names a WatchCache port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineTarget {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// Its WatchCache address.
    pub addr: SocketAddr,
}

impl Default for Index {
    fn default() -> Self {
        Index::new()
    }
}

impl Index {
    /// An empty index whose versions are floored by the wall clock
    /// ([`wall_clock_micros`]), so they stay higher than those of an
    /// earlier run.
    pub fn new() -> Self {
        Index::with_clock(wall_clock_micros)
    }

    /// An empty index whose versions are floored by `clock`; with `|| 0`
    /// every change adds exactly 1.
    pub fn with_clock(clock: Clock) -> Self {
        Index {
            pools: Namespaced::default(),
            pods: Namespaced::default(),
            policies: Namespaced::default(),
            services: Namespaced::default(),
            objectives: Namespaced::default(),
            config_maps: Namespaced::default(),
            states: Namespaced::default(),
            changes: watch::Sender::new(0),
            clock,
            engines: HashMap::new(),
            status_writer: None,
            warmups_sent: HashMap::new(),
        }
    }

    /// A receiver of pool `namespace/name`'s state. For a pool that does
    /// not exist (yet) it holds `pool_exists = false`, version 0, and sees
    /// the pool appear when it is applied.
    pub fn watch_pool(&mut self, namespace: &str, name: &str) -> watch::Receiver<PoolState> {
        self.prune();
        if let Some(tx) = self.states.get(namespace, name) {
            return tx.subscribe();
        }
        let tx = state::channel(namespace, name);
        let rx = tx.subscribe();
        self.states.insert(namespace, name, tx);
        rx
    }

    /// A receiver that sees a new value after every change that can alter
    /// a pool's or a policy's status (the status writer's wake-up).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Pool `namespace/name`, if the index has it.
    pub fn pool(&self, namespace: &str, name: &str) -> Option<&PoolSpec> {
        self.pools.get(namespace, name)
    }

    /// Policy `namespace/name`, if the index has it.
    pub fn policy(&self, namespace: &str, name: &str) -> Option<&PolicySpec> {
        self.policies.get(namespace, name)
    }

    /// Pod `namespace/name`, if the index has it.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<&PodInfo> {
        self.pods.get(namespace, name)
    }

    /// Records what pod `namespace/pod`'s engine reported of its cache.
    pub fn set_engine(&mut self, namespace: &str, pod: &str, engine: EngineCache) {
        let key = (namespace.to_owned(), pod.to_owned());
        if self.engines.get(&key) != Some(&engine) {
            self.engines.insert(key, engine);
            self.changes.send_modify(|n| *n += 1);
        }
    }

    /// What pod `namespace/pod`'s engine reported, if it was probed.
    pub fn engine(&self, namespace: &str, pod: &str) -> Option<&EngineCache> {
        self.engines.get(&(namespace.to_owned(), pod.to_owned()))
    }

    /// The engines to probe: each serving pod of each pool whose policy
    /// names a WatchCache port, once, sorted.
    pub fn engine_targets(&self) -> Vec<EngineTarget> {
        let mut out: Vec<EngineTarget> = self
            .pools()
            .flat_map(|pool| {
                let port = self
                    .attached_policy(&pool.namespace, &pool.name)
                    .and_then(|p| p.cache_port)
                    .unwrap_or(0);
                self.pods
                    .in_namespace(&pool.namespace)
                    .map(|(_, pod)| pod)
                    .filter(move |pod| port > 0 && pod.serves() && pool.selects(pod))
                    .filter_map(move |pod| {
                        Some(EngineTarget {
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                            addr: SocketAddr::new(pod.ip?, port),
                        })
                    })
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Every pool, by namespace and name.
    pub fn pools(&self) -> impl Iterator<Item = &PoolSpec> {
        self.pools.iter().map(|(_, _, pool)| pool)
    }

    /// Every policy, by namespace and name.
    pub fn policies(&self) -> impl Iterator<Item = &PolicySpec> {
        self.policies.iter().map(|(_, _, policy)| policy)
    }

    /// Adds or replaces a pool.
    pub fn apply_pool(&mut self, pool: PoolSpec) {
        let (ns, name) = (pool.namespace.clone(), pool.name.clone());
        self.pools.insert(&ns, &name, pool);
        self.refresh(&ns, &name);
    }

    /// Removes a pool: its state becomes `pool_exists = false`.
    pub fn delete_pool(&mut self, namespace: &str, name: &str) {
        if self.pools.remove(namespace, name).is_some() {
            self.refresh(namespace, name);
        }
    }

    /// Replaces the pools of `namespace` with `pools` (a relist of one
    /// namespace, when the operator watches several); other namespaces keep
    /// theirs. Items outside `namespace` are ignored.
    pub fn reset_pools_in(&mut self, namespace: &str, pools: Vec<PoolSpec>) {
        self.pools.retain(|ns, _, _| ns != namespace);
        for item in pools.into_iter().filter(|i| i.namespace == namespace) {
            let name = item.name.clone();
            self.pools.insert(namespace, &name, item);
        }
        self.refresh_all();
    }

    /// Replaces every pool with `pools` (a relist).
    pub fn reset_pools(&mut self, pools: Vec<PoolSpec>) {
        self.pools = pools
            .into_iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p))
            .collect();
        self.refresh_all();
    }

    /// Adds or replaces a pod.
    pub fn apply_pod(&mut self, pod: PodInfo) {
        let (ns, name) = (pod.namespace.clone(), pod.name.clone());
        let old = self.pods.insert(&ns, &name, pod);
        let new = self.pods.get(&ns, &name);
        if old.as_ref() == new {
            return;
        }
        let affected = self.pools_selecting(&ns, [old.as_ref(), new]);
        let routed = routed_pools([old.as_ref(), new]);
        self.refresh_each(&ns, affected);
        for (ns, name) in routed {
            self.refresh(&ns, &name);
        }
    }

    /// Removes a pod.
    pub fn delete_pod(&mut self, namespace: &str, name: &str) {
        self.engines
            .remove(&(namespace.to_owned(), name.to_owned()));
        if let Some(old) = self.pods.remove(namespace, name) {
            let affected = self.pools_selecting(namespace, [Some(&old), None]);
            self.refresh_each(namespace, affected);
            for (ns, name) in routed_pools([Some(&old), None]) {
                self.refresh(&ns, &name);
            }
        }
    }

    /// Replaces the pods of `namespace` with `pods` (a relist of one
    /// namespace, when the operator watches several); other namespaces keep
    /// theirs. Items outside `namespace` are ignored.
    pub fn reset_pods_in(&mut self, namespace: &str, pods: Vec<PodInfo>) {
        self.pods.retain(|ns, _, _| ns != namespace);
        for item in pods.into_iter().filter(|i| i.namespace == namespace) {
            let name = item.name.clone();
            self.pods.insert(namespace, &name, item);
        }
        self.forget_gone_engines();
        self.refresh_all();
    }

    /// Replaces every pod with `pods` (a relist).
    pub fn reset_pods(&mut self, pods: Vec<PodInfo>) {
        self.pods = pods
            .into_iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p))
            .collect();
        self.forget_gone_engines();
        self.refresh_all();
    }

    /// Adds or replaces a policy.
    pub fn apply_policy(&mut self, policy: PolicySpec) {
        let (ns, name) = (policy.namespace.clone(), policy.name.clone());
        let target = policy.target_pool.clone();
        let old = self.policies.insert(&ns, &name, policy);
        if let Some(old) = old.filter(|o| o.target_pool != target) {
            self.refresh(&ns, &old.target_pool);
        }
        self.refresh(&ns, &target);
    }

    /// Removes a policy.
    pub fn delete_policy(&mut self, namespace: &str, name: &str) {
        if let Some(old) = self.policies.remove(namespace, name) {
            self.refresh(namespace, &old.target_pool);
        }
    }

    /// Replaces the policies of `namespace` with `policies` (a relist of one
    /// namespace, when the operator watches several); other namespaces keep
    /// theirs. Items outside `namespace` are ignored.
    pub fn reset_policies_in(&mut self, namespace: &str, policies: Vec<PolicySpec>) {
        self.policies.retain(|ns, _, _| ns != namespace);
        for item in policies.into_iter().filter(|i| i.namespace == namespace) {
            let name = item.name.clone();
            self.policies.insert(namespace, &name, item);
        }
        self.refresh_all();
    }

    /// Replaces every policy with `policies` (a relist).
    pub fn reset_policies(&mut self, policies: Vec<PolicySpec>) {
        self.policies = policies
            .into_iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p))
            .collect();
        self.refresh_all();
    }

    /// Adds or replaces a labelled ConfigMap.
    pub fn apply_config_map(&mut self, map: ConfigMapInfo) {
        let (ns, name) = (map.namespace.clone(), map.name.clone());
        if self.config_maps.insert(&ns, &name, map).as_ref() != self.config_maps.get(&ns, &name) {
            self.refresh_all();
        }
    }

    /// Removes a ConfigMap.
    pub fn delete_config_map(&mut self, namespace: &str, name: &str) {
        if self.config_maps.remove(namespace, name).is_some() {
            self.refresh_all();
        }
    }

    /// Replaces the ConfigMaps of `namespace` with `maps` (a relist of one
    /// namespace); items outside it are ignored.
    pub fn reset_config_maps_in(&mut self, namespace: &str, maps: Vec<ConfigMapInfo>) {
        self.config_maps.retain(|ns, _, _| ns != namespace);
        for item in maps.into_iter().filter(|i| i.namespace == namespace) {
            let name = item.name.clone();
            self.config_maps.insert(namespace, &name, item);
        }
        self.refresh_all();
    }

    /// Replaces every ConfigMap with `maps` (a relist).
    pub fn reset_config_maps(&mut self, maps: Vec<ConfigMapInfo>) {
        self.config_maps = maps
            .into_iter()
            .map(|m| (m.namespace.clone(), m.name.clone(), m))
            .collect();
        self.refresh_all();
    }

    /// ConfigMap `namespace/name`, if the index has it.
    pub fn config_map(&self, namespace: &str, name: &str) -> Option<&ConfigMapInfo> {
        self.config_maps.get(namespace, name)
    }

    /// Service `namespace/name`, if the index has it.
    pub fn service(&self, namespace: &str, name: &str) -> Option<&ServiceInfo> {
        self.services.get(namespace, name)
    }

    /// Adds or replaces a Service.
    pub fn apply_service(&mut self, service: ServiceInfo) {
        let (ns, name) = (service.namespace.clone(), service.name.clone());
        if self.services.insert(&ns, &name, service).as_ref() != self.services.get(&ns, &name) {
            self.service_changed(&ns, &name);
        }
    }

    /// Removes a Service.
    pub fn delete_service(&mut self, namespace: &str, name: &str) {
        if self.services.remove(namespace, name).is_some() {
            self.service_changed(namespace, name);
        }
    }

    /// Replaces the Services of `namespace` with `services`; other
    /// namespaces keep theirs. Items outside `namespace` are ignored.
    pub fn reset_services_in(&mut self, namespace: &str, services: Vec<ServiceInfo>) {
        self.services.retain(|ns, _, _| ns != namespace);
        for item in services.into_iter().filter(|i| i.namespace == namespace) {
            let name = item.name.clone();
            self.services.insert(namespace, &name, item);
        }
        self.changes.send_modify(|n| *n += 1);
    }

    /// Replaces every Service with `services` (a relist).
    pub fn reset_services(&mut self, services: Vec<ServiceInfo>) {
        self.services = services
            .into_iter()
            .map(|s| (s.namespace.clone(), s.name.clone(), s))
            .collect();
        self.changes.send_modify(|n| *n += 1);
    }

    /// Objective `namespace/name`, if the index has it.
    pub fn objective(&self, namespace: &str, name: &str) -> Option<&ObjectiveSpec> {
        self.objectives.get(namespace, name)
    }

    /// Adds or replaces an objective: the pools it named and names now are
    /// recomputed.
    pub fn apply_objective(&mut self, objective: ObjectiveSpec) {
        let (ns, name) = (objective.namespace.clone(), objective.name.clone());
        let pool = objective.pool.clone();
        let old = self.objectives.insert(&ns, &name, objective);
        if old.as_ref() == self.objectives.get(&ns, &name) {
            return;
        }
        if let Some(old_pool) = old
            .and_then(|o| o.pool)
            .filter(|p| Some(p) != pool.as_ref())
        {
            self.refresh(&ns, &old_pool);
        }
        if let Some(pool) = pool {
            self.refresh(&ns, &pool);
        }
    }

    /// Removes an objective.
    pub fn delete_objective(&mut self, namespace: &str, name: &str) {
        if let Some(pool) = self.objectives.remove(namespace, name).and_then(|o| o.pool) {
            self.refresh(namespace, &pool);
        }
    }

    /// Replaces the objectives of `namespace` with `objectives`; other
    /// namespaces keep theirs. Items outside `namespace` are ignored.
    pub fn reset_objectives_in(&mut self, namespace: &str, objectives: Vec<ObjectiveSpec>) {
        self.objectives.retain(|ns, _, _| ns != namespace);
        for item in objectives.into_iter().filter(|i| i.namespace == namespace) {
            let name = item.name.clone();
            self.objectives.insert(namespace, &name, item);
        }
        self.refresh_all();
    }

    /// Replaces every objective with `objectives` (a relist).
    pub fn reset_objectives(&mut self, objectives: Vec<ObjectiveSpec>) {
        self.objectives = objectives
            .into_iter()
            .map(|o| (o.namespace.clone(), o.name.clone(), o))
            .collect();
        self.refresh_all();
    }

    /// Wakes the status writer when a pool of `namespace` names Service
    /// `name` as its picker (other Services change no status).
    fn service_changed(&mut self, namespace: &str, name: &str) {
        let named = self
            .pools
            .in_namespace(namespace)
            .any(|(_, p)| p.picker.as_ref().is_some_and(|r| r.name == name));
        if named {
            self.changes.send_modify(|n| *n += 1);
        }
    }

    /// Drops the engines of pods the index no longer has.
    fn forget_gone_engines(&mut self) {
        let pods = &self.pods;
        self.engines
            .retain(|(ns, pod), _| pods.get(ns, pod).is_some());
    }

    /// The pools of `namespace` that select any of `pods`.
    fn pools_selecting(&self, namespace: &str, pods: [Option<&PodInfo>; 2]) -> Vec<String> {
        self.pools
            .in_namespace(namespace)
            .filter(|(_, pool)| pods.iter().flatten().any(|pod| pool.selects(pod)))
            .map(|(name, _)| name.to_owned())
            .collect()
    }

    /// Recomputes the pools `names` of `namespace`.
    fn refresh_each(&mut self, namespace: &str, names: Vec<String>) {
        for name in names {
            self.refresh(namespace, &name);
        }
    }

    /// Recomputes every existing or watched pool.
    fn refresh_all(&mut self) {
        let mut keys = self.pools.keys();
        keys.extend(self.states.keys());
        keys.sort_unstable();
        keys.dedup();
        for (ns, name) in keys {
            self.refresh(&ns, &name);
        }
    }

    /// Recomputes pool `namespace/name` and publishes its state if it
    /// changed. A pool that is gone and unwatched loses its channel.
    fn refresh(&mut self, namespace: &str, name: &str) {
        self.changes.send_modify(|n| *n += 1);
        let content = self.content(namespace, name);
        match self.states.get(namespace, name) {
            Some(tx) if !content.exists && tx.receiver_count() == 0 => {
                self.states.remove(namespace, name);
            }
            Some(tx) => {
                state::publish(tx, content, self.clock);
            }
            None if content.exists => {
                let tx = state::channel(namespace, name);
                state::publish(&tx, content, self.clock);
                self.states.insert(namespace, name, tx);
            }
            None => {}
        }
    }

    /// What pool `namespace/name`'s state should say now.
    fn content(&self, namespace: &str, name: &str) -> Content {
        let Some(pool) = self.pools.get(namespace, name) else {
            return Content::default();
        };
        let attached = self.attached_policy(namespace, name);
        let mut policy = attached.map_or_else(default_policy, PolicySpec::routing_policy);
        if let Some(w) = attached.and_then(|p| p.warmup.as_ref()) {
            let (resolved, _) = warmups::resolve(w, namespace, &self.config_maps);
            policy.warmup = Some((&resolved).into());
        }
        let pods = self.pods.in_namespace(namespace).map(|(_, p)| p);
        let objectives = self.objectives.in_namespace(namespace).map(|(_, o)| o);
        Content {
            exists: true,
            endpoints: pods::endpoints(pool, pods, policy.cache_port),
            policy: Some(policy),
            objectives: objectives::of_pool(objectives, name),
            routers: pods::routers(self.pods.iter().map(|(_, _, p)| p), namespace, name),
            status_writer: self.status_writer.clone().unwrap_or_default(),
        }
    }

    /// Sets where routers report warm-ups, and tells every pool's routers.
    pub fn set_status_writer(&mut self, address: Option<String>) {
        if self.status_writer != address {
            self.status_writer = address;
            self.refresh_all();
        }
    }

    /// Takes a report of warm-ups sent for pool `namespace/pool`, `(prefix,
    /// endpoint, unix_ms)`, from `router` at `peer`: refused whole unless
    /// the pool's state names that router and the report comes from its
    /// pod's address ([`warmups::reporter`]). Entries for prefixes the
    /// pool's policy does not name, or endpoints the pool does not have,
    /// are dropped; returns how many were taken.
    pub fn record_warmups(
        &mut self,
        namespace: &str,
        pool: &str,
        router: &str,
        peer: Option<IpAddr>,
        sent: Vec<(String, String, u64)>,
    ) -> Result<usize, WarmupRefused> {
        let Some(state) = self.states.get(namespace, pool) else {
            return Err(WarmupRefused::UnknownRouter);
        };
        let state = state.borrow();
        let pods = self.pods.iter().map(|(_, _, p)| p);
        warmups::reporter(&state.routers, pods, (namespace, pool), router, peer)?;
        // The names the policy gives and the endpoints the pool's state
        // already lists: nothing recomputed per report.
        let policies = self.policies.in_namespace(namespace).map(|(_, p)| p);
        let prefixes: Vec<&str> = policy::attached(policies, pool)
            .filter(|_| self.pools.get(namespace, pool).is_some())
            .and_then(|p| p.warmup.as_ref())
            .map(|w| w.prefixes.iter().map(|p| p.name.as_str()).collect())
            .unwrap_or_default();
        if prefixes.is_empty() {
            return Ok(0);
        }
        let endpoints: Vec<&str> = state.endpoints.iter().map(|e| e.name.as_str()).collect();
        let key = (namespace.to_owned(), pool.to_owned());
        let reported = self.warmups_sent.entry(key).or_default();
        let (taken, changed) = reported.record(router, sent, &prefixes, &endpoints);
        if changed {
            self.changes.send_modify(|n| *n += 1);
        }
        Ok(taken)
    }

    /// Why prefixes of `policy`'s warm-ups are left out (their references
    /// do not resolve), each naming its field.
    pub(super) fn unresolved_warmups(&self, policy: &PolicySpec) -> Option<Vec<String>> {
        let w = policy.warmup.as_ref()?;
        Some(warmups::resolve(w, &policy.namespace, &self.config_maps).1)
    }

    /// The policy in effect for pool `namespace/name`, if any.
    fn attached_policy(&self, namespace: &str, name: &str) -> Option<&PolicySpec> {
        policy::attached(self.policies.in_namespace(namespace).map(|(_, p)| p), name)
    }

    /// Drops the channels of pools that do not exist and nobody watches, so
    /// subscriptions to made-up names do not accumulate.
    fn prune(&mut self) {
        let pools = &self.pools;
        self.states
            .retain(|ns, name, tx| tx.receiver_count() > 0 || pools.get(ns, name).is_some());
        self.warmups_sent
            .retain(|(ns, name), _| pools.get(ns, name).is_some());
    }
}

/// The pools `(namespace, name)` any of `pods` is a router of.
fn routed_pools(pods: [Option<&PodInfo>; 2]) -> Vec<(String, String)> {
    let mut pools: Vec<(String, String)> = (pods.iter().flatten())
        .filter_map(|p| p.router_for())
        .map(|(ns, name)| (ns.to_owned(), name.to_owned()))
        .collect();
    pools.dedup();
    pools
}
