//! The fake API server, driven over plain HTTP as a Kubernetes client would.

use std::time::Duration;

use futures_util::StreamExt;
use kvroute_testkit::{FakeApiServer, HISTORY_LEN};
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};

const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools";
const PODS: &str = "/api/v1/namespaces/ns/pods";

fn pool(name: &str) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": { "name": name, "namespace": "ns" },
        "spec": { "targetPorts": [{ "number": 8000 }], "selector": { "matchLabels": { "app": name } } },
    })
}

fn pod(name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": "ns", "labels": labels },
        "spec": { "containers": [{ "name": "vllm", "image": "vllm" }] },
    })
}

fn rv(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

struct Api {
    server: FakeApiServer,
    http: Client,
}

impl Api {
    async fn start() -> Self {
        Self {
            server: FakeApiServer::start().await,
            http: Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.url())
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let response = request.send().await.unwrap();
        let status = response.status();
        (status, response.json().await.unwrap())
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.send(self.http.get(self.url(path))).await
    }

    async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        self.send(self.http.post(self.url(path)).json(body)).await
    }

    async fn put(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        self.send(self.http.put(self.url(path)).json(body)).await
    }

    async fn patch(&self, path: &str, content_type: &str, body: &Value) -> (StatusCode, Value) {
        let request = self
            .http
            .patch(self.url(path))
            .header("content-type", content_type)
            .body(body.to_string());
        self.send(request).await
    }

    async fn watch(&self, path_and_query: &str) -> Watch {
        let response = self
            .http
            .get(self.url(path_and_query))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        Watch::new(response)
    }
}

/// Reads newline-delimited watch events.
struct Watch {
    stream: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: Vec<u8>,
}

impl Watch {
    fn new(response: Response) -> Self {
        Self {
            stream: response.bytes_stream().boxed(),
            buffer: Vec::new(),
        }
    }

    /// The next event, or `None` when the server ended the stream.
    async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            let chunk = tokio::time::timeout(Duration::from_secs(10), self.stream.next())
                .await
                .expect("a watch event within 10s")?;
            self.buffer.extend_from_slice(&chunk.unwrap());
        }
    }

    /// The next event's type and object name.
    async fn next_named(&mut self) -> (String, String) {
        let event = self.next().await.expect("another watch event");
        let name = event["object"]["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        (event["type"].as_str().unwrap().to_string(), name)
    }
}

fn named(kind: &str, name: &str) -> (String, String) {
    (kind.to_string(), name.to_string())
}

#[tokio::test]
async fn create_get_and_stale_update_conflicts() {
    let api = Api::start().await;
    let (code, created) = api.post(POOLS, &pool("p")).await;
    assert_eq!(code, StatusCode::CREATED);
    let meta = &created["metadata"];
    assert_eq!(meta["generation"], 1);
    assert!(!meta["uid"].as_str().unwrap().is_empty());
    assert!(meta["creationTimestamp"].as_str().unwrap().ends_with('Z'));
    assert_eq!(rv(&created), api.server.resource_version());

    let (code, again) = api.post(POOLS, &pool("p")).await;
    assert_eq!(
        (code, again["reason"].as_str()),
        (StatusCode::CONFLICT, Some("AlreadyExists"))
    );

    let (code, fetched) = api.get(&format!("{POOLS}/p")).await;
    assert_eq!((code, &fetched), (StatusCode::OK, &created));

    let mut update = created.clone();
    update["spec"]["targetPorts"][0]["number"] = json!(9000);
    let (code, updated) = api.put(&format!("{POOLS}/p"), &update).await;
    assert_eq!(code, StatusCode::OK);
    assert!(rv(&updated) > rv(&created));
    assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);

    // `update` still carries the first version: the write is refused.
    let (code, status) = api.put(&format!("{POOLS}/p"), &update).await;
    assert_eq!(code, StatusCode::CONFLICT);
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["reason"], "Conflict");
    assert_eq!(status["code"], 409);

    let (code, missing) = api.get(&format!("{POOLS}/nope")).await;
    assert_eq!(
        (code, missing["reason"].as_str()),
        (StatusCode::NOT_FOUND, Some("NotFound"))
    );
}

#[tokio::test]
async fn status_subresource_is_separate_from_spec() {
    let api = Api::start().await;
    let mut body = pool("p");
    body["status"] = json!({ "ignored": true });
    let (_, created) = api.post(POOLS, &body).await;
    assert!(created.get("status").is_none(), "create drops status");

    let status_path = format!("{POOLS}/p/status");
    let mut with_status = created.clone();
    with_status["status"] = json!({ "parents": [{ "name": "gw" }] });
    with_status["spec"]["targetPorts"][0]["number"] = json!(1);
    let (code, after_status) = api.put(&status_path, &with_status).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(after_status["status"]["parents"][0]["name"], "gw");
    assert_eq!(
        after_status["spec"], created["spec"],
        "status writes leave spec alone"
    );
    assert_eq!(after_status["metadata"]["generation"], 1);
    assert!(rv(&after_status) > rv(&created));

    let (_, patched) = api
        .patch(
            &status_path,
            "application/merge-patch+json",
            &json!({"status": {"ready": 2}}),
        )
        .await;
    assert_eq!(
        patched["status"],
        json!({ "parents": [{ "name": "gw" }], "ready": 2 })
    );
    assert_eq!(patched["metadata"]["generation"], 1);

    // A spec change bumps generation; the status in the same body is ignored.
    let mut spec_change = patched.clone();
    spec_change["spec"]["targetPorts"][0]["number"] = json!(8001);
    spec_change["status"] = json!({});
    let (_, after_spec) = api.put(&format!("{POOLS}/p"), &spec_change).await;
    assert_eq!(after_spec["metadata"]["generation"], 2);
    assert_eq!(after_spec["status"], patched["status"]);

    // Rewriting the same status is not a new version.
    let (_, same) = api
        .patch(
            &status_path,
            "application/merge-patch+json",
            &json!({"status": {"ready": 2}}),
        )
        .await;
    assert_eq!(rv(&same), rv(&after_spec));
}

#[tokio::test]
async fn merge_patch_and_server_side_apply() {
    let api = Api::start().await;
    let mut body = pool("p");
    body["metadata"]["labels"] = json!({ "a": "1", "b": "2" });
    api.post(POOLS, &body).await;

    let patch = json!({ "metadata": { "labels": { "a": null, "c": "3" } }, "spec": { "targetPorts": [{ "number": 1 }] } });
    let (code, patched) = api
        .patch(
            &format!("{POOLS}/p"),
            "application/merge-patch+json",
            &patch,
        )
        .await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(patched["metadata"]["labels"], json!({ "b": "2", "c": "3" }));
    assert_eq!(patched["spec"]["targetPorts"], json!([{ "number": 1 }]));
    assert_eq!(patched["spec"]["selector"], body["spec"]["selector"]);
    assert_eq!(patched["metadata"]["generation"], 2);

    let apply = "application/apply-patch+yaml";
    let (code, _) = api.patch(&format!("{POOLS}/q"), apply, &pool("q")).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "apply needs a fieldManager");
    let (code, applied) = api
        .patch(
            &format!("{POOLS}/q?fieldManager=t&force=true"),
            apply,
            &pool("q"),
        )
        .await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(
        applied["metadata"]["generation"], 1,
        "apply creates a missing object"
    );

    let (code, unsupported) = api
        .patch(&format!("{POOLS}/p"), "text/plain", &json!({}))
        .await;
    assert_eq!(
        (code, unsupported["code"].as_i64()),
        (StatusCode::UNSUPPORTED_MEDIA_TYPE, Some(415))
    );

    let malformed = api
        .http
        .post(api.url(POOLS))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), StatusCode::BAD_REQUEST);
    let status: Value = malformed.json().await.unwrap();
    assert_eq!(status["reason"], "BadRequest");
}

#[tokio::test]
async fn lists_filter_by_labels_fields_and_namespace() {
    let api = Api::start().await;
    api.post(
        PODS,
        &pod("web-0", json!({ "app": "web", "canary": "yes" })),
    )
    .await;
    api.post(PODS, &pod("web-1", json!({ "app": "web" }))).await;
    api.post(PODS, &pod("db-0", json!({ "app": "db" }))).await;
    let mut other = pod("web-2", json!({ "app": "web" }));
    other["metadata"]["namespace"] = json!("other");
    api.post("/api/v1/namespaces/other/pods", &other).await;

    let names = |list: &Value| -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, list) = api.get(&format!("{PODS}?labelSelector=app%3Dweb")).await;
    assert_eq!(list["kind"], "PodList");
    assert_eq!(
        list["metadata"]["resourceVersion"],
        api.server.resource_version().to_string()
    );
    assert_eq!(names(&list), ["web-0", "web-1"]);
    let (_, list) = api
        .get(&format!("{PODS}?labelSelector=app%3Dweb,!canary"))
        .await;
    assert_eq!(names(&list), ["web-1"]);
    let (_, list) = api.get(&format!("{PODS}?labelSelector=app!%3Dweb")).await;
    assert_eq!(names(&list), ["db-0"]);
    let (_, list) = api.get(&format!("{PODS}?labelSelector=canary")).await;
    assert_eq!(names(&list), ["web-0"]);
    let (_, list) = api
        .get(&format!("{PODS}?fieldSelector=metadata.name%3Ddb-0"))
        .await;
    assert_eq!(names(&list), ["db-0"]);
    let (_, list) = api.get("/api/v1/pods?labelSelector=app%3Dweb").await;
    assert_eq!(
        names(&list),
        ["web-0", "web-1", "web-2"],
        "sorted by namespace, then name"
    );
}

#[tokio::test]
async fn watch_from_a_version_streams_later_events_in_order() {
    let api = Api::start().await;
    let (_, a) = api.post(POOLS, &pool("a")).await;
    api.post(POOLS, &pool("b")).await;
    api.patch(
        &format!("{POOLS}/a"),
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"x": "y"}}}),
    )
    .await;

    let mut watch = api
        .watch(&format!(
            "{POOLS}?watch=true&resourceVersion={}&allowWatchBookmarks=true",
            rv(&a)
        ))
        .await;
    assert_eq!(watch.next_named().await, named("ADDED", "b"));
    assert_eq!(watch.next_named().await, named("MODIFIED", "a"));
    let bookmark = watch.next().await.unwrap();
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert_eq!(
        bookmark["object"]["metadata"]["resourceVersion"],
        api.server.resource_version().to_string()
    );

    api.post(POOLS, &pool("c")).await;
    api.http
        .delete(api.url(&format!("{POOLS}/b")))
        .send()
        .await
        .unwrap();
    assert_eq!(watch.next_named().await, named("ADDED", "c"));
    let deleted = watch.next().await.unwrap();
    assert_eq!(deleted["type"], "DELETED");
    assert_eq!(deleted["object"]["metadata"]["name"], "b");
    assert_eq!(rv(&deleted["object"]), api.server.resource_version());
}

#[tokio::test]
async fn watch_without_a_version_starts_with_current_objects_and_honours_selectors() {
    let api = Api::start().await;
    api.post(PODS, &pod("web-0", json!({ "app": "web" }))).await;
    api.post(PODS, &pod("db-0", json!({ "app": "db" }))).await;
    let mut watch = api
        .watch(&format!(
            "{PODS}?watch=1&labelSelector=app%3Dweb&timeoutSeconds=5"
        ))
        .await;
    assert_eq!(watch.next_named().await, named("ADDED", "web-0"));

    // Leaving the selector is a DELETED for this watch; entering it, an ADDED.
    let merge = "application/merge-patch+json";
    api.patch(
        &format!("{PODS}/web-0"),
        merge,
        &json!({"metadata": {"labels": {"app": "old"}}}),
    )
    .await;
    api.patch(
        &format!("{PODS}/db-0"),
        merge,
        &json!({"metadata": {"labels": {"app": "web"}}}),
    )
    .await;
    assert_eq!(watch.next_named().await, named("DELETED", "web-0"));
    assert_eq!(watch.next_named().await, named("ADDED", "db-0"));

    // Writes through the test helpers are seen too.
    api.server
        .put(pod("web-9", json!({ "app": "web" })))
        .unwrap();
    assert_eq!(watch.next_named().await, named("ADDED", "web-9"));
}

#[tokio::test]
async fn a_version_older_than_the_history_is_expired() {
    let api = Api::start().await;
    // Version 0 means "from now", so the expired version must be at least 1.
    api.server.put(pool("before")).unwrap();
    let first = api.server.put(pool("churn")).unwrap();
    for i in 0..HISTORY_LEN {
        let mut next = pool("churn");
        next["spec"]["targetPorts"][0]["number"] = json!(i);
        api.server.put(next).unwrap();
    }
    let mut watch = api
        .watch(&format!(
            "{POOLS}?watch=true&resourceVersion={}",
            rv(&first) - 1
        ))
        .await;
    let event = watch.next().await.unwrap();
    assert_eq!(event["type"], "ERROR");
    assert_eq!(event["object"]["kind"], "Status");
    assert_eq!(event["object"]["code"], 410);
    assert_eq!(event["object"]["reason"], "Expired");
    assert!(
        watch.next().await.is_none(),
        "the stream ends after the error"
    );

    // The oldest retained version still replays.
    let mut watch = api
        .watch(&format!(
            "{POOLS}?watch=true&resourceVersion={}",
            rv(&first)
        ))
        .await;
    assert_eq!(watch.next_named().await, named("MODIFIED", "churn"));
}

#[tokio::test]
async fn helpers_discovery_and_kubeconfig() {
    let api = Api::start().await;
    let stored = api
        .server
        .put({
            let mut p = pod("web-0", json!({}));
            p["status"] = json!({ "podIP": "10.0.0.1", "phase": "Running" });
            p
        })
        .unwrap();
    assert_eq!(
        stored["status"]["podIP"], "10.0.0.1",
        "helpers may set status"
    );
    let (_, fetched) = api.get(&format!("{PODS}/web-0")).await;
    assert_eq!(fetched, stored);
    assert_eq!(api.server.get("v1", "Pod", "ns", "web-0"), Some(stored));
    assert_eq!(api.server.list("v1", "Pod", None).len(), 1);
    assert!(api.server.delete("v1", "Pod", "ns", "web-0").is_some());
    assert_eq!(api.server.get("v1", "Pod", "ns", "web-0"), None);

    let (code, version) = api.get("/version").await;
    assert_eq!(
        (code, version["major"].as_str()),
        (StatusCode::OK, Some("1"))
    );
    let (_, core) = api.get("/api/v1").await;
    let names: Vec<&str> = core["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"pods") && names.contains(&"pods/status"));
    let (_, groups) = api.get("/apis").await;
    assert!(
        groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["name"] == "kvroute.dev")
    );
    let (_, crp) = api.get("/apis/kvroute.dev/v1alpha1").await;
    assert_eq!(crp["resources"][0]["kind"], "CacheRoutingPolicy");

    let kubeconfig = api.server.kubeconfig_yaml();
    assert!(kubeconfig.contains(&format!("server: {}", api.server.url())));
    assert!(kubeconfig.contains("current-context: fake"));
}

#[tokio::test]
async fn finalizers_delay_deletion_until_a_json_patch_removes_them() {
    let api = Api::start().await;
    let path = format!("{POOLS}/p");
    let (_, created) = api.post(POOLS, &pool("p")).await;
    let mut watch = api
        .watch(&format!(
            "{POOLS}?watch=true&resourceVersion={}",
            rv(&created)
        ))
        .await;

    // Exactly what kube-runtime's finalizer helper sends to add its finalizer.
    let json_patch = "application/json-patch+json";
    let add = json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["kvroute.dev/cleanup"]},
    ]);
    let (code, _) = api.patch(&path, json_patch, &add).await;
    assert_eq!(code, StatusCode::OK);
    let (code, status) = api.patch(&path, json_patch, &add).await;
    assert_eq!(
        (code, status["reason"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("Invalid"))
    );
    assert_eq!(watch.next_named().await, named("MODIFIED", "p"));

    let response = api.http.delete(api.url(&path)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let deleting: Value = response.json().await.unwrap();
    assert!(deleting["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(watch.next_named().await, named("MODIFIED", "p"));
    assert!(
        api.server
            .get("inference.networking.k8s.io/v1", "InferencePool", "ns", "p")
            .is_some()
    );

    let remove = json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "kvroute.dev/cleanup"},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]);
    let (code, _) = api.patch(&path, json_patch, &remove).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(watch.next_named().await, named("DELETED", "p"));
    let (code, _) = api.get(&path).await;
    assert_eq!(code, StatusCode::NOT_FOUND);
}
