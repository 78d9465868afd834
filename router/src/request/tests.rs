//! The decision service on a pool without I/O.

use axum::http::HeaderMap;
use serde_json::json;

use super::*;
use crate::config;
use crate::pool::Lost;

/// A service with `config` over a pool of the test settings (no endpoints
/// yet), tenants shared.
fn test_service(config: &Config) -> (Arc<Service>, Arc<Pool>) {
    let metrics = Arc::new(Metrics::default());
    let pool = Pool::new(Settings::test(), &config.resilience, 8);
    let t = Tenancy::load(&config::Tenancy::default()).unwrap();
    (
        Arc::new(Service::new(pool.clone(), metrics, t, config)),
        pool,
    )
}

/// Endpoints `names` that report their caches.
fn reporting(names: &[&str]) -> Vec<crate::pool::EndpointSpec> {
    (names.iter())
        .map(|name| crate::pool::EndpointSpec {
            name: (*name).into(),
            http: std::net::SocketAddr::from(([127, 0, 0, 1], 9)),
            cache: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 9))),
            ready: true,
            draining: false,
            ready_since_ms: None,
            role: Default::default(),
        })
        .collect()
}

/// In exact mode a chain is hashed as far as the engines hold it: the
/// router asks whether any engine holds its last block after 1, 2, 4, ...
/// 64 blocks, then every 64.
#[tokio::test]
async fn exact_chains_end_past_the_blocks_engines_hold() {
    let (service, pool) = test_service(&Config::default());
    let streams = pool.set_endpoints(reporting(&["a", "b", "c"]));
    let body = |text: &str| {
        let content = text.repeat(300);
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": content}]});
        Bytes::from(chat.to_string())
    };
    let prompt = "Every block of this prompt is hashed only while an engine holds it. ";
    let analyze = |bytes: Bytes, keep_tokens: bool| {
        let service = service.clone();
        let headers = HeaderMap::new();
        let scope = if keep_tokens {
            Scope::KeepTokens
        } else {
            Scope::Whole
        };
        async move {
            let mut model = String::new();
            let a = service
                .analyze(
                    "/v1/chat/completions",
                    &headers,
                    (None, None),
                    bytes,
                    scope,
                    &mut model,
                )
                .await
                .unwrap();
            a.chain
        }
    };
    let whole = analyze(body(prompt), true).await;
    assert!(whole.len() > 256, "{}", whole.len());
    let engine = kvroute_core::contract::EngineCache::of(&pool.settings().hasher);
    // `b` holds 100 leading blocks, `c` 150.
    for (s, held) in streams.start.iter().zip([0, 100, 150]) {
        pool.apply_snapshot(
            &s.name,
            s.generation,
            engine.clone(),
            1 << 12,
            &whole[..held],
            &[],
        )
        .unwrap();
    }
    // Asked at 1, 2, 4, ... 64, 128 (held by `c`), 192 (held by none).
    let ended = analyze(body(prompt), false).await;
    assert_eq!(ended.len(), 192);
    assert!(whole.starts_with(&ended));
    let path = "/v1/chat/completions";
    let decided = service.measure(path, &HeaderMap::new(), body(prompt)).await;
    assert_eq!(decided.unwrap(), "c");
    // A prompt nobody holds costs one block's hash.
    let other = analyze(body("A prompt no engine has seen. "), false).await;
    assert_eq!(other.len(), 1);
}

/// An attempt knows what its endpoint held and who held more: endpoints
/// tried before it (a retry), or ranked after it (load).
#[tokio::test]
async fn attempts_know_who_held_more_and_why_it_lost() {
    let (service, pool) = test_service(&Config::default());
    let streams = pool.set_endpoints(reporting(&["a", "b"]));
    let content = "Attempts remember who held the prefix. ".repeat(40);
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": content}]});
    let bytes = Bytes::from(chat.to_string());
    let headers = HeaderMap::new();
    let ask = |bytes: Bytes| Ask {
        path: "/v1/chat/completions",
        headers: &headers,
        body: Payload::Read(bytes),
        among: &|_| true,
        fairness: None,
        id: RequestId::of(&headers),
    };
    let path = "/v1/chat/completions";
    let mut model = String::new();
    let whole = service.analyze(
        path,
        &headers,
        (None, None),
        bytes.clone(),
        Scope::KeepTokens,
        &mut model,
    );
    let chain = whole.await.unwrap().chain;
    assert!(chain.len() >= 4);
    let engine = kvroute_core::contract::EngineCache::of(&pool.settings().hasher);
    // `a` holds 2 leading blocks, `b` 4.
    for (s, held) in streams.start.iter().zip([2, 4]) {
        pool.apply_snapshot(
            &s.name,
            s.generation,
            engine.clone(),
            64,
            &chain[..held],
            &[],
        )
        .unwrap();
    }
    let d = service.decide(ask(bytes)).await.unwrap();
    let targets = d.targets().to_vec();
    assert_eq!(&*targets[0].name, "b", "the longest prefix first");
    let bs = d.analysis.block_tokens;
    let first = d.send(0, &targets[0]).expect("admitted");
    assert_eq!(first.known.held, 4 * bs);
    assert_eq!(first.known.elsewhere, Some((2 * bs, Lost::Load)));
    assert_eq!(first.known.prompt_tokens, Some(d.analysis.prompt_tokens));
    let retry = d.send(1, &targets[1]).expect("admitted");
    assert_eq!(retry.known.held, 2 * bs);
    assert_eq!(retry.known.elsewhere, Some((4 * bs, Lost::Retry)));
    d.forget();
}
