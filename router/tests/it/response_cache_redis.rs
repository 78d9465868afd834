//! The response cache's Redis store against a real `redis-server`: two
//! routers sharing answers, expiry, purges, Redis going away and coming
//! back (the circuit breaker), a password, and `rediss://`. Skipped when
//! `redis-server` is not installed (see [`crate::support::redis_server`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_router::config::{Backend, ResponseCache};
use kvroute_router::response_cache::StoreError;
use kvroute_router::response_cache::answer::Answer;
use kvroute_router::response_cache::key::Key;
use kvroute_router::response_cache::metrics::CacheMetrics;
use kvroute_router::response_cache::redis::RedisStore;

use crate::support::redis_server::{Listen, RedisServer, fixture};

/// Set in the child process [`rediss_trusting_the_servers_ca`] runs.
const TLS_URL_ENV: &str = "KVROUTE_TEST_REDISS_URL";

fn config(url: &str) -> ResponseCache {
    ResponseCache {
        backend: Backend::Redis,
        url: Some(url.into()),
        timeout_ms: 1000,
        ..ResponseCache::default()
    }
}

fn store(config: &ResponseCache) -> RedisStore {
    RedisStore::new(config, Arc::default()).expect("a valid configuration")
}

fn key(model: &str, n: u8) -> Key {
    Key {
        digest: [n; 32],
        model: model.into(),
    }
}

fn answer(content: &str) -> Answer {
    Answer {
        model: "m".into(),
        content: content.into(),
        finish_reason: "stop".into(),
        prompt_tokens: 12,
        completion_tokens: 3,
        stored_unix_ms: 1_700_000_000_000,
        ..Answer::default()
    }
}

/// A plain connection to `url`, to look at what the store wrote.
async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

async fn keys(url: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut raw(url).await)
        .await
        .unwrap();
    keys.sort();
    keys
}

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvroute-it-{name}-{}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn two_routers_share_answers_in_the_documented_layout() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let c = config(&server.url());
    let (one, two) = (store(&c), store(&c));
    let k = key("llama", 7);
    assert_eq!(two.get(&k).await.unwrap(), None);
    one.put(&k, &answer("hello")).await.unwrap();
    assert_eq!(two.get(&k).await.unwrap(), Some(answer("hello")));

    // {prefix}{16 hex of the model's SHA-256}:{key hex}, expiring in ttlS.
    let stored = keys(&server.url()).await;
    let [name] = stored.as_slice() else {
        panic!("one key: {stored:?}");
    };
    let rest = name.strip_prefix("kvroute:response:").unwrap();
    let (tag, digest) = rest.split_once(':').unwrap();
    assert_eq!(tag.len(), 16);
    assert!(tag.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(digest, "07".repeat(32));
    let pttl: i64 = redis::cmd("PTTL")
        .arg(name)
        .query_async(&mut raw(&server.url()).await)
        .await
        .unwrap();
    assert!(0 < pttl && pttl <= 3_600_000, "PTTL {pttl}");

    // A value that is not an answer is a miss, not an error.
    let _: () = redis::cmd("SET")
        .arg(name)
        .arg("not json")
        .query_async(&mut raw(&server.url()).await)
        .await
        .unwrap();
    assert_eq!(two.get(&k).await.unwrap(), None);
}

#[tokio::test]
async fn answers_expire_after_ttl() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let s = store(&ResponseCache {
        ttl_s: 1,
        ..config(&server.url())
    });
    let k = key("m", 1);
    s.put(&k, &answer("brief")).await.unwrap();
    assert!(s.get(&k).await.unwrap().is_some());
    kvroute_testkit::eventually("the answer expires", Duration::from_secs(10), || async {
        s.get(&k).await.unwrap().is_none().then_some(())
    })
    .await;
}

#[tokio::test]
async fn purge_drops_every_answer_or_one_models_and_nothing_else() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    // Glob characters in the prefix match only themselves.
    let s = store(&ResponseCache {
        key_prefix: "kv*[x]:".into(),
        ..config(&server.url())
    });
    for n in 0..3 {
        s.put(&key("a", n), &answer("a")).await.unwrap();
    }
    for n in 0..2 {
        s.put(&key("b", n), &answer("b")).await.unwrap();
    }
    let mut c = raw(&server.url()).await;
    for other in ["kv-x:unrelated", "kv*[x]-not-ours", "other:key"] {
        let _: () = redis::cmd("SET")
            .arg(other)
            .arg("1")
            .query_async(&mut c)
            .await
            .unwrap();
    }

    assert_eq!(s.purge(Some("a")).await.unwrap(), 3);
    assert_eq!(s.get(&key("a", 0)).await.unwrap(), None);
    assert_eq!(s.get(&key("b", 1)).await.unwrap(), Some(answer("b")));
    assert_eq!(s.purge(Some("a")).await.unwrap(), 0);

    assert_eq!(s.purge(None).await.unwrap(), 2);
    assert_eq!(
        keys(&server.url()).await,
        ["kv*[x]-not-ours", "kv-x:unrelated", "other:key"]
    );
}

#[tokio::test]
async fn purge_walks_more_keys_than_one_scan() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let s = store(&config(&server.url()));
    let k = |n: u16| Key {
        digest: {
            let mut d = [0; 32];
            d[..2].copy_from_slice(&n.to_le_bytes());
            d
        },
        model: "m".into(),
    };
    for n in 0..1200 {
        s.put(&k(n), &answer("x")).await.unwrap();
    }
    assert_eq!(s.purge(None).await.unwrap(), 1200);
    assert!(keys(&server.url()).await.is_empty());
}

#[tokio::test]
async fn redis_going_away_opens_the_breaker_and_its_return_closes_it() {
    let Some(mut server) = RedisServer::start(&[]) else {
        return;
    };
    let metrics = Arc::new(CacheMetrics::default());
    let s = RedisStore::new(
        &ResponseCache {
            timeout_ms: 250,
            ..config(&server.url())
        },
        metrics.clone(),
    )
    .unwrap();
    let k = key("m", 1);
    s.put(&k, &answer("before")).await.unwrap();

    server.stop();
    for i in 0..5 {
        let started = Instant::now();
        let got = s.get(&k).await;
        let took = started.elapsed();
        assert!(
            matches!(got, Err(StoreError::Failed(_) | StoreError::Timeout(250))),
            "failure {i}: {got:?}"
        );
        assert!(took < Duration::from_secs(2), "failure {i} took {took:?}");
    }
    assert!(matches!(s.get(&k).await, Err(StoreError::BreakerOpen)));
    assert!(matches!(
        s.put(&k, &answer("during")).await,
        Err(StoreError::BreakerOpen)
    ));
    assert_eq!(metrics.breaker_opened.get(), 1);

    server.restart();
    kvroute_testkit::eventually(
        "the store answers again once the breaker lets a probe through",
        Duration::from_secs(10),
        || async { s.get(&k).await.ok() },
    )
    .await;
    // The restarted Redis is empty; the store works as before.
    s.put(&k, &answer("after")).await.unwrap();
    assert_eq!(s.get(&k).await.unwrap(), Some(answer("after")));
    assert_eq!(metrics.breaker_opened.get(), 1);
}

#[tokio::test]
async fn a_hung_redis_costs_each_operation_its_timeout_at_most() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let metrics = Arc::new(CacheMetrics::default());
    let c = ResponseCache {
        timeout_ms: 250,
        ..config(&server.url())
    };
    let s = RedisStore::new(&c, metrics.clone()).unwrap();
    let k = key("m", 1);
    s.put(&k, &answer("before")).await.unwrap();

    // Stopped, it still accepts connections but answers nothing.
    server.pause();
    for i in 0..5 {
        let started = Instant::now();
        let got = s.get(&k).await;
        let took = started.elapsed();
        assert!(matches!(got, Err(StoreError::Timeout(250))), "{i}: {got:?}");
        assert!(took < Duration::from_secs(2), "{i} took {took:?}");
    }
    assert!(matches!(s.get(&k).await, Err(StoreError::BreakerOpen)));
    assert_eq!(metrics.breaker_opened.get(), 1);

    // A new store connects once: an operation arriving meanwhile fails
    // at once instead of waiting or connecting too.
    let fresh = store(&c);
    let (first, second) = tokio::join!(fresh.get(&k), async {
        let started = Instant::now();
        (fresh.get(&k).await, started.elapsed())
    });
    assert!(matches!(first, Err(StoreError::Timeout(250))), "{first:?}");
    assert!(
        matches!(&second.0, Err(StoreError::Failed(e)) if e.contains("connecting")),
        "{second:?}"
    );
    assert!(second.1 < Duration::from_millis(250), "{second:?}");

    server.resume();
    kvroute_testkit::eventually(
        "the store answers again once the breaker lets a probe through",
        Duration::from_secs(10),
        || async { s.get(&k).await.ok() },
    )
    .await;
    assert_eq!(s.get(&k).await.unwrap(), Some(answer("before")));
}

#[tokio::test]
async fn the_password_file_authenticates() {
    let Some(server) = RedisServer::start(&["--requirepass", "s3cret"]) else {
        return;
    };
    let k = key("m", 1);
    let right = temp_file("redis-password-right", "s3cret\n");
    let s = store(&ResponseCache {
        password_file: Some(right.clone()),
        ..config(&server.url())
    });
    s.put(&k, &answer("authenticated")).await.unwrap();
    assert_eq!(s.get(&k).await.unwrap(), Some(answer("authenticated")));

    let wrong = temp_file("redis-password-wrong", "guess\n");
    let s = store(&ResponseCache {
        password_file: Some(wrong.clone()),
        ..config(&server.url())
    });
    let got = s.get(&k).await;
    assert!(matches!(got, Err(StoreError::Failed(_))), "{got:?}");

    let s = store(&config(&server.url()));
    let got = s.get(&k).await;
    assert!(matches!(got, Err(StoreError::Failed(_))), "{got:?}");
    for path in [right, wrong] {
        std::fs::remove_file(path).unwrap();
    }
}

#[tokio::test]
async fn rediss_refuses_a_server_the_system_does_not_trust() {
    let Some(server) = RedisServer::start_listening(Listen::Tls, &[]) else {
        return;
    };
    // The test CA is not among the system's roots: the handshake (on
    // ring, installed as the process's provider) refuses the server.
    let s = store(&config(&server.url()));
    let got = s.get(&key("m", 1)).await;
    assert!(
        matches!(&got, Err(StoreError::Failed(e)) if e.contains("certificate")),
        "{got:?}"
    );
}

#[test]
fn rediss_trusting_the_servers_ca() {
    let Some(server) = RedisServer::start_listening(Listen::Tls, &[]) else {
        return;
    };
    // The roots come from SSL_CERT_FILE, which is read process-wide:
    // the round trip runs in a child process of this test binary.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "response_cache_redis::rediss_round_trip_in_child",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("SSL_CERT_FILE", fixture("ca.crt"))
        .env(TLS_URL_ENV, server.url())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Run by [`rediss_trusting_the_servers_ca`] only.
#[tokio::test]
#[ignore = "run in a child process by rediss_trusting_the_servers_ca"]
async fn rediss_round_trip_in_child() {
    let url = std::env::var(TLS_URL_ENV).expect("run by rediss_trusting_the_servers_ca");
    let s = store(&config(&url));
    let k = key("m", 1);
    s.put(&k, &answer("over TLS")).await.unwrap();
    assert_eq!(s.get(&k).await.unwrap(), Some(answer("over TLS")));
}
