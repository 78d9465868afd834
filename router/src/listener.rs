//! Serving a listener with limits: at most `maxConnections` connections
//! (more are closed as soon as they are accepted, and counted), a timer for
//! hyper so the header-read timeout works, an idle timeout for connections
//! with no request in progress, and HTTP/2 stream and reset limits. On stop
//! it stops accepting, lets every connection finish its requests, and
//! returns when the last one closed.
//!
//! With a TLS configuration every connection is a TLS one; its handshake
//! must finish within the header-read timeout. Not here: the body-read
//! timeout (the proxy reads bodies).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::config::Limits;
use crate::metrics::{ListenerReason, Metrics};

/// File descriptors kept free for upstream connections, WatchCache streams,
/// files and the admin port when fitting `maxConnections` to the process
/// limit.
const FD_RESERVE: u64 = 1024;

/// Connection limits of one listener.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// See `limits.headerReadTimeoutMs`.
    pub header_read_timeout: Duration,
    /// See `limits.idleTimeoutMs`.
    pub idle_timeout: Duration,
    /// See `limits.http2MaxConcurrentStreams`.
    pub h2_max_concurrent_streams: u32,
    /// See `limits.http2MaxPendingAcceptResetStreams`.
    pub h2_max_pending_accept_reset_streams: usize,
    /// See `limits.http2MaxLocalErrorResetStreams`.
    pub h2_max_local_error_reset_streams: usize,
    /// TLS for every connection; `None`: plaintext.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl ConnLimits {
    /// The API listener's limits: `maxConnections` lowered to fit the
    /// process's open-file limit, leaving room for an upstream connection
    /// per client connection and a reserve.
    pub fn api(limits: &Limits) -> Self {
        let mut max = limits.max_connections;
        // Two descriptors per connection: its own and an upstream one.
        if let Some(nofile) = open_file_limit() {
            let fits = (nofile.saturating_sub(FD_RESERVE) / 2).max(1) as usize;
            if fits < max {
                tracing::warn!(
                    configured = max,
                    open_file_limit = nofile,
                    using = fits,
                    "limits.maxConnections lowered to fit the open-file limit (raise `ulimit -n` for more)"
                );
                max = fits;
            }
        }
        Self::with_max(limits, max)
    }

    /// The admin listener's: the API's timeouts and a small connection cap
    /// of its own, so neither port can starve the other.
    pub fn admin(limits: &Limits) -> Self {
        Self::with_max(limits, 64)
    }

    fn with_max(limits: &Limits, max_connections: usize) -> Self {
        ConnLimits {
            max_connections,
            header_read_timeout: Duration::from_millis(limits.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(limits.idle_timeout_ms),
            h2_max_concurrent_streams: limits.http2_max_concurrent_streams,
            h2_max_pending_accept_reset_streams: limits.http2_max_pending_accept_reset_streams,
            h2_max_local_error_reset_streams: limits.http2_max_local_error_reset_streams,
            tls: None,
        }
    }
}

/// The soft `RLIMIT_NOFILE`, read from `/proc/self/limits` (Linux); `None`
/// elsewhere or when unlimited.
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Serves `app` on `listener` until `stopped` turns true, then waits for
/// open connections to finish. `name` labels the metrics (`api`, `admin`).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    name: &'static str,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.h2_max_concurrent_streams)
        .max_pending_accept_reset_streams(limits.h2_max_pending_accept_reset_streams)
        .max_local_error_reset_streams(limits.h2_max_local_error_reset_streams);
    let builder = Arc::new(builder);
    let tls = limits.tls.clone().map(TlsAcceptor::from);
    let max = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let slots = Arc::new(Semaphore::new(max as usize));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.wait_for(|s| *s) => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of descriptors, most likely: back off instead of
                // spinning; the connections that hold them time out.
                tracing::warn!(listener = name, error = %e, "accept failed");
                refused(&metrics, name, "accept_error");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refused(&metrics, name, "max_connections");
            drop(tcp);
            continue;
        };
        // Small SSE chunks must not wait for delayed ACKs.
        let _ = tcp.set_nodelay(true);
        let builder = builder.clone();
        let app = app.clone();
        let stopped = stopped.clone();
        let idle = limits.idle_timeout;
        let handshake = limits.header_read_timeout;
        let tls = tls.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            match tls {
                None => connection(&builder, tcp, app, idle, stopped).await,
                Some(tls) => match tokio::time::timeout(handshake, tls.accept(tcp)).await {
                    Ok(Ok(stream)) => connection(&builder, stream, app, idle, stopped).await,
                    failed => {
                        let reason = if failed.is_err() {
                            "tls_timeout"
                        } else {
                            "tls_handshake"
                        };
                        tracing::debug!(listener = name, reason, "TLS handshake failed");
                        refused(&metrics, name, reason);
                    }
                },
            }
            drop(slot);
        });
    }
    // Every connection holds a slot until it closes.
    let _ = slots.acquire_many(max).await;
}

fn refused(metrics: &Metrics, listener: &'static str, reason: &'static str) {
    metrics
        .connections_refused
        .get_or_create(&ListenerReason { listener, reason })
        .inc();
}

/// One connection, closed gracefully when idle for `idle` or when the
/// server stops.
async fn connection(
    builder: &auto::Builder<TokioExecutor>,
    io: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    app: Router,
    idle: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::default());
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |request: Request<Incoming>| {
            let app = app.clone();
            let active = Active::new(activity.clone());
            async move {
                let response = app
                    .oneshot(request.map(Body::new))
                    .await
                    .unwrap_or_else(|e: Infallible| match e {});
                Ok::<_, Infallible>(response.map(|body| {
                    Body::new(Tracked {
                        body,
                        _active: active,
                    })
                }))
            }
        })
    };
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            return;
        }
        _ = activity.idle_for(idle) => tracing::debug!("closing an idle connection"),
        _ = stopped.wait_for(|s| *s) => {}
    }
    conn.as_mut().graceful_shutdown();
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// Requests in progress on one connection.
#[derive(Debug, Default)]
struct Activity {
    active: AtomicUsize,
    changed: Notify,
}

impl Activity {
    /// Resolves once no request has been in progress for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.active.load(Ordering::SeqCst) == 0 {
                tokio::select! {
                    _ = tokio::time::sleep(idle) => return,
                    _ = changed => {}
                }
            } else {
                changed.await;
            }
        }
    }
}

/// A request in progress, from its headers until its response body is
/// done or dropped.
#[derive(Debug)]
struct Active(Arc<Activity>);

impl Active {
    fn new(activity: Arc<Activity>) -> Self {
        activity.active.fetch_add(1, Ordering::SeqCst);
        activity.changed.notify_waiters();
        Active(activity)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// A response body that keeps its request [`Active`] until it ends.
struct Tracked {
    body: Body,
    _active: Active,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
