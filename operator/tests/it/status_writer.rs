//! The status writer against a scripted mock API (`tower-test`): each test
//! plays the API server's side of the conversation and asserts the exact
//! requests the writer sends.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response};
use kube::client::Body;
use kvroute_operator::index::{Index, PodInfo, PoolSpec};
use kvroute_operator::metrics::{Gauges, Metrics};
use kvroute_operator::status::StatusWriter;
use serde_json::{Value, json};
use tokio::sync::watch;
use tower_test::mock::{self, Handle, SendResponse};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

const POOL_STATUS_PATH: &str = "/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools/llama/status?&fieldManager=kvroute-operator";
const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/ml/events?";

/// A writer over `index`, talking to a mock API.
fn writer(index: Index) -> (StatusWriter, ApiHandle, Arc<Metrics>, Arc<Mutex<Index>>) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let metrics = Arc::new(Metrics::default());
    let index = Arc::new(Mutex::new(index));
    let writer = StatusWriter::new(client, index.clone(), metrics.clone(), "op-1".into());
    (writer, handle, metrics, index)
}

/// Pool `ml/llama` at resourceVersion "41", selecting `app=llama` on port
/// 8000, with `pods`.
fn index_with(pods: &[PodInfo]) -> Index {
    let mut index = Index::new();
    index.apply_pool(pool_spec());
    for pod in pods {
        index.apply_pod(pod.clone());
    }
    index
}

fn pool_spec() -> PoolSpec {
    let mut pool = PoolSpec {
        namespace: "ml".into(),
        name: "llama".into(),
        selector: [("app".to_owned(), "llama".to_owned())].into(),
        target_ports: vec![8000],
        generation: 2,
        ..PoolSpec::default()
    };
    pool.observed.uid = Some("uid-1".into());
    pool.observed.resource_version = Some("41".into());
    pool
}

fn ready_pod() -> PodInfo {
    PodInfo {
        namespace: "ml".into(),
        name: "a".into(),
        labels: [("app".to_owned(), "llama".to_owned())].into(),
        ip: Some("10.0.0.1".parse().unwrap()),
        phase_running: true,
        ready: true,
        deleting: false,
        ready_since_ms: None,
        role: Default::default(),
    }
}

/// The next request: method, path and query, and the JSON body.
async fn next(handle: &mut ApiHandle) -> (Method, String, Value, SendResponse<Response<Body>>) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a request within 5 s")
        .expect("the client is alive");
    let (parts, body) = request.into_parts();
    let bytes = body.collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    if parts.method == Method::PATCH {
        assert_eq!(
            parts.headers["content-type"], "application/merge-patch+json",
            "status writes are merge patches"
        );
    }
    (parts.method, parts.uri.to_string(), body, send)
}

fn respond(send: SendResponse<Response<Body>>, code: u16, body: &Value) {
    let response = Response::builder()
        .status(code)
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    send.send_response(response);
}

/// The pool as the API server returns it after a status write.
fn pool_object(status: &Value) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"namespace": "ml", "name": "llama", "resourceVersion": "42", "generation": 2},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": [{"number": 8000}]},
        "status": status,
    })
}

fn api_error(code: u16, reason: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "message": "scripted", "reason": reason, "code": code})
}

#[tokio::test]
async fn a_pool_without_endpoints_gets_its_status_and_a_warning() {
    let (mut writer, mut api, metrics, _) = writer(index_with(&[]));
    let pass = tokio::spawn(async move { writer.pass().await });

    let (method, path, body, send) = next(&mut api).await;
    assert_eq!(method, Method::PATCH);
    assert_eq!(path, POOL_STATUS_PATH);
    assert_eq!(body["metadata"], json!({"resourceVersion": "41"}));
    let parent = &body["status"]["parents"][0];
    assert_eq!(parent["controllerName"], "kvroute.dev/operator");
    assert_eq!(
        parent["parentRef"],
        json!({"group": "kvroute.dev", "kind": "CacheRoutingPolicy", "name": "default"})
    );
    let conditions: Vec<_> = parent["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["type"].as_str().unwrap(),
                c["status"].as_str().unwrap(),
                c["observedGeneration"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        conditions,
        vec![("Accepted", "True", 2), ("ResolvedRefs", "True", 2)]
    );
    respond(send, 200, &pool_object(&body["status"]));

    let (method, path, event, send) = next(&mut api).await;
    assert_eq!((method, path.as_str()), (Method::POST, EVENTS_PATH));
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "NoReadyEndpoints");
    assert_eq!(event["action"], "Reconcile");
    assert_eq!(event["reportingController"], "kvroute-operator");
    assert_eq!(event["reportingInstance"], "op-1");
    assert_eq!(
        event["regarding"],
        json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "namespace": "ml", "name": "llama", "uid": "uid-1"})
    );
    respond(send, 201, &event);

    assert!(pass.await.unwrap(), "nothing to retry");
    let text = metrics.render(&Gauges::default());
    assert!(
        text.contains("kvroute_operator_status_patches_total{kind=\"InferencePool\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kvroute_operator_events_total{reason=\"NoReadyEndpoints\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_conflict_waits_for_the_watch_and_is_not_resent() {
    let (mut writer, mut api, metrics, index) = writer(index_with(&[ready_pod()]));
    let pass = tokio::spawn(async move { (writer.pass().await, writer) });
    let (_, path, _, send) = next(&mut api).await;
    assert_eq!(path, POOL_STATUS_PATH);
    respond(send, 409, &api_error(409, "Conflict"));
    let (ok, mut writer) = pass.await.unwrap();
    assert!(ok, "a conflict is resolved by the watch, not by a retry");
    assert!(
        !metrics
            .render(&Gauges::default())
            .contains("what=\"status_patch\"")
    );

    // Same object, same version: nothing is sent.
    let again = tokio::spawn(async move { (writer.pass().await, writer) });
    let again = tokio::time::timeout(Duration::from_secs(5), again).await;
    let (ok, mut writer) = again.expect("no request sent").unwrap();
    assert!(ok);
    // The watch brings a newer version: written again, on that version.
    let mut newer = pool_spec();
    newer.observed.resource_version = Some("43".into());
    index.lock().unwrap().apply_pool(newer);
    let pass = tokio::spawn(async move { writer.pass().await });
    let (method, path, body, send) = next(&mut api).await;
    assert_eq!((method, path.as_str()), (Method::PATCH, POOL_STATUS_PATH));
    assert_eq!(body["metadata"], json!({"resourceVersion": "43"}));
    respond(send, 200, &pool_object(&body["status"]));
    assert!(pass.await.unwrap());
}

#[tokio::test]
async fn a_failed_write_is_retried_by_the_next_pass() {
    let (mut writer, mut api, metrics, _) = writer(index_with(&[ready_pod()]));
    let pass = tokio::spawn(async move { (writer.pass().await, writer) });
    let (_, path, first, send) = next(&mut api).await;
    assert_eq!(path, POOL_STATUS_PATH);
    respond(send, 500, &api_error(500, "InternalError"));
    let (ok, mut writer) = pass.await.unwrap();
    assert!(!ok, "a server error asks for a retry");
    assert!(
        metrics
            .render(&Gauges::default())
            .contains("kvroute_operator_errors_total{what=\"status_patch\"} 1")
    );

    let pass = tokio::spawn(async move { writer.pass().await });
    let (method, path, second, send) = next(&mut api).await;
    assert_eq!((method, path.as_str()), (Method::PATCH, POOL_STATUS_PATH));
    assert_eq!(second["status"], first["status"]);
    respond(send, 200, &pool_object(&second["status"]));
    assert!(pass.await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn only_the_leader_writes_and_only_once_the_lists_are_in() {
    let (writer, mut api, _, _) = writer(index_with(&[ready_pod()]));
    let (leader_tx, leader) = watch::channel(false);
    let (ready_tx, ready) = watch::channel(false);
    let task = tokio::spawn(writer.run(leader, ready));

    leader_tx.send_replace(true);
    let idle = tokio::time::timeout(Duration::from_secs(60), api.next_request()).await;
    assert!(
        idle.is_err(),
        "nothing is written before the initial lists are in"
    );

    leader_tx.send_replace(false);
    ready_tx.send_replace(true);
    let idle = tokio::time::timeout(Duration::from_secs(60), api.next_request()).await;
    assert!(idle.is_err(), "a follower writes nothing");

    leader_tx.send_replace(true);
    let (method, path, _, send) = next(&mut api).await;
    assert_eq!((method, path.as_str()), (Method::PATCH, POOL_STATUS_PATH));
    respond(send, 200, &pool_object(&json!({})));
    task.abort();
}
