//! Startup readiness: a router whose engine has not yet delivered its
//! WatchCache snapshot says it is not ready, and why; it is ready once the
//! snapshot is in, or once `resilience.snapshotWaitMs` has passed (logged
//! and counted).

use std::net::SocketAddr;

use kvroute_engine_sim::{Config as SimConfig, Sim};
use kvroute_router::Running;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::support::{Logs, eventually, get_text, router_config, sum_of, temp_dir};

/// A TCP relay to `target` that holds every connection, its bytes
/// unanswered, until opened: an engine whose snapshot is slow to come.
struct Gate {
    addr: SocketAddr,
    open: watch::Sender<bool>,
}

impl Gate {
    async fn start(target: SocketAddr) -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, opened) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut opened = opened.clone();
                tokio::spawn(async move {
                    if opened.wait_for(|o| *o).await.is_err() {
                        return;
                    }
                    let Ok(mut engine) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut engine).await;
                });
            }
        });
        Gate { addr, open }
    }

    fn open(&self) {
        self.open.send_replace(true);
    }
}

/// A router over `sim`, its WatchCache reached through `gate`.
async fn router(name: &str, sim: &Sim, gate: &Gate, wait_ms: u64) -> Running {
    let dir = temp_dir(name);
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!(
            "endpoints:\n  - name: sim-0\n    address: {}\n    cachePort: {}\n",
            sim.http_addr,
            gate.addr.port()
        ),
    )
    .unwrap();
    let mut config = router_config(&dir);
    config.resilience.snapshot_wait_ms = wait_ms;
    kvroute_router::start(config).await.unwrap()
}

/// `/readyz` on the admin port and on the API port: status and text,
/// which must agree (call it while nothing changes).
async fn readyz(router: &Running) -> (u16, String) {
    let mut answers = Vec::new();
    for addr in [router.admin_addr, router.addr()] {
        let r = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
        answers.push((r.status().as_u16(), r.text().await.unwrap()));
    }
    assert_eq!(answers[0], answers[1], "both ports answer alike");
    answers.remove(0)
}

/// Whether the admin port's `/readyz` answers 200.
async fn admin_ready(router: &Running) -> bool {
    let url = format!("http://{}/readyz", router.admin_addr);
    reqwest::get(url).await.unwrap().status() == 200
}

#[tokio::test]
async fn not_ready_until_the_engines_snapshot_arrives() {
    let sim = kvroute_engine_sim::start(SimConfig::test()).await.unwrap();
    let gate = Gate::start(sim.cache_addr).await;
    let router = router("startup-slow", &sim, &gate, 60_000).await;
    // The endpoint is known and routable: only its snapshot is missing.
    eventually("the endpoint is known", || router.pool.routable() == 1).await;
    let (status, text) = readyz(&router).await;
    assert_eq!(status, 503);
    assert_eq!(
        text,
        "not ready: waiting for cache snapshots from 1 of 1 engines: sim-0\n"
    );
    gate.open();
    kvroute_testkit::eventually(
        "ready once the snapshot is in",
        std::time::Duration::from_secs(20),
        || async { (admin_ready(&router).await).then_some(()) },
    )
    .await;
    assert_eq!(readyz(&router).await, (200, "ready: 1 endpoints\n".into()));
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(
        sum_of(&metrics, "kvroute_snapshot_waits_expired_total"),
        0.0
    );
    router.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn ready_when_the_bounded_wait_has_passed() {
    let (logs, _guard) = Logs::capture();
    let sim = kvroute_engine_sim::start(SimConfig::test()).await.unwrap();
    // Never opened: the snapshot never comes.
    let gate = Gate::start(sim.cache_addr).await;
    let router = router("startup-bounded", &sim, &gate, 300).await;
    kvroute_testkit::eventually(
        "ready once the wait has passed",
        std::time::Duration::from_secs(10),
        || async { (admin_ready(&router).await).then_some(()) },
    )
    .await;
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(
        sum_of(&metrics, "kvroute_snapshot_waits_expired_total"),
        1.0
    );
    // Still without the snapshot, and still ready.
    assert_ne!(router.pool.status()[0].stream, "live");
    assert_eq!(readyz(&router).await.0, 200);
    assert_eq!(
        logs.count("resilience.snapshotWaitMs passed"),
        1,
        "{}",
        logs.text()
    );
    assert_eq!(logs.count("missing=sim-0"), 1, "{}", logs.text());
    router.shutdown().await;
    sim.shutdown().await;
}
