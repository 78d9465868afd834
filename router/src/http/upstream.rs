//! The request sent to an engine: the client's, addressed to the target,
//! with the router's headers (request id, admission bound and room, trace context)
//! and without the private ones, any `x-kvroute-*` the client sent, or
//! llm-d's `x-prefiller-*`.

use axum::http::header::{self, HeaderName, HeaderValue};
use axum::http::request::Parts;
use axum::http::{Request, Uri};
use bytes::Bytes;
use http_body_util::Full;
use kvroute_core::admission::{ADMIT_WITHIN_HEADER, ROOM_HEADER};

use super::headers::copy_headers;
use crate::errors::ApiError;
use crate::pool::Fault;
use crate::request::recent::REQUEST_ID;
use crate::request::split::{OLD_PREFILLER_HEADER, PREFILLER_HEADER};
use crate::request::{RequestId, routers_own};

/// The request to send to `target`.
pub(super) fn request(
    parts: &Parts,
    bytes: &Bytes,
    target: &crate::pool::Target,
    id: &RequestId,
    admit: Option<(u64, Option<u64>)>,
    private_headers: &[HeaderName],
) -> Result<Request<Full<Bytes>>, (ApiError, Option<Fault>)> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri: Uri = format!("http://{}{path}", target.http)
        .parse()
        .map_err(|e| (ApiError::Upstream(format!("bad upstream URI: {e}")), None))?;
    let mut request = Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .body(Full::new(bytes.clone()))
        .map_err(|e| (ApiError::Upstream(e.to_string()), None))?;
    let headers = request.headers_mut();
    copy_headers(&parts.headers, headers, private_headers);
    let own: Vec<HeaderName> = headers.keys().filter(|n| routers_own(n)).cloned().collect();
    for name in own {
        headers.remove(name);
    }
    // llm-d's routing sidecar would run the prefill where a client's
    // header names.
    headers.remove(PREFILLER_HEADER);
    headers.remove(OLD_PREFILLER_HEADER);
    headers.remove(header::HOST);
    headers.insert(REQUEST_ID, id.header().clone());
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    if let Some((ms, room)) = admit {
        headers.insert(ADMIT_WITHIN_HEADER, HeaderValue::from(ms));
        if let Some(blocks) = room {
            headers.insert(ROOM_HEADER, HeaderValue::from(blocks));
        }
    }
    // With tracing on, the engine's parent is this router's span; else
    // the client's traceparent passes through as copied.
    crate::telemetry::inject(headers);
    Ok(request)
}
