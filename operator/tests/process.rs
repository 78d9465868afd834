//! The `kvroute-operator run` binary against the fake API server: objects
//! written to the API reach a router subscribed over WatchPool.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute_e2e::FakeApiServer;
use kvroute_proto::v1::endpoint_discovery_client::EndpointDiscoveryClient;
use kvroute_proto::v1::{PoolState, WatchPoolRequest};
use serde_json::{Value, json};
use tonic::Streaming;

/// How long a change may take to reach a subscriber.
const PROMPTLY: Duration = Duration::from_secs(1);
/// How long the operator may take to start listening.
const STARTUP: Duration = Duration::from_secs(30);

/// The operator process and its kubeconfig file; both go away on drop, so a
/// failing test leaves no process behind.
struct Operator {
    child: Child,
    kubeconfig: PathBuf,
    addr: String,
}

impl Operator {
    /// Starts `kvroute-operator run` against `api`, watching `default`.
    async fn start(api: &FakeApiServer) -> Operator {
        let kubeconfig = std::env::temp_dir().join(format!(
            "kvroute-operator-test-{}-{}.yaml",
            std::process::id(),
            api.url().rsplit(':').next().unwrap_or("0")
        ));
        std::fs::write(&kubeconfig, api.kubeconfig_yaml()).expect("write the kubeconfig");
        let child = Command::new(env!("CARGO_BIN_EXE_kvroute-operator"))
            .args([
                "run",
                "--grpc-listen",
                "127.0.0.1:0",
                "--namespace",
                "default",
            ])
            .env("KUBECONFIG", &kubeconfig)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvroute-operator");
        let mut operator = Operator {
            child,
            kubeconfig,
            addr: String::new(),
        };
        let stdout = operator.child.stdout.take().expect("piped stdout");
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            BufReader::new(stdout)
                .read_line(&mut line)
                .expect("read the operator's stdout");
            line
        });
        let line = tokio::time::timeout(STARTUP, line)
            .await
            .expect("the operator starts listening")
            .unwrap();
        operator.addr = line
            .trim()
            .strip_prefix("kvroute-operator: WatchPool on ")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_owned();
        operator
    }

    async fn watch(&self, namespace: &str, pool: &str) -> Streaming<PoolState> {
        let mut client = EndpointDiscoveryClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect to WatchPool");
        client
            .watch_pool(WatchPoolRequest {
                namespace: namespace.into(),
                pool: pool.into(),
                subscriber: "test-router".into(),
            })
            .await
            .expect("WatchPool")
            .into_inner()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.kubeconfig);
    }
}

/// The next state on `stream`, which must arrive within [`PROMPTLY`].
async fn next(stream: &mut Streaming<PoolState>) -> PoolState {
    tokio::time::timeout(PROMPTLY, stream.message())
        .await
        .expect("a state within 1 s")
        .expect("the stream is healthy")
        .expect("the stream is open")
}

/// The first state on `stream` for which `done` holds, within [`PROMPTLY`]
/// (the states before it may be skipped or intermediate).
async fn until(stream: &mut Streaming<PoolState>, done: impl Fn(&PoolState) -> bool) -> PoolState {
    let wait = async {
        loop {
            let state = stream
                .message()
                .await
                .expect("the stream is healthy")
                .expect("the stream is open");
            if done(&state) {
                return state;
            }
        }
    };
    tokio::time::timeout(PROMPTLY, wait)
        .await
        .expect("the expected state within 1 s")
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
async fn api_changes_reach_a_watchpool_subscriber() {
    let api = FakeApiServer::start().await;
    let operator = Operator::start(&api).await;
    let mut states = operator.watch("default", "llama").await;
    let absent = next(&mut states).await;
    assert!(!absent.pool_exists);

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

    api.put(pod("llama-0", "10.0.0.1", false))
        .expect("make the pod unready");
    let unready = next(&mut states).await;
    assert_eq!(endpoints(&unready), [("llama-0:8000".to_owned(), false)]);
    assert!(unready.version > ready.version);

    api.delete("v1", "Pod", "default", "llama-0")
        .expect("delete the pod");
    let gone = next(&mut states).await;
    assert!(gone.pool_exists);
    assert_eq!(endpoints(&gone), []);

    api.put(policy("llama-rr", "llama", "round-robin"))
        .expect("create the policy");
    let configured = next(&mut states).await;
    assert_eq!(configured.policy.expect("a policy").policy, "round-robin");
}
