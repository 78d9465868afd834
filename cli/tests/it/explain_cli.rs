//! `kvroute explain` against a router over engine sims in this process: it
//! prints the chain, each endpoint's cached blocks and the decision, and a
//! served request's missed tokens by cause; a router that cannot be reached
//! is one error line.

use std::process::{Command, Output};

use kvroute_engine_sim::Config as SimConfig;
use kvroute_router::config::{Config, Discovery, Prefix, StaticDiscovery, Warmup};

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
async fn explains_a_request_to_a_running_router() {
    let sims = [
        kvroute_engine_sim::start(SimConfig::test()).await.unwrap(),
        kvroute_engine_sim::start(SimConfig::test()).await.unwrap(),
    ];
    let dir = std::env::temp_dir().join(format!("kvroute-explain-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut endpoints = String::from("endpoints:\n");
    for (i, s) in sims.iter().enumerate() {
        endpoints += &format!(
            "  - name: sim-{i}\n    address: {}\n    cachePort: {}\n",
            s.http_addr,
            s.cache_addr.port()
        );
    }
    std::fs::write(dir.join("endpoints.yaml"), endpoints).unwrap();
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
    let body = serde_json::json!({
        "model": "kvroute-sim",
        "messages": [
            {"role": "system", "content": "You answer questions about block caches. ".repeat(12)},
            {"role": "user", "content": "What is a block?"},
        ],
        "max_tokens": 2,
    });
    let file = dir.join("request.json");
    std::fs::write(&file, body.to_string()).unwrap();
    // Warm one engine and wait until the router's index has its blocks.
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", router.addr()))
        .header("x-request-id", "warm-1")
        .json(&body)
        .send()
        .await
        .unwrap();
    let holder = r.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    kvroute_testkit::eventually(
        "the index to fill",
        std::time::Duration::from_secs(10),
        || std::future::ready((router.pool.index_entries() > 0).then_some(())),
    )
    .await;

    let admin = format!("http://{}", router.admin_addr);
    let out = kvroute(vec![
        "explain".into(),
        "--admin".into(),
        admin.clone(),
        file.display().to_string(),
    ])
    .await;
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let blocks = stdout
        .lines()
        .find_map(|l| l.strip_prefix("prompt    "))
        .and_then(|l| l.split(" full blocks").next())
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("no prompt line:\n{stdout}"))
        .to_owned();
    assert!(
        stdout.contains(&format!(
            "decision  kvroute → {holder} (warm, {blocks} cached blocks)"
        )),
        "{stdout}"
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with(&holder))
        .unwrap_or_else(|| panic!("no {holder} row:\n{stdout}"));
    assert!(row.contains(&format!(" {blocks}/{blocks} ")), "{row}");

    let json = kvroute(vec![
        "explain".into(),
        "--admin".into(),
        admin,
        "--json".into(),
        file.display().to_string(),
    ])
    .await;
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["decision"]["ranked"][0], holder.as_str());

    // Where the first request's missed tokens went.
    let id = |id: &str| {
        vec![
            "explain".into(),
            "--admin".into(),
            format!("http://{}", router.admin_addr),
            "--request-id".into(),
            id.into(),
        ]
    };
    let out = kvroute(id("warm-1")).await;
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.starts_with("request   warm-1 (response chatcmpl-"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("served    by {holder};")),
        "{stdout}"
    );
    assert!(stdout.contains("\n  cold "), "{stdout}");
    let missing = kvroute(id("nope")).await;
    assert_eq!(missing.status.code(), Some(1));
    let stderr = String::from_utf8(missing.stderr).unwrap();
    assert!(
        stderr.starts_with(
            "error: the router refused the request (404 Not Found): no recent request nope"
        ),
        "{stderr}"
    );

    let unreachable = kvroute(vec![
        "explain".into(),
        "--admin".into(),
        "http://127.0.0.1:1".into(),
        file.display().to_string(),
    ])
    .await;
    assert_eq!(unreachable.status.code(), Some(1));
    let stderr = String::from_utf8(unreachable.stderr).unwrap();
    assert!(
        stderr.starts_with("error: asking http://127.0.0.1:1/debug/explain"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");

    router.shutdown().await;
    for s in sims {
        s.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shows_a_warmed_prefix_and_its_owners() {
    let sim = kvroute_engine_sim::start(SimConfig::test()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("kvroute-explain-warmup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let endpoints = format!(
        "endpoints:\n  - name: sim-0\n    address: {}\n    cachePort: {}\n",
        sim.http_addr,
        sim.cache_addr.port()
    );
    std::fs::write(dir.join("endpoints.yaml"), endpoints).unwrap();
    let mut config = Config {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    config.discovery = Discovery::Static(StaticDiscovery {
        file: dir.join("endpoints.yaml"),
        reload_ms: 100,
    });
    config.routing.warmup = Some(Warmup {
        every_seconds: 1,
        max_share_of_prefill: 1.0,
        prefixes: vec![Prefix {
            name: "support-v3".into(),
            model: None,
            tenant: None,
            messages: None,
            prompt: Some("You answer questions about block caches. ".repeat(12)),
            config_map_ref: None,
        }],
        ..Warmup::default()
    });
    let router = kvroute_router::start(config).await.unwrap();
    let admin = format!("http://{}", router.admin_addr);
    let prefix = |name: &str| {
        let args = ["explain", "--admin", &admin, "--prefix", name];
        kvroute(args.iter().map(|a| a.to_string()).collect())
    };
    // Its second period: the owner holds it.
    let shown = kvroute_testkit::eventually(
        "a warm-up of a resident prefix",
        std::time::Duration::from_secs(20),
        || async {
            let out = prefix("support-v3").await;
            let stdout = String::from_utf8(out.stdout).unwrap();
            let resident = stdout.contains("owner") && !stdout.contains("not resident");
            // Warm-ups run concurrently: one may still be in flight.
            let answered = !stdout.contains("last warm-up: in_flight");
            (resident && answered).then_some(stdout)
        },
    )
    .await;
    assert!(shown.starts_with("prefix    support-v3, "), "{shown}");
    assert!(shown.contains("owner     sim-0 "), "{shown}");
    assert!(shown.contains("last warm-up: sent"), "{shown}");
    let unknown = prefix("nope").await;
    assert_eq!(unknown.status.code(), Some(1));
    let stderr = String::from_utf8(unknown.stderr).unwrap();
    assert!(
        stderr.starts_with("error: the router warms no prefix \"nope\"; it warms [\"support-v3\"]"),
        "{stderr}"
    );
    router.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
