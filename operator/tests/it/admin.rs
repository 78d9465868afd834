//! The admin server end to end: a real listener on 127.0.0.1:0, probed the
//! way Prometheus and the kubelet would.

use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_operator::admin::{Admin, serve};
use kvroute_operator::metrics::{Gauges, Metrics, PoolGauge};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// An admin server whose readiness the test flips.
struct Server {
    addr: SocketAddr,
    ready: watch::Sender<bool>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(metrics: Arc<Metrics>) -> Server {
        let (ready, ready_rx) = watch::channel(false);
        let gauges_ready = ready_rx.clone();
        let gauges = move || Gauges {
            pools: vec![PoolGauge {
                namespace: "ml".into(),
                name: "llama".into(),
                ready_endpoints: 3,
            }],
            subscribers: 2,
            leader: true,
            ready: *gauges_ready.borrow(),
        };
        let admin = Admin {
            metrics,
            gauges: Arc::new(gauges),
            ready: ready_rx,
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, admin, async {
            let _ = stopped.await;
        }));
        Server {
            addr,
            ready,
            stop,
            task,
        }
    }

    async fn get(&self, path: &str) -> (u16, Option<String>, String) {
        let r = reqwest::get(format!("http://{}{path}", self.addr))
            .await
            .unwrap();
        let status = r.status().as_u16();
        let content_type = r
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned());
        (status, content_type, r.text().await.unwrap())
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn healthz_answers_ok_while_the_process_serves() {
    let server = Server::start(Arc::default()).await;
    let (status, _, body) = server.get("/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    server.stop().await;
}

#[tokio::test]
async fn readyz_turns_ready_when_the_initial_lists_are_in() {
    let server = Server::start(Arc::default()).await;
    let (status, _, body) = server.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("initial lists"), "{body}");
    assert_eq!(body.trim_end().lines().count(), 1, "one line: {body:?}");

    server.ready.send(true).unwrap();
    let (status, _, body) = server.get("/readyz").await;
    assert_eq!((status, body.as_str()), (200, "ok"));

    server.ready.send(false).unwrap();
    assert_eq!(server.get("/readyz").await.0, 503);
    server.stop().await;
}

#[tokio::test]
async fn metrics_show_the_counters_and_the_gauges_read_at_scrape_time() {
    let metrics = Arc::new(Metrics::default());
    metrics.reconcile();
    metrics.status_patch("InferencePool");
    let server = Server::start(metrics.clone()).await;

    let (status, content_type, body) = server.get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        content_type
            .as_deref()
            .is_some_and(|t| t.starts_with("application/openmetrics-text")),
        "{content_type:?}"
    );
    for line in [
        "kvroute_operator_reconciles_total 1",
        "kvroute_operator_status_patches_total{kind=\"InferencePool\"} 1",
        "kvroute_operator_pools 1",
        "kvroute_operator_ready_endpoints{namespace=\"ml\",pool=\"llama\"} 3",
        "kvroute_operator_watchpool_subscribers 2",
        "kvroute_operator_leader 1",
        "kvroute_operator_ready 0",
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "missing {line:?} in\n{body}"
        );
    }

    // Counters bumped and gauges changed after start show on the next scrape.
    metrics.reconcile();
    server.ready.send(true).unwrap();
    let (_, _, body) = server.get("/metrics").await;
    assert!(
        body.lines()
            .any(|l| l == "kvroute_operator_reconciles_total 2"),
        "{body}"
    );
    assert!(
        body.lines().any(|l| l == "kvroute_operator_ready 1"),
        "{body}"
    );
    server.stop().await;
}

#[tokio::test]
async fn other_paths_are_not_found() {
    let server = Server::start(Arc::default()).await;
    let (status, _, body) = server.get("/debug").await;
    assert_eq!(status, 404, "{body}");
    server.stop().await;
}
