//! The response's way back: the engine's response streamed to the client
//! frame by frame, its headers cleaned, the guard told of each byte.

use axum::body::Body;
use axum::http::Response;
use axum::http::header::{self, HeaderName, HeaderValue};
use bytes::Bytes;
use futures_util::stream;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};

use super::headers::end_to_end;
use crate::request::Guard;
use crate::request::recent::CACHE_HEADER;

/// Streams the engine's response back frame by frame, `first` first.
/// The guard records the first byte and the end; a broken stream ejects
/// the endpoint and, for event streams, ends with an error event.
pub(super) fn respond(
    endpoint_header: Option<&HeaderName>,
    response: Response<Incoming>,
    first: Option<Frame<Bytes>>,
    endpoint: &str,
    guard: Guard,
) -> Response<Body> {
    let (mut parts, incoming) = response.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let length = parts.headers.get(header::CONTENT_LENGTH).cloned();
    end_to_end(&mut parts.headers);
    // A sized response stays sized (the body passes through whole).
    if let Some(length) = length {
        parts.headers.insert(header::CONTENT_LENGTH, length);
    }
    if let Some(name) = endpoint_header
        && let Ok(v) = HeaderValue::from_str(endpoint)
    {
        parts.headers.insert(name.clone(), v);
    }
    if let Some(v) = guard.cache_header() {
        parts.headers.insert(CACHE_HEADER, v);
    }
    let first = first.map(Ok);
    let frames = stream::unfold(Some((incoming, guard, first)), move |state| async move {
        let (mut incoming, mut guard, first) = state?;
        let next = match first {
            Some(frame) => Some(frame),
            None => incoming.frame().await,
        };
        match next {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    guard.data(data);
                }
                // A sized body may not be polled past its last byte.
                if hyper::body::Body::is_end_stream(&incoming) {
                    guard.done();
                }
                let next = Some((incoming, guard, None));
                Some((Ok::<_, std::io::Error>(frame), next))
            }
            Some(Err(e)) => {
                guard.broke(&e.to_string());
                if sse {
                    let event = serde_json::json!({"error": {
                        "message": format!("the engine's stream broke: {e}"),
                        "type": "server_error",
                        "code": "upstream_stream_error",
                    }});
                    let bytes = Bytes::from(format!("data: {event}\n\n"));
                    Some((Ok(Frame::data(bytes)), None))
                } else {
                    Some((Err(std::io::Error::other(e)), None))
                }
            }
            None => {
                guard.done();
                None
            }
        }
    });
    Response::from_parts(parts, Body::new(StreamBody::new(frames)))
}
