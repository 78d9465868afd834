//! The API port's routes: `POST` to the forwarder, `GET /v1/models`, the
//! probes.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use super::Forwarder;
use crate::errors::ApiError;
use crate::request::Service;

/// The API port: a POST to any path but these goes to the forwarder, which
/// refuses paths outside `proxy.allowedPaths`. A fallback rather than a
/// `/v1/{*rest}` route, whose path parameter cost each request allocations.
pub(crate) fn routes(forwarder: Arc<Forwarder>) -> Router {
    Router::new()
        .route(
            "/v1/models",
            get(|State(f): State<Arc<Forwarder>>, headers| models(f.service.clone(), headers)),
        )
        .route("/healthz", get(|| async { StatusCode::OK }))
        .route(
            "/readyz",
            get(|State(f): State<Arc<Forwarder>>| async move { crate::admin::readyz(&f.service) }),
        )
        .fallback(|State(p): State<Arc<Forwarder>>, req: Request| async move {
            if req.method() == axum::http::Method::POST {
                p.serve(req).await
            } else {
                ApiError::NotFound(
                    "no such path; kvroute serves POST to proxy.allowedPaths and GET /v1/models"
                        .into(),
                )
                .into_response()
            }
        })
        .with_state(forwarder)
}

async fn models(p: Arc<Service>, headers: axum::http::HeaderMap) -> Response {
    if let Err(e) = p.authenticate(&headers) {
        return e.into_response();
    }
    let models = p.models().await;
    let data: Vec<_> = models
        .ids
        .iter()
        .map(|id| {
            let parent = models.adapters.get(id).map(|a| &a.parent);
            json!({"id": id, "object": "model", "owned_by": "kvroute", "parent": parent})
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}
