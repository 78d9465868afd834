//! Every way a request can fail, each mapped in one place to its HTTP
//! status and an OpenAI-style body:
//! `{"error": {"message": "...", "type": "...", "code": "..."}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::flow::queue::ShedReason;

fn shed_message(reason: ShedReason) -> &'static str {
    match reason {
        ShedReason::QueueFull => "the router's queue is full; retry later",
        ShedReason::WaitLimit => {
            "no endpoint could start the request within its wait limit; retry later"
        }
        ShedReason::Sheddable => {
            "every endpoint is busy and the request's priority is sheddable; retry later"
        }
    }
}

/// A request the router refuses or cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed JSON or a missing or mistyped field.
    #[error("{0}")]
    BadRequest(String),
    /// No valid credentials, or none where a tenant is required.
    #[error("{0}")]
    Unauthenticated(String),
    /// Valid credentials that do not allow what the request claims.
    #[error("{0}")]
    Forbidden(String),
    /// The client did not send its body in time.
    #[error("the request body did not arrive within {ms} ms")]
    BodyTimeout {
        /// The limit.
        ms: u64,
    },
    /// The client sent its body slower than `limits.bodyMinBytesPerS`.
    #[error("the request body arrived slower than {min_bytes_per_s} bytes/s")]
    BodyTooSlow {
        /// The limit.
        min_bytes_per_s: u64,
    },
    /// No such model or path.
    #[error("{0}")]
    NotFound(String),
    /// The body exceeds the configured limit.
    #[error("request body exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Every candidate endpoint is at its limit and the queue is full or
    /// timed out.
    #[error("all endpoints are busy; retry later")]
    Overloaded {
        /// Seconds to wait.
        retry_after: u64,
    },
    /// Flow control answered the request instead of holding it on
    /// ([`crate::flow`]).
    #[error("{}", shed_message(*.reason))]
    Shed {
        /// Why.
        reason: ShedReason,
        /// Seconds to wait.
        retry_after: u64,
    },
    /// The router is shutting down: a request it would hold is answered
    /// at once instead.
    #[error("this router is shutting down; retry (another replica will take it)")]
    ShuttingDown {
        /// Seconds to wait.
        retry_after: u64,
    },
    /// No endpoint is ready.
    #[error("no ready endpoint for this pool")]
    Unavailable {
        /// Seconds to wait.
        retry_after: u64,
    },
    /// Request bodies in memory are at `limits.maxBodyBytesInFlight`, or
    /// the tokenizer queue is full.
    #[error("the router is at its limit for {0}; retry later")]
    Saturated(&'static str, u64),
    /// The tenant's request bodies in memory are at
    /// `limits.maxBodyBytesPerTenant`.
    #[error("this tenant's request bodies in memory are at their limit; retry later")]
    TenantSaturated(u64),
    /// Every attempt failed before a response.
    #[error("upstream failed: {0}")]
    Upstream(String),
    /// A fault of the router itself.
    #[error("internal error: {0}")]
    Internal(String),
    /// The engine took too long to answer.
    #[error("upstream timed out: {0}")]
    Timeout(String),
    /// The pool's policy asks for salted tenancy and this router cannot
    /// salt: it refuses rather than share cached prefixes across tenants.
    #[error("{}", TENANCY_REQUIRED)]
    SaltingRequired,
}

/// Why [`ApiError::SaltingRequired`] refuses, for clients and `/readyz`.
pub const TENANCY_REQUIRED: &str = "the pool's CacheRoutingPolicy sets tenancy Salted, but this router is not configured to salt (tenancy.mode: salted with a tenancy.secretFile); it refuses requests rather than share cached prefixes between tenants";

impl ApiError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::BodyTimeout { .. } | ApiError::BodyTooSlow { .. } => {
                StatusCode::REQUEST_TIMEOUT
            }
            ApiError::TenantSaturated(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Saturated(..) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded { .. } | ApiError::Shed { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } | ApiError::ShuttingDown { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::SaltingRequired => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The OpenAI error `type` and `code`.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::BadRequest(_) => ("invalid_request_error", "invalid_request"),
            ApiError::Unauthenticated(_) => ("authentication_error", "unauthenticated"),
            ApiError::Forbidden(_) => ("permission_error", "forbidden"),
            ApiError::BodyTimeout { .. } => ("invalid_request_error", "request_timeout"),
            ApiError::BodyTooSlow { .. } => ("invalid_request_error", "request_too_slow"),
            ApiError::TenantSaturated(_) => ("rate_limit_error", "tenant_saturated"),
            ApiError::Saturated(..) => ("server_error", "router_saturated"),
            ApiError::NotFound(_) => ("invalid_request_error", "not_found"),
            ApiError::TooLarge { .. } => ("invalid_request_error", "request_too_large"),
            ApiError::Overloaded { .. } => ("rate_limit_error", "overloaded"),
            ApiError::Shed { reason, .. } => ("rate_limit_error", reason.as_str()),
            ApiError::Unavailable { .. } => ("server_error", "no_ready_endpoint"),
            ApiError::ShuttingDown { .. } => ("server_error", "router_shutting_down"),
            ApiError::Upstream(_) => ("server_error", "upstream_error"),
            ApiError::Internal(_) => ("server_error", "internal_error"),
            ApiError::Timeout(_) => ("server_error", "upstream_timeout"),
            ApiError::SaltingRequired => ("server_error", "salted_tenancy_not_configured"),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let (kind, code) = self.kind();
        json!({"error": {"message": self.to_string(), "type": kind, "code": code}})
    }

    /// The metric label of the error.
    pub fn code(&self) -> &'static str {
        self.kind().1
    }

    /// Seconds a client should wait before retrying, for the errors that
    /// say so (`Retry-After`).
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::Overloaded { retry_after }
            | ApiError::Shed { retry_after, .. }
            | ApiError::Unavailable { retry_after }
            | ApiError::ShuttingDown { retry_after }
            | ApiError::Saturated(_, retry_after)
            | ApiError::TenantSaturated(retry_after) => Some(*retry_after),
            _ => None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = self.retry_after();
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let Some(s) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_bodies_and_retry_after() {
        let cases = [
            (ApiError::BadRequest("x".into()), 400),
            (ApiError::Unauthenticated("x".into()), 401),
            (ApiError::NotFound("x".into()), 404),
            (ApiError::Forbidden("x".into()), 403),
            (ApiError::BodyTimeout { ms: 1 }, 408),
            (ApiError::Saturated("request bodies", 1), 503),
            (ApiError::TenantSaturated(1), 429),
            (ApiError::BodyTooSlow { min_bytes_per_s: 1 }, 408),
            (ApiError::TooLarge { limit: 1 }, 413),
            (ApiError::Overloaded { retry_after: 2 }, 429),
            (ApiError::Unavailable { retry_after: 3 }, 503),
            (ApiError::Upstream("x".into()), 502),
            (ApiError::Internal("x".into()), 500),
            (ApiError::Timeout("x".into()), 504),
        ];
        for (err, status) in cases {
            assert_eq!(err.status().as_u16(), status);
            let body = err.body();
            assert!(body["error"]["message"].is_string());
            assert!(body["error"]["type"].is_string());
            assert!(body["error"]["code"].is_string());
        }
        let r = ApiError::Overloaded { retry_after: 2 }.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r = ApiError::BadRequest("x".into()).into_response();
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
    }
}
