//! Room kept for higher priorities: a running request cannot be taken
//! back from an engine, so while a priority has had requests in the last
//! `flowControl.reserveWindowMs`, a lower one is sent to an endpoint only
//! if that leaves room there for the largest request of any priority in
//! the window (its KV blocks and a seat: a priority's next request may be
//! larger than any it sent, as a conversation grows), and only if the
//! prefill it adds there ends within `holdAboveMs` (so the higher one's
//! prefill starts within it too; a longer one goes only where none is
//! queued, while another endpoint is left that can start a request within
//! it). A critical request then finds room without waiting for a flood's
//! requests to finish, at the cost of that room standing empty while the
//! higher priority is quiet (at most one request's blocks per endpoint)
//! and of long lower prefills waiting for a quiet endpoint. Pure: the
//! clock is passed in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The largest value seen over a sliding window, in two buckets: the
/// current one and the one before. A value is kept for one to two
/// windows; constant state.
#[derive(Clone, Copy, Debug)]
pub struct Largest {
    /// When the current bucket began.
    since: Instant,
    current: u64,
    previous: u64,
}

impl Largest {
    pub fn new(now: Instant) -> Self {
        Largest {
            since: now,
            current: 0,
            previous: 0,
        }
    }

    /// Moves the buckets on to `now`.
    fn roll(&mut self, now: Instant, window: Duration) {
        let age = now.saturating_duration_since(self.since);
        if age >= window {
            self.previous = if age >= 2 * window { 0 } else { self.current };
            self.current = 0;
            self.since = now;
        }
    }

    pub fn saw(&mut self, value: u64, now: Instant, window: Duration) {
        self.roll(now, window);
        self.current = self.current.max(value);
    }

    /// The largest in the last one to two windows, at `now`; `None` when
    /// nothing was seen.
    pub fn get(&self, now: Instant, window: Duration) -> Option<u64> {
        let mut at = *self;
        at.roll(now, window);
        Some(at.current.max(at.previous)).filter(|&v| v > 0)
    }
}

/// When each priority last had a request, and the largest request of any
/// priority. Priorities come from the configured objectives (or 0), so it
/// holds a few entries.
#[derive(Debug)]
pub struct Reserve {
    window: Duration,
    last: BTreeMap<i32, Instant>,
    any: Largest,
}

impl Reserve {
    /// Room kept over `window` (zero: none).
    pub fn new(window: Duration, now: Instant) -> Self {
        Reserve {
            window,
            last: BTreeMap::new(),
            any: Largest::new(now),
        }
    }

    /// A request of `priority` taking `blocks` arrived at `now`.
    pub fn saw(&mut self, priority: i32, blocks: u64, now: Instant) {
        if self.window.is_zero() {
            return;
        }
        self.last.insert(priority, now);
        self.any.saw(blocks.max(1), now, self.window);
    }

    /// The largest request of any priority in the window, at `now`.
    pub fn any(&self, now: Instant) -> u64 {
        self.any.get(now, self.window).unwrap_or(0)
    }

    /// Blocks a request of `priority` must leave free where it goes, at
    /// `now`: the largest request of any priority, while a higher priority
    /// has had a request in the window; `None` otherwise.
    pub fn for_priority(&self, priority: i32, now: Instant) -> Option<u64> {
        let higher = self.last.range(priority.saturating_add(1)..);
        let active = higher
            .into_iter()
            .any(|(_, &t)| now.saturating_duration_since(t) <= self.window);
        active.then(|| self.any(now)).filter(|&b| b > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_priorities_leave_room_for_the_largest_recent_request() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut r = Reserve::new(s(10), t0);
        assert_eq!(r.for_priority(0, t0), None);
        r.saw(0, 150, t0);
        assert_eq!(r.for_priority(0, t0), None, "nothing above 0");
        r.saw(10, 40, t0 + s(1));
        r.saw(5, 30, t0 + s(1));
        // The next request of a priority may be larger than any it sent:
        // the room is the largest of any.
        assert_eq!(r.for_priority(0, t0 + s(2)), Some(150));
        assert_eq!(r.for_priority(5, t0 + s(2)), Some(150));
        assert_eq!(r.for_priority(10, t0 + s(2)), None, "nothing above 10");
        // Priority 10 quiet for a window: 5 keeps no room for it; 0 keeps
        // room for 5, the largest of one to two windows.
        r.saw(5, 20, t0 + s(11));
        assert_eq!(r.for_priority(5, t0 + s(12)), None);
        assert_eq!(r.for_priority(0, t0 + s(12)), Some(150));
        assert_eq!(r.for_priority(0, t0 + s(21)), Some(20));
        assert_eq!(r.for_priority(0, t0 + s(22)), None, "5 quiet too");
        assert_eq!(r.for_priority(-1, t0 + s(60)), None, "all quiet");
    }

    #[test]
    fn the_largest_is_kept_one_to_two_windows() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let w = s(10);
        let mut l = Largest::new(t0);
        assert_eq!(l.get(t0, w), None);
        l.saw(50, t0 + s(9), w);
        l.saw(10, t0 + s(12), w);
        assert_eq!(l.get(t0 + s(12), w), Some(50), "one window on");
        assert_eq!(l.get(t0 + s(22), w), Some(10), "two windows on");
        assert_eq!(l.get(t0 + s(40), w), None);
    }

    #[test]
    fn a_zero_window_keeps_no_room() {
        let t0 = Instant::now();
        let mut r = Reserve::new(Duration::ZERO, t0);
        r.saw(10, 40, t0);
        assert_eq!(r.for_priority(0, t0), None);
    }
}
