//! The Kubernetes watchers: `InferencePool`, `CacheRoutingPolicy` and `Pod`
//! watch streams, converted ([`crate::convert`]) and fed to the [`Index`].
//!
//! A thin edge: an added or changed object becomes `apply_*`, a removed one
//! `delete_*`, and a (re)list is buffered from `Init` to `InitDone` and then
//! replaces what the index holds for that watch's scope (`reset_*` for all
//! namespaces, `reset_*_in` for one). Watch errors are logged and counted;
//! the watcher's own backoff retries them.
//!
//! Readiness: until every watch has its first list in, the index knows only
//! part of the cluster, so [`run_watchers`] flips its `ready` flag only then;
//! routers and the status writer wait for it. A later relist keeps the old
//! objects until the new list is complete, so readiness never goes back.
//!
//! Not here: deciding anything about the objects (the index), writing
//! status, leader election.

use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch as flag;

use crate::api::{CacheRoutingPolicy, InferencePool};
use crate::convert;
use crate::index::{Index, PodInfo, PolicySpec, PoolSpec};
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
trait Watched:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + Debug
    + Send
    + 'static
{
    /// The index's view of an object.
    type Spec: Send;
    const KIND: &'static str;
    fn convert(&self) -> Option<Self::Spec>;
    fn apply(index: &mut Index, spec: Self::Spec);
    fn delete(index: &mut Index, spec: Self::Spec);
    /// Replaces the objects in `namespace` (all when `None`) with `specs`.
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<Self::Spec>);
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
    fn delete(index: &mut Index, spec: PoolSpec) {
        index.delete_pool(&spec.namespace, &spec.name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<PoolSpec>) {
        match namespace {
            Some(ns) => index.reset_pools_in(ns, specs),
            None => index.reset_pools(specs),
        }
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
    fn delete(index: &mut Index, spec: PolicySpec) {
        index.delete_policy(&spec.namespace, &spec.name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<PolicySpec>) {
        match namespace {
            Some(ns) => index.reset_policies_in(ns, specs),
            None => index.reset_policies(specs),
        }
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
    fn delete(index: &mut Index, spec: PodInfo) {
        index.delete_pod(&spec.namespace, &spec.name);
    }
    fn reset(index: &mut Index, namespace: Option<&str>, specs: Vec<PodInfo>) {
        match namespace {
            Some(ns) => index.reset_pods_in(ns, specs),
            None => index.reset_pods(specs),
        }
    }
}

/// Watches pools, policies and pods in `scope`, feeding `index`; sets
/// `ready` once every watch has its first list in. Runs until cancelled:
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
        pending: Arc::new(AtomicUsize::new(namespaces.len() * 3)),
        ready: Arc::new(ready),
    };
    let mut watches: Vec<BoxFuture<'static, ()>> = Vec::new();
    for namespace in namespaces {
        let feed = Feed {
            client: client.clone(),
            namespace,
            index: index.clone(),
            metrics: metrics.clone(),
            lists: lists.clone(),
        };
        watches.push(watch::<InferencePool>(feed.clone()).boxed());
        watches.push(watch::<CacheRoutingPolicy>(feed.clone()).boxed());
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
}

/// One watch: objects of kind `T` in the feed's namespace.
async fn watch<T: Watched>(feed: Feed) {
    let Feed {
        client,
        namespace,
        index,
        metrics,
        lists,
    } = feed;
    let api: Api<T> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let lock = || index.lock().unwrap_or_else(PoisonError::into_inner);
    // The objects of the (re)list in progress, between `Init` and `InitDone`.
    let mut relist = Vec::new();
    let mut listed_once = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(o)) => {
                if let Some(spec) = o.convert() {
                    T::apply(&mut lock(), spec);
                }
            }
            Ok(Event::Delete(o)) => {
                if let Some(spec) = o.convert() {
                    T::delete(&mut lock(), spec);
                }
            }
            Ok(Event::Init) => {
                relist.clear();
                if listed_once {
                    metrics.watch_restart(T::KIND);
                }
            }
            Ok(Event::InitApply(o)) => relist.extend(o.convert()),
            Ok(Event::InitDone) => {
                let listed = std::mem::take(&mut relist);
                tracing::info!(kind = T::KIND, namespace = ?namespace, objects = listed.len(), "listed");
                T::reset(&mut lock(), namespace.as_deref(), listed);
                if !listed_once {
                    listed_once = true;
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
