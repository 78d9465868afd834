//! `kvroute probe` (the chart's `helm test`) against a router over an
//! engine sim: both steps pass; a wrong model fails naming the request.

use std::process::{Command, Output};

use kvroute_engine_sim::Config as SimConfig;
use kvroute_router::config::{Config, Discovery, StaticDiscovery};

async fn kvroute(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_a_router_end_to_end() {
    let sim = kvroute_engine_sim::start(SimConfig::test()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("kvroute-probe-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!(
            "endpoints:\n  - name: sim-0\n    address: {}\n",
            sim.http_addr
        ),
    )
    .unwrap();
    let mut config = Config {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    config.discovery = Discovery::Static(StaticDiscovery {
        file: dir.join("endpoints.yaml"),
        reload_ms: 100,
    });
    let router = kvroute_router::start(config).await.unwrap();
    let args = |model: &str| {
        vec![
            "probe".to_owned(),
            "--url".to_owned(),
            format!("http://{}", router.addr()),
            "--model".to_owned(),
            model.to_owned(),
            "--wait-s".to_owned(),
            "10".to_owned(),
        ]
    };
    let ok = kvroute(args("kvroute-sim")).await;
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        stdout.contains("ok   http://") && stdout.contains("served by sim-0"),
        "{stdout}"
    );

    let bad = kvroute(args("no-such-model")).await;
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("/v1/completions: 404"), "{stderr}");
    router.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
