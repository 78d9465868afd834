//! Slow start: the share of new keys an endpoint takes while it ramps up
//! after becoming ready, as a rendezvous weight ([`weight`]).
//!
//! 1. An endpoint ready for `elapsed` of a `window` has weight
//!    `max(elapsed / window, MIN_WEIGHT)`, and 1 from the end of the window
//!    on (and always when the window is 0: slow start off). It is first for
//!    about `w / Σw` of cold keys ([`crate::rendezvous::weighted_score`]),
//!    so a pool of N at 1 gives it `w / (N + w)` of them: nothing like a
//!    burst onto an empty cache and a cold engine.
//! 2. The weight is never 0: a ramping endpoint still has a place in every
//!    ranking (the retry order, and the choice when it is the only one), and
//!    two ramping endpoints are still ordered by the key, not by the order
//!    they are listed in.
//! 3. An endpoint whose ready time is in the future (a clock ahead of this
//!    one) is at the start of its ramp.
//!
//! Only cold keys and ties are shaped: warm prefixes stay with the
//! endpoints holding them, whatever their weight. This module has no clock:
//! the caller says how long the endpoint has been ready.

use std::time::Duration;

/// The weight of an endpoint that has just become ready: small, not 0
/// (rule 2).
pub const MIN_WEIGHT: f64 = 0.01;

/// The default window: 30 s.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(30);

/// The longest window a configuration may set: an hour.
pub const MAX_WINDOW_SECONDS: u32 = 3600;

/// The rendezvous weight of an endpoint ready for `elapsed` (`None`: ready
/// since before anyone can tell, so not ramping) with a ramp of `window`.
pub fn weight(elapsed: Option<Duration>, window: Duration) -> f64 {
    match elapsed {
        Some(e) if e < window => (e.as_secs_f64() / window.as_secs_f64()).max(MIN_WEIGHT),
        _ => 1.0,
    }
}

/// How long an endpoint ready since `ready_since_ms` (Unix milliseconds)
/// has been ready at `now_ms`; zero when the ready time is ahead of
/// `now_ms` (rule 3).
pub fn ready_for(ready_since_ms: i64, now_ms: i64) -> Duration {
    Duration::from_millis(now_ms.saturating_sub(ready_since_ms).max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_ramps_linearly_from_the_floor_to_one() {
        let w = Duration::from_secs(30);
        assert_eq!(weight(Some(Duration::ZERO), w), MIN_WEIGHT);
        assert_eq!(weight(Some(Duration::from_secs(15)), w), 0.5);
        assert_eq!(weight(Some(Duration::from_secs(30)), w), 1.0);
        assert_eq!(weight(Some(Duration::from_secs(3000)), w), 1.0);
        assert_eq!(weight(None, w), 1.0, "no ready time: not ramping");
        assert_eq!(weight(Some(Duration::ZERO), Duration::ZERO), 1.0, "off");
    }

    #[test]
    fn a_ready_time_ahead_of_the_clock_is_the_start_of_the_ramp() {
        assert_eq!(ready_for(10_000, 4_000), Duration::ZERO);
        assert_eq!(ready_for(1_000, 4_500), Duration::from_millis(3_500));
    }
}
