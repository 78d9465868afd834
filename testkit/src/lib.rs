//! Test support shared by kvroute's crates: the test double of the
//! Kubernetes API server that the operator's tests and the e2e system suite
//! run against, and [`eventually`], how integration tests wait for a
//! condition. Not here: the system suite itself (`kvroute-e2e`).
//!
//! # `FakeApiServer`: a stateful fake Kubernetes API server
//!
//! No real kube-apiserver runs on the test machines, so [`FakeApiServer`]
//! serves a small, honest subset of the Kubernetes REST API over plain HTTP
//! on `127.0.0.1:0`, keeping objects as JSON in memory. It is a **test
//! double**, not an emulator; this list says exactly what it does.
//!
//! ## Resources
//!
//! All namespaced: core `v1` `pods`, `services` and `events`,
//! `coordination.k8s.io/v1` `leases`, `events.k8s.io/v1` `events`,
//! `inference.networking.k8s.io/v1` `inferencepools`, `kvroute.dev/v1alpha1`
//! `cacheroutingpolicies`, `inference.networking.x-k8s.io/v1alpha2`
//! `inferenceobjectives`. Every other path is a 404 `Status`, and so are a
//! type's paths while [`FakeApiServer::uninstall`] hides it (a cluster
//! without that CRD).
//!
//! ## What it implements
//!
//! - One `resourceVersion` counter for the whole server, bumped by every
//!   write that changes an object and stamped on it; lists carry the
//!   current counter. A write that changes nothing is not a new version
//!   (as upstream), so status writers do not wake their own watches.
//! - Server-set `metadata.uid`, `creationTimestamp` (RFC 3339, seconds),
//!   `generation` (1 on create, +1 when `spec` changes, never on status
//!   writes); `apiVersion`/`kind` are set from the URL. `generateName` works.
//! - list (one namespace or all), `labelSelector` (`a=b`, `a==b`, `a!=b`,
//!   `a`, `!a`, `a in (x,y)`, `a notin (x,y)`), `fieldSelector` on
//!   `metadata.name` / `metadata.namespace` only.
//! - watch (`watch=true`): from `resourceVersion=N` it replays every change
//!   after `N` from a history of the last [`HISTORY_LEN`] changes, then
//!   streams live ones; without a version (or `0`) it first sends every
//!   current object as `ADDED`. Objects leaving a selector are `DELETED`,
//!   entering it `ADDED`. A version older than the history gets, as upstream,
//!   HTTP 200 and one `ERROR` event whose `Status` has `code: 410,
//!   reason: Expired` (kube-runtime's watcher relists on it; an HTTP 410
//!   response would make it retry the same version forever).
//!   `allowWatchBookmarks` sends one `BOOKMARK` after the initial events and
//!   one at `timeoutSeconds`; `sendInitialEvents=true` (streaming list) sends
//!   current objects then a bookmark annotated `k8s.io/initial-events-end`.
//! - get, create (POST, 201; 409 `AlreadyExists`), update (PUT; 409
//!   `Conflict` on a stale `metadata.resourceVersion`, unconditional when it
//!   is empty), delete (returns the deleted object; a `DELETED` event).
//! - PATCH with `application/merge-patch+json` (RFC 7386);
//!   `strategic-merge-patch+json` and server-side apply
//!   (`apply-patch+yaml`, `fieldManager` required, creates missing objects)
//!   are **both applied as plain merge patches**: no list merge keys, no
//!   field ownership, no apply conflicts. A `metadata.resourceVersion` in a
//!   merge patch is a precondition. `application/json-patch+json` (RFC 6902,
//!   all six operations; a failed `test` is 422 `Invalid`) as kube-runtime's
//!   finalizer helper sends it.
//! - Finalizers: deleting an object with `metadata.finalizers` only sets
//!   `deletionTimestamp` (a `MODIFIED` event); the write that removes the
//!   last finalizer deletes it (a `DELETED` event).
//! - `/status` subresource: PUT/PATCH there change only `status`; PUT/PATCH
//!   on the object ignore `status`; POST drops `status`.
//! - Errors are `Status` objects with upstream codes and reasons (400
//!   `BadRequest`, 404 `NotFound`, 405, 409, 410 `Expired`, 415, 422).
//! - `/version`, `/api`, `/apis`, `/api/v1` and `/apis/{group}/{version}`
//!   legacy discovery documents.
//!
//! ## What it does not implement
//!
//! No authentication, authorization, admission, validation against
//! schemas, defaulting or pruning; no namespaces as objects (any namespace
//! name works); no grace periods (pods go at once), no refusal of new
//! finalizers on a deleting object, no garbage collection of
//! `ownerReferences`; no `deletecollection`; no `dryRun` (rejected with
//! 400); no paging (`limit` is ignored, `continue` never returned); no
//! `resourceVersionMatch` on lists (lists are always current); no YAML
//! bodies (apply bodies must be JSON, which is what kube-rs sends); no
//! protobuf, no `Table` output, no aggregated discovery
//! (`apidiscovery.k8s.io`), no OpenAPI; no field selectors beyond
//! `metadata.name`/`metadata.namespace`; no periodic bookmarks; watching a
//! future `resourceVersion` does not wait for it. Dropping the server stops
//! accepting connections; open watch streams end when their client goes.
//!
//! Test helpers ([`FakeApiServer::put`], [`get`](FakeApiServer::get),
//! [`delete`](FakeApiServer::delete), [`list`](FakeApiServer::list)) work on
//! the store directly, with the same versioning and watch events as HTTP.
//! [`FakeApiServer::service`] serves the same routes in process, without a
//! socket, for tests on tokio's paused clock.

#![forbid(unsafe_code)]

mod error;
mod eventually;
mod http;
mod meta;
mod resource;
mod selector;
mod store;
mod watch;

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::Value;
use tokio::task::JoinHandle;

pub use error::ApiError;
pub use eventually::eventually;
pub use resource::{RESOURCES, ResourceType};
pub use store::HISTORY_LEN;

use store::Store;

/// A fake Kubernetes API server on `127.0.0.1`, stopped when dropped.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    store: Arc<Store>,
    task: JoinHandle<()>,
}

impl FakeApiServer {
    /// Binds `127.0.0.1:0` and starts serving.
    ///
    /// # Panics
    ///
    /// If no local port can be bound; a test cannot continue without one.
    pub async fn start() -> FakeApiServer {
        let store = Arc::new(Store::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0 for the fake API server");
        let addr = listener
            .local_addr()
            .expect("local address of a bound listener");
        let app = http::router(store.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "fake API server stopped");
            }
        });
        FakeApiServer { addr, store, task }
    }

    /// The same server as a tower service, over the same objects, for a
    /// client in this process that needs no socket
    /// (`kube::Client::new(server.service(), "default")`). With no I/O
    /// between client and server, tokio's paused clock advances only when
    /// every task waits on a timer, so a test of timing on it is exact.
    pub fn service(&self) -> axum::Router {
        http::router(self.store.clone())
    }

    /// The base URL, e.g. `http://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig with one cluster at [`url`](Self::url), one context
    /// (namespace `default`) and one user without credentials.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {url}
    insecure-skip-tls-verify: true
contexts:
- name: fake
  context:
    cluster: fake
    user: fake
    namespace: default
current-context: fake
users:
- name: fake
  user: {{}}
preferences: {{}}
",
            url = self.url()
        )
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.store.resource_version()
    }

    /// Stops serving a type over HTTP, as in a cluster without its CRD: its
    /// paths answer 404 and discovery leaves it out. Unlike deleting a CRD,
    /// objects stay stored (the test helpers still reach them) and open
    /// watches go on. Returns whether the type is one the server knows.
    pub fn uninstall(&self, api_version: &str, kind: &str) -> bool {
        resource::by_kind(api_version, kind)
            .map(|rt| self.store.set_served(rt, false))
            .is_some()
    }

    /// Serves a type [`uninstall`](Self::uninstall)ed before again, as
    /// when its CRD is installed. Returns whether the server knows the type.
    pub fn install(&self, api_version: &str, kind: &str) -> bool {
        resource::by_kind(api_version, kind)
            .map(|rt| self.store.set_served(rt, true))
            .is_some()
    }

    /// Creates or replaces an object, `status` included, without preconditions.
    /// The type comes from `apiVersion` and `kind`; the namespace defaults to
    /// `default`. Returns the stored object.
    pub fn put(&self, object: Value) -> Result<Value, ApiError> {
        let rt = Self::resource(&object["apiVersion"], &object["kind"])?;
        self.store.put(rt, object)
    }

    /// One object, if it exists.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let rt = resource::by_kind(api_version, kind)?;
        self.store.get(rt, namespace, name).ok()
    }

    /// Deletes an object, returning its last state if it existed.
    pub fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let rt = resource::by_kind(api_version, kind)?;
        self.store.delete(rt, namespace, name).ok()
    }

    /// Every object of a type, in one namespace or all.
    pub fn list(&self, api_version: &str, kind: &str, namespace: Option<&str>) -> Vec<Value> {
        resource::by_kind(api_version, kind)
            .map(|rt| self.store.list(rt, namespace, |_| true).0)
            .unwrap_or_default()
    }

    fn resource(api_version: &Value, kind: &Value) -> Result<&'static ResourceType, ApiError> {
        let (api_version, kind) = (
            api_version.as_str().unwrap_or(""),
            kind.as_str().unwrap_or(""),
        );
        resource::by_kind(api_version, kind).ok_or_else(|| ApiError::NotFound {
            what: format!("resource type {api_version} {kind}"),
        })
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
