//! Engine probes: the operator learns how each serving engine hashes its
//! cache by reading the first message of its WatchCache stream (connect,
//! read the snapshot's config, close) and records it in the [`Index`],
//! whose policy status then says whether the engines agree with the policy
//! (`EnginesConsistent`).
//!
//! A pod is probed when it starts serving in a pool whose policy names a
//! WatchCache port, and again after it stopped and came back; a failed
//! probe is retried every [`RETRY`]. At most [`CONCURRENCY`] probes run at
//! once, each within [`TIMEOUT`].
//!
//! Over TLS (and mTLS) when the operator is given the engines' CA
//! (`--engine-tls-*`), as routers dial them with `grpcTls`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvroute_core::contract::EngineCache;
use kvroute_proto::v1::cache_reporter_client::CacheReporterClient;
use kvroute_proto::v1::{WatchCacheRequest, cache_update::Update};
use tonic::transport::ClientTlsConfig;

use crate::index::{EngineTarget, Index};

/// How the operator names itself to engines.
const SUBSCRIBER: &str = "kvroute-operator";
/// One probe, connection included.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// A failed probe is tried again after this long.
pub const RETRY: Duration = Duration::from_secs(30);
/// Probes at once.
pub const CONCURRENCY: usize = 16;
/// Largest message read: the snapshot carries every resident block.
const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Probes engines as the index's pools and pods change, until aborted;
/// over TLS when `tls` is given.
pub async fn run(index: Arc<Mutex<Index>>, tls: Option<ClientTlsConfig>) {
    let mut changes = index
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .changes();
    // What was probed, and when a probe last failed.
    let mut probed: HashMap<EngineTarget, Option<Instant>> = HashMap::new();
    loop {
        let targets = index
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .engine_targets();
        probed.retain(|t, _| targets.contains(t));
        let due: Vec<EngineTarget> = targets
            .into_iter()
            .filter(|t| match probed.get(t) {
                None => true,
                Some(failed) => failed.is_some_and(|at| at.elapsed() >= RETRY),
            })
            .collect();
        let results: Vec<_> = futures_util::stream::iter(due)
            .map(|t| {
                let tls = tls.clone();
                async move {
                    let result = probe(&t, tls).await;
                    (t, result)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (target, result) in results {
            match result {
                Ok(engine) => {
                    index
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .set_engine(&target.namespace, &target.pod, engine);
                    probed.insert(target, None);
                }
                Err(error) => {
                    tracing::warn!(namespace = %target.namespace, pod = %target.pod,
                        addr = %target.addr, %error, retry_in = ?RETRY,
                        "cannot read the engine's cache settings");
                    probed.insert(target, Some(Instant::now()));
                }
            }
        }
        // The next change, or the next retry.
        let _ = tokio::time::timeout(RETRY, changes.changed()).await;
    }
}

/// Reads the cache settings from the first message of `target`'s
/// WatchCache stream, over TLS when `tls` is given.
pub async fn probe(
    target: &EngineTarget,
    tls: Option<ClientTlsConfig>,
) -> Result<EngineCache, String> {
    let read = async {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint =
            tonic::transport::Endpoint::from_shared(format!("{scheme}://{}", target.addr))
                .map_err(|e| e.to_string())?;
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
        }
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let mut client =
            CacheReporterClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let request = WatchCacheRequest {
            subscriber: SUBSCRIBER.into(),
        };
        let mut stream = client
            .watch_cache(request)
            .await
            .map_err(|s| format!("WatchCache: {}", s.message()))?
            .into_inner();
        let first = stream
            .message()
            .await
            .map_err(|s| format!("WatchCache: {}", s.message()))?
            .ok_or("the stream ended before its snapshot")?;
        match first.update {
            Some(Update::Snapshot(s)) => s
                .config
                .as_ref()
                .map(EngineCache::from)
                .ok_or_else(|| "the snapshot has no cache config".to_owned()),
            _ => Err("the first message is not a snapshot".to_owned()),
        }
    };
    tokio::time::timeout(TIMEOUT, read)
        .await
        .map_err(|_| format!("no snapshot within {TIMEOUT:?}"))?
}
