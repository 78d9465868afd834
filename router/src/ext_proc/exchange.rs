//! One request's `ext_proc` exchange, from the request headers to the end of
//! the response. What it does, in order:
//!
//! 1. Request headers: checks the credentials (and that the path is
//!    proxied when a body follows) and reads the subset hint. It answers
//!    nothing yet: the decision needs the body.
//! 2. Request body chunks: kept within the body limits of
//!    [`crate::body`] (size, budget, timeout, minimum rate); chunks may
//!    split anywhere.
//! 3. The body's end (`end_of_stream`, or the request trailers): the same
//!    decision as the HTTP proxy's ([`Proxy::route`]), among the hinted
//!    endpoints. The answer: the headers response with the ranked
//!    `x-gateway-destination-endpoint` list and the same `envoy.lb`
//!    metadata, then the body (rewritten when tenancy sets `cache_salt`),
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
use kvroute_core::keys::RoutingKey;
use kvroute_core::policy::Request as RouteRequest;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use super::envoy::{self, Direction, Headers, Subset};
use crate::body::{Held, Received};
use crate::errors::ApiError;
use crate::pool::{Fault, InFlight, Target};
use crate::proxy::{Analysis, Expected, Guard, Labels, Proxy};

/// Serves one `Process` stream: reads the gateway's messages and sends the
/// answers on `out` until the request is over or the stream ends.
pub(crate) async fn run(
    proxy: Arc<Proxy>,
    mut inbound: Streaming<ProcessingRequest>,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    rules: Rules,
) {
    let mut exchange = Exchange {
        proxy,
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
    proxy: Arc<Proxy>,
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
    tenant: Option<String>,
    labels: Labels,
    received: Received,
    subset: Option<Subset>,
}

/// A decided request.
struct Picked {
    labels: Labels,
    /// Its analysis (the body taken out); none for a request without one.
    analysis: Option<Analysis>,
    pick: Target,
    /// Prompt tokens expected cached at the pick.
    cached: u64,
    load: InFlight,
    sent: Instant,
    /// The body's share of the budget, until the body has gone out.
    budget: Option<Held>,
}

impl Exchange {
    /// When the phase in progress times out: the first message's, the
    /// body's deadline, or
    /// `limits.firstByteTimeoutMs` after the pick for the response
    /// headers (the gateway's filter may never send them).
    fn deadline(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Start => Some(self.started + self.rules.first_message),
            Phase::Body(p) => Some(p.received.deadline().0),
            Phase::Sent(p) => Some(p.sent + self.proxy.first_byte_timeout()),
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
                let error = p.received.expired();
                refused(p.labels, error)
            }
            Phase::Sent(mut p) => {
                // Its load goes with it.
                p.labels.count(StatusCode::GATEWAY_TIMEOUT.as_str());
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
            Phase::Body(p) => refused(p.labels, error),
            Phase::Sent(p) => refused(p.labels, error),
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
                let mut labels = Labels::new(&self.proxy);
                if h.end_of_stream {
                    return self.bodiless(&headers.map, labels, subset).await;
                }
                let path = headers.path.as_deref().unwrap_or("/");
                let path = path.split('?').next().unwrap_or(path).to_owned();
                let admitted =
                    self.proxy
                        .admit(&path, &headers.map, &mut labels)
                        .and_then(|tenant| {
                            let declared = headers
                                .map
                                .get(axum::http::header::CONTENT_LENGTH)
                                .and_then(|v| v.to_str().ok()?.parse().ok());
                            let bodies = self.proxy.bodies();
                            let received = Received::new(bodies, declared, tenant.as_deref())?;
                            Ok((tenant, received))
                        });
                let (tenant, received) = match admitted {
                    Ok(a) => a,
                    Err(e) => return Err(refused(labels, e)),
                };
                self.phase = Phase::Body(Box::new(Pending {
                    path,
                    headers: headers.map,
                    tenant,
                    labels,
                    received,
                    subset,
                }));
                Ok(Vec::new())
            }
            (Phase::Body(mut pending), Message::RequestBody(b)) => {
                if let Err(e) = pending.received.push(b.body.into()) {
                    self.phase = Phase::Body(pending);
                    return Err(self.refuse(e));
                }
                if b.end_of_stream {
                    self.decide(*pending, true).await
                } else {
                    self.phase = Phase::Body(pending);
                    Ok(Vec::new())
                }
            }
            (Phase::Body(pending), Message::RequestTrailers(_)) => {
                let mut answers = self.decide(*pending, false).await?;
                answers.push(envoy::trailers_unchanged(Direction::Request));
                Ok(answers)
            }
            (Phase::Sent(picked), Message::ResponseHeaders(h)) => {
                let headers = Headers::read(h.headers.as_ref());
                let served = envoy::served(metadata.as_ref(), &headers.map);
                let status = headers.status.unwrap_or(StatusCode::OK);
                let mut guard = self.served(*picked, served, status);
                if h.end_of_stream {
                    guard.done();
                } else {
                    self.phase = Phase::Response(Box::new(guard));
                }
                Ok(vec![envoy::headers_unchanged(Direction::Response)])
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
    async fn decide(
        &mut self,
        pending: Pending,
        end_of_stream: bool,
    ) -> Result<Vec<ProcessingResponse>, Stop> {
        let Pending {
            path,
            headers,
            tenant,
            mut labels,
            received,
            subset,
            ..
        } = pending;
        let (bytes, budget) = received.finish();
        let among = |a: &SocketAddr| subset.as_ref().is_none_or(|s| s.allows(a));
        let routed = self
            .proxy
            .route(&path, &headers, tenant, bytes, &mut labels, &among)
            .await;
        let (mut analysis, plan) = match routed {
            Ok(r) => r,
            Err(e) => return Err(refused(labels, e)),
        };
        let body = std::mem::take(&mut analysis.bytes);
        let mut answers = vec![envoy::destination(
            &ranked(&plan.targets),
            (!body.is_empty()).then_some(body.len()),
        )];
        answers.extend(envoy::body(Direction::Request, &body, end_of_stream));
        drop(body);
        let pick = plan.targets[0].clone();
        let cached = analysis.expected_cached(plan.cached_blocks);
        self.proxy.count_routed(&labels, analysis.prompt_tokens);
        self.proxy.count_decision(plan.reason.as_str());
        let load = self.proxy.pool.hold(
            &pick,
            analysis.prompt_tokens,
            analysis.prompt_tokens - cached,
        );
        self.phase = Phase::Sent(Box::new(Picked {
            labels,
            analysis: Some(analysis),
            pick,
            cached,
            load,
            sent: Instant::now(),
            budget: Some(budget),
        }));
        self.proxy
            .metrics
            .decision_seconds
            .observe(self.started.elapsed().as_secs_f64());
        Ok(answers)
    }

    /// A request without a body (headers with `end_of_stream`): nothing to
    /// read, so the least loaded endpoint, at once.
    async fn bodiless(
        &mut self,
        headers: &HeaderMap,
        mut labels: Labels,
        subset: Option<Subset>,
    ) -> Result<Vec<ProcessingResponse>, Stop> {
        let among = |a: &SocketAddr| subset.as_ref().is_none_or(|s| s.allows(a));
        let request = RouteRequest {
            key: RoutingKey(0),
            chain: &[],
            prompt_tokens: 0,
        };
        let plan = match self.proxy.identify(headers, &mut labels) {
            Ok(_) => self.proxy.plan(&request, false, &among).await,
            Err(e) => Err(e),
        };
        let plan = match plan {
            Ok(p) => p,
            Err(e) => return Err(refused(labels, e)),
        };
        let pick = plan.targets[0].clone();
        self.proxy.count_routed(&labels, 0);
        self.proxy.count_decision(plan.reason.as_str());
        let load = self.proxy.pool.hold(&pick, 0, 0);
        let answer = envoy::destination(&ranked(&plan.targets), None);
        self.phase = Phase::Sent(Box::new(Picked {
            labels,
            analysis: None,
            pick,
            cached: 0,
            load,
            sent: Instant::now(),
            budget: None,
        }));
        Ok(vec![answer])
    }

    /// The response began at `served` (the pick when the gateway does not
    /// say): the request's load and the policy's memory go there.
    fn served(&mut self, picked: Picked, served: Option<SocketAddr>, status: StatusCode) -> Guard {
        let Picked {
            labels,
            analysis,
            pick,
            cached,
            mut load,
            sent,
            budget,
        } = picked;
        drop(budget);
        let prompt_tokens = analysis.as_ref().map_or(0, |a| a.prompt_tokens);
        let other = served
            .filter(|addr| *addr != pick.http)
            .and_then(|addr| self.proxy.pool.target_at(addr));
        let by = labels.model_tenant();
        let (target, cached) = match other {
            Some(other) => {
                load = self.proxy.pool.hold(&other, prompt_tokens, prompt_tokens);
                self.proxy.count_decision("retry");
                (other, 0)
            }
            None => {
                self.proxy.count_first_choice(&by, cached);
                (pick, cached)
            }
        };
        if let Some(a) = &analysis {
            self.proxy.pool.learn(&a.request(), &target);
        }
        if status.is_server_error() && self.rules.trusted {
            self.proxy
                .metrics
                .health(self.proxy.pool.failed(&target.name, Fault::Status));
        }
        Guard::new(
            &self.proxy,
            load,
            target.name,
            sent,
            labels,
            status,
            Expected {
                cached,
                prompt_tokens,
            },
        )
    }
}

/// Refuses a request, counted in `labels` with the error's status.
fn refused(mut labels: Labels, error: ApiError) -> Stop {
    labels.count(error.status().as_str());
    Stop::Refuse(error)
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
