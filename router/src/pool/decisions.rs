//! The last [`RECENT_DECISIONS`] routing decisions, for `/debug/pool`'s
//! shares: where each request's first attempt went, and whether the policy
//! chose it cold (no endpoint held any of its prefix), so an operator can
//! see whether the fleet is balanced and where new keys land.
//!
//! Rules:
//! 1. A decision is a request's first attempt (the one counted by reason
//!    in `kvroute_routing_decisions_total`); retries are not decisions.
//! 2. The ring holds at most [`RECENT_DECISIONS`]; the oldest goes first.
//! 3. An endpoint's share is its decisions over all in the ring, and its
//!    cold share its cold decisions over the cold ones in the ring (0 when
//!    there are none).
//!
//! Memory: one `Arc<str>` (16 bytes, the name shared with the endpoint
//! table) and a flag per decision, about 24 KB when full. An endpoint that
//! leaves the pool keeps its entries until they age out.
//!
//! Not here: the decision itself (`routing`), or metrics.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Decisions the ring keeps.
pub const RECENT_DECISIONS: usize = 1000;

/// Recent decisions, oldest first. See the module docs.
#[derive(Debug)]
pub struct Decisions {
    ring: VecDeque<(Arc<str>, bool)>,
    capacity: usize,
}

/// One endpoint's part of the recent decisions.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Share {
    /// Its decisions over all recent ones, 0 to 1.
    pub decisions: f64,
    /// Its cold decisions over all recent cold ones, 0 to 1.
    pub cold: f64,
}

impl Default for Decisions {
    fn default() -> Self {
        Self::with_capacity(RECENT_DECISIONS)
    }
}

impl Decisions {
    /// A ring of at most `capacity` decisions (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Decisions {
            ring: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Records a decision for `endpoint`, `cold` or not.
    pub fn record(&mut self, endpoint: Arc<str>, cold: bool) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back((endpoint, cold));
    }

    /// Decisions held, and how many of them were cold.
    pub fn counts(&self) -> (usize, usize) {
        let cold = self.ring.iter().filter(|(_, c)| *c).count();
        (self.ring.len(), cold)
    }

    /// Every endpoint's share, by name (endpoints with no recent decision
    /// are absent: their share is 0).
    pub fn shares(&self) -> HashMap<Arc<str>, Share> {
        let (all, cold) = self.counts();
        let mut counts: HashMap<Arc<str>, (usize, usize)> = HashMap::new();
        for (name, c) in &self.ring {
            let entry = counts.entry(name.clone()).or_default();
            entry.0 += 1;
            entry.1 += usize::from(*c);
        }
        let part = |n: usize, of: usize| if of == 0 { 0.0 } else { n as f64 / of as f64 };
        counts
            .into_iter()
            .map(|(name, (d, c))| {
                let share = Share {
                    decisions: part(d, all),
                    cold: part(c, cold),
                };
                (name, share)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn shares_are_of_all_decisions_and_of_cold_ones() {
        let mut d = Decisions::default();
        for _ in 0..3 {
            d.record(name("a"), false);
        }
        d.record(name("a"), true);
        d.record(name("b"), true);
        d.record(name("b"), true);
        d.record(name("c"), true);
        d.record(name("c"), false);
        let shares = d.shares();
        assert_eq!(d.counts(), (8, 4));
        assert_eq!(
            shares[&name("a")],
            Share {
                decisions: 0.5,
                cold: 0.25
            }
        );
        assert_eq!(shares[&name("b")].decisions, 0.25);
        assert_eq!(shares[&name("b")].cold, 0.5);
        assert_eq!(shares[&name("c")].cold, 0.25);
        let total: f64 = shares.values().map(|s| s.decisions).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_ring_is_bounded_and_forgets_the_oldest() {
        let mut d = Decisions::default();
        for _ in 0..RECENT_DECISIONS {
            d.record(name("old"), true);
        }
        assert_eq!(d.counts(), (RECENT_DECISIONS, RECENT_DECISIONS));
        for _ in 0..RECENT_DECISIONS / 4 {
            d.record(name("new"), false);
        }
        assert_eq!(d.counts(), (RECENT_DECISIONS, RECENT_DECISIONS * 3 / 4));
        assert_eq!(d.shares()[&name("new")].decisions, 0.25);
        // Every cold decision left is the old endpoint's.
        assert_eq!(d.shares()[&name("old")].cold, 1.0);
        for _ in 0..10 * RECENT_DECISIONS {
            d.record(name("new"), false);
        }
        assert_eq!(d.counts(), (RECENT_DECISIONS, 0));
        assert!(!d.shares().contains_key(&name("old")));
        assert!(d.ring.capacity() < 2 * RECENT_DECISIONS);
    }

    #[test]
    fn no_cold_decision_is_no_cold_share() {
        let mut d = Decisions::with_capacity(0);
        d.record(name("a"), false);
        d.record(name("b"), false);
        assert_eq!(d.counts(), (1, 0));
        assert_eq!(
            d.shares()[&name("b")],
            Share {
                decisions: 1.0,
                cold: 0.0
            }
        );
        assert!(Decisions::default().shares().is_empty());
    }
}
