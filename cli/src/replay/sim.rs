//! The replay model: N replicas, each an LRU block cache and a FIFO prefill
//! server, fed a trace in virtual time and routed by a `kvroute-core`
//! policy, the same code the router runs.
//!
//! The rules (the model, so figures compare with other tools):
//! - Each replica caches `capacity` blocks, LRU.
//! - Routing a request to replica r: `m` is the longest leading run of its
//!   ids in r's cache, looked up before inserting; cached tokens are
//!   `min(m × block_tokens, input_length)`. Then its ids are touched from the
//!   last to the first (inserted if absent) and least recently used blocks
//!   are evicted down to the capacity.
//! - One FIFO prefill server per replica, free at F: `start = max(arrival,
//!   F)`, `prefill_end = start + 0.020 + uncached / 10000`, `F = prefill_end`,
//!   `TTFT = prefill_end − arrival`, completion `= prefill_end + 0.030 ×
//!   output_length`. A request is in flight from arrival to completion; one
//!   completing at t no longer counts at t.
//! - Requests are spread over R router replicas, round robin. Each router
//!   knows its own requests exactly (in flight, still in prefill, decoding,
//!   sent since the last engine report), and, like every router with
//!   WatchCache streams, the replicas' cache contents and load reports as
//!   of `report_lag` ago: cache events reach the shared occupancy index
//!   that late, and each replica's report (queued prefill tokens, waiting
//!   and running requests, prefill rate) describes it at `t − lag`.
//! - Admission checks ([`kvroute_core::admission`]): when the policy
//!   bounds the wait at its choice and the replica's prefill server would
//!   make the request wait longer, the replica refuses it; the router takes
//!   the replica's queue at `t` as a fresh report of it and ranks again.
//!   Each refusal delays the request by [`REFUSAL_S`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvroute_core::admission::{self, MAX_REFUSALS};
use kvroute_core::index::{CacheEvent, OccupancyIndex};
use kvroute_core::keys::RoutingKey;
use kvroute_core::load::{EngineLoad, Load};
use kvroute_core::lru::Lru;
use kvroute_core::pinned::Pinned;
use kvroute_core::policy::{Context, Decision, Endpoint, Policy, Reason, Request};
use kvroute_core::rendezvous::endpoint_id;
use kvroute_core::slot::Slot;

use super::trace::TraceRequest;

/// Fixed prefill cost per request, seconds.
pub const PREFILL_OVERHEAD_S: f64 = 0.020;
/// Prefill throughput, tokens per second.
pub const PREFILL_TOKENS_PER_S: f64 = 10_000.0;
/// Decode time per output token, seconds.
pub const DECODE_S_PER_TOKEN: f64 = 0.030;
/// What an engine's refusal costs a request: a round trip to the engine
/// and a new decision, seconds.
pub const REFUSAL_S: f64 = 0.002;

/// The length of the leading run of `ids` present in `cache`.
pub fn leading_hits(cache: &Lru, ids: &[u64]) -> usize {
    ids.iter().take_while(|&&id| cache.contains(id)).count()
}

/// Touches `ids` from the last to the first, then evicts down to
/// `capacity`. Calls `inserted`/`evicted` for each change.
pub fn admit(
    cache: &mut Lru,
    ids: &[u64],
    capacity: usize,
    mut inserted: impl FnMut(u64),
    mut evicted: impl FnMut(u64),
) {
    for &id in ids.iter().rev() {
        if !cache.touch(id) {
            inserted(id);
        }
    }
    while cache.len() > capacity {
        match cache.pop_lru() {
            Some(id) => evicted(id),
            None => break,
        }
    }
}

/// A request served by a replica, with its times (virtual seconds).
#[derive(Clone, Copy, Debug)]
struct Served {
    arrival: f64,
    start: f64,
    prefill_end: f64,
    completion: f64,
    uncached: u64,
    prompt: u64,
}

/// One replica: its cache, its prefill server, and the requests it serves
/// that a report as of `t − lag` may still see.
#[derive(Clone, Debug)]
struct Replica {
    cache: Lru,
    /// When the prefill server is next free.
    free_at: f64,
    /// In arrival order; dropped once complete before `t − lag`.
    served: VecDeque<Served>,
}

impl Replica {
    fn new() -> Self {
        Replica {
            cache: Lru::new(),
            free_at: 0.0,
            served: VecDeque::new(),
        }
    }

    /// The replica's own load report, describing it at `at`: requests not
    /// started are waiting, with their uncached tokens queued; a prefill in
    /// progress counts its time left.
    /// Requests complete before `at` are dropped: reports only move
    /// forward ([`Self::queue_at`] looks without dropping).
    fn report(&mut self, at: f64, reported_at: Instant) -> EngineLoad {
        while self.served.front().is_some_and(|s| s.completion <= at) {
            self.served.pop_front();
        }
        self.queue_at(at, reported_at)
    }

    /// [`Self::report`] at `at`, changing nothing.
    fn queue_at(&self, at: f64, reported_at: Instant) -> EngineLoad {
        let (mut queued, mut waiting, mut running) = (0.0, 0u32, 0u32);
        for s in self.served.iter().take_while(|s| s.arrival <= at) {
            if s.start > at {
                waiting += 1;
                queued += s.uncached as f64;
            } else if s.completion > at {
                running += 1;
                if s.prefill_end > at {
                    // The time left, overhead included, in tokens at the
                    // rate: queued / rate + overhead × waiting is then
                    // exactly how long until the server is free.
                    queued += (s.prefill_end - at) * PREFILL_TOKENS_PER_S;
                }
            }
        }
        EngineLoad {
            waiting,
            running,
            kv_usage: 0.0,
            queued_prefill_tokens: Some(queued.round() as u64),
            prefill_tokens_per_s: Some(PREFILL_TOKENS_PER_S),
            memory: None,
            reported_at,
        }
    }
}

/// A router replica: its policy and, per replica, its own requests in
/// flight (`T`: however the engine model tracks them).
#[derive(Debug)]
pub(super) struct Router<T> {
    pub(super) policy: Box<dyn Policy>,
    pub(super) own: Vec<T>,
    /// The prompt blocks of its requests in flight, per replica.
    pub(super) pinned: Pinned,
}

impl<T: Clone> Clone for Router<T> {
    fn clone(&self) -> Self {
        Router {
            policy: self.policy.boxed_clone(),
            own: self.own.clone(),
            pinned: self.pinned.clone(),
        }
    }
}

// The simple model's routers keep, per replica, their requests not yet
// complete (sent at their arrival).
impl Router<VecDeque<Served>> {
    /// What this router counts at replica `r` at `t`, with requests sent
    /// after `reported` not in the engine's report.
    fn load(&mut self, r: usize, t: f64, reported: f64) -> Load {
        let own = &mut self.own[r];
        own.retain(|s| s.completion > t);
        let mut load = Load::default();
        for s in own.iter() {
            load.in_flight += 1;
            load.active_tokens += s.prompt;
            if s.prefill_end > t {
                load.prefill_tokens += s.uncached;
                if s.arrival > reported {
                    load.unreported_prefill_tokens += s.uncached;
                    load.unreported_requests += 1;
                }
            } else {
                load.decoding += 1;
            }
        }
        load
    }
}

/// `policy`'s decision for `request` with admission checks (see the
/// module docs): `engine(r, bound_ms)` is replica `r`'s answer to a
/// request that asks to start within `bound_ms`: the load it refuses
/// with, or `None`.
/// Returns the decision, the replica it went to and how many times it was
/// refused.
pub(super) fn decide(
    policy: &mut dyn Policy,
    request: &Request<'_>,
    endpoints: &mut [Endpoint],
    cx: &Context<'_>,
    mut engine: impl FnMut(usize, u64) -> Option<EngineLoad>,
) -> (Decision, usize, usize) {
    let mut refused = Vec::new();
    loop {
        let decision = policy.rank(request, endpoints, cx);
        let r = decision.ranked[0];
        let bound = policy
            .admit_within(r)
            .filter(|_| !refused.contains(&r) && refused.len() < MAX_REFUSALS);
        let Some(bound) = bound else {
            return (decision, r, refused.len());
        };
        let Some(refusal) = engine(r, admission::bound_ms(bound)) else {
            return (decision, r, refused.len());
        };
        endpoints[r].load.refused(refusal, cx.now);
        refused.push(r);
    }
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    /// The replica it went to.
    pub replica: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: u64,
    /// Prompt tokens prefilled.
    pub uncached_tokens: u64,
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// The policy's reason.
    pub reason: Reason,
}

/// Cache events of one routing, waiting to reach the routers.
#[derive(Clone, Debug)]
struct Pending {
    at: f64,
    slot: Slot,
    stored: Vec<u64>,
    removed: Vec<u64>,
}

/// A pool of replicas routed by R router replicas under one policy.
#[derive(Clone, Debug)]
pub struct Sim {
    replicas: Vec<Replica>,
    ids: Vec<u64>,
    /// The routers' view of the caches, `lag` behind.
    index: OccupancyIndex,
    pending: VecDeque<Pending>,
    routers: Vec<Router<VecDeque<Served>>>,
    next_router: usize,
    lag_s: f64,
    capacity: usize,
    block_tokens: u64,
    /// Virtual time 0 as an `Instant`, for report ages.
    epoch: Instant,
    endpoints: Vec<Endpoint>,
}

impl Sim {
    /// `replicas` empty replicas of `capacity` blocks each, routed by
    /// `routers` routers running `policy` (each its own copy), which see
    /// cache contents and load reports `lag_s` seconds late.
    pub fn new(
        policy: Box<dyn Policy>,
        routers: usize,
        lag_s: f64,
        replicas: usize,
        capacity: usize,
        block_tokens: u64,
    ) -> Self {
        let mut sim = Sim {
            replicas: Vec::new(),
            ids: Vec::new(),
            index: OccupancyIndex::new(),
            pending: VecDeque::new(),
            routers: (0..routers.max(1))
                .map(|_| Router {
                    policy: policy.boxed_clone(),
                    own: Vec::new(),
                    // The simple model has no KV memory to wait for.
                    pinned: Pinned::new(0),
                })
                .collect(),
            next_router: 0,
            lag_s,
            capacity,
            block_tokens,
            epoch: Instant::now(),
            endpoints: Vec::new(),
        };
        for _ in 0..replicas {
            sim.add_replica();
        }
        sim
    }

    /// Adds an empty replica (a scale-out).
    pub fn add_replica(&mut self) {
        let i = self.replicas.len();
        self.replicas.push(Replica::new());
        self.ids.push(endpoint_id(&format!("replica-{i}")));
        for router in &mut self.routers {
            router.own.push(VecDeque::new());
        }
        // Admission overshoots the capacity by up to one request's blocks
        // before evicting; the index only mirrors the caches.
        let empty = CacheEvent::Snapshot {
            capacity: usize::MAX,
            blocks: &[],
        };
        self.index
            .apply(Slot(i as u32), empty)
            .expect("an empty snapshot fits");
    }

    fn instant(&self, t: f64) -> Instant {
        self.epoch + Duration::from_secs_f64(t.max(0.0))
    }

    /// Applies the cache events of routings at or before `seen` to the
    /// routers' index.
    fn deliver(&mut self, seen: f64) {
        while let Some(p) = self.pending.front().filter(|p| p.at <= seen) {
            let (slot, stored, removed) = (p.slot, p.stored.clone(), p.removed.clone());
            self.pending.pop_front();
            for event in [CacheEvent::Stored(&stored), CacheEvent::Removed(&removed)] {
                self.index
                    .apply(slot, event)
                    .expect("the index mirrors the cache");
            }
        }
    }

    /// Routes and serves `request` with routing key `key` (made from its
    /// first `key_prefix_blocks` block ids, if it was).
    pub fn step(
        &mut self,
        request: &TraceRequest,
        (key, key_prefix_blocks): (RoutingKey, Option<u32>),
    ) -> Outcome {
        let t = request.arrival_s;
        let seen = t - self.lag_s;
        self.deliver(seen);
        let k = self.next_router;
        self.next_router = (k + 1) % self.routers.len();
        let reported_at = self.instant(seen);
        self.endpoints.clear();
        for i in 0..self.replicas.len() {
            let mut load = self.routers[k].load(i, t, seen);
            load.engine = Some(self.replicas[i].report(seen, reported_at));
            self.endpoints.push(Endpoint {
                slot: Slot(i as u32),
                id: self.ids[i],
                load,
                weight: 1.0,
            });
        }
        let req = Request {
            key,
            chain: &request.hash_ids,
            prompt_tokens: request.input_length,
            key_prefix_blocks,
            output_tokens: request.output_length,
        };
        let cx = Context {
            index: Some(&self.index),
            block_tokens: self.block_tokens,
            now: self.instant(t),
            pinned: None,
        };
        let router = &mut self.routers[k];
        let replicas = &mut self.replicas;
        let (decision, r, refused) = decide(
            &mut *router.policy,
            &req,
            &mut self.endpoints,
            &cx,
            |r, bound_ms| {
                let wait = (replicas[r].free_at - t).max(0.0);
                admission::refuses(bound_ms, wait).then(|| replicas[r].queue_at(t, cx.now))
            },
        );
        router.policy.routed(&req, &self.endpoints[r]);

        let replica = &mut self.replicas[r];
        let m = leading_hits(&replica.cache, &request.hash_ids) as u64;
        let cached_tokens = (m * self.block_tokens).min(request.input_length);
        let uncached_tokens = request.input_length - cached_tokens;
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        admit(
            &mut replica.cache,
            &request.hash_ids,
            self.capacity,
            |id| stored.push(id),
            |id| removed.push(id),
        );
        self.pending.push_back(Pending {
            at: t,
            slot: Slot(r as u32),
            stored,
            removed,
        });

        let start = (t + REFUSAL_S * refused as f64).max(replica.free_at);
        let prefill_end =
            start + PREFILL_OVERHEAD_S + uncached_tokens as f64 / PREFILL_TOKENS_PER_S;
        replica.free_at = prefill_end;
        let served = Served {
            arrival: t,
            start,
            prefill_end,
            completion: prefill_end + DECODE_S_PER_TOKEN * request.output_length as f64,
            uncached: uncached_tokens,
            prompt: request.input_length,
        };
        replica.served.push_back(served);
        router.own[r].push_back(served);
        Outcome {
            replica: r,
            cached_tokens,
            uncached_tokens,
            ttft_s: prefill_end - t,
            reason: decision.reason,
        }
    }
}

#[cfg(test)]
mod tests;
