//! The replay's second engine model, `--engine vllm`: N replicas each
//! running [`kvroute_core::engine`] (vLLM v1's scheduler, the model
//! `kvroute-engine-sim` runs in real time) in virtual time, routed by a
//! `kvroute-core` policy, the same code the router runs.
//!
//! - Each trace block id stands for `block_tokens` tokens; the engines
//!   cache blocks of `block_size` tokens, hashed in a chain from the trace
//!   ids their tokens come from ([`engine_hashes`]), so two prompts share
//!   engine blocks exactly when they share tokens, as the live replay's
//!   token mapping makes them.
//! - Routers see what the live routers see: the engines' cache events and
//!   load reports `lag` late (a report describes the engine at
//!   `arrival − lag`), and their own requests exactly.
//! - A request's time to first token is known only when the engine gets
//!   there, so outcomes are collected at the end ([`VllmSim::finish`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::admission;
use kvroute_core::engine::pool::PoolEvent;
use kvroute_core::engine::{self as model, Progress};
use kvroute_core::index::{CacheEvent, OccupancyIndex};
use kvroute_core::keys::RoutingKey;
use kvroute_core::load::{Load, PINNED_BLOCKS, demand_blocks};
use kvroute_core::pinned::{Pin, Pinned};
use kvroute_core::policy::{Context, Endpoint, Policy, Reason, Request};
use kvroute_core::rendezvous::endpoint_id;
use kvroute_core::slot::Slot;
use xxhash_rust::xxh3::xxh3_64;

use super::sim::{Outcome, REFUSAL_S, Router, decide};
use super::trace::TraceRequest;

/// The engine-block hash chain of `request`'s prompt: one hash per full
/// block of `block_size` tokens, each over its parent and the trace ids
/// (and positions) its tokens come from. Past the trace's ids, tokens are
/// the request's own (`own`), shared with no one.
pub fn engine_hashes(
    request: &TraceRequest,
    block_tokens: u64,
    block_size: usize,
    own: u64,
) -> Vec<u64> {
    let bs = block_size as u64;
    let id_of = |token: u64| {
        let j = (token / block_tokens) as usize;
        request
            .hash_ids
            .get(j)
            .map_or((own, u64::MAX), |&id| (id, 0))
    };
    let mut parent = 0u64;
    (0..request.input_length / bs)
        .map(|i| {
            let (first, last) = (id_of(i * bs), id_of((i + 1) * bs - 1));
            let mut bytes = [0u8; 48];
            for (k, v) in [parent, first.0, first.1, last.0, last.1, i]
                .into_iter()
                .enumerate()
            {
                bytes[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
            }
            parent = xxh3_64(&bytes);
            parent
        })
        .collect()
}

/// One request's life, as far as it is known.
#[derive(Clone, Copy, Debug, Default)]
struct Record {
    replica: usize,
    arrival: f64,
    reason: Option<Reason>,
    cached_tokens: Option<u64>,
    first_token: Option<f64>,
    done: Option<f64>,
    refused: bool,
    prompt: u64,
    /// The router's estimate of its uncached tokens.
    uncached_estimate: u64,
    /// The router's estimate of the KV blocks it takes.
    blocks: u64,
}

/// N replicas of the vLLM model, routed by R routers under one policy.
#[derive(Clone, Debug)]
pub struct VllmSim {
    engines: Vec<model::Engine>,
    ids: Vec<u64>,
    config: model::Config,
    /// Per request (trace order), its engine-block hashes.
    hashes: Arc<Vec<Vec<u64>>>,
    records: Vec<Record>,
    /// Virtual time processed up to.
    now: f64,
    index: OccupancyIndex,
    /// Cache events not yet seen by the routers: (time, replica, event).
    pending: VecDeque<(f64, usize, PoolEvent)>,
    /// Each router's own requests per replica, by trace position, with
    /// their prompt blocks pinned until they finish.
    routers: Vec<Router<Vec<Own>>>,
    next_router: usize,
    lag_s: f64,
    /// Arrival times of the requests still to come, and the engines' load
    /// observed at `arrival − lag` for those whose moment has passed.
    arrivals: VecDeque<f64>,
    observed: VecDeque<Vec<model::Load>>,
    epoch: Instant,
}

/// A router's request in flight, or finished since the report it sees.
#[derive(Clone, Debug)]
struct Own {
    /// Its trace position.
    i: usize,
    /// Its prompt blocks, pinned until it finishes.
    pin: Option<Pin>,
    /// Once finished, the blocks it freed: its own, less those another of
    /// the router's requests there still held.
    freed: u64,
}

fn at(t: f64) -> Duration {
    Duration::from_secs_f64(t.max(0.0))
}

impl VllmSim {
    /// `replicas` idle replicas of `config`, routed by `routers` routers
    /// running `policy`, which see cache events and load reports `lag_s`
    /// late. `hashes` are every request's engine-block hashes and
    /// `arrivals` the arrival times of the requests to be routed, in order.
    pub fn new(
        policy: Box<dyn Policy>,
        routers: usize,
        lag_s: f64,
        replicas: usize,
        config: model::Config,
        hashes: Arc<Vec<Vec<u64>>>,
        arrivals: impl IntoIterator<Item = f64>,
    ) -> Self {
        let mut sim = VllmSim {
            engines: Vec::new(),
            ids: Vec::new(),
            config,
            records: vec![Record::default(); hashes.len()],
            hashes,
            now: 0.0,
            index: OccupancyIndex::new(),
            pending: VecDeque::new(),
            routers: (0..routers.max(1))
                .map(|_| Router {
                    policy: policy.boxed_clone(),
                    own: Vec::new(),
                    pinned: Pinned::new(PINNED_BLOCKS),
                })
                .collect(),
            next_router: 0,
            lag_s,
            arrivals: VecDeque::new(),
            observed: VecDeque::new(),
            epoch: Instant::now(),
        };
        for _ in 0..replicas {
            sim.add_replica();
        }
        sim.expect(arrivals);
        sim
    }

    /// Tokens per engine block.
    pub fn block_size(&self) -> u64 {
        self.config.block_size as u64
    }

    /// Adds an idle replica (a scale-out).
    pub fn add_replica(&mut self) {
        let i = self.engines.len();
        self.engines.push(model::Engine::new(self.config.clone()));
        self.ids.push(endpoint_id(&format!("replica-{i}")));
        for router in &mut self.routers {
            router.own.push(Vec::new());
        }
        let empty = CacheEvent::Snapshot {
            capacity: self.config.num_blocks,
            blocks: &[],
        };
        self.index
            .apply(Slot(i as u32), empty)
            .expect("an empty snapshot fits");
    }

    /// From now on, the requests routed arrive at `arrivals`, in order
    /// (a fork routes only some of the trace).
    pub fn expect(&mut self, arrivals: impl IntoIterator<Item = f64>) {
        self.arrivals = arrivals.into_iter().collect();
        self.observed.clear();
    }

    /// Runs the engines' steps that end by `t`, in time order.
    fn advance(&mut self, t: f64) {
        loop {
            let next = self
                .engines
                .iter()
                .enumerate()
                .filter_map(|(r, e)| e.step_end().map(|end| (end, r)))
                .min();
            match next {
                Some((end, r)) if end.as_secs_f64() <= t => {
                    let end_s = end.as_secs_f64();
                    self.now = self.now.max(end_s);
                    self.engines[r].finish_step();
                    self.settle(r, end_s);
                    self.engines[r].start_step(end);
                    self.settle(r, end_s);
                }
                _ => break,
            }
        }
        self.now = self.now.max(t);
    }

    /// Records what replica `r` did at `t`.
    fn settle(&mut self, r: usize, t: f64) {
        let engine = &mut self.engines[r];
        for (id, progress) in engine.take_progress() {
            let record = &mut self.records[id as usize];
            match progress {
                Progress::Admitted { cached_tokens } => {
                    record.cached_tokens = Some(cached_tokens as u64);
                }
                Progress::Token { index: 0, last } => {
                    record.first_token = Some(t);
                    if last {
                        record.done = Some(t);
                    }
                }
                Progress::Token { last: true, .. } => record.done = Some(t),
                Progress::Token { .. } | Progress::Preempted => {}
            }
        }
        for event in engine.take_events() {
            self.pending.push_back((t, r, event));
        }
    }

    /// Applies the cache events up to `seen` to the routers' index.
    fn deliver(&mut self, seen: f64) {
        while self.pending.front().is_some_and(|(t, ..)| *t <= seen) {
            let (_, r, event) = self.pending.pop_front().expect("checked");
            let slot = Slot(r as u32);
            let event = match &event {
                PoolEvent::Stored { hashes, .. } => CacheEvent::Stored(hashes),
                PoolEvent::Removed(hashes) => CacheEvent::Removed(hashes),
                PoolEvent::Cleared => CacheEvent::Cleared,
            };
            self.index
                .apply(slot, event)
                .expect("the index mirrors the engines");
        }
    }

    /// Observes the engines' load at every passed moment `arrival − lag`
    /// up to `t`.
    fn observe_until(&mut self, t: f64) {
        let pending = self.observed.len();
        let due = self
            .arrivals
            .iter()
            .skip(pending)
            .take_while(|&&a| a - self.lag_s <= t)
            .count();
        for k in 0..due {
            let moment = self.arrivals[pending + k] - self.lag_s;
            self.advance(moment);
            let loads = self.engines.iter().map(|e| e.load(at(self.now))).collect();
            self.observed.push_back(loads);
        }
    }

    /// Routes request number `i` (its position in the trace) with routing
    /// key `key` (made from its first `key_prefix_blocks` block ids, if it
    /// was), and queues it at its replica. Returns the replica and the
    /// policy's reason.
    pub fn route(
        &mut self,
        i: usize,
        request: &TraceRequest,
        (key, key_prefix_blocks): (RoutingKey, Option<u32>),
    ) -> (usize, Reason) {
        let t = request.arrival_s;
        self.observe_until(t);
        self.advance(t);
        self.arrivals.pop_front();
        let loads = self.observed.pop_front().unwrap_or_default();
        let seen = t - self.lag_s;
        self.deliver(seen);
        let reported_at = self.epoch + at(seen);
        let k = self.next_router;
        self.next_router = (k + 1) % self.routers.len();
        let rate = self.config.prefill_tokens_per_s;
        let (itl, rate) = (self.config.itl, (rate > 0.0).then_some(rate));
        let report = |engine: model::Load, at| engine.report(rate, itl, at);
        let mut endpoints: Vec<Endpoint> = (0..self.engines.len())
            .map(|r| {
                let mut load = self.own_load(k, r, t, seen);
                load.engine = Some(report(
                    loads.get(r).copied().unwrap_or_default(),
                    reported_at,
                ));
                Endpoint {
                    slot: Slot(r as u32),
                    id: self.ids[r],
                    load,
                    weight: 1.0,
                }
            })
            .collect();
        let hashes = self.hashes.clone();
        let req = Request {
            key,
            chain: &hashes[i],
            prompt_tokens: request.input_length,
            key_prefix_blocks,
            output_tokens: request.output_length,
        };
        let now = self.epoch + at(t);
        let block_size = self.config.block_size as u64;
        let router = &mut self.routers[k];
        let cx = Context {
            index: Some(&self.index),
            block_tokens: block_size,
            now,
            pinned: Some(&router.pinned),
        };
        let overhead_ms = self.config.prefill_overhead.as_secs_f64() * 1000.0;
        let engines = &self.engines;
        let (decision, r, refused) = decide(
            &mut *router.policy,
            &req,
            &mut endpoints,
            &cx,
            |r, bound_ms| {
                let fresh = report(engines[r].load(at(t)), now);
                let blocks = engines[r].demand(&hashes[i], request.input_length as usize);
                (!admission::admits(bound_ms, fresh, overhead_ms, blocks)).then_some(fresh)
            },
        );
        router.policy.routed(&req, &endpoints[r]);
        let slot = Slot(r as u32);
        let (admit, growth) = demand_blocks(
            request.input_length,
            router.pinned.leading(slot, &hashes[i]),
            request.output_length,
            block_size,
        );
        let pin = router.pinned.pin(slot, &hashes[i]);
        router.own[r].push(Own {
            i,
            pin: Some(pin),
            freed: 0,
        });
        let estimate = (decision.cached_blocks as u64 * self.config.block_size as u64)
            .min(request.input_length);
        // Each refusal's round trip is charged to the request's TTFT.
        self.records[i] = Record {
            replica: r,
            arrival: t - REFUSAL_S * refused as f64,
            reason: Some(decision.reason),
            prompt: request.input_length,
            uncached_estimate: request.input_length - estimate,
            blocks: admit + growth,
            ..Record::default()
        };
        let added = self.engines[r].add(
            i as u64,
            hashes[i].clone(),
            request.input_length as usize,
            request.output_length as usize,
        );
        if added.is_err() {
            self.records[i].refused = true;
        }
        self.engines[r].start_step(at(t));
        self.settle(r, t);
        (r, decision.reason)
    }

    /// What router `k` counts at replica `r` at `t`, with requests sent
    /// after `reported` not in the engine's report.
    fn own_load(&mut self, k: usize, r: usize, t: f64, reported: f64) -> Load {
        let records = &self.records;
        let router = &mut self.routers[k];
        // Kept until the report covers their end: one sent before the
        // report that finished since frees its blocks at once, as the
        // router counts it live ([`kvroute_core::load::LoadTracker::finish`]).
        let (own, gone): (Vec<Own>, Vec<Own>) = std::mem::take(&mut router.own[r])
            .into_iter()
            .partition(|o| !records[o.i].refused && records[o.i].done.is_none_or(|d| d > reported));
        router.own[r] = own;
        for pin in gone.into_iter().filter_map(|o| o.pin) {
            router.pinned.unpin(pin);
        }
        let mut load = Load::default();
        for o in router.own[r].iter_mut() {
            let s = &records[o.i];
            if s.done.is_some_and(|d| d <= t) {
                if let Some(pin) = o.pin.take() {
                    o.freed = s.blocks.saturating_sub(router.pinned.unpin(pin));
                }
                if s.arrival <= reported {
                    load.finished_since_report.0 += 1;
                    load.finished_since_report.1 += o.freed;
                }
                continue;
            }
            load.in_flight += 1;
            load.active_tokens += s.prompt;
            if s.first_token.is_none_or(|f| f > t) {
                load.prefill_tokens += s.uncached_estimate;
                if s.arrival > reported {
                    load.unreported_prefill_tokens += s.uncached_estimate;
                    load.unreported_requests += 1;
                }
            } else {
                load.decoding += 1;
            }
            if s.arrival > reported {
                load.unreported_blocks += s.blocks;
            }
        }
        load
    }

    /// Runs every engine until idle; the outcome of each request routed
    /// here (by trace position), `None` for a refused or unrouted one.
    pub fn finish(mut self) -> Vec<Option<Outcome>> {
        self.advance(f64::INFINITY);
        self.records
            .iter()
            .map(|r| {
                let reason = r.reason?;
                if r.refused {
                    return None;
                }
                let cached = r.cached_tokens.expect("every request is admitted");
                let first = r.first_token.expect("every request gets a token");
                Some(Outcome {
                    replica: r.replica,
                    cached_tokens: cached,
                    uncached_tokens: r.prompt - cached,
                    ttft_s: first - r.arrival,
                    reason,
                })
            })
            .collect()
    }

    /// Requests refused because they can never fit.
    pub fn refused(&self) -> usize {
        self.records.iter().filter(|r| r.refused).count()
    }
}

#[cfg(test)]
mod tests;
