//! The `kvroute-operator run` binary against the fake API server: objects
//! written to the API reach a router subscribed over WatchPool, statuses and
//! Events are written, and a restarted operator takes over without
//! rewriting what is already right.

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
    admin: String,
}

impl Operator {
    /// Starts `kvroute-operator run` against `api`, watching `default`,
    /// with the lease identity `identity`.
    async fn start(api: &FakeApiServer, identity: &str) -> Operator {
        let kubeconfig = std::env::temp_dir().join(format!(
            "kvroute-operator-test-{}-{}-{identity}.yaml",
            std::process::id(),
            api.url().rsplit(':').next().unwrap_or("0")
        ));
        std::fs::write(&kubeconfig, api.kubeconfig_yaml()).expect("write the kubeconfig");
        let child = Command::new(env!("CARGO_BIN_EXE_kvroute-operator"))
            .args([
                "run",
                "--grpc-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--namespace",
                "default",
                "--lease-namespace",
                "default",
                "--identity",
                identity,
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
            admin: String::new(),
        };
        let stdout = operator.child.stdout.take().expect("piped stdout");
        let lines = tokio::task::spawn_blocking(move || {
            let mut stdout = BufReader::new(stdout);
            let mut lines = [String::new(), String::new()];
            for line in &mut lines {
                stdout.read_line(line).expect("read the operator's stdout");
            }
            lines
        });
        let [grpc, admin] = tokio::time::timeout(STARTUP, lines)
            .await
            .expect("the operator starts listening")
            .unwrap();
        let addr = |line: &str, prefix: &str| {
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}"))
                .to_owned()
        };
        operator.addr = addr(&grpc, "kvroute-operator: WatchPool on ");
        operator.admin = addr(&admin, "kvroute-operator: admin on ");
        operator
    }

    /// `GET` on the admin server: status code and body.
    async fn admin(&self, path: &str) -> (u16, String) {
        let response = reqwest::get(format!("http://{}{path}", self.admin))
            .await
            .expect("the admin server answers");
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    }

    /// Waits until `/metrics` has a line `metric value`.
    async fn metric(&self, metric: &str, value: &str) {
        let wanted = format!("{metric} {value}");
        let wait = async {
            loop {
                let (_, text) = self.admin("/metrics").await;
                if text.lines().any(|l| l == wanted) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(STARTUP, wait)
            .await
            .unwrap_or_else(|_| panic!("no `{wanted}` in /metrics"));
    }

    /// Stops it with SIGTERM, as Kubernetes does, and waits for it to exit.
    fn terminate(mut self) {
        let killed = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(killed.success());
        let status = self.child.wait().expect("wait for the operator");
        assert!(status.success(), "a clean exit on SIGTERM, got {status}");
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

/// Waits, up to [`PROMPTLY`], until `check` returns something for the API
/// object `kind/name` in `default`.
async fn eventually<T>(
    api: &FakeApiServer,
    (api_version, kind, name): (&str, &str, &str),
    check: impl Fn(&Value) -> Option<T>,
) -> T {
    let wait = async {
        loop {
            if let Some(found) = api
                .get(api_version, kind, "default", name)
                .as_ref()
                .and_then(&check)
            {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(PROMPTLY, wait)
        .await
        .unwrap_or_else(|_| panic!("{kind} {name} not as expected within 1 s"))
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

/// The reasons of the Events about `name` in `default`.
fn event_reasons(api: &FakeApiServer, name: &str) -> Vec<String> {
    api.list("events.k8s.io/v1", "Event", Some("default"))
        .iter()
        .filter(|e| e["regarding"]["name"] == name)
        .map(|e| e["reason"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Waits, up to [`PROMPTLY`], until the Events about `name` have exactly
/// the reasons `reasons`, in order.
async fn wait_for_events(api: &FakeApiServer, name: &str, reasons: &[&str]) {
    let wait = async {
        while event_reasons(api, name) != reasons {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(PROMPTLY, wait).await.is_err() {
        panic!(
            "Events about {name}: {:?}, not {reasons:?}",
            event_reasons(api, name)
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
    let operator = Operator::start(&api, "op-1").await;
    let mut states = operator.watch("default", "llama").await;
    let absent = next(&mut states).await;
    assert!(!absent.pool_exists);
    assert_eq!(operator.admin("/readyz").await.0, 200);
    assert_eq!(operator.admin("/healthz").await.0, 200);

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
    let unready = next(&mut states).await;
    assert_eq!(endpoints(&unready), [("llama-0:8000".to_owned(), false)]);
    assert!(unready.version > ready.version);

    api.delete("v1", "Pod", "default", "llama-0")
        .expect("delete the pod");
    let gone = next(&mut states).await;
    assert!(gone.pool_exists);
    assert_eq!(endpoints(&gone), []);
    wait_for_events(&api, "llama", &["NoReadyEndpoints"]).await;

    api.put(pod("llama-0", "10.0.0.1", true))
        .expect("recreate the pod");
    until(&mut states, |s| s.endpoints.len() == 1).await;
    api.put(policy("llama-rr", "llama", "round-robin"))
        .expect("create the policy");
    let configured = next(&mut states).await;
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
    let events = ["NoReadyEndpoints", "EndpointsReady"];
    wait_for_events(&api, "llama", &events).await;
    let last_version = configured.version;
    drop(states);
    operator.terminate();

    let operator = Operator::start(&api, "op-2").await;
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
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(versions(&api), before, "no status was rewritten");
    let (_, text) = operator.admin("/metrics").await;
    assert!(
        !text.contains("kvroute_operator_status_patches_total{"),
        "{text}"
    );
    assert_eq!(event_reasons(&api, "llama"), events, "no Event repeated");

    // And it carries on: a pod flip still reaches the router promptly.
    api.put(pod("llama-0", "10.0.0.1", false))
        .expect("make the pod unready");
    let flipped = next(&mut states).await;
    assert_eq!(endpoints(&flipped), [("llama-0:8000".to_owned(), false)]);
}
