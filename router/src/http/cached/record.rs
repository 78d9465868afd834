//! A miss's answer on its way from the engine to its client, read into
//! the cache as it passes ([`Capture`]) and stored once complete.
//!
//! 1. A request that does not lead (coalescing off, `no-cache`) has its
//!    engine's body read as its client pulls it. A client that leaves
//!    drops the body, which cancels the engine's request.
//! 2. A request that leads (identical requests may wait for its answer)
//!    has its engine's body read by a task at the engine's pace, whatever
//!    its client does. The client gets the frames through a queue that
//!    holds at most `responseCache.maxEntryBytes`, so a client that reads
//!    slowly, or not at all, does not hold the others:
//!    1. a client more than that behind ends the lead without an answer
//!       (`kvroute_response_cache_slow_leaders_total`); the waiting
//!       requests go to an engine, and the task goes on at the client's
//!       pace, still storing the answer if it completes;
//!    2. a client that leaves is no longer sent anything; the task reads
//!       on only while a request still waits for the answer, until it is
//!       stored or found unstorable (the capture holds at most
//!       `maxEntryBytes`), and drops the engine's body (cancelling its
//!       request) as soon as none does.
//! 3. An answer the engine marks `Cache-Control: no-store` or `private`
//!    is not stored (`stores_total{reason="cache_control"}`), and its
//!    lead ends at once.
//!
//! Memory per leading request: the queue and the capture, each at most
//! `maxEntryBytes`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::header::{self, HeaderMap};
use axum::http::{Response, StatusCode};
use bytes::Bytes;
use futures_util::stream;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::{Semaphore, TryAcquireError, mpsc};
use tracing::Instrument;

use crate::response_cache::capture::Capture;
use crate::response_cache::coalesce::Leader;
use crate::response_cache::key::{self, Cacheable};
use crate::response_cache::semantic::{Remember, Semantic};
use crate::response_cache::{ResponseCache, unix_ms};

type Item = Result<Frame<Bytes>, std::io::Error>;

/// `response` passed on as it streams, its answer read and stored when it
/// is complete: before its last byte is passed on. `lead`'s followers get
/// the answer, or go on alone when there is none.
pub(super) fn record(
    cache: Arc<ResponseCache>,
    c: Cacheable,
    (lead, remember): (Option<Leader>, Option<(Arc<Semantic>, Remember)>),
    response: Response<Body>,
) -> Response<Body> {
    if response.status() != StatusCode::OK {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let sse = (parts.headers.get(header::CONTENT_TYPE))
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let length =
        (parts.headers.get(header::CONTENT_LENGTH)).and_then(|v| v.to_str().ok()?.parse().ok());
    let strip = c.forward.is_some();
    if strip {
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    let max = cache.config.max_entry_bytes;
    let capture = Capture::new(c.form.api, sse, strip, max, length);
    let mut r = Recording {
        cache,
        key: Some(c.key),
        lead,
        remember,
        capture,
    };
    if forbids_storing(&parts.headers) {
        r.refuse("cache_control");
    }
    let body = if r.lead.is_some() {
        engine_paced(body, r, max)
    } else {
        client_paced(body, r)
    };
    Response::from_parts(parts, body)
}

/// Whether the engine's `Cache-Control` forbids a shared cache to keep
/// the answer: `no-store` or `private` (RFC 9111, 5.2.2.5 and 5.2.2.7).
fn forbids_storing(headers: &HeaderMap) -> bool {
    (headers.get_all(header::CACHE_CONTROL).iter())
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.split('=').next().unwrap_or("").trim())
        .any(|d| d.eq_ignore_ascii_case("no-store") || d.eq_ignore_ascii_case("private"))
}

/// Rule 1: the engine's body read as the client pulls it.
fn client_paced(body: Body, r: Recording) -> Body {
    let frames = stream::unfold(Some((body, r)), |s| async move {
        let (mut body, mut r) = s?;
        loop {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(frame) = r.frame(frame) {
                        return Some((Ok(frame), Some((body, r))));
                    }
                }
                Some(Err(e)) => return Some((Err(std::io::Error::other(e)), None)),
                None => return r.end().map(|frame| (Ok(frame), None)),
            }
        }
    });
    Body::new(StreamBody::new(frames))
}

/// Rule 2: the engine's body read by a task, the client's frames queued,
/// at most `max` bytes of them.
fn engine_paced(body: Body, r: Recording, max: usize) -> Body {
    let bound = u32::try_from(max).unwrap_or(u32::MAX);
    let room = Arc::new(Semaphore::new(bound as usize));
    let (tx, rx) = mpsc::unbounded_channel();
    let queue = Queue {
        tx,
        room: room.clone(),
        bound,
    };
    tokio::spawn(pump(body, r, queue).in_current_span());
    Body::new(StreamBody::new(Queued { rx, room }))
}

/// The task's end of the client's queue. A frame takes room for its bytes
/// (at most `bound`); the client taking it gives the room back.
struct Queue {
    tx: mpsc::UnboundedSender<(Item, u32)>,
    room: Arc<Semaphore>,
    bound: u32,
}

/// The client's end of the queue; dropped (the client left), it closes
/// the room, so a task waiting for room stops.
struct Queued {
    rx: mpsc::UnboundedReceiver<(Item, u32)>,
    room: Arc<Semaphore>,
}

impl futures_util::Stream for Queued {
    type Item = Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = self.get_mut();
        this.rx.poll_recv(cx).map(|next| {
            next.map(|(item, bytes)| {
                this.room.add_permits(bytes as usize);
                item
            })
        })
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.room.close();
    }
}

/// Reads the engine's body into `r` and the queue (rule 2).
async fn pump(mut body: Body, mut r: Recording, q: Queue) {
    let mut client = true;
    loop {
        // Biased to the engine's body: what has already arrived is read
        // (and stored when complete) before a client's leaving is noticed.
        let next = if client {
            tokio::select! {
                biased;
                next = body.frame() => next,
                () = q.tx.closed() => {
                    client = false;
                    continue;
                }
            }
        } else {
            // Rule 2.2: on only for the requests still waiting.
            let Some(lead) = &r.lead else { return };
            tokio::select! {
                biased;
                next = body.frame() => next,
                () = lead.unwanted() => return,
            }
        };
        let frame = match next {
            Some(Ok(frame)) => r.frame(frame),
            Some(Err(e)) => {
                let _ = q.tx.send((Err(std::io::Error::other(e)), 0));
                return;
            }
            None => {
                if let Some(frame) = r.end() {
                    let _ = q.tx.send((Ok(frame), 0));
                }
                return;
            }
        };
        let Some(frame) = frame else { continue };
        if !client {
            continue;
        }
        let bytes = frame.data_ref().map_or(0, |d| d.len());
        let bytes = u32::try_from(bytes).unwrap_or(u32::MAX).min(q.bound);
        match q.room.try_acquire_many(bytes) {
            Ok(permit) => permit.forget(),
            Err(TryAcquireError::Closed) => {
                client = false;
                continue;
            }
            Err(TryAcquireError::NoPermits) => {
                // Rule 2.1: the others stop waiting; on at the client's pace.
                if let Some(lead) = r.lead.take() {
                    r.cache.metrics.slow_leaders.inc();
                    lead.end(None);
                }
                match q.room.acquire_many(bytes).await {
                    Ok(permit) => permit.forget(),
                    Err(_) => return,
                }
            }
        }
        if q.tx.send((Ok(frame), bytes)).is_err() {
            client = false;
        }
    }
}

/// A miss's answer being read.
struct Recording {
    cache: Arc<ResponseCache>,
    /// Until stored, or refused.
    key: Option<key::Key>,
    lead: Option<Leader>,
    /// The question to remember with the answer (the semantic level).
    remember: Option<(Arc<Semantic>, Remember)>,
    capture: Capture,
}

impl Recording {
    /// Reads one frame of the engine's body; returns what the client gets
    /// now, if anything.
    fn frame(&mut self, frame: Frame<Bytes>) -> Option<Frame<Bytes>> {
        match frame.into_data() {
            Ok(data) => {
                let out = self.capture.push(data);
                if self.capture.complete() || self.capture.spoiled() {
                    self.store();
                }
                (!out.is_empty()).then(|| Frame::data(out))
            }
            Err(frame) => Some(frame),
        }
    }

    /// The engine's body ended: stores what was read; returns the
    /// client's last bytes, if any.
    fn end(&mut self) -> Option<Frame<Bytes>> {
        self.store();
        let rest = self.capture.rest();
        (!rest.is_empty()).then(|| Frame::data(rest))
    }

    /// Stores nothing, for `reason`, and ends the lead without an answer.
    fn refuse(&mut self, reason: &'static str) {
        self.key = None;
        self.remember = None;
        let reason = crate::metrics::Why { reason };
        self.cache.metrics.stores.get_or_create(&reason).inc();
        if let Some(lead) = self.lead.take() {
            lead.end(None);
        }
    }

    /// Stores the answer if it is complete and storable (once), and ends
    /// the lead with it.
    fn store(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        let answer = match self.capture.answer(unix_ms()) {
            Ok(a) => {
                let a = Arc::new(a);
                if let Some((semantic, question)) = self.remember.take() {
                    semantic.remember(question, key.clone());
                }
                self.cache.put(key, a.clone());
                Some(a)
            }
            Err(reason) => {
                let reason = crate::metrics::Why { reason };
                self.cache.metrics.stores.get_or_create(&reason).inc();
                None
            }
        };
        if let Some(lead) = self.lead.take() {
            lead.end(answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::http::HeaderValue;
    use futures_util::StreamExt;

    use super::*;
    use crate::config::{Limits, ResponseCache as Config};
    use crate::response_cache::coalesce::Joined;
    use crate::response_cache::key::{Classified, classify};
    use crate::tenancy::Tenancy;

    /// A cache and a cacheable chat request to it.
    fn cache() -> (Arc<ResponseCache>, Cacheable) {
        let tenancy = Tenancy::load(&crate::config::Tenancy::default()).unwrap();
        let cache = ResponseCache::new(
            &Config::default(),
            &tenancy,
            &Limits::default(),
            Arc::default(),
        );
        let cache = Arc::new(cache.unwrap());
        let body = br#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}"#;
        let path = "/v1/chat/completions";
        let classified = classify(
            cache.keying(),
            path,
            &HeaderMap::new(),
            None,
            body,
            |_| vec![],
        );
        let Classified::Cacheable(c) = classified else {
            panic!("cacheable")
        };
        (cache, c)
    }

    /// An engine's JSON answer whose body the test writes.
    fn engine() -> (mpsc::UnboundedSender<Bytes>, Response<Body>) {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let frames = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
            .map(|b| Ok::<_, std::io::Error>(Frame::data(b)));
        let mut response = Response::new(Body::new(StreamBody::new(frames)));
        let json = HeaderValue::from_static("application/json");
        response.headers_mut().insert(header::CONTENT_TYPE, json);
        (tx, response)
    }

    const ANSWER: &str = r#"{"id":"x","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_client_left_reads_on_only_while_followers_wait() {
        let (cache, c) = cache();
        let Joined::Lead(lead) = cache.inflight.join(c.key.digest) else {
            panic!("leads")
        };
        let Joined::Follow(follower) = cache.inflight.join(c.key.digest) else {
            panic!("follows")
        };
        let (writer, response) = engine();
        drop(record(cache.clone(), c, (Some(lead), None), response));
        writer.send(Bytes::from_static(ANSWER.as_bytes())).unwrap();
        drop(writer);
        let answer = follower.answer(Duration::from_secs(5)).await;
        assert_eq!(answer.expect("the follower is answered").content, "4");

        // Nobody waits: the engine's request is dropped at once.
        let (cache, c) = self::cache();
        let Joined::Lead(lead) = cache.inflight.join(c.key.digest) else {
            panic!("leads")
        };
        let (writer, response) = engine();
        drop(record(cache.clone(), c, (Some(lead), None), response));
        tokio::time::timeout(Duration::from_secs(5), writer.closed())
            .await
            .expect("the engine's body is dropped");
        assert!(cache.inflight.is_empty());
    }

    #[test]
    fn no_store_and_private_forbid_storing_in_any_spelling() {
        let forbids = |values: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::CACHE_CONTROL, HeaderValue::from_static(v));
            }
            forbids_storing(&h)
        };
        assert!(forbids(&["no-store"]));
        assert!(forbids(&["max-age=60, Private"]));
        assert!(forbids(&["private=\"set-cookie\""]));
        assert!(forbids(&["no-cache", "NO-STORE"]));
        assert!(!forbids(&[]));
        assert!(!forbids(&["no-cache, max-age=0"]));
        assert!(!forbids(&["public, s-maxage=60"]));
    }
}
