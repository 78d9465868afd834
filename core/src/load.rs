//! Load accounting per endpoint.
//!
//! The router counts what it sent: requests in flight, the estimated prefill
//! work still ahead of each endpoint (uncached prompt tokens of requests that
//! have not produced their first token), and requests decoding. Engines add
//! their own view over WatchCache (waiting, running, KV usage), which ages.
//! [`WorkModel`] turns a [`Load`] into one number, estimated work in prompt
//! tokens, which is what load bounds and penalties compare.
//!
//! Not here: timing out requests or reading clocks for the caller.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::slot::Slot;

/// What an engine last reported about itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting to be scheduled.
    pub waiting: u32,
    /// Requests running (prefill or decode).
    pub running: u32,
    /// Share of KV cache blocks in use, 0 to 1.
    pub kv_usage: f32,
    /// Prompt tokens it has still to prefill, if it says.
    pub queued_prefill_tokens: Option<u64>,
    /// Its prefill rate, tokens per second, if it says.
    pub prefill_tokens_per_s: Option<f64>,
    /// When the report arrived.
    pub reported_at: Instant,
}

impl EngineLoad {
    /// How old the report is at `now`.
    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.reported_at)
    }
}

/// One endpoint's load as policies see it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// Requests sent and not finished.
    pub in_flight: u32,
    /// Uncached prompt tokens of in-flight requests not yet past prefill.
    pub prefill_tokens: u64,
    /// In-flight requests past prefill (producing tokens).
    pub decoding: u32,
    /// The engine's own report, if it sends one.
    pub engine: Option<EngineLoad>,
}

impl Load {
    /// In-flight requests still in (or queued for) prefill.
    pub fn prefilling(&self) -> u32 {
        self.in_flight.saturating_sub(self.decoding)
    }
}

/// Converts load into estimated outstanding work, in prompt tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkModel {
    /// Fixed cost of each request's prefill, in token-equivalents. Default:
    /// 200 (a 20 ms scheduling and launch overhead at 10,000 prefill tokens
    /// per second, the figures of kvroute's replay model).
    pub request_overhead_tokens: u64,
    /// Work one decoding request adds, in token-equivalents: decode steps
    /// share the batch with prefill and slow it. Default: 16.
    pub decode_tokens: u64,
}

impl Default for WorkModel {
    fn default() -> Self {
        WorkModel {
            request_overhead_tokens: 200,
            decode_tokens: 16,
        }
    }
}

impl WorkModel {
    /// Estimated work queued at an endpoint.
    pub fn work(&self, load: &Load) -> u64 {
        load.prefill_tokens
            + self.request_overhead_tokens * u64::from(load.prefilling())
            + self.decode_tokens * u64::from(load.decoding)
    }

    /// Estimated work a request adds when `uncached_tokens` of its prompt
    /// must be computed.
    pub fn cost(&self, uncached_tokens: u64) -> u64 {
        uncached_tokens + self.request_overhead_tokens
    }
}

/// Where a tracked request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
}

/// A request counted against an endpoint. Hand it back to
/// [`LoadTracker::first_token`] and [`LoadTracker::finish`]; a ticket from
/// before its endpoint was removed is ignored, so a slot reused by another
/// endpoint is never decremented by the old one's requests.
#[derive(Debug)]
#[must_use = "a ticket must be finished, or the endpoint's load never drops"]
pub struct Ticket {
    slot: Slot,
    generation: u64,
    uncached_tokens: u64,
    phase: Phase,
}

impl Ticket {
    /// The endpoint the request went to.
    pub fn slot(&self) -> Slot {
        self.slot
    }
}

#[derive(Clone, Debug, Default)]
struct Entry {
    load: Load,
    generation: u64,
}

/// Per-endpoint load of one pool, by slot.
#[derive(Debug, Default)]
pub struct LoadTracker {
    entries: Vec<Entry>,
    generations: u64,
}

impl LoadTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(&mut self, slot: Slot) -> &mut Entry {
        if self.entries.len() <= slot.index() {
            self.entries.resize_with(slot.index() + 1, Entry::default);
        }
        &mut self.entries[slot.index()]
    }

    /// Counts a request sent to `slot` with `uncached_tokens` of prefill.
    pub fn start(&mut self, slot: Slot, uncached_tokens: u64) -> Ticket {
        let entry = self.entry(slot);
        entry.load.in_flight += 1;
        entry.load.prefill_tokens += uncached_tokens;
        Ticket {
            slot,
            generation: entry.generation,
            uncached_tokens,
            phase: Phase::Prefill,
        }
    }

    fn live(&mut self, ticket: &Ticket) -> Option<&mut Load> {
        let entry = self.entries.get_mut(ticket.slot.index())?;
        (entry.generation == ticket.generation).then_some(&mut entry.load)
    }

    /// The request produced its first token: its prefill is done.
    pub fn first_token(&mut self, ticket: &mut Ticket) {
        if ticket.phase == Phase::Decode {
            return;
        }
        ticket.phase = Phase::Decode;
        let uncached = ticket.uncached_tokens;
        if let Some(load) = self.live(ticket) {
            load.prefill_tokens = load.prefill_tokens.saturating_sub(uncached);
            load.decoding += 1;
        }
    }

    /// The request finished (completed, failed or cancelled).
    pub fn finish(&mut self, ticket: Ticket) {
        if let Some(load) = self.live(&ticket) {
            load.in_flight = load.in_flight.saturating_sub(1);
            match ticket.phase {
                Phase::Prefill => {
                    load.prefill_tokens = load.prefill_tokens.saturating_sub(ticket.uncached_tokens)
                }
                Phase::Decode => load.decoding = load.decoding.saturating_sub(1),
            }
        }
    }

    /// Records an engine's own load report.
    pub fn report(&mut self, slot: Slot, engine: EngineLoad) {
        self.entry(slot).load.engine = Some(engine);
    }

    /// `slot`'s current load.
    pub fn load(&self, slot: Slot) -> Load {
        self.entries
            .get(slot.index())
            .map(|e| e.load)
            .unwrap_or_default()
    }

    /// Forgets `slot`'s load; outstanding tickets for it are ignored from
    /// now on.
    pub fn remove(&mut self, slot: Slot) {
        self.generations += 1;
        let generation = self.generations;
        *self.entry(slot) = Entry {
            load: Load::default(),
            generation,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_moves_from_prefill_to_decode_to_done() {
        let mut t = LoadTracker::new();
        let mut a = t.start(Slot(1), 1000);
        let b = t.start(Slot(1), 50);
        assert_eq!(
            t.load(Slot(1)),
            Load {
                in_flight: 2,
                prefill_tokens: 1050,
                decoding: 0,
                engine: None
            }
        );
        t.first_token(&mut a);
        t.first_token(&mut a); // idempotent
        assert_eq!(t.load(Slot(1)).prefill_tokens, 50);
        assert_eq!(t.load(Slot(1)).decoding, 1);
        assert_eq!(t.load(Slot(1)).prefilling(), 1);
        t.finish(a);
        t.finish(b); // cancelled before its first token
        assert_eq!(t.load(Slot(1)), Load::default());
        assert_eq!(t.load(Slot(7)), Load::default());
    }

    #[test]
    fn tickets_from_a_removed_endpoint_are_ignored() {
        let mut t = LoadTracker::new();
        let old = t.start(Slot(0), 10);
        t.remove(Slot(0));
        let new = t.start(Slot(0), 20);
        t.finish(old);
        assert_eq!(t.load(Slot(0)).in_flight, 1);
        assert_eq!(t.load(Slot(0)).prefill_tokens, 20);
        t.finish(new);
        assert_eq!(t.load(Slot(0)), Load::default());
    }

    #[test]
    fn engine_reports_age() {
        let mut t = LoadTracker::new();
        let at = Instant::now();
        t.report(
            Slot(0),
            EngineLoad {
                waiting: 3,
                running: 5,
                kv_usage: 0.5,
                queued_prefill_tokens: Some(100),
                prefill_tokens_per_s: None,
                reported_at: at,
            },
        );
        let engine = t.load(Slot(0)).engine.unwrap();
        assert_eq!(engine.waiting, 3);
        assert_eq!(
            engine.age(at + Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(engine.age(at - Duration::from_secs(1)), Duration::ZERO);
    }

    #[test]
    fn work_counts_prefill_overhead_and_decode() {
        let m = WorkModel::default();
        let load = Load {
            in_flight: 3,
            prefill_tokens: 1000,
            decoding: 1,
            engine: None,
        };
        assert_eq!(m.work(&load), 1000 + 200 * 2 + 16);
        assert_eq!(m.cost(300), 500);
    }
}
