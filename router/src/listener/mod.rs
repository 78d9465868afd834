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
//!
//! This file accepts connections and serves them on the caller's runtime;
//! `limits` holds each listener's limits and fits them to the open-file
//! limit, `open` the open connections within a cap, `connection` serving
//! one connection, `threads` the API port's threads.

mod connection;
mod limits;
mod open;
mod threads;

pub use limits::{
    ADMIN_HEADER_READ_TIMEOUT, ADMIN_IDLE_TIMEOUT, ADMIN_MAX_CONNECTIONS, Caps, ConnLimits,
    fit_caps, fit_to_open_files, raise_open_file_limit,
};
pub use threads::serve_on_threads;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use self::connection::Opener;
use self::open::{Admitted, Connections, Slot};
use crate::metrics::{ListenerReason, Metrics};

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

fn refused(metrics: &Metrics, listener: &'static str, reason: &'static str) {
    metrics
        .connections_refused
        .get_or_create(&ListenerReason { listener, reason })
        .inc();
}
