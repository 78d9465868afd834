//! WatchCache subscriptions: one task per engine that reports its cache,
//! mirroring the engine's resident blocks and load into the [`Pool`].
//!
//! The task subscribes to `CacheReporter.WatchCache`, checks every update
//! with [`SequenceCheck`] and applies it to the pool under its
//! `(name, generation)`, so a replaced endpoint's old watcher cannot touch
//! the new one's entries. Whenever the stream breaks (connect failure,
//! stream error or end, a sequence gap, a new incarnation, an update the
//! index refuses) the endpoint's entries are dropped at once and the task
//! resubscribes after a jittered exponential [`Backoff`] for a fresh
//! snapshot.
//!
//! Discovery owns the tasks ([`Watchers`]) and starts and stops them as the
//! pool says when the endpoint set or the settings change ([`Streams`]).
//!
//! Not here: deciding which engines to watch (the pool does), and judging the
//! engine's cache configuration (the pool checks it, see
//! [`kvroute_core::contract`]): a snapshot's blocks are applied through
//! [`Pool::apply_snapshot`] with it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvroute_core::index::{CacheEvent, IndexError};
use kvroute_core::load::EngineLoad;
use kvroute_proto::v1::cache_reporter_client::CacheReporterClient;
use kvroute_proto::v1::{CacheUpdate, LoadReport, WatchCacheRequest, cache_update::Update};
use kvroute_proto::{ResyncReason, SequenceCheck, Verdict};
use tokio::task::JoinHandle;
use tonic::transport::ClientTlsConfig;

use crate::pool::{Pool, Stream, StreamState, Streams};
use crate::reconnect::{BACKOFF_RESET_AFTER, Backoff, error_chain};

/// How the router names itself to engines.
const SUBSCRIBER: &str = "kvroute-router";
/// Connecting to an engine's WatchCache server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest message accepted: a snapshot costs 8 bytes per block, so this
/// covers caches of up to about 32 million blocks.
const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// HTTP/2 pings, so an engine that vanished without closing its
/// connection is noticed.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The watcher tasks of one pool, owned by its discovery: it applies the
/// [`Streams`] each pool change returns. Dropping it stops every watcher.
#[derive(Debug)]
pub struct Watchers {
    tls: Option<ClientTlsConfig>,
    tasks: HashMap<String, JoinHandle<()>>,
}

impl Watchers {
    /// No watchers yet; they will dial over TLS when `tls` is given.
    pub fn new(tls: Option<ClientTlsConfig>) -> Self {
        Watchers {
            tls,
            tasks: HashMap::new(),
        }
    }

    /// Stops and starts watchers as `streams` says. Each watches its
    /// member's server until stopped, replaced, or the pool is dropped.
    pub fn apply(&mut self, pool: &Arc<Pool>, streams: Streams) {
        for name in streams.stop {
            if let Some(task) = self.tasks.remove(&name) {
                task.abort();
            }
        }
        for Stream {
            name,
            generation,
            addr,
        } in streams.start
        {
            // A weak reference, so a dropped pool ends its watchers.
            let (pool, tls) = (Arc::downgrade(pool), self.tls.clone());
            let task = tokio::spawn(run(pool, name.clone(), generation, addr, tls));
            if let Some(old) = self.tasks.insert(name, task) {
                old.abort();
            }
        }
    }
}

impl Drop for Watchers {
    fn drop(&mut self) {
        for task in self.tasks.values() {
            task.abort();
        }
    }
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
enum Broken {
    #[error("connecting: {0}")]
    Connect(String),
    #[error("WatchCache failed: {0}")]
    Status(#[source] tonic::Status),
    #[error("the engine ended the stream")]
    Ended,
    #[error("resync: {0}")]
    Resync(ResyncReason),
    #[error("snapshot without a cache config")]
    NoConfig,
    #[error("the index refused an update: {0}")]
    Index(#[source] IndexError),
    #[error("the pool is gone")]
    PoolGone,
}

async fn run(
    pool: Weak<Pool>,
    name: String,
    generation: u64,
    addr: SocketAddr,
    tls: Option<ClientTlsConfig>,
) {
    let mut backoff = Backoff::new(&name);
    loop {
        let mut live_since = None;
        let broken = match pool.upgrade() {
            Some(p) => {
                p.set_stream(&name, generation, StreamState::Connecting);
                drop(p);
                let w = Watcher {
                    pool: &pool,
                    name: &name,
                    generation,
                };
                w.watch(addr, tls.as_ref(), &mut live_since).await
            }
            None => Broken::PoolGone,
        };
        let Some(p) = pool.upgrade() else { return };
        p.set_stream(&name, generation, StreamState::Connecting);
        drop(p);
        if live_since.is_some_and(|t: Instant| t.elapsed() >= BACKOFF_RESET_AFTER) {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        tracing::warn!(
            endpoint = %name, %addr, reason = %broken, retry_in = ?delay,
            "WatchCache stream lost; the endpoint's cache entries are dropped until it resyncs"
        );
        tokio::time::sleep(delay).await;
    }
}

/// One subscription of one pool member.
struct Watcher<'a> {
    pool: &'a Weak<Pool>,
    name: &'a str,
    generation: u64,
}

impl Watcher<'_> {
    /// Subscribes and applies updates until the stream breaks; sets
    /// `live_since` when the first snapshot is applied.
    async fn watch(
        &self,
        addr: SocketAddr,
        tls: Option<&ClientTlsConfig>,
        live_since: &mut Option<Instant>,
    ) -> Broken {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))
            .expect("a socket address makes a valid URI")
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT);
        if let Some(tls) = tls {
            endpoint = match endpoint.tls_config(tls.clone()) {
                Ok(e) => e,
                Err(e) => return Broken::Connect(error_chain(&e)),
            };
        }
        let channel = match endpoint.connect().await {
            Ok(c) => c,
            Err(e) => return Broken::Connect(error_chain(&e)),
        };
        let mut client =
            CacheReporterClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let request = WatchCacheRequest {
            subscriber: SUBSCRIBER.into(),
        };
        let mut stream = match client.watch_cache(request).await {
            Ok(r) => r.into_inner(),
            Err(s) => return Broken::Status(s),
        };
        let mut check = SequenceCheck::new();
        loop {
            let update = match stream.message().await {
                Ok(Some(u)) => u,
                Ok(None) => return Broken::Ended,
                Err(s) => return Broken::Status(s),
            };
            if let Verdict::Resync(reason) = check.observe(&update) {
                return Broken::Resync(reason);
            }
            if let Err(b) = self.apply(update, live_since) {
                return b;
            }
        }
    }

    /// Applies one checked update.
    fn apply(&self, update: CacheUpdate, live_since: &mut Option<Instant>) -> Result<(), Broken> {
        let pool = self.pool.upgrade().ok_or(Broken::PoolGone)?;
        let (name, generation) = (self.name, self.generation);
        let event = match &update.update {
            Some(Update::Snapshot(s)) => {
                let config = s.config.as_ref().ok_or(Broken::NoConfig)?;
                tracing::debug!(
                    endpoint = %name,
                    incarnation = %update.incarnation,
                    sequence = update.sequence,
                    blocks = s.block_hashes.len(),
                    ?config,
                    "WatchCache snapshot"
                );
                let offloaded: Vec<&[u64]> =
                    s.offloaded.iter().map(|m| &m.block_hashes[..]).collect();
                pool.apply_snapshot(
                    name,
                    generation,
                    config.into(),
                    config.capacity_blocks as usize,
                    &s.block_hashes,
                    &offloaded,
                )
                .map_err(Broken::Index)?;
                if let Some(load) = &s.load {
                    pool.report_load(name, generation, engine_load(load));
                }
                pool.set_stream(name, generation, StreamState::Live);
                live_since.get_or_insert_with(Instant::now);
                return Ok(());
            }
            // An empty medium is the GPU cache; every other medium is one
            // offloaded tier (a medium's clear drops that whole tier).
            Some(Update::Stored(s)) if s.medium.is_empty() => CacheEvent::Stored(&s.block_hashes),
            Some(Update::Stored(s)) => CacheEvent::Offloaded(&s.block_hashes),
            Some(Update::Removed(r)) if r.medium.is_empty() => CacheEvent::Removed(&r.block_hashes),
            Some(Update::Removed(r)) => CacheEvent::OffloadRemoved(&r.block_hashes),
            Some(Update::Cleared(c)) => match c.medium.as_deref() {
                None => CacheEvent::Cleared,
                Some("") => CacheEvent::GpuCleared,
                Some(_) => CacheEvent::OffloadCleared,
            },
            Some(Update::Load(load)) => {
                pool.report_load(name, generation, engine_load(load));
                return Ok(());
            }
            // SequenceCheck turns an empty update into a resync.
            None => return Err(Broken::Resync(ResyncReason::EmptyUpdate)),
        };
        pool.apply_cache(name, generation, event)
            .map_err(Broken::Index)
    }
}

/// `load` as the pool keeps it, received now (the pool's clock, tokio's,
/// paused in tests, ages it).
fn engine_load(load: &LoadReport) -> EngineLoad {
    kvroute_proto::load::engine_load(load, tokio::time::Instant::now().into_std())
}
