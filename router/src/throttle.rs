//! Rate limits for warnings that repeat once per request: a failing
//! engine must not turn every request into a log line. A pure type with
//! no clock (`now` is passed in) and no I/O.
//!
//! The rule: for each key (an endpoint and a reason), the first occurrence
//! is logged; further ones within `interval` of the last logged line are
//! counted, not logged; the next occurrence after the interval is logged
//! with the count of those it stood for. So a key writes at most one line
//! per interval, and no occurrence goes uncounted.
//!
//! Memory: one entry (the key and two words) per key seen in the last
//! interval, at most [`MAX_KEYS`]; keys come from the endpoint set and a
//! fixed list of reasons, so the bound is never reached in practice. Past
//! it, stale entries are dropped, then new keys are logged unthrottled.

use std::collections::HashMap;
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
pub struct Throttle {
    interval: Duration,
    entries: HashMap<(String, &'static str), Entry>,
}

impl Throttle {
    /// At most one line per key per `interval`.
    pub fn new(interval: Duration) -> Self {
        Throttle {
            interval,
            entries: HashMap::new(),
        }
    }

    /// An occurrence of `reason` at `endpoint` at `now`: `Some(n)` to log
    /// it as standing for `n` occurrences (itself and those suppressed
    /// since the last line), `None` to count it silently.
    pub fn admit(&mut self, endpoint: &str, reason: &'static str, now: Instant) -> Option<u64> {
        let key = (endpoint.to_owned(), reason);
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

impl Default for Throttle {
    fn default() -> Self {
        Throttle::new(INTERVAL)
    }
}

/// A [`Throttle`] shared by the request path, on tokio's clock (so tests
/// can pause it).
#[derive(Debug, Default)]
pub struct Warnings(std::sync::Mutex<Throttle>);

impl Warnings {
    /// See [`Throttle::admit`].
    pub fn admit(&self, endpoint: &str, reason: &'static str) -> Option<u64> {
        let now = tokio::time::Instant::now().into_std();
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(endpoint, reason, now)
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
        assert_eq!(t.admit("a", "status", t0), Some(1));
        for i in 1..=99 {
            assert_eq!(t.admit("a", "status", t0 + i * S / 10), None);
        }
        // Other keys are independent.
        assert_eq!(t.admit("a", "timeout", t0 + S), Some(1));
        assert_eq!(t.admit("b", "status", t0 + S), Some(1));
        // After the interval: one line standing for itself and the 99.
        assert_eq!(t.admit("a", "status", t0 + 10 * S), Some(100));
        assert_eq!(t.admit("a", "status", t0 + 11 * S), None);
        assert_eq!(t.admit("a", "status", t0 + 100 * S), Some(2));
    }

    #[test]
    fn memory_is_bounded() {
        let t0 = Instant::now();
        let mut t = Throttle::new(10 * S);
        for i in 0..MAX_KEYS + 10 {
            assert_eq!(t.admit(&format!("e{i}"), "status", t0), Some(1));
        }
        assert!(t.entries.len() <= MAX_KEYS);
        // Once the interval passed, stale keys make room.
        assert_eq!(t.admit("new", "status", t0 + 10 * S), Some(1));
        assert_eq!(t.entries.len(), 1);
        assert_eq!(t.admit("new", "status", t0 + 11 * S), None);
    }

    #[tokio::test(start_paused = true)]
    async fn warnings_follow_the_paused_clock() {
        let w = Warnings::default();
        assert_eq!(w.admit("a", "status"), Some(1));
        assert_eq!(w.admit("a", "status"), None);
        tokio::time::advance(INTERVAL).await;
        assert_eq!(w.admit("a", "status"), Some(2));
    }
}
