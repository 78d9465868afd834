//! Opt-in: the `kvroute-operator` binary against a real cluster. Pods the
//! kubelet really starts reach a router subscribed over WatchPool with their
//! real IPs, the real API server accepts the status the operator writes, and
//! a deleted pod leaves the endpoint set.
//!
//! It changes the cluster of the current kubeconfig context, so it is
//! `#[ignore]`d and, even with `--ignored`, runs only when
//! `KVROUTE_CLUSTER_TESTS=1`. On a throwaway kind cluster:
//!
//! ```sh
//! kind create cluster
//! KVROUTE_CLUSTER_TESTS=1 cargo test -p kvroute-operator --test it cluster:: -- --ignored --nocapture
//! ```
//!
//! What it changes:
//! - Applies `crds/*.yaml` (server-side apply, field manager
//!   `kvroute-cluster-test`) and leaves them installed. The upstream CRDs
//!   (InferencePool, InferenceObjective) are applied only when absent, as
//!   the Helm chart does: upstream's are compatible.
//! - Creates the namespace `kvroute-test-<unix seconds>-<pid>` (labelled
//!   `app.kubernetes.io/created-by=kvroute-cluster-test`) holding an
//!   InferencePool, a CacheRoutingPolicy, two `pause` pods and the
//!   operator's Lease, and deletes it at the end, pass or fail. Only a killed
//!   test process leaves one behind; delete those with `kubectl delete
//!   namespace -l app.kubernetes.io/created-by=kvroute-cluster-test`.
//!
//! The test and the operator both run on this machine as the kubeconfig's
//! user, which therefore needs the rules of `operator/RBAC.md` plus get,
//! list, watch, create and patch on `customresourcedefinitions`, create and
//! delete on `namespaces` and `pods`, and create on `inferencepools` and
//! `cacheroutingpolicies`. kind's default user is a cluster admin.

use std::fmt::Debug;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::Operator;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::{self, await_condition, conditions::is_crd_established};
use kube::{Client, Resource};
use kvroute_operator::api::{CacheRoutingPolicy, InferencePool};
use kvroute_proto::v1::PoolState;
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use tonic::Streaming;

const OPT_IN: &str = "KVROUTE_CLUSTER_TESTS";
/// Field manager, Lease identity and namespace label of this test.
const CREATED_BY: &str = "kvroute-cluster-test";
const CRD_ESTABLISHED: Duration = Duration::from_secs(60);
/// How long the pods may take to be ready, image pulls included.
const PODS_READY: Duration = Duration::from_secs(180);
const STATUS_WRITTEN: Duration = Duration::from_secs(30);
const POD_GONE: Duration = Duration::from_secs(60);

/// An endpoint as a router sees it: name, address, HTTP port, ready.
type Seen = (String, String, u32, bool);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster; see the module docs"]
async fn pods_of_a_real_cluster_reach_a_router_and_status() {
    if std::env::var(OPT_IN).as_deref() != Ok("1") {
        eprintln!(
            "not run: it changes the cluster of the current kubeconfig context; \
             set {OPT_IN}=1 to run it (see operator/tests/it/cluster.rs)"
        );
        return;
    }
    let client = Client::try_default()
        .await
        .expect("a client for the current kubeconfig context");
    install_crds(&client).await;

    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let namespace = format!("kvroute-test-{}-{}", now.as_secs(), std::process::id());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let labels = json!({ "app.kubernetes.io/created-by": CREATED_BY });
    let metadata = json!({ "name": namespace, "labels": labels });
    let object = json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": metadata });
    create(&namespaces, object).await;
    eprintln!("testing in namespace {namespace}");

    // A task of its own, so that the namespace goes even when it panics.
    let outcome = tokio::spawn(scenario(client, namespace.clone())).await;
    let deleted = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    if let Err(failed) = outcome {
        if let Err(e) = deleted {
            eprintln!("and the namespace {namespace} could not be deleted: {e}");
        }
        match failed.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("the test body did not finish: {e}"),
        }
    }
    deleted.unwrap_or_else(|e| panic!("delete the namespace {namespace}: {e}"));
}

/// The test proper, in the fresh `namespace`.
async fn scenario(client: Client, namespace: String) {
    let ns = namespace.as_str();
    let operator = Operator::start(None, ns, ns, CREATED_BY).await;
    let mut states = operator.watch(ns, "echo").await;
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), ns);
    let policies: Api<CacheRoutingPolicy> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client, ns);

    let selector = json!({ "matchLabels": { "app": "echo" } });
    let pool = json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": { "name": "echo" },
        "spec": { "selector": selector, "targetPorts": [{ "number": 8080 }] },
    });
    create(&pools, pool).await;
    let group = "inference.networking.k8s.io";
    let target = json!({ "group": group, "kind": "InferencePool", "name": "echo" });
    let policy = json!({
        "apiVersion": "kvroute.dev/v1alpha1",
        "kind": "CacheRoutingPolicy",
        "metadata": { "name": "echo" },
        "spec": { "targetRef": target, "policy": "kvroute" },
    });
    create(&policies, policy).await;
    create(&pods, pod("echo-0")).await;
    create(&pods, pod("echo-1")).await;

    let both = until(&mut states, PODS_READY, "both pods ready", |s| {
        s.endpoints.len() == 2 && s.endpoints.iter().all(|e| e.ready)
    })
    .await;
    let expected = pod_endpoints(&pods, &["echo-0", "echo-1"]).await;
    assert_eq!(endpoints(&both), expected, "the pods' IPs and target port");
    let what = "the pool Accepted by kvroute";
    wait_for(&pools, "echo", STATUS_WRITTEN, what, kvroute_accepted()).await;
    let what = "the policy Accepted with 2 ready endpoints";
    wait_for(&policies, "echo", STATUS_WRITTEN, what, policy_ready(2)).await;

    pods.delete("echo-1", &DeleteParams::default())
        .await
        .expect("delete the pod echo-1");
    let one = until(&mut states, POD_GONE, "echo-1 gone", |s| {
        s.endpoints.len() == 1
    })
    .await;
    assert_eq!(endpoints(&one), expected[..1]);
    let what = "the policy with 1 ready endpoint";
    wait_for(&policies, "echo", STATUS_WRITTEN, what, policy_ready(1)).await;

    assert_eq!(operator.admin("/readyz").await.0, 200);
    operator.metric("kvroute_operator_leader", "1").await;
    drop(states);
    // `terminate` blocks until the process exits.
    tokio::task::spawn_blocking(move || operator.terminate())
        .await
        .expect("the operator stops cleanly");
}

/// Applies `crds/*.yaml`, except an upstream CRD already there, and waits
/// for each to be Established.
async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("read crds/")
        .map(|entry| entry.expect("list crds/").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path).expect("read a CRD");
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = crd.metadata.name.clone().expect("a named CRD");
        let upstream = crd.spec.group.starts_with("inference.networking.");
        if upstream && crds.get_opt(&name).await.expect("read CRDs").is_some() {
            eprintln!("keeping the installed {name}");
        } else {
            let apply = PatchParams::apply(CREATED_BY).force();
            crds.patch(&name, &apply, &Patch::Apply(&crd))
                .await
                .unwrap_or_else(|e| panic!("apply the CRD {name}: {e}"));
        }
        let what = format!("the CRD {name} Established");
        wait_for(&crds, &name, CRD_ESTABLISHED, &what, is_crd_established()).await;
    }
}

/// Creates `object`, given as JSON, through `api`.
async fn create<K>(api: &Api<K>, object: Value)
where
    K: Resource + Clone + Debug + DeserializeOwned + Serialize,
{
    let (kind, name) = (&object["kind"], &object["metadata"]["name"]);
    let what = format!("{} {}", kind.as_str().unwrap(), name.as_str().unwrap());
    let typed: K = serde_json::from_value(object).unwrap_or_else(|e| panic!("{what}: {e}"));
    api.create(&PostParams::default(), &typed)
        .await
        .unwrap_or_else(|e| panic!("create {what}: {e}"));
}

/// A pod of the pool, Ready as soon as it runs (no probes). Nothing listens
/// on 8080: the operator reports endpoints and never connects to them. The
/// security context passes the `restricted` Pod Security level.
fn pod(name: &str) -> Value {
    let security = json!({
        "allowPrivilegeEscalation": false,
        "capabilities": { "drop": ["ALL"] },
        "runAsNonRoot": true,
        "runAsUser": 65535,
        "seccompProfile": { "type": "RuntimeDefault" },
    });
    let image = "registry.k8s.io/pause:3.10";
    let container = json!({ "name": "pause", "image": image, "securityContext": security });
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "labels": { "app": "echo" } },
        "spec": { "terminationGracePeriodSeconds": 1, "containers": [container] },
    })
}

/// Every endpoint of `state`, by name.
fn endpoints(state: &PoolState) -> Vec<Seen> {
    let mut endpoints: Vec<_> = state
        .endpoints
        .iter()
        .map(|e| (e.name.clone(), e.address.clone(), e.http_port, e.ready))
        .collect();
    endpoints.sort();
    endpoints
}

/// The endpoints the ready pods `names` should be, from the `status.podIP`
/// the API server has for them.
async fn pod_endpoints(pods: &Api<Pod>, names: &[&str]) -> Vec<Seen> {
    let mut expected = Vec::new();
    for name in names {
        let pod = pods.get(name).await.expect("read a pod");
        let ip = pod.status.and_then(|s| s.pod_ip).expect("a pod IP");
        expected.push((format!("{name}:8080"), ip, 8080, true));
    }
    expected
}

fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// kvroute's entry in the pool's `status.parents` says `Accepted`.
fn kvroute_accepted() -> impl wait::Condition<InferencePool> {
    |pool: Option<&InferencePool>| {
        let parents = pool.iter().flat_map(|p| &p.status).flat_map(|s| &s.parents);
        parents
            .filter(|p| p.controller_name.as_deref() == Some("kvroute.dev/operator"))
            .any(|p| is_true(&p.conditions, "Accepted"))
    }
}

/// The policy is `Accepted` and counts `ready` ready endpoints.
fn policy_ready(ready: i32) -> impl wait::Condition<CacheRoutingPolicy> {
    move |policy: Option<&CacheRoutingPolicy>| {
        let status = policy.and_then(|p| p.status.as_ref());
        status
            .is_some_and(|s| is_true(&s.conditions, "Accepted") && s.ready_endpoints == Some(ready))
    }
}

/// The first state on `states` for which `done` holds, within `within`.
async fn until(
    states: &mut Streaming<PoolState>,
    within: Duration,
    what: &str,
    done: impl Fn(&PoolState) -> bool,
) -> PoolState {
    let mut last = None;
    let wait = async {
        loop {
            let state = states.message().await.expect("a healthy WatchPool stream");
            let state = state.expect("an open WatchPool stream");
            if done(&state) {
                return state;
            }
            last = Some(state);
        }
    };
    let outcome = tokio::time::timeout(within, wait).await;
    outcome.unwrap_or_else(|_| {
        let last = last.as_ref().map(endpoints);
        panic!("not within {within:?}: {what}; the last endpoints: {last:?}")
    })
}

/// Waits, up to `within`, until `done` holds for the object `name`; on a
/// timeout, says what its status is.
async fn wait_for<K>(
    api: &Api<K>,
    name: &str,
    within: Duration,
    what: &str,
    done: impl wait::Condition<K> + Send,
) where
    K: Resource + Clone + Debug + Send + DeserializeOwned + Serialize + 'static,
{
    let waiting = await_condition(api.clone(), name, done);
    match tokio::time::timeout(within, waiting).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => panic!("watch {name}: {e}"),
        Err(_) => {
            let now = api.get_opt(name).await.ok().flatten();
            let status = now.map(|o| serde_json::to_value(o).unwrap()["status"].to_string());
            let status = status.as_deref().unwrap_or("unknown");
            panic!("not within {within:?}: {what}; its status: {status}");
        }
    }
}
