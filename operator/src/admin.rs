//! The operator's admin HTTP server: `/metrics` for Prometheus, `/healthz`
//! for the liveness probe and `/readyz` for the readiness probe.
//!
//! Not here: what the numbers mean ([`crate::metrics`]) or deciding when the
//! operator is ready; the watchers flip [`Admin::ready`], this only reports it.

use std::fmt;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::{Gauges, Metrics};

/// What the admin endpoints read.
#[derive(Clone)]
pub struct Admin {
    /// The operator's counters.
    pub metrics: Arc<Metrics>,
    /// Reads the gauges; called once per scrape of `/metrics`.
    pub gauges: Arc<dyn Fn() -> Gauges + Send + Sync>,
    /// True once the initial lists are in (see [`crate::watch`]).
    pub ready: watch::Receiver<bool>,
}

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin")
            .field("metrics", &self.metrics)
            .field("ready", &self.ready)
            .finish_non_exhaustive()
    }
}

/// Serves the admin endpoints on `listener` until `shutdown` completes;
/// requests in flight then finish.
pub async fn serve(
    listener: TcpListener,
    admin: Admin,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, routes(admin))
        .with_graceful_shutdown(shutdown)
        .await
}

fn routes(admin: Admin) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        // Answering at all is the liveness signal: the runtime is serving.
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "no such path; the admin server serves GET /metrics, /healthz and /readyz\n",
            )
        })
        .with_state(admin)
}

async fn metrics(State(admin): State<Admin>) -> Response {
    let text = admin.metrics.render(&(admin.gauges)());
    (
        [(
            header::CONTENT_TYPE,
            kvroute_telemetry::metrics::CONTENT_TYPE,
        )],
        text,
    )
        .into_response()
}

async fn readyz(State(admin): State<Admin>) -> Response {
    if *admin.ready.borrow() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the initial lists of InferencePools, CacheRoutingPolicies, Services, Pods and InferenceObjectives are not in yet\n",
        )
            .into_response()
    }
}
