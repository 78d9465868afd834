//! The watchers against the fake API server with a real kube-rs client:
//! objects reach the index, readiness waits for every initial list, and an
//! object kvroute's types cannot read stalls nothing else.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kvroute_operator::index::Index;
use kvroute_operator::metrics::{Gauges, Metrics};
use kvroute_operator::watch::{Scope, run_watchers};
use kvroute_testkit::FakeApiServer;
use serde_json::{Value, json};
use tokio::sync::watch;

/// A kube-rs client of `api`.
pub(crate) async fn client(api: &FakeApiServer) -> kube::Client {
    let kubeconfig = Kubeconfig::from_yaml(&api.kubeconfig_yaml()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

fn pool(name: &str, app_protocol: &str, port: u16) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "targetPorts": [{"number": port}],
            "appProtocol": app_protocol,
        },
    })
}

/// Waits up to 5 s for `check` to hold on the index.
async fn eventually(index: &Mutex<Index>, what: &str, check: impl Fn(&Index) -> bool) {
    kvroute_testkit::eventually(what, Duration::from_secs(5), || {
        let holds = check(&index.lock().unwrap());
        async move { holds.then_some(()) }
    })
    .await;
}

fn ports(index: &Index, name: &str) -> Option<Vec<u16>> {
    index.pool("ml", name).map(|p| p.target_ports.clone())
}

#[tokio::test]
async fn an_unreadable_pool_stalls_nothing_and_keeps_its_last_readable_spec() {
    let api = FakeApiServer::start().await;
    // "grpc" is no `appProtocol` kvroute knows; a newer upstream CRD might
    // accept it.
    api.put(pool("good", "http", 8000)).unwrap();
    api.put(pool("odd", "grpc", 8000)).unwrap();

    let index = Arc::new(Mutex::new(Index::new()));
    let metrics = Arc::new(Metrics::default());
    let (ready_tx, mut ready) = watch::channel(false);
    let watchers = tokio::spawn(run_watchers(
        client(&api).await,
        Scope::Namespaces(vec!["ml".into()]),
        index.clone(),
        metrics.clone(),
        ready_tx,
    ));
    tokio::time::timeout(Duration::from_secs(5), ready.wait_for(|r| *r))
        .await
        .expect("ready within 5 s despite the unreadable pool")
        .unwrap();
    {
        let index = index.lock().unwrap();
        assert_eq!(ports(&index, "good"), Some(vec![8000]));
        assert_eq!(ports(&index, "odd"), None, "never read, so unknown");
    }

    // A readable pool turning unreadable keeps its last readable spec...
    api.put(pool("good", "grpc", 9000)).unwrap();
    // ...while other changes still flow.
    api.put(pool("odd", "http", 8001)).unwrap();
    eventually(&index, "the fixed pool", |i| {
        ports(i, "odd") == Some(vec![8001])
    })
    .await;
    assert_eq!(ports(&index.lock().unwrap(), "good"), Some(vec![8000]));
    let text = metrics.render(&Gauges::default());
    assert!(
        text.contains("kvroute_operator_errors_total{what=\"decode\"} 2"),
        "{text}"
    );

    // Deleting an unreadable object still deletes it.
    api.delete(
        "inference.networking.k8s.io/v1",
        "InferencePool",
        "ml",
        "good",
    )
    .unwrap();
    eventually(&index, "the deleted pool gone", |i| {
        ports(i, "good").is_none()
    })
    .await;
    watchers.abort();
}

/// The watchers over every namespace of `api`, feeding `index`, once
/// ready.
async fn watch_all(api: &FakeApiServer, index: &Arc<Mutex<Index>>) -> tokio::task::JoinHandle<()> {
    let (ready_tx, mut ready) = watch::channel(false);
    let watchers = tokio::spawn(run_watchers(
        client(api).await,
        Scope::All,
        index.clone(),
        Arc::new(Metrics::default()),
        ready_tx,
    ));
    tokio::time::timeout(Duration::from_secs(5), ready.wait_for(|r| *r))
        .await
        .expect("ready within 5 s")
        .unwrap();
    watchers
}

#[tokio::test]
async fn a_pools_picker_reference_follows_its_service() {
    let api = FakeApiServer::start().await;
    let mut with_picker = pool("llama", "http", 8000);
    with_picker["spec"]["endpointPickerRef"] =
        json!({"name": "llama-picker", "port": {"number": 9002}, "failureMode": "FailOpen"});
    api.put(with_picker).unwrap();

    let index = Arc::new(Mutex::new(Index::new()));
    let watchers = watch_all(&api, &index).await;
    let resolved = |i: &Index| {
        let c = i.pool_status("ml", "llama").unwrap().resolved_refs;
        (c.status, c.reason.as_str())
    };
    assert_eq!(
        resolved(&index.lock().unwrap()),
        (false, "InvalidExtensionRef")
    );

    api.put(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "llama-picker", "namespace": "ml"},
        "spec": {"ports": [{"name": "grpc", "port": 9002, "targetPort": 9002}]},
    }))
    .unwrap();
    eventually(&index, "the Service resolves the reference", |i| {
        resolved(i) == (true, "ResolvedRefs")
    })
    .await;

    api.delete("v1", "Service", "ml", "llama-picker").unwrap();
    eventually(&index, "the deleted Service unresolves it", |i| {
        resolved(i) == (false, "InvalidExtensionRef")
    })
    .await;
    watchers.abort();
}

#[tokio::test]
async fn a_pod_is_ready_since_its_ready_conditions_last_transition() {
    let api = FakeApiServer::start().await;
    api.put(pool("llama", "http", 8000)).unwrap();
    let pod = |ready: &str, since: &str| {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "llama-0", "namespace": "ml", "labels": {"app": "llama"}},
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.7",
                "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": since}],
            },
        })
    };
    api.put(pod("True", "2026-01-02T03:04:05Z")).unwrap();

    let index = Arc::new(Mutex::new(Index::new()));
    let watchers = watch_all(&api, &index).await;
    let states = index.lock().unwrap().watch_pool("ml", "llama");
    let since = |states: &watch::Receiver<kvroute_proto::v1::PoolState>| {
        let state = states.borrow();
        state
            .endpoints
            .iter()
            .map(|e| (e.ready, e.ready_since_unix_ms))
            .collect::<Vec<_>>()
    };
    let poll = |want: Vec<(bool, Option<i64>)>| {
        let states = states.clone();
        async move {
            kvroute_testkit::eventually("the pod's ready time", Duration::from_secs(5), || {
                let holds = since(&states) == want;
                async move { holds.then_some(()) }
            })
            .await;
        }
    };
    poll(vec![(true, Some(1_767_323_045_000))]).await;

    // Unready: no ready time; ready again: the new transition's.
    api.put(pod("False", "2026-01-02T03:05:00Z")).unwrap();
    poll(vec![(false, None)]).await;
    api.put(pod("True", "2026-01-02T03:06:00Z")).unwrap();
    poll(vec![(true, Some(1_767_323_160_000))]).await;
    watchers.abort();
}

#[tokio::test]
async fn a_pods_role_label_reaches_its_endpoints() {
    let api = FakeApiServer::start().await;
    api.put(pool("llama", "http", 8000)).unwrap();
    let pod = |name: &str, labels: serde_json::Value| {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "labels": labels},
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.7",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        })
    };
    api.put(pod(
        "llama-0",
        json!({"app": "llama", "kvroute.dev/role": "prefill"}),
    ))
    .unwrap();
    api.put(pod(
        "llama-1",
        json!({"app": "llama", "llm-d.ai/role": "decode"}),
    ))
    .unwrap();
    api.put(pod(
        "llama-2",
        json!({"app": "llama", "kvroute.dev/role": "cook"}),
    ))
    .unwrap();

    let index = Arc::new(Mutex::new(Index::new()));
    let watchers = watch_all(&api, &index).await;
    let states = index.lock().unwrap().watch_pool("ml", "llama");
    use kvroute_proto::v1::EndpointRole;
    let want = vec![
        ("llama-0:8000".to_owned(), EndpointRole::Prefill),
        ("llama-1:8000".to_owned(), EndpointRole::Decode),
        ("llama-2:8000".to_owned(), EndpointRole::Both),
    ];
    kvroute_testkit::eventually("the pods' roles", Duration::from_secs(5), || {
        let roles: Vec<_> = (states.borrow().endpoints.iter())
            .map(|e| (e.name.clone(), e.role()))
            .collect();
        let holds = roles == want;
        async move { holds.then_some(()) }
    })
    .await;
    watchers.abort();
}
