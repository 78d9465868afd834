//! The `EndpointDiscovery.WatchPool` server: each subscriber gets its pool's
//! current [`PoolState`] at once, then every newer state the [`Index`]
//! publishes.
//!
//! States come from the pool's `tokio::sync::watch` channel, so a slow
//! subscriber skips intermediate states and always gets the latest (each
//! state is full, never a delta). A subscriber may ask for a pool that does
//! not exist yet: it gets `pool_exists = false`, then the pool when it
//! appears.
//!
//! A call made before the operator's initial lists are in waits for them
//! ([`Discovery::with_ready`]): a partial index would tell routers that pools
//! are empty.
//!
//! `ReportWarmups` hands a router's warm-ups to the index, for the
//! policy's `status.warmup`, with the address the call came from: a report
//! over [`MAX_REPORTED`] entries or with an over-long name is refused whole
//! (`INVALID_ARGUMENT`), and so is one that is not from a router the
//! pool's state names, at its pod's IP (`PERMISSION_DENIED`; the rule is
//! the index's), each counted in
//! `kvroute_operator_warmup_reports_refused_total{reason}`. What names no
//! prefix or endpoint of the pool is dropped, a time ahead of the
//! operator's clock is taken as now.
//!
//! Not here: computing states (the index), TLS (with a client CA the
//! handshake already demands a certificate it signed; routers share one,
//! so it says which clients may call, not which router calls), metrics
//! beyond the refused reports and the subscriber gauge
//! ([`Discovery::subscribers`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::{Stream, StreamExt};
use kvroute_proto::v1::endpoint_discovery_server::{EndpointDiscovery, EndpointDiscoveryServer};
use kvroute_proto::v1::{PoolState, WarmupReport, WarmupReportReply, WatchPoolRequest};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::{TcpListenerStream, WatchStream};
use tonic::transport::ServerTlsConfig;
use tonic::{Request, Response, Status};

use crate::index::Index;
use crate::metrics::Metrics;

/// Most entries one `ReportWarmups` may carry: every prefix a policy may
/// name (64) to 64 owners.
pub const MAX_REPORTED: usize = 64 * 64;
/// Longest name (router, prefix, endpoint) a report may carry.
const MAX_NAME_BYTES: usize = 256;

/// The stream of states one `WatchPool` call returns.
pub type PoolStates = Pin<Box<dyn Stream<Item = Result<PoolState, Status>> + Send>>;

/// Serving the WatchPool server failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The gRPC transport failed (accepting or serving connections).
    #[error("the WatchPool server failed")]
    Transport(#[source] tonic::transport::Error),
    /// The TLS certificate, key or client CA is invalid.
    #[error("the WatchPool TLS files are invalid")]
    Tls(#[source] tonic::transport::Error),
}

/// The `EndpointDiscovery` service over a shared [`Index`]. Cheap to clone:
/// clones share the index, the subscriber gauge and the shutdown signal.
#[derive(Debug, Clone)]
pub struct Discovery {
    index: Arc<Mutex<Index>>,
    subscribers: Arc<AtomicUsize>,
    /// Set to true to end every open stream, so a graceful shutdown does
    /// not wait forever on subscribers.
    stop: Arc<watch::Sender<bool>>,
    /// True once the index has its initial lists.
    ready: watch::Receiver<bool>,
    /// Where refused warm-up reports are counted.
    metrics: Arc<Metrics>,
}

impl Discovery {
    /// A service streaming the states of `index`.
    pub fn new(index: Arc<Mutex<Index>>) -> Self {
        Discovery {
            index,
            subscribers: Arc::default(),
            stop: Arc::new(watch::Sender::new(false)),
            ready: watch::channel(true).1,
            metrics: Arc::default(),
        }
    }

    /// Counts refused warm-up reports in `metrics` (the operator's own).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Makes calls wait until `ready` is true before their first state.
    pub fn with_ready(mut self, ready: watch::Receiver<bool>) -> Self {
        self.ready = ready;
        self
    }

    /// How many `WatchPool` streams are open.
    pub fn subscribers(&self) -> usize {
        self.subscribers.load(Ordering::Relaxed)
    }

    /// Ends every open stream and every stream opened from now on.
    pub fn stop_streams(&self) {
        self.stop.send_replace(true);
    }

    /// Serves `EndpointDiscovery` on `listener` (over `tls` when given)
    /// until `shutdown` completes, then ends every stream and waits for
    /// connections to close.
    pub async fn serve(
        self,
        listener: TcpListener,
        tls: Option<ServerTlsConfig>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let stopper = self.clone();
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            server = server.tls_config(tls).map_err(ServeError::Tls)?;
        }
        server
            .add_service(EndpointDiscoveryServer::new(self))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
                shutdown.await;
                stopper.stop_streams();
            })
            .await
            .map_err(ServeError::Transport)
    }
}

/// Serves `EndpointDiscovery` for `index` on `listener` until `shutdown`
/// completes. Use [`Discovery::serve`] to keep a handle on the subscriber
/// gauge.
pub async fn serve(
    index: Arc<Mutex<Index>>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    Discovery::new(index).serve(listener, None, shutdown).await
}

#[tonic::async_trait]
impl EndpointDiscovery for Discovery {
    type WatchPoolStream = PoolStates;

    async fn watch_pool(
        &self,
        request: Request<WatchPoolRequest>,
    ) -> Result<Response<PoolStates>, Status> {
        let WatchPoolRequest {
            namespace,
            pool,
            subscriber,
        } = request.into_inner();
        if namespace.is_empty() || pool.is_empty() {
            return Err(Status::invalid_argument(
                "WatchPool needs a namespace and a pool name",
            ));
        }
        let mut ready = self.ready.clone();
        let mut stop = self.stop.subscribe();
        let listed = tokio::select! {
            listed = ready.wait_for(|r| *r) => listed.is_ok(),
            _ = stop.wait_for(|s| *s) => false,
        };
        if !listed {
            return Err(Status::unavailable("the operator is shutting down"));
        }
        // The index stays consistent across a panic elsewhere (each call
        // publishes whole states), so a poisoned lock is still usable.
        let states = self
            .index
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .watch_pool(&namespace, &pool);
        let guard = Subscription::start(self.subscribers.clone(), namespace, pool, subscriber);
        // `WatchStream::new` yields the current state first, then each change.
        let stream = WatchStream::new(states)
            .map(move |state| {
                // The stream owns the guard: dropping the stream (the client
                // went away, or the server stopped) ends the subscription.
                let _ = &guard;
                Ok(state)
            })
            .take_until(async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_warmups(
        &self,
        request: Request<WarmupReport>,
    ) -> Result<Response<WarmupReportReply>, Status> {
        let peer = request.remote_addr().map(|a| a.ip());
        let report = request.into_inner();
        let too_large = |message: String| {
            self.metrics.warmup_report_refused("too_large");
            Err(Status::invalid_argument(message))
        };
        if report.sent.len() > MAX_REPORTED {
            return too_large(format!(
                "a warm-up report holds at most {MAX_REPORTED} entries, not {}",
                report.sent.len()
            ));
        }
        let long = |s: &str| s.len() > MAX_NAME_BYTES;
        if long(&report.router)
            || (report.sent.iter()).any(|s| long(&s.prefix) || long(&s.endpoint))
        {
            return too_large(format!(
                "warm-up report names are at most {MAX_NAME_BYTES} bytes"
            ));
        }
        // A router's clock ahead of ours must not pin a send in the future.
        let now_ms = crate::index::wall_clock_micros() / 1000;
        let sent = (report.sent.into_iter())
            .map(|s| (s.prefix, s.endpoint, s.unix_ms.min(now_ms)))
            .collect();
        let taken = self
            .index
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record_warmups(&report.namespace, &report.pool, &report.router, peer, sent);
        match taken {
            Ok(taken) => {
                tracing::debug!(namespace = %report.namespace, pool = %report.pool,
                    router = %report.router, taken, "warm-up report");
                Ok(Response::new(WarmupReportReply {}))
            }
            Err(refused) => {
                // Counted, not logged at info: a flood must not flood the log.
                self.metrics.warmup_report_refused(refused.reason());
                tracing::debug!(namespace = %report.namespace, pool = %report.pool,
                    router = %report.router, ?peer, %refused, "warm-up report refused");
                Err(Status::permission_denied(format!(
                    "warm-up report from {:?} for {}/{}: {refused}",
                    report.router, report.namespace, report.pool
                )))
            }
        }
    }
}

/// One open stream: counted in the gauge and logged while it lives.
struct Subscription {
    subscribers: Arc<AtomicUsize>,
    namespace: String,
    pool: String,
    subscriber: String,
}

impl Subscription {
    fn start(
        subscribers: Arc<AtomicUsize>,
        namespace: String,
        pool: String,
        subscriber: String,
    ) -> Self {
        let open = subscribers.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(%namespace, %pool, %subscriber, open, "WatchPool subscriber joined");
        Subscription {
            subscribers,
            namespace,
            pool,
            subscriber,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let open = self.subscribers.fetch_sub(1, Ordering::Relaxed) - 1;
        tracing::info!(namespace = %self.namespace, pool = %self.pool,
            subscriber = %self.subscriber, open, "WatchPool subscriber left");
    }
}
