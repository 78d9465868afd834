//! What floods of hostile connections cost the clients that behave: a
//! router over 2 engine sims on loopback, probed before and while each
//! flood is held. Reported, p50 / p99 / max over the probes, each on a new
//! connection (as the kubelet probes):
//!
//! - `/healthz` on the admin port, alone, then with 1,000 sockets held on
//!   the admin port (half idle, half with half-sent headers), then with
//!   2,500 held on the picker port;
//! - a small chat on the API port, alone, then with 256 connections each
//!   declaring a 32 MiB body and sending 64 bytes of it, then while 16
//!   clients loop `/debug/explain` of 2 MB prompts.
//!
//! `cargo bench -p kvroute-router --bench flood [-- --probes N]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_router::config::{Config, Discovery, ExtProc, StaticDiscovery};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn percentiles(mut ms: Vec<f64>) -> String {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    format!("{:8.2} {:8.2} {:8.2}", at(0.5), at(0.99), at(1.0))
}

/// `n` GETs of `url`, each on a new connection; their latencies, ms.
async fn probe(url: &str, n: usize) -> Vec<f64> {
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("a client");
        let started = Instant::now();
        let r = client.get(url).send().await.expect("an answer");
        assert_eq!(r.status(), 200, "{url}");
        ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    ms
}

/// `n` small chats, each on a new connection; their latencies, ms.
async fn chats(api: SocketAddr, n: usize) -> Vec<f64> {
    let mut ms = Vec::with_capacity(n);
    for i in 0..n {
        let client = reqwest::Client::new();
        let body = json!({"model": "kvroute-sim", "max_tokens": 1,
            "messages": [{"role": "user", "content": format!("probe {i}")}]});
        let started = Instant::now();
        let r = client
            .post(format!("http://{api}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("an answer");
        assert_eq!(r.status(), 200);
        r.bytes().await.expect("a body");
        ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    ms
}

async fn hold(addr: SocketAddr, n: usize, first: impl Fn(usize) -> Vec<u8>) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let mut c = TcpStream::connect(addr).await.expect("connects");
        let bytes = first(i);
        if !bytes.is_empty() {
            c.write_all(&bytes).await.expect("writes");
        }
        held.push(c);
    }
    held
}

#[tokio::main]
async fn main() {
    let mut probes = 200;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--probes" {
            probes = args
                .next()
                .and_then(|v| v.parse().ok())
                .expect("--probes N");
        }
    }
    kvroute_router::listener::raise_open_file_limit();
    let mut sims = Vec::new();
    let mut endpoints = String::from("endpoints:\n");
    for i in 0..2 {
        let sim = kvroute_engine_sim::start(kvroute_engine_sim::Config::test())
            .await
            .expect("a sim");
        endpoints += &format!("  - name: sim-{i}\n    address: {}\n", sim.http_addr);
        sims.push(sim);
    }
    let dir = std::env::temp_dir().join(format!("kvroute-bench-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("endpoints.yaml"), endpoints).expect("endpoints file");
    let mut config = Config {
        listen: Some("127.0.0.1:0".parse().expect("addr")),
        admin_listen: "127.0.0.1:0".parse().expect("addr"),
        ext_proc: Some(ExtProc {
            listen: "127.0.0.1:0".parse().expect("addr"),
            ..ExtProc::default()
        }),
        ..Config::default()
    };
    config.resilience.health_check = None;
    config.discovery = Discovery::Static(StaticDiscovery::file(dir.join("endpoints.yaml")));
    let router = kvroute_router::start(config)
        .await
        .expect("the router starts");
    let (api, admin) = (router.addr(), router.admin_addr);
    let picker = router.ext_proc_addr.expect("a picker");
    let healthz = format!("http://{admin}/healthz");

    println!("{probes} probes each, ms on a new connection: p50 p99 max");
    println!(
        "/healthz alone                        {}",
        percentiles(probe(&healthz, probes).await)
    );
    let flood = hold(admin, 1000, |i| {
        if i % 2 == 1 {
            b"GET /metrics HTTP/1.1\r\nhost: x\r\n".to_vec()
        } else {
            Vec::new()
        }
    })
    .await;
    println!(
        "/healthz, 1,000 sockets on the admin  {}",
        percentiles(probe(&healthz, probes).await)
    );
    drop(flood);
    let flood = hold(picker, 2500, |_| Vec::new()).await;
    println!(
        "/healthz, 2,500 sockets on the picker {}",
        percentiles(probe(&healthz, probes).await)
    );
    drop(flood);
    println!(
        "chat alone                            {}",
        percentiles(chats(api, probes).await)
    );
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 33554432\r\n\r\n";
    let flood = hold(api, 256, |_| {
        let mut b = head.as_bytes().to_vec();
        b.extend_from_slice(&[b' '; 64]);
        b
    })
    .await;
    println!(
        "chat, 256 bodies declaring 32 MiB     {}",
        percentiles(chats(api, probes).await)
    );
    drop(flood);
    let explaining = Arc::new(AtomicBool::new(true));
    let explains: Vec<_> = (0..16)
        .map(|i| {
            let explaining = explaining.clone();
            let prompt: String = (0..200_000).map(|k| format!("w{i}x{k} ")).collect();
            let body =
                json!({"model": "kvroute-sim", "messages": [{"role": "user", "content": prompt}]});
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut answered = 0usize;
                while explaining.load(Ordering::Relaxed) {
                    let r = client
                        .post(format!("http://{admin}/debug/explain"))
                        .json(&body)
                        .send()
                        .await;
                    answered += usize::from(r.is_ok_and(|r| r.status() == 200));
                }
                answered
            })
        })
        .collect();
    println!(
        "chat, 16 loops of 2 MB explains       {}",
        percentiles(chats(api, probes).await)
    );
    explaining.store(false, Ordering::Relaxed);
    let mut answered = 0;
    for e in explains {
        answered += e.await.expect("an explain loop");
    }
    println!("({answered} explains answered meanwhile)");
    router.shutdown().await;
    for s in sims {
        s.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}
