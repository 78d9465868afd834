//! Endpoint discovery: the static file (load errors, live edits) and the
//! operator's WatchPool stream, served here by an in-process tonic server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::support::{Logs, eventually};
use futures_util::{Stream, StreamExt};
use kvroute_core::hash::HashAlgo;
use kvroute_core::keys::{KeyMode, RoutingKey};
use kvroute_core::policy::{PolicyConfig, Request};
use kvroute_proto::v1::endpoint_discovery_server::{EndpointDiscovery, EndpointDiscoveryServer};
use kvroute_proto::v1::{
    self, PoolState, RoutingPolicy, WarmupReport, WarmupReportReply, WatchPoolRequest,
};
use kvroute_router::config::Resilience;
use kvroute_router::discovery::{DiscoveryError, operator, static_file};
use kvroute_router::pool::Pool;
use kvroute_router::pool::Watchers;
use kvroute_router::settings::Settings;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::WatchStream;
use tonic::{Response, Status};

fn pool() -> Arc<Pool> {
    Pool::new(
        Settings::builtin(PolicyConfig::default()),
        &Resilience::default(),
        256,
    )
}

/// (name, ready, draining) of every endpoint, by name.
fn endpoints(pool: &Pool) -> Vec<(String, bool, bool)> {
    pool.status()
        .into_iter()
        .map(|s| (s.name, s.ready, s.draining))
        .collect()
}

fn names(pool: &Pool) -> Vec<String> {
    pool.status().into_iter().map(|s| s.name).collect()
}

// ---- the static file ----

/// A scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-discovery-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn load_error(dir: &Path, yaml: &str) -> String {
    let path = dir.join("endpoints.yaml");
    std::fs::write(&path, yaml).unwrap();
    let e: DiscoveryError = static_file::load(&path).unwrap_err();
    e.to_string()
}

#[test]
fn static_file_errors_name_the_problem() {
    let dir = scratch("errors");
    let e = load_error(
        &dir,
        "endpoints:\n  - {address: 127.0.0.1:8001, name: sim}\n  - {address: 127.0.0.1:8002, name: sim}\n",
    );
    assert!(
        e.contains(r#"name "sim""#) && e.contains("endpoints[0]") && e.contains("endpoints[1]"),
        "{e}"
    );

    let e = load_error(
        &dir,
        "endpoints:\n  - address: 127.0.0.1:8001\n  - address: not-an-address\n",
    );
    assert!(
        e.contains("endpoints[1].address") && e.contains("not-an-address"),
        "{e}"
    );

    let e = load_error(
        &dir,
        "endpoints:\n  - address: 127.0.0.1:8001\n    port: 9\n",
    );
    assert!(e.contains("unknown field `port`"), "{e}");

    let e = load_error(&dir, "endpoint: []\n");
    assert!(e.contains("unknown field `endpoint`"), "{e}");

    let missing = dir.join("missing.yaml");
    let e = static_file::load(&missing).unwrap_err().to_string();
    assert!(e.contains("missing.yaml"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn static_file_edits_apply_and_a_broken_edit_keeps_the_last_set() {
    let (logs, _guard) = Logs::capture();
    let dir = scratch("reload");
    let path = dir.join("endpoints.yaml");
    std::fs::write(
        &path,
        "endpoints:\n  - {address: 127.0.0.1:8001, name: a}\n",
    )
    .unwrap();
    let pool = pool();
    let task = tokio::spawn(static_file::run(
        pool.clone(),
        path.clone(),
        Duration::from_millis(20),
        Watchers::new(None),
    ));
    eventually("the file is applied", || names(&pool) == ["a"]).await;

    std::fs::write(
        &path,
        "endpoints:\n  - {address: 127.0.0.1:8001, name: a}\n  - {address: 127.0.0.1:8002, name: b, ready: false}\n  - {address: 127.0.0.1:8003, draining: true}\n",
    )
    .unwrap();
    let edited = vec![
        ("127.0.0.1:8003".to_owned(), true, true),
        ("a".to_owned(), true, false),
        ("b".to_owned(), false, false),
    ];
    eventually("the edit is applied", || endpoints(&pool) == edited).await;

    std::fs::write(
        &path,
        "endpoints:\n  - {address: 127.0.0.1:8001, name: a, weight: 2}\n",
    )
    .unwrap();
    eventually("the broken edit is logged", || {
        logs.count("invalid endpoints file") == 1
    })
    .await;
    assert!(
        logs.text().contains("unknown field `weight`"),
        "{}",
        logs.text()
    );
    assert_eq!(endpoints(&pool), edited);

    std::fs::remove_file(&path).unwrap();
    eventually("the missing file is logged", || {
        logs.count("cannot read the endpoints file") == 1
    })
    .await;
    assert_eq!(endpoints(&pool), edited);

    std::fs::write(&path, "endpoints: []\n").unwrap();
    eventually("the fixed file is applied", || names(&pool).is_empty()).await;
    task.abort();
    std::fs::remove_dir_all(dir).unwrap();
}

// ---- the operator ----

/// An in-process `EndpointDiscovery` server: streams the current state on
/// subscribe and every change, until stopped.
struct FakeOperator {
    state: watch::Sender<PoolState>,
    reports: Arc<std::sync::Mutex<Vec<WarmupReport>>>,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
}

#[derive(Clone)]
struct Service {
    state: watch::Receiver<PoolState>,
    stop: watch::Receiver<bool>,
    reports: Arc<std::sync::Mutex<Vec<WarmupReport>>>,
}

type States = Pin<Box<dyn Stream<Item = Result<PoolState, Status>> + Send>>;

#[tonic::async_trait]
impl EndpointDiscovery for Service {
    type WatchPoolStream = States;

    async fn watch_pool(
        &self,
        request: tonic::Request<WatchPoolRequest>,
    ) -> Result<Response<States>, Status> {
        let r = request.into_inner();
        assert_eq!((r.namespace.as_str(), r.pool.as_str()), ("ml", "llama"));
        let mut stop = self.stop.clone();
        let states = WatchStream::new(self.state.clone())
            .map(Ok)
            .take_until(async move {
                let _ = stop.wait_for(|s| *s).await;
            });
        Ok(Response::new(Box::pin(states)))
    }

    async fn report_warmups(
        &self,
        request: tonic::Request<WarmupReport>,
    ) -> Result<Response<WarmupReportReply>, Status> {
        self.reports.lock().unwrap().push(request.into_inner());
        Ok(Response::new(WarmupReportReply {}))
    }
}

impl FakeOperator {
    async fn start(addr: SocketAddr, state: PoolState) -> (Self, SocketAddr) {
        Self::start_with(addr, state, None).await
    }

    async fn start_with(
        addr: SocketAddr,
        state: PoolState,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> (Self, SocketAddr) {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (state, state_rx) = watch::channel(state);
        let (stop, stop_rx) = watch::channel(false);
        let reports = Arc::default();
        let service = Service {
            state: state_rx,
            stop: stop_rx.clone(),
            reports: Arc::clone(&reports),
        };
        let mut until_stop = stop_rx;
        let server = tokio::spawn(async move {
            let mut server = tonic::transport::Server::builder();
            if let Some(tls) = tls {
                server = server.tls_config(tls).unwrap();
            }
            server
                .add_service(EndpointDiscoveryServer::new(service))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async move {
                        let _ = until_stop.wait_for(|s| *s).await;
                    },
                )
                .await
                .unwrap();
        });
        (
            FakeOperator {
                state,
                reports,
                stop,
                server,
            },
            addr,
        )
    }

    fn publish(&self, state: PoolState) {
        self.state.send_replace(state);
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        self.server.await.unwrap();
    }
}

/// A router on free ports whose pool `ml/llama` comes from the operator at
/// `addr`.
fn operator_config(addr: SocketAddr) -> kvroute_router::config::Config {
    kvroute_router::config::Config {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        discovery: kvroute_router::config::Discovery::Operator(
            kvroute_router::config::OperatorDiscovery {
                url: format!("http://{addr}"),
                urls: Vec::new(),
                namespace: "ml".into(),
                pool: "llama".into(),
            },
        ),
        ..kvroute_router::config::Config::default()
    }
}

fn policy(name: &str) -> RoutingPolicy {
    RoutingPolicy {
        policy: name.into(),
        key_mode: v1::KeyMode::Conversation.into(),
        prefix_tokens: 256,
        load_bound: 0.0,
        block_size: 16,
        hash_algorithm: v1::HashAlgorithm::Sha256.into(),
        hash_seed: None,
        cache_port: 0,
        tenancy: v1::TenancyMode::Shared.into(),
        tenant_header: String::new(),
        latency_slack: None,
        prefill_tokens_per_second: None,
        prefill_overhead_ms: None,
        offload_weight: None,
        slow_start_seconds: None,
        disaggregation: None,
        warmup: None,
    }
}

fn endpoint(name: &str, ip: &str, draining: bool) -> v1::Endpoint {
    v1::Endpoint {
        name: name.into(),
        address: ip.into(),
        http_port: 8000,
        cache_port: 0,
        ready: true,
        draining,
        ready_since_unix_ms: None,
        role: 0,
    }
}

fn state(version: u64, endpoints: Vec<v1::Endpoint>, policy: RoutingPolicy) -> PoolState {
    PoolState {
        namespace: "ml".into(),
        pool: "llama".into(),
        version,
        endpoints,
        policy: Some(policy),
        pool_exists: true,
        objectives: Vec::new(),
        routers: Vec::new(),
        status_writer: String::new(),
    }
}

/// The first choice of two plans for the same request: equal under a
/// keyed policy, different under round robin.
fn two_firsts(pool: &Pool) -> (String, String) {
    let request = Request {
        key: RoutingKey(7),
        chain: &[],
        prompt_tokens: 100,
        key_prefix_blocks: None,
        output_tokens: 0,
    };
    let first = || pool.plan(&request, true).targets[0].name.to_string();
    (first(), first())
}

fn watch_operator(pool: &Arc<Pool>, addr: SocketAddr) -> JoinHandle<()> {
    watch_operators(pool, &[addr])
}

fn watch_operators(pool: &Arc<Pool>, addrs: &[SocketAddr]) -> JoinHandle<()> {
    tokio::spawn(operator::run(
        pool.clone(),
        addrs.iter().map(|a| format!("http://{a}")).collect(),
        None,
        "ml".into(),
        "llama".into(),
        Watchers::new(None),
    ))
}

#[tokio::test]
async fn operator_states_apply_newest_first_with_policy_and_settings() {
    let (logs, _guard) = Logs::capture();
    let ab = || {
        vec![
            endpoint("a:8000", "10.0.0.1", false),
            endpoint("b:8000", "10.0.0.2", false),
        ]
    };
    let (op, addr) = FakeOperator::start(
        "127.0.0.1:0".parse().unwrap(),
        state(5, ab(), policy("kvroute")),
    )
    .await;
    let pool = pool();
    let task = watch_operator(&pool, addr);
    eventually("version 5 is applied", || {
        names(&pool) == ["a:8000", "b:8000"]
    })
    .await;
    let (x, y) = two_firsts(&pool);
    assert_eq!(x, y, "kvroute places a key on one endpoint");

    // A lagging replica's older state is ignored.
    op.publish(state(
        3,
        vec![endpoint("c:8000", "10.0.0.3", false)],
        policy("kvroute"),
    ));
    eventually("version 3 is ignored", || {
        logs.count("not newer than the applied one") == 1
    })
    .await;
    assert_eq!(names(&pool), ["a:8000", "b:8000"]);

    // A newer state changes endpoints, policy, key and hashing.
    let mut p = policy("round-robin");
    p.key_mode = v1::KeyMode::Prefix.into();
    p.prefix_tokens = 64;
    p.block_size = 32;
    p.hash_algorithm = v1::HashAlgorithm::XxhashCbor.into();
    p.hash_seed = Some("0".into());
    let mut abc = ab();
    abc.push(endpoint("c:8000", "10.0.0.3", true));
    let objective = |name: &str, priority| v1::Objective {
        name: name.into(),
        priority,
    };
    let mut six = state(6, abc.clone(), p.clone());
    six.objectives = vec![objective("batch", -1), objective("critical", 20)];
    op.publish(six);
    eventually("version 6 is applied", || {
        pool.settings().key.mode == KeyMode::Prefix
    })
    .await;
    let cluster = pool.objectives();
    assert_eq!(
        (cluster.get("critical"), cluster.get("batch")),
        (Some(&20), Some(&-1))
    );
    assert_eq!(
        endpoints(&pool),
        [
            ("a:8000".to_owned(), true, false),
            ("b:8000".to_owned(), true, false),
            ("c:8000".to_owned(), true, true),
        ]
    );
    let s = pool.settings();
    assert_eq!(s.key.prefix_tokens, 64);
    let hashing = s.hasher.config();
    assert_eq!(
        (hashing.algo, hashing.block_size, hashing.seed.as_deref()),
        (HashAlgo::XxhashCbor, 32, Some("0"))
    );
    let (x, y) = two_firsts(&pool);
    assert_ne!(x, y, "round robin alternates");

    // An unknown policy and an invalid block size keep what is there; the
    // rest of the state still applies.
    p.policy = "fastest".into();
    p.block_size = 0;
    p.key_mode = v1::KeyMode::Tenant.into();
    op.publish(state(7, abc, p));
    eventually("version 7 is applied", || {
        pool.settings().key.mode == KeyMode::Tenant
    })
    .await;
    assert_eq!(logs.count("unknown routing policy"), 1);
    assert_eq!(logs.count("invalid block hashing"), 1);
    assert_eq!(pool.settings().hasher.config().block_size, 32);
    let (x, y) = two_firsts(&pool);
    assert_ne!(x, y, "still round robin");
    assert!(
        pool.objectives().is_empty(),
        "a state without objectives has none"
    );

    task.abort();
    op.stop().await;
}

#[tokio::test]
async fn the_operators_warm_ups_replace_the_routers_own_and_name_its_routers() {
    let own = kvroute_router::config::Warmup {
        prefixes: vec![kvroute_router::config::Prefix {
            name: "own".into(),
            model: None,
            tenant: None,
            messages: None,
            prompt: Some("x".into()),
            config_map_ref: None,
        }],
        ..Default::default()
    };
    let pool = pool();
    pool.warmup.set_own(Some(own));
    let prefix = v1::WarmupPrefix {
        name: "support".into(),
        text: Some(v1::warmup_prefix::Text::MessagesJson(
            r#"[{"role":"system","content":"hi"}]"#.into(),
        )),
        ..Default::default()
    };
    let warmup = v1::Warmup {
        every_seconds: 60,
        owners: 2,
        max_share_of_prefill: 0.1,
        prefixes: vec![prefix],
    };
    let mut with_warmup = state(
        1,
        vec![endpoint("a:8000", "10.0.0.1", false)],
        RoutingPolicy {
            warmup: Some(warmup.clone()),
            ..policy("kvroute")
        },
    );
    with_warmup.routers = vec!["router-a".into(), "router-b".into()];
    let (op, addr) = FakeOperator::start("127.0.0.1:0".parse().unwrap(), with_warmup.clone()).await;
    let task = watch_operator(&pool, addr);
    let name = |pool: &Pool| pool.warmup.current().map(|w| w.prefixes[0].name.clone());
    eventually("the operator's warm-ups", || {
        name(&pool).as_deref() == Some("support")
    })
    .await;
    assert_eq!(*pool.warmup.routers(), ["router-a", "router-b"]);
    assert_eq!(pool.warmup.current().unwrap().owners, 2);

    // Unusable ones keep the current ones; none brings back the router's own.
    let broken = v1::Warmup {
        owners: 0,
        ..warmup
    };
    let mut next = with_warmup.clone();
    next.version = 2;
    next.policy.as_mut().unwrap().warmup = Some(broken);
    next.routers.pop();
    op.publish(next.clone());
    eventually("the routers apply", || pool.warmup.routers().len() == 1).await;
    assert_eq!(name(&pool).as_deref(), Some("support"));
    next.version = 3;
    next.policy.as_mut().unwrap().warmup = None;
    op.publish(next);
    eventually("the router's own again", || {
        name(&pool).as_deref() == Some("own")
    })
    .await;
    task.abort();
    op.stop().await;
}

/// A router reports the warm-ups it sent to the status writer the pool
/// state names, for the policy's `status.warmup`.
#[tokio::test]
async fn sent_warm_ups_are_reported_to_the_status_writer() {
    let sim = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let prefix = v1::WarmupPrefix {
        name: "support".into(),
        text: Some(v1::warmup_prefix::Text::Prompt(crate::support::long_text(
            3,
        ))),
        ..Default::default()
    };
    let warmup = v1::Warmup {
        every_seconds: 1,
        owners: 1,
        max_share_of_prefill: 1.0,
        prefixes: vec![prefix],
    };
    let sim_endpoint = v1::Endpoint {
        http_port: sim.http_addr.port().into(),
        ..endpoint("sim:8000", "127.0.0.1", false)
    };
    let policy = RoutingPolicy {
        warmup: Some(warmup),
        ..policy("kvroute")
    };
    let mut first = state(1, vec![sim_endpoint], policy);
    let (op, addr) = FakeOperator::start("127.0.0.1:0".parse().unwrap(), first.clone()).await;
    first.version = 2;
    first.status_writer = addr.to_string();
    op.publish(first);
    let config = operator_config(addr);
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let router = kvroute_router::start(config).await.unwrap();
    eventually("a warm-up report", || {
        !op.reports.lock().unwrap().is_empty()
    })
    .await;
    let report = op.reports.lock().unwrap()[0].clone();
    assert_eq!((&*report.namespace, &*report.pool), ("ml", "llama"));
    assert!(!report.router.is_empty());
    let sent: Vec<_> = (report.sent.iter())
        .map(|s| (s.prefix.as_str(), s.endpoint.as_str()))
        .collect();
    assert_eq!(sent, [("support", "sim:8000")]);
    assert!(report.sent[0].unix_ms >= started, "{report:?}");
    let metrics = crate::support::get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert!(
        metrics.contains("kvroute_warmup_reports_total{result=\"ok\"}"),
        "{metrics}"
    );
    router.shutdown().await;
    op.stop().await;
}

#[tokio::test]
async fn operator_loss_keeps_the_last_state_until_a_newer_one() {
    let (logs, _guard) = Logs::capture();
    let ab = vec![
        endpoint("a:8000", "10.0.0.1", false),
        endpoint("b:8000", "10.0.0.2", false),
    ];
    let (op, addr) = FakeOperator::start(
        "127.0.0.1:0".parse().unwrap(),
        state(5, ab, policy("kvroute")),
    )
    .await;
    let pool = pool();
    let task = watch_operator(&pool, addr);
    eventually("version 5 is applied", || {
        names(&pool) == ["a:8000", "b:8000"]
    })
    .await;

    op.stop().await;
    eventually("the router notices", || {
        logs.count("operator stream lost") >= 1
    })
    .await;
    assert_eq!(names(&pool), ["a:8000", "b:8000"]);
    assert_eq!(pool.routable(), 2);

    // Another replica comes up where the first was, lagging behind: the
    // router resubscribes and ignores its older state...
    let (op, _) = FakeOperator::start(addr, state(4, Vec::new(), policy("kvroute"))).await;
    eventually("version 4 is ignored", || {
        logs.count("not newer than the applied one") == 1
    })
    .await;
    assert_eq!(names(&pool), ["a:8000", "b:8000"]);

    // ...until it catches up: the pool was deleted.
    op.publish(PoolState {
        namespace: "ml".into(),
        pool: "llama".into(),
        version: 8,
        endpoints: Vec::new(),
        policy: None,
        pool_exists: false,
        objectives: Vec::new(),
        routers: Vec::new(),
        status_writer: String::new(),
    });
    eventually("version 8 is applied", || names(&pool).is_empty()).await;
    task.abort();
    op.stop().await;
}

#[tokio::test]
async fn a_router_fails_over_to_the_next_operator_replica() {
    let (logs, _guard) = Logs::capture();
    let a = || vec![endpoint("a:8000", "10.0.0.1", false)];
    let ab = vec![
        endpoint("a:8000", "10.0.0.1", false),
        endpoint("b:8000", "10.0.0.2", false),
    ];
    let (first, first_addr) = FakeOperator::start(
        "127.0.0.1:0".parse().unwrap(),
        state(5, a(), policy("kvroute")),
    )
    .await;
    let (second, second_addr) = FakeOperator::start(
        "127.0.0.1:0".parse().unwrap(),
        state(5, a(), policy("kvroute")),
    )
    .await;
    let pool = pool();
    let task = watch_operators(&pool, &[first_addr, second_addr]);
    eventually("the first replica's state applies", || {
        names(&pool) == ["a:8000"]
    })
    .await;

    // The first replica dies; the second has a newer state by now.
    second.publish(state(6, ab, policy("kvroute")));
    first.stop().await;
    eventually("the second replica's state applies", || {
        names(&pool) == ["a:8000", "b:8000"]
    })
    .await;
    assert_eq!(logs.count("operator stream lost"), 1, "{}", logs.text());
    assert!(
        logs.text()
            .contains(&format!("next_url=http://{second_addr}")),
        "{}",
        logs.text()
    );
    task.abort();
    second.stop().await;
}

fn tls_fixture(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

#[tokio::test]
async fn the_operator_stream_runs_over_mutual_tls() {
    let server_tls = kvroute_proto::tls::server(
        &tls_fixture("server.crt"),
        &tls_fixture("server.key"),
        Some(&tls_fixture("ca.crt")),
    )
    .unwrap();
    let (op, addr) = FakeOperator::start_with(
        "127.0.0.1:0".parse().unwrap(),
        state(
            1,
            vec![endpoint("a:8000", "10.0.0.1", false)],
            policy("kvroute"),
        ),
        Some(server_tls),
    )
    .await;
    let client_tls = kvroute_proto::tls::client(
        &tls_fixture("ca.crt"),
        Some((&tls_fixture("client.crt"), &tls_fixture("client.key"))),
        Some("localhost"),
    )
    .unwrap();
    let pool = pool();
    let task = tokio::spawn(operator::run(
        pool.clone(),
        vec![format!("https://{addr}")],
        Some(client_tls),
        "ml".into(),
        "llama".into(),
        Watchers::new(None),
    ));
    eventually("the state arrives over TLS", || names(&pool) == ["a:8000"]).await;
    task.abort();
    op.stop().await;
}

/// A policy that sets tenancy Salted makes a router that does not salt
/// refuse requests and report not ready, rather than share caches between
/// tenants; once the policy says Shared it serves again.
#[tokio::test]
async fn a_salted_policy_stops_a_router_that_cannot_salt() {
    let salted = RoutingPolicy {
        tenancy: v1::TenancyMode::Salted.into(),
        ..policy("kvroute")
    };
    let endpoints = || vec![endpoint("a:8000", "127.0.0.1", false)];
    let (operator, addr) = FakeOperator::start(
        "127.0.0.1:0".parse().unwrap(),
        state(1, endpoints(), salted),
    )
    .await;
    let config = operator_config(addr);
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    let send = || async {
        let response = client
            .post(format!("http://{}/v1/chat/completions", router.addr()))
            .json(
                &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            )
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body: serde_json::Value = response.json().await.unwrap();
        (
            status,
            body["error"]["code"].as_str().unwrap_or("").to_owned(),
        )
    };
    let readyz = || async {
        let r = reqwest::get(format!("http://{}/readyz", router.addr()))
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    let refused = (503, "salted_tenancy_not_configured".to_owned());
    kvroute_testkit::eventually("refused", Duration::from_secs(5), || async {
        (send().await == refused).then_some(())
    })
    .await;
    let (status, text) = readyz().await;
    assert_eq!(status, 503);
    assert!(text.contains("tenancy Salted"), "{text}");

    operator.publish(state(2, endpoints(), policy("kvroute")));
    kvroute_testkit::eventually("served again", Duration::from_secs(5), || async {
        (send().await != refused).then_some(())
    })
    .await;
    assert!(!readyz().await.1.contains("tenancy"));
    router.shutdown().await;
    operator.stop().await;
}
