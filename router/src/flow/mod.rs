//! Flow control: a request waits at the router, not in an engine's queue,
//! until an endpoint can start it, and the endpoint is chosen when it is
//! sent (late binding), by the same ranking as any request, with the
//! state of that moment.
//!
//! 1. **Hold.** A request is sent at once when the policy's first choice
//!    for it would start its prefill within `flowControl.holdAboveMs`
//!    (the wait the policy predicts there: queued prefill, KV memory) and
//!    is under `limits.endpointConcurrency`. Otherwise it waits here. So
//!    does any request arriving while requests of its priority or higher
//!    wait: it does not overtake them. A request under way (its decode
//!    leg after its prefill, or one an engine refused) is not new: it
//!    waits only while no endpoint can start it.
//! 2. **Dispatch.** When an endpoint's load changes (a request starts or
//!    ends, its engine reports or refuses) and on a timer (predictions
//!    age), the held requests get turns in the queue's order
//!    ([`queue`]): each ranks the endpoints afresh, leaving out those a
//!    request ahead of it waits for, and is sent when the first it ranks
//!    can start it now. A warm endpoint is still preferred while the
//!    policy's slack rule says waiting for it costs less than the prefill
//!    it saves: the wait is in its predictions. **Patience:** predictions
//!    of a wait can be too short again and again, so once a request has
//!    been held for as long as its first choice saves it over the next
//!    one (times `latencySlack`), it goes to that next one if it can
//!    start it now ([`Gate::spill`], counted `spilled`); a cold key, which
//!    saves nothing anywhere, goes to the first endpoint in its rendezvous
//!    order that can start it.
//! 3. **Room for higher priorities and light flows** ([`reserve`],
//!    [`shares`]): a lower priority, or a flow far over its fair share, is
//!    sent only where it leaves room for the largest recent request
//!    (while a higher priority, or a flow under its share, is active). Nor
//!    does it keep the endpoint it waits for from the requests behind it
//!    in the pass (rule 2 of [`queue`]): a noisy tenant's large request
//!    waiting for memory does not hold back a quiet tenant's that fits.
//! 4. **Bounds.** Past `maxQueued` or `maxQueuedBytes`, the lowest band
//!    sheds first, then, within a band, the largest flow when the
//!    newcomer's holds fewer; past its wait limit a request is answered; a request
//!    of negative priority is never held. All get 429 with `Retry-After`
//!    and the reason as the error's code. A client that goes away while
//!    held leaves nothing behind: dropping its wait takes it out.
//!
//! Without a prediction (policies other than `kvroute` and `min-ttft`, an
//! unread prompt, or an engine whose load report is missing or older than
//! `routing.policy.engine.maxReportAgeMs`) an endpoint can start a request
//! when it is under `limits.endpointConcurrency`.
//!
//! Each router replica holds its own queue; priorities and fairness hold
//! per replica.

pub mod metrics;
pub mod objectives;
pub mod queue;
pub mod reserve;
pub mod shares;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvroute_core::policy::{Predicted, Request};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use self::metrics::{Priority, PriorityReason, Reason};
use self::queue::{Bounds, Id, Queue, ShedReason, Turn};
use crate::config::Config;
use crate::errors::ApiError;
use crate::metrics::Metrics;
use crate::pool::{Leg, Plan, Pool};
use crate::request::Among;

/// The longest a held request waits for a change before its turn comes
/// again anyway: predictions age, and an engine may report nothing new.
const RECHECK: Duration = Duration::from_millis(25);

/// The header a trusted gateway names a request's flow with (the Gateway
/// API Inference Extension's); honoured only from the picker with
/// `extProc.trustedNetwork` or `extProc.tls.clientCaFile`.
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";

/// Who a request is, for the queue.
#[derive(Debug)]
pub(crate) struct Who {
    /// The objective it names.
    pub(crate) objective: Option<String>,
    /// Its tenant.
    pub(crate) tenant: Option<String>,
    /// Its flow: the trusted gateway's fairness id, else its tenant;
    /// requests with neither share a flow.
    pub(crate) flow: Option<String>,
    /// Its body's size.
    pub(crate) bytes: usize,
}

/// The gate requests pass. See the module docs.
#[derive(Debug)]
pub(crate) struct Gate {
    /// What each objective's priority is.
    objectives: objectives::Objectives,
    enabled: bool,
    hold_s: f64,
    /// The `kvroute` policy's `latencySlack`, for patience ([`Gate::spill`]).
    latency_slack: Option<f64>,
    retry_after: u64,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
    /// Set when the router begins to shut down: nothing is held any more.
    closed: AtomicBool,
    /// Signalled when a request is held: the passes' timer starts.
    held: Notify,
}

#[derive(Debug)]
struct State {
    queue: Queue,
    reserve: reserve::Reserve,
    shares: shares::Shares,
    turns: HashMap<Id, Arc<Waiter>>,
}

#[derive(Debug, Default)]
struct Waiter {
    turn: Notify,
    shed: Mutex<Option<ShedReason>>,
}

/// A held request's place: dropping it takes the request out.
struct Place<'a> {
    gate: &'a Gate,
    id: Id,
    priority: i32,
    waiter: Arc<Waiter>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut state = self.gate.lock();
        state.turns.remove(&self.id);
        let next = state.queue.leave(self.id);
        state.hand(next);
        let priority = self.priority;
        self.gate
            .metrics
            .flow
            .queued
            .get_or_create(&Priority { priority })
            .dec();
    }
}

impl State {
    /// Wakes the request whose turn it is.
    fn hand(&self, turn: Option<Id>) {
        if let Some(w) = turn.and_then(|id| self.turns.get(&id)) {
            w.turn.notify_one();
        }
    }
}

impl Gate {
    /// The gate `config` asks for: `flowControl.holdAboveMs`, else the
    /// policy's `admissionToleranceMs`, else 50 ms.
    pub(crate) fn new(config: &Config, metrics: Arc<Metrics>) -> Self {
        let flow = &config.flow_control;
        let hold_ms = (flow.hold_above_ms)
            .or(config.routing.policy.admission_tolerance_ms())
            .unwrap_or(50.0);
        Gate {
            objectives: objectives::Objectives::new(&config.objectives),
            metrics,
            closed: AtomicBool::new(false),
            held: Notify::new(),
            enabled: flow.enabled,
            hold_s: hold_ms / 1000.0,
            latency_slack: config.routing.policy.latency_slack(),
            retry_after: config.limits.retry_after_s,
            state: Mutex::new(State {
                queue: Queue::new(Bounds {
                    max_queued: flow.max_queued,
                    max_queued_bytes: flow.max_queued_bytes,
                    max_wait: Duration::from_millis(flow.max_wait_ms),
                    band_wait: flow.band_waits(),
                }),
                turns: HashMap::new(),
                reserve: reserve::Reserve::new(
                    Duration::from_millis(flow.reserve_window_ms),
                    std::time::Instant::now(),
                ),
                shares: shares::Shares::new(Duration::from_millis(flow.reserve_window_ms)),
            }),
        }
    }

    /// The longest wait before its prefill a request is sent with at once
    /// (`flowControl.holdAboveMs`), seconds.
    pub(crate) fn hold_s(&self) -> f64 {
        self.hold_s
    }

    /// Whether requests are held here (`flowControl.enabled`).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Something changed that may let a held request start.
    pub(crate) fn kick(&self) {
        let mut state = self.lock();
        let turn = state.queue.kick();
        state.hand(turn);
    }

    /// Runs until the process ends: a pass at each change of the pool's
    /// load, and at least every [`RECHECK`] while requests are held. When
    /// `stop` turns true (the router shuts down), every held request is
    /// answered 503 with `Retry-After` at once, and so is every later one
    /// that would be held: the drain never waits on, or drops, a held
    /// request.
    pub(crate) async fn run(self: Arc<Self>, pool: Arc<Pool>, mut stop: watch::Receiver<bool>) {
        let closing = async {
            let _ = stop.wait_for(|s| *s).await;
            self.closed.store(true, Ordering::Relaxed);
            for w in self.lock().turns.values() {
                w.turn.notify_one();
            }
            std::future::pending::<()>().await;
        };
        let passes = async {
            loop {
                let changed = pool.changed();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let held = !self.lock().queue.is_empty();
                if held {
                    let _ = tokio::time::timeout(RECHECK, changed).await;
                } else {
                    // A request held after the check leaves a permit here.
                    tokio::select! {
                        () = changed => {}
                        () = self.held.notified() => {}
                    }
                }
                self.kick();
            }
        };
        tokio::join!(closing, passes);
    }

    /// 503 for a request held, or about to be, while the router shuts
    /// down; counted as shed for `shutdown`.
    fn closing(&self, priority: i32) -> ApiError {
        let labels = PriorityReason {
            priority,
            reason: "shutdown",
        };
        self.metrics.flow.shed.get_or_create(&labels).inc();
        ApiError::ShuttingDown {
            retry_after: self.retry_after,
        }
    }

    /// Counts `plan` of `flow` as dispatched for `reason`, leaving `room`;
    /// in the flow's share only the first time (`again` false).
    fn dispatched(
        &self,
        plan: Plan,
        (flow, room): (&str, Option<u64>),
        reason: &'static str,
        again: bool,
    ) -> Plan {
        let now = std::time::Instant::now();
        if !again {
            self.lock().shares.dispatched(flow, now);
        }
        let labels = Reason { reason };
        self.metrics.flow.dispatched.get_or_create(&labels).inc();
        Plan { room, ..plan }
    }

    /// Whether `plan`'s first target can start `leg` of `request` now,
    /// leaving `room` blocks (and a seat) there for a higher priority or a
    /// lighter flow.
    fn start(
        &self,
        pool: &Pool,
        (request, leg): (&Request<'_>, Leg),
        plan: &Plan,
        room: Option<u64>,
    ) -> Start {
        let Some(t) = plan.targets.first() else {
            return Start::Busy;
        };
        if !t.predicted.is_none_or(|p| p.queued <= self.hold_s) {
            return Start::Busy;
        }
        if room.is_none_or(|blocks| pool.leaves_room((request, leg), plan, blocks, self.hold_s)) {
            Start::Now
        } else {
            Start::Room
        }
    }

    /// Patience (rule 2): a plan for a held request whose first choice
    /// cannot start it, without that endpoint: the policy's next choice,
    /// when it can start the request now and the prefill the first choice
    /// would save over it is at most what the request has waited
    /// (`held_s`, times the policy's `latencySlack`). Then the next
    /// without that one too, and so on. `None` while the wait is worth
    /// it, or without predictions (policies other than `kvroute`).
    fn spill(
        &self,
        (pool, request, readable, leg): (&Pool, &Request<'_>, bool, Leg),
        among: Among<'_>,
        plan: &Plan,
        except: &[SocketAddr],
        (held_s, room): (f64, Option<u64>),
    ) -> Option<Plan> {
        let slack = self.latency_slack?;
        let first = plan.targets.first()?;
        let prefill = |p: Predicted| p.ttft - p.queued;
        let first_prefill = prefill(first.predicted?);
        let mut except = [except, &[first.http]].concat();
        loop {
            let other = pool.plan_except(request, readable, among, &except, leg);
            let next = other.targets.first()?;
            // Checked apart: an infinite slack times no saving is NaN.
            let saved = prefill(next.predicted?) - first_prefill;
            if saved > 0.0 && slack * saved > held_s {
                return None;
            }
            if self.start(pool, (request, leg), &other, room) == Start::Now {
                return Some(other);
            }
            except.push(next.http);
        }
    }

    /// The room a request of `priority` from `flow` leaves now for higher
    /// priorities and for flows under their share.
    fn room(&self, priority: i32, flow: &str) -> Option<u64> {
        let now = std::time::Instant::now();
        let state = self.lock();
        let (band, share) = (
            state.reserve.for_priority(priority, now),
            state.shares.for_flow(flow, now, state.reserve.any(now)),
        );
        band.max(share)
    }

    fn shed(&self, priority: i32, reason: ShedReason) -> ApiError {
        let labels = PriorityReason {
            priority,
            reason: reason.as_str(),
        };
        self.metrics.flow.shed.get_or_create(&labels).inc();
        ApiError::Shed {
            reason,
            retry_after: self.retry_after,
        }
    }

    /// A plan for `leg` of `request` from `who` among `among` whose
    /// first target can start it now, waiting here until there is one
    /// (rules 1 to 4); 503 when no endpoint is routable, 429 when shed.
    /// `again`: the request was planned before (an engine refused it,
    /// [`kvroute_core::admission`], or this is its prefill leg after its
    /// decode leg, or its decode leg after its prefill); it is not counted
    /// as arriving again, and its decode leg is not held behind others
    /// (rule 1).
    pub(crate) async fn plan(
        &self,
        pool: &Pool,
        (request, readable, leg): (&Request<'_>, bool, Leg),
        among: Among<'_>,
        who: &Who,
        again: bool,
    ) -> Result<(Plan, Option<Held>), ApiError> {
        let (objective, tenant) = (who.objective.as_deref(), who.tenant.as_deref());
        let priority = (self.objectives).priority(objective, tenant, &pool.objectives());
        let (flow, bytes) = (who.flow.as_deref().unwrap_or(""), who.bytes);
        let retry_after = self.retry_after;
        let unavailable = || ApiError::Unavailable { retry_after };
        let ahead = self.enabled && {
            let mut state = self.lock();
            let now = std::time::Instant::now();
            if !again {
                let blocks = pool.blocks_of(request);
                state.reserve.saw(priority, blocks, now);
                state.shares.saw(flow, now);
            }
            !(again && leg == Leg::Decode) && state.queue.ahead(priority)
        };
        let because = if ahead {
            "requests_ahead"
        } else {
            let plan = pool.plan_except(request, readable, among, &[], leg);
            if plan.targets.is_empty() && plan.full == 0 {
                return Err(unavailable());
            }
            if !self.enabled {
                if plan.targets.is_empty() {
                    return Err(ApiError::Overloaded { retry_after });
                }
                return Ok((
                    self.dispatched(plan, (flow, None), "immediate", again),
                    None,
                ));
            }
            let room = self.room(priority, flow);
            match self.start(pool, (request, leg), &plan, room) {
                Start::Now => {
                    let plan = self.dispatched(plan, (flow, room), "immediate", again);
                    return Ok((plan, None));
                }
                Start::Room => "room_reserved",
                Start::Busy if plan.targets.is_empty() => "endpoints_full",
                Start::Busy => "predicted_wait",
            }
        };
        if self.closed.load(Ordering::Relaxed) {
            return Err(self.closing(priority));
        }
        let place = {
            let mut state = self.lock();
            let now = std::time::Instant::now();
            let pushed = (state.queue)
                .push(priority, flow, bytes, now)
                .map_err(|r| self.shed(priority, r))?;
            for id in &pushed.shed {
                if let Some(w) = state.turns.remove(id) {
                    *w.shed.lock().unwrap_or_else(|e| e.into_inner()) = Some(ShedReason::QueueFull);
                    w.turn.notify_one();
                }
            }
            let waiter = Arc::new(Waiter::default());
            state.turns.insert(pushed.id, waiter.clone());
            let turn = pushed.turn.or_else(|| state.queue.kick());
            state.hand(turn);
            self.held.notify_one();
            let deadline = Instant::now() + (pushed.deadline - now);
            self.metrics
                .flow
                .queued
                .get_or_create(&Priority { priority })
                .inc();
            (
                Place {
                    gate: self,
                    id: pushed.id,
                    priority,
                    waiter,
                },
                deadline,
            )
        };
        let held_at = Instant::now();
        let (place, deadline) = place;
        loop {
            let woke = tokio::time::timeout_at(deadline, place.waiter.turn.notified()).await;
            if woke.is_err() {
                return Err(self.shed(priority, ShedReason::WaitLimit));
            }
            if self.closed.load(Ordering::Relaxed) {
                return Err(self.closing(priority));
            }
            if let Some(r) = *place.waiter.shed.lock().unwrap_or_else(|e| e.into_inner()) {
                return Err(self.shed(priority, r));
            }
            let reserved = {
                let state = self.lock();
                if !state.queue.has_turn(place.id) {
                    continue;
                }
                state.queue.reserved().to_vec()
            };
            let plan = pool.plan_except(request, readable, among, &reserved, leg);
            let room = self.room(priority, flow);
            let mut start = self.start(pool, (request, leg), &plan, room);
            let held_s = held_at.elapsed().as_secs_f64();
            let spilled = (start == Start::Busy)
                .then(|| {
                    self.spill(
                        (pool, request, readable, leg),
                        among,
                        &plan,
                        &reserved,
                        (held_s, room),
                    )
                })
                .flatten();
            if spilled.is_some() {
                start = Start::Now;
            }
            let mut state = self.lock();
            if plan.targets.is_empty() && plan.full == 0 && reserved.is_empty() {
                let next = state.queue.turn_done(place.id, Turn::Held(None));
                state.hand(next);
                return Err(unavailable());
            }
            let first = plan.targets.first().map(|t| t.http);
            if start == Start::Now {
                let (sent, reason) = match spilled {
                    Some(other) => (other, "spilled"),
                    None => (plan, "after_wait"),
                };
                let addr = sent.targets[0].http;
                let next = state.queue.turn_done(place.id, Turn::Dispatched(addr));
                state.turns.remove(&place.id);
                state.hand(next);
                drop(state);
                let seconds = held_at.elapsed().as_secs_f64();
                (self.metrics.flow.wait_seconds)
                    .get_or_create(&Priority { priority })
                    .observe(seconds);
                let held = Held { seconds, because };
                let sent = self.dispatched(sent, (flow, room), reason, again);
                return Ok((sent, Some(held)));
            }
            // Held to leave room for others, or one that must leave room
            // (a flow over its share): the endpoint is theirs to take.
            // Held because every endpoint is full: the best of those is its
            // own, should it free during the pass.
            let claims = start == Start::Busy && room.is_none();
            let waits_for = (first.or(plan.first_full)).filter(|_| claims);
            let next = state.queue.turn_done(place.id, Turn::Held(waits_for));
            state.hand(next);
        }
    }
}

/// How long a request was held, and why it was held when it arrived.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Held {
    pub seconds: f64,
    /// `requests_ahead` (requests of its priority or higher were held),
    /// `endpoints_full` (every endpoint at `endpointConcurrency`),
    /// `predicted_wait` (its first choice would make it wait longer than
    /// `holdAboveMs`) or `room_reserved` (starting it would take the room
    /// kept for a higher priority or a lighter tenant).
    pub because: &'static str,
}

/// Whether a request can start at its first target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    /// Now.
    Now,
    /// Not within `holdAboveMs`, or no target under its limit.
    Busy,
    /// Only by taking the room kept for a higher priority or a lighter
    /// flow.
    Room,
}
