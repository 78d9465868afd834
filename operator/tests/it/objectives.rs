//! `InferenceObjective`s against the fake API server: created, changed and
//! deleted, they reach a router subscribed over WatchPool as its pool's
//! `name → priority` list; an unreadable one is a decode error; and a
//! cluster without the CRD still gets its pools served, then objectives
//! once the CRD is installed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{Operator, until};
use crate::watchers::client;
use kvroute_operator::index::Index;
use kvroute_operator::metrics::{Gauges, Metrics};
use kvroute_operator::watch::{Scope, run_watchers};
use kvroute_proto::v1::PoolState;
use kvroute_testkit::FakeApiServer;
use serde_json::{Value, json};
use tokio::sync::watch;

const NS: &str = "ml";
const OBJECTIVE_API: &str = "inference.networking.x-k8s.io/v1alpha2";
const OBJECTIVE: &str = "InferenceObjective";
/// How long a change may take to reach a subscriber.
const PROMPTLY: Duration = Duration::from_secs(5);
/// How long a watch of a kind the API did not serve may take to retry: its
/// backoff, doubling from 0.8 s with jitter, after a few failures.
const RETRIED: Duration = Duration::from_secs(60);

fn pool(name: &str) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": name}}, "targetPorts": [{"number": 8000}]},
    })
}

/// Objective `name` for `pool_ref`, with `priority` when given.
fn objective(name: &str, pool_ref: Value, priority: Option<Value>) -> Value {
    let mut spec = json!({"poolRef": pool_ref});
    if let Some(priority) = priority {
        spec["priority"] = priority;
    }
    json!({
        "apiVersion": OBJECTIVE_API,
        "kind": OBJECTIVE,
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    })
}

/// Objective `name` for pool `pool` with `priority`.
fn for_pool(name: &str, pool: &str, priority: i32) -> Value {
    objective(name, json!({"name": pool}), Some(json!(priority)))
}

/// `(name, priority)` of every objective in `state`.
fn objectives(state: &PoolState) -> Vec<(&str, i32)> {
    state
        .objectives
        .iter()
        .map(|o| (o.name.as_str(), o.priority))
        .collect()
}

#[tokio::test]
async fn objectives_reach_a_router_as_they_are_created_changed_and_deleted() {
    let api = FakeApiServer::start().await;
    api.put(pool("llama")).unwrap();
    api.put(pool("mistral")).unwrap();
    api.put(for_pool("chat", "llama", 10)).unwrap();
    let operator = Operator::start(Some(&api), NS, NS, "objectives").await;
    let mut states = operator.watch(NS, "llama").await;

    let first = until(&mut states, PROMPTLY, "the listed objective", |s| {
        s.pool_exists && objectives(s) == [("chat", 10)]
    })
    .await;

    // Created: sorted by name; another pool's stays out.
    api.put(for_pool("batch", "llama", -5)).unwrap();
    api.put(for_pool("other", "mistral", 3)).unwrap();
    let created = until(&mut states, PROMPTLY, "batch added", |s| {
        objectives(s) == [("batch", -5), ("chat", 10)]
    })
    .await;
    assert!(created.version > first.version);

    // Priority changed, and unset (0).
    api.put(for_pool("chat", "llama", 20)).unwrap();
    until(&mut states, PROMPTLY, "chat at 20", |s| {
        objectives(s) == [("batch", -5), ("chat", 20)]
    })
    .await;
    api.put(objective("batch", json!({"name": "llama"}), None))
        .unwrap();
    until(&mut states, PROMPTLY, "batch unset, so 0", |s| {
        objectives(s) == [("batch", 0), ("chat", 20)]
    })
    .await;

    // Moved to another pool, then deleted.
    api.put(for_pool("batch", "mistral", 0)).unwrap();
    until(&mut states, PROMPTLY, "batch moved away", |s| {
        objectives(s) == [("chat", 20)]
    })
    .await;
    api.delete(OBJECTIVE_API, OBJECTIVE, NS, "chat").unwrap();
    let last = until(&mut states, PROMPTLY, "chat deleted", |s| {
        objectives(s).is_empty()
    })
    .await;
    assert!(last.pool_exists && last.version > created.version);

    let mut mistral = operator.watch(NS, "mistral").await;
    until(&mut mistral, PROMPTLY, "mistral's objectives", |s| {
        objectives(s) == [("batch", 0), ("other", 3)]
    })
    .await;
}

#[tokio::test]
async fn without_the_crd_pools_are_served_and_objectives_follow_its_install() {
    let api = FakeApiServer::start().await;
    assert!(api.uninstall(OBJECTIVE_API, OBJECTIVE));
    api.put(pool("llama")).unwrap();
    let operator = Operator::start(Some(&api), NS, NS, "no-crd").await;

    kvroute_testkit::eventually("/readyz 200 without the CRD", PROMPTLY, || async {
        (operator.admin("/readyz").await.0 == 200).then_some(())
    })
    .await;
    let mut states = operator.watch(NS, "llama").await;
    let served = until(&mut states, PROMPTLY, "the pool", |s| s.pool_exists).await;
    assert!(served.objectives.is_empty());
    let counted = "kvroute_operator_errors_total{what=\"crd_missing\"} ";
    kvroute_testkit::eventually("the missing CRD counted", PROMPTLY, || async {
        let (_, text) = operator.admin("/metrics").await;
        text.lines().any(|l| l.starts_with(counted)).then_some(text)
    })
    .await;
    let (_, text) = operator.admin("/metrics").await;
    assert!(
        !text.contains("what=\"watch\""),
        "not a watch error:\n{text}"
    );

    assert!(api.install(OBJECTIVE_API, OBJECTIVE));
    api.put(for_pool("chat", "llama", 7)).unwrap();
    let state = until(&mut states, RETRIED, "the objective once installed", |s| {
        objectives(s) == [("chat", 7)]
    })
    .await;
    assert!(state.version > served.version);
}

#[tokio::test]
async fn an_unreadable_objective_is_counted_and_a_foreign_pool_ref_names_no_pool() {
    let api = FakeApiServer::start().await;
    api.put(pool("llama")).unwrap();
    api.put(for_pool("ok", "llama", 1)).unwrap();
    // Upstream's schema takes any integer; kvroute's i32 cannot hold this.
    let huge = objective("huge", json!({"name": "llama"}), Some(json!(1_i64 << 40)));
    api.put(huge).unwrap();
    let service = json!({"group": "", "kind": "Service", "name": "llama"});
    api.put(objective("svc", service, Some(json!(9)))).unwrap();

    let index = Arc::new(Mutex::new(Index::new()));
    let metrics = Arc::new(Metrics::default());
    let (ready_tx, mut ready) = watch::channel(false);
    let watchers = tokio::spawn(run_watchers(
        client(&api).await,
        Scope::Namespaces(vec![NS.into()]),
        index.clone(),
        metrics.clone(),
        ready_tx,
    ));
    tokio::time::timeout(PROMPTLY, ready.wait_for(|r| *r))
        .await
        .expect("ready despite the unreadable objective")
        .unwrap();
    {
        let mut index = index.lock().unwrap();
        assert_eq!(index.objective(NS, "huge"), None, "never read");
        assert_eq!(index.objective(NS, "svc").unwrap().pool, None);
        let state = index.watch_pool(NS, "llama").borrow().clone();
        assert_eq!(objectives(&state), [("ok", 1)]);
    }
    let text = metrics.render(&Gauges::default());
    assert!(
        text.contains("kvroute_operator_errors_total{what=\"decode\"} 1"),
        "{text}"
    );
    assert!(!text.contains("what=\"crd_missing\""), "{text}");
    watchers.abort();
}
