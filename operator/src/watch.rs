//! The Kubernetes watchers: `InferencePool`, `CacheRoutingPolicy`, `Pod`,
//! `Service` (for endpoint picker references), `InferenceObjective` and
//! `ConfigMap` (labelled `kvroute.dev/warmup=true`, for warm-ups) watch
//! streams, converted ([`crate::convert`]) and fed to the [`Index`].
//!
//! A thin edge: an added or changed object becomes `apply_*`, a removed one
//! `delete_*`, and a (re)list is buffered from `Init` to `InitDone` and then
//! replaces what the index holds for that watch's scope (`reset_*` for all
//! namespaces, `reset_*_in` for one). Watch errors are logged and counted;
//! the watcher's own backoff retries them.
//!
//! Objects are watched untyped (`DynamicObject`) and decoded one by one, so
//! one object the API server accepted but kvroute's types cannot read (say,
//! an `InferencePool` from a newer upstream CRD with a value kvroute does not
//! know) cannot stall the watch of every other object, as it would if the
//! whole list were decoded at once. Such an object is logged and counted
//! (`errors_total{what="decode"}`), and the index keeps what it last read of
//! it: routers keep routing on the last good spec rather than losing a pool
//! to a typo-level incompatibility.
//!
//! Readiness: until every watch has its first list in, the index knows only
//! part of the cluster, so [`run_watchers`] flips its `ready` flag only then;
//! routers and the status writer wait for it. A later relist keeps the old
//! objects until the new list is complete, so readiness never goes back.
//!
//! An optional CRD: `InferenceObjective` is alpha upstream, and a cluster
//! may not have its CRD. The API then answers its watch with 404, which
//! counts as an empty first list: readiness does not wait for a kind the
//! cluster does not serve, and pools carry no objectives. The first 404
//! logs one warning (per process) naming the CRD and how to install it;
//! every 404 counts as `errors_total{what="crd_missing"}` (not as a `watch`
//! error); the watch keeps retrying with its backoff (at most about a
//! minute apart), so objectives appear once the CRD is installed. Any
//! other error (403 included: RBAC without the rule) holds readiness back,
//! as for the other kinds.
//!
//! Not here: deciding anything about the objects (the index), writing
//! status, leader election.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch as flag;

use crate::api::{CacheRoutingPolicy, InferenceObjective, InferencePool};
use crate::convert;
use crate::index::{
    ConfigMapInfo, Index, ObjectiveSpec, PodInfo, PolicySpec, PoolSpec, ServiceInfo,
};
use crate::metrics::Metrics;

/// Which namespaces the operator watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace, through one cluster-wide watch per kind.
    All,
    /// These namespaces, through one watch per namespace and kind.
    Namespaces(Vec<String>),
}

impl Scope {
    /// `All` when `namespaces` is empty, else those namespaces.
    pub fn from_namespaces(namespaces: Vec<String>) -> Self {
        if namespaces.is_empty() {
            Scope::All
        } else {
            Scope::Namespaces(namespaces)
        }
    }

    /// One entry per watch: `None` for a cluster-wide one.
    fn watches(&self) -> Vec<Option<String>> {
        match self {
            Scope::All => vec![None],
            Scope::Namespaces(namespaces) => namespaces.iter().cloned().map(Some).collect(),
        }
    }
}

/// How objects of one watched kind reach the index.
trait Watched: Resource<DynamicType = (), Scope = NamespaceResourceScope> + DeserializeOwned {
    /// The index's view of an object.
    type Spec: Clone + Send;
    const KIND: &'static str;
    /// How to install the kind's CRD, when the operator runs without it
    /// (a 404 then reads as "no objects"); `None` for a kind it needs.
    const OPTIONAL_CRD: Option<&'static str> = None;
    /// The label selector of its watch; `None`: every object.
    const LABELS: Option<&'static str> = None;
    fn convert(&self) -> Option<Self::Spec>;
    fn apply(index: &mut Index, spec: Self::Spec);
    fn delete(index: &mut Index, namespace: &str, name: &str);
    /// Replaces the objects in `namespace` (all when `None`) with `specs`.
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<Self::Spec>);
    /// What the index holds for `namespace/name`.
    fn current(index: &Index, namespace: &str, name: &str) -> Option<Self::Spec>;
}

impl Watched for InferencePool {
    type Spec = PoolSpec;
    const KIND: &'static str = "InferencePool";
    fn convert(&self) -> Option<PoolSpec> {
        convert::pool(self)
    }
    fn apply(index: &mut Index, spec: PoolSpec) {
        index.apply_pool(spec);
    }
    fn delete(index: &mut Index, namespace: &str, name: &str) {
        index.delete_pool(namespace, name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<PoolSpec>) {
        match namespace {
            Some(ns) => index.reset_pools_in(ns, specs),
            None => index.reset_pools(specs),
        }
    }
    fn current(index: &Index, namespace: &str, name: &str) -> Option<PoolSpec> {
        index.pool(namespace, name).cloned()
    }
}

impl Watched for CacheRoutingPolicy {
    type Spec = PolicySpec;
    const KIND: &'static str = "CacheRoutingPolicy";
    fn convert(&self) -> Option<PolicySpec> {
        convert::policy(self)
    }
    fn apply(index: &mut Index, spec: PolicySpec) {
        index.apply_policy(spec);
    }
    fn delete(index: &mut Index, namespace: &str, name: &str) {
        index.delete_policy(namespace, name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<PolicySpec>) {
        match namespace {
            Some(ns) => index.reset_policies_in(ns, specs),
            None => index.reset_policies(specs),
        }
    }
    fn current(index: &Index, namespace: &str, name: &str) -> Option<PolicySpec> {
        index.policy(namespace, name).cloned()
    }
}

impl Watched for Pod {
    type Spec = PodInfo;
    const KIND: &'static str = "Pod";
    fn convert(&self) -> Option<PodInfo> {
        convert::pod(self)
    }
    fn apply(index: &mut Index, spec: PodInfo) {
        index.apply_pod(spec);
    }
    fn delete(index: &mut Index, namespace: &str, name: &str) {
        index.delete_pod(namespace, name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<PodInfo>) {
        match namespace {
            Some(ns) => index.reset_pods_in(ns, specs),
            None => index.reset_pods(specs),
        }
    }
    fn current(index: &Index, namespace: &str, name: &str) -> Option<PodInfo> {
        index.pod(namespace, name).cloned()
    }
}

impl Watched for ConfigMap {
    type Spec = ConfigMapInfo;
    const KIND: &'static str = "ConfigMap";
    const LABELS: Option<&'static str> = Some(crate::index::WARMUP_SELECTOR);
    fn convert(&self) -> Option<ConfigMapInfo> {
        convert::config_map(self)
    }
    fn apply(index: &mut Index, spec: ConfigMapInfo) {
        index.apply_config_map(spec);
    }
    fn delete(index: &mut Index, namespace: &str, name: &str) {
        index.delete_config_map(namespace, name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<ConfigMapInfo>) {
        match namespace {
            Some(ns) => index.reset_config_maps_in(ns, specs),
            None => index.reset_config_maps(specs),
        }
    }
    fn current(index: &Index, namespace: &str, name: &str) -> Option<ConfigMapInfo> {
        index.config_map(namespace, name).cloned()
    }
}

impl Watched for Service {
    type Spec = ServiceInfo;
    const KIND: &'static str = "Service";
    fn convert(&self) -> Option<ServiceInfo> {
        convert::service(self)
    }
    fn apply(index: &mut Index, spec: ServiceInfo) {
        index.apply_service(spec);
    }
    fn delete(index: &mut Index, namespace: &str, name: &str) {
        index.delete_service(namespace, name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<ServiceInfo>) {
        match namespace {
            Some(ns) => index.reset_services_in(ns, specs),
            None => index.reset_services(specs),
        }
    }
    fn current(index: &Index, namespace: &str, name: &str) -> Option<ServiceInfo> {
        index.service(namespace, name).cloned()
    }
}

impl Watched for InferenceObjective {
    type Spec = ObjectiveSpec;
    const KIND: &'static str = "InferenceObjective";
    const OPTIONAL_CRD: Option<&'static str> = Some(
        "install the CRD inferenceobjectives.inference.networking.x-k8s.io: \
         `kubectl apply --server-side -f crds/inferenceobjectives.inference.networking.x-k8s.io.yaml` \
         from kvroute, or the Gateway API Inference Extension's manifests",
    );
    fn convert(&self) -> Option<ObjectiveSpec> {
        convert::objective(self)
    }
    fn apply(index: &mut Index, spec: ObjectiveSpec) {
        index.apply_objective(spec);
    }
    fn delete(index: &mut Index, namespace: &str, name: &str) {
        index.delete_objective(namespace, name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<ObjectiveSpec>) {
        match namespace {
            Some(ns) => index.reset_objectives_in(ns, specs),
            None => index.reset_objectives(specs),
        }
    }
    fn current(index: &Index, namespace: &str, name: &str) -> Option<ObjectiveSpec> {
        index.objective(namespace, name).cloned()
    }
}

/// Decodes a watched object into `T` and then the index's view. `Ok(None)`
/// for an object without a namespace or name (the API never sends one);
/// `Err` for one `T` cannot read, after logging and counting it.
fn decode<T: Watched>(object: DynamicObject, metrics: &Metrics) -> Result<Option<T::Spec>, ()> {
    let (namespace, name) = (
        object.metadata.namespace.clone(),
        object.metadata.name.clone(),
    );
    match object.try_parse::<T>() {
        Ok(typed) => Ok(typed.convert()),
        Err(error) => {
            metrics.error("decode");
            tracing::warn!(kind = T::KIND, namespace = ?namespace, name = ?name, %error,
                "cannot read the object; keeping what was last read of it");
            Err(())
        }
    }
}

/// Whether `error` says the API does not serve the watched kind (its CRD is
/// not installed): 404, with or without a `Status` body.
fn not_served(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.is_not_found(),
        watcher::Error::WatchError(status) => status.is_not_found(),
        _ => false,
    }
}

/// Watches pools, policies, Services, pods and objectives in `scope`,
/// feeding `index`; sets `ready` once every watch has its first list in (an
/// objective watch without its CRD counts as listed). Runs until cancelled:
/// watch errors are retried with backoff, never returned.
pub async fn run_watchers(
    client: Client,
    scope: Scope,
    index: Arc<Mutex<Index>>,
    metrics: Arc<Metrics>,
    ready: flag::Sender<bool>,
) {
    let namespaces = scope.watches();
    let lists = InitialLists {
        pending: Arc::new(AtomicUsize::new(namespaces.len() * 6)),
        ready: Arc::new(ready),
    };
    let warned_missing_crd = Arc::new(AtomicBool::new(false));
    let mut watches: Vec<BoxFuture<'static, ()>> = Vec::new();
    for namespace in namespaces {
        let feed = Feed {
            client: client.clone(),
            namespace,
            index: index.clone(),
            metrics: metrics.clone(),
            lists: lists.clone(),
            warned_missing_crd: warned_missing_crd.clone(),
        };
        watches.push(watch::<InferencePool>(feed.clone()).boxed());
        watches.push(watch::<CacheRoutingPolicy>(feed.clone()).boxed());
        watches.push(watch::<Service>(feed.clone()).boxed());
        watches.push(watch::<InferenceObjective>(feed.clone()).boxed());
        watches.push(watch::<ConfigMap>(feed.clone()).boxed());
        watches.push(watch::<Pod>(feed).boxed());
    }
    futures_util::future::join_all(watches).await;
}

/// Counts the watches whose first list is not in yet.
#[derive(Clone, Debug)]
struct InitialLists {
    pending: Arc<AtomicUsize>,
    ready: Arc<flag::Sender<bool>>,
}

impl InitialLists {
    /// One watch has its first list in.
    fn done(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            tracing::info!("initial lists are in; ready");
            self.ready.send_replace(true);
        }
    }
}

/// What one watch needs.
#[derive(Clone)]
struct Feed {
    client: Client,
    /// The namespace watched; `None` for all.
    namespace: Option<String>,
    index: Arc<Mutex<Index>>,
    metrics: Arc<Metrics>,
    lists: InitialLists,
    /// Set by the first watch that finds an optional CRD missing, so the
    /// warning is logged once, not once per namespace and retry.
    warned_missing_crd: Arc<AtomicBool>,
}

/// One watch: objects of kind `T` in the feed's namespace.
async fn watch<T: Watched>(feed: Feed) {
    let Feed {
        client,
        namespace,
        index,
        metrics,
        lists,
        warned_missing_crd,
    } = feed;
    let resource = ApiResource::erase::<T>(&());
    let api: Api<DynamicObject> = match &namespace {
        Some(ns) => Api::namespaced_with(client, ns, &resource),
        None => Api::all_with(client, &resource),
    };
    let mut config = watcher::Config::default();
    if let Some(labels) = T::LABELS {
        config = config.labels(labels);
    }
    let mut events = watcher(api, config).default_backoff().boxed();
    let lock = || index.lock().unwrap_or_else(PoisonError::into_inner);
    // The objects of the (re)list in progress, between `Init` and `InitDone`,
    // and the keys of those that could not be read.
    let mut relist = Vec::new();
    let mut unreadable = Vec::new();
    let mut listed_once = false;
    // Whether this watch counted towards readiness yet (its first list, or
    // its optional CRD found missing), and whether the CRD is missing now.
    let mut counted = false;
    let mut missing = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(o)) => {
                if let Ok(Some(spec)) = decode::<T>(o, &metrics) {
                    T::apply(&mut lock(), spec);
                }
            }
            Ok(Event::Delete(o)) => {
                if let (Some(ns), Some(name)) = (&o.metadata.namespace, &o.metadata.name) {
                    T::delete(&mut lock(), ns, name);
                }
            }
            Ok(Event::Init) => {
                relist.clear();
                unreadable.clear();
                if listed_once {
                    metrics.watch_restart(T::KIND);
                }
            }
            Ok(Event::InitApply(o)) => {
                let key = (o.metadata.namespace.clone(), o.metadata.name.clone());
                match decode::<T>(o, &metrics) {
                    Ok(spec) => relist.extend(spec),
                    Err(()) => unreadable.extend(key.0.zip(key.1)),
                }
            }
            Ok(Event::InitDone) => {
                let mut listed = std::mem::take(&mut relist);
                let mut index = lock();
                // Unreadable objects keep their last readable version.
                listed.extend(
                    unreadable
                        .drain(..)
                        .filter_map(|(ns, name)| T::current(&index, &ns, &name)),
                );
                tracing::info!(kind = T::KIND, namespace = ?namespace, objects = listed.len(), "listed");
                T::reset(&mut index, namespace.as_deref(), listed);
                drop(index);
                listed_once = true;
                if std::mem::take(&mut missing) {
                    tracing::info!(kind = T::KIND, namespace = ?namespace, "the CRD is installed now");
                }
                if !std::mem::replace(&mut counted, true) {
                    lists.done();
                }
            }
            Err(error) if T::OPTIONAL_CRD.is_some() && not_served(&error) => {
                metrics.error("crd_missing");
                if !warned_missing_crd.swap(true, Ordering::Relaxed) {
                    let how = T::OPTIONAL_CRD.unwrap_or_default();
                    tracing::warn!(kind = T::KIND, %error,
                        "the {kind} CRD is not installed, so pools carry no {kind}s until \
                         it is (retrying); {how}", kind = T::KIND);
                } else {
                    tracing::debug!(kind = T::KIND, namespace = ?namespace, %error, "still not served");
                }
                // No CRD, no objects: forget any listed before it went.
                if !std::mem::replace(&mut missing, true) {
                    T::reset(&mut lock(), namespace.as_deref(), Vec::new());
                }
                if !std::mem::replace(&mut counted, true) {
                    lists.done();
                }
            }
            Err(error) => {
                metrics.error("watch");
                metrics.watch_restart(T::KIND);
                tracing::warn!(kind = T::KIND, namespace = ?namespace, %error, "watch failed; retrying");
            }
        }
    }
}
