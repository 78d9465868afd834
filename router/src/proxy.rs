//! The request path: read the body within its limit, extract what routing
//! needs, resolve the tenant, compute the prompt's block chain and routing
//! key, ask the pool for a ranked plan (waiting in a bounded queue when
//! every candidate is full), and forward to the first endpoint, retrying on
//! the next ones while no response byte has been received. The response
//! streams back frame by frame as the engine sends it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::request::Parts;
use axum::http::{Request, Response, StatusCode, Uri};
use bytes::Bytes;
use futures_util::stream;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_core::hash::BlockExtras;
use kvroute_core::keys::KeyInput;
use kvroute_core::load::Ticket;
use kvroute_core::policy::Request as RouteRequest;
use tokio::time::Instant;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::config::Limits;
use crate::errors::ApiError;
use crate::features::{self, Api};
use crate::metrics::Metrics;
use crate::pool::{Plan, Pool, Target};
use crate::settings::SharedSettings;
use crate::tenancy::Tenancy;

/// How long the union of the endpoints' models is reused.
const MODELS_TTL: Duration = Duration::from_secs(10);

/// Headers that describe one hop, never forwarded.
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

/// The proxy's shared state.
#[derive(Debug)]
pub struct Proxy {
    /// The pool requests go to.
    pub pool: Arc<Pool>,
    /// Tokenization, hashing and key settings.
    pub settings: Arc<SharedSettings>,
    /// Counters and histograms.
    pub metrics: Arc<Metrics>,
    tenancy: Tenancy,
    limits: Limits,
    attempts: u32,
    endpoint_header: Option<HeaderName>,
    client: Client<HttpConnector, Full<Bytes>>,
    queued: AtomicUsize,
    models: std::sync::Mutex<Option<(Instant, Arc<BTreeSet<String>>)>>,
    refreshing_models: AtomicBool,
}

impl Proxy {
    /// A proxy over `pool`.
    pub fn new(
        pool: Arc<Pool>,
        settings: Arc<SharedSettings>,
        metrics: Arc<Metrics>,
        tenancy: Tenancy,
        limits: Limits,
        attempts: u32,
        endpoint_header: &str,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(limits.connect_timeout_ms)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Proxy {
            pool,
            settings,
            metrics,
            tenancy,
            limits,
            attempts,
            endpoint_header: (!endpoint_header.is_empty())
                .then(|| HeaderName::from_bytes(endpoint_header.as_bytes()).ok())
                .flatten(),
            client,
            queued: AtomicUsize::new(0),
            models: std::sync::Mutex::new(None),
            refreshing_models: AtomicBool::new(false),
        }
    }

    /// Serves one proxied request, recording it in the metrics, inside a
    /// span joined to the client's trace context.
    pub async fn serve(self: &Arc<Self>, request: Request<Body>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let span = tracing::info_span!("proxy", path = %parts.uri.path());
        let parent = opentelemetry::global::get_text_map_propagator(|p| {
            p.extract(&crate::telemetry::HeaderExtractor(&parts.headers))
        });
        if let Err(e) = span.set_parent(parent) {
            tracing::debug!(error = %e, "no trace parent");
        }
        let mut model = String::new();
        let response = match self.handle(&parts, body, &mut model).instrument(span).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, path = %parts.uri.path(), "request refused");
                axum::response::IntoResponse::into_response(e)
            }
        };
        let status = response.status().as_u16().to_string();
        self.metrics.inc(
            "kvroute_requests_total",
            &[("model", &model), ("status", &status)],
            1.0,
        );
        response
    }

    async fn read_body(&self, parts: &Parts, body: Body) -> Result<Bytes, ApiError> {
        let limit = self.limits.max_body_bytes;
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            return Err(ApiError::TooLarge { limit });
        }
        match axum::body::to_bytes(body, limit).await {
            Ok(bytes) => Ok(bytes),
            Err(e) => {
                let too_large = std::error::Error::source(&e)
                    .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
                if too_large {
                    Err(ApiError::TooLarge { limit })
                } else {
                    Err(ApiError::BadRequest(format!(
                        "reading the request body: {e}"
                    )))
                }
            }
        }
    }

    async fn handle(
        self: &Arc<Self>,
        parts: &Parts,
        body: Body,
        model_label: &mut String,
    ) -> Result<Response<Body>, ApiError> {
        let decision_start = Instant::now();
        let mut bytes = self.read_body(parts, body).await?;
        let api = Api::of(parts.uri.path());
        let mut obj = features::parse(api, &bytes)?;
        let feats = obj
            .as_ref()
            .map(features::features)
            .transpose()?
            .unwrap_or_default();
        if let Some(model) = &feats.model {
            *model_label = model.clone();
            let known = self.models().await;
            if !known.is_empty() && !known.contains(model) {
                return Err(ApiError::NotFound(format!(
                    "The model `{model}` does not exist."
                )));
            }
        }
        let tenant = self.tenancy.tenant(&parts.headers)?;
        if let Some(o) = obj.as_mut()
            && self.tenancy.apply(tenant.as_deref(), o)?
        {
            bytes = Bytes::from(serde_json::to_vec(o).expect("a JSON map serializes"));
        }
        let salt = obj
            .as_ref()
            .and_then(|o| o.get("cache_salt"))
            .and_then(|v| v.as_str())
            .map(str::to_owned);

        let settings = self.settings.get();
        let tokens = match &obj {
            Some(o) => features::prompt_tokens(api, o, &settings)?,
            None => None,
        };
        let tokens = tokens.unwrap_or_default();
        let chain = settings.hasher.hashes(
            &tokens,
            BlockExtras {
                lora: None,
                cache_salt: salt.as_deref(),
            },
        );
        let conversation = feats.prompt_cache_key.clone().or_else(|| {
            parts
                .headers
                .get(&settings.conversation_header)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        let key = settings.key.key(&KeyInput {
            tenant: tenant.as_deref(),
            conversation: conversation.as_deref(),
            tokens: &tokens,
        });
        let prompt_tokens = if tokens.is_empty() {
            // No tokens (not JSON, or content we cannot tokenize): about
            // four bytes per token.
            bytes.len() as u64 / 4
        } else {
            tokens.len() as u64
        };
        let request = RouteRequest {
            key,
            chain: &chain,
            prompt_tokens,
        };
        let plan = self.plan(&request, !tokens.is_empty()).await?;
        self.metrics.observe(
            "kvroute_decision_seconds",
            &[],
            decision_start.elapsed().as_secs_f64(),
        );
        let block_tokens = settings.hasher.config().block_size as u64;
        self.forward(parts, bytes, &request, plan, block_tokens)
            .await
    }

    /// A plan with at least one target, waiting in the bounded queue while
    /// every routable endpoint is at its concurrency limit.
    async fn plan(&self, request: &RouteRequest<'_>, readable: bool) -> Result<Plan, ApiError> {
        let deadline = Instant::now() + Duration::from_millis(self.limits.queue_timeout_ms);
        let retry_after = self.limits.retry_after_s;
        loop {
            let released = self.pool.released();
            tokio::pin!(released);
            released.as_mut().enable();
            let plan = self.pool.plan(request, readable);
            if !plan.targets.is_empty() {
                return Ok(plan);
            }
            if plan.full == 0 {
                return Err(ApiError::Unavailable { retry_after });
            }
            if self.queued.fetch_add(1, Ordering::SeqCst) >= self.limits.queue_size {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                return Err(ApiError::Overloaded { retry_after });
            }
            let woke = tokio::time::timeout_at(deadline, released).await;
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if woke.is_err() {
                return Err(ApiError::Overloaded { retry_after });
            }
        }
    }

    async fn forward(
        self: &Arc<Self>,
        parts: &Parts,
        bytes: Bytes,
        request: &RouteRequest<'_>,
        plan: Plan,
        block_tokens: u64,
    ) -> Result<Response<Body>, ApiError> {
        let expected_cached =
            (u64::from(plan.cached_blocks) * block_tokens).min(request.prompt_tokens);
        self.metrics.inc("kvroute_routed_total", &[], 1.0);
        self.metrics.inc(
            "kvroute_prompt_tokens_total",
            &[],
            request.prompt_tokens as f64,
        );
        let mut last_error = ApiError::Upstream("no attempt was made".into());
        let mut last_response: Option<Response<Incoming>> = None;
        for (attempt, target) in plan.targets.iter().take(self.attempts as usize).enumerate() {
            let (reason, cached) = if attempt == 0 {
                (plan.reason.as_str(), expected_cached)
            } else {
                ("retry", 0)
            };
            self.metrics.inc(
                "kvroute_routing_decisions_total",
                &[("reason", reason)],
                1.0,
            );
            let ticket = self
                .pool
                .start(request, target, request.prompt_tokens - cached);
            let sent = Instant::now();
            match self.send(parts, &bytes, target).await {
                Ok(response)
                    if response.status().is_server_error()
                        || response.status() == StatusCode::TOO_MANY_REQUESTS =>
                {
                    self.pool.finish(ticket);
                    let status = response.status();
                    if status.is_server_error() {
                        self.pool.failed(&target.name);
                    }
                    self.failure(target, "status");
                    tracing::info!(endpoint = %target.name, %status, attempt, "retrying on the next endpoint");
                    last_error = ApiError::Upstream(format!("{} answered {status}", target.name));
                    last_response = Some(response);
                }
                Ok(response) => {
                    if attempt == 0 {
                        self.metrics.inc("kvroute_first_choice_total", &[], 1.0);
                        self.metrics.inc(
                            "kvroute_expected_cached_tokens_total",
                            &[],
                            cached as f64,
                        );
                    }
                    return Ok(self.respond(response, ticket, target, sent));
                }
                Err(e) => {
                    self.pool.finish(ticket);
                    self.pool.failed(&target.name);
                    let kind = if matches!(e, ApiError::Timeout(_)) {
                        "timeout"
                    } else {
                        "connect"
                    };
                    self.failure(target, kind);
                    tracing::info!(endpoint = %target.name, error = %e, attempt, "attempt failed");
                    last_error = e;
                }
            }
        }
        // Every attempt failed before a byte was forwarded: the last
        // engine answer if there was one, else the last error.
        match last_response {
            Some(response) => {
                let (parts, body) = response.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                Ok(Response::from_parts(parts, Body::from(body)))
            }
            None => Err(last_error),
        }
    }

    fn failure(&self, target: &Target, kind: &str) {
        self.metrics.inc(
            "kvroute_upstream_failures_total",
            &[("endpoint", &target.name), ("kind", kind)],
            1.0,
        );
    }

    async fn send(
        &self,
        parts: &Parts,
        bytes: &Bytes,
        target: &Target,
    ) -> Result<Response<Incoming>, ApiError> {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let uri: Uri = format!("http://{}{path}", target.http)
            .parse()
            .map_err(|e| ApiError::Upstream(format!("bad upstream URI: {e}")))?;
        let mut request = Request::builder()
            .method(parts.method.clone())
            .uri(uri)
            .body(Full::new(bytes.clone()))
            .map_err(|e| ApiError::Upstream(e.to_string()))?;
        copy_headers(&parts.headers, request.headers_mut());
        request.headers_mut().remove(header::HOST);
        // With tracing on, the engine's parent is this router's span; else
        // the client's traceparent passes through as copied.
        let context = tracing::Span::current().context();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(
                &context,
                &mut crate::telemetry::HeaderInjector(request.headers_mut()),
            )
        });
        request
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        let timeout = Duration::from_millis(self.limits.first_byte_timeout_ms);
        match tokio::time::timeout(timeout, self.client.request(request)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) => Err(ApiError::Upstream(format!("{}: {e}", target.name))),
            Err(_) => Err(ApiError::Timeout(format!(
                "{} sent no response within {} ms",
                target.name, self.limits.first_byte_timeout_ms
            ))),
        }
    }

    /// Streams the engine's response back frame by frame. The ticket
    /// records the first byte and the end; a broken stream ejects the
    /// endpoint and, for event streams, ends with an error event.
    fn respond(
        self: &Arc<Self>,
        response: Response<Incoming>,
        ticket: Ticket,
        target: &Target,
        sent: Instant,
    ) -> Response<Body> {
        let (mut parts, incoming) = response.into_parts();
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut headers = HeaderMap::new();
        copy_headers(&parts.headers, &mut headers);
        // A sized response stays sized (the body passes through whole).
        if let Some(length) = parts.headers.get(header::CONTENT_LENGTH) {
            headers.insert(header::CONTENT_LENGTH, length.clone());
        }
        if let Some(name) = &self.endpoint_header
            && let Ok(v) = HeaderValue::from_str(&target.name)
        {
            headers.insert(name.clone(), v);
        }
        parts.headers = headers;
        let guard = Guard {
            proxy: self.clone(),
            ticket: Some(ticket),
            name: target.name.clone(),
            sent,
            first: true,
        };
        let frames = stream::unfold(Some((incoming, guard)), move |state| async move {
            let (mut incoming, mut guard) = state?;
            match incoming.frame().await {
                Some(Ok(frame)) => {
                    if guard.first && frame.is_data() {
                        guard.first_byte();
                    }
                    Some((Ok::<_, std::io::Error>(frame), Some((incoming, guard))))
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

    /// The union of the endpoints' served models. The first call fetches
    /// it; later calls answer from the cache at once and, once it is older
    /// than [`MODELS_TTL`], refresh it in the background, so no request
    /// waits on the endpoints. Empty when no endpoint answered.
    pub async fn models(self: &Arc<Self>) -> Arc<BTreeSet<String>> {
        let cached = self
            .models
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match cached {
            Some((at, models)) => {
                if at.elapsed() >= MODELS_TTL
                    && !self.refreshing_models.swap(true, Ordering::SeqCst)
                {
                    let this = self.clone();
                    tokio::spawn(async move {
                        this.fetch_models().await;
                        this.refreshing_models.store(false, Ordering::SeqCst);
                    });
                }
                models
            }
            None => self.fetch_models().await,
        }
    }

    async fn fetch_models(&self) -> Arc<BTreeSet<String>> {
        let mut models = BTreeSet::new();
        let fetches = self.pool.addresses().into_iter().map(|addr| async move {
            let uri: Uri = format!("http://{addr}/v1/models").parse().ok()?;
            let request = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
            let response =
                tokio::time::timeout(Duration::from_secs(2), self.client.request(request))
                    .await
                    .ok()?
                    .ok()?;
            let body = response.into_body().collect().await.ok()?.to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            Some(
                v["data"]
                    .as_array()?
                    .iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_owned))
                    .collect::<Vec<_>>(),
            )
        });
        for ids in futures_util::future::join_all(fetches)
            .await
            .into_iter()
            .flatten()
        {
            models.extend(ids);
        }
        let models = Arc::new(models);
        *self.models.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), models.clone()));
        models
    }
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP_BY_HOP.contains(&name.as_str()) && name != header::CONTENT_LENGTH {
            to.append(name.clone(), value.clone());
        }
    }
}

/// A forwarded request's hold on its endpoint's load; dropping it (the
/// client went away) ends the request and, with the upstream body dropped
/// too, cancels it at the engine.
struct Guard {
    proxy: Arc<Proxy>,
    ticket: Option<Ticket>,
    name: String,
    sent: Instant,
    first: bool,
}

impl Guard {
    fn first_byte(&mut self) {
        self.first = false;
        if let Some(t) = self.ticket.as_mut() {
            self.proxy.pool.first_token(t);
        }
        self.proxy.metrics.observe(
            "kvroute_upstream_ttft_seconds",
            &[],
            self.sent.elapsed().as_secs_f64(),
        );
    }

    fn done(&mut self) {
        self.proxy.pool.succeeded(&self.name);
    }

    fn broke(&mut self, error: &str) {
        tracing::warn!(endpoint = %self.name, error, "upstream stream broke; ejecting");
        self.proxy.pool.broke(&self.name);
        self.proxy.metrics.inc(
            "kvroute_upstream_failures_total",
            &[("endpoint", &self.name), ("kind", "stream")],
            1.0,
        );
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.proxy.pool.finish(t);
        }
    }
}
