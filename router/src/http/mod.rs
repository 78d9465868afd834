//! The HTTP front end: the OpenAI-compatible API port's forwarder. It hands
//! each request to the decision service ([`Service::decide`]), sends it to
//! the first target, retrying on the next ones while no response byte has
//! been received, commits the attempt whose response begins
//! ([`Decision::commit`]) and streams that response back frame by frame as
//! the engine sends it ([`respond`]). With the response cache on, a request
//! goes through it first ([`cached`]).
//!
//! Not here: admission, reading the prompt, the plan and every count
//! ([`crate::request`]); the listeners' limits ([`crate::listener`]).

mod cached;
mod clients;
mod headers;
mod legs;
mod respond;
mod routes;
mod upstream;

use std::sync::Arc;

use axum::body::Body;
use axum::http::header::{self, HeaderName};
use axum::http::request::Parts;
use axum::http::{Request, Response, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use tokio::time::Instant;
use tracing::Instrument;

use self::clients::Clients;
pub use self::clients::on_api_thread;
use self::headers::end_to_end;
pub(crate) use self::routes::routes;
use crate::config::Config;
use crate::errors::ApiError;
use crate::pool::Fault;
use crate::request::recent::REQUEST_ID;
use crate::request::{Ask, Attempt, Decision, Payload, RequestId, Service, refusal};

/// An attempt's outcome: the response and its first body frame, or why it
/// failed and whether that is the endpoint's fault.
type Outcome = Result<(Response<Incoming>, Option<Frame<Bytes>>), (ApiError, Option<Fault>)>;

/// The forwarder's state.
#[derive(Debug)]
pub struct Forwarder {
    /// The decision service.
    pub service: Arc<Service>,
    clients: Clients,
    attempts: u32,
    endpoint_header: Option<HeaderName>,
    /// Client headers never forwarded: `Authorization` and the tenant
    /// header unless configured otherwise.
    private_headers: Vec<HeaderName>,
}

impl Forwarder {
    /// A forwarder deciding with `service`, configured by `config`.
    pub fn new(service: Arc<Service>, config: &Config) -> Self {
        let mut private_headers = Vec::new();
        if !config.proxy.forward_authorization {
            private_headers.push(header::AUTHORIZATION);
        }
        if !config.proxy.forward_tenant_header
            && let Some(h) = service.tenancy().header()
        {
            private_headers.push(h.clone());
        }
        let endpoint_header = &config.telemetry.endpoint_header.0;
        Forwarder {
            clients: Clients::new(&config.limits),
            attempts: config.resilience.attempts,
            endpoint_header: endpoint_header.as_ref().map(|h| h.0.clone()),
            private_headers,
            service,
        }
    }

    /// Serves one proxied request; when traces are exported, inside a span
    /// joined to the client's trace context.
    pub async fn serve(self: &Arc<Self>, request: Request<Body>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let span = crate::telemetry::request_span(parts.uri.path(), &parts.headers);
        let id = RequestId::of(&parts.headers);
        let mut result = None;
        let served = async {
            let Some(cache) = &self.service.response_cache else {
                return self.routed(&parts, Payload::Stream(body), &id).await;
            };
            let (served, r) = self.cached(cache, &parts, body, &id).await;
            result = Some(r);
            served
        };
        let mut response = match served.instrument(span).await {
            Ok(response) => response,
            Err(e) => {
                tracing::debug!(error = %e, path = %parts.uri.path(), "request refused");
                axum::response::IntoResponse::into_response(e)
            }
        };
        if let Some(r) = result {
            cached::mark(&mut response, r);
        }
        let headers = response.headers_mut();
        headers.insert(REQUEST_ID, id.header().clone());
        response
    }

    /// Decides a request with `body` and forwards it.
    async fn routed(
        self: &Arc<Self>,
        parts: &Parts,
        body: Payload,
        id: &RequestId,
    ) -> Result<Response<Body>, ApiError> {
        let ask = Ask {
            path: parts.uri.path(),
            headers: &parts.headers,
            body,
            among: &|_| true,
            fairness: None,
            id: id.clone(),
        };
        let mut decision = self.service.decide(ask).await?;
        self.prefill(parts, &mut decision).await?;
        Ok(self.forward(parts, decision).await)
    }

    async fn forward(self: &Arc<Self>, parts: &Parts, mut decision: Decision) -> Response<Body> {
        let mut last_error = ApiError::Upstream("no attempt was made".into());
        let mut last_response: Option<Response<Incoming>> = None;
        // Fewer targets than attempts (endpoints ejected or full): the
        // ranking is tried again from the top, as Envoy retries a host. An
        // engine's admission refusal is not an attempt: the request is
        // planned again and starts over.
        let (mut n, mut tried, mut skipped) = (0, 0, 0);
        while tried < self.attempts as usize {
            let targets = decision.targets();
            let target = &targets[n % targets.len()].clone();
            let bound = decision.admit_within(target);
            // Held until dropped: whether this attempt fails, the client
            // goes away while it waits, or the response ends.
            let Some(attempt) = decision.send(n, target) else {
                // Ejected, or its one trial taken, since the plan.
                (n, skipped) = (n + 1, skipped + 1);
                if skipped >= targets.len() {
                    last_error = ApiError::Unavailable { retry_after: 1 };
                    break;
                }
                continue;
            };
            (n, tried, skipped) = (n + 1, tried + 1, 0);
            let sent = Instant::now();
            let (body, id) = (decision.body(), decision.id());
            let upstream = upstream::request(parts, body, target, id, bound, &self.private_headers);
            let (first, attempt) = match upstream {
                Err(e) => (Err(e), attempt),
                Ok(upstream) => {
                    // With a hang deadline the attempt outlives a client
                    // that leaves, until its first byte or the deadline,
                    // so a hung engine is found even when every client
                    // gives up sooner; without one, leaving cancels it.
                    let mut task = Watched {
                        abort: attempt.hang.is_none(),
                        task: tokio::spawn(self.clone().attempt(upstream, attempt, sent)),
                    };
                    match (&mut task.task).await {
                        Ok(done) => done,
                        Err(e) => {
                            last_error = ApiError::Internal(format!("the attempt failed: {e}"));
                            continue;
                        }
                    }
                }
            };
            let name = attempt.target.name.clone();
            let warnings = &self.service.accounting.warnings;
            match first {
                Ok((response, _))
                    if let Some(refusal) =
                        bound.and_then(|_| refusal(response.status(), response.headers())) =>
                {
                    decision.refused(attempt, refusal);
                    if let Err(e) = self.service.plan_again(&mut decision).await {
                        (last_error, last_response) = (e, None);
                        break;
                    }
                    (n, tried) = (0, tried - 1);
                }
                Ok((response, _)) if retried(response.status()) => {
                    let status = response.status();
                    // A refusal the router did not ask for is no fault.
                    let refused = refusal(status, response.headers()).is_some();
                    let fault = (status.is_server_error() && !refused).then_some(Fault::Status);
                    decision.failed(attempt, "status", fault);
                    if let Some(times) = warnings.admit(&name, "status") {
                        tracing::info!(endpoint = %name, %status, attempt = tried - 1, times, "retrying on the next endpoint");
                    }
                    last_error = ApiError::Upstream(format!("{name} answered {status}"));
                    last_response = Some(response);
                }
                Ok((response, first)) => {
                    let guard = decision.commit(attempt, response.status(), sent);
                    let header = self.endpoint_header.as_ref();
                    return respond::respond(header, response, first, &name, guard);
                }
                Err((e, fault)) => {
                    // Dropping the response future or body first cancels
                    // the request at the engine. The attempt counted its
                    // own timeout.
                    let kind = fault.map_or("transport", Fault::as_str);
                    if fault == Some(Fault::Timeout) {
                        drop(attempt);
                    } else {
                        decision.failed(attempt, kind, fault);
                    }
                    if let Some(times) = warnings.admit(&name, kind) {
                        tracing::info!(endpoint = %name, error = %e, attempt = tried - 1, times, "attempt failed");
                    }
                    last_error = e;
                }
            }
        }
        // Every attempt failed before a byte was forwarded: the last
        // engine answer if there was one, else the last error.
        let response = match last_response {
            Some(response) => {
                let (mut parts, body) = response.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                end_to_end(&mut parts.headers);
                Response::from_parts(parts, Body::from(body))
            }
            None => {
                tracing::debug!(error = %last_error, path = %parts.uri.path(), "request failed");
                axum::response::IntoResponse::into_response(last_error)
            }
        };
        decision.answered(response.status());
        response
    }

    /// One attempt sent at `sent`: the response headers, then, with a hang
    /// deadline ([`crate::request::hang`]), the first body frame within it.
    /// A timeout is counted against the endpoint here, whether or not the
    /// client still waits.
    async fn attempt(
        self: Arc<Self>,
        upstream: Request<Full<Bytes>>,
        attempt: Attempt,
        sent: Instant,
    ) -> (Outcome, Attempt) {
        let (target, hang) = (&attempt.target.name, attempt.hang);
        let timeout = hang.unwrap_or(self.service.accounting.hang_cap());
        let timed_out = || {
            let e = format!(
                "{target} sent no response within {} ms",
                timeout.as_millis()
            );
            (ApiError::Timeout(e), Some(Fault::Timeout))
        };
        let deadline = sent + timeout;
        let outcome =
            match tokio::time::timeout_at(deadline, self.clients.get().request(upstream)).await {
                Err(_) => Err(timed_out()),
                // An upload the engine cut off is not counted against it.
                Ok(Err(e)) => {
                    let upload_cut = std::error::Error::source(&e)
                        .and_then(|s| s.downcast_ref::<hyper::Error>())
                        .is_some_and(hyper::Error::is_body_write_aborted);
                    let fault = (!upload_cut).then_some(Fault::Connect);
                    Err((ApiError::Upstream(format!("{target}: {e}")), fault))
                }
                // No byte has reached the client yet: the first body frame is
                // awaited within the hang deadline, so a hung engine that
                // sent its headers is retried too. A stream that breaks or
                // stays silent is the engine's fault; the response is dropped,
                // which cancels the request at the engine.
                Ok(Ok(response)) if hang.is_some() && !retried(response.status()) => {
                    let (head, mut incoming) = response.into_parts();
                    if hyper::body::Body::is_end_stream(&incoming) {
                        Ok((Response::from_parts(head, incoming), None))
                    } else {
                        match tokio::time::timeout_at(deadline, incoming.frame()).await {
                            Ok(Some(Ok(frame))) => {
                                Ok((Response::from_parts(head, incoming), Some(frame)))
                            }
                            Ok(None) => Ok((Response::from_parts(head, incoming), None)),
                            Ok(Some(Err(e))) => Err((
                                ApiError::Upstream(format!("{target}: {e}")),
                                Some(Fault::Stream),
                            )),
                            Err(_) => Err(timed_out()),
                        }
                    }
                }
                Ok(Ok(response)) => Ok((response, None)),
            };
        if let Err((_, Some(Fault::Timeout))) = &outcome {
            let fault = Some(Fault::Timeout);
            let service = &self.service;
            let kind = Fault::Timeout.as_str();
            (service.accounting).failure(&service.pool, &attempt.target.name, kind, fault);
        }
        (outcome, attempt)
    }
}

/// An attempt's task, aborted when dropped if `abort`.
struct Watched<T> {
    task: tokio::task::JoinHandle<T>,
    abort: bool,
}

impl<T> Drop for Watched<T> {
    fn drop(&mut self) {
        if self.abort {
            self.task.abort();
        }
    }
}

/// Whether an engine's answer with `status` is retried elsewhere.
fn retried(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}
