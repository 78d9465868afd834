//! Serving one accepted connection: the TLS handshake within the
//! header-read timeout, hyper's HTTP/1 and HTTP/2 with the listener's
//! limits, and a graceful close when it was idle too long, the server
//! stops or a new connection needs its place.
//!
//! Not here: admitting the connection (`open`), or which thread serves it
//! (`threads`).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use super::limits::ConnLimits;
use super::open::Slot;
use super::refused;
use crate::metrics::Metrics;

/// What serving one accepted connection needs.
pub(super) struct Opener {
    builder: auto::Builder<TokioExecutor>,
    pub(super) app: Router,
    tls: Option<TlsAcceptor>,
    idle: Duration,
    handshake: Duration,
    stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    pub(super) name: &'static str,
}

impl Opener {
    pub(super) fn new(
        app: Router,
        limits: &ConnLimits,
        stopped: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
        name: &'static str,
    ) -> Self {
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
        Opener {
            builder,
            app,
            tls: limits.tls.clone().map(TlsAcceptor::from),
            idle: limits.idle_timeout,
            handshake: limits.header_read_timeout,
            stopped,
            metrics,
            name,
        }
    }

    /// Serves `tcp` (after the TLS handshake, with TLS) until it closes
    /// or is evicted; `slot` is held until then.
    pub(super) async fn open(self: Arc<Self>, tcp: TcpStream, slot: Slot) {
        let this = slot.connection.clone();
        let serve = async {
            let (app, stopped) = (self.app.clone(), self.stopped.clone());
            let activity = this.activity.clone();
            match &self.tls {
                None => connection(&self.builder, tcp, app, activity, self.idle, stopped).await,
                Some(tls) => match tokio::time::timeout(self.handshake, tls.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        connection(&self.builder, stream, app, activity, self.idle, stopped).await
                    }
                    failed => {
                        let reason = if failed.is_err() {
                            "tls_timeout"
                        } else {
                            "tls_handshake"
                        };
                        tracing::debug!(listener = self.name, reason, "TLS handshake failed");
                        refused(&self.metrics, self.name, reason);
                    }
                },
            }
        };
        tokio::select! {
            () = serve => {}
            () = this.evict.notified() => {
                tracing::debug!(listener = self.name, "closed an idle connection for a new one");
            }
        }
        drop(slot);
    }
}

/// One connection, closed gracefully when idle for `idle` or when the
/// server stops.
async fn connection(
    builder: &auto::Builder<TokioExecutor>,
    io: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    app: Router,
    activity: Arc<Activity>,
    idle: Duration,
    mut stopped: watch::Receiver<bool>,
) {
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

/// Requests in progress on one connection, and when the last one ended.
///
/// Polled by one timer per idle period, not told of each request: a
/// notification and a new timer per request cost a proxy of small requests
/// a few percent of its CPU.
#[derive(Debug)]
pub(super) struct Activity {
    since: Instant,
    pub(super) active: AtomicUsize,
    /// When the last request ended, in ms after `since`.
    ended_ms: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            since: Instant::now(),
            active: AtomicUsize::new(0),
            ended_ms: AtomicU64::new(0),
        }
    }

    /// Resolves once no request has been in progress for `idle`.
    async fn idle_for(&self, idle: Duration) {
        let mut deadline = Instant::now() + idle;
        loop {
            tokio::time::sleep_until(deadline).await;
            let now = Instant::now();
            deadline = if self.active.load(Ordering::SeqCst) > 0 {
                now + idle
            } else {
                let ended =
                    self.since + Duration::from_millis(self.ended_ms.load(Ordering::SeqCst));
                if ended + idle <= now {
                    return;
                }
                ended + idle
            };
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
        Active(activity)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        let a = &self.0;
        let ms = u64::try_from(a.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        a.ended_ms.fetch_max(ms, Ordering::SeqCst);
        a.active.fetch_sub(1, Ordering::SeqCst);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_once_its_last_request_ended() {
        let idle = Duration::from_secs(10);
        let start = Instant::now();
        let activity = Arc::new(Activity::new());
        let idled = tokio::spawn({
            let a = activity.clone();
            async move {
                a.idle_for(idle).await;
                Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        // Two requests, the second in progress longer than `idle`.
        let first = Active::new(activity.clone());
        let second = Active::new(activity.clone());
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(first);
        tokio::time::sleep(Duration::from_secs(17)).await;
        assert!(!idled.is_finished(), "a request is still in progress");
        drop(second);
        assert_eq!(idled.await.unwrap() - start, Duration::from_secs(35));
        // A connection that never had a request is idle after `idle`.
        let start = Instant::now();
        Arc::new(Activity::new()).idle_for(idle).await;
        assert_eq!(Instant::now() - start, idle);
    }
}
