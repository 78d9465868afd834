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
//! - Policies see in-flight counts, outstanding prefill tokens and requests
//!   decoding per replica, and the replicas' exact cache contents through an
//!   occupancy index, as a router with WatchCache streams would.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use kvroute_core::index::{CacheEvent, OccupancyIndex};
use kvroute_core::keys::RoutingKey;
use kvroute_core::load::Load;
use kvroute_core::lru::Lru;
use kvroute_core::policy::{Context, Endpoint, Policy, Reason, Request};
use kvroute_core::rendezvous::endpoint_id;
use kvroute_core::slot::Slot;

use super::trace::TraceRequest;

/// Fixed prefill cost per request, seconds.
pub const PREFILL_OVERHEAD_S: f64 = 0.020;
/// Prefill throughput, tokens per second.
pub const PREFILL_TOKENS_PER_S: f64 = 10_000.0;
/// Decode time per output token, seconds.
pub const DECODE_S_PER_TOKEN: f64 = 0.030;

/// A time that orders totally (virtual seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

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

/// One replica: its cache and its prefill server.
#[derive(Clone, Debug)]
struct Replica {
    cache: Lru,
    /// When the prefill server is next free.
    free_at: f64,
    /// Requests not yet past prefill: (prefill end, uncached tokens,
    /// completion), in FIFO order.
    prefilling: VecDeque<(f64, u64, f64)>,
    prefill_tokens: u64,
    /// Completion times of requests past prefill.
    decoding: BinaryHeap<Reverse<Time>>,
}

impl Replica {
    fn new() -> Self {
        Replica {
            cache: Lru::new(),
            free_at: 0.0,
            prefilling: VecDeque::new(),
            prefill_tokens: 0,
            decoding: BinaryHeap::new(),
        }
    }

    /// Moves the replica's queues to time `t`.
    fn advance(&mut self, t: f64) {
        while let Some(&(end, uncached, done)) = self.prefilling.front() {
            if end > t {
                break;
            }
            self.prefilling.pop_front();
            self.prefill_tokens -= uncached;
            self.decoding.push(Reverse(Time(done)));
        }
        while self
            .decoding
            .peek()
            .is_some_and(|Reverse(done)| done.0 <= t)
        {
            self.decoding.pop();
        }
    }

    fn load(&self) -> Load {
        Load {
            in_flight: (self.prefilling.len() + self.decoding.len()) as u32,
            prefill_tokens: self.prefill_tokens,
            decoding: self.decoding.len() as u32,
            engine: None,
        }
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

/// A pool of replicas under one policy.
#[derive(Debug)]
pub struct Sim {
    replicas: Vec<Replica>,
    ids: Vec<u64>,
    index: OccupancyIndex,
    policy: Box<dyn Policy>,
    capacity: usize,
    block_tokens: u64,
    endpoints: Vec<Endpoint>,
}

impl Clone for Sim {
    fn clone(&self) -> Self {
        Sim {
            replicas: self.replicas.clone(),
            ids: self.ids.clone(),
            index: self.index.clone(),
            policy: self.policy.boxed_clone(),
            capacity: self.capacity,
            block_tokens: self.block_tokens,
            endpoints: Vec::new(),
        }
    }
}

impl Sim {
    /// `replicas` empty replicas of `capacity` blocks each.
    pub fn new(
        policy: Box<dyn Policy>,
        replicas: usize,
        capacity: usize,
        block_tokens: u64,
    ) -> Self {
        let mut sim = Sim {
            replicas: Vec::new(),
            ids: Vec::new(),
            index: OccupancyIndex::new(),
            policy,
            capacity,
            block_tokens,
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

    /// Routes and serves `request` with routing key `key`.
    pub fn step(&mut self, request: &TraceRequest, key: RoutingKey) -> Outcome {
        let t = request.arrival_s;
        self.endpoints.clear();
        for (i, replica) in self.replicas.iter_mut().enumerate() {
            replica.advance(t);
            self.endpoints.push(Endpoint {
                slot: Slot(i as u32),
                id: self.ids[i],
                load: replica.load(),
            });
        }
        let req = Request {
            key,
            chain: &request.hash_ids,
            prompt_tokens: request.input_length,
        };
        let cx = Context {
            index: Some(&self.index),
            block_tokens: self.block_tokens,
        };
        let decision = self.policy.rank(&req, &self.endpoints, &cx);
        let r = decision.ranked[0];
        self.policy.routed(&req, &self.endpoints[r]);

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
        let slot = Slot(r as u32);
        let mirror = [CacheEvent::Stored(&stored), CacheEvent::Removed(&removed)];
        for event in mirror {
            self.index
                .apply(slot, event)
                .expect("the index mirrors the cache");
        }

        let start = t.max(replica.free_at);
        let prefill_end =
            start + PREFILL_OVERHEAD_S + uncached_tokens as f64 / PREFILL_TOKENS_PER_S;
        replica.free_at = prefill_end;
        let completion = prefill_end + DECODE_S_PER_TOKEN * request.output_length as f64;
        replica
            .prefilling
            .push_back((prefill_end, uncached_tokens, completion));
        replica.prefill_tokens += uncached_tokens;
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
