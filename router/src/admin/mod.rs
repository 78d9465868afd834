//! The admin port: probes, `/metrics`, and the `/debug` endpoints (the
//! pool's state, explain, volatile prefixes) behind their access rule.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::config::Config;
use crate::errors::ApiError;
use crate::request::Service;

/// The admin port's routes for `service`, `/debug` open as `config` and
/// `token` (`adminTokenFile`'s) say.
pub(crate) fn routes(service: Arc<Service>, config: &Config, token: Option<Arc<String>>) -> Router {
    admin_routes(service, debug_access(config, token))
}

/// Who may call `/debug/*` on the admin port.
#[derive(Clone, Debug)]
enum DebugAccess {
    /// Callers with `adminTokenFile`'s token.
    Token(Arc<String>),
    /// Anyone who reaches the port: a loopback `adminListen`, or
    /// `debug.open`.
    Open,
    /// No one: neither a token nor an open or loopback listener.
    Closed,
}

/// The access rule `config` sets, with the token read from its file.
fn debug_access(config: &Config, token: Option<Arc<String>>) -> DebugAccess {
    match token {
        Some(token) => DebugAccess::Token(token),
        None if config.debug.open || config.admin_listen.ip().is_loopback() => DebugAccess::Open,
        None => DebugAccess::Closed,
    }
}

fn admin_routes(service: Arc<Service>, access: DebugAccess) -> Router {
    let debug = Router::new()
        .route(
            "/debug/pool",
            get(|State(p): State<Arc<Service>>| async move { axum::Json(p.pool.status()) }),
        )
        .route("/debug/explain", axum::routing::post(explain))
        .route(
            "/debug/requests/{id}",
            get(
                |State(p): State<Arc<Service>>, Path(id): Path<String>| async move {
                    p.accounting.recorded(&id).map(axum::Json).ok_or_else(|| {
                        ApiError::NotFound(format!(
                            "no recent request {id}: the router keeps the last {} served requests with usage",
                            crate::request::recent::RECENT
                        ))
                    })
                },
            ),
        )
        .route(
            "/admin/response-cache/purge",
            axum::routing::post(purge_response_cache),
        )
        .route(
            "/debug/warmup",
            get(|State(p): State<Arc<Service>>| async move {
                let statuses = p.warmups.get();
                if statuses.is_empty() {
                    return Err(ApiError::NotFound(
                        "no warm-ups: set routing.warmup, or spec.warmup in the pool's CacheRoutingPolicy"
                            .into(),
                    ));
                }
                Ok(axum::Json(json!({"prefixes": statuses})))
            }),
        )
        .route(
            "/debug/prefixes",
            get(|State(p): State<Arc<Service>>| async move { axum::Json(p.accounting.volatile_prefixes()) }),
        )
        .layer(axum::middleware::from_fn(
            move |request: Request, next: axum::middleware::Next| {
                let access = access.clone();
                async move {
                    let refused = match &access {
                        DebugAccess::Token(t) if !bearer_is(request.headers(), t) => {
                            "the admin port's /debug endpoints need Authorization: Bearer <adminTokenFile's token>"
                        }
                        DebugAccess::Closed => {
                            "the admin port's /debug endpoints are served without a token only on a loopback adminListen or with debug.open: true; set adminTokenFile to use them here"
                        }
                        _ => return next.run(request).await,
                    };
                    ApiError::Unauthenticated(refused.into()).into_response()
                }
            },
        ));
    Router::new()
        .merge(debug)
        .route(
            "/metrics",
            get(|State(p): State<Arc<Service>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        kvroute_telemetry::metrics::CONTENT_TYPE,
                    )],
                    p.render_metrics(),
                )
            }),
        )
        .route("/healthz", get(|| async { StatusCode::OK }))
        .route(
            "/readyz",
            get(|State(p): State<Arc<Service>>| async move { readyz(&p) }),
        )
        .with_state(service)
}

/// `POST /admin/response-cache/purge[?model=M]`: drops every stored
/// answer, or those of model `M`; answers `{"purged": n}`.
async fn purge_response_cache(
    State(p): State<Arc<Service>>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Response {
    let Some(cache) = &p.response_cache else {
        return ApiError::NotFound("the response cache is off: set responseCache".into())
            .into_response();
    };
    match cache.purge(q.get("model").map(String::as_str)).await {
        Ok(n) => axum::Json(json!({"purged": n})).into_response(),
        Err(e) => ApiError::Upstream(format!("purging the response cache: {e}")).into_response(),
    }
}

/// Whether `headers` carry `Authorization: Bearer <token>`, compared in
/// constant time.
fn bearer_is(headers: &axum::http::HeaderMap, token: &str) -> bool {
    use subtle::ConstantTimeEq;
    crate::tenancy::bearer(headers)
        .is_some_and(|given| bool::from(given.as_bytes().ct_eq(token.as_bytes())))
}

pub(crate) fn readyz(p: &Service) -> Response {
    match p.readiness() {
        Ok(n) => (StatusCode::OK, format!("ready: {n} endpoints\n")).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")).into_response(),
    }
}

/// `POST /debug/explain`: what the router would do with a request, without
/// sending it. Takes `{"path", "headers", "body"}` (`path` defaults to
/// `/v1/chat/completions`; `headers` is an object of strings; `body` is the
/// request's JSON, or a string holding it) or a bare chat completion body.
async fn explain(State(p): State<Arc<Service>>, body: axum::body::Bytes) -> Response {
    let result = async {
        let value: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))?;
        let Some(inner) = value.get("body") else {
            return p
                .explain("/v1/chat/completions", &axum::http::HeaderMap::new(), body)
                .await;
        };
        let path = match value.get("path") {
            None => "/v1/chat/completions",
            Some(serde_json::Value::String(path)) => path,
            Some(_) => return Err(ApiError::BadRequest("'path' must be a string".into())),
        };
        let mut headers = axum::http::HeaderMap::new();
        let given = value.get("headers").cloned().unwrap_or(json!({}));
        let Some(given) = given.as_object() else {
            return Err(ApiError::BadRequest("'headers' must be an object".into()));
        };
        for (name, v) in given {
            let parsed = v.as_str().and_then(|v| {
                Some((
                    axum::http::HeaderName::from_bytes(name.as_bytes()).ok()?,
                    axum::http::HeaderValue::from_str(v).ok()?,
                ))
            });
            let Some((name, v)) = parsed else {
                return Err(ApiError::BadRequest(format!(
                    "header {name:?} is not a valid name with a string value"
                )));
            };
            headers.append(name, v);
        }
        let body = match inner {
            serde_json::Value::String(raw) => raw.clone().into_bytes(),
            other => serde_json::to_vec(other).expect("a JSON value serializes"),
        };
        p.explain(path, &headers, body.into()).await
    };
    match result.await {
        Ok(explanation) => axum::Json(explanation).into_response(),
        Err(e) => e.into_response(),
    }
}
