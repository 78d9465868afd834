//! Admission checks: the engine, not a stale report, has the last word on
//! its queue.
//!
//! Router replicas see the same engine reports, a report's age late, and
//! none of each other's sends. When requests come in bursts (a batch job,
//! agents fanning out, retries after an incident), every replica sends its
//! share of the burst to the endpoint that looked fastest, and they queue
//! behind each other there. Nothing a replica knows tells it what the
//! others just sent: keys spread cold requests by rendezvous, but requests
//! that arrive at once still collide on it as often as random picks do.
//! The engine is the one place that sees them all, in order, so:
//!
//! 1. With each attempt the router sends [`ADMIT_WITHIN_HEADER`]: the wait
//!    before prefill it predicted there, plus the policy's tolerance, in
//!    milliseconds; and, when flow control keeps room there for others,
//!    [`ROOM_HEADER`]: the blocks the request must leave free.
//! 2. An engine that supports the check (engine-sim does; vLLM ignores the
//!    header, and nothing changes) compares it with its own wait at
//!    arrival, counting the blocks the request takes from its free pool
//!    and the room it must leave.
//!    Longer: it answers `503` at once, with its load report in
//!    [`LOAD_HEADER`], and does no work.
//! 3. The router takes that as a fresh load report of that endpoint
//!    ([`Load::refused`]): its queue and its KV memory, every replica's
//!    sends in them. It decides again, at most [`MAX_REFUSALS`] times per
//!    request; an endpoint that refused once is not asked to check again
//!    for that request, so the check never turns a request away.
//!
//! A refusal costs one round trip to the engine; a collision costs the
//! prefill of the request ahead. Engines keep no state for it and routers
//! never talk to each other: it stays coordination-free.
//!
//! Not here: the headers on the wire (the router and engine-sim) and what
//! a policy predicts ([`crate::policy::Policy::admit_within`]).

use std::time::Instant;

use crate::load::{EngineLoad, Load, PrefillModel};

/// Request header: refuse this request unless its prefill can start within
/// this many milliseconds.
pub const ADMIT_WITHIN_HEADER: &str = "x-kvroute-admit-within-ms";
/// Request header, sent beside [`ADMIT_WITHIN_HEADER`]: the KV blocks the
/// request must leave free, beyond its own, when it starts (flow
/// control's room for a higher priority or a lighter tenant). The engine
/// counts them with the request's blocks in its check, so a request
/// another replica sent into the same room is refused, not admitted.
pub const ROOM_HEADER: &str = "x-kvroute-admit-room-blocks";
/// Refusal header: the engine's load at that moment, a
/// `kvroute.v1.LoadReport` as WatchCache sends it, in protobuf, base64
/// (standard alphabet, padded).
pub const LOAD_HEADER: &str = "x-kvroute-load";
/// Refusals one request takes before it is sent without a bound.
pub const MAX_REFUSALS: usize = 3;

/// Whether an engine whose request would wait `wait_s` before its prefill
/// starts refuses one that asked to start within `bound_ms`.
pub fn refuses(bound_ms: u64, wait_s: f64) -> bool {
    wait_s * 1000.0 > bound_ms as f64
}

/// An engine's check of a request that asked to start within `bound_ms`
/// and takes `blocks` KV blocks from its free pool, against its own
/// `report` taken at that moment (`engine_wait_s`): whether it admits it.
pub fn admits(bound_ms: u64, report: EngineLoad, overhead_ms: f64, blocks: u64) -> bool {
    !refuses(bound_ms, engine_wait_s(report, overhead_ms, blocks))
}

/// The header value for a bound of `bound_s` seconds: whole milliseconds,
/// rounded up (a bound never shrinks on the wire).
pub fn bound_ms(bound_s: f64) -> u64 {
    (bound_s.max(0.0) * 1000.0).ceil().min(u64::MAX as f64) as u64
}

/// The wait before prefill an engine predicts for a new request that
/// takes `blocks` from its free pool, from its own `report` taken at the
/// moment it checks: its queued prefill at its rate plus `overhead_ms` per
/// waiting request, or the wait for a seat and KV memory behind the
/// requests ahead, whichever is longer. The router predicts the same from
/// a report and its own sends; the engine sees every router's.
fn engine_wait_s(report: EngineLoad, overhead_ms: f64, blocks: u64) -> f64 {
    let model = PrefillModel {
        prefill_overhead_ms: overhead_ms,
        ..PrefillModel::default()
    };
    let now = report.reported_at;
    let load = Load {
        engine: Some(report),
        ..Load::default()
    };
    let rate = model.rate(&load);
    model
        .queued_s_at(&load, now, rate)
        .max(model.memory_wait_s(&load, blocks, now))
}

impl Load {
    /// Takes an engine's refusal at `now`: the load it answered with is
    /// its fresh report, covering every request this router sent there so
    /// far (it saw them all).
    pub fn refused(&mut self, report: EngineLoad, now: Instant) {
        self.engine = Some(EngineLoad {
            reported_at: now,
            ..report
        });
        self.unreported_prefill_tokens = 0;
        self.unreported_requests = 0;
        self.unreported_blocks = 0;
        self.finished_since_report = (0, 0);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::load::{Memory, PrefillModel};

    #[test]
    fn a_bound_is_whole_milliseconds_rounded_up() {
        assert_eq!(bound_ms(0.0501), 51);
        assert_eq!(bound_ms(-1.0), 0);
        assert_eq!(bound_ms(f64::INFINITY), u64::MAX);
        assert!(refuses(50, 0.051));
        assert!(!refuses(50, 0.050));
    }

    #[test]
    fn a_refusal_is_a_fresh_report_covering_this_routers_sends() {
        let t0 = Instant::now();
        let model = PrefillModel::default();
        let mut load = Load {
            in_flight: 2,
            prefill_tokens: 4000,
            unreported_prefill_tokens: 4000,
            unreported_requests: 2,
            ..Load::default()
        };
        let now = t0 + Duration::from_secs(5);
        // The router's own count: 4,000 tokens and 2 overheads.
        assert!((model.queued_s_at(&load, now, 10_000.0) - 0.44).abs() < 1e-9);
        load.refused(report(10_000, 1, None, t0), now);
        // The engine's word: 1 s of tokens and one request waiting.
        assert!((model.queued_s_at(&load, now, 10_000.0) - 1.02).abs() < 1e-9);
        assert_eq!(load.unreported_requests, 0);
        // It ages like any report.
        let later = now + Duration::from_millis(500);
        assert!((model.queued_s_at(&load, later, 10_000.0) - 0.52).abs() < 1e-9);
    }

    /// A report with `queued` tokens, `waiting` requests and `memory`,
    /// taken at `at`.
    fn report(queued: u64, waiting: u32, memory: Option<Memory>, at: Instant) -> EngineLoad {
        EngineLoad {
            waiting,
            running: 1,
            kv_usage: 0.5,
            queued_prefill_tokens: Some(queued),
            prefill_tokens_per_s: None,
            memory,
            reported_at: at,
        }
    }

    /// One request running that holds 200 of 256 blocks and decodes for
    /// another 0.5 s.
    fn busy() -> Memory {
        Memory {
            free_blocks: 56,
            used_blocks: 200,
            remaining_decode_s: 0.5,
            running: 1,
            ..Memory::default()
        }
    }

    #[test]
    fn the_check_counts_the_blocks_the_request_takes() {
        let now = Instant::now();
        let engine = report(0, 0, Some(busy()), now);
        // 56 blocks fit; 57 wait for the running request to finish, in
        // 0.5 s.
        assert!(admits(50, engine, 0.0, 56));
        assert!(!admits(50, engine, 0.0, 57));
        assert!(admits(600, engine, 0.0, 57));
    }

    #[test]
    fn a_refusal_brings_the_engines_memory() {
        let t0 = Instant::now();
        let model = PrefillModel::default();
        // The router's last report saw the pool empty.
        let mut load = Load {
            engine: Some(report(0, 0, Some(Memory::default()), t0)),
            ..Load::default()
        };
        let now = t0 + Duration::from_millis(100);
        assert_eq!(model.memory_wait_s(&load, 100, now), 0.0);
        // Another replica's request runs there now: the refusal says so.
        load.refused(report(0, 0, Some(busy()), t0), now);
        assert!((model.memory_wait_s(&load, 100, now) - 0.5).abs() < 1e-9);
    }
}
