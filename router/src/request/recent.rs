//! Request ids and the ring of recent requests' missed tokens.
//!
//! Every request carries an id: the client's `x-request-id` when it is a
//! plausible one (1 to [`MAX_ID_BYTES`] visible ASCII characters), else one
//! the router generates. The front ends forward it to the engine (vLLM
//! names its request after it) and echo it in the response.
//!
//! [`Recent`] keeps the last [`RECENT`] served requests' entries for
//! `GET /debug/requests/{id}`, about 300 bytes each, and renders one as a
//! [`Recorded`] when asked.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::SystemTime;

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use super::hit_rate::Usage;
use super::missed::Split;
use crate::explain::Recorded;

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
        let id = HeaderValue::from_maybe_shared(bytes::Bytes::from(id));
        RequestId(id.expect("hex digits are a header value"))
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

/// A served request's missed tokens, as kept.
#[derive(Debug)]
pub struct Entry {
    pub id: RequestId,
    /// The engine's response `id`.
    pub response_id: Option<String>,
    pub at: SystemTime,
    pub model: String,
    pub tenant: String,
    pub endpoint: Arc<str>,
    pub key: u64,
    pub first_block: Option<u64>,
    pub block_size: u64,
    /// Prompt tokens as the router counted them.
    pub prompt_tokens: u64,
    pub expected_cached: u64,
    /// What the engine reported.
    pub usage: Usage,
    pub split: Split,
    pub held: Option<crate::flow::Held>,
}

impl Entry {
    /// As `GET /debug/requests/{id}` answers.
    fn recorded(&self) -> Recorded {
        let hex = |h: u64| format!("{h:016x}");
        Recorded {
            request_id: self.id.as_str().to_owned(),
            response_id: self.response_id.clone(),
            at_unix_s: (self.at.duration_since(SystemTime::UNIX_EPOCH)).map_or(0, |d| d.as_secs()),
            model: self.model.clone(),
            tenant: self.tenant.clone(),
            endpoint: self.endpoint.to_string(),
            key: hex(self.key),
            first_block: self.first_block.map(hex),
            block_size: self.block_size,
            router_prompt_tokens: self.prompt_tokens,
            prompt_tokens: self.usage.prompt_tokens,
            expected_cached_tokens: self.expected_cached,
            cached_tokens: self.usage.cached_tokens,
            missed: (self.split.causes().iter())
                .map(|(c, n)| (c.as_str().to_owned(), *n))
                .collect(),
            routed_elsewhere_reason: self.split.lost.map(|l| l.as_str().to_owned()),
            held_seconds: self.held.map(|h| h.seconds),
            held_because: self.held.map(|h| h.because.to_owned()),
        }
    }
}

/// The last [`RECENT`] requests' entries.
#[derive(Debug, Default)]
pub struct Recent {
    ring: Mutex<VecDeque<Entry>>,
}

impl Recent {
    /// Keeps `e`, forgetting the oldest beyond [`RECENT`].
    pub fn push(&self, e: Entry) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT {
            ring.pop_front();
        }
        ring.push_back(e);
    }

    /// The newest request whose request id or response id is `id`.
    pub fn find(&self, id: &str) -> Option<Recorded> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        (ring.iter().rev())
            .find(|e| e.id.as_str() == id || e.response_id.as_deref() == Some(id))
            .map(Entry::recorded)
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

    fn entry(request_id: &str, response_id: &str) -> Entry {
        Entry {
            id: RequestId::of(&headers(request_id.as_bytes())),
            response_id: Some(response_id.into()),
            at: SystemTime::UNIX_EPOCH,
            model: "m".into(),
            tenant: "none".into(),
            endpoint: "e".into(),
            key: 0xab,
            first_block: None,
            block_size: 16,
            prompt_tokens: 40,
            expected_cached: 16,
            usage: Usage {
                prompt_tokens: 40,
                cached_tokens: 16,
            },
            split: Split {
                tokens: [0, 8, 16, 0, 0, 0, 0, 0],
                lost: Some(crate::pool::Lost::Queue),
            },
            held: Some(crate::flow::Held {
                seconds: 0.25,
                because: "endpoints_full",
            }),
        }
    }

    #[test]
    fn found_by_either_id_and_bounded() {
        let recent = Recent::default();
        for i in 0..RECENT + 10 {
            recent.push(entry(&format!("r{i}"), &format!("chatcmpl-{i}")));
        }
        assert_eq!(recent.ring.lock().unwrap().len(), RECENT);
        assert!(recent.find("r5").is_none(), "the oldest went");
        let last = format!("r{}", RECENT + 9);
        assert_eq!(recent.find(&last).unwrap().request_id, last);
        let r = recent.find("chatcmpl-100").unwrap();
        assert_eq!(r.request_id, "r100", "by the engine's id");
        assert_eq!(r.key, "00000000000000ab");
        assert_eq!(
            r.missed,
            [("routed_elsewhere".into(), 16), ("partial_block".into(), 8)]
        );
        assert_eq!(r.routed_elsewhere_reason.as_deref(), Some("queue"));
        assert_eq!(r.held_seconds, Some(0.25));
        assert_eq!(r.held_because.as_deref(), Some("endpoints_full"));
    }
}
