//! The `kvroute-operator run` process, shared by the process tests: started
//! against the fake API server or a real cluster, reached over WatchPool and
//! its admin server, stopped with SIGTERM or killed on drop.
//!
//! Not here: the API objects a test writes, or what it asserts.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute_proto::v1::endpoint_discovery_client::EndpointDiscoveryClient;
use kvroute_proto::v1::{PoolState, WatchPoolRequest};
use kvroute_testkit::FakeApiServer;
use tonic::Streaming;

/// How long the operator may take to start listening, or a metric to reach
/// its value.
const STARTUP: Duration = Duration::from_secs(30);

/// The operator process and the kubeconfig file written for it, if any; both
/// go away on drop, so a failing test leaves no process behind.
pub struct Operator {
    child: Child,
    kubeconfig: Option<PathBuf>,
    addr: String,
    admin: String,
}

impl Operator {
    /// Starts `kvroute-operator run` on loopback ports, watching `namespace`,
    /// holding the Lease in `lease_namespace` as `identity`.
    ///
    /// With `api`, it talks to that fake API server through a kubeconfig
    /// written to a temporary file. Without, it inherits this process's
    /// environment: the current context of `KUBECONFIG` or `~/.kube/config`.
    pub async fn start(
        api: Option<&FakeApiServer>,
        namespace: &str,
        lease_namespace: &str,
        identity: &str,
    ) -> Operator {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvroute-operator"));
        command
            .args(["run", "--grpc-listen", "127.0.0.1:0"])
            .args(["--admin-listen", "127.0.0.1:0"])
            .args(["--namespace", namespace])
            .args(["--lease-namespace", lease_namespace])
            .args(["--identity", identity])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let kubeconfig = api.map(|api| {
            let path = std::env::temp_dir().join(format!(
                "kvroute-operator-test-{}-{}-{identity}.yaml",
                std::process::id(),
                api.url().rsplit(':').next().unwrap_or("0")
            ));
            std::fs::write(&path, api.kubeconfig_yaml()).expect("write the kubeconfig");
            command.env("KUBECONFIG", &path);
            path
        });
        let child = command.spawn().expect("spawn kvroute-operator");
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
    pub async fn admin(&self, path: &str) -> (u16, String) {
        let response = reqwest::get(format!("http://{}{path}", self.admin))
            .await
            .expect("the admin server answers");
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    }

    /// Waits until `/metrics` has a line `metric value`.
    pub async fn metric(&self, metric: &str, value: &str) {
        let wanted = format!("{metric} {value}");
        let what = format!("`{wanted}` in /metrics");
        kvroute_testkit::eventually(&what, STARTUP, || async {
            let (_, text) = self.admin("/metrics").await;
            text.lines().any(|l| l == wanted).then_some(())
        })
        .await;
    }

    /// Stops it with SIGTERM, as Kubernetes does, and waits for it to exit.
    pub fn terminate(mut self) {
        let killed = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(killed.success());
        let status = self.child.wait().expect("wait for the operator");
        assert!(status.success(), "a clean exit on SIGTERM, got {status}");
    }

    /// Subscribes to the pool `namespace/pool` as a router does.
    pub async fn watch(&self, namespace: &str, pool: &str) -> Streaming<PoolState> {
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
        if let Some(kubeconfig) = &self.kubeconfig {
            let _ = std::fs::remove_file(kubeconfig);
        }
    }
}

/// The first state on `stream` for which `done` holds, within `within`.
pub async fn until(
    stream: &mut Streaming<PoolState>,
    within: Duration,
    what: &str,
    done: impl Fn(&PoolState) -> bool,
) -> PoolState {
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
    tokio::time::timeout(within, wait)
        .await
        .unwrap_or_else(|_| panic!("not within {within:?}: {what}"))
}
