//! The agent's admin endpoints: `/healthz` (the process serves), `/readyz`
//! (every rank can serve WatchCache: its capacity is known, a batch or a
//! replay arrived or the stream was quiet, and no fault; otherwise 503 with
//! the reasons), and `/metrics`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::{Metrics, gauges};
use crate::rank::Rank;

#[derive(Clone)]
struct App {
    ranks: Vec<Arc<Rank>>,
    metrics: Arc<Metrics>,
}

/// Serves until `stop`.
pub async fn serve(
    listener: TcpListener,
    ranks: Vec<Arc<Rank>>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(App { ranks, metrics });
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    if let Err(e) = server.await {
        tracing::error!(error = %e, "admin server failed");
    }
}

async fn readyz(State(app): State<App>) -> impl IntoResponse {
    let reasons: Vec<String> = app
        .ranks
        .iter()
        .filter_map(|r| r.not_ready().map(|why| format!("rank {}: {why}", r.rank)))
        .collect();
    if reasons.is_empty() {
        (StatusCode::OK, "ready\n".to_owned())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, reasons.join("\n") + "\n")
    }
}

async fn metrics_text(State(app): State<App>) -> impl IntoResponse {
    let gauges = gauges(&app.ranks);
    let body = kvroute_telemetry::metrics::encode(&[app.metrics.registry(), &gauges]);
    (
        [(
            header::CONTENT_TYPE,
            kvroute_telemetry::metrics::CONTENT_TYPE,
        )],
        body,
    )
}
