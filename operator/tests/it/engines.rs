//! Engine probes against engine sims: the operator reads each serving
//! pod's cache settings from its WatchCache stream and the policy's status
//! says which engines hash otherwise.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_engine_sim::Config as SimConfig;
use kvroute_operator::index::{Index, PodInfo, PolicySpec, PoolSpec, Reason};

fn pod(name: &str, ip: &str) -> PodInfo {
    PodInfo {
        namespace: "ml".into(),
        name: name.into(),
        labels: [("app".to_owned(), "llama".to_owned())].into(),
        ip: Some(ip.parse().unwrap()),
        phase_running: true,
        ready: true,
        deleting: false,
        ready_since_ms: None,
        role: Default::default(),
    }
}

#[tokio::test]
async fn probes_report_engines_that_hash_otherwise() {
    // Two engines on one port of two loopback addresses, as two pods.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sim = |ip: &str, block_size| {
        let mut c = SimConfig::test();
        c.cache_listen = format!("{ip}:{port}").parse().unwrap();
        c.block_size = block_size;
        kvroute_engine_sim::start(c)
    };
    let a = sim("127.0.0.1", 16).await.unwrap();
    let b = sim("127.0.0.2", 32).await.unwrap();

    let index = Arc::new(Mutex::new(Index::with_clock(|| 0)));
    {
        let mut i = index.lock().unwrap();
        i.apply_pool(PoolSpec {
            namespace: "ml".into(),
            name: "llama".into(),
            selector: [("app".to_owned(), "llama".to_owned())].into(),
            target_ports: vec![8000],
            ..PoolSpec::default()
        });
        i.apply_pod(pod("a", "127.0.0.1"));
        i.apply_pod(pod("b", "127.0.0.2"));
        i.apply_policy(PolicySpec {
            namespace: "ml".into(),
            name: "p".into(),
            target_pool: "llama".into(),
            cache_port: Some(port),
            ..PolicySpec::default()
        });
    }
    let probes = tokio::spawn(kvroute_operator::engines::run(index.clone(), None));
    let engines = || {
        index
            .lock()
            .unwrap()
            .policy_status("ml", "p")
            .unwrap()
            .engines
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let condition = loop {
        if let Some(c) = engines().filter(|c| c.message.contains("2 probed")) {
            break c;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no verdict: {:?}",
            engines()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!condition.status);
    assert_eq!(condition.reason, Reason::EnginesInconsistent);
    assert!(
        condition.message.contains("b: blockSize 32 (policy 16)"),
        "{}",
        condition.message
    );
    assert!(!condition.message.contains("a:"), "{}", condition.message);
    probes.abort();
    a.shutdown().await;
    b.shutdown().await;
}

/// The router crate's test certificates: one set for the workspace.
fn tls_fixture(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../router/tests/fixtures/tls")
        .join(name)
}

#[tokio::test]
async fn probes_dial_engines_over_mutual_tls() {
    let mut c = SimConfig::test();
    c.tls.tls_cert_file = Some(tls_fixture("server.crt"));
    c.tls.tls_key_file = Some(tls_fixture("server.key"));
    c.tls.tls_client_ca_file = Some(tls_fixture("ca.crt"));
    let sim = kvroute_engine_sim::start(c).await.unwrap();
    let target = kvroute_operator::index::EngineTarget {
        namespace: "ml".into(),
        pod: "a".into(),
        addr: sim.cache_addr,
    };
    let tls = kvroute_proto::tls::client(
        &tls_fixture("ca.crt"),
        Some((&tls_fixture("client.crt"), &tls_fixture("client.key"))),
        Some("localhost"),
    )
    .unwrap();
    let engine = kvroute_operator::engines::probe(&target, Some(tls))
        .await
        .unwrap();
    assert_eq!(engine.block_size, 16);
    let plain = kvroute_operator::engines::probe(&target, None).await;
    assert!(plain.is_err(), "a plaintext probe of a TLS engine fails");
    sim.shutdown().await;
}
