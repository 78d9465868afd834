//! The `kvroute-operator run` binary against the fake API server: objects
//! written to the API reach a router subscribed over WatchPool, statuses and
//! Events are written, and a restarted operator takes over without
//! rewriting what is already right.

use std::time::Duration;

use crate::support::{self, Operator};
use k8s_openapi::jiff::Timestamp;
use kvroute_proto::v1::PoolState;
use kvroute_testkit::FakeApiServer;
use serde_json::{Value, json};
use tonic::Streaming;

/// How long a change may take to reach a subscriber.
const PROMPTLY: Duration = Duration::from_secs(1);
/// The next state on `stream`, which must arrive within [`PROMPTLY`].
async fn next(stream: &mut Streaming<PoolState>) -> PoolState {
    tokio::time::timeout(PROMPTLY, stream.message())
        .await
        .expect("a state within 1 s")
        .expect("the stream is healthy")
        .expect("the stream is open")
}

/// The first state on `stream` for which `done` holds, within [`PROMPTLY`]
/// (the states before it may be skipped or intermediate, or name a new
/// status writer when a replica takes the lease).
async fn until(stream: &mut Streaming<PoolState>, done: impl Fn(&PoolState) -> bool) -> PoolState {
    support::until(stream, PROMPTLY, "the expected state", done).await
}

/// Waits, up to [`PROMPTLY`], until `check` returns something for the API
/// object `kind/name` in `default`.
async fn eventually<T>(
    api: &FakeApiServer,
    (api_version, kind, name): (&str, &str, &str),
    check: impl Fn(&Value) -> Option<T>,
) -> T {
    let what = format!("{kind} {name} as expected");
    kvroute_testkit::eventually(&what, PROMPTLY, || {
        let found = api
            .get(api_version, kind, "default", name)
            .as_ref()
            .and_then(&check);
        async move { found }
    })
    .await
}

const POOL: (&str, &str, &str) = ("inference.networking.k8s.io/v1", "InferencePool", "llama");
const POLICY: (&str, &str, &str) = ("kvroute.dev/v1alpha1", "CacheRoutingPolicy", "llama-rr");

/// The conditions of kvroute's entry in the pool's `status.parents`, as
/// `(type, status)`.
fn pool_conditions(pool: &Value) -> Option<Vec<(String, String)>> {
    let parent = pool["status"]["parents"]
        .as_array()?
        .iter()
        .find(|p| p["controllerName"] == "kvroute.dev/operator")?;
    Some(conditions(&parent["conditions"]))
}

fn conditions(list: &Value) -> Vec<(String, String)> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["type"].as_str().unwrap_or_default().to_owned(),
                c["status"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn pair(a: &str, b: &str) -> (String, String) {
    (a.to_owned(), b.to_owned())
}

/// The Events about `name` in `default`, whole.
fn events_about(api: &FakeApiServer, name: &str) -> Vec<Value> {
    api.list("events.k8s.io/v1", "Event", Some("default"))
        .into_iter()
        .filter(|e| e["regarding"]["name"] == name)
        .collect()
}

/// When an Event was last observed: its series' last observation, else
/// its time.
fn last_observed(event: &Value) -> Option<Timestamp> {
    let time = event["series"]["lastObservedTime"]
        .as_str()
        .or(event["eventTime"].as_str())?;
    time.parse().ok()
}

/// Waits, up to [`PROMPTLY`], until the latest Event about `name` has
/// `reason` and was observed at or after `since`.
async fn wait_for_latest_event(api: &FakeApiServer, name: &str, reason: &str, since: Timestamp) {
    let latest = || {
        events_about(api, name)
            .into_iter()
            .filter_map(|e| Some((last_observed(&e)?, e)))
            .max_by_key(|(time, _)| *time)
    };
    let wait = async {
        while !latest().is_some_and(|(time, e)| e["reason"] == reason && time >= since) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(PROMPTLY, wait).await.is_err() {
        panic!(
            "the latest Event about {name} is not {reason} within 1 s: {:?}",
            events_about(api, name)
        );
    }
}

/// `(name, ready)` of every endpoint.
fn endpoints(state: &PoolState) -> Vec<(String, bool)> {
    state
        .endpoints
        .iter()
        .map(|e| (e.name.clone(), e.ready))
        .collect()
}

fn pool(name: &str) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "selector": { "matchLabels": { "app": "llama" } },
            "targetPorts": [{ "number": 8000 }],
        },
    })
}

fn pod(name: &str, ip: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": "default", "labels": { "app": "llama" } },
        "spec": { "containers": [{ "name": "engine", "image": "example/engine:1" }] },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{ "type": "Ready", "status": if ready { "True" } else { "False" } }],
        },
    })
}

fn policy(name: &str, target: &str, routing: &str) -> Value {
    json!({
        "apiVersion": "kvroute.dev/v1alpha1",
        "kind": "CacheRoutingPolicy",
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "targetRef": {
                "group": "inference.networking.k8s.io",
                "kind": "InferencePool",
                "name": target,
            },
            "policy": routing,
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_changes_reach_a_watchpool_subscriber_and_status() {
    let api = FakeApiServer::start().await;
    let operator = Operator::start(Some(&api), "default", "default", "op-1").await;
    let mut states = operator.watch("default", "llama").await;
    let absent = next(&mut states).await;
    assert!(!absent.pool_exists);
    assert_eq!(operator.admin("/readyz").await.0, 200);
    assert_eq!(operator.admin("/healthz").await.0, 200);

    let created = Timestamp::now();
    api.put(pool("llama")).expect("create the pool");
    api.put(pod("llama-0", "10.0.0.1", true))
        .expect("create the pod");
    let ready = until(&mut states, |s| !s.endpoints.is_empty()).await;
    assert!(ready.pool_exists);
    assert_eq!(endpoints(&ready), [("llama-0:8000".to_owned(), true)]);
    let endpoint = &ready.endpoints[0];
    assert_eq!(
        (endpoint.address.as_str(), endpoint.http_port),
        ("10.0.0.1", 8000)
    );
    let accepted = eventually(&api, POOL, pool_conditions).await;
    assert_eq!(
        accepted,
        [pair("Accepted", "True"), pair("ResolvedRefs", "True")]
    );

    api.put(pod("llama-0", "10.0.0.1", false))
        .expect("make the pod unready");
    let unready = until(&mut states, |s| s.endpoints.iter().any(|e| !e.ready)).await;
    assert_eq!(endpoints(&unready), [("llama-0:8000".to_owned(), false)]);
    assert!(unready.version > ready.version);
    // The writer may never have seen the pod ready (it coalesces changes
    // that come faster than its passes), in which case the Warning it gave
    // the new pool still stands; either way it is the latest word.
    wait_for_latest_event(&api, "llama", "NoReadyEndpoints", created).await;

    api.delete("v1", "Pod", "default", "llama-0")
        .expect("delete the pod");
    let gone = until(&mut states, |s| s.endpoints.is_empty()).await;
    assert!(gone.pool_exists);
    assert_eq!(endpoints(&gone), []);

    let recreated = Timestamp::now();
    api.put(pod("llama-0", "10.0.0.1", true))
        .expect("recreate the pod");
    until(&mut states, |s| s.endpoints.len() == 1).await;
    wait_for_latest_event(&api, "llama", "EndpointsReady", recreated).await;
    api.put(policy("llama-rr", "llama", "round-robin"))
        .expect("create the policy");
    let configured = until(&mut states, |s| {
        s.policy.as_ref().is_some_and(|p| p.policy == "round-robin")
    })
    .await;
    assert_eq!(configured.policy.expect("a policy").policy, "round-robin");
    let policy_status = eventually(&api, POLICY, |p| {
        (p["status"]["readyEndpoints"] == 1).then(|| conditions(&p["status"]["conditions"]))
    })
    .await;
    assert_eq!(
        policy_status,
        [
            pair("Accepted", "True"),
            pair("TargetFound", "True"),
            pair("Conflicted", "False")
        ]
    );
    // The pool's parent entry now names the policy.
    eventually(&api, POOL, |p| {
        (p["status"]["parents"][0]["parentRef"]["name"] == "llama-rr").then_some(())
    })
    .await;

    // Restart: the lease is released on SIGTERM, so the new replica leads
    // at once; everything it would write is already written.
    operator.metric("kvroute_operator_leader", "1").await;
    let versions = |api: &FakeApiServer| {
        [POOL, POLICY].map(|(v, k, n)| {
            api.get(v, k, "default", n).unwrap()["metadata"]["resourceVersion"].clone()
        })
    };
    let before = versions(&api);
    let events = events_about(&api, "llama");
    let last_version = configured.version;
    drop(states);
    operator.terminate();

    let operator = Operator::start(Some(&api), "default", "default", "op-2").await;
    let mut states = operator.watch("default", "llama").await;
    let resumed = next(&mut states).await;
    assert_eq!(endpoints(&resumed), [("llama-0:8000".to_owned(), true)]);
    assert!(
        resumed.version > last_version,
        "a restarted operator's versions stay ahead, so routers take them"
    );
    operator.metric("kvroute_operator_leader", "1").await;
    // A pass after the initial lists has run (the first one at the latest).
    operator.metric("kvroute_operator_ready", "1").await;
    // What is checked is an absence (no status rewritten), which no
    // condition announces: the status writer counts a pass before it sends
    // the pass's writes, so the test gives a rewrite, if there were one,
    // this long to land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(versions(&api), before, "no status was rewritten");
    let (_, text) = operator.admin("/metrics").await;
    assert!(
        !text.contains("kvroute_operator_status_patches_total{"),
        "{text}"
    );
    assert_eq!(
        events_about(&api, "llama"),
        events,
        "no Event repeated or counted again"
    );

    // And it carries on: a pod flip still reaches the router promptly
    // (after, maybe, the state naming the new leader as the status writer).
    api.put(pod("llama-0", "10.0.0.1", false))
        .expect("make the pod unready");
    let flipped = until(&mut states, |s| s.endpoints.iter().any(|e| !e.ready)).await;
    assert_eq!(endpoints(&flipped), [("llama-0:8000".to_owned(), false)]);
}
