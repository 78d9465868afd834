//! Header hygiene: what passes from the client to the engine and back.

use axum::http::header::{self, HeaderMap, HeaderName};

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Copies end-to-end headers: not hop-by-hop ones, not those the
/// `Connection` header names, not `content-length` (set by the caller), and
/// none of `private`.
pub(crate) fn copy_headers(from: &HeaderMap, to: &mut HeaderMap, private: &[HeaderName]) {
    let named: Vec<String> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    for (name, value) in from {
        let n = name.as_str();
        if !HOP_BY_HOP.contains(&n)
            && name != header::CONTENT_LENGTH
            && !named.iter().any(|c| c == n)
            && !private.contains(name)
        {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Keeps only a response's end-to-end headers (see [`copy_headers`]).
pub(crate) fn end_to_end(headers: &mut HeaderMap) {
    let mut kept = HeaderMap::new();
    copy_headers(headers, &mut kept, &[]);
    *headers = kept;
}
