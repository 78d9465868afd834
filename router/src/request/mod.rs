//! The decision service: everything about a request that does not depend
//! on how it arrived. Both front ends, the HTTP forwarder
//! ([`crate::http`]) and the endpoint picker ([`crate::ext_proc`]), and the
//! admin port's explain, hand a request to [`Service::decide`] and get a
//! [`Decision`] back; they then say where it was sent
//! ([`Decision::send`], [`Decision::pick`]) and where its response began
//! ([`Decision::commit`]), which does the counting and returns the
//! response's [`Guard`]. In order:
//!
//! 1. Admission ([`Service::admit`]): the path is proxied, the
//!    credentials name a tenant, and the body's declared size fits its
//!    budget ([`body`]).
//! 2. The body, read within its limits (or as the picker received it).
//! 3. The prompt, read as the pool's mode says ([`crate::prompt`]); a model
//!    the endpoints do not serve is 404.
//! 4. The plan: the pool's ranking among the endpoints the request may go
//!    to, waiting in the bounded queue while all are full ([`queue`]).
//!
//! What a routed request moves, every counter and record, is the
//! [`Accounting`]'s: the decision and its guard hold it and the pool, not
//! this service.
//!
//! Not here: sending, retrying and streaming bytes (the front ends).

mod accounting;
mod admitted;
mod ask;
pub mod body;
mod decision;
mod guard;
pub mod hang;
pub mod hit_rate;
mod labels;
pub mod missed;
mod observed;
mod readiness;
pub mod recent;
pub mod split;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use axum::http::header;
use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio::time::Instant;

pub use self::accounting::Accounting;
pub(crate) use self::admitted::Admitted;
pub(crate) use self::ask::{Among, Ask, Payload};
use self::body::{BodyBudget, Received};
pub(crate) use self::decision::{Attempt, Decision, refusal, routers_own};
pub(crate) use self::guard::Guard;
pub(crate) use self::labels::Labels;
pub use self::recent::RequestId;
pub(crate) use self::split::Outcome as SplitOutcome;
use crate::config::{Config, Limits};
use crate::errors::ApiError;
use crate::explain::Explanation;
use crate::metrics::{Metrics, Outcome};
use crate::models::{ModelList, Models};
use crate::pool::{Leg, Pool};
use crate::prompt::body::Api;
use crate::prompt::conversations::{Conversations, Memo};
use crate::prompt::{Analysis, Input, Prompts, Reader, Scope, TREE_EXPANSION};
use crate::settings::Settings;
use crate::tenancy::Tenancy;

/// How long an explain waits for the one before it (503 after).
const EXPLAIN_WAIT: Duration = Duration::from_secs(10);

/// The `model` label of requests whose model the endpoints do not serve:
/// labels come only from served models, so clients cannot add series.
const UNKNOWN_MODEL: &str = "unknown";

/// The decision service's shared state.
#[derive(Debug)]
pub struct Service {
    /// The pool requests go to.
    pub pool: Arc<Pool>,
    /// What routed requests are counted and recorded in.
    pub accounting: Arc<Accounting>,
    prompts: Prompts,
    limits: Limits,
    allowed_paths: HashSet<String>,
    /// Request bodies in memory.
    bodies: Arc<BodyBudget>,
    /// Requests held until an endpoint can start them.
    pub(crate) flow: Arc<crate::flow::Gate>,
    /// What the warm-ups did last (`routing.warmup`), for `/debug/warmup`.
    pub(crate) warmups: crate::warmup::Statuses,
    /// Explains running: one at a time.
    explains: Arc<Semaphore>,
    models: Arc<Models>,
    /// The exact response cache, when on (the HTTP front end's).
    pub response_cache: Option<Arc<crate::response_cache::ResponseCache>>,
}

/// What a decision is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purpose {
    /// Sending the request: counted.
    Route,
    /// Explaining it: every token kept, no plan, not counted.
    Explain,
}

/// A request admitted and read.
struct Read {
    labels: Labels,
    analysis: Analysis,
    /// The block where it left a recent prompt of its tenant whose later
    /// contents recur.
    diverged: Option<u32>,
    /// The body's share of the budget, while it is held.
    budget: Option<body::Held>,
    /// When it was admitted.
    started: Instant,
    /// The tenant its credentials name.
    tenant: Option<String>,
}

impl Service {
    /// A service over `pool` configured by `config`.
    pub fn new(pool: Arc<Pool>, metrics: Arc<Metrics>, tenancy: Tenancy, config: &Config) -> Self {
        let limits = config.limits.clone();
        let accounting = Arc::new(Accounting::new(metrics.clone(), &tenancy, config));
        let conversations = Conversations::new(metrics.conversation_evictions.clone());
        Service {
            pool,
            prompts: Prompts::new(
                tenancy,
                conversations,
                limits.tokenize_queue,
                limits.retry_after_s,
            ),
            allowed_paths: config.proxy.allowed_paths.iter().cloned().collect(),
            bodies: BodyBudget::new(&limits, &metrics),
            flow: Arc::new(crate::flow::Gate::new(config, metrics.clone())),
            explains: Arc::new(Semaphore::new(1)),
            models: Arc::new(Models::new(&limits)),
            response_cache: None,
            warmups: crate::warmup::Statuses::default(),
            limits,
            accounting,
        }
    }

    /// The service with `cache` answering what it can.
    pub fn with_response_cache(mut self, cache: crate::response_cache::ResponseCache) -> Self {
        self.response_cache = Some(Arc::new(cache));
        self
    }

    /// The tenancy requests are admitted and read with.
    pub fn tenancy(&self) -> &Tenancy {
        self.prompts.tenancy()
    }

    /// Checks a request's credentials as the proxied paths do.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        self.tenancy().tenant(headers).map(drop)
    }

    /// Refuses every request while the pool's policy (in `settings`) asks
    /// for salted tenancy that this router is not configured for.
    pub fn tenancy_check(&self, settings: &Settings) -> Result<(), ApiError> {
        if settings.salting_required && !self.tenancy().salted() {
            return Err(ApiError::SaltingRequired);
        }
        Ok(())
    }

    /// Runs `job` on the tokenizer pool, off the event loop (503 when its
    /// queue is full).
    pub(crate) async fn off_loop<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.prompts.run(self.limits.retry_after_s, job).await
    }

    /// `limits.firstByteTimeoutMs`.
    pub(crate) fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.first_byte_timeout_ms)
    }

    /// Admits a request to `path` with `headers` whose body follows:
    /// the path is proxied, the credentials name a tenant, and the declared
    /// size fits the body budget. A refusal is counted.
    pub(crate) fn admit(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Admitted, ApiError> {
        let started = Instant::now();
        let (mut labels, tenant) = self.checked(path, headers, Purpose::Route)?;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        match Received::new(&self.bodies, declared, tenant.as_deref()) {
            Ok(received) => Ok(Admitted {
                labels,
                tenant,
                received,
                started,
            }),
            Err(e) => {
                labels.count(e.status().as_str());
                Err(e)
            }
        }
    }

    /// Checks that `path` is proxied and the credentials in `headers`;
    /// returns the request's labels (counted unless for an explain) and the
    /// tenant. A refusal is counted.
    fn checked(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        purpose: Purpose,
    ) -> Result<(Labels, Option<String>), ApiError> {
        let mut labels = match purpose {
            Purpose::Route => Labels::new(&self.accounting),
            Purpose::Explain => Labels::uncounted(&self.accounting),
        };
        let checked = self
            .allowed(path)
            .and_then(|()| self.identify(headers, &mut labels));
        match checked {
            Ok(tenant) => Ok((labels, tenant)),
            Err(e) => {
                labels.count(e.status().as_str());
                Err(e)
            }
        }
    }

    /// The decision for a request: its body read, its prompt read, and a
    /// plan among the endpoints it may go to with at least one target
    /// (waiting in the bounded queue while they are all full). Both front
    /// ends decide here, so they decide alike. A refusal is counted.
    pub(crate) async fn decide(self: &Arc<Self>, ask: Ask<'_>) -> Result<Decision, ApiError> {
        let among = ask.among;
        let id = ask.id.clone();
        let objective = crate::flow::objectives::Objectives::named(ask.headers);
        let fairness = ask.fairness.map(str::to_owned);
        let Read {
            mut labels,
            analysis,
            diverged,
            budget,
            started,
            tenant,
        } = self.read(ask, Purpose::Route).await?;
        let who = crate::flow::Who {
            objective,
            flow: fairness.or_else(|| tenant.clone()),
            tenant,
            bytes: analysis.bytes.len(),
        };
        let request = (&analysis.request(), analysis.readable, Leg::Decode);
        let planned = (self.flow.plan(&self.pool, request, among, &who, false)).await;
        let (plan, held) = match planned {
            Ok(p) => p,
            Err(e) => {
                labels.count(e.status().as_str());
                return Err(e);
            }
        };
        self.accounting
            .metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(Decision::new(
            (&self.accounting, &self.pool),
            (labels, id),
            (analysis, diverged),
            (plan, held, who),
            budget,
        ))
    }

    /// Plans `decision` again once an engine refused it
    /// ([`Decision::refused`]): through flow control, as on arrival, so it
    /// waits here while no endpoint can start it. Without flow control, at
    /// once. An error (shed, shutting down) is the request's answer.
    pub(crate) async fn plan_again(&self, decision: &mut Decision) -> Result<(), ApiError> {
        let a = &decision.analysis;
        let (plan, held) = if self.flow.enabled() {
            let request = (&a.request(), a.readable, Leg::Decode);
            (self
                .flow
                .plan(&self.pool, request, &|_| true, &decision.who, true))
            .await?
        } else {
            (self.pool.plan(&a.request(), a.readable), None)
        };
        decision.planned(plan, held);
        Ok(())
    }

    /// Reads a warm-up's body `bytes` to `path` as a request from `tenant`
    /// would be read ([`crate::warmup`]): salted, keyed and hashed alike,
    /// counted nowhere.
    pub(crate) async fn read_warmup(
        self: &Arc<Self>,
        path: &str,
        bytes: Bytes,
        tenant: Option<String>,
    ) -> Result<Analysis, ApiError> {
        let mut model = String::new();
        let headers = HeaderMap::new();
        (self.analyze(
            path,
            &headers,
            (tenant, None),
            bytes,
            Scope::Whole,
            &mut model,
        ))
        .await
    }

    /// Admits a request and reads it, as [`decide`](Self::decide) and
    /// [`explain`](Self::explain) do.
    async fn read(self: &Arc<Self>, ask: Ask<'_>, purpose: Purpose) -> Result<Read, ApiError> {
        let Ask {
            path,
            headers,
            body,
            ..
        } = ask;
        let admitted = match body {
            Payload::Received(admitted) => *admitted,
            Payload::Stream(body) => {
                let mut admitted = self.admit(path, headers)?;
                if let Err(e) = admitted.read(body).await {
                    return Err(admitted.refuse(e));
                }
                admitted
            }
            Payload::Read(bytes) => {
                let started = Instant::now();
                let (labels, tenant) = self.checked(path, headers, purpose)?;
                let read = Read {
                    labels,
                    analysis: Analysis::bodiless(),
                    diverged: None,
                    budget: None,
                    started,
                    tenant: tenant.clone(),
                };
                return self
                    .analyzed(read, path, headers, tenant, bytes, purpose)
                    .await;
            }
            Payload::Bodiless => {
                let mut labels = Labels::new(&self.accounting);
                let tenant = match self.identify(headers, &mut labels) {
                    Ok(t) => t,
                    Err(e) => {
                        labels.count(e.status().as_str());
                        return Err(e);
                    }
                };
                return Ok(Read {
                    labels,
                    analysis: Analysis::bodiless(),
                    diverged: None,
                    budget: None,
                    started: Instant::now(),
                    tenant,
                });
            }
        };
        let Admitted {
            labels,
            tenant,
            received,
            started,
        } = admitted;
        let (bytes, budget) = received.finish();
        let read = Read {
            labels,
            analysis: Analysis::bodiless(),
            diverged: None,
            budget: Some(budget),
            started,
            tenant: tenant.clone(),
        };
        self.analyzed(read, path, headers, tenant, bytes, purpose)
            .await
    }

    /// `read` with the analysis of its body `bytes`.
    async fn analyzed(
        self: &Arc<Self>,
        mut read: Read,
        path: &str,
        headers: &HeaderMap,
        tenant: Option<String>,
        bytes: Bytes,
        purpose: Purpose,
    ) -> Result<Read, ApiError> {
        let scope = match purpose {
            Purpose::Route => Scope::Whole,
            Purpose::Explain => Scope::KeepTokens,
        };
        let own = tenant
            .as_deref()
            .map_or(0, |t| xxhash_rust::xxh3::xxh3_64(t.as_bytes()));
        let labels = &mut read.labels;
        let held = read.budget.as_ref();
        match self
            .analyze(
                path,
                headers,
                (tenant, held),
                bytes,
                scope,
                &mut labels.model,
            )
            .await
        {
            Ok(a) => read.analysis = a,
            Err(e) => {
                labels.count(e.status().as_str());
                return Err(e);
            }
        }
        if purpose == Purpose::Route {
            read.diverged = self.accounting.volatile(&read.analysis, &read.labels, own);
        }
        Ok(read)
    }

    /// The tenant the credentials in `headers` name, labelled in `labels`.
    fn identify(
        &self,
        headers: &HeaderMap,
        labels: &mut Labels,
    ) -> Result<Option<String>, ApiError> {
        let tenant = self.tenancy().tenant(headers)?;
        labels.tenant = self.accounting.tenant_label(tenant.as_deref());
        Ok(tenant)
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

    /// Reads a request to `path` with `headers` and body `bytes` from
    /// `tenant` ([`Prompts::read`]) as the pool's settings say; a body
    /// parsed whole holds [`TREE_EXPANSION`] times its size more of its
    /// budget (`held`, when it has one) while it is read. Sets
    /// `model_label` to the model for metrics (`unknown` when not served);
    /// an unknown model is 404.
    async fn analyze(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        (tenant, held): (Option<String>, Option<&body::Held>),
        bytes: Bytes,
        scope: Scope,
        model_label: &mut String,
    ) -> Result<Analysis, ApiError> {
        let (settings, exact) = self.pool.routing();
        self.tenancy_check(&settings)?;
        let conversation = headers
            .get(&settings.conversation_header)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let reader = Reader::of(
            &settings,
            exact,
            bytes.len(),
            self.limits.max_tokenize_bytes,
        );
        if reader == Reader::TooLarge {
            self.accounting.metrics.prompts_not_tokenized.inc();
        }
        let _parsing = match held {
            Some(h) if reader.builds_tree(Api::of(path)) => {
                Some(h.more(bytes.len() * TREE_EXPANSION)?)
            }
            _ => None,
        };
        let held = (reader.exact()
            && scope != Scope::KeepTokens
            && settings.policy.reads_held_prefix_only())
        .then(|| self.pool.clone() as Arc<dyn crate::prompt::Holds>);
        let known = self.models().await;
        let input = Input {
            api: Api::of(path),
            tenant,
            conversation,
            reader,
            scope,
            held,
        };
        let analysis = self
            .prompts
            .read(bytes, input, settings, known.clone())
            .await?;
        if let Some(memo) = analysis.memo {
            let result = match memo {
                Memo::Hit => "hit",
                Memo::Miss => "miss",
            };
            self.accounting
                .metrics
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
    /// changing any state (`POST /debug/explain`): the same admission and
    /// reading as a proxied request, then the pool's explanation.
    pub async fn explain(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Explanation, ApiError> {
        // One at a time, on a blocking thread: an explain reads its prompt
        // whole, and must not take the request path's tokenizer workers or
        // its event loops.
        let retry_after = self.limits.retry_after_s;
        let one = tokio::time::timeout(EXPLAIN_WAIT, self.explains.clone().acquire_owned())
            .await
            .map_err(|_| ApiError::Saturated("explain requests", retry_after))?
            .expect("the semaphore is never closed");
        let (service, path, headers) = (self.clone(), path.to_owned(), headers.clone());
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _one = one;
            runtime.block_on(service.explain_here(&path, &headers, body))
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
        let ask = Ask {
            path,
            headers,
            body: Payload::Read(body),
            among: &|_| true,
            fairness: None,
            id: RequestId::of(headers),
        };
        let a = self.read(ask, Purpose::Explain).await?.analysis;
        let decision = self.pool.explain(&a.request(), a.readable);
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

    /// The routing decision for a request as a front end makes it: the
    /// same admission, reading and plan, then the first target's load and
    /// the policy's memory of it, as when sent (the load released at
    /// once) and its missed tokens attributed as if the engine found what
    /// was expected, without I/O and not counted as a request. Returns the
    /// first target's name. For measuring what a decision costs.
    pub async fn measure(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<String, ApiError> {
        let ask = Ask {
            path,
            headers,
            body: Payload::Read(body),
            among: &|_| true,
            fairness: None,
            id: RequestId::of(headers),
        };
        let decision = self.decide(ask).await?;
        let target = decision.targets()[0].clone();
        let attempt =
            (decision.send(0, &target)).ok_or(ApiError::Unavailable { retry_after: 1 })?;
        decision.attribute_expected(&attempt);
        drop(attempt);
        decision.forget();
        Ok(target.name.to_string())
    }

    /// What the endpoints serve (see [`Models`]).
    pub async fn models(self: &Arc<Self>) -> Arc<ModelList> {
        self.models.get(|| self.pool.addresses()).await
    }

    /// The exposition text of `/metrics`, with the gauges that are set
    /// when read (`kvroute_cache_pressure`, the response cache's) as of now.
    pub fn render_metrics(&self) -> String {
        self.accounting.set_pressure();
        if let Some(cache) = &self.response_cache {
            cache.refresh_gauges();
        }
        self.accounting.metrics.render(&self.pool)
    }
}

#[cfg(test)]
mod tests;
