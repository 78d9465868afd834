//! Rate limits for log lines that repeat with what a peer controls: a
//! failing engine must not turn every request into a log line, nor a
//! misbehaving publisher every message. A pure type with no clock (`now`
//! is passed in) and no I/O, shared by the router and the agent.
//!
//! The rule: for each key (e.g. an endpoint and a reason), the first occurrence
//! is logged; further ones within `interval` of the last logged line are
//! counted, not logged; the next occurrence after the interval is logged
//! with the count of those it stood for. So a key writes at most one line
//! per interval, and no occurrence goes uncounted.
//!
//! Memory: one entry (the key and two words) per key seen in the last
//! interval, at most [`MAX_KEYS`]; callers' keys come from bounded sets
//! (endpoints, ranks, fixed reasons), so the bound is never reached in
//! practice. Past it, stale entries are dropped, then new keys are logged
//! unthrottled.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// The most keys remembered.
pub const MAX_KEYS: usize = 4096;

/// How often each key may log, by default.
pub const INTERVAL: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug)]
struct Entry {
    logged: Instant,
    suppressed: u64,
}

/// See the module docs.
#[derive(Clone, Debug)]
pub struct Throttle<K> {
    interval: Duration,
    entries: HashMap<K, Entry>,
}

impl<K: Hash + Eq> Throttle<K> {
    /// At most one line per key per `interval`.
    pub fn new(interval: Duration) -> Self {
        Throttle {
            interval,
            entries: HashMap::new(),
        }
    }

    /// An occurrence of `key` at `now`: `Some(n)` to log it as standing
    /// for `n` occurrences (itself and those suppressed since the last
    /// line), `None` to count it silently.
    pub fn admit(&mut self, key: K, now: Instant) -> Option<u64> {
        if let Some(e) = self.entries.get_mut(&key) {
            if now.saturating_duration_since(e.logged) < self.interval {
                e.suppressed += 1;
                return None;
            }
            let n = e.suppressed + 1;
            *e = Entry {
                logged: now,
                suppressed: 0,
            };
            return Some(n);
        }
        if self.entries.len() >= MAX_KEYS {
            let interval = self.interval;
            self.entries
                .retain(|_, e| now.saturating_duration_since(e.logged) < interval);
            if self.entries.len() >= MAX_KEYS {
                return Some(1);
            }
        }
        self.entries.insert(
            key,
            Entry {
                logged: now,
                suppressed: 0,
            },
        );
        Some(1)
    }
}

impl<K: Hash + Eq> Default for Throttle<K> {
    fn default() -> Self {
        Throttle::new(INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn one_line_per_key_per_interval_with_the_count() {
        let t0 = Instant::now();
        let mut t = Throttle::new(10 * S);
        assert_eq!(t.admit(("a", "status"), t0), Some(1));
        for i in 1..=99 {
            assert_eq!(t.admit(("a", "status"), t0 + i * S / 10), None);
        }
        // Other keys are independent.
        assert_eq!(t.admit(("a", "timeout"), t0 + S), Some(1));
        assert_eq!(t.admit(("b", "status"), t0 + S), Some(1));
        // After the interval: one line standing for itself and the 99.
        assert_eq!(t.admit(("a", "status"), t0 + 10 * S), Some(100));
        assert_eq!(t.admit(("a", "status"), t0 + 11 * S), None);
        assert_eq!(t.admit(("a", "status"), t0 + 100 * S), Some(2));
    }

    #[test]
    fn memory_is_bounded() {
        let t0 = Instant::now();
        let mut t = Throttle::new(10 * S);
        for i in 0..MAX_KEYS + 10 {
            assert_eq!(t.admit(i, t0), Some(1));
        }
        assert!(t.entries.len() <= MAX_KEYS);
        // Once the interval passed, stale keys make room.
        let new = MAX_KEYS + 10;
        assert_eq!(t.admit(new, t0 + 10 * S), Some(1));
        assert_eq!(t.entries.len(), 1);
        assert_eq!(t.admit(new, t0 + 11 * S), None);
    }
}
