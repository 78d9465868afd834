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
        .route(
            FALSE_HIT_PATH,
            axum::routing::post(|State(f): State<Arc<Forwarder>>, req: Request| {
                false_hit(f.service.clone(), req)
            }),
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

/// Where a client reports a wrong semantic hit.
pub const FALSE_HIT_PATH: &str = "/v1/kvroute/semantic-cache/false-hit";

/// The largest false-hit report read, bytes: it carries one id.
pub const MAX_REPORT_BYTES: usize = 512;

/// `POST /v1/kvroute/semantic-cache/false-hit` with `{"id": "<the
/// answer's id>"}`: counts a semantic hit a client found wrong (see
/// [`crate::response_cache::semantic`]). In order: 404 while the semantic
/// level is off, before anything is read; the credentials, as the proxied
/// paths check them; the body, within the proxied paths' limits and at
/// most [`MAX_REPORT_BYTES`]. 404 for an id that is not a recent semantic
/// hit of the reporting tenant; 200 for one reported before, counted once
/// (`"counted": false`).
async fn false_hit(p: Arc<Service>, req: Request) -> Response {
    use crate::response_cache::semantic::{RECENT_HITS, Report};
    let Some(semantic) = p.response_cache.as_ref().and_then(|c| c.semantic.clone()) else {
        return ApiError::NotFound("the semantic cache is off".into()).into_response();
    };
    let (parts, body) = req.into_parts();
    let mut admitted = match p.admit_control(&parts.headers, MAX_REPORT_BYTES) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = admitted.read(body).await {
        return e.into_response();
    }
    #[derive(serde::Deserialize)]
    struct Body {
        id: String,
    }
    let report: Body = match serde_json::from_slice(&admitted.received.bytes()) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::BadRequest(format!("expected {{\"id\": \"...\"}}: {e}"))
                .into_response();
        }
    };
    match semantic.report_false_hit(admitted.tenant(), &report.id) {
        Report::Counted => axum::Json(json!({"reported": report.id, "counted": true})),
        Report::Again => axum::Json(json!({"reported": report.id, "counted": false})),
        Report::Unknown => {
            return ApiError::NotFound(format!(
                "{} is not one of the last {RECENT_HITS} semantic hits",
                report.id,
            ))
            .into_response();
        }
    }
    .into_response()
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
