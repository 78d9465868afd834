//! The response cache at the HTTP front end ([`crate::response_cache`]):
//! a request is admitted and read, classified and looked up; a hit is
//! answered here, a miss is decided and forwarded as usual and its answer
//! stored as it streams back. Every answer carries
//! `x-kvroute-response-cache: hit | miss | bypass`. How a miss's answer
//! is read and stored: [`mod@record`].

mod record;

use std::sync::Arc;

use axum::body::Body;
use axum::http::Response;
use axum::http::header::{self, HeaderValue};
use axum::http::request::Parts;

use self::record::record;
use super::Forwarder;
use crate::errors::ApiError;
use crate::prompt::body::Api;
use crate::request::{Payload, RequestId};
use crate::response_cache::answer::Answer;
use crate::response_cache::coalesce::Joined;
use crate::response_cache::key::{self, Cacheable, Classified};
use crate::response_cache::metrics::ModelResult;
use crate::response_cache::semantic::{Found, SIMILARITY_HEADER};
use crate::response_cache::{RESULT_HEADER, ResponseCache, unix_ms};

/// Bodies up to this size are keyed on the event loop; larger ones on the
/// tokenizer pool.
const INLINE_KEY_BYTES: usize = 256 << 10;

/// What the cache did with a request: the header's value (`hit`,
/// `semantic-hit`, `miss` or `bypass`).
pub(super) type Result_ = &'static str;

impl Forwarder {
    /// Serves a request with the response cache on: its answer and what
    /// the cache did (`hit`, `miss` or `bypass`).
    pub(super) async fn cached(
        self: &Arc<Self>,
        cache: &Arc<ResponseCache>,
        parts: &Parts,
        body: Body,
        id: &RequestId,
    ) -> (Result<Response<Body>, ApiError>, Result_) {
        let (path, headers) = (parts.uri.path(), &parts.headers);
        let mut admitted = match self.service.admit(path, headers) {
            Ok(a) => a,
            Err(e) => return (Err(e), "bypass"),
        };
        if let Err(e) = admitted.read(body).await {
            return (Err(admitted.refuse(e)), "bypass");
        }
        let bytes = admitted.received.bytes();
        let known = self.service.models().await;
        let classify = {
            let (cache, known, bytes) = (cache.clone(), known.clone(), bytes.clone());
            let (path, headers) = (path.to_owned(), headers.clone());
            let tenant = admitted.tenant().map(str::to_owned);
            move || {
                let roots = |m: &str| known.roots.get(m).into_iter().flatten().cloned().collect();
                key::classify(
                    cache.keying(),
                    &path,
                    &headers,
                    tenant.as_deref(),
                    &bytes,
                    roots,
                )
            }
        };
        // A large body's key is a pass over all of it: off the event loop.
        let classified = if bytes.len() <= INLINE_KEY_BYTES {
            classify()
        } else {
            match self.service.off_loop(classify).await {
                Ok(c) => c,
                Err(e) => return (Err(admitted.refuse(e)), "bypass"),
            }
        };
        let label = |m: &str| {
            if known.ids.contains(m) {
                m.to_owned()
            } else {
                "unknown".into()
            }
        };
        let count = |model: &str, result| {
            let labels = ModelResult {
                model: label(model),
                result,
            };
            cache.metrics.requests.get_or_create(&labels).inc();
        };
        let c = match classified {
            // A model the endpoints do not serve is the decision's 404.
            Classified::Cacheable(c)
                if known.ids.is_empty() || known.ids.contains(&c.key.model) =>
            {
                c
            }
            other => {
                let model = match &other {
                    Classified::Cacheable(c) => c.key.model.as_str(),
                    Classified::Bypass(_) => "",
                };
                count(model, "bypass");
                let payload = Payload::Received(Box::new(admitted));
                return (self.routed(parts, payload, id).await, "bypass");
            }
        };
        let mut failed = false;
        let mut lead = None;
        if c.read {
            match cache.get(&c.key).await {
                Ok(Some(answer)) => {
                    count(&c.key.model, "hit");
                    admitted.answered(&label(&c.key.model));
                    return (Ok(self.hit(cache, &c, &answer, id)), "hit");
                }
                Ok(None) => {}
                Err(_) => failed = true,
            }
            if cache.config.coalesce_wait_ms > 0 {
                match cache.inflight.join(c.key.digest) {
                    Joined::Lead(l) => lead = Some(l),
                    // A stream's first event must not wait for another
                    // request's whole answer: it goes to an engine.
                    Joined::Follow(_) if c.form.stream => {}
                    Joined::Follow(f) => {
                        let wait = std::time::Duration::from_millis(cache.config.coalesce_wait_ms);
                        if let Some(answer) = f.answer(wait).await {
                            count(&c.key.model, "hit");
                            cache.metrics.coalesced.inc();
                            admitted.answered(&label(&c.key.model));
                            return (Ok(self.hit(cache, &c, &answer, id)), "hit");
                        }
                    }
                }
            }
        }
        let mut remember = None;
        if let (true, Some(semantic), Some(question)) = (c.read, &cache.semantic, &c.question) {
            let tenant = admitted.tenant();
            match semantic.lookup(tenant, &c.key.model, question).await {
                Found::Similar(found, again) => {
                    if let Ok(Some(answer)) = cache.get(&found.key).await {
                        count(&c.key.model, "semantic_hit");
                        admitted.answered(&label(&c.key.model));
                        if let Some(lead) = lead.take() {
                            lead.end(Some(answer.clone()));
                        }
                        let mut response = self.hit(cache, &c, &answer, id);
                        let similarity = HeaderValue::from_str(&format!("{:.4}", found.similarity));
                        if let Ok(v) = similarity {
                            response.headers_mut().insert(SIMILARITY_HEADER, v);
                        }
                        semantic.served(&again, answer_id(&c, id), label(&c.key.model));
                        return (Ok(response), "semantic-hit");
                    }
                    remember = Some((semantic.clone(), again));
                }
                Found::Unmatched(r) => remember = r.map(|r| (semantic.clone(), r)),
            }
        }
        count(&c.key.model, if failed { "error" } else { "miss" });
        if let Some(body) = &c.forward
            && let Err(e) = admitted.received.replace(body.clone())
        {
            return (Err(admitted.refuse(e)), "miss");
        }
        let response = match self
            .routed(parts, Payload::Received(Box::new(admitted)), id)
            .await
        {
            Ok(r) => r,
            Err(e) => return (Err(e), "miss"),
        };
        (
            Ok(record(cache.clone(), c, (lead, remember), response)),
            "miss",
        )
    }

    /// `answer` rendered as `c` asked for it, named after the request.
    fn hit(
        &self,
        cache: &ResponseCache,
        c: &Cacheable,
        answer: &Answer,
        id: &RequestId,
    ) -> Response<Body> {
        let id = answer_id(c, id);
        let now = unix_ms();
        let body = answer.render(c.form, &id, now / 1000);
        let content_type = if c.form.stream {
            "text/event-stream"
        } else {
            "application/json"
        };
        let mut response = Response::new(Body::from(body));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        if c.form.stream {
            // As an engine's stream says: intermediaries must not keep it.
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        }
        if cache.config.age_header {
            let age = now.saturating_sub(answer.stored_unix_ms) / 1000;
            headers.insert(header::AGE, HeaderValue::from(age));
        }
        response
    }
}

/// The `id` of a hit's answer: named after the request, as vLLM names
/// its answers.
fn answer_id(c: &Cacheable, id: &RequestId) -> String {
    let prefix = match c.form.api {
        Api::Chat => "chatcmpl",
        Api::Completion | Api::Other => "cmpl",
    };
    format!("{prefix}-{}", id.header().to_str().unwrap_or_default())
}

/// Sets the header saying what the cache did.
pub(super) fn mark(response: &mut Response<Body>, result: Result_) {
    (response.headers_mut()).insert(RESULT_HEADER, HeaderValue::from_static(result));
}
