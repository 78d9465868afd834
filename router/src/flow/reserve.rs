//! Room kept for higher priorities: a running request cannot be taken
//! back from an engine, so while a priority has had requests in the last
//! `flowControl.reserveWindowMs`, a lower one is sent to an endpoint only
//! if that leaves room there for the largest request the higher one had in
//! the window (its KV blocks and a seat). A critical request then finds
//! room without waiting for a flood's requests to finish, at the cost of
//! that room standing empty while the higher priority is quiet (at most
//! one such request's blocks per endpoint). Pure: the clock is passed in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The largest recent request per priority. Priorities come from the
/// configured objectives (or 0), so it holds a few entries.
#[derive(Debug)]
pub struct Reserve {
    window: Duration,
    largest: BTreeMap<i32, (Instant, u64)>,
}

impl Reserve {
    /// Room kept over `window` (zero: none).
    pub fn new(window: Duration) -> Self {
        Reserve {
            window,
            largest: BTreeMap::new(),
        }
    }

    /// A request of `priority` taking `blocks` arrived at `now`. Kept: the
    /// largest, until it leaves the window (then the next one to arrive,
    /// whatever its size: an approximation that needs one entry).
    pub fn saw(&mut self, priority: i32, blocks: u64, now: Instant) {
        if self.window.is_zero() {
            return;
        }
        let entry = self.largest.entry(priority).or_insert((now, blocks));
        if blocks >= entry.1 || now.saturating_duration_since(entry.0) > self.window {
            *entry = (now, blocks);
        }
    }

    /// Blocks a request of `priority` must leave free where it goes, at
    /// `now`: the largest request of a higher priority in the window;
    /// `None` when none had any.
    pub fn for_priority(&self, priority: i32, now: Instant) -> Option<u64> {
        (self.largest.range(priority.saturating_add(1)..))
            .filter(|(_, (at, _))| now.saturating_duration_since(*at) <= self.window)
            .map(|(_, &(_, blocks))| blocks)
            .max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_priorities_leave_room_for_the_largest_recent_higher_request() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut r = Reserve::new(s(10));
        assert_eq!(r.for_priority(0, t0), None);
        r.saw(10, 40, t0);
        r.saw(10, 20, t0 + s(1));
        r.saw(5, 90, t0 + s(1));
        assert_eq!(r.for_priority(0, t0 + s(2)), Some(90));
        assert_eq!(r.for_priority(5, t0 + s(2)), Some(40));
        assert_eq!(r.for_priority(10, t0 + s(2)), None, "nothing above 10");
        // The largest ages out of the window: a smaller one replaces it.
        assert_eq!(r.for_priority(5, t0 + s(11)), None);
        r.saw(10, 20, t0 + s(12));
        assert_eq!(r.for_priority(5, t0 + s(12)), Some(20));
        assert_eq!(r.for_priority(-1, t0 + s(30)), None, "all quiet");
    }

    #[test]
    fn a_zero_window_keeps_no_room() {
        let t0 = Instant::now();
        let mut r = Reserve::new(Duration::ZERO);
        r.saw(10, 40, t0);
        assert_eq!(r.for_priority(0, t0), None);
    }
}
