//! The request path: read the body within its limit, extract what routing
//! needs, resolve the tenant, compute the prompt's block chain and routing
//! key, ask the pool for a ranked plan (waiting in a bounded queue when
//! every candidate is full), and forward to the first endpoint, retrying on
//! the next ones while no response byte has been received. The response
//! streams back frame by frame as the engine sends it.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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
use kvroute_core::keys::{KeyInput, RoutingKey};
use kvroute_core::policy::Request as RouteRequest;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::body::{self, BodyBudget, Received};
use crate::config::{Config, Limits};
use crate::conversations::{Conversation, Conversations, Memo, Scope};
use crate::errors::ApiError;
use crate::explain::Explanation;
use crate::features::{self, Api, Held};
use crate::hit_rate::{Gap, Usage, UsageScan};
use crate::metrics::{Metrics, Model, ModelStatus, ModelTenant, Outcome, Why};
use crate::models::{ModelList, Models};
use crate::pool::{Fault, InFlight, Plan, Pool, Target};
use crate::prefixes::{Offender, Volatility};
use crate::tenancy::Tenancy;
use crate::throttle::Warnings;

/// Bodies up to this size are tokenized on the async worker that read
/// them (microseconds); larger ones on the bounded tokenizer pool, so a
/// large prompt never stalls the workers that carry streams.
const INLINE_BODY_BYTES: usize = 16 << 10;

/// How long an explain waits for the one before it (503 after).
const EXPLAIN_WAIT: Duration = Duration::from_secs(10);

/// The `model` label of requests whose model the endpoints do not serve:
/// labels come only from served models, so clients cannot add series.
const UNKNOWN_MODEL: &str = "unknown";

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

/// The proxy's shared state.
#[derive(Debug)]
pub struct Proxy {
    /// The pool requests go to.
    pub pool: Arc<Pool>,
    /// Counters and histograms.
    pub metrics: Arc<Metrics>,
    tenancy: Tenancy,
    limits: Limits,
    attempts: u32,
    endpoint_header: Option<HeaderName>,
    allowed_paths: HashSet<String>,
    /// Client headers never forwarded: `Authorization` and the tenant
    /// header unless configured otherwise.
    private_headers: Vec<HeaderName>,
    clients: Clients,
    queued: AtomicUsize,
    /// Request bodies in memory.
    bodies: Arc<BodyBudget>,
    /// Explains running: one at a time.
    explains: Arc<Semaphore>,
    tokenizers: Workers,
    models: Arc<Models>,
    /// Tenants named in metrics.
    tenant_labels: HashSet<String>,
    /// Expected against observed hit rate, per model.
    gap: std::sync::Mutex<Gap>,
    /// Volatile prefix detection.
    prefixes: std::sync::Mutex<Volatility>,
    /// Conversations' prompt snapshots.
    conversations: Arc<Conversations>,
    /// When an attempt counts as hung.
    hang: crate::hang::Deadline,
    /// Per-request warnings, throttled per endpoint and reason.
    warnings: Warnings,
}

thread_local! {
    /// The API thread this thread is ([`Proxy::on_api_thread`]); `None` on
    /// every other thread.
    static API_THREAD: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Upstream clients: one per API thread, so that a request and the
/// pooled connection it is sent on live on one thread's runtime, and one
/// for every other thread.
#[derive(Debug)]
struct Clients(Vec<Client<HttpConnector, Full<Bytes>>>);

impl Clients {
    fn new(limits: &Limits) -> Self {
        let client = || {
            let mut connector = HttpConnector::new();
            connector.set_connect_timeout(Some(Duration::from_millis(limits.connect_timeout_ms)));
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .build(connector)
        };
        Clients((0..=limits.api_threads()).map(|_| client()).collect())
    }

    /// This thread's client.
    fn get(&self) -> &Client<HttpConnector, Full<Bytes>> {
        let last = self.0.len() - 1;
        let k = API_THREAD
            .with(std::cell::Cell::get)
            .map_or(last, |k| k.min(last));
        &self.0[k]
    }
}

/// What routing takes from a request, computed by [`analyze`].
#[derive(Debug)]
pub(crate) struct Analysis {
    /// The body to forward (rewritten when tenancy sets `cache_salt`).
    pub(crate) bytes: Bytes,
    model: Option<String>,
    chain: Vec<u64>,
    key: RoutingKey,
    pub(crate) prompt_tokens: u64,
    /// Whether the policy can rank it: the router read its prompt, or the
    /// policy reads none (else the least loaded endpoint serves it).
    readable: bool,
    /// Whether the router read and tokenized its prompt.
    tokenized: bool,
    block_tokens: u64,
    /// The LoRA adapter the prompt was hashed with.
    lora: Option<String>,
    /// Every prompt token, when [`Input::keep_tokens`] asked for them.
    tokens: Vec<u32>,
    /// Content hashes of the leading blocks ([`features::Prompt::contents`]).
    contents: Vec<u64>,
    /// Whether a conversation's prompt was resumed.
    memo: Option<Memo>,
    /// Whether the client asked for a streamed response.
    stream: bool,
    /// The output tokens the client asked for at most.
    max_tokens: Option<u64>,
}

impl Analysis {
    /// What the policy ranks.
    pub(crate) fn request(&self) -> RouteRequest<'_> {
        RouteRequest {
            key: self.key,
            chain: &self.chain,
            prompt_tokens: self.prompt_tokens,
        }
    }

    /// Prompt tokens the engine is expected to find cached with `cached_blocks`
    /// leading blocks: as vLLM counts a hit, full blocks, and the last
    /// prompt token is always computed.
    pub(crate) fn expected_cached(&self, cached_blocks: u32) -> u64 {
        let cap = self.prompt_tokens.saturating_sub(1) / self.block_tokens * self.block_tokens;
        (u64::from(cached_blocks) * self.block_tokens).min(cap)
    }
}

/// Counts a request under `kvroute_requests_total` exactly once: with its
/// status when [`Proxy::serve`] answers, else (the client went away while
/// the router worked) as 499 when dropped. The engine's response body
/// takes over the count when it is streamed back.
#[derive(Debug)]
pub(crate) struct Labels {
    proxy: Arc<Proxy>,
    model: String,
    /// The tenant, as a bounded label (see [`Proxy::tenant_label`]).
    tenant: String,
    counted: bool,
}

impl Labels {
    /// Labels of a request not yet counted nor analyzed.
    pub(crate) fn new(proxy: &Arc<Proxy>) -> Self {
        Labels {
            proxy: proxy.clone(),
            model: String::new(),
            tenant: String::new(),
            counted: false,
        }
    }

    /// Counts the request with `status`, unless it was counted; returns
    /// whether this call counted it.
    pub(crate) fn count(&mut self, status: &str) -> bool {
        let first = !std::mem::replace(&mut self.counted, true);
        if first {
            self.proxy.count(&self.model, status);
        }
        first
    }

    /// `{model, tenant}` for the token counters.
    pub(crate) fn model_tenant(&self) -> ModelTenant {
        ModelTenant {
            model: self.model.clone(),
            tenant: self.tenant.clone(),
        }
    }

    /// Hands the count over to the response body.
    pub(crate) fn hand_over(&mut self) -> Labels {
        self.counted = true;
        Labels {
            proxy: self.proxy.clone(),
            model: std::mem::take(&mut self.model),
            tenant: std::mem::take(&mut self.tenant),
            counted: false,
        }
    }
}

impl Drop for Labels {
    fn drop(&mut self) {
        // 499: nginx's "client closed request".
        self.count("499");
    }
}

impl Proxy {
    /// A proxy over `pool` configured by `config`.
    pub fn new(pool: Arc<Pool>, metrics: Arc<Metrics>, tenancy: Tenancy, config: &Config) -> Self {
        let limits = config.limits.clone();
        let clients = Clients::new(&limits);
        let mut private_headers = Vec::new();
        if !config.proxy.forward_authorization {
            private_headers.push(header::AUTHORIZATION);
        }
        if !config.proxy.forward_tenant_header
            && let Some(h) = tenancy.header()
        {
            private_headers.push(h.clone());
        }
        let tenant_labels = tenancy
            .tenants()
            .chain(config.telemetry.tenant_labels.iter().cloned())
            .collect();
        Proxy {
            pool,
            tenancy,
            attempts: config.resilience.attempts,
            endpoint_header: config
                .telemetry
                .endpoint_header
                .0
                .as_ref()
                .map(|h| h.0.clone()),
            allowed_paths: config.proxy.allowed_paths.iter().cloned().collect(),
            private_headers,
            clients,
            queued: AtomicUsize::new(0),
            bodies: BodyBudget::new(&limits, &metrics),
            explains: Arc::new(Semaphore::new(1)),
            tokenizers: Workers::new(limits.tokenize_queue),
            limits,
            models: Arc::default(),
            tenant_labels,
            gap: std::sync::Mutex::default(),
            prefixes: std::sync::Mutex::default(),
            conversations: Arc::new(Conversations::new(metrics.conversation_evictions.clone())),
            hang: crate::hang::Deadline::new(&config.resilience, &config.limits),
            warnings: Warnings::default(),
            metrics,
        }
    }

    /// Serves one proxied request, recording it in the metrics; when
    /// traces are exported, inside a span joined to the client's trace
    /// context.
    pub async fn serve(self: &Arc<Self>, request: Request<Body>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let span = if kvroute_telemetry::exporting() {
            let span = tracing::info_span!("proxy", path = %parts.uri.path());
            let parent = opentelemetry::global::get_text_map_propagator(|p| {
                p.extract(&crate::telemetry::HeaderExtractor(&parts.headers))
            });
            if let Err(e) = span.set_parent(parent) {
                tracing::debug!(error = %e, "no trace parent");
            }
            span
        } else {
            tracing::Span::none()
        };
        let mut labels = Labels::new(self);
        let response = match self
            .handle(&parts, body, &mut labels)
            .instrument(span)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, path = %parts.uri.path(), "request refused");
                axum::response::IntoResponse::into_response(e)
            }
        };
        labels.count(response.status().as_str());
        response
    }

    /// Marks this thread as API thread `k` (of `limits.apiThreads`): its
    /// requests then use an upstream client of their own.
    pub fn on_api_thread(k: usize) {
        API_THREAD.with(|t| t.set(Some(k)));
    }

    /// Checks a request's credentials as the proxied paths do.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        self.tenancy.tenant(headers).map(drop)
    }

    fn count(&self, model: &str, status: &str) {
        let labels = ModelStatus {
            model: model.to_owned(),
            status: status.to_owned(),
        };
        self.metrics.requests.get_or_create(&labels).inc();
    }

    /// Reads the body within its limits ([`crate::body`]) for `tenant`.
    /// The body's share of the budget is held until the caller drops it.
    async fn read_body(
        &self,
        parts: &Parts,
        mut body: Body,
        tenant: Option<&str>,
    ) -> Result<(Bytes, body::Held), ApiError> {
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let mut received = Received::new(&self.bodies, declared, tenant)?;
        loop {
            let (deadline, _) = received.deadline();
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(Some(frame)) => frame
                    .map_err(|e| ApiError::BadRequest(format!("reading the request body: {e}")))?,
                Ok(None) => return Ok(received.finish()),
                Err(_) => return Err(received.expired()),
            };
            if let Ok(data) = frame.into_data() {
                received.push(data)?;
            }
        }
    }

    /// The budget of request bodies in memory.
    pub(crate) fn bodies(&self) -> &Arc<BodyBudget> {
        &self.bodies
    }

    /// `limits.firstByteTimeoutMs`.
    pub(crate) fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.first_byte_timeout_ms)
    }

    async fn handle(
        self: &Arc<Self>,
        parts: &Parts,
        body: Body,
        labels: &mut Labels,
    ) -> Result<Response<Body>, ApiError> {
        let decision_start = Instant::now();
        let path = parts.uri.path();
        let tenant = self.admit(path, &parts.headers, labels)?;
        let (bytes, _budget) = self.read_body(parts, body, tenant.as_deref()).await?;
        let (analysis, plan) = self
            .route(path, &parts.headers, tenant, bytes, labels, &|_| true)
            .await?;
        self.metrics
            .decision_seconds
            .observe(decision_start.elapsed().as_secs_f64());
        self.forward(parts, &analysis, plan, labels).await
    }

    /// Checks that `path` is proxied and the credentials in `headers`;
    /// returns the tenant they name, labelled in `labels`.
    pub(crate) fn admit(
        &self,
        path: &str,
        headers: &HeaderMap,
        labels: &mut Labels,
    ) -> Result<Option<String>, ApiError> {
        self.allowed(path)?;
        self.identify(headers, labels)
    }

    /// The tenant the credentials in `headers` name, labelled in `labels`.
    pub(crate) fn identify(
        &self,
        headers: &HeaderMap,
        labels: &mut Labels,
    ) -> Result<Option<String>, ApiError> {
        let tenant = self.tenancy.tenant(headers)?;
        labels.tenant = self.tenant_label(tenant.as_deref());
        Ok(tenant)
    }

    /// Whether the router can serve: routable endpoints (their number),
    /// and the tenancy the pool's policy asks for; else why not.
    pub fn readiness(&self) -> Result<usize, String> {
        self.tenancy_check(&self.pool.settings())
            .map_err(|e| e.to_string())?;
        match self.pool.routable() {
            0 => Err("no routable endpoint".into()),
            n => Ok(n),
        }
    }

    /// The decision for a request whose body is `bytes`: its analysis and
    /// a plan among the endpoints `among` accepts, waiting in the bounded
    /// queue while they are all full. The HTTP proxy and the endpoint
    /// picker both decide here, so they decide alike.
    pub(crate) async fn route(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        tenant: Option<String>,
        bytes: Bytes,
        labels: &mut Labels,
        among: &(dyn Fn(&std::net::SocketAddr) -> bool + Sync),
    ) -> Result<(Analysis, Plan), ApiError> {
        let analysis = self
            .analyze(path, headers, tenant, bytes, false, &mut labels.model)
            .await?;
        self.volatile(&analysis, &labels.model, &labels.tenant);
        let plan = self
            .plan(&analysis.request(), analysis.readable, among)
            .await?;
        Ok((analysis, plan))
    }

    /// Analyzes a request to `path` with `headers` and body `bytes` from
    /// `tenant`: its tokens (all of them in the result with `keep_tokens`),
    /// chain and key, tokenized off the async workers when large. Sets
    /// `model_label` to the model for metrics (`unknown` when not served); an
    /// unknown model is 404.
    async fn analyze(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        tenant: Option<String>,
        bytes: Bytes,
        keep_tokens: bool,
        model_label: &mut String,
    ) -> Result<Analysis, ApiError> {
        let (settings, exact) = self.pool.routing();
        self.tenancy_check(&settings)?;
        let conversation = headers
            .get(&settings.conversation_header)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let tokenize = bytes.len() <= self.limits.max_tokenize_bytes;
        if !tokenize {
            self.metrics.prompts_not_tokenized.inc();
        }
        let known = self.models().await;
        let input = Input {
            api: Api::of(path),
            tenant,
            conversation,
            tokenize,
            keep_tokens,
            exact,
            held_by: (exact && !keep_tokens && settings.policy.reads_held_prefix_only())
                .then(|| self.pool.clone()),
        };
        // Scanning a body's top-level fields is one fast pass: inline.
        let scan_only = !settings.policy.reads_request() && !self.tenancy.salted();
        // So is a follow-up turn with little new in it (exact mode): a
        // scan, and a hash of the body up to the conversation's snapshot.
        // Only a request that names a conversation can be one.
        let conversation_named = || {
            input.conversation.is_some()
                || memchr::memmem::find(&bytes, b"\"prompt_cache_key\"").is_some()
        };
        let resumed =
            if bytes.len() > INLINE_BODY_BYTES && !scan_only && exact && conversation_named() {
                analyze_resumed(
                    bytes.clone(),
                    input.clone(),
                    &self.tenancy,
                    &settings,
                    &known,
                    &self.conversations,
                    Some(INLINE_BODY_BYTES),
                )?
            } else {
                None
            };
        let analysis = if let Some(analysis) = resumed {
            analysis
        } else if bytes.len() <= INLINE_BODY_BYTES || scan_only || keep_tokens {
            // (`keep_tokens`: an explain, on a thread of its own.)
            analyze(
                bytes,
                input,
                &self.tenancy,
                &settings,
                &known,
                &self.conversations,
            )?
        } else {
            let tenancy = self.tenancy.clone();
            let retry_after = self.limits.retry_after_s;
            let known = known.clone();
            let conversations = self.conversations.clone();
            self.tokenizers
                .run(retry_after, move || {
                    analyze(bytes, input, &tenancy, &settings, &known, &conversations)
                })
                .await??
        };
        if let Some(memo) = analysis.memo {
            let result = match memo {
                Memo::Hit => "hit",
                Memo::Miss => "miss",
            };
            self.metrics
                .conversation_prompts
                .get_or_create(&Outcome { result })
                .inc();
        }
        if let Some(model) = &analysis.model {
            if known.ids.contains(model) {
                model_label.clone_from(model);
            } else {
                *model_label = UNKNOWN_MODEL.into();
                if !known.ids.is_empty() {
                    return Err(ApiError::NotFound(format!(
                        "The model `{model}` does not exist."
                    )));
                }
            }
        }
        Ok(analysis)
    }

    /// What the router would do with a request, without sending it or
    /// changing any state (`POST /debug/explain`): the same checks and
    /// analysis as a proxied request, then the pool's explanation.
    pub async fn explain(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Explanation, ApiError> {
        // One at a time, on a blocking thread: an explain tokenizes its
        // prompt whole, and must not take the request path's tokenizer
        // workers or its event loops.
        let retry_after = self.limits.retry_after_s;
        let one = tokio::time::timeout(EXPLAIN_WAIT, self.explains.clone().acquire_owned())
            .await
            .map_err(|_| ApiError::Saturated("explain requests", retry_after))?
            .expect("the semaphore is never closed");
        let (proxy, path, headers) = (self.clone(), path.to_owned(), headers.clone());
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _one = one;
            runtime.block_on(proxy.explain_here(&path, &headers, body))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("explaining: {e}")))?
    }

    async fn explain_here(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Explanation, ApiError> {
        self.allowed(path)?;
        let tenant = self.tenancy.tenant(headers)?;
        let mut label = String::new();
        let a = self
            .analyze(path, headers, tenant, body, true, &mut label)
            .await?;
        let request = RouteRequest {
            key: a.key,
            chain: &a.chain,
            prompt_tokens: a.prompt_tokens,
        };
        let decision = self.pool.explain(&request, a.readable);
        let (settings, exact) = self.pool.routing();
        let hashing = settings.hasher.config();
        Ok(Explanation {
            path: path.to_owned(),
            key: format!("{:016x}", a.key.0),
            prompt_tokens: a.prompt_tokens,
            tokenized: a.tokenized,
            mode: if exact { "exact" } else { "approximate" }.to_owned(),
            block_size: hashing.block_size,
            hash_algo: hashing.algo.as_str().to_owned(),
            chain: a.chain.iter().map(|h| format!("{h:016x}")).collect(),
            model: a.model,
            lora: a.lora,
            tokens: a.tokens,
            decision,
        })
    }

    /// The routing decision for a request as [`serve`](Self::serve) makes
    /// it before forwarding: the same checks, analysis and plan, then the
    /// first target's load and the policy's memory of it, as when sent
    /// (the load released at once), without queueing or I/O. Returns the
    /// first target's name. For measuring what a decision costs.
    pub async fn decide(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<String, ApiError> {
        self.allowed(path)?;
        let tenant = self.tenancy.tenant(headers)?;
        let tenant_label = self.tenant_label(tenant.as_deref());
        let mut model = String::new();
        let a = self
            .analyze(path, headers, tenant, body, false, &mut model)
            .await?;
        self.volatile(&a, &model, &tenant_label);
        let request = a.request();
        let plan = self.pool.plan(&request, a.readable);
        let target = plan.targets.first().ok_or(ApiError::Unavailable {
            retry_after: self.limits.retry_after_s,
        })?;
        drop(self.pool.start(&request, target, a.prompt_tokens));
        Ok(target.name.to_string())
    }

    /// Refuses every request while the pool's policy (in `settings`) asks
    /// for salted tenancy that this router is not configured for.
    pub fn tenancy_check(&self, settings: &crate::settings::Settings) -> Result<(), ApiError> {
        if settings.salting_required && !self.tenancy.salted() {
            return Err(ApiError::SaltingRequired);
        }
        Ok(())
    }

    /// Refuses a path that is not proxied.
    fn allowed(&self, path: &str) -> Result<(), ApiError> {
        if self.allowed_paths.contains(path) {
            return Ok(());
        }
        Err(ApiError::NotFound(format!(
            "{path} is not proxied; see proxy.allowedPaths"
        )))
    }

    /// A plan with at least one target, waiting in the bounded queue while
    /// every routable endpoint is at its concurrency limit.
    pub(crate) async fn plan(
        &self,
        request: &RouteRequest<'_>,
        readable: bool,
        among: &(dyn Fn(&std::net::SocketAddr) -> bool + Sync),
    ) -> Result<Plan, ApiError> {
        let deadline = Instant::now() + Duration::from_millis(self.limits.queue_timeout_ms);
        let retry_after = self.limits.retry_after_s;
        // Registered for releases only once every endpoint was full, then
        // planned again, so no release in between is missed.
        let mut released = None;
        loop {
            let plan = self.pool.plan_among(request, readable, among);
            if !plan.targets.is_empty() {
                return Ok(plan);
            }
            if plan.full == 0 {
                return Err(ApiError::Unavailable { retry_after });
            }
            let Some(waiting) = released.as_mut() else {
                let mut r = Box::pin(self.pool.released());
                r.as_mut().enable();
                released = Some(r);
                continue;
            };
            if self.queued.fetch_add(1, Ordering::SeqCst) >= self.limits.queue_size {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                return Err(ApiError::Overloaded { retry_after });
            }
            let woke = tokio::time::timeout_at(deadline, waiting.as_mut()).await;
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if woke.is_err() {
                return Err(ApiError::Overloaded { retry_after });
            }
            released = None;
        }
    }

    async fn forward(
        self: &Arc<Self>,
        parts: &Parts,
        analysis: &Analysis,
        plan: Plan,
        labels: &mut Labels,
    ) -> Result<Response<Body>, ApiError> {
        let request = &analysis.request();
        let bytes = &analysis.bytes;
        let expected_cached = analysis.expected_cached(plan.cached_blocks);
        let by = self.count_routed(labels, request.prompt_tokens);
        let mut last_error = ApiError::Upstream("no attempt was made".into());
        let mut last_response: Option<Response<Incoming>> = None;
        // Fewer targets than attempts (endpoints ejected or full): the
        // ranking is tried again from the top, as Envoy retries a host.
        let attempts = plan.targets.iter().cycle().take(self.attempts as usize);
        for (attempt, target) in attempts.enumerate() {
            let (reason, cached) = if attempt == 0 {
                (plan.reason.as_str(), expected_cached)
            } else {
                ("retry", 0)
            };
            self.count_decision(reason);
            let uncached = request.prompt_tokens - cached;
            let ttft = self.pool.predicted_ttft(target, uncached);
            let hang = self.hang.of(analysis.stream, analysis.max_tokens, ttft);
            // Counted until dropped: whether this attempt fails, the
            // client goes away while it waits, or the response ends.
            let load = self.pool.start(request, target, uncached);
            let sent = Instant::now();
            let (first, load) = match self.upstream_request(parts, bytes, target) {
                Err(e) => (Err(e), load),
                Ok(upstream) => {
                    let attempt = self
                        .clone()
                        .attempt(upstream, target.clone(), load, sent, hang);
                    // With a hang deadline the attempt outlives a client
                    // that leaves, until its first byte or the deadline,
                    // so a hung engine is found even when every client
                    // gives up sooner; without one, leaving cancels it.
                    let mut task = Watched {
                        task: tokio::spawn(attempt),
                        abort: hang.is_none(),
                    };
                    match (&mut task.task).await {
                        Ok(done) => done,
                        Err(e) => {
                            let e = ApiError::Internal(format!("the attempt failed: {e}"));
                            last_error = e;
                            continue;
                        }
                    }
                }
            };
            match first {
                Ok((response, _)) if retried(response.status()) => {
                    drop(load);
                    let status = response.status();
                    if status.is_server_error() {
                        self.metrics
                            .health(self.pool.failed(&target.name, Fault::Status));
                    }
                    self.failure(target, "status");
                    if let Some(times) = self.warnings.admit(&target.name, "status") {
                        tracing::info!(endpoint = %target.name, %status, attempt, times, "retrying on the next endpoint");
                    }
                    last_error = ApiError::Upstream(format!("{} answered {status}", target.name));
                    last_response = Some(response);
                }
                Ok((response, first)) => {
                    if attempt == 0 {
                        self.count_first_choice(&by, cached);
                    }
                    let expected = Expected {
                        cached,
                        prompt_tokens: request.prompt_tokens,
                    };
                    let labels = labels.hand_over();
                    return Ok(self.respond(response, first, load, target, sent, labels, expected));
                }
                Err((e, fault)) => {
                    // Dropping the response future or body first cancels
                    // the request at the engine.
                    drop(load);
                    let kind = fault.map_or("transport", Fault::as_str);
                    // The attempt counted its own timeout.
                    if fault != Some(Fault::Timeout) {
                        if let Some(fault) = fault {
                            self.metrics.health(self.pool.failed(&target.name, fault));
                        }
                        self.failure(target, kind);
                    }
                    if let Some(times) = self.warnings.admit(&target.name, kind) {
                        tracing::info!(endpoint = %target.name, error = %e, attempt, times, "attempt failed");
                    }
                    last_error = e;
                }
            }
        }
        // Every attempt failed before a byte was forwarded: the last
        // engine answer if there was one, else the last error.
        match last_response {
            Some(response) => {
                let (mut parts, body) = response.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                end_to_end(&mut parts.headers);
                Ok(Response::from_parts(parts, Body::from(body)))
            }
            None => Err(last_error),
        }
    }

    /// Counts a routed request and its prompt tokens; returns its
    /// `{model, tenant}` labels.
    pub(crate) fn count_routed(&self, labels: &Labels, prompt_tokens: u64) -> ModelTenant {
        self.metrics.routed.inc();
        let by = labels.model_tenant();
        self.metrics
            .prompt_tokens
            .get_or_create(&by)
            .inc_by(prompt_tokens);
        by
    }

    /// Counts a routing decision by its reason.
    pub(crate) fn count_decision(&self, reason: &'static str) {
        self.metrics
            .routing_decisions
            .get_or_create(&Why { reason })
            .inc();
    }

    /// Counts a request served by the policy's first choice, expected to
    /// find `cached` prompt tokens there.
    pub(crate) fn count_first_choice(&self, by: &ModelTenant, cached: u64) {
        self.metrics.first_choice.inc();
        self.metrics
            .expected_cached_tokens
            .get_or_create(by)
            .inc_by(cached);
    }

    fn failure(&self, target: &Target, kind: &'static str) {
        self.metrics.upstream_failure(&target.name, kind);
    }

    /// One attempt sent at `sent` and holding `load`: the response headers,
    /// then, with a hang deadline ([`crate::hang`]), the first body frame
    /// within it. A timeout is counted against the endpoint here, whether
    /// or not the client still waits.
    #[allow(clippy::type_complexity)]
    async fn attempt(
        self: Arc<Self>,
        upstream: Request<Full<Bytes>>,
        target: Target,
        load: InFlight,
        sent: Instant,
        hang: Option<Duration>,
    ) -> (
        Result<(Response<Incoming>, Option<Frame<Bytes>>), (ApiError, Option<Fault>)>,
        InFlight,
    ) {
        let outcome = match self.send(upstream, &target, sent, hang).await {
            // No byte has reached the client yet: the first body frame is
            // awaited within the hang deadline, so a hung engine that
            // sent its headers is retried too.
            Ok(response) if hang.is_some() && !retried(response.status()) => {
                self.first_frame(response, &target, sent, hang).await
            }
            other => other.map(|r| (r, None)),
        };
        if let Err((_, Some(Fault::Timeout))) = &outcome {
            self.metrics
                .health(self.pool.failed(&target.name, Fault::Timeout));
            self.failure(&target, Fault::Timeout.as_str());
        }
        (outcome, load)
    }

    /// The request to send to `target`.
    fn upstream_request(
        &self,
        parts: &Parts,
        bytes: &Bytes,
        target: &Target,
    ) -> Result<Request<Full<Bytes>>, (ApiError, Option<Fault>)> {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let uri: Uri = format!("http://{}{path}", target.http)
            .parse()
            .map_err(|e| (ApiError::Upstream(format!("bad upstream URI: {e}")), None))?;
        let mut request = Request::builder()
            .method(parts.method.clone())
            .uri(uri)
            .body(Full::new(bytes.clone()))
            .map_err(|e| (ApiError::Upstream(e.to_string()), None))?;
        copy_headers(&parts.headers, request.headers_mut(), &self.private_headers);
        request.headers_mut().remove(header::HOST);
        // With tracing on, the engine's parent is this router's span; else
        // the client's traceparent passes through as copied.
        if kvroute_telemetry::exporting() {
            let context = tracing::Span::current().context();
            opentelemetry::global::get_text_map_propagator(|p| {
                p.inject_context(
                    &context,
                    &mut crate::telemetry::HeaderInjector(request.headers_mut()),
                )
            });
        }
        request
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        Ok(request)
    }

    /// Sends `request` at `sent`, for its response headers within the hang
    /// deadline `hang`, else within `limits.firstByteTimeoutMs`. An error
    /// carries the engine's [`Fault`] when it is one: refused or failed
    /// connections and timeouts are; an upload the engine cut off is not
    /// counted against it.
    async fn send(
        &self,
        request: Request<Full<Bytes>>,
        target: &Target,
        sent: Instant,
        hang: Option<Duration>,
    ) -> Result<Response<Incoming>, (ApiError, Option<Fault>)> {
        let timeout = hang.unwrap_or(self.hang.cap());
        match tokio::time::timeout_at(sent + timeout, self.clients.get().request(request)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) => {
                let upload_cut = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<hyper::Error>())
                    .is_some_and(hyper::Error::is_body_write_aborted);
                let fault = (!upload_cut).then_some(Fault::Connect);
                Err((ApiError::Upstream(format!("{}: {e}", target.name)), fault))
            }
            Err(_) => Err(timed_out(target, timeout)),
        }
    }

    /// Awaits the first body frame of `response` (from an attempt sent at
    /// `sent`) within the hang deadline `hang`. A stream that breaks or
    /// stays silent is the engine's fault; the response is dropped, which
    /// cancels the request at the engine.
    #[allow(clippy::type_complexity)]
    async fn first_frame(
        &self,
        response: Response<Incoming>,
        target: &Target,
        sent: Instant,
        hang: Option<Duration>,
    ) -> Result<(Response<Incoming>, Option<Frame<Bytes>>), (ApiError, Option<Fault>)> {
        let timeout = hang.unwrap_or(self.hang.cap());
        let (head, mut incoming) = response.into_parts();
        if hyper::body::Body::is_end_stream(&incoming) {
            return Ok((Response::from_parts(head, incoming), None));
        }
        match tokio::time::timeout_at(sent + timeout, incoming.frame()).await {
            Ok(Some(Ok(frame))) => Ok((Response::from_parts(head, incoming), Some(frame))),
            Ok(None) => Ok((Response::from_parts(head, incoming), None)),
            Ok(Some(Err(e))) => Err((
                ApiError::Upstream(format!("{}: {e}", target.name)),
                Some(Fault::Stream),
            )),
            Err(_) => Err(timed_out(target, timeout)),
        }
    }

    /// Streams the engine's response back frame by frame. The guard
    /// records the first byte and the end; a broken stream ejects the
    /// endpoint and, for event streams, ends with an error event.
    #[allow(clippy::too_many_arguments)]
    fn respond(
        self: &Arc<Self>,
        response: Response<Incoming>,
        first: Option<Frame<Bytes>>,
        load: InFlight,
        target: &Target,
        sent: Instant,
        labels: Labels,
        expected: Expected,
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
        if let Some(name) = &self.endpoint_header
            && let Ok(v) = HeaderValue::from_str(&target.name)
        {
            parts.headers.insert(name.clone(), v);
        }
        let guard = Guard::new(
            self,
            load,
            target.name.clone(),
            sent,
            labels,
            parts.status,
            expected,
        );
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
                    Some((
                        Ok::<_, std::io::Error>(frame),
                        Some((incoming, guard, None)),
                    ))
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

    /// `tenant` as a metric label: a tenant of the API-key map or of
    /// `telemetry.tenantLabels`, `none` without one, else `other`.
    fn tenant_label(&self, tenant: Option<&str>) -> String {
        match tenant {
            None => "none".into(),
            Some(t) if self.tenant_labels.contains(t) => t.into(),
            Some(_) => "other".into(),
        }
    }

    /// Counts what the engine reported of a request against what the
    /// router expected, and logs a sustained gap.
    fn observed(&self, labels: &Labels, expected: Expected, usage: Usage, id: Option<String>) {
        let by = labels.model_tenant();
        let m = &self.metrics;
        m.observed_prompt_tokens
            .get_or_create(&by)
            .inc_by(usage.prompt_tokens);
        m.observed_cached_tokens
            .get_or_create(&by)
            .inc_by(usage.cached_tokens);
        let mut gap = self.gap.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now().into_std();
        let model = labels.model.as_str();
        let (value, alert) = gap.record(
            model,
            expected.cached,
            expected.prompt_tokens,
            usage,
            id,
            now,
        );
        drop(gap);
        let label = Model {
            model: model.to_owned(),
        };
        m.hit_rate_gap.get_or_create(&label).set(value);
        if let Some(a) = alert {
            m.hit_rate_gap_alerts.get_or_create(&label).inc();
            tracing::warn!(model = %a.model, gap = a.gap, requests = a.requests,
                example = %a.example.as_deref().unwrap_or("-"),
                "the engines report far fewer cached tokens than the router expects: \
                 check that the router's tokenizer, chat template and hashing match the engines' \
                 (kvroute explain shows what the router computes)");
        }
    }

    /// Looks for a volatile prefix in a routed request (see
    /// [`prefixes`](crate::prefixes)) and counts one.
    fn volatile(&self, analysis: &Analysis, model: &str, tenant: &str) {
        let mut v = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        let Some(d) = v.observe(analysis.chain.first().copied(), &analysis.contents) else {
            return;
        };
        v.record(&d, analysis.block_tokens as usize, model, tenant);
        drop(v);
        let by = ModelTenant {
            model: model.to_owned(),
            tenant: tenant.to_owned(),
        };
        self.metrics
            .volatile_prefix_requests
            .get_or_create(&by)
            .inc();
    }

    /// The recurring volatile prefixes, most frequent first.
    pub fn volatile_prefixes(&self) -> Vec<Offender> {
        self.prefixes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .offenders()
    }

    /// What the endpoints serve (see [`Models`]).
    pub async fn models(self: &Arc<Self>) -> Arc<ModelList> {
        self.models
            .get(self.clients.get(), || self.pool.addresses())
            .await
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

/// The error of an attempt at `target` that sent nothing within `timeout`.
fn timed_out(target: &Target, timeout: Duration) -> (ApiError, Option<Fault>) {
    (
        ApiError::Timeout(format!(
            "{} sent no response within {} ms",
            target.name,
            timeout.as_millis()
        )),
        Some(Fault::Timeout),
    )
}

/// Copies end-to-end headers: not hop-by-hop ones, not those the
/// `Connection` header names, not `content-length` (set by the caller), and
/// none of `private`.
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap, private: &[HeaderName]) {
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
fn end_to_end(headers: &mut HeaderMap) {
    let mut kept = HeaderMap::new();
    copy_headers(headers, &mut kept, &[]);
    *headers = kept;
}

/// What [`analyze`] takes from a request besides its body.
#[derive(Clone, Debug)]
struct Input {
    api: Api,
    /// The tenant the credentials name.
    tenant: Option<String>,
    /// The conversation header's value.
    conversation: Option<String>,
    /// False when the body is over `limits.maxTokenizeBytes`.
    tokenize: bool,
    /// Keep every prompt token in [`Analysis::tokens`].
    keep_tokens: bool,
    /// Exact mode: the prompt is tokenized as the engines do. Else
    /// approximate mode reads it in byte chunks ([`chunks`](crate::chunks)).
    exact: bool,
    /// The pool whose engines' index ends a chain early ([`Held`]): in
    /// exact mode, for a policy that reads only held prefixes, unless every
    /// token is kept (`explain`).
    held_by: Option<Arc<Pool>>,
}

/// Parses the body, applies tenancy, and computes the prompt's tokens
/// (unless `tokenize` is false: the body is over `limits.maxTokenizeBytes`),
/// block chain and routing key. Synchronous: large bodies run it on the
/// tokenizer pool. In salted mode every body must be a JSON object: one
/// the router cannot read could carry a client salt the engine would read.
///
/// Three ways to read a body: a policy that reads no prompt scans only its
/// top-level fields; a chat (not salted) in approximate mode, or in exact
/// mode with the built-in tokenizer and template, is scanned with its
/// messages kept raw and read a message at a time (byte chunks or tokens,
/// resuming a known conversation: [`Conversations`]); anything else is
/// parsed whole.
fn analyze(
    bytes: Bytes,
    input: Input,
    tenancy: &Tenancy,
    settings: &crate::settings::Settings,
    models: &ModelList,
    conversations: &Conversations,
) -> Result<Analysis, ApiError> {
    let analysis = analyze_resumed(bytes, input, tenancy, settings, models, conversations, None)?;
    Ok(analysis.expect("only analyze_resumed with a bound leaves a prompt undone"))
}

/// As [`analyze`], but with `resumed_within` only a chat (either mode) that
/// resumes a known conversation with at most that many body bytes after
/// its snapshot is analyzed: `None` for anything else, for the tokenizer
/// pool. A follow-up turn then skips the hand-off to the pool, which costs
/// more than the little that is left to tokenize.
fn analyze_resumed(
    bytes: Bytes,
    input: Input,
    tenancy: &Tenancy,
    settings: &crate::settings::Settings,
    models: &ModelList,
    conversations: &Conversations,
    resumed_within: Option<usize>,
) -> Result<Option<Analysis>, ApiError> {
    let Input {
        api,
        tenant,
        conversation: conversation_header,
        tokenize,
        keep_tokens,
        exact,
        held_by,
    } = input;
    let holds = |block| held_by.as_ref().is_some_and(|p| p.holds_any(block));
    let held: Option<Held<'_>> = held_by.is_some().then_some(&holds);
    let reads = settings.policy.reads_request();
    let salted = tenancy.salted();
    let streamed = api == Api::Chat
        && reads
        && tokenize
        && !salted
        && (!exact || features::streams_chats(settings));
    let mut raw_messages = None;
    let mut obj = if streamed {
        features::scan(api, &bytes, true)?.map(|s| {
            raw_messages = s.messages;
            s.fields
        })
    } else if reads || salted {
        features::parse(api, &bytes, salted)?
    } else {
        features::scan(api, &bytes, false)?.map(|s| s.fields)
    };
    let feats = obj
        .as_ref()
        .map(features::features)
        .transpose()?
        .unwrap_or_default();
    let mut forwarded = None;
    if let Some(o) = obj.as_mut()
        && tenancy.apply(tenant.as_deref(), o)?
    {
        forwarded = Some(Bytes::from(
            serde_json::to_vec(o).expect("a JSON map serializes"),
        ));
    }
    let salt = obj
        .as_ref()
        .and_then(|o| o.get("cache_salt"))
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    // A request naming a LoRA adapter is hashed with it, as the engine
    // hashes its blocks.
    let lora = feats.model.as_deref().and_then(|m| {
        settings
            .lora_adapters
            .get(m)
            .or_else(|| models.adapters.get(m).map(|a| &a.lora))
    });
    let extras = BlockExtras {
        lora,
        cache_salt: salt.as_deref(),
    };
    let conversation = feats.prompt_cache_key.or(conversation_header);
    let mut memo = None;
    let prompt = match obj.as_mut() {
        Some(_) if streamed => {
            let raw = raw_messages
                .as_deref()
                .ok_or_else(features::messages_required)?;
            let c = conversation.as_deref().map(|key| Conversation {
                tenant: tenant.as_deref(),
                key,
            });
            let scope = match (resumed_within, keep_tokens) {
                (Some(n), _) => Scope::ResumedWithin(n),
                (None, true) => Scope::KeepTokens,
                (None, false) => Scope::Whole,
            };
            let chat = (&bytes[..], raw);
            let Some(chat) =
                conversations.chat_prompt(chat, c, settings, extras, scope, exact, held)?
            else {
                return Ok(None);
            };
            memo = chat.memo;
            chat.prompt
        }
        _ if resumed_within.is_some() => return Ok(None),
        Some(o) if tokenize && reads && !exact => crate::chunks::prompt(api, o, settings, extras)?,
        // A model's tokenizer or template: resumed by the rendered prompt.
        Some(o)
            if tokenize
                && reads
                && api == Api::Chat
                && conversation.is_some()
                && !keep_tokens
                && !features::streams_chats(settings) =>
        {
            let c = Conversation {
                tenant: tenant.as_deref(),
                key: conversation.as_deref().unwrap_or_default(),
            };
            features::chat_messages(o)?.and_then(|messages| {
                let chat = conversations.rendered_prompt(messages, c, settings, extras);
                memo = chat.memo;
                chat.prompt
            })
        }
        Some(o) if tokenize && reads => {
            features::prompt(api, o, settings, extras, keep_tokens, held)?
        }
        _ => None,
    }
    .unwrap_or_default();
    drop(raw_messages);
    drop(obj);
    let bytes = forwarded.unwrap_or(bytes);
    let key = settings.key.key(&KeyInput {
        tenant: tenant.as_deref(),
        conversation: conversation.as_deref(),
        tokens: &prompt.head,
    });
    let prompt_tokens = if prompt.tokens == 0 {
        // No tokens (not JSON, or content we cannot tokenize): about
        // four bytes per token.
        bytes.len() as u64 / 4
    } else {
        prompt.tokens
    };
    Ok(Some(Analysis {
        bytes,
        model: feats.model,
        stream: feats.stream,
        max_tokens: feats.max_tokens,
        chain: prompt.chain,
        key,
        prompt_tokens,
        readable: prompt.tokens > 0 || !reads,
        tokenized: prompt.tokens > 0 && exact,
        block_tokens: settings.hasher.config().block_size as u64,
        lora: lora.map(|l| l.name.clone()),
        tokens: prompt.all,
        contents: prompt.contents,
        memo,
    }))
}

/// The tokenizer pool: at most one job per core at once, at most `queue`
/// waiting; more are refused with 503.
#[derive(Debug)]
struct Workers {
    running: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue: usize,
}

impl Workers {
    fn new(queue: usize) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Workers {
            running: Arc::new(Semaphore::new(cores)),
            waiting: AtomicUsize::new(0),
            queue,
        }
    }

    async fn run<T: Send + 'static>(
        &self,
        retry_after: u64,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::Saturated(
                "prompts waiting to be tokenized",
                retry_after,
            ));
        }
        let waiting = Waiting(&self.waiting);
        let permit = self
            .running
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        drop(waiting);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job()
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizing the prompt failed: {e}")))
    }
}

/// A forwarded request's hold on its endpoint's load; dropping it (the
/// client went away) ends the request and, with the upstream body dropped
/// too, cancels it at the engine. Its labels count the request: with the
/// status when the body completed, `stream_error` when it broke, 499 when
/// the client left first.
pub(crate) struct Guard {
    proxy: Arc<Proxy>,
    load: InFlight,
    name: Arc<str>,
    sent: Instant,
    first: bool,
    labels: Labels,
    status: StatusCode,
    expected: Expected,
    /// The body's end, for the engine's usage.
    usage: UsageScan,
}

/// What the router expected of a request at the endpoint it was sent to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expected {
    /// Prompt tokens it expected cached there.
    pub(crate) cached: u64,
    /// Prompt tokens, as the router computed them.
    pub(crate) prompt_tokens: u64,
}

impl Guard {
    /// Follows the response of a request sent to endpoint `name` at `sent`
    /// holding `load`, answered with `status`.
    pub(crate) fn new(
        proxy: &Arc<Proxy>,
        load: InFlight,
        name: Arc<str>,
        sent: Instant,
        labels: Labels,
        status: StatusCode,
        expected: Expected,
    ) -> Self {
        Guard {
            proxy: proxy.clone(),
            load,
            name,
            sent,
            first: true,
            labels,
            status,
            expected,
            usage: UsageScan::default(),
        }
    }

    /// A body chunk of the response arrived.
    pub(crate) fn data(&mut self, data: &[u8]) {
        if self.first {
            self.first_byte();
        }
        if self.status.is_success() {
            self.usage.push(data);
        }
    }

    fn first_byte(&mut self) {
        self.first = false;
        self.load.first_token();
        self.proxy
            .metrics
            .upstream_ttft_seconds
            .observe(self.sent.elapsed().as_secs_f64());
    }

    /// The response ended.
    pub(crate) fn done(&mut self) {
        if self.labels.count(self.status.as_str()) && !self.status.is_server_error() {
            self.proxy
                .metrics
                .health(self.proxy.pool.succeeded(&self.name));
            if self.status.is_success()
                && let Some((usage, id)) = self.usage.usage()
            {
                self.proxy.observed(&self.labels, self.expected, usage, id);
            }
        }
    }

    fn broke(&mut self, error: &str) {
        if let Some(times) = self.proxy.warnings.admit(&self.name, "stream") {
            tracing::warn!(endpoint = %self.name, error, times, "upstream stream broke");
        }
        self.proxy
            .metrics
            .health(self.proxy.pool.failed(&self.name, Fault::Stream));
        self.proxy.metrics.upstream_failure(&self.name, "stream");
        self.labels.count("stream_error");
    }
}

#[cfg(test)]
pub(crate) mod tests;
