//! Request ids and the ring of recent requests' missed tokens.
//!
//! Every request carries an id: the client's `x-request-id` when it is a
//! plausible one (1 to [`MAX_ID_BYTES`] visible ASCII characters), else one
//! the router generates. The front ends forward it to the engine (vLLM
//! names its request after it) and echo it in the response.
//!
//! [`Recent`] keeps the last [`RECENT`] served requests' records
//! ([`Recorded`]) for `GET /debug/requests/{id}`: about 400 bytes each.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::admin::explain::Recorded;

/// The request id header.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// The response header of what was expected of a request
/// (`telemetry.cacheHeader`).
pub const CACHE_HEADER: HeaderName = HeaderName::from_static("x-kvroute-cache");
/// The longest client request id taken as is.
pub const MAX_ID_BYTES: usize = 128;
/// Requests kept.
pub const RECENT: usize = 1024;

/// A request's id. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(HeaderValue);

impl RequestId {
    /// The client's id in `headers`, else a new one.
    pub fn of(headers: &HeaderMap) -> Self {
        match headers.get(REQUEST_ID) {
            Some(v)
                if (1..=MAX_ID_BYTES).contains(&v.len())
                    && v.as_bytes().iter().all(|b| b.is_ascii_graphic()) =>
            {
                RequestId(v.clone())
            }
            _ => RequestId::new(),
        }
    }

    /// A new id: 32 hex digits, unique in this process, unpredictable.
    fn new() -> Self {
        static KEYS: OnceLock<(u64, std::collections::hash_map::RandomState)> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let (prefix, state) = KEYS.get_or_init(|| {
            let state = std::collections::hash_map::RandomState::new();
            (std::hash::BuildHasher::hash_one(&state, "kvroute"), state)
        });
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = format!(
            "{prefix:016x}{:016x}",
            std::hash::BuildHasher::hash_one(state, n)
        );
        RequestId(HeaderValue::from_str(&id).expect("hex digits are a header value"))
    }

    /// The id as a header value.
    pub fn header(&self) -> &HeaderValue {
        &self.0
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        self.0.to_str().expect("visible ASCII")
    }
}

/// The last [`RECENT`] requests' records.
#[derive(Debug, Default)]
pub struct Recent {
    ring: Mutex<VecDeque<Recorded>>,
}

impl Recent {
    /// Keeps `r`, forgetting the oldest beyond [`RECENT`].
    pub fn push(&self, r: Recorded) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT {
            ring.pop_front();
        }
        ring.push_back(r);
    }

    /// The newest record whose request id or response id is `id`.
    pub fn find(&self, id: &str) -> Option<Recorded> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter()
            .rev()
            .find(|r| r.request_id == id || r.response_id.as_deref() == Some(id))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_bytes(id).unwrap());
        h
    }

    #[test]
    fn a_plausible_client_id_is_kept_else_one_is_made() {
        assert_eq!(RequestId::of(&headers(b"req-1")).as_str(), "req-1");
        for bad in [
            &b"has space"[..],
            &[b'a'; MAX_ID_BYTES + 1][..],
            b"caf\xc3\xa9",
        ] {
            let id = RequestId::of(&headers(bad));
            assert_eq!(id.as_str().len(), 32, "{bad:?} replaced");
        }
        let (a, b) = (
            RequestId::of(&HeaderMap::new()),
            RequestId::of(&HeaderMap::new()),
        );
        assert_ne!(a, b);
        assert!(a.as_str().bytes().all(|c| c.is_ascii_hexdigit()));
    }

    fn record(request_id: &str, response_id: &str) -> Recorded {
        Recorded {
            request_id: request_id.into(),
            response_id: Some(response_id.into()),
            at_unix_s: 0,
            model: "m".into(),
            tenant: "none".into(),
            endpoint: "e".into(),
            key: "0".into(),
            first_block: None,
            block_size: 16,
            router_prompt_tokens: 1,
            prompt_tokens: 1,
            expected_cached_tokens: 0,
            cached_tokens: 0,
            missed: Vec::new(),
            routed_elsewhere_reason: None,
        }
    }

    #[test]
    fn found_by_either_id_and_bounded() {
        let recent = Recent::default();
        for i in 0..RECENT + 10 {
            recent.push(record(&format!("r{i}"), &format!("chatcmpl-{i}")));
        }
        assert_eq!(recent.ring.lock().unwrap().len(), RECENT);
        assert!(recent.find("r5").is_none(), "the oldest went");
        let last = format!("r{}", RECENT + 9);
        assert_eq!(recent.find(&last).unwrap().request_id, last);
        assert_eq!(
            recent.find("chatcmpl-100").unwrap().request_id,
            "r100",
            "by the engine's id"
        );
    }
}
