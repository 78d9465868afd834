//! Room kept for light flows: a tenant that sends far more than the others
//! would otherwise fill every endpoint with running requests, and the
//! others' requests, first in the queue by turn, would still wait for
//! those to finish. So a flow over its fair share of recent dispatches is
//! sent to an endpoint only if that leaves room there, while a flow under
//! its share has had a request in the window, for the largest recent
//! request of any flow (its KV blocks and a seat), as [`super::reserve`]
//! does for priorities.
//!
//! A flow's recent dispatches are a count that decays with time constant
//! `flowControl.reserveWindowMs`. Its fair share is the mean count of the
//! flows seen in the window; it is over its share above 1.5 × the mean
//! (so flows that send alike do not keep room from each other by chance)
//! and under it below the mean. At most [`MAX_FLOWS`] flows are followed
//! (tenants come from headers): beyond, the one with the lowest count is
//! forgotten. Pure: the clock is passed in.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flows followed at most.
pub const MAX_FLOWS: usize = 1024;

#[derive(Clone, Copy, Debug)]
struct Flow {
    /// Dispatches, decayed to `at`.
    count: f64,
    at: Instant,
    /// When it last had a request.
    seen: Instant,
}

/// The flows' recent dispatches. See the module docs.
#[derive(Debug)]
pub struct Shares {
    window: Duration,
    flows: HashMap<Arc<str>, Flow>,
}

impl Flow {
    fn count_at(&self, now: Instant, window: Duration) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.count * (-dt / window.as_secs_f64()).exp()
    }

    fn recent(&self, now: Instant, window: Duration) -> bool {
        let since = |t: Instant| now.saturating_duration_since(t);
        since(self.at) <= window || since(self.seen) <= window
    }
}

impl Shares {
    /// Shares over `window` (zero: no room kept).
    pub fn new(window: Duration) -> Self {
        Shares {
            window,
            flows: HashMap::new(),
        }
    }

    fn flow(&mut self, name: &str, now: Instant) -> &mut Flow {
        if !self.flows.contains_key(name) && self.flows.len() >= MAX_FLOWS {
            let window = self.window;
            let lowest = (self.flows.iter())
                .min_by(|a, b| {
                    a.1.count_at(now, window)
                        .total_cmp(&b.1.count_at(now, window))
                })
                .map(|(k, _)| k.clone());
            if let Some(k) = lowest {
                self.flows.remove(&k);
            }
        }
        self.flows.entry(Arc::from(name)).or_insert(Flow {
            count: 0.0,
            at: now,
            seen: now,
        })
    }

    /// A request of `flow` arrived at `now`.
    pub fn saw(&mut self, flow: &str, now: Instant) {
        if self.window.is_zero() {
            return;
        }
        self.flow(flow, now).seen = now;
    }

    /// A request of `flow` was sent to an endpoint at `now`.
    pub fn dispatched(&mut self, flow: &str, now: Instant) {
        if self.window.is_zero() {
            return;
        }
        let window = self.window;
        let f = self.flow(flow, now);
        f.count = f.count_at(now, window) + 1.0;
        f.at = now;
    }

    /// Blocks a request of `flow` must leave free where it goes, at `now`:
    /// when it is over its fair share and a flow under it had a request in
    /// the window, `any` (the largest request of any, as
    /// [`super::reserve`] keeps for priorities); `None` otherwise.
    pub fn for_flow(&self, flow: &str, now: Instant, any: u64) -> Option<u64> {
        let window = self.window;
        let own = self.flows.get(flow)?.count_at(now, window);
        let recent: Vec<(f64, &Flow)> = (self.flows.values())
            .filter(|f| f.recent(now, window))
            .map(|f| (f.count_at(now, window), f))
            .collect();
        if recent.len() < 2 {
            return None;
        }
        let mean = recent.iter().map(|(c, _)| c).sum::<f64>() / recent.len() as f64;
        if own <= 1.5 * mean {
            return None;
        }
        let under = recent.iter().any(|(c, _)| *c < mean);
        under.then_some(any).filter(|&b| b > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_far_over_its_share_leaves_room_for_the_flows_under_it() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = Shares::new(ms(10_000));
        for flow in ["quiet", "other"] {
            s.saw(flow, t0);
            s.dispatched(flow, t0);
        }
        for i in 0..10 {
            s.saw("noisy", t0 + ms(i));
            s.dispatched("noisy", t0 + ms(i));
        }
        let now = t0 + ms(100);
        assert_eq!(s.for_flow("noisy", now, 80), Some(80), "the largest of any");
        assert_eq!(
            s.for_flow("noisy", now, 0),
            None,
            "no request in the window"
        );
        assert_eq!(s.for_flow("quiet", now, 80), None, "under its share");
        assert_eq!(s.for_flow("unknown", now, 80), None);
        // Long after, every count has decayed and nobody is recent.
        assert_eq!(s.for_flow("noisy", t0 + ms(60_000), 80), None);
    }

    #[test]
    fn flows_that_send_alike_keep_no_room_from_each_other() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = Shares::new(ms(10_000));
        for (i, flow) in ["a", "b", "a", "b", "a"].iter().enumerate() {
            s.saw(flow, t0 + ms(i as u64));
            s.dispatched(flow, t0 + ms(i as u64));
        }
        assert_eq!(s.for_flow("a", t0 + ms(10), 40), None);
        // One flow alone has no share to be over.
        let mut alone = Shares::new(ms(10_000));
        alone.dispatched("a", t0);
        assert_eq!(alone.for_flow("a", t0, 40), None);
    }

    #[test]
    fn the_flows_followed_are_bounded_and_a_zero_window_keeps_no_room() {
        let t0 = Instant::now();
        let mut s = Shares::new(Duration::from_secs(10));
        for i in 0..(MAX_FLOWS + 10) {
            s.dispatched(&format!("tenant-{i}"), t0);
        }
        assert_eq!(s.flows.len(), MAX_FLOWS);
        let mut off = Shares::new(Duration::ZERO);
        off.saw("a", t0);
        off.dispatched("a", t0);
        assert!(off.flows.is_empty());
        assert_eq!(off.for_flow("a", t0, 10), None);
    }
}
