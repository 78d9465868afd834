//! Load accounting per endpoint.
//!
//! The router counts what it sent: requests in flight, the estimated prefill
//! work still ahead of each endpoint (uncached prompt tokens of requests that
//! have not produced their first token), and requests decoding. Engines add
//! their own view over WatchCache (waiting, running, KV usage, queued
//! prefill), which ages: it covers every router's requests, where the local
//! counts cover only this router's.
//!
//! [`PrefillModel`] turns a [`Load`] into predicted seconds until a new
//! request's prefill could start, fleet-wide when the engine reports its
//! queue: the `kvroute` and `min-ttft` policies compare that, at one rate
//! for the whole pool ([`PrefillModel::pool_rate`]).
//!
//! Not here: timing out requests or reading clocks for the caller (the
//! caller passes `now`).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::pinned::{Pin, Pinned};
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
    /// Its KV memory, if it says.
    pub memory: Option<Memory>,
    /// When the report arrived.
    pub reported_at: Instant,
}

/// What an engine says of its KV memory: enough to predict how long a new
/// request waits for blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Memory {
    /// Blocks not held by a running request.
    pub free_blocks: u64,
    /// Blocks held by running requests.
    pub used_blocks: u64,
    /// Blocks the waiting requests take from the free pool to be admitted.
    pub waiting_blocks: u64,
    /// Blocks the requests running and waiting will still take for their
    /// output, as they decode.
    pub growth_blocks: u64,
    /// Seconds until the running requests finish, on average.
    pub remaining_decode_s: f64,
    /// Seconds a waiting request decodes once it runs, on average: the
    /// blocks it is admitted with are held that long.
    pub waiting_decode_s: f64,
    /// Requests running, and waiting.
    pub running: u64,
    /// See `running`.
    pub waiting: u64,
    /// Requests the engine runs at once (vLLM `max_num_seqs`), if it says.
    pub max_num_seqs: Option<u64>,
}

impl Memory {
    /// Seconds until a new request, behind the waiting ones, has a seat
    /// and `blocks` free blocks, the blocks the others will still take
    /// for their output counted as taken. Requests free both when they
    /// finish, each holding its share of the blocks: a deficit of D of U
    /// used blocks held by R running requests clears when ⌈D·R/U⌉ of them
    /// have finished (a deficit of seats, when that many have), their
    /// finishes taken as evenly spread over twice their mean remaining
    /// time, the k-th at k/(R+1) of it. With one request running, one
    /// block short waits for the whole of its decode. A deficit beyond
    /// every running request's blocks waits, after them, for the waiting
    /// requests they make room for to finish in turn, the same way over
    /// twice `waiting_decode_s`: they hold what they are admitted with for
    /// their whole decode.
    pub fn wait_s(&self, blocks: u64) -> f64 {
        // The first k of n holders of `held` blocks (or seats) to finish,
        // spread over `span` s, free `deficit`: when the k-th does.
        let finishes = |deficit: u64, held: u64, n: u64, span: f64| -> f64 {
            if deficit == 0 || held == 0 || n == 0 {
                return 0.0;
            }
            let k = ((deficit as f64 * n as f64 / held as f64).ceil() as u64).clamp(1, n);
            span * k as f64 / n.saturating_add(1) as f64
        };
        let running = 2.0 * self.remaining_decode_s.max(0.0);
        let waiting = 2.0 * self.waiting_decode_s.max(0.0);
        // Saturating: the counts are an engine's word.
        let demand = (self.waiting_blocks)
            .saturating_add(self.growth_blocks)
            .saturating_add(blocks);
        let deficit = demand.saturating_sub(self.free_blocks);
        let for_blocks = if deficit <= self.used_blocks {
            finishes(deficit, self.used_blocks, self.running, running)
        } else {
            finishes(self.used_blocks, self.used_blocks, self.running, running)
                + finishes(
                    deficit - self.used_blocks,
                    self.waiting_blocks,
                    self.waiting,
                    waiting,
                )
        };
        let for_seat = self.max_num_seqs.map_or(0.0, |seats| {
            let free = seats.saturating_sub(self.running);
            let deficit = (self.waiting + 1).saturating_sub(free);
            finishes(deficit, self.running, self.running, running)
        });
        for_blocks.max(for_seat)
    }

    /// The memory with `requests` of the running ones finished, and the
    /// `blocks` they held free again.
    pub fn without(self, (requests, blocks): (u32, u64)) -> Memory {
        let blocks = blocks.min(self.used_blocks);
        Memory {
            free_blocks: self.free_blocks.saturating_add(blocks),
            used_blocks: self.used_blocks - blocks,
            running: self.running.saturating_sub(u64::from(requests)),
            ..self
        }
    }
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
    /// Prompt tokens of the requests in flight: the KV cache they hold
    /// while they decode.
    pub active_tokens: u64,
    /// Uncached prompt tokens of in-flight requests sent since the engine's
    /// last report and not yet past prefill: what that report cannot know.
    pub unreported_prefill_tokens: u64,
    /// How many requests `unreported_prefill_tokens` covers.
    pub unreported_requests: u32,
    /// KV blocks the in-flight requests sent since the engine's last
    /// report take from its free pool, output included
    /// ([`demand_blocks`]), until they finish.
    pub unreported_blocks: u64,
    /// Requests this router sent before the engine's last report that
    /// finished since, and the KV blocks they held: the report counts them
    /// as running, but the engine has freed them.
    pub finished_since_report: (u32, u64),
    /// The engine's own report, if it sends one.
    pub engine: Option<EngineLoad>,
}

impl Load {
    /// In-flight requests still in (or queued for) prefill.
    pub fn prefilling(&self) -> u32 {
        self.in_flight.saturating_sub(self.decoding)
    }
}

/// How long prefill takes, in seconds: what the time-denominated policies
/// (`kvroute`, `min-ttft`) predict time to first token with.
///
/// An endpoint's queue is read from its engine's last report when there is
/// one younger than `max_report_age_ms` that states its queued prefill
/// tokens: the report covers every router's requests. It is aged (the
/// engine kept prefilling since) and this router's requests sent after it
/// are added. Without such a report, the router's own counts stand in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct PrefillModel {
    /// Prompt tokens an engine prefills per second, for a pool whose
    /// engines report none of their own (policies compare a pool's
    /// endpoints at one rate: [`PrefillModel::pool_rate`]). Default: 10,000.
    pub prefill_tokens_per_second: f64,
    /// Fixed cost of each prefill (scheduling, kernel launches), in
    /// milliseconds. Default: 20.
    pub prefill_overhead_ms: f64,
    /// Engine load reports older than this are not trusted, in
    /// milliseconds. Default: 2,000 (engines report at least every second).
    pub max_report_age_ms: u64,
}

impl Default for PrefillModel {
    fn default() -> Self {
        PrefillModel {
            prefill_tokens_per_second: 10_000.0,
            prefill_overhead_ms: 20.0,
            max_report_age_ms: 2_000,
        }
    }
}

impl PrefillModel {
    /// Checks the model can predict anything: a positive rate, a
    /// non-negative overhead.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.prefill_tokens_per_second.is_finite() && self.prefill_tokens_per_second > 0.0) {
            return Err(format!(
                "prefillTokensPerSecond must be a positive number, got {}",
                self.prefill_tokens_per_second
            ));
        }
        if !(self.prefill_overhead_ms.is_finite() && self.prefill_overhead_ms >= 0.0) {
            return Err(format!(
                "prefillOverheadMs must be 0 or more, got {}",
                self.prefill_overhead_ms
            ));
        }
        Ok(())
    }

    /// The endpoint's own prefill rate, tokens per second: its engine's
    /// when reported, else the configured one. For one endpoint's own
    /// estimates (its status, how long to wait for it); policies compare
    /// endpoints at [`Self::pool_rate`].
    pub fn rate(&self, load: &Load) -> f64 {
        reported_rate(load)
            .unwrap_or(self.prefill_tokens_per_second)
            .max(f64::MIN_POSITIVE)
    }

    /// The rate a pool's endpoints are compared at, tokens per second: the
    /// median of the rates their engines report (of an even count, the
    /// mean of the middle two), else the configured one. One rate for all,
    /// so that endpoints whose measured rates differ only by noise, or one
    /// not measured yet, are predicted alike; a pool of unlike hardware is
    /// predicted at its median speed.
    pub fn pool_rate<'a>(&self, loads: impl IntoIterator<Item = &'a Load>) -> f64 {
        let mut rates: Vec<f64> = loads.into_iter().filter_map(reported_rate).collect();
        rates.sort_by(f64::total_cmp);
        let mid = rates.len() / 2;
        let median = match rates.len() {
            0 => self.prefill_tokens_per_second,
            n if n % 2 == 1 => rates[mid],
            _ => (rates[mid - 1] + rates[mid]) / 2.0,
        };
        median.max(f64::MIN_POSITIVE)
    }

    fn overhead_s(&self) -> f64 {
        self.prefill_overhead_ms.max(0.0) / 1000.0
    }

    /// Seconds of prefill queued at the endpoint at `now`: how long a new
    /// request would wait before its own prefill starts.
    pub fn queued_s(&self, load: &Load, now: Instant) -> f64 {
        self.queued_s_at(load, now, self.rate(load))
    }

    /// [`Self::queued_s`] at `rate` tokens per second (a pool's, see
    /// [`Self::pool_rate`]).
    pub fn queued_s_at(&self, load: &Load, now: Instant, rate: f64) -> f64 {
        let overhead = self.overhead_s();
        let fresh = load.engine.filter(|e| {
            e.queued_prefill_tokens.is_some()
                && e.age(now) <= Duration::from_millis(self.max_report_age_ms)
        });
        match fresh {
            Some(e) => {
                let reported = e.queued_prefill_tokens.unwrap_or(0) as f64 / rate
                    + overhead * f64::from(e.waiting);
                let drained = (reported - e.age(now).as_secs_f64()).max(0.0);
                drained
                    + load.unreported_prefill_tokens as f64 / rate
                    + overhead * f64::from(load.unreported_requests)
            }
            None => load.prefill_tokens as f64 / rate + overhead * f64::from(load.prefilling()),
        }
    }

    /// Seconds a request taking `blocks` KV blocks from the free pool
    /// ([`demand_blocks`]) waits at the endpoint at `now` for its engine
    /// to free them (after every waiting request's), from the engine's
    /// last report when it is fresh and says (else 0); this router's
    /// requests sent since count as taken.
    pub fn memory_wait_s(&self, load: &Load, blocks: u64, now: Instant) -> f64 {
        let fresh = load
            .engine
            .filter(|e| e.age(now) <= Duration::from_millis(self.max_report_age_ms));
        let Some((e, memory)) = fresh.and_then(|e| Some((e, e.memory?))) else {
            return 0.0;
        };
        let memory = memory.without(load.finished_since_report);
        (memory.wait_s(blocks.saturating_add(load.unreported_blocks)) - e.age(now).as_secs_f64())
            .max(0.0)
    }

    /// Seconds the endpoint takes to prefill `uncached_tokens` once it
    /// starts.
    pub fn prefill_s(&self, load: &Load, uncached_tokens: u64) -> f64 {
        self.prefill_s_at(uncached_tokens, self.rate(load))
    }

    /// Seconds a prefill of `uncached_tokens` takes at `rate` tokens per
    /// second.
    pub fn prefill_s_at(&self, uncached_tokens: u64, rate: f64) -> f64 {
        self.overhead_s() + uncached_tokens as f64 / rate
    }

    /// Predicted time to first token at the endpoint for a request with
    /// `uncached_tokens` to prefill there that takes `blocks` KV blocks
    /// from the free pool ([`demand_blocks`]): the longer of the prefill
    /// queue and the wait for memory, then its own prefill. (While the
    /// head of the queue waits for blocks nothing prefills, so the two
    /// overlap; the longer one bounds the wait.)
    pub fn ttft_s(&self, load: &Load, uncached_tokens: u64, blocks: u64, now: Instant) -> f64 {
        let memory = self.memory_wait_s(load, blocks, now);
        self.queued_s(load, now).max(memory) + self.prefill_s(load, uncached_tokens)
    }
}

/// KV blocks a request takes from an endpoint's free pool: to be admitted,
/// every block of its prompt but the leading `pinned` that a request
/// running there holds (a cached block nobody holds is in the free pool,
/// and leaves it when reused); then, as it decodes, its output's. Returns
/// (to be admitted, output).
pub fn demand_blocks(
    prompt_tokens: u64,
    pinned: u32,
    output_tokens: u64,
    block_tokens: u64,
) -> (u64, u64) {
    let bs = block_tokens.max(1);
    let prompt = prompt_tokens.div_ceil(bs);
    let admit = prompt.saturating_sub(u64::from(pinned)).max(1);
    // The last output token is never fed back: it needs no KV.
    let total = (prompt_tokens + output_tokens.saturating_sub(1)).div_ceil(bs);
    (admit, total.saturating_sub(prompt))
}

/// The prefill rate the endpoint's engine reports, if a usable one.
fn reported_rate(load: &Load) -> Option<f64> {
    load.engine
        .and_then(|e| e.prefill_tokens_per_s)
        .filter(|r| r.is_finite() && *r > 0.0)
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
    /// The endpoint's report count when the request was sent.
    reports: u64,
    uncached_tokens: u64,
    prompt_tokens: u64,
    /// KV blocks it takes, counted in `unreported_blocks` until a report.
    blocks: u64,
    pin: Option<Pin>,
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
    /// Engine reports received.
    reports: u64,
}

/// Per-endpoint load of one pool, by slot, and the prompt blocks its
/// requests in flight hold ([`Pinned`]).
#[derive(Debug)]
pub struct LoadTracker {
    entries: Vec<Entry>,
    generations: u64,
    pinned: Pinned,
}

impl Default for LoadTracker {
    fn default() -> Self {
        LoadTracker {
            entries: Vec::new(),
            generations: 0,
            pinned: Pinned::new(PINNED_BLOCKS),
        }
    }
}

/// Blocks of requests in flight a [`LoadTracker`] keeps, over all
/// endpoints: 2^20, about 50 MiB at most.
pub const PINNED_BLOCKS: usize = 1 << 20;

impl LoadTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// The prompt blocks requests in flight hold, per endpoint.
    pub fn pinned(&self) -> &Pinned {
        &self.pinned
    }

    /// [`Self::start`] for a request whose prompt has the block hashes
    /// `chain` (blocks of `block_tokens`) and that may generate
    /// `output_tokens`: its blocks count as held at `slot` until it
    /// finishes, and what it takes from the free pool ([`demand_blocks`])
    /// as taken until the engine's next report.
    pub fn start_request(
        &mut self,
        slot: Slot,
        chain: &[crate::hash::BlockHash],
        tokens: (u64, u64, u64),
        block_tokens: u64,
    ) -> Ticket {
        let (prompt_tokens, uncached_tokens, output_tokens) = tokens;
        let pinned = self.pinned.leading(slot, chain);
        let (admit, growth) = demand_blocks(prompt_tokens, pinned, output_tokens, block_tokens);
        let mut ticket = self.start(slot, prompt_tokens, uncached_tokens);
        ticket.blocks = admit + growth;
        self.entry(slot).load.unreported_blocks += ticket.blocks;
        ticket.pin = Some(self.pinned.pin(slot, chain));
        ticket
    }

    fn entry(&mut self, slot: Slot) -> &mut Entry {
        if self.entries.len() <= slot.index() {
            self.entries.resize_with(slot.index() + 1, Entry::default);
        }
        &mut self.entries[slot.index()]
    }

    /// Counts a request sent to `slot` with `prompt_tokens` of prompt, of
    /// which `uncached_tokens` must be prefilled.
    pub fn start(&mut self, slot: Slot, prompt_tokens: u64, uncached_tokens: u64) -> Ticket {
        let entry = self.entry(slot);
        let load = &mut entry.load;
        load.in_flight += 1;
        load.prefill_tokens += uncached_tokens;
        load.active_tokens += prompt_tokens;
        load.unreported_prefill_tokens += uncached_tokens;
        load.unreported_requests += 1;
        Ticket {
            slot,
            generation: entry.generation,
            reports: entry.reports,
            uncached_tokens,
            prompt_tokens,
            blocks: 0,
            pin: None,
            phase: Phase::Prefill,
        }
    }

    /// The ticket's endpoint entry, unless the endpoint was removed since.
    fn live(&mut self, ticket: &Ticket) -> Option<&mut Entry> {
        let entry = self.entries.get_mut(ticket.slot.index())?;
        (entry.generation == ticket.generation).then_some(entry)
    }

    /// Takes a request out of prefill counts.
    fn end_prefill(entry: &mut Entry, ticket: &Ticket) {
        let load = &mut entry.load;
        load.prefill_tokens = load.prefill_tokens.saturating_sub(ticket.uncached_tokens);
        if entry.reports == ticket.reports {
            load.unreported_prefill_tokens = load
                .unreported_prefill_tokens
                .saturating_sub(ticket.uncached_tokens);
            load.unreported_requests = load.unreported_requests.saturating_sub(1);
        }
    }

    /// The request produced its first token: its prefill is done.
    pub fn first_token(&mut self, ticket: &mut Ticket) {
        if ticket.phase == Phase::Decode {
            return;
        }
        ticket.phase = Phase::Decode;
        if let Some(entry) = self.live(ticket) {
            Self::end_prefill(entry, ticket);
            entry.load.decoding += 1;
        }
    }

    /// The request finished (completed, failed or cancelled). Sent before
    /// the engine's last report, it frees what that report counts it as
    /// holding: its blocks, but those another request in flight there
    /// still holds (other routers' requests are not known here).
    pub fn finish(&mut self, mut ticket: Ticket) {
        let still_held = ticket.pin.take().map_or(0, |pin| self.pinned.unpin(pin));
        if let Some(entry) = self.live(&ticket) {
            let load = &mut entry.load;
            if entry.reports == ticket.reports {
                load.unreported_blocks = load.unreported_blocks.saturating_sub(ticket.blocks);
            } else {
                let (requests, blocks) = &mut load.finished_since_report;
                *requests += 1;
                *blocks += ticket.blocks.saturating_sub(still_held);
            }
            match ticket.phase {
                Phase::Prefill => Self::end_prefill(entry, &ticket),
                Phase::Decode => entry.load.decoding = entry.load.decoding.saturating_sub(1),
            }
            let load = &mut entry.load;
            load.in_flight = load.in_flight.saturating_sub(1);
            load.active_tokens = load.active_tokens.saturating_sub(ticket.prompt_tokens);
        }
    }

    /// An engine refused a request sent to `slot` ([`crate::admission`]):
    /// the load it answered with is a fresh report, covering every
    /// request sent so far.
    pub fn refused(&mut self, slot: Slot, report: EngineLoad, now: Instant) {
        let entry = self.entry(slot);
        entry.load.refused(report, now);
        entry.reports += 1;
    }

    /// Records an engine's own load report. It covers the requests sent
    /// so far, so none of them count as unreported any more.
    pub fn report(&mut self, slot: Slot, engine: EngineLoad) {
        let entry = self.entry(slot);
        entry.load.engine = Some(engine);
        entry.load.unreported_prefill_tokens = 0;
        entry.load.unreported_requests = 0;
        entry.load.unreported_blocks = 0;
        entry.load.finished_since_report = (0, 0);
        entry.reports += 1;
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
        self.pinned.forget(slot);
        self.generations += 1;
        let generation = self.generations;
        *self.entry(slot) = Entry {
            load: Load::default(),
            generation,
            reports: 0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_moves_from_prefill_to_decode_to_done() {
        let mut t = LoadTracker::new();
        let mut a = t.start(Slot(1), 1500, 1000);
        let b = t.start(Slot(1), 50, 50);
        assert_eq!(
            t.load(Slot(1)),
            Load {
                in_flight: 2,
                prefill_tokens: 1050,
                decoding: 0,
                active_tokens: 1550,
                unreported_prefill_tokens: 1050,
                unreported_requests: 2,
                unreported_blocks: 0,
                finished_since_report: (0, 0),
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
        let old = t.start(Slot(0), 10, 10);
        t.remove(Slot(0));
        let new = t.start(Slot(0), 20, 20);
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
                memory: None,
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

    fn report(at: Instant, queued: u64, waiting: u32, rate: Option<f64>) -> EngineLoad {
        EngineLoad {
            waiting,
            running: 1,
            kv_usage: 0.5,
            queued_prefill_tokens: Some(queued),
            prefill_tokens_per_s: rate,
            memory: None,
            reported_at: at,
        }
    }

    #[test]
    fn without_a_report_the_local_counts_predict_the_wait() {
        let m = PrefillModel::default();
        let mut t = LoadTracker::new();
        let now = Instant::now();
        let _a = t.start(Slot(0), 5000, 4000);
        let _b = t.start(Slot(0), 1000, 1000);
        let load = t.load(Slot(0));
        // 5,000 tokens at 10,000/s plus two 20 ms overheads.
        assert!((m.queued_s(&load, now) - 0.54).abs() < 1e-9);
        assert!((m.prefill_s(&load, 2000) - 0.22).abs() < 1e-9);
        assert!((m.ttft_s(&load, 2000, 125, now) - 0.76).abs() < 1e-9);
    }

    #[test]
    fn an_engine_report_overrides_stale_local_counts() {
        let m = PrefillModel::default();
        let mut t = LoadTracker::new();
        let at = Instant::now();
        // This router sent one request; the engine, serving every router,
        // has 20,000 tokens queued at 20,000 tokens/s, 2 requests waiting.
        let _mine = t.start(Slot(0), 1000, 1000);
        t.report(Slot(0), report(at, 20_000, 2, Some(20_000.0)));
        let load = t.load(Slot(0));
        assert_eq!(m.rate(&load), 20_000.0);
        assert!((m.queued_s(&load, at) - 1.04).abs() < 1e-9);
        // Half a second later half of it is done.
        let later = at + Duration::from_millis(500);
        assert!((m.queued_s(&load, later) - 0.54).abs() < 1e-9);
        // Requests sent after the report add to it until the next one...
        let mut after = t.start(Slot(0), 4000, 4000);
        let load = t.load(Slot(0));
        assert_eq!(
            (load.unreported_prefill_tokens, load.unreported_requests),
            (4000, 1)
        );
        assert!((m.queued_s(&load, later) - 0.76).abs() < 1e-9);
        // ...and leave it when their prefill is done.
        t.first_token(&mut after);
        assert_eq!(t.load(Slot(0)).unreported_requests, 0);
        // An old report is not trusted: local counts stand in.
        let stale = at + Duration::from_secs(3);
        let load = t.load(Slot(0));
        assert!((m.queued_s(&load, stale) - (1000.0 / 20_000.0 + 0.02)).abs() < 1e-9);
        // A drained queue predicts no wait, not a negative one.
        t.report(Slot(0), report(at, 100, 0, None));
        assert_eq!(m.queued_s(&t.load(Slot(0)), later), 0.0);
        assert_eq!(m.rate(&t.load(Slot(0))), 10_000.0);
    }

    #[test]
    fn a_full_memory_predicts_a_wait_for_blocks() {
        let memory = Memory {
            free_blocks: 100,
            used_blocks: 400,
            waiting_blocks: 60,
            growth_blocks: 0,
            remaining_decode_s: 1.5,
            waiting_decode_s: 2.0,
            running: 10,
            waiting: 2,
            max_num_seqs: None,
        };
        // 60 waiting + 40 of its own fit in 100 free blocks.
        assert_eq!(memory.wait_s(40), 0.0);
        // 140 needed: 40 of 400 used blocks must free, what one of the 10
        // running requests holds; finishes spread over 2 × 1.5 s, the
        // first at 1/11 of it.
        let first = 3.0 / 11.0;
        assert!((memory.wait_s(80) - first).abs() < 1e-9);
        // 41 missing: two must finish.
        assert!((memory.wait_s(81) - 2.0 * first).abs() < 1e-9);
        // More than all used blocks: every running request must finish,
        // then the two waiting ones, admitted as room frees, holding 60
        // blocks over a 2 s decode each.
        let all = 10.0 * first + 2.0 * 2.0 * 2.0 / 3.0;
        assert!((memory.wait_s(1000) - all).abs() < 1e-9);
        // Seats: 10 of 12 taken, 2 waiting: a third must free first, one
        // of the 10 running.
        let seated = Memory {
            max_num_seqs: Some(12),
            ..memory
        };
        assert!((seated.wait_s(40) - first).abs() < 1e-9);
        assert!(
            (seated.wait_s(81) - 2.0 * first).abs() < 1e-9,
            "the longer wait"
        );
        // One request running: a block short waits for all of it, as the
        // engine frees its blocks only when it finishes.
        let one = Memory {
            running: 1,
            waiting: 0,
            waiting_blocks: 0,
            ..memory
        };
        assert!((one.wait_s(101) - 1.5).abs() < 1e-9);
        // One request nearly done and one waiting that fills what it frees:
        // a follow-up of 142 blocks waits for the waiting one's whole
        // decode (as measured live: ~0.5 s where D/U predicted 40 ms).
        let behind = Memory {
            free_blocks: 130,
            used_blocks: 126,
            waiting_blocks: 158,
            growth_blocks: 2,
            remaining_decode_s: 0.04,
            waiting_decode_s: 0.48,
            running: 1,
            waiting: 1,
            max_num_seqs: Some(64),
        };
        assert!((behind.wait_s(142) - (0.04 + 0.48)).abs() < 1e-9);
        // Nothing running frees nothing: no wait to predict.
        let none = Memory { running: 0, ..one };
        assert_eq!(none.wait_s(1000), 0.0);

        let m = PrefillModel::default();
        let mut t = LoadTracker::new();
        let at = Instant::now();
        t.report(
            Slot(0),
            EngineLoad {
                memory: Some(memory),
                ..report(at, 0, 2, None)
            },
        );
        let load = t.load(Slot(0));
        assert!((m.memory_wait_s(&load, 80, at) - first).abs() < 1e-9);
        // The wait ages like the queue, and bounds the time to first token
        // with the queue (empty here) before the request's own prefill
        // (20 ms + 1,280 tokens at 10,000/s).
        let later = at + Duration::from_millis(100);
        assert!((m.memory_wait_s(&load, 80, later) - (first - 0.1)).abs() < 1e-9);
        assert!((m.ttft_s(&load, 80 * 16, 80, later) - (first - 0.1 + 0.148)).abs() < 1e-9);
        // This router's requests sent since the report take blocks too: a
        // 640-token prompt is 40 more blocks, all of them, cached or not.
        let chain: Vec<u64> = (0..40).collect();
        let sent = t.start_request(Slot(0), &chain, (640, 0, 0), 16);
        let load = t.load(Slot(0));
        assert!((m.memory_wait_s(&load, 80, at) - 2.0 * first).abs() < 1e-9);
        // Output the engines will still write counts as taken: 20 blocks
        // of growth make the 40 missing 60, more than one request holds.
        let grown = Memory {
            growth_blocks: 20,
            ..memory
        };
        assert!((grown.wait_s(80) - 2.0 * first).abs() < 1e-9);
        // A request that shares the one in flight's prompt takes only its
        // own blocks: the shared ones are held.
        assert_eq!(t.pinned().leading(Slot(0), &[0, 1, 2, 99]), 3);
        t.finish(sent);
        assert_eq!(t.pinned().leading(Slot(0), &[0, 1, 2, 99]), 0);
        assert_eq!(
            t.load(Slot(0)).unreported_blocks,
            0,
            "finished before a report"
        );
        // Without memory in the report there is no memory term.
        t.report(Slot(0), report(at, 0, 2, None));
        assert_eq!(m.memory_wait_s(&t.load(Slot(0)), 1000, at), 0.0);
    }

    #[test]
    fn a_request_that_finishes_after_a_report_frees_its_blocks_at_once() {
        let memory = Memory {
            free_blocks: 0,
            used_blocks: 200,
            running: 2,
            remaining_decode_s: 0.5,
            ..Memory::default()
        };
        let (m, mut t, at) = (PrefillModel::default(), LoadTracker::new(), Instant::now());
        // Two requests of 100 blocks each (99 of prompt, 1 of output); the
        // second shares the first's 10 leading blocks.
        let own: Vec<u64> = (0..99).collect();
        let mut shared: Vec<u64> = (0..10).collect();
        shared.extend(1000..1089);
        let first = t.start_request(Slot(0), &own, (99 * 16, 0, 2), 16);
        let second = t.start_request(Slot(0), &shared, (99 * 16, 0, 2), 16);
        let reported = EngineLoad {
            memory: Some(memory),
            ..report(at, 0, 0, None)
        };
        t.report(Slot(0), reported);
        // 50 blocks wait for one of the two to finish: 2 × 0.5 s / 3.
        let wait = |t: &LoadTracker| m.memory_wait_s(&t.load(Slot(0)), 50, at);
        assert!((wait(&t) - 1.0 / 3.0).abs() < 1e-9);
        // The first finishes: the report still counts it, this router knows
        // better. Its 100 blocks are free but the 10 the second holds.
        t.finish(first);
        assert_eq!(t.load(Slot(0)).finished_since_report, (1, 90));
        assert_eq!(wait(&t), 0.0);
        assert!(m.memory_wait_s(&t.load(Slot(0)), 91, at) > 0.0);
        // A request sent after the report was never in it: it only stops
        // counting as unreported.
        let late = t.start_request(Slot(0), &[7], (16, 0, 2), 16);
        t.finish(late);
        assert_eq!(t.load(Slot(0)).finished_since_report, (1, 90));
        // The next report covers what finished.
        t.report(Slot(0), reported);
        assert_eq!(t.load(Slot(0)).finished_since_report, (0, 0));
        t.finish(second);
    }

    #[test]
    fn a_report_taken_before_a_request_does_not_uncount_it_twice() {
        let mut t = LoadTracker::new();
        let at = Instant::now();
        let mut before = t.start(Slot(0), 100, 100);
        t.report(Slot(0), report(at, 100, 1, None));
        let after = t.start(Slot(0), 300, 300);
        t.first_token(&mut before); // was in the report: unreported unchanged
        let load = t.load(Slot(0));
        assert_eq!(
            (load.unreported_prefill_tokens, load.unreported_requests),
            (300, 1)
        );
        t.finish(after);
        t.finish(before);
        let load = t.load(Slot(0));
        assert_eq!(
            (load.in_flight, load.prefill_tokens, load.active_tokens),
            (0, 0, 0)
        );
        assert_eq!(load.unreported_requests, 0);
    }

    #[test]
    fn a_pool_is_compared_at_the_median_of_its_reported_rates() {
        let m = PrefillModel::default();
        let at = Instant::now();
        let with = |rate: Option<f64>| Load {
            engine: Some(report(at, 0, 0, rate)),
            ..Load::default()
        };
        // Not measured, measured as nonsense, and no report at all: the
        // configured rate.
        let unmeasured = [
            with(None),
            with(Some(f64::NAN)),
            with(Some(0.0)),
            Load::default(),
        ];
        assert_eq!(m.pool_rate(&unmeasured), 10_000.0);
        assert_eq!(m.pool_rate(&[]), 10_000.0);
        // The median of those that report one; the others do not count.
        let odd = [
            with(Some(30_000.0)),
            with(None),
            with(Some(12_000.0)),
            with(Some(18_000.0)),
        ];
        assert_eq!(m.pool_rate(&odd), 18_000.0);
        let even = [
            with(Some(30_000.0)),
            with(Some(12_000.0)),
            with(Some(18_000.0)),
            with(Some(20_000.0)),
        ];
        assert_eq!(m.pool_rate(&even), 19_000.0);
        // Predictions at the pool's rate.
        let mut queued = with(Some(30_000.0));
        queued.engine.as_mut().unwrap().queued_prefill_tokens = Some(18_000);
        queued.engine.as_mut().unwrap().waiting = 1;
        assert!((m.queued_s_at(&queued, at, 18_000.0) - 1.02).abs() < 1e-9);
        assert!((m.queued_s(&queued, at) - 0.62).abs() < 1e-9);
        assert!((m.prefill_s_at(1800, 18_000.0) - 0.12).abs() < 1e-9);
    }

    #[test]
    fn prefill_models_are_checked() {
        assert!(PrefillModel::default().validate().is_ok());
        for (rate, overhead) in [(0.0, 20.0), (f64::NAN, 20.0), (1.0, -1.0)] {
            let m = PrefillModel {
                prefill_tokens_per_second: rate,
                prefill_overhead_ms: overhead,
                ..PrefillModel::default()
            };
            assert!(m.validate().is_err(), "{m:?}");
        }
    }
}
