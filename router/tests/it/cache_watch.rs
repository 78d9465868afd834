//! WatchCache watchers against real engine simulators: the pool mirrors
//! each engine's cache, resyncs after a restart, and drops an engine's
//! entries when its stream is lost.

use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_core::policy::PolicyConfig;
use kvroute_engine_sim::{Config, Sim, start};
use kvroute_router::config::Resilience;
use kvroute_router::pool::Watchers;
use kvroute_router::pool::{EndpointSpec, EndpointStatus, Pool};
use kvroute_router::settings::Settings;
use serde_json::json;

use crate::support::eventually;

fn pool() -> Arc<Pool> {
    Pool::new(
        Settings::builtin(PolicyConfig::default()),
        &Resilience::default(),
        256,
    )
}

fn spec(name: &str, sim: &Sim) -> EndpointSpec {
    EndpointSpec {
        name: name.into(),
        http: sim.http_addr,
        cache: Some(sim.cache_addr),
        ready: true,
        draining: false,
        ready_since_ms: None,
        role: Default::default(),
    }
}

async fn complete(http: SocketAddr, prompt: &str) {
    let r = reqwest::Client::new()
        .post(format!("http://{http}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// Fills `sim`'s cache with a few long prompts.
async fn warm(sim: &Sim, topic: &str) {
    for i in 0..3 {
        let prompt = format!("Prompt {i} about {topic}. ").repeat(40);
        complete(sim.http_addr, &prompt).await;
    }
}

fn status(pool: &Pool, name: &str) -> EndpointStatus {
    pool.status()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("{name} is not in the pool"))
}

/// Whether `name`'s stream is live and the pool holds exactly as many
/// blocks for it as the engine does.
fn mirrors(pool: &Pool, name: &str, sim: &Sim) -> bool {
    let s = status(pool, name);
    s.stream == "live" && s.cached_blocks == sim.engine.resident().len()
}

#[tokio::test]
async fn watchers_mirror_engines_through_restarts_and_shutdowns() {
    let (a, b) = (
        start(Config::test()).await.unwrap(),
        start(Config::test()).await.unwrap(),
    );
    let pool = pool();
    let mut watchers = Watchers::new(None);
    watchers.apply(
        &pool,
        pool.set_endpoints(vec![spec("a", &a), spec("b", &b)]),
    );
    warm(&a, "rivers").await;
    warm(&b, "mountains").await;
    assert!(!a.engine.resident().is_empty() && !b.engine.resident().is_empty());
    eventually("both streams are live and mirror their engines", || {
        mirrors(&pool, "a", &a) && mirrors(&pool, "b", &b)
    })
    .await;

    // A new incarnation: the old entries go, the new (empty) contents come
    // from a fresh snapshot, and later deltas refill them.
    a.engine.restart_cache();
    assert!(a.engine.resident().is_empty());
    eventually("a resynced to its empty new incarnation", || {
        mirrors(&pool, "a", &a)
    })
    .await;
    warm(&a, "deserts").await;
    assert!(!a.engine.resident().is_empty());
    eventually("a's new contents are mirrored", || mirrors(&pool, "a", &a)).await;

    // An engine that goes away loses its entries; the other keeps its own.
    let b_blocks = b.engine.resident().len();
    b.shutdown().await;
    eventually("b's stream is lost and its entries dropped", || {
        let s = status(&pool, "b");
        s.stream != "live" && s.cached_blocks == 0
    })
    .await;
    assert_eq!(status(&pool, "b").stream, "connecting");
    assert!(mirrors(&pool, "a", &a));
    let mut a_blocks = a.engine.resident();
    a_blocks.sort_unstable();
    a_blocks.dedup();
    assert_eq!(
        pool.index_entries(),
        a_blocks.len(),
        "only a's blocks are indexed"
    );
    assert!(b_blocks > 0);
    a.shutdown().await;
}

#[tokio::test]
async fn removing_an_endpoint_stops_its_watcher() {
    let sim = start(Config::test()).await.unwrap();
    let pool = pool();
    let mut watchers = Watchers::new(None);
    watchers.apply(&pool, pool.set_endpoints(vec![spec("a", &sim)]));
    eventually("the stream is live", || status(&pool, "a").stream == "live").await;
    assert_eq!(sim.engine.subscribers(), 1);
    watchers.apply(&pool, pool.set_endpoints(Vec::new()));
    // The engine notices a gone subscriber at its next load report.
    eventually("the engine has no subscriber", || {
        sim.engine.subscribers() == 0
    })
    .await;
    sim.shutdown().await;
}

#[tokio::test]
async fn dropping_the_pool_or_the_watchers_stops_them() {
    for drop_pool in [true, false] {
        let sim = start(Config::test()).await.unwrap();
        let pool = pool();
        let mut watchers = Watchers::new(None);
        watchers.apply(&pool, pool.set_endpoints(vec![spec("a", &sim)]));
        eventually("the stream is live", || status(&pool, "a").stream == "live").await;
        if drop_pool {
            drop(pool);
        } else {
            drop(watchers);
        }
        eventually("the engine has no subscriber", || {
            sim.engine.subscribers() == 0
        })
        .await;
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn engines_that_hash_differently_get_no_cache_credit_until_the_settings_agree() {
    let sim = |f: fn(&mut Config)| {
        let mut c = Config::test();
        f(&mut c);
        start(c)
    };
    let same = sim(|_| {}).await.unwrap();
    let block32 = sim(|c| c.block_size = 32).await.unwrap();
    let seeded = sim(|c| c.hash_seed = Some("7".into())).await.unwrap();
    let xxhash = sim(|c| c.hash_algo = kvroute_core::hash::HashAlgo::XxhashCbor)
        .await
        .unwrap();
    let sims = [
        ("same", &same),
        ("block32", &block32),
        ("seeded", &seeded),
        ("xxhash", &xxhash),
    ];
    for (name, s) in sims {
        warm(s, name).await;
        assert!(!s.engine.resident().is_empty());
    }
    let pool = pool();
    let mut watchers = Watchers::new(None);
    watchers.apply(
        &pool,
        pool.set_endpoints(sims.iter().map(|(n, s)| spec(n, s)).collect()),
    );
    eventually("every contract is known", || {
        sims.iter()
            .all(|(n, _)| status(&pool, n).contract != "unknown")
    })
    .await;
    assert!(mirrors(&pool, "same", &same));
    assert_eq!(status(&pool, "same").contract, "match");
    for (name, field) in [
        ("block32", "blockSize"),
        ("seeded", "hashSeed"),
        ("xxhash", "hashAlgo"),
    ] {
        let s = status(&pool, name);
        assert_eq!(s.contract, "mismatch", "{name}");
        assert_eq!(s.stream, "live", "{name}: its load still counts");
        assert_eq!(s.cached_blocks, 0, "{name}: no cache credit");
        let fields: Vec<&str> = s.contract_mismatches.iter().map(|m| m.field).collect();
        assert_eq!(fields, [field], "{name}");
    }
    assert_eq!(status(&pool, "block32").contract_mismatches[0].engine, "32");
    let metrics = kvroute_router::metrics::Metrics::default().render(&pool);
    for line in [
        "kvroute_endpoint_contract{endpoint=\"block32\",state=\"mismatch\"} 1",
        "kvroute_endpoint_contract{endpoint=\"same\",state=\"match\"} 1",
        "kvroute_endpoint_contract{endpoint=\"same\",state=\"mismatch\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }

    // The settings move to block size 32: that engine resyncs and counts,
    // the others stop.
    let streams = pool.update_settings(|s| Settings {
        hasher: kvroute_core::hash::BlockHasher::new(kvroute_core::hash::HashConfig {
            block_size: 32,
            ..s.hasher.config().clone()
        })
        .unwrap(),
        ..s.clone()
    });
    watchers.apply(&pool, streams);
    eventually("block32 matches and is mirrored", || {
        status(&pool, "block32").contract == "match" && mirrors(&pool, "block32", &block32)
    })
    .await;
    let s = status(&pool, "same");
    assert_eq!((s.contract, s.cached_blocks), ("mismatch", 0));
    for s in [same, block32, seeded, xxhash] {
        s.shutdown().await;
    }
}
