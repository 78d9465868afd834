//! The router binary under a lowered open-file limit (`ulimit -n 2048`, in
//! a child process) with 2,500 connections held on its picker port: no
//! listener may take the descriptors another needs, so probes and API
//! requests are still served. Linux only: elsewhere it prints a skip
//! message and passes.

use crate::support::child;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{chat, get_text, temp_dir, write_endpoints};
use child::Router;

/// Where the router says it listens: (API, picker, admin).
fn addresses(router: &mut Child) -> (SocketAddr, SocketAddr, SocketAddr) {
    let out = router.stdout.take().expect("stdout is piped");
    let mut lines = std::io::BufReader::new(out).lines();
    let (mut api, mut picker, mut admin) = (None, None, None);
    while api.is_none() || picker.is_none() || admin.is_none() {
        let line = lines
            .next()
            .expect("the router printed its addresses")
            .unwrap();
        let addr = |prefix: &str| {
            line.strip_prefix(prefix)
                .map(|rest| rest.trim_start_matches("http://").parse().unwrap())
        };
        api = api.or_else(|| addr("kvroute-router: API on "));
        picker = picker.or_else(|| addr("kvroute-router: endpoint picker (ext_proc gRPC) on "));
        admin = admin.or_else(|| addr("kvroute-router: admin on "));
    }
    (api.unwrap(), picker.unwrap(), admin.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_requests_are_served_with_the_picker_port_full() {
    if !std::path::Path::new("/proc/self/fd").exists() {
        eprintln!("skipped: no /proc to lower the open-file limit under");
        return;
    }
    kvroute_router::listener::raise_open_file_limit();
    let sim = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
        .await
        .unwrap();
    let dir = temp_dir("open-files");
    write_endpoints(&dir, &[&sim], false);
    std::fs::write(
        dir.join("router.yaml"),
        format!(
            "listen: 127.0.0.1:0\nadminListen: 127.0.0.1:0\nextProc: {{listen: 127.0.0.1:0}}\n\
             discovery: {{static: {{file: {}}}}}\nresilience: {{healthCheck: null}}\n",
            dir.join("endpoints.yaml").display()
        ),
    )
    .unwrap();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(r#"ulimit -n 2048 && exec "$0" --config "$1""#)
        .arg(env!("CARGO_BIN_EXE_kvroute-router"))
        .arg(dir.join("router.yaml"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (api, picker, admin) = addresses(&mut child);
    let router = Router(child);
    let mut held = Vec::new();
    for _ in 0..2500 {
        match tokio::net::TcpStream::connect(picker).await {
            Ok(c) => held.push(c),
            Err(e) => panic!("connecting to the picker: {e}"),
        }
    }
    let fds = std::fs::read_dir(format!("/proc/{}/fd", router.0.id()))
        .unwrap()
        .count();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let started = Instant::now();
    let health = client
        .get(format!("http://{admin}/healthz"))
        .send()
        .await
        .expect("/healthz answers");
    let took = started.elapsed();
    assert_eq!(health.status(), 200);
    let r = client
        .post(format!("http://{api}/v1/chat/completions"))
        .json(&chat("s", "with the picker port full", 2))
        .send()
        .await
        .expect("the API answers");
    assert_eq!(r.status(), 200);
    let metrics = get_text(&format!("http://{admin}/metrics")).await;
    assert!(
        metrics.contains("kvroute_connections_evicted_total{listener=\"picker\"}"),
        "{metrics}"
    );
    println!(
        "2,500 connections on the picker under ulimit -n 2048: the router holds {fds} descriptors; /healthz in {} ms",
        took.as_millis()
    );
    drop(held);
    drop(router);
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
