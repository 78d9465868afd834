//! `EndpointDiscovery.WatchPool` end to end: a real server on 127.0.0.1:0
//! over an index, and the generated tonic client a router uses.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_operator::grpc::{Discovery, ServeError};
use kvroute_operator::index::{Index, PodInfo, PolicySpec, PoolSpec};
use kvroute_operator::metrics::{Gauges, Metrics};
use kvroute_proto::v1::endpoint_discovery_client::EndpointDiscoveryClient;
use kvroute_proto::v1::{PoolState, WarmupReport, WarmupSent, WatchPoolRequest};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Streaming;
use tonic::transport::Channel;

const NS: &str = "ml";
/// How long a state may take to reach a subscriber.
const PROMPTLY: Duration = Duration::from_secs(1);

/// An operator's WatchPool server over an index the test edits.
struct Operator {
    index: Arc<Mutex<Index>>,
    discovery: Discovery,
    metrics: Arc<Metrics>,
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    server: JoinHandle<Result<(), ServeError>>,
}

impl Operator {
    async fn start(index: Index) -> Self {
        Self::start_with(index, None).await
    }

    async fn start_with(index: Index, tls: Option<tonic::transport::ServerTlsConfig>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let index = Arc::new(Mutex::new(index));
        let metrics = Arc::new(Metrics::default());
        let discovery = Discovery::new(index.clone()).with_metrics(metrics.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(discovery.clone().serve(listener, tls, async {
            let _ = stopped.await;
        }));
        Operator {
            index,
            discovery,
            metrics,
            addr,
            stop,
            server,
        }
    }

    /// Edits the index, as a watcher would.
    fn edit(&self, edit: impl FnOnce(&mut Index)) {
        edit(&mut self.index.lock().unwrap());
    }

    async fn client(&self) -> EndpointDiscoveryClient<Channel> {
        EndpointDiscoveryClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    async fn watch(&self, pool: &str) -> Streaming<PoolState> {
        self.client()
            .await
            .watch_pool(request(NS, pool))
            .await
            .unwrap()
            .into_inner()
    }

    /// The value of `kvroute_operator_warmup_reports_refused_total` for
    /// `reason`; 0 when absent.
    fn refused(&self, reason: &str) -> f64 {
        let text = self.metrics.render(&Gauges::default());
        let line = format!("kvroute_operator_warmup_reports_refused_total{{reason=\"{reason}\"}} ");
        (text.lines().find_map(|l| l.strip_prefix(&line))).map_or(0.0, |v| v.parse().unwrap())
    }

    async fn shut_down(self) {
        self.stop.send(()).unwrap();
        let done = tokio::time::timeout(PROMPTLY, self.server).await;
        done.expect("the server stops promptly").unwrap().unwrap();
    }
}

fn request(namespace: &str, pool: &str) -> WatchPoolRequest {
    WatchPoolRequest {
        namespace: namespace.into(),
        pool: pool.into(),
        subscriber: "test-router".into(),
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

fn pool(name: &str) -> PoolSpec {
    PoolSpec {
        namespace: NS.into(),
        name: name.into(),
        selector: [("app".to_owned(), "llama".to_owned())].into(),
        target_ports: vec![8000],
        ..PoolSpec::default()
    }
}

fn pod(name: &str, ip: &str, ready: bool) -> PodInfo {
    PodInfo {
        namespace: NS.into(),
        name: name.into(),
        labels: [("app".to_owned(), "llama".to_owned())].into(),
        ip: Some(ip.parse().unwrap()),
        phase_running: true,
        ready,
        deleting: false,
        ready_since_ms: None,
        role: Default::default(),
    }
}

fn policy(name: &str, target: &str, routing: &str) -> PolicySpec {
    PolicySpec {
        namespace: NS.into(),
        name: name.into(),
        created: 1000,
        generation: 1,
        target_pool: target.into(),
        policy: Some(routing.into()),
        ..PolicySpec::default()
    }
}

/// `(name, ready)` of every endpoint.
fn endpoints(state: &PoolState) -> Vec<(&str, bool)> {
    state
        .endpoints
        .iter()
        .map(|e| (e.name.as_str(), e.ready))
        .collect()
}

/// An index with pool `llama` and one ready pod, `a`.
fn llama() -> Index {
    let mut index = Index::new();
    index.apply_pool(pool("llama"));
    index.apply_pod(pod("a", "10.0.0.1", true));
    index
}

#[tokio::test]
async fn an_existing_pool_arrives_at_once() {
    let operator = Operator::start(llama()).await;
    let mut states = operator.watch("llama").await;
    let state = next(&mut states).await;
    assert_eq!(
        (state.namespace.as_str(), state.pool.as_str()),
        (NS, "llama")
    );
    assert!(state.pool_exists);
    assert!(state.version > 0);
    assert_eq!(endpoints(&state), [("a:8000", true)]);
    let e = &state.endpoints[0];
    assert_eq!((e.address.as_str(), e.http_port), ("10.0.0.1", 8000));
    assert_eq!(state.policy.unwrap().policy, "kvroute");
    operator.shut_down().await;
}

#[tokio::test]
async fn a_pod_becoming_ready_arrives_as_a_higher_version() {
    let operator = Operator::start(llama()).await;
    let mut states = operator.watch("llama").await;
    let first = next(&mut states).await;

    operator.edit(|i| i.apply_pod(pod("b", "10.0.0.2", false)));
    let unready = next(&mut states).await;
    assert_eq!(endpoints(&unready), [("a:8000", true), ("b:8000", false)]);
    operator.edit(|i| i.apply_pod(pod("b", "10.0.0.2", true)));
    let ready = next(&mut states).await;
    assert_eq!(endpoints(&ready), [("a:8000", true), ("b:8000", true)]);
    assert!(first.version < unready.version && unready.version < ready.version);
    operator.shut_down().await;
}

#[tokio::test]
async fn two_subscribers_both_see_a_change() {
    let operator = Operator::start(llama()).await;
    let mut one = operator.watch("llama").await;
    let mut two = operator.watch("llama").await;
    let before = next(&mut one).await;
    assert_eq!(next(&mut two).await, before);
    assert_eq!(operator.discovery.subscribers(), 2);

    operator.edit(|i| i.apply_pod(pod("b", "10.0.0.2", true)));
    let seen_by_one = next(&mut one).await;
    assert_eq!(next(&mut two).await, seen_by_one);
    assert!(seen_by_one.version > before.version);
    assert_eq!(seen_by_one.endpoints.len(), 2);
    operator.shut_down().await;
}

#[tokio::test]
async fn a_subscriber_before_the_pool_exists_sees_it_appear() {
    let operator = Operator::start(Index::new()).await;
    let mut states = operator.watch("llama").await;
    let absent = next(&mut states).await;
    assert!(!absent.pool_exists);
    assert!(absent.endpoints.is_empty());

    operator.edit(|i| {
        i.apply_pod(pod("a", "10.0.0.1", true));
        i.apply_pool(pool("llama"));
    });
    let present = next(&mut states).await;
    assert!(present.pool_exists);
    assert!(present.version > absent.version);
    assert_eq!(endpoints(&present), [("a:8000", true)]);
    assert!(present.policy.is_some());
    operator.shut_down().await;
}

#[tokio::test]
async fn a_policy_edit_changes_the_policy_in_the_next_state() {
    let operator = Operator::start(llama()).await;
    let mut states = operator.watch("llama").await;
    next(&mut states).await;

    operator.edit(|i| i.apply_policy(policy("p", "llama", "round-robin")));
    assert_eq!(
        next(&mut states).await.policy.unwrap().policy,
        "round-robin"
    );
    operator.edit(|i| i.apply_policy(policy("p", "llama", "least-loaded")));
    assert_eq!(
        next(&mut states).await.policy.unwrap().policy,
        "least-loaded"
    );
    operator.shut_down().await;
}

#[tokio::test]
async fn an_empty_namespace_or_pool_is_an_invalid_argument() {
    let operator = Operator::start(llama()).await;
    let mut client = operator.client().await;
    for (namespace, pool) in [("", "llama"), (NS, ""), ("", "")] {
        let status = client
            .watch_pool(request(namespace, pool))
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{namespace:?}/{pool:?}"
        );
    }
    assert_eq!(operator.discovery.subscribers(), 0);
    operator.shut_down().await;
}

#[tokio::test]
async fn a_reconnecting_router_gets_the_current_state_at_once() {
    let operator = Operator::start(llama()).await;
    let mut states = operator.watch("llama").await;
    next(&mut states).await;
    drop(states);

    operator.edit(|i| i.apply_pod(pod("b", "10.0.0.2", true)));
    let mut states = operator.watch("llama").await;
    let current = next(&mut states).await;
    assert_eq!(endpoints(&current), [("a:8000", true), ("b:8000", true)]);
    operator.shut_down().await;
}

#[tokio::test]
async fn a_slow_subscriber_skips_to_the_latest_state() {
    let operator = Operator::start(llama()).await;
    let mut states = operator.watch("llama").await;
    next(&mut states).await;

    // Twenty states published while the server cannot send (the test's
    // single-threaded runtime runs nothing else during the edit): the
    // subscriber is owed the last one, not a backlog.
    operator.edit(|i| {
        for n in 0..20 {
            i.apply_pod(pod(&format!("p{n:02}"), &format!("10.0.1.{n}"), true));
        }
    });
    let latest = next(&mut states).await;
    assert_eq!(latest.endpoints.len(), 21);
    assert_eq!(latest.endpoints.last().unwrap().name, "p19:8000");
    operator.shut_down().await;
}

#[tokio::test]
async fn the_gauge_counts_open_streams() {
    let operator = Operator::start(llama()).await;
    let mut one = operator.watch("llama").await;
    let mut two = operator.watch("mistral").await;
    next(&mut one).await;
    next(&mut two).await;
    assert_eq!(operator.discovery.subscribers(), 2);

    drop(two);
    // The server learns of the cancelled stream asynchronously.
    tokio::time::timeout(PROMPTLY, async {
        while operator.discovery.subscribers() != 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the gauge drops to 1 within 1 s");
    operator.shut_down().await;
}

#[tokio::test]
async fn shutting_down_ends_open_streams() {
    let operator = Operator::start(llama()).await;
    let mut states = operator.watch("llama").await;
    next(&mut states).await;
    let discovery = operator.discovery.clone();

    operator.shut_down().await;
    let end = tokio::time::timeout(PROMPTLY, states.message()).await;
    assert!(
        matches!(end, Ok(Ok(None) | Err(_))),
        "the stream ends: {end:?}"
    );
    assert_eq!(discovery.subscribers(), 0);
}

fn tls_fixture(name: &str) -> std::path::PathBuf {
    // The router crate's test certificates: one set for the workspace.
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../router/tests/fixtures/tls")
        .join(name)
}

#[tokio::test]
async fn watch_pool_serves_mutual_tls() {
    let tls = kvroute_proto::tls::server(
        &tls_fixture("server.crt"),
        &tls_fixture("server.key"),
        Some(&tls_fixture("ca.crt")),
    )
    .unwrap();
    let mut index = llama();
    index.apply_pod(router_pod("router-0", "127.0.0.1"));
    let operator = Operator::start_with(index, Some(tls)).await;
    let (cert, key) = (tls_fixture("client.crt"), tls_fixture("client.key"));
    let channel = |with_cert: bool| {
        let identity = with_cert.then_some((cert.as_path(), key.as_path()));
        let client =
            kvroute_proto::tls::client(&tls_fixture("ca.crt"), identity, Some("localhost"))
                .unwrap();
        tonic::transport::Endpoint::from_shared(format!("https://{}", operator.addr))
            .unwrap()
            .tls_config(client)
            .unwrap()
    };
    let mut with_cert = EndpointDiscoveryClient::new(channel(true).connect().await.unwrap());
    let mut states = with_cert
        .watch_pool(request(NS, "llama"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(endpoints(&next(&mut states).await), [("a:8000", true)]);
    // The caller's address is known over TLS too: a router's report is
    // believed from its pod's IP.
    with_cert
        .report_warmups(report("router-0", Vec::new()))
        .await
        .unwrap();
    // Without a client certificate the handshake or the call fails.
    let refused = match channel(false).connect().await {
        Err(_) => true,
        Ok(ch) => EndpointDiscoveryClient::new(ch)
            .watch_pool(request(NS, "llama"))
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate is refused");
    drop(states);
    operator.shut_down().await;
}

/// A ready router pod of pool `llama`, at `ip`.
fn router_pod(name: &str, ip: &str) -> PodInfo {
    PodInfo {
        labels: [("kvroute.dev/router-for".to_owned(), "llama".to_owned())].into(),
        ..pod(name, ip, true)
    }
}

/// [`llama`] with policy `fast` warming prefix `support`, and its router
/// `router-0` at `router_ip` (the test's client connects from 127.0.0.1).
fn llama_warmed(router_ip: &str) -> Index {
    use kvroute_core::warmup::{Prefix, Warmup};
    let mut index = llama();
    index.apply_policy(PolicySpec {
        warmup: Some(Warmup {
            prefixes: vec![Prefix {
                name: "support".into(),
                model: None,
                tenant: None,
                messages: None,
                prompt: Some("You are helpful.".into()),
                config_map_ref: None,
            }],
            ..Warmup::default()
        }),
        ..policy("fast", "llama", "kvroute")
    });
    index.apply_pod(router_pod("router-0", router_ip));
    index
}

fn entry(prefix: &str, endpoint: &str) -> WarmupSent {
    WarmupSent {
        prefix: prefix.into(),
        endpoint: endpoint.into(),
        unix_ms: 1_700_000_000_000,
    }
}

fn report(router: &str, sent: Vec<WarmupSent>) -> WarmupReport {
    WarmupReport {
        namespace: NS.into(),
        pool: "llama".into(),
        router: router.into(),
        sent,
    }
}

/// `ReportWarmups`: a router's sends reach the policy's status; what is
/// too large is refused whole, what names nothing of the pool is dropped.
#[tokio::test]
async fn warm_up_reports_reach_the_status_and_oversized_ones_are_refused() {
    let op = Operator::start(llama_warmed("127.0.0.1")).await;
    let mut client = op.client().await;
    let report = |sent| report("router-0", sent);

    let too_many = vec![entry("support", "a:8000"); kvroute_operator::grpc::MAX_REPORTED + 1];
    let refused = client.report_warmups(report(too_many)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let long = vec![entry(&"x".repeat(300), "a:8000")];
    let refused = client.report_warmups(report(long)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let status = || op.index.lock().unwrap().policy_status(NS, "fast").unwrap();
    assert!(status().warmups_sent.is_empty());
    assert_eq!(op.refused("too_large"), 2.0);

    // A clock ahead of the operator's is taken as now.
    let ahead = WarmupSent {
        unix_ms: u64::MAX,
        ..entry("support", "a:8000")
    };
    let sent = vec![ahead, entry("other", "a:8000"), entry("support", "zz:8000")];
    client.report_warmups(report(sent)).await.unwrap();
    let sent = status().warmups_sent;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        (&*sent[0].endpoint, &*sent[0].router),
        ("a:8000", "router-0")
    );
    let now_ms = kvroute_operator::index::wall_clock_micros() / 1000;
    assert!(sent[0].unix_ms <= now_ms, "{sent:?}");
    op.shut_down().await;
}

/// `ReportWarmups` is believed only from a router the pool's state names,
/// connecting from its own pod's address; others are refused and change
/// nothing.
#[tokio::test]
async fn warm_up_reports_only_from_the_pools_routers_at_their_own_address() {
    // router-0's pod is at 10.0.0.7; the test's client is at 127.0.0.1.
    let op = Operator::start(llama_warmed("10.0.0.7")).await;
    let mut client = op.client().await;
    let sent = || vec![entry("support", "a:8000")];
    let status = || op.index.lock().unwrap().policy_status(NS, "fast").unwrap();
    let mut refuse = async |router: &str| {
        let refused = client.report_warmups(report(router, sent())).await;
        let refused = refused.expect_err("the report is refused");
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    };

    // A router the pool does not name.
    refuse("evil-router").await;
    // A named router, from another address than its pod's.
    refuse("router-0").await;
    // A router pod that is not ready is not named.
    op.edit(|i| {
        i.apply_pod(PodInfo {
            ready: false,
            ..router_pod("router-0", "127.0.0.1")
        })
    });
    refuse("router-0").await;
    assert!(status().warmups_sent.is_empty());
    assert_eq!(
        (op.refused("unknown_router"), op.refused("wrong_address")),
        (2.0, 1.0)
    );

    // Ready, at the address it connects from: believed.
    op.edit(|i| i.apply_pod(router_pod("router-0", "127.0.0.1")));
    client
        .report_warmups(report("router-0", sent()))
        .await
        .unwrap();
    let sent = status().warmups_sent;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].router, "router-0");
    op.shut_down().await;
}
