//! A router in exact mode over engine-sim + agent pairs, each sim speaking
//! only vLLM's ZMQ events (its own WatchCache unused): warm requests go to
//! the engine that holds their prefix, and an agent started with the wrong
//! seed is reported by its own data and given no cache credit.

use std::time::Duration;

use kvroute_agent::Agent;
use kvroute_engine_sim::Sim;
use kvroute_router::config::{Config, Discovery, StaticDiscovery};
use serde_json::{Value, json};

async fn pair(agent_seed: Option<&str>) -> (Sim, Agent) {
    let mut config = kvroute_engine_sim::Config::test();
    config.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
    let sim = kvroute_engine_sim::start(config).await.unwrap();
    let events = sim.kv_events.as_ref().unwrap().bound.0.clone();
    let mut config = kvroute_agent::Config::loopback(events, format!("http://{}", sim.http_addr));
    config.python_hash_seed = agent_seed.map(str::to_owned);
    let agent = kvroute_agent::start(config).await.unwrap();
    (sim, agent)
}

fn chat(system: &str, user: &str) -> Value {
    json!({
        "model": "kvroute-sim",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    })
}

fn system(i: usize) -> String {
    (0..60)
        .map(|n| format!("Pool {i}: rule {n} of the long shared instructions. "))
        .collect()
}

async fn post(url: String, body: &Value) -> reqwest::Response {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r
}

/// Polls `check` until it holds (10 s at most).
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    kvroute_testkit::eventually(what, Duration::from_secs(10), || {
        std::future::ready(check().then_some(()))
    })
    .await;
}

#[tokio::test]
async fn warm_requests_go_to_the_holder_and_a_wrong_seed_is_caught() {
    let mut pairs = Vec::new();
    for seed in [None, None, None, Some("1234")] {
        pairs.push(pair(seed).await);
    }
    let dir = std::env::temp_dir().join(format!("kvroute-agent-router-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut yaml = String::from("endpoints:\n");
    for (i, (sim, agent)) in pairs.iter().enumerate() {
        yaml += &format!(
            "  - name: sim-{i}\n    address: {}\n    cachePort: {}\n",
            sim.http_addr,
            agent.cache_addrs[0].port()
        );
    }
    std::fs::write(dir.join("endpoints.yaml"), yaml).unwrap();
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
    eventually("the three right agents serve and match", || {
        let status = router.pool.status();
        status.len() == 4
            && status
                .iter()
                .filter(|s| s.stream == "live" && s.contract == "match")
                .count()
                == 3
    })
    .await;

    // Each engine gets its own prefix directly, as if earlier traffic had
    // put it there; the router learns it only through the agents.
    for (i, (sim, _)) in pairs.iter().take(3).enumerate() {
        post(
            format!("http://{}/v1/chat/completions", sim.http_addr),
            &chat(&system(i), "warm up"),
        )
        .await;
    }
    eventually("the router's index holds the three prefixes", || {
        let status = router.pool.status();
        (0..3).all(|i| {
            status
                .iter()
                .any(|s| s.name == format!("sim-{i}") && s.cached_blocks >= 20)
        })
    })
    .await;
    for round in 0..3 {
        for i in 0..3 {
            let r = post(
                format!("http://{}/v1/chat/completions", router.addr()),
                &chat(&system(i), &format!("question {round}")),
            )
            .await;
            assert_eq!(
                r.headers()["x-kvroute-endpoint"],
                format!("sim-{i}").as_str()
            );
        }
    }

    // The fourth agent's PYTHONHASHSEED differs from its engine's: the
    // hashes it recomputes from the engine's tokens disagree, and the
    // router sees the mismatch in the engine's contract.
    let (sim, _) = &pairs[3];
    post(
        format!("http://{}/v1/chat/completions", sim.http_addr),
        &chat(&system(9), "warm up"),
    )
    .await;
    eventually("the wrong seed is reported", || {
        router.pool.status().iter().any(|s| {
            s.name == "sim-3"
                && s.contract == "mismatch"
                && s.contract_mismatches.iter().any(|m| m.field == "hashes")
        })
    })
    .await;

    router.shutdown().await;
    for (sim, agent) in pairs {
        agent.shutdown().await;
        sim.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}
