//! One request's `ext_proc` exchange, from the request headers to the end of
//! the response. What it does, in order:
//!
//! 1. Request headers: checks the credentials (and that the path is
//!    proxied when a body follows) and reads the subset hint. It answers
//!    nothing yet: the decision needs the body.
//! 2. Request body chunks: kept within the body limits of
//!    [`crate::request::body`] (size, budget, timeout, minimum rate); chunks may
//!    split anywhere.
//! 3. The body's end (`end_of_stream`, or the request trailers): the same
//!    decision as the HTTP forwarder's ([`Service::decide`]), among the hinted
//!    endpoints. The answer: the headers response with the ranked
//!    `x-gateway-destination-endpoint` list and the same `envoy.lb`
//!    metadata (and any `x-kvroute-*` header the client sent removed, as
//!    the HTTP front end drops them), then the body (rewritten when tenancy sets `cache_salt`),
//!    in chunks; then the trailers response if trailers ended it. A request
//!    without a body goes to the least loaded endpoint at once. Once the
//!    answers are sent, the body's budget is given back.
//! 4. Response headers, within `limits.firstByteTimeoutMs` of the pick
//!    (else the stream ends with `DEADLINE_EXCEEDED` and the request's
//!    load is released): the endpoint that served (`…-served`, which may
//!    differ from the pick when the gateway fell back) takes the request's
//!    load, and the policy learns it there, not at the pick.
//! 5. Response body and trailers: passed back as they come, never
//!    buffered; the first chunk ends the prefill, the end counts the
//!    request and reads `usage`.
//!
//! A refusal (400, 401, 404, 413, 429, 503, …) is an immediate response
//! with an OpenAI-style body, and ends the exchange. A message out of order
//! ends it with a gRPC error. When the gateway drops the stream, whatever
//! the request held (its load, its body budget) is released with it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_request::Request as Message,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use super::envoy::{self, Direction, Headers, Subset};
use crate::errors::ApiError;
use crate::pool::{Fault, InFlight, Target};
use crate::request::body::Held;
use crate::request::recent::{CACHE_HEADER, REQUEST_ID};
use crate::request::{
    Admitted, Ask, Attempt, Decision, Guard, Payload, RequestId, Service, SplitOutcome, routers_own,
};

/// Serves one `Process` stream: reads the gateway's messages and sends the
/// answers on `out` until the request is over or the stream ends.
pub(crate) async fn run(
    service: Arc<Service>,
    mut inbound: Streaming<ProcessingRequest>,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    rules: Rules,
) {
    let mut exchange = Exchange {
        service,
        echo_response: true,
        started: Instant::now(),
        rules,
        phase: Phase::Start,
    };
    loop {
        let next = match exchange.deadline() {
            Some(deadline) => match tokio::time::timeout_at(deadline, inbound.message()).await {
                Ok(next) => next,
                Err(_) => {
                    let stop = exchange.expired();
                    send(&out, Vec::new(), Some(stop)).await;
                    return;
                }
            },
            None => inbound.message().await,
        };
        let message = match next {
            Ok(Some(m)) => m,
            // The gateway closed its side: the request is over.
            Ok(None) => return exchange.ended(),
            Err(status) => {
                // A message over the size limit, a malformed one, or the
                // gateway's reset: say why (a reset stream drops it).
                tracing::debug!(%status, "the ext_proc stream failed");
                let _ = out.send(Err(status)).await;
                return;
            }
        };
        let (answers, stop) = match exchange.on(message).await {
            Ok(answers) => (answers, None),
            Err(stop) => (Vec::new(), Some(stop)),
        };
        // Once the response has ended there is nothing left to follow:
        // closing our side ends the exchange.
        if !send(&out, answers, stop).await || matches!(exchange.phase, Phase::Done) {
            return;
        }
        exchange.forwarded();
    }
}

/// Sends `answers`, then what `stop` says; returns whether the exchange
/// goes on.
async fn send(
    out: &mpsc::Sender<Result<ProcessingResponse, Status>>,
    answers: Vec<ProcessingResponse>,
    stop: Option<Stop>,
) -> bool {
    for answer in answers {
        if out.send(Ok(answer)).await.is_err() {
            return false;
        }
    }
    match stop {
        None => true,
        Some(Stop::Refuse(e)) => {
            let _ = out.send(Ok(envoy::refusal(&e))).await;
            false
        }
        Some(Stop::Protocol(status)) => {
            tracing::warn!(%status, "ext_proc stream ended");
            let _ = out.send(Err(status)).await;
            false
        }
    }
}

/// Why an exchange ends early.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The request is refused: the gateway answers the client with it.
    Refuse(ApiError),
    /// The gateway broke the protocol.
    Protocol(Status),
}

struct Exchange {
    service: Arc<Service>,
    /// Whether response body chunks go back to the gateway
    /// (`FULL_DUPLEX_STREAMED`), or are acknowledged only.
    echo_response: bool,
    /// When the stream opened, then when the request headers arrived.
    started: Instant,
    rules: Rules,
    phase: Phase,
}

/// What the picker's configuration sets for every exchange.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    /// `extProc.firstMessageTimeoutMs`.
    pub(crate) first_message: Duration,
    /// Whether the gateway's reports are trusted ([`ExtProc::trusted`]):
    /// only then do the statuses it reports feed ejection.
    ///
    /// [`ExtProc::trusted`]: crate::config::ExtProc::trusted
    pub(crate) trusted: bool,
}

enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Receiving the request body.
    Body(Box<Pending>),
    /// Decided; waiting for the engine's response headers.
    Sent(Box<Picked>),
    /// Following the response.
    Response(Box<Guard>),
    /// Nothing left to follow.
    Done,
}

/// A request whose body is arriving.
struct Pending {
    path: String,
    headers: HeaderMap,
    admitted: Admitted,
    subset: Option<Subset>,
}

/// A decided request.
struct Picked {
    decision: Decision,
    /// The pick, holding its load.
    attempt: Attempt,
    sent: Instant,
    /// The body's share of the budget, until the body has gone out.
    budget: Option<Held>,
    /// Its prefill endpoint's load, when llm-d's sidecar runs its prefill
    /// leg there: until the response begins.
    prefill: Option<InFlight>,
}

impl Exchange {
    /// When the phase in progress times out: the first message's, the
    /// body's deadline, or
    /// `limits.firstByteTimeoutMs` after the pick for the response
    /// headers (the gateway's filter may never send them).
    fn deadline(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Start => Some(self.started + self.rules.first_message),
            Phase::Body(p) => Some(p.admitted.received.deadline().0),
            Phase::Sent(p) => Some(p.sent + self.service.first_byte_timeout()),
            _ => None,
        }
    }

    /// Ends the phase whose [`deadline`](Self::deadline) passed.
    fn expired(&mut self) -> Stop {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Start => Stop::Protocol(Status::deadline_exceeded(
                "no request headers within extProc.firstMessageTimeoutMs",
            )),
            Phase::Body(p) => {
                let error = p.admitted.received.expired();
                Stop::Refuse(p.admitted.refuse(error))
            }
            Phase::Sent(p) => {
                // Its load goes with it.
                p.decision.answered(StatusCode::GATEWAY_TIMEOUT);
                Stop::Protocol(Status::deadline_exceeded(
                    "no response headers from the gateway within limits.firstByteTimeoutMs",
                ))
            }
            phase => {
                self.phase = phase;
                protocol("a deadline in a phase without one")
            }
        }
    }

    /// The answers sent so far are on their way: the body they carried no
    /// longer needs its budget.
    fn forwarded(&mut self) {
        if let Phase::Sent(p) = &mut self.phase {
            p.budget = None;
        }
    }

    /// Refuses the request in progress, counted with the error's status.
    fn refuse(&mut self, error: ApiError) -> Stop {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Body(p) => Stop::Refuse(p.admitted.refuse(error)),
            Phase::Sent(p) => {
                p.decision.answered(error.status());
                Stop::Refuse(error)
            }
            _ => Stop::Refuse(error),
        }
    }

    /// The gateway ended the stream cleanly: a response being followed is
    /// complete (its end may not have been sent, e.g. with trailers or body
    /// processing off).
    fn ended(self) {
        if let Phase::Response(mut guard) = self.phase {
            guard.done();
        }
    }

    async fn on(&mut self, message: ProcessingRequest) -> Result<Vec<ProcessingResponse>, Stop> {
        let metadata = message.metadata_context;
        if let Some(config) = message.protocol_config {
            let request = config.request_body_mode();
            if request != BodySendMode::FullDuplexStreamed {
                return Err(Stop::Protocol(Status::failed_precondition(format!(
                    "kvroute's endpoint picker needs processing_mode.request_body_mode \
                     FULL_DUPLEX_STREAMED (with request_trailer_mode SEND); this filter sends {}",
                    request.as_str_name()
                ))));
            }
            self.echo_response = config.response_body_mode() == BodySendMode::FullDuplexStreamed;
        }
        let Some(message) = message.request else {
            return Err(protocol("a ProcessingRequest without a message"));
        };
        match (std::mem::replace(&mut self.phase, Phase::Done), message) {
            (Phase::Start, Message::RequestHeaders(h)) => {
                self.started = Instant::now();
                let headers = Headers::read(h.headers.as_ref());
                let subset = Subset::read(metadata.as_ref(), &headers.map);
                let path = headers.path.as_deref().unwrap_or("/");
                let path = path.split('?').next().unwrap_or(path).to_owned();
                if h.end_of_stream {
                    let body = Payload::Bodiless;
                    return self.decide(&path, &headers.map, body, subset, false).await;
                }
                let admitted = self
                    .service
                    .admit(&path, &headers.map)
                    .map_err(Stop::Refuse)?;
                self.phase = Phase::Body(Box::new(Pending {
                    path,
                    headers: headers.map,
                    admitted,
                    subset,
                }));
                Ok(Vec::new())
            }
            (Phase::Body(mut pending), Message::RequestBody(b)) => {
                if let Err(e) = pending.admitted.received.push(b.body.into()) {
                    self.phase = Phase::Body(pending);
                    return Err(self.refuse(e));
                }
                if b.end_of_stream {
                    self.decided(*pending, true).await
                } else {
                    self.phase = Phase::Body(pending);
                    Ok(Vec::new())
                }
            }
            (Phase::Body(pending), Message::RequestTrailers(_)) => {
                let mut answers = self.decided(*pending, false).await?;
                answers.push(envoy::trailers_unchanged(Direction::Request));
                Ok(answers)
            }
            (Phase::Sent(picked), Message::ResponseHeaders(h)) => {
                let headers = Headers::read(h.headers.as_ref());
                let served = envoy::served(metadata.as_ref(), &headers.map);
                let status = headers.status.unwrap_or(StatusCode::OK);
                let mut guard = self.served(*picked, served, status);
                let mut set = vec![(REQUEST_ID, guard.id().header().clone())];
                set.extend(guard.cache_header().map(|v| (CACHE_HEADER, v)));
                if h.end_of_stream {
                    guard.done();
                } else {
                    self.phase = Phase::Response(Box::new(guard));
                }
                Ok(vec![envoy::response_headers(&set)])
            }
            (Phase::Response(mut guard), Message::ResponseBody(b)) => {
                guard.data(&b.body);
                if b.end_of_stream {
                    guard.done();
                } else {
                    self.phase = Phase::Response(guard);
                }
                Ok(if self.echo_response {
                    envoy::body(Direction::Response, &b.body, b.end_of_stream)
                } else {
                    vec![envoy::body_unchanged(Direction::Response)]
                })
            }
            (phase, Message::ResponseTrailers(_))
                if matches!(phase, Phase::Response(_) | Phase::Done) =>
            {
                if let Phase::Response(mut guard) = phase {
                    guard.done();
                }
                Ok(vec![envoy::trailers_unchanged(Direction::Response)])
            }
            (phase, message) => {
                let expected = match phase {
                    Phase::Start => "the request headers (request_header_mode SEND)",
                    Phase::Body(_) => "the request body or trailers",
                    Phase::Sent(_) => "the response headers (response_header_mode SEND)",
                    Phase::Response(_) => "the response body or trailers",
                    Phase::Done => "nothing more",
                };
                self.phase = phase;
                Err(protocol(&format!(
                    "expected {expected}, got {}",
                    name(&message)
                )))
            }
        }
    }

    /// Decides a request whose body has arrived; `end_of_stream` when the
    /// body's last chunk ended it (else its trailers did).
    async fn decided(
        &mut self,
        pending: Pending,
        end_of_stream: bool,
    ) -> Result<Vec<ProcessingResponse>, Stop> {
        let Pending {
            path,
            headers,
            admitted,
            subset,
        } = pending;
        let body = Payload::Received(Box::new(admitted));
        self.decide(&path, &headers, body, subset, end_of_stream)
            .await
    }

    /// Decides a request to `path` among the hinted endpoints, and answers
    /// with the ranked destinations and its body (in chunks, the last one
    /// ending the stream when `end_of_stream`). A request without a body
    /// (headers with `end_of_stream`) has nothing to read: the least loaded
    /// endpoint, at once.
    async fn decide(
        &mut self,
        path: &str,
        headers: &HeaderMap,
        body: Payload,
        subset: Option<Subset>,
        end_of_stream: bool,
    ) -> Result<Vec<ProcessingResponse>, Stop> {
        let among = |a: &SocketAddr| subset.as_ref().is_none_or(|s| s.allows(a));
        let ask = Ask {
            path,
            headers,
            body,
            among: &among,
            fairness: (headers.get(crate::flow::FAIRNESS_HEADER))
                .and_then(|v| v.to_str().ok())
                .filter(|_| self.rules.trusted),
            id: RequestId::of(headers),
        };
        let mut decision = self.service.decide(ask).await.map_err(Stop::Refuse)?;
        // A disaggregated request: llm-d's sidecar on the decode endpoint
        // runs the legs ([`crate::request::Service::split`]).
        // Its prefill endpoint's load is counted until the response begins.
        let (mut prefiller, mut prefill) = (None, None);
        if let Some(p) = self.service.split(path, &decision).await {
            let request = decision.analysis().request();
            let uncached = request.prompt_tokens.saturating_sub(p.cached);
            let target = p.plan.targets.first();
            prefill = target.and_then(|t| self.service.pool.start(&request, t, uncached));
            prefiller = target.filter(|_| prefill.is_some()).map(|t| t.http);
            (self.service.accounting.metrics.split).count(match prefiller {
                Some(_) => SplitOutcome::Disaggregated,
                None => SplitOutcome::FallbackLocal,
            });
        }
        let (body, budget) = decision.take_body();
        let own = (headers.keys())
            .filter(|n| routers_own(n))
            .map(|n| n.as_str().to_owned())
            .collect();
        let mut answers = vec![envoy::destination(
            &ranked(decision.targets()),
            (!body.is_empty()).then_some(body.len()),
            decision.id(),
            (prefiller, own),
        )];
        if budget.is_some() {
            answers.extend(envoy::body(Direction::Request, &body, end_of_stream));
        }
        drop(body);
        let attempt = decision.pick();
        self.phase = Phase::Sent(Box::new(Picked {
            decision,
            attempt,
            sent: Instant::now(),
            budget,
            prefill,
        }));
        Ok(answers)
    }

    /// The response began at `served` (the pick when the gateway does not
    /// say): the request's load and the policy's memory go there.
    fn served(&mut self, picked: Picked, served: Option<SocketAddr>, status: StatusCode) -> Guard {
        let Picked {
            decision,
            attempt,
            sent,
            budget,
            prefill,
        } = picked;
        drop((budget, prefill));
        let other = served
            .filter(|addr| *addr != attempt.target.http)
            .and_then(|addr| self.service.pool.target_at(addr));
        let attempt = match other {
            Some(other) => decision.instead(other),
            None => attempt,
        };
        if status.is_server_error() && self.rules.trusted {
            let failed = self
                .service
                .pool
                .failed(&attempt.target.name, Fault::Status);
            self.service.accounting.metrics.health(failed);
        }
        decision.commit(attempt, status, sent)
    }
}

/// The ranked endpoints as the destination header carries them.
fn ranked(targets: &[Target]) -> String {
    targets
        .iter()
        .map(|t| t.http.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn protocol(what: &str) -> Stop {
    Stop::Protocol(Status::invalid_argument(format!(
        "ext_proc protocol: {what}"
    )))
}

fn name(message: &Message) -> &'static str {
    match message {
        Message::RequestHeaders(_) => "request headers",
        Message::RequestBody(_) => "a request body chunk",
        Message::RequestTrailers(_) => "request trailers",
        Message::ResponseHeaders(_) => "response headers",
        Message::ResponseBody(_) => "a response body chunk",
        Message::ResponseTrailers(_) => "response trailers",
    }
}
