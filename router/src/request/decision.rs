//! A decided request, from its plan to the start of its response: where
//! each attempt goes and what it holds, and the one commit that counts
//! where the response began. Every counter a routed request moves is moved
//! here (or by the [`Guard`] the commit returns), whichever front end sent
//! it, into the [`Accounting`] it holds with the pool.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use tokio::time::Instant;

use kvroute_core::admission::{LOAD_HEADER, MAX_REFUSALS};
use kvroute_core::load::EngineLoad;
use kvroute_core::slot::Slot;

use super::guard::{Expected, Guard};
use super::hit_rate::Usage;
use super::labels::Labels;
use super::missed::Known;
use super::{Accounting, RequestId, body};
use crate::flow::{Held, Who};
use crate::metrics::{ModelTenant, Why};
use crate::pool::{Fault, InFlight, Lost, Plan, Pool, Seen, Target};
use crate::prompt::Analysis;

/// A decided request ([`super::Service::decide`]). Dropped before a
/// commit or an answer, it counts the request as 499 (the client went
/// away).
#[derive(Debug)]
pub(crate) struct Decision {
    accounting: Arc<Accounting>,
    pool: Arc<Pool>,
    labels: Labels,
    pub(super) analysis: Analysis,
    plan: Plan,
    by: ModelTenant,
    /// Prompt tokens expected cached at the first target.
    cached: u64,
    /// The body's share of the budget.
    budget: Option<body::Held>,
    id: RequestId,
    /// The block where the prompt left a recent one whose later contents
    /// recur.
    diverged: Option<u32>,
    /// Endpoints whose engine refused the request for its bound
    /// ([`kvroute_core::admission`]), at most `MAX_REFUSALS`.
    refused: Vec<Slot>,
    /// How long flow control held it, and why.
    held: Option<Held>,
    /// Who it is, for flow control, should it be planned again.
    pub(super) who: Who,
    /// How long its prefill leg took, when it was disaggregated.
    prefill_leg: Option<Duration>,
}

/// One attempt at an endpoint: the load it holds there until dropped.
#[derive(Debug)]
pub(crate) struct Attempt {
    /// Where it goes.
    pub(crate) target: Target,
    load: InFlight,
    /// Prompt tokens expected cached there.
    cached: u64,
    /// Whether it is the policy's first choice.
    first: bool,
    /// Whether the policy learned it already.
    learned: bool,
    /// What the router knew of the request there.
    pub(super) known: Known,
    /// When it counts as hung ([`super::hang`]); `None` for a pick whose
    /// sending the gateway owns.
    pub(crate) hang: Option<Duration>,
}

impl Decision {
    /// A routed request: counted as routed with its prompt tokens.
    pub(super) fn new(
        (accounting, pool): (&Arc<Accounting>, &Arc<Pool>),
        (labels, id): (Labels, RequestId),
        (analysis, diverged): (Analysis, Option<u32>),
        (plan, held, who): (Plan, Option<Held>, Who),
        budget: Option<body::Held>,
    ) -> Self {
        let by = labels.model_tenant();
        accounting.count_routed(&by, analysis.prompt_tokens);
        Decision {
            cached: analysis.expected_cached(plan.cached_blocks),
            accounting: accounting.clone(),
            pool: pool.clone(),
            labels,
            analysis,
            plan,
            by,
            budget,
            id,
            diverged,
            refused: Vec::new(),
            held,
            who,
            prefill_leg: None,
        }
    }

    /// The request's id.
    pub(crate) fn id(&self) -> &RequestId {
        &self.id
    }

    /// The endpoints to try, best first: at least one.
    pub(crate) fn targets(&self) -> &[Target] {
        &self.plan.targets
    }

    /// The body to forward (rewritten when tenancy sets `cache_salt`).
    pub(crate) fn body(&self) -> &Bytes {
        &self.analysis.bytes
    }

    /// What the router read of it.
    pub(crate) fn analysis(&self) -> &Analysis {
        &self.analysis
    }

    /// Prompt tokens its first target is expected to prefill.
    pub(crate) fn expected_uncached(&self) -> u64 {
        self.analysis.prompt_tokens.saturating_sub(self.cached)
    }

    /// Its prefill leg was done elsewhere in `took`: `body` (with the
    /// producer's `kv_transfer_params`) goes to the decode endpoint, which
    /// loads the prompt's KV and computes its last token only.
    pub(crate) fn prefilled(&mut self, body: Bytes, took: Duration) {
        self.prefill_leg = Some(took);
        self.analysis.bytes = body;
        self.cached = self.analysis.prompt_tokens.saturating_sub(1);
    }

    /// Takes the body to forward out, with its share of the budget (held
    /// until the caller has sent it).
    pub(crate) fn take_body(&mut self) -> (Bytes, Option<body::Held>) {
        (std::mem::take(&mut self.analysis.bytes), self.budget.take())
    }

    /// Attempt `n` (0 the first), sent now to `target`: counted by its
    /// reason, holding `target`'s load, and learned by the policy. `None`
    /// when `target` no longer admits a request ([`Pool::start`]).
    pub(crate) fn send(&self, n: usize, target: &Target) -> Option<Attempt> {
        let first = n == 0;
        let cached = if first { self.cached } else { 0 };
        let uncached = self.analysis.prompt_tokens - cached;
        let a = &self.analysis;
        let ttft = self.pool.predicted_ttft(&a.request(), target, uncached);
        let load = self.pool.start(&a.request(), target, uncached)?;
        self.count_decision(target, first);
        Some(Attempt {
            target: target.clone(),
            load,
            cached,
            first,
            learned: true,
            known: self.known(Some(n % self.plan.targets.len())),
            hang: self.accounting.hang.of(a.stream, a.max_tokens, ttft),
        })
    }

    /// The bound on the wait before prefill to send with an attempt at
    /// `target`, milliseconds, and the room in KV blocks to leave there
    /// ([`kvroute_core::admission`]): none once its engine refused this
    /// request, or once `MAX_REFUSALS` did.
    pub(crate) fn admit_within(&self, target: &Target) -> Option<(u64, Option<u64>)> {
        let asked = self.refused.len() < MAX_REFUSALS && !self.refused.contains(&target.slot);
        let bound = target.admit_within_ms.filter(|_| asked)?;
        Some((bound, self.plan.room))
    }

    /// `attempt`'s engine refused it for its bound and said its load: that
    /// becomes the endpoint's load. The request is to be planned again
    /// with it ([`super::Service::plan_again`]).
    pub(crate) fn refused(&mut self, attempt: Attempt, report: EngineLoad) {
        drop(attempt.load);
        self.accounting.metrics.admission_refusals.inc();
        self.pool.refused(attempt.target.slot, report);
        self.refused.push(attempt.target.slot);
    }

    /// Planned again, after being held `held` more: attempts start over at
    /// `plan`'s first target. An empty plan (every endpoint at its limit)
    /// keeps the old one.
    pub(super) fn planned(&mut self, plan: Plan, held: Option<Held>) {
        if plan.targets.is_empty() {
            return;
        }
        self.cached = self.analysis.expected_cached(plan.cached_blocks);
        self.plan = plan;
        if let Some(more) = held {
            let seconds = self.held.map_or(0.0, |h| h.seconds) + more.seconds;
            let because = self.held.map_or(more.because, |h| h.because);
            self.held = Some(Held { seconds, because });
        }
    }

    /// The first target, picked for a gateway to send to: counted by its
    /// reason and holding its load; the policy learns where the response
    /// begins ([`commit`](Self::commit)), which may be elsewhere.
    pub(crate) fn pick(&self) -> Attempt {
        let target = self.plan.targets[0].clone();
        self.count_decision(&target, true);
        let prompt_tokens = self.analysis.prompt_tokens;
        let load = self
            .pool
            .hold(&target, prompt_tokens, prompt_tokens - self.cached);
        Attempt {
            target,
            load,
            cached: self.cached,
            first: true,
            learned: false,
            known: self.known(Some(0)),
            hang: None,
        }
    }

    /// The gateway sent the request to `target` instead of the pick: a
    /// retry there, expected to find nothing cached.
    pub(crate) fn instead(&self, target: Target) -> Attempt {
        self.count_decision(&target, false);
        let at = self.plan.targets.iter().position(|t| t.slot == target.slot);
        let prompt_tokens = self.analysis.prompt_tokens;
        let load = self.pool.hold(&target, prompt_tokens, prompt_tokens);
        Attempt {
            target,
            load,
            cached: 0,
            first: false,
            learned: false,
            known: self.known(at),
            hang: None,
        }
    }

    /// `attempt` failed before its response began, `kind` of failure
    /// (`status`, `transport`, …), the endpoint's `fault` when it is one.
    pub(crate) fn failed(&self, attempt: Attempt, kind: &'static str, fault: Option<Fault>) {
        drop(attempt.load);
        self.accounting
            .failure(&self.pool, &attempt.target.name, kind, fault);
    }

    /// The response of `attempt`, sent at `sent`, began with `status`: the
    /// policy learns where it went, and the returned guard follows the
    /// response and counts the request when it ends.
    pub(crate) fn commit(mut self, attempt: Attempt, status: StatusCode, sent: Instant) -> Guard {
        let metrics = &self.accounting.metrics;
        if attempt.first {
            metrics.first_choice.inc();
            metrics
                .expected_cached_tokens
                .get_or_create(&self.by)
                .inc_by(attempt.cached);
        }
        if !attempt.learned {
            self.pool.learn(&self.analysis.request(), &attempt.target);
        }
        if status.is_success() {
            (self.pool.warmup).touched(&self.analysis.chain, &attempt.target.name);
        }
        let expected = self.expected(&attempt);
        let labels = self.labels.hand_over();
        let load = (attempt.load, attempt.target.name);
        let holds = (&self.accounting, &self.pool);
        Guard::new(holds, load, sent, labels, status, expected)
    }

    /// The request was answered with `status` without a response to follow
    /// (every attempt failed, or the gateway gave up).
    pub(crate) fn answered(mut self, status: StatusCode) {
        self.labels.count(status.as_str());
    }

    /// Never counted as a request ([`super::Service::measure`]).
    pub(super) fn forget(self) {
        self.labels.forget();
    }

    /// What the router expected of `attempt`.
    fn expected(&self, attempt: &Attempt) -> Expected {
        self.expected_at(attempt.cached, attempt.known)
    }

    /// What was expected where `cached` prompt tokens were expected
    /// cached, and `known`.
    fn expected_at(&self, cached: u64, known: Known) -> Expected {
        let a = &self.analysis;
        Expected {
            cached,
            prompt_tokens: a.prompt_tokens,
            known,
            id: self.id.clone(),
            key: a.key.0,
            first_block: a.chain.first().copied(),
            held: self.held,
            prefill_leg: self.prefill_leg,
        }
    }

    /// Attributes the missed tokens of `attempt` as if its engine found
    /// what was expected cached there ([`super::Service::measure`]).
    pub(super) fn attribute_expected(&self, attempt: &Attempt) {
        let e = self.expected(attempt);
        let usage = Usage {
            prompt_tokens: e.prompt_tokens,
            cached_tokens: e.cached,
        };
        let name = &attempt.target.name;
        (self.accounting).missed(&self.labels, name, &e, usage, None);
    }

    /// Its prefill leg went to `plan`'s target `at`, expecting `cached`
    /// prompt tokens cached there, and its engine answered `usage`: what
    /// the cache saved the request, counted and attributed as any
    /// request's ([`super::missed`], [`super::hit_rate`]). Its decode leg
    /// loads the prompt and is not counted again.
    pub(crate) fn prefill_answered(&self, plan: &Plan, at: usize, cached: u64, usage: Usage) {
        let e = self.expected_at(cached, self.known_in(plan.seen.as_ref(), Some(at)));
        let name = &plan.targets[at].name;
        (self.accounting).usage((&self.labels, &self.pool), name, &e, usage, None);
    }

    /// What the router knew of the request at target `at` (by position;
    /// `None`: not a target), for attributing its missed tokens
    /// ([`super::missed`]). Targets before it were tried and failed; those
    /// after it were ranked lower.
    fn known(&self, at: Option<usize>) -> Known {
        self.known_in(self.plan.seen.as_ref(), at)
    }

    /// [`known`](Self::known) in a plan that `seen` describes.
    fn known_in(&self, seen: Option<&Seen>, at: Option<usize>) -> Known {
        let a = &self.analysis;
        let Some(seen) = seen else {
            return Known {
                block_tokens: a.block_tokens,
                ..Known::default()
            };
        };
        let tokens = |blocks: u32| u64::from(blocks) * a.block_tokens;
        // What the engine's reports said it held: a prefix the policy
        // credits only because this router sent it there recently may have
        // been evicted since (the index would say so) or not be computed
        // yet (first sight).
        let held = at.map_or(0, |i| seen.held[i]);
        let mut elsewhere = seen.outside;
        for (i, &h) in seen.held.iter().enumerate() {
            if Some(i) != at && h > elsewhere.map_or(0, |e| e.0) {
                let lost = if at.is_none_or(|at| i < at) {
                    Lost::Retry
                } else {
                    Lost::Load
                };
                elsewhere = Some((h, lost));
            }
        }
        Known {
            block_tokens: a.block_tokens,
            prompt_tokens: a.tokenized.then_some(a.prompt_tokens),
            contract: at.is_some_and(|i| seen.foreign[i]),
            held: tokens(held),
            elsewhere: elsewhere.map(|(b, lost)| (tokens(b), lost)),
            recent: tokens(seen.recent),
            diverged: self.diverged.map(tokens),
        }
    }

    /// Counts an attempt at `target`'s decision: the policy's reason for
    /// the first choice, else `retry`; a first choice is one of the pool's
    /// recent decisions.
    fn count_decision(&self, target: &Target, first: bool) {
        let reason = if first {
            self.pool.decided(target, self.plan.reason);
            self.plan.reason.as_str()
        } else {
            "retry"
        };
        (self.accounting.metrics)
            .routing_decisions
            .get_or_create(&Why { reason })
            .inc();
    }
}

/// The prefix of the router's own headers. A client's are read by the
/// router (`x-kvroute-cache-sampled`) and never reach an engine: one it
/// could forge (`x-kvroute-admit-within-ms`) would make the engine refuse
/// what the router then counts against it.
const ROUTER_PREFIX: &str = "x-kvroute-";

/// Whether `name` is one of the router's own headers ([`ROUTER_PREFIX`]).
pub(crate) fn routers_own(name: &axum::http::HeaderName) -> bool {
    name.as_str().starts_with(ROUTER_PREFIX)
}

/// An engine's admission refusal ([`kvroute_core::admission`]): a 503
/// with its load report in a header, received now.
pub(crate) fn refusal(status: StatusCode, headers: &axum::http::HeaderMap) -> Option<EngineLoad> {
    if status != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    let report = kvroute_proto::load::from_header(headers.get(LOAD_HEADER)?.as_bytes())?;
    Some(kvroute_proto::load::engine_load(
        &report,
        Instant::now().into_std(),
    ))
}
