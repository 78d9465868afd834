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
//!    milliseconds.
//! 2. An engine that supports the check (engine-sim does; vLLM ignores the
//!    header, and nothing changes) compares it with its own wait at
//!    arrival. Longer: it answers `503` at once, with its queue in
//!    [`QUEUED_TOKENS_HEADER`] and [`WAITING_HEADER`], and does no work.
//! 3. The router takes those as a fresh load report of that endpoint
//!    ([`Load::refused`]) and decides again, at most [`MAX_REFUSALS`] times
//!    per request; an endpoint that refused once is not asked to check
//!    again for that request, so the check never turns a request away.
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
/// Refusal header: prompt tokens the engine has still to prefill.
pub const QUEUED_TOKENS_HEADER: &str = "x-kvroute-queued-prefill-tokens";
/// Refusal header: requests waiting to be scheduled.
pub const WAITING_HEADER: &str = "x-kvroute-waiting";
/// Refusals one request takes before it is sent without a bound.
pub const MAX_REFUSALS: usize = 3;

/// What a refusing engine says of its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Prompt tokens it has still to prefill.
    pub queued_prefill_tokens: u64,
    /// Requests waiting to be scheduled.
    pub waiting: u32,
}

impl Refusal {
    /// Reads a refusal from its two header values; `None` unless both are
    /// plain numbers (then the answer is an ordinary 503).
    pub fn parse(queued: &str, waiting: &str) -> Option<Self> {
        Some(Refusal {
            queued_prefill_tokens: queued.trim().parse().ok()?,
            waiting: waiting.trim().parse().ok()?,
        })
    }
}

impl Refusal {
    /// What an engine whose load is `report` says when it refuses.
    pub fn of(report: &EngineLoad) -> Self {
        Refusal {
            queued_prefill_tokens: report.queued_prefill_tokens.unwrap_or(0),
            waiting: report.waiting,
        }
    }
}

/// Whether an engine whose request would wait `wait_s` before its prefill
/// starts refuses one that asked to start within `bound_ms`.
pub fn refuses(bound_ms: u64, wait_s: f64) -> bool {
    wait_s * 1000.0 > bound_ms as f64
}

/// An engine's check of a request that asked to start within `bound_ms`,
/// against its own `report` taken at that moment (`engine_wait_s`): the
/// refusal to answer with, or `None` to admit it.
pub fn check(bound_ms: u64, report: EngineLoad, overhead_ms: f64) -> Option<Refusal> {
    let wait = engine_wait_s(report, overhead_ms);
    refuses(bound_ms, wait).then(|| Refusal::of(&report))
}

/// The header value for a bound of `bound_s` seconds: whole milliseconds,
/// rounded up (a bound never shrinks on the wire).
pub fn bound_ms(bound_s: f64) -> u64 {
    (bound_s.max(0.0) * 1000.0).ceil().min(u64::MAX as f64) as u64
}

/// The wait before prefill an engine predicts for a new request from its
/// own `report`, taken at the moment it checks: its queued prefill at its
/// rate plus `overhead_ms` per waiting request, or the wait for KV memory
/// of the requests ahead, whichever is longer. It leaves out the request's
/// own blocks, which the router counts, so it refuses a little less often
/// than the router's own figures would.
fn engine_wait_s(report: EngineLoad, overhead_ms: f64) -> f64 {
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
        .max(model.memory_wait_s(&load, 0, now))
}

impl Load {
    /// Takes an engine's refusal at `now` as its fresh load report: its
    /// queue as it said, and none of this router's requests unreported (it
    /// saw them all). An endpoint whose engine never reported keeps
    /// counting on this router's own figures, with the refusal's queue in
    /// a report of its own.
    pub fn refused(&mut self, refusal: Refusal, now: Instant) {
        let engine = self.engine.get_or_insert(EngineLoad {
            waiting: 0,
            running: 0,
            kv_usage: 0.0,
            queued_prefill_tokens: None,
            prefill_tokens_per_s: None,
            memory: None,
            reported_at: now,
        });
        engine.queued_prefill_tokens = Some(refusal.queued_prefill_tokens);
        engine.waiting = refusal.waiting;
        engine.reported_at = now;
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
    use crate::load::PrefillModel;

    #[test]
    fn refusal_headers_are_plain_numbers() {
        assert_eq!(
            Refusal::parse("1200", " 3"),
            Some(Refusal {
                queued_prefill_tokens: 1200,
                waiting: 3
            })
        );
        assert_eq!(Refusal::parse("-1", "3"), None);
        assert_eq!(Refusal::parse("12", "x"), None);
    }

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
        load.refused(
            Refusal {
                queued_prefill_tokens: 10_000,
                waiting: 1,
            },
            now,
        );
        // The engine's word: 1 s of tokens and one request waiting.
        assert!((model.queued_s_at(&load, now, 10_000.0) - 1.02).abs() < 1e-9);
        assert_eq!(load.unreported_requests, 0);
        // It ages like any report.
        let later = now + Duration::from_millis(500);
        assert!((model.queued_s_at(&load, later, 10_000.0) - 0.52).abs() < 1e-9);
    }
}
