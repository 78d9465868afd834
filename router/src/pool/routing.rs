//! Routing over the pool: a ranked [`Plan`] for a request (the policy's,
//! or the least loaded endpoint's when the prompt is unreadable), what it
//! would be and why ([`Pool::explain`]), the predicted time to first token,
//! and the requests in flight: counted against their endpoint's load and
//! taught to the policy when started, released by dropping [`InFlight`].
//!
//! Not here: the decision rules (`kvroute_core::policy`), or what an
//! outcome means for the endpoint's health (`health`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::admission;
use kvroute_core::contract::Contract;
use kvroute_core::load::{EngineLoad, Ticket};
use kvroute_core::policy::{Context, Endpoint, Policy, Predicted, Reason, Request};
use kvroute_core::role::Role;
use kvroute_core::slot::Slot;
use kvroute_core::spec::DisaggregationMode;

use super::{Inner, Pool, now};
use crate::explain::{Explained, ExplainedEndpoint, ExplainedPrefill};

/// One endpoint in a routing plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// Its name.
    pub name: Arc<str>,
    /// Its HTTP address.
    pub http: SocketAddr,
    /// Its slot.
    pub slot: Slot,
    /// Its rendezvous identity.
    pub id: u64,
    /// The policy's bound on the wait before prefill there, milliseconds
    /// ([`kvroute_core::admission`]); set in plans only.
    pub admit_within_ms: Option<u64>,
    /// The wait before prefill and the time to first token the policy
    /// predicts there; set in plans only, by policies that predict them,
    /// where the engine's report is fresh.
    pub predicted: Option<Predicted>,
}

/// Which endpoints a plan ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leg {
    /// A whole request, or a disaggregated one's decode leg:
    /// decode-capable endpoints.
    Decode,
    /// A disaggregated request's prefill leg: prefill-capable endpoints.
    Prefill,
}

impl Leg {
    /// Whether an endpoint of `role` takes this leg.
    pub fn takes(self, role: Role) -> bool {
        match self {
            Leg::Decode => role.decodes(),
            Leg::Prefill => role.prefills(),
        }
    }
}

/// An owner of a named prefix ([`Pool::owners`]).
#[derive(Clone, Debug)]
pub struct PrefixOwner {
    pub target: Target,
    /// Leading blocks of the prefix its engine reports.
    pub held_blocks: u32,
    /// Whether a warm-up there would wait or delay requests.
    pub busy: bool,
}

/// Where a request should go, in order.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Endpoints under their concurrency limit, best first.
    pub targets: Vec<Target>,
    /// Routable endpoints that were at their limit.
    pub full: usize,
    /// The best ranked of those.
    pub first_full: Option<SocketAddr>,
    /// The policy's reason for the first.
    pub reason: Reason,
    /// Leading blocks the policy believes the first holds.
    pub cached_blocks: u32,
    /// What the engines' reports said of the request's prefix (exact mode,
    /// a prompt read).
    pub seen: Option<Seen>,
    /// KV blocks flow control keeps free at the first target beside the
    /// request (room for a higher priority or a lighter tenant), for the
    /// engine's admission check to count ([`admission::ROOM_HEADER`]).
    pub room: Option<u64>,
}

/// What the engines' reports said of a request's prefix when it was
/// planned, in blocks: what its missed tokens are attributed by
/// ([`crate::request::missed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// Leading blocks each target holds, by target.
    pub held: Vec<u32>,
    /// Whether each target's engine hashes differently, by target.
    pub foreign: Vec<bool>,
    /// The longest prefix an endpoint that is not a target holds, and
    /// why it is not one.
    pub outside: Option<(u32, Lost)>,
    /// Leading blocks of the chain that an engine holds or evicted
    /// recently.
    pub recent: u32,
}

/// Why an endpoint holding a longer prefix was not the one sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lost {
    /// It was routable and free, and the policy ranked it lower: slower by
    /// the latency model beyond the slack.
    Load,
    /// It was at its concurrency limit, or flow control found it could
    /// not start the request when it was sent.
    Queue,
    /// Not ready, draining, or failing its health checks.
    Health,
    /// Ejected as an outlier.
    Ejection,
    /// A gateway's subset hint left it out.
    Subset,
    /// It was tried first and failed; the response came from a retry.
    Retry,
}

impl Lost {
    /// The reason as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Lost::Load => "load",
            Lost::Queue => "queue",
            Lost::Health => "health",
            Lost::Ejection => "ejection",
            Lost::Subset => "subset",
            Lost::Retry => "retry",
        }
    }
}

impl Pool {
    /// Ranks the routable endpoints for `request`. Endpoints at their
    /// concurrency limit are left out of the targets (and counted in
    /// `full`).
    /// `readable` is false when the router could not read a prompt from the
    /// request: it then goes to the least loaded endpoint instead.
    pub fn plan(&self, request: &Request<'_>, readable: bool) -> Plan {
        self.plan_among(request, readable, &|_| true)
    }

    /// [`plan`](Self::plan) among the endpoints whose HTTP address
    /// `among` accepts (a gateway's subset hint).
    pub fn plan_among(
        &self,
        request: &Request<'_>,
        readable: bool,
        among: &dyn Fn(&SocketAddr) -> bool,
    ) -> Plan {
        self.plan_except(request, readable, among, &[], Leg::Decode)
    }

    /// The plan of `leg` of `request` among the endpoints `among`
    /// accepts, leaving out those in `except`: flow control's, which
    /// cannot take the request now (a longer prefix there was lost to
    /// [`Lost::Queue`]). A disaggregated request's prefill leg is ranked
    /// by the same policy among the prefill-capable endpoints (their
    /// caches, their queues).
    pub fn plan_except(
        &self,
        request: &Request<'_>,
        readable: bool,
        among: &dyn Fn(&SocketAddr) -> bool,
        except: &[SocketAddr],
        leg: Leg,
    ) -> Plan {
        let among = |a: &SocketAddr| among(a) && !except.contains(a);
        let mut inner = self.lock();
        let now = now();
        let (endpoints, candidates) = inner.candidates(now, &among, leg);
        let inner = &mut *inner;
        // Field by field: the policy is borrowed mutably beside it.
        let cx = Context {
            index: inner.exact.then_some(&inner.index),
            block_tokens: inner.settings.hasher.config().block_size as u64,
            now,
            pinned: Some(inner.load.pinned()),
        };
        let decision = if readable {
            inner.policy.rank(request, &endpoints, &cx)
        } else {
            inner.least_loaded.rank(request, &endpoints, &cx)
        };
        let (mut full, mut first_full) = (0, None);
        // Flow control gates on a prediction only where an engine's fresh
        // report backs it; elsewhere on the concurrency limit alone.
        let max_age =
            Duration::from_millis(inner.settings.policy.prefill_model().max_report_age_ms);
        let reported = |i: usize| (endpoints[i].load.engine).is_some_and(|e| e.age(now) <= max_age);
        let targets: Vec<Target> = decision
            .ranked
            .iter()
            .filter(|&&i| {
                let under = endpoints[i].load.in_flight < self.concurrency;
                full += usize::from(!under);
                if !under && first_full.is_none() {
                    first_full = Some(candidates[i].http);
                }
                under
            })
            .map(|&i| Target {
                admit_within_ms: (inner.policy.admit_within(i))
                    .filter(|_| readable)
                    .map(admission::bound_ms),
                predicted: (inner.policy.predicted(i)).filter(|_| readable && reported(i)),
                ..candidates[i].clone()
            })
            .collect();
        let seen = (inner.exact && readable)
            .then(|| inner.seen(request.chain, &targets, now, (&among, leg)));
        Plan {
            targets,
            full,
            first_full,
            reason: decision.reason,
            cached_blocks: decision.cached_blocks,
            seen,
            room: None,
        }
    }

    /// What [`plan`](Self::plan) would decide for `request`, with every
    /// endpoint's view of it, changing nothing: the policy decides on a
    /// copy of itself.
    pub fn explain(&self, request: &Request<'_>, readable: bool) -> Explained {
        let inner = self.lock();
        let now = now();
        let prefill = inner.settings.policy.prefill_model();
        let block_tokens = inner.settings.hasher.config().block_size as u64;
        let cx = Context {
            index: inner.exact.then_some(&inner.index),
            block_tokens,
            now,
            pinned: Some(inner.load.pinned()),
        };
        let mut leading = Vec::new();
        if inner.exact {
            inner.index.longest_prefix(request.chain, &mut leading);
        }
        let (endpoints, targets) = inner.candidates(now, &|_| true, Leg::Decode);
        let mut policy = if readable {
            inner.policy.boxed_clone()
        } else {
            inner.least_loaded.boxed_clone()
        };
        let decision = policy.rank(request, &endpoints, &cx);
        // The policies compare every routable endpoint at one rate.
        let rate = prefill.pool_rate(endpoints.iter().map(|e| &e.load));
        let ranked = decision
            .ranked
            .iter()
            .map(|&i| targets[i].name.to_string())
            .collect();
        let d = inner.settings.disaggregation;
        let split = (d.mode == DisaggregationMode::Auto).then(|| {
            let (endpoints, targets) = inner.candidates(now, &|_| true, Leg::Prefill);
            let decision = policy.boxed_clone().rank(request, &endpoints, &cx);
            ExplainedPrefill {
                reason: decision.reason.as_str().to_owned(),
                cached_blocks: decision.cached_blocks,
                ranked: (decision.ranked.iter())
                    .map(|&i| targets[i].name.to_string())
                    .collect(),
                min_uncached_tokens: d.min_uncached_tokens,
            }
        });
        let explained_endpoints = inner
            .members
            .values()
            .map(|m| {
                let load = inner.load.load(m.slot);
                let cached = leading.get(m.slot.index()).copied().unwrap_or(0);
                let uncached = request
                    .prompt_tokens
                    .saturating_sub(u64::from(cached) * block_tokens);
                let blocks = inner.demand_blocks(request, m.slot);
                let queued = prefill.queued_s_at(&load, now, rate);
                let memory = prefill.memory_wait_s(&load, blocks, now);
                ExplainedEndpoint {
                    name: m.spec.name.clone(),
                    routable: inner.is_routable(m, now),
                    full: load.in_flight >= self.concurrency,
                    contract: m.contract.as_str().to_owned(),
                    cached_blocks: cached,
                    in_flight: load.in_flight,
                    queue_seconds: queued,
                    memory_wait_seconds: memory,
                    predicted_ttft_seconds: queued.max(memory)
                        + prefill.prefill_s_at(uncached, rate),
                }
            })
            .collect();
        Explained {
            policy: policy.name().to_owned(),
            reason: if readable {
                decision.reason.as_str()
            } else {
                "unreadable"
            }
            .to_owned(),
            cached_blocks: decision.cached_blocks,
            ranked,
            prefill_tokens_per_second: rate,
            endpoints: explained_endpoints,
            prefill: split,
        }
    }

    /// `slot`'s engine refused a request it could not start within the
    /// bound ([`kvroute_core::admission`]): the load it answered with is
    /// the endpoint's from now on, until its next report.
    pub fn refused(&self, slot: Slot, report: EngineLoad) {
        self.lock().load.refused(slot, report, now());
        self.changed.notify_waiters();
    }

    /// Remembers that a request's first attempt goes to `target` for
    /// `reason` (`/debug/pool`'s shares of the last decisions).
    pub fn decided(&self, target: &Target, reason: Reason) {
        let mut decisions = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        decisions.record(target.name.clone(), reason == Reason::Cold);
    }

    /// Counts a request sent to `target` and lets the policy learn it.
    /// The count ends when the returned guard is dropped, however the
    /// request ends: completion, error, client disconnect, stream reset or
    /// timeout. `None`, counting nothing, when `target` no longer admits a
    /// request (ejected, or half-open with its trial in flight, since the
    /// plan): checked under the same lock that begins a trial, so
    /// concurrent requests cannot both be one.
    pub fn start(
        self: &Arc<Self>,
        request: &Request<'_>,
        target: &Target,
        uncached_tokens: u64,
    ) -> Option<InFlight> {
        // One lock for all: this is the request path.
        let mut inner = self.lock();
        if !inner.outlier.admits(&target.name, now()) {
            return None;
        }
        inner.learn(request, target);
        let block_tokens = inner.settings.hasher.config().block_size as u64;
        let tokens = (
            request.prompt_tokens,
            uncached_tokens,
            request.output_tokens,
        );
        let ticket = (inner.load).start_request(target.slot, request.chain, tokens, block_tokens);
        let trial = inner.outlier.begin(&target.name, now());
        drop(inner);
        self.changed.notify_waiters();
        let mut load = self.in_flight(ticket);
        if trial {
            load.trial = Some(target.name.clone());
        }
        Some(load)
    }

    /// The predicted time to first token at `target` for `request` with
    /// `uncached_tokens` to prefill there, by the policy's prefill model
    /// over the endpoint's load now (before the request is counted).
    pub fn predicted_ttft(
        &self,
        request: &Request<'_>,
        target: &Target,
        uncached_tokens: u64,
    ) -> std::time::Duration {
        let inner = self.lock();
        let load = inner.load.load(target.slot);
        let blocks = inner.demand_blocks(request, target.slot);
        let s = inner
            .settings
            .policy
            .prefill_model()
            .ttft_s(&load, uncached_tokens, blocks, now());
        std::time::Duration::try_from_secs_f64(s).unwrap_or(std::time::Duration::MAX)
    }

    /// The owners of the prefix `request` (a warm-up's, [`crate::warmup`]):
    /// the first `n` routable endpoints in the rendezvous order of the key
    /// the policy places such a request by, among the prefill-capable
    /// endpoints when the pool has `prefill` ones, else the decode-capable.
    /// Each with the leading blocks of its chain its engine reports, and
    /// whether it is busy: at its concurrency limit, or its prefill queue
    /// predicted longer than `busy_s`.
    pub fn owners(&self, request: &Request<'_>, n: usize, busy_s: f64) -> Vec<PrefixOwner> {
        let inner = self.lock();
        let now = now();
        let split = (inner.members.values()).any(|m| m.spec.role == Role::Prefill);
        let leg = if split { Leg::Prefill } else { Leg::Decode };
        let (endpoints, targets) = inner.candidates(now, &|_| true, leg);
        let key = inner.policy.placement(request, endpoints.len());
        let ids: Vec<u64> = endpoints.iter().map(|e| e.id).collect();
        let mut by_slot = Vec::new();
        if inner.exact {
            inner.index.longest_prefix(request.chain, &mut by_slot);
        }
        let model = inner.settings.policy.prefill_model();
        let ranked = kvroute_core::rendezvous::rank(key.0, &ids);
        (ranked.into_iter().take(n))
            .map(|i| {
                let load = &endpoints[i].load;
                PrefixOwner {
                    held_blocks: by_slot.get(endpoints[i].slot.index()).copied().unwrap_or(0),
                    busy: load.in_flight >= self.concurrency || model.queued_s(load, now) > busy_s,
                    target: targets[i].clone(),
                }
            })
            .collect()
    }

    /// The pool's prefill rate, tokens per second: the median of the
    /// rates its engines report, else the configured one
    /// ([`kvroute_core::load::PrefillModel::pool_rate`]).
    pub fn prefill_rate(&self) -> f64 {
        let inner = self.lock();
        let loads: Vec<_> = (inner.members.values())
            .map(|m| inner.load.load(m.slot))
            .collect();
        inner.settings.policy.prefill_model().pool_rate(&loads)
    }

    /// Whether `plan`'s first target can start `request` and still have,
    /// for another request, a seat and `extra_blocks` of KV memory free
    /// within `hold_s`, and its prefill start within `hold_s`: the queued
    /// prefill, this request's included, takes at most `hold_s`, or, for a
    /// request whose own prefill is longer, none is queued before it
    /// ([`crate::flow`]'s room for higher priorities). Memory is judged
    /// from the engine's fresh report (without one, the seat alone), the
    /// prefill queue as the policy predicts it.
    pub fn leaves_room(
        &self,
        (request, leg): (&Request<'_>, Leg),
        plan: &Plan,
        extra_blocks: u64,
        hold_s: f64,
    ) -> bool {
        let Some(target) = plan.targets.first() else {
            return false;
        };
        let inner = self.lock();
        let load = inner.load.load(target.slot);
        if load.in_flight.saturating_add(2) > self.concurrency {
            return false;
        }
        let block_tokens = inner.settings.hasher.config().block_size as u64;
        let cached = u64::from(plan.cached_blocks) * block_tokens;
        let uncached = request.prompt_tokens.saturating_sub(cached);
        let blocks = inner.demand_blocks(request, target.slot) + extra_blocks;
        let model = inner.settings.policy.prefill_model();
        let now = now();
        let (queued, own) = (model.queued_s(&load, now), model.prefill_s(&load, uncached));
        // A longer prefill only where none is queued, and while another
        // endpoint is left whose queue lets a request start within `hold_s`.
        let prefill = queued + own <= hold_s
            || queued <= 0.0
                && inner.members.values().any(|m| {
                    let load = inner.load.load(m.slot);
                    m.slot != target.slot
                        && leg.takes(m.spec.role)
                        && inner.is_routable(m, now)
                        && load.in_flight < self.concurrency
                        && model.queued_s(&load, now) <= hold_s
                });
        prefill && model.memory_wait_s(&load, blocks, now) <= hold_s
    }

    /// KV blocks `request` takes in all, prompt and output.
    pub fn blocks_of(&self, request: &Request<'_>) -> u64 {
        let block_tokens = self.lock().settings.hasher.config().block_size as u64;
        let tokens = request.prompt_tokens + request.output_tokens;
        tokens.div_ceil(block_tokens.max(1))
    }

    /// Lets the policy learn that `target` serves `request` (approximate
    /// mode remembers where prefixes went).
    pub fn learn(&self, request: &Request<'_>, target: &Target) {
        self.lock().learn(request, target);
    }

    /// Counts a request of `prompt_tokens` (`uncached_tokens` to prefill)
    /// against `target`'s load until the returned guard is dropped, without
    /// teaching the policy anything.
    pub fn hold(
        self: &Arc<Self>,
        target: &Target,
        prompt_tokens: u64,
        uncached_tokens: u64,
    ) -> InFlight {
        let ticket = self
            .lock()
            .load
            .start(target.slot, prompt_tokens, uncached_tokens);
        self.in_flight(ticket)
    }

    fn in_flight(self: &Arc<Self>, ticket: Ticket) -> InFlight {
        InFlight {
            pool: self.clone(),
            ticket: Some(ticket),
            trial: None,
        }
    }
}

impl Inner {
    /// The KV blocks `request` takes from `slot`'s free pool to be
    /// admitted ([`kvroute_core::load::demand_blocks`]).
    fn demand_blocks(&self, request: &Request<'_>, slot: Slot) -> u64 {
        let block_tokens = self.settings.hasher.config().block_size as u64;
        let pinned = self.load.pinned().leading(slot, request.chain);
        kvroute_core::load::demand_blocks(
            request.prompt_tokens,
            pinned,
            request.output_tokens,
            block_tokens,
        )
        .0
    }

    /// What the index says of `chain` for a plan of `leg` with `targets`
    /// among the endpoints `among` accepts: one more walk of the held
    /// prefix, and of the recently evicted blocks past it. Endpoints that
    /// do not take `leg` lost nothing to it.
    fn seen(
        &self,
        chain: &[u64],
        targets: &[Target],
        now: std::time::Instant,
        (among, leg): (&dyn Fn(&SocketAddr) -> bool, Leg),
    ) -> Seen {
        let mut by_slot = Vec::new();
        self.index.longest_prefix(chain, &mut by_slot);
        let held_by = |slot: Slot| by_slot.get(slot.index()).copied().unwrap_or(0);
        let slots = (self.members.values())
            .map(|m| m.slot.index() + 1)
            .max()
            .unwrap_or(0);
        let (mut target, mut foreign) = (vec![false; slots], vec![false; slots]);
        for t in targets {
            target[t.slot.index()] = true;
        }
        let mut outside = None;
        for m in self.members.values() {
            let i = m.slot.index();
            foreign[i] = matches!(m.contract, Contract::Mismatch(_));
            let held = held_by(m.slot);
            let other = !leg.takes(m.spec.role);
            if other || target[i] || held <= outside.map_or(0, |o: (u32, Lost)| o.0) {
                continue;
            }
            let lost = if self.outlier.is_ejected(&m.spec.name, now) {
                Lost::Ejection
            } else if !self.is_routable(m, now) {
                Lost::Health
            } else if !among(&m.spec.http) {
                Lost::Subset
            } else {
                Lost::Queue
            };
            outside = Some((held, lost));
        }
        let longest = by_slot.iter().copied().max().unwrap_or(0) as usize;
        let recent = chain
            .iter()
            .skip(longest)
            .position(|&b| !self.index.holds_any(b) && !self.index.recently_evicted(b));
        Seen {
            held: targets.iter().map(|t| held_by(t.slot)).collect(),
            foreign: targets.iter().map(|t| foreign[t.slot.index()]).collect(),
            outside,
            recent: recent.map_or(chain.len(), |r| longest + r) as u32,
        }
    }

    /// Lets the policy learn that `target` serves `request`.
    fn learn(&mut self, request: &Request<'_>, target: &Target) {
        let endpoint = Endpoint {
            slot: target.slot,
            id: target.id,
            load: self.load.load(target.slot),
            // Learning reads no weight: it only ranks.
            weight: 1.0,
        };
        self.policy.routed(request, &endpoint);
    }

    /// The routable endpoints `among` accepts that take `leg`, as the
    /// policy sees them and as targets.
    fn candidates(
        &self,
        now: std::time::Instant,
        among: &dyn Fn(&SocketAddr) -> bool,
        leg: Leg,
    ) -> (Vec<Endpoint>, Vec<Target>) {
        let now_ms = super::wall_ms();
        self.members
            .values()
            .filter(|m| leg.takes(m.spec.role) && self.is_routable(m, now) && among(&m.spec.http))
            .map(|m| {
                let endpoint = Endpoint {
                    slot: m.slot,
                    id: m.id,
                    load: self.load.load(m.slot),
                    weight: self.weight(m, now_ms),
                };
                let target = Target {
                    name: m.name.clone(),
                    http: m.spec.http,
                    slot: m.slot,
                    id: m.id,
                    admit_within_ms: None,
                    predicted: None,
                };
                (endpoint, target)
            })
            .unzip()
    }
}

/// A request counted against its endpoint's load. Dropping it ends the
/// count, so no path (an error, a client that goes away mid-request, a
/// reset stream, a timeout) can leak load.
#[derive(Debug)]
pub struct InFlight {
    pool: Arc<Pool>,
    ticket: Option<Ticket>,
    /// The half-open endpoint whose trial this request is: released
    /// unjudged if it ends without a success or failure reported.
    trial: Option<Arc<str>>,
}

impl InFlight {
    /// The request's first response byte arrived: its prefill is done.
    pub fn first_token(&mut self) {
        if let Some(t) = self.ticket.as_mut() {
            self.pool.lock().load.first_token(t);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            let mut inner = self.pool.lock();
            inner.load.finish(t);
            if let Some(name) = self.trial.take() {
                inner.outlier.abandon(&name);
            }
            drop(inner);
            self.pool.changed.notify_waiters();
        }
    }
}
