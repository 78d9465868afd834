//! Reconnecting to a server that went away, shared by the router's
//! long-lived gRPC subscriptions (WatchCache to each engine, WatchPool to
//! the operator): the jittered exponential [`Backoff`] between attempts,
//! and [`error_chain`] to say why an attempt failed.
//!
//! Not here: the subscriptions themselves, or deciding when a stream is
//! broken (`pool::cache_watch` and `discovery::operator` do).

use std::time::{Duration, SystemTime};

use kvroute_core::rng::SplitMix64;

/// Ceiling of the first reconnect delay.
pub const BACKOFF_BASE: Duration = Duration::from_millis(100);
/// Largest reconnect delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A stream that stayed up this long resets the backoff.
pub const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(30);

/// The delay before reconnect attempt `attempt` (0 for the first): "full
/// jitter", uniform in `[0, min(BACKOFF_MAX, BACKOFF_BASE × 2^attempt)]`,
/// with `random` a uniformly random `u64`. Pure, for tests.
pub fn backoff(attempt: u32, random: u64) -> Duration {
    let base = BACKOFF_BASE.as_nanos() as u64;
    let max = BACKOFF_MAX.as_nanos() as u64;
    let ceiling = base.saturating_mul(1u64 << attempt.min(32)).min(max);
    // Multiply-high maps `random` onto [0, ceiling] without modulo bias
    // worth speaking of.
    let nanos = ((u128::from(random) * (u128::from(ceiling) + 1)) >> 64) as u64;
    Duration::from_nanos(nanos)
}

/// Reconnect delays for one stream: [`backoff`] driven by a [`SplitMix64`]
/// seeded per stream, so that many routers (or watchers) losing the same
/// server do not retry in lockstep.
#[derive(Clone, Debug)]
pub struct Backoff {
    attempt: u32,
    rng: SplitMix64,
}

impl Backoff {
    /// A backoff seeded from `seed` (the endpoint name or URL) and the
    /// clock.
    pub fn new(seed: &str) -> Self {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Backoff {
            attempt: 0,
            rng: SplitMix64::new(xxhash_rust::xxh3::xxh3_64(seed.as_bytes()) ^ now),
        }
    }

    /// The delay before the next attempt; each call doubles the ceiling.
    pub fn next_delay(&mut self) -> Duration {
        let delay = backoff(self.attempt, self.rng.next_u64());
        self.attempt = self.attempt.saturating_add(1);
        delay
    }

    /// Starts over from [`BACKOFF_BASE`] (the connection had been healthy).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// `e` and its sources, as tonic's transport errors hide the useful part
/// (connection refused, timed out) in their source.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_ceiling_doubles_from_base_to_max() {
        assert_eq!(backoff(0, u64::MAX), Duration::from_millis(100));
        assert_eq!(backoff(1, u64::MAX), Duration::from_millis(200));
        assert_eq!(backoff(3, u64::MAX), Duration::from_millis(800));
        assert_eq!(backoff(7, u64::MAX), BACKOFF_MAX);
        assert_eq!(backoff(1000, u64::MAX), BACKOFF_MAX);
    }

    #[test]
    fn backoff_is_full_jitter() {
        assert_eq!(backoff(5, 0), Duration::ZERO);
        let half = backoff(0, u64::MAX / 2);
        assert!(
            half > Duration::from_millis(49) && half < Duration::from_millis(51),
            "{half:?}"
        );
    }

    #[test]
    fn backoff_delays_spread_and_stay_under_the_ceiling() {
        let mut b = Backoff::new("sim-0");
        let delays: Vec<Duration> = (0..200).map(|_| b.next_delay()).collect();
        assert!(delays[0] <= BACKOFF_BASE);
        assert!(delays.iter().all(|d| *d <= BACKOFF_MAX));
        // Late attempts are spread over [0, 10 s], not all equal.
        let late = &delays[20..];
        assert!(late.iter().any(|d| *d < Duration::from_secs(5)));
        assert!(late.iter().any(|d| *d > Duration::from_secs(5)));
    }

    #[test]
    fn backoff_reset_starts_over() {
        let mut b = Backoff::new("sim-0");
        for _ in 0..10 {
            b.next_delay();
        }
        b.reset();
        assert!(b.next_delay() <= BACKOFF_BASE);
    }

    #[test]
    fn backoffs_of_different_streams_differ() {
        let (mut a, mut b) = (Backoff::new("sim-0"), Backoff::new("sim-1"));
        let a: Vec<Duration> = (0..8).map(|_| a.next_delay()).collect();
        let b: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
        assert_ne!(a, b);
    }
}
