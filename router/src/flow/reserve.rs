//! Room kept for higher priorities: a running request cannot be taken
//! back from an engine, so while a priority has had requests in the last
//! `flowControl.reserveWindowMs`, a lower one is sent to an endpoint only
//! if that leaves room there for the largest request the higher one had in
//! the window (its KV blocks and a seat), and only if the prefill it adds
//! there ends within `holdAboveMs` (so the higher one's prefill starts
//! within it too). A critical request then finds room without waiting for
//! a flood's requests to finish, at the cost of that room standing empty
//! while the higher priority is quiet (at most one such request's blocks
//! per endpoint) and of the longest lower prefills waiting for a quiet
//! endpoint. In its first window after a quiet spell a priority has not
//! yet shown its sizes: the room kept for it is then at least the largest
//! request of any priority in the window. Pure: the clock is passed in.

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

/// A priority's or a flow's recent requests: the largest, and since when
/// it has been active (it is new for its first window after a quiet
/// spell, before it has shown its sizes).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    largest: Largest,
    since: Instant,
}

impl Sizes {
    pub fn new(now: Instant) -> Self {
        Sizes {
            largest: Largest::new(now),
            since: now,
        }
    }

    pub fn saw(&mut self, blocks: u64, now: Instant, window: Duration) {
        if !self.recent(now, window) {
            self.since = now;
        }
        self.largest.saw(blocks.max(1), now, window);
    }

    /// Whether it had a request in the last one to two windows.
    pub fn recent(&self, now: Instant, window: Duration) -> bool {
        self.largest.get(now, window).is_some()
    }

    /// The room to keep for it at `now`: its largest request in the
    /// window, and while it is new at least `any` (the largest of any);
    /// `None` when it had none.
    pub fn room(&self, now: Instant, window: Duration, any: u64) -> Option<u64> {
        let own = self.largest.get(now, window)?;
        let new = now.saturating_duration_since(self.since) < window;
        Some(if new { own.max(any) } else { own })
    }
}

/// The largest recent request per priority, and of any. Priorities come
/// from the configured objectives (or 0), so it holds a few entries.
#[derive(Debug)]
pub struct Reserve {
    window: Duration,
    largest: BTreeMap<i32, Sizes>,
    any: Largest,
}

impl Reserve {
    /// Room kept over `window` (zero: none).
    pub fn new(window: Duration, now: Instant) -> Self {
        Reserve {
            window,
            largest: BTreeMap::new(),
            any: Largest::new(now),
        }
    }

    /// A request of `priority` taking `blocks` arrived at `now`.
    pub fn saw(&mut self, priority: i32, blocks: u64, now: Instant) {
        if self.window.is_zero() {
            return;
        }
        let sizes = self.largest.entry(priority).or_insert(Sizes::new(now));
        sizes.saw(blocks, now, self.window);
        self.any.saw(blocks.max(1), now, self.window);
    }

    /// The largest request of any priority in the window, at `now`.
    pub fn any(&self, now: Instant) -> u64 {
        self.any.get(now, self.window).unwrap_or(0)
    }

    /// Blocks a request of `priority` must leave free where it goes, at
    /// `now`: the room a higher priority's [`Sizes`] keeps; `None` when
    /// none had any request in the window.
    pub fn for_priority(&self, priority: i32, now: Instant) -> Option<u64> {
        let any = self.any(now);
        (self.largest.range(priority.saturating_add(1)..))
            .filter_map(|(_, sizes)| sizes.room(now, self.window, any))
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
        let mut r = Reserve::new(s(10), t0);
        assert_eq!(r.for_priority(0, t0), None);
        r.saw(10, 40, t0);
        r.saw(5, 30, t0);
        // A window on, both have shown their sizes.
        r.saw(10, 20, t0 + s(11));
        r.saw(5, 90, t0 + s(11));
        assert_eq!(r.for_priority(0, t0 + s(12)), Some(90));
        assert_eq!(r.for_priority(5, t0 + s(12)), Some(40));
        assert_eq!(r.for_priority(10, t0 + s(12)), None, "nothing above 10");
        // Kept one to two windows: the bucket of t0 + 11 s ends at t0 + 30 s.
        assert_eq!(r.for_priority(5, t0 + s(29)), Some(20));
        assert_eq!(r.for_priority(-1, t0 + s(60)), None, "all quiet");
    }

    #[test]
    fn a_priority_new_to_the_window_gets_room_for_the_largest_of_any() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut r = Reserve::new(s(10), t0);
        r.saw(0, 150, t0);
        r.saw(10, 40, t0 + s(1));
        assert_eq!(
            r.for_priority(0, t0 + s(2)),
            Some(150),
            "new: any's largest"
        );
        r.saw(10, 40, t0 + s(11));
        assert_eq!(r.for_priority(0, t0 + s(11)), Some(40), "shown its sizes");
        // Quiet for two windows, then back: new again.
        r.saw(0, 150, t0 + s(40));
        r.saw(10, 40, t0 + s(41));
        assert_eq!(r.for_priority(0, t0 + s(42)), Some(150));
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
