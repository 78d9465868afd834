//! Serving a listener with limits: at most `max_connections` connections,
//! a timer for hyper so the header-read timeout works, an idle timeout for
//! connections with no request in progress, and HTTP/2 stream and reset
//! limits. At the cap, a new connection closes the oldest one with no
//! request in progress (idle, or still sending its first headers), so idle
//! sockets cannot lock out a health probe; when every connection has a
//! request in progress, the new one is closed at once. Both are counted.
//! On stop it stops accepting, lets every connection finish its requests,
//! and returns when the last one closed.
//!
//! Every listener's cap fits the process's open-file limit
//! ([`fit_to_open_files`]), which the process raises to its hard limit at
//! start ([`raise_open_file_limit`]): no listener can take the descriptors
//! another one needs.
//!
//! The API port's connections are dealt to threads of their own, each
//! with a single-threaded runtime ([`serve_on_threads`]); the admin port's
//! are served on the main runtime.
//!
//! With a TLS configuration every connection is a TLS one; its handshake
//! must finish within the header-read timeout. Not here: the body-read
//! timeout (the proxy reads bodies).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::config::{ExtProc, Limits};
use crate::metrics::{ListenerReason, Metrics};

/// The admin port's connection cap: probes and scrapes need few, and idle
/// ones make room for new ones.
pub const ADMIN_MAX_CONNECTIONS: usize = 128;
/// The admin port's time to receive a request's headers.
pub const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The admin port's idle timeout.
pub const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// Threads for [`serve_on_threads`] (`limits.apiThreads` resolved).
    pub threads: usize,
}

impl ConnLimits {
    /// The API listener's limits with `max_connections` (see
    /// [`fit_to_open_files`]).
    pub fn api(limits: &Limits, max_connections: usize) -> Self {
        Self::with_max(limits, max_connections)
    }

    /// The endpoint picker's: its own cap and idle timeout, the API's
    /// HTTP/2 limits.
    pub fn picker(limits: &Limits, picker: &ExtProc, max_connections: usize) -> Self {
        ConnLimits {
            idle_timeout: Duration::from_millis(picker.idle_timeout_ms),
            ..Self::with_max(limits, max_connections)
        }
    }

    /// The admin listener's: a small cap of its own and short timeouts, so
    /// neither port can starve the other.
    pub fn admin(limits: &Limits) -> Self {
        ConnLimits {
            header_read_timeout: ADMIN_HEADER_READ_TIMEOUT,
            idle_timeout: ADMIN_IDLE_TIMEOUT,
            ..Self::with_max(limits, ADMIN_MAX_CONNECTIONS)
        }
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
            threads: limits.api_threads(),
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, logging what it
/// did; a failure leaves the limit as it was.
pub fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current >= limit.maximum {
        return;
    }
    let from = limit.current;
    limit.current = limit.maximum;
    match setrlimit(Resource::Nofile, limit) {
        Ok(()) => tracing::debug!(from = ?from, to = ?limit.current, "raised the open-file limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
    }
}

/// The soft `RLIMIT_NOFILE`; `None` when unlimited.
fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Connection caps that fit the open-file limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The API port's (two descriptors a connection: its own and one
    /// upstream).
    pub api: usize,
    /// The endpoint picker's (one a connection).
    pub picker: usize,
}

/// Fits the configured caps (0 for a listener not served) to the process's
/// open-file limit (see [`fit_caps`]), warning when it lowered them.
pub fn fit_to_open_files(api: usize, picker: usize) -> Caps {
    let wanted = Caps { api, picker };
    let Some(nofile) = open_file_limit() else {
        return wanted;
    };
    let caps = fit_caps(wanted, nofile);
    if caps != wanted {
        tracing::warn!(
            open_file_limit = nofile,
            api = caps.api,
            picker = caps.picker,
            "limits.maxConnections and extProc.maxConnections lowered to fit the open-file limit (raise the hard `ulimit -n` for more)"
        );
    }
    caps
}

/// The caps within `nofile` descriptors: a reserve (an eighth, at most
/// 1024) for upstream pools, WatchCache streams, files and logs, then
/// [`ADMIN_MAX_CONNECTIONS`], and what is left shared by the API and the
/// picker in proportion to what each wants (each keeps at least one).
pub fn fit_caps(wanted: Caps, nofile: u64) -> Caps {
    let reserve = (nofile / 8).min(1024) + ADMIN_MAX_CONNECTIONS as u64;
    let left = nofile.saturating_sub(reserve);
    let need = 2 * wanted.api as u64 + wanted.picker as u64;
    if need <= left {
        return wanted;
    }
    let scale = |n: usize| {
        let fitted = (n as u128 * left as u128 / need as u128) as usize;
        if n == 0 { 0 } else { fitted.max(1) }
    };
    Caps {
        api: scale(wanted.api),
        picker: scale(wanted.picker),
    }
}

/// Serves `app` on `listener` until `stopped` turns true, then waits for
/// open connections to finish. `name` labels the metrics (`api`, `admin`,
/// `picker`). Connections are served on the caller's runtime.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    name: &'static str,
) {
    let opener = Arc::new(Opener::new(
        app,
        &limits,
        stopped.clone(),
        metrics.clone(),
        name,
    ));
    let open = Arc::new(Connections::new(limits.max_connections));
    accept(listener, &open, stopped, &metrics, name, |tcp, slot| {
        tokio::spawn(opener.clone().open(tcp, slot));
    })
    .await;
    open.all_closed().await;
}

/// As [`serve`], with the connections dealt to `limits.threads` threads
/// of their own, each running a single-threaded runtime: a connection, its
/// requests and their upstream connections then stay on one thread, with
/// no hand-off between threads per request (the multi-threaded runtime
/// spent more time waking its workers than proxying small requests). Each
/// new connection goes to the thread with the fewest open ones.
/// `on_thread(k)` runs first on thread `k`.
pub async fn serve_on_threads(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    name: &'static str,
    on_thread: impl Fn(usize) + Clone + Send + 'static,
) {
    let opener = Arc::new(Opener::new(
        app,
        &limits,
        stopped.clone(),
        metrics.clone(),
        name,
    ));
    let mut workers = Vec::new();
    for k in 0..limits.threads.max(1) {
        match Worker::spawn(k, opener.clone(), on_thread.clone()) {
            Ok(w) => workers.push(w),
            Err(e) if !workers.is_empty() => {
                tracing::warn!(listener = name, error = %e, threads = k, "could not start every API thread; serving on fewer");
                break;
            }
            Err(e) => {
                tracing::error!(listener = name, error = %e, "could not start an API thread; serving on the runtime");
                return serve(listener, opener.app.clone(), limits, stopped, metrics, name).await;
            }
        }
    }
    let open = Arc::new(Connections::new(limits.max_connections));
    accept(listener, &open, stopped, &metrics, name, |tcp, slot| {
        let Some(worker) = workers
            .iter()
            .min_by_key(|w| w.open.load(Ordering::Relaxed))
        else {
            return;
        };
        match tcp.into_std() {
            Ok(tcp) => {
                worker.open.fetch_add(1, Ordering::Relaxed);
                // A worker only stops when its sender is dropped.
                let _ = worker.connections.send((tcp, slot));
            }
            Err(e) => {
                tracing::debug!(listener = name, error = %e, "could not hand a connection over")
            }
        }
    })
    .await;
    // Closing the channels lets each worker finish its connections and end.
    let threads: Vec<_> = workers.into_iter().map(|w| w.thread).collect();
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
}

/// A listener's open connections, oldest first, within its cap.
#[derive(Debug)]
struct Connections {
    max: usize,
    open: Mutex<BTreeMap<u64, Arc<Connection>>>,
    next: AtomicU64,
    /// Notified when a connection leaves `open`.
    closed: Notify,
}

/// One open connection, as its listener sees it.
#[derive(Debug)]
struct Connection {
    activity: Arc<Activity>,
    /// Notified to close it, when a new connection needs its place.
    evict: Notify,
}

/// A connection's place among its listener's [`Connections`], given up
/// when dropped.
#[derive(Debug)]
struct Slot {
    open: Arc<Connections>,
    id: u64,
    connection: Arc<Connection>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.open.open.lock().unwrap_or_else(|e| e.into_inner());
        open.remove(&self.id);
        drop(open);
        self.open.closed.notify_waiters();
    }
}

/// Whether a new connection was admitted, and what it cost.
enum Admitted {
    /// Within the cap.
    Free(Slot),
    /// In the place of the oldest connection with no request in progress,
    /// which is told to close.
    Evicted(Slot),
}

impl Connections {
    fn new(max: usize) -> Self {
        Connections {
            max: max.max(1),
            open: Mutex::default(),
            next: AtomicU64::new(0),
            closed: Notify::new(),
        }
    }

    /// A place for a new connection, or `None` when every open one has a
    /// request in progress.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mut evicted = false;
        if open.len() >= self.max {
            let idle = open
                .iter()
                .find(|(_, c)| c.activity.active.load(Ordering::SeqCst) == 0)
                .map(|(id, _)| *id)?;
            if let Some(old) = open.remove(&idle) {
                old.evict.notify_one();
            }
            evicted = true;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let connection = Arc::new(Connection {
            activity: Arc::new(Activity::new()),
            evict: Notify::new(),
        });
        open.insert(id, connection.clone());
        let slot = Slot {
            open: self.clone(),
            id,
            connection,
        };
        Some(if evicted {
            Admitted::Evicted(slot)
        } else {
            Admitted::Free(slot)
        })
    }

    /// Resolves once every admitted connection has closed (or was told to).
    async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            if self
                .open
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return;
            }
            closed.await;
        }
    }
}

/// Accepts connections until `stopped` turns true, each within the open
/// connections' cap, and hands them to `serve`.
async fn accept(
    listener: TcpListener,
    open: &Arc<Connections>,
    mut stopped: watch::Receiver<bool>,
    metrics: &Metrics,
    name: &'static str,
    mut serve: impl FnMut(TcpStream, Slot),
) {
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
                refused(metrics, name, "accept_error");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match open.admit() {
            Some(Admitted::Free(slot)) => slot,
            Some(Admitted::Evicted(slot)) => {
                metrics
                    .connections_evicted
                    .get_or_create(&crate::metrics::Listener { listener: name })
                    .inc();
                slot
            }
            None => {
                refused(metrics, name, "max_connections");
                continue;
            }
        };
        // Small SSE chunks must not wait for delayed ACKs.
        let _ = tcp.set_nodelay(true);
        serve(tcp, slot);
    }
}

/// A thread serving the connections sent to it.
struct Worker {
    connections: mpsc::UnboundedSender<(std::net::TcpStream, Slot)>,
    /// Its open connections.
    open: Arc<AtomicUsize>,
    thread: std::thread::JoinHandle<()>,
}

impl Worker {
    fn spawn(
        k: usize,
        opener: Arc<Opener>,
        on_thread: impl Fn(usize) + Send + 'static,
    ) -> std::io::Result<Worker> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (connections, mut received) = mpsc::unbounded_channel::<(std::net::TcpStream, Slot)>();
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        // The caller's subscriber, scoped or global, logs for the thread.
        let logs = tracing::dispatcher::get_default(Clone::clone);
        let thread = std::thread::Builder::new()
            .name(format!("kvroute-{}-{k}", opener.name))
            .spawn(move || {
                let _logs = tracing::dispatcher::set_default(&logs);
                on_thread(k);
                runtime.block_on(async move {
                    let mut running = tokio::task::JoinSet::new();
                    loop {
                        tokio::select! {
                            next = received.recv() => match next {
                                Some((tcp, slot)) => {
                                    let opener = opener.clone();
                                    let counted = counted.clone();
                                    running.spawn(async move {
                                        if let Ok(tcp) = TcpStream::from_std(tcp) {
                                            opener.open(tcp, slot).await;
                                        }
                                        counted.fetch_sub(1, Ordering::Relaxed);
                                    });
                                }
                                None => break,
                            },
                            Some(_) = running.join_next() => {}
                        }
                    }
                    while running.join_next().await.is_some() {}
                });
            })?;
        Ok(Worker {
            connections,
            open,
            thread,
        })
    }
}

/// What serving one accepted connection needs.
struct Opener {
    builder: auto::Builder<TokioExecutor>,
    app: Router,
    tls: Option<TlsAcceptor>,
    idle: Duration,
    handshake: Duration,
    stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    name: &'static str,
}

impl Opener {
    fn new(
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
    async fn open(self: Arc<Self>, tcp: TcpStream, slot: Slot) {
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
struct Activity {
    since: Instant,
    active: AtomicUsize,
    /// When the last request ended, in ms after `since`.
    ended_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn caps_fit_the_open_file_limit_in_proportion() {
        let wanted = Caps {
            api: 10_000,
            picker: 1024,
        };
        // Room enough: as configured.
        assert_eq!(fit_caps(wanted, 1 << 20), wanted);
        // 2,048 descriptors: 256 reserved, 128 for the admin port, the
        // 1,664 left shared as 2 × api + picker.
        let fitted = fit_caps(wanted, 2048);
        assert_eq!(
            fitted,
            Caps {
                api: 791,
                picker: 81
            }
        );
        assert!(2 * fitted.api + fitted.picker <= 2048 - 256 - 128);
        // A listener not served takes nothing; each served one keeps one.
        assert_eq!(
            fit_caps(
                Caps {
                    api: 10_000,
                    picker: 0
                },
                2048
            )
            .picker,
            0
        );
        assert_eq!(fit_caps(wanted, 10), Caps { api: 1, picker: 1 });
    }

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

    /// Which thread answers a request on `tcp` (a keep-alive connection).
    async fn thread_of(tcp: &mut TcpStream) -> String {
        tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !answer.ends_with(b"@") {
            let n = tcp.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8(answer).unwrap();
        let body = text.split("\r\n\r\n").nth(1).unwrap();
        body.trim_end_matches('@').to_owned()
    }

    #[tokio::test]
    async fn connections_are_dealt_to_the_least_busy_thread_and_stay_there() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/",
            axum::routing::get(|| async {
                let name = std::thread::current().name().unwrap_or("?").to_owned();
                let k = API_THREAD_SEEN.with(std::cell::Cell::get);
                format!("{name}/{k:?}@")
            }),
        );
        let limits = ConnLimits {
            threads: 3,
            ..ConnLimits::admin(&Limits::default())
        };
        let (stop, stopped) = watch::channel(false);
        let server = tokio::spawn(serve_on_threads(
            listener,
            app,
            limits,
            stopped,
            Arc::new(Metrics::default()),
            "test",
            |k| API_THREAD_SEEN.with(|t| t.set(Some(k))),
        ));
        let mut conns = Vec::new();
        let mut seen = std::collections::BTreeMap::<String, usize>::new();
        for _ in 0..6 {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            *seen.entry(thread_of(&mut tcp).await).or_default() += 1;
            conns.push(tcp);
        }
        let dealt: Vec<_> = seen.iter().map(|(t, n)| format!("{t}={n}")).collect();
        assert_eq!(
            dealt,
            [
                "kvroute-test-0/Some(0)=2",
                "kvroute-test-1/Some(1)=2",
                "kvroute-test-2/Some(2)=2"
            ]
        );
        // A connection's next requests stay on its thread.
        for tcp in &mut conns {
            let first = thread_of(tcp).await;
            assert_eq!(thread_of(tcp).await, first);
        }
        // Stopping waits for the open connections: they close once idle.
        stop.send(true).unwrap();
        drop(conns);
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the threads end")
            .unwrap();
    }

    thread_local! {
        static API_THREAD_SEEN: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }
}
