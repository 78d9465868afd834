//! Prefixes that carry more traffic than one endpoint can: a chat
//! template's header, a preamble or tool list every prompt starts with.
//!
//! Such a prefix is no placement signal. Every endpoint that serves any of
//! its requests holds it after the first, so holding it says nothing of
//! where a new group or conversation should live; ranked as warmth, it
//! pulls every new key onto the few endpoints that hold it first, while
//! the others idle (an idle endpoint holds nothing, so it never wins).
//!
//! The rule: a leading block of a request is **shared** when more than two
//! endpoints' share of the recent requests (2/N of them, N endpoints; at
//! most half of them), and at least [`MIN_REQUESTS`], carry it, and
//! requests carrying it have gone on with different next blocks (it
//! branches). A request's shared depth is the position after the last
//! shared block of its chain. Both halves are needed:
//! - Share alone would call a long conversation's history shared (it is
//!   all of its traffic); it never branches.
//! - Branching alone would call a group's system prompt shared (its
//!   conversations branch after it). A group with a few endpoints' share
//!   of the traffic or less is served best where it is: keeping it there
//!   keeps its prefix cached once, and the latency slack spills what one
//!   endpoint cannot take. A prefix with more cannot live on a few
//!   endpoints anyway; it spreads, and each endpoint computes it once.
//!
//! Counts decay with a half-life of [`HALF_LIFE`] requests, so the window
//! follows the traffic. Bounded: at most `capacity` blocks remembered, the
//! least recently seen forgotten first; only a request's first
//! [`MAX_DEPTH`] blocks are looked at. About 64 bytes per block.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::hash::BlockHash;
use crate::lru::Lru;

/// Requests after which a count has halved.
pub const HALF_LIFE: f64 = 1024.0;
/// Leading blocks of a request looked at (64K tokens of 16-token blocks).
pub const MAX_DEPTH: usize = 4096;
/// Requests that must carry a prefix before it can be shared, the one
/// being placed included (its decayed count, rounded): two may share one
/// by chance.
pub const MIN_REQUESTS: f64 = 3.0;

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Requests that carried the block, decayed to `at`.
    count: f64,
    at: u64,
    /// The first next block seen after it.
    child: Option<BlockHash>,
    /// Whether another next block was seen since.
    branches: bool,
}

/// Leading blocks many requests share. See the module docs.
#[derive(Clone, Debug)]
pub struct SharedPrefixes {
    capacity: usize,
    entries: HashMap<BlockHash, Entry, RandomState>,
    lru: Lru,
    /// Requests recorded: the decay clock.
    seen: u64,
    /// Requests recorded, decayed to `seen`.
    total: f64,
}

fn decayed(count: f64, from: u64, to: u64) -> f64 {
    count * 0.5f64.powf((to - from) as f64 / HALF_LIFE)
}

impl SharedPrefixes {
    /// At most `capacity` blocks remembered.
    pub fn new(capacity: usize) -> Self {
        SharedPrefixes {
            capacity: capacity.max(1),
            entries: HashMap::default(),
            lru: Lru::new(),
            seen: 0,
            total: 0.0,
        }
    }

    /// The shared depth of `chain` among `endpoints` endpoints, counting
    /// the request as if it were recorded: the blocks it leads with that
    /// more than 2/`endpoints` of the requests (at most half) carry, up to
    /// the last of them that branches. 0 with fewer than two endpoints.
    pub fn depth(&self, chain: &[BlockHash], endpoints: usize) -> u32 {
        if endpoints < 2 {
            return 0;
        }
        let least = (self.total + 1.0) * (2.0 / endpoints as f64).min(0.5);
        let mut depth = 0;
        for (j, block) in chain.iter().enumerate().take(MAX_DEPTH) {
            let Some(e) = self.entries.get(block) else {
                break;
            };
            let count = decayed(e.count, e.at, self.seen) + 1.0;
            if count.round() < MIN_REQUESTS || count <= least {
                break;
            }
            let next = chain.get(j + 1);
            if e.branches || next.is_some_and(|n| e.child.is_some_and(|c| c != *n)) {
                depth = j as u32 + 1;
            }
        }
        depth
    }

    /// Counts a request with `chain`.
    pub fn record(&mut self, chain: &[BlockHash]) {
        self.total = decayed(self.total, self.seen, self.seen + 1) + 1.0;
        self.seen += 1;
        let chain = &chain[..chain.len().min(MAX_DEPTH)];
        for (j, &block) in chain.iter().enumerate() {
            let next = chain.get(j + 1).copied();
            let seen = self.seen;
            let e = self.entries.entry(block).or_insert(Entry {
                count: 0.0,
                at: seen,
                child: None,
                branches: false,
            });
            e.count = decayed(e.count, e.at, seen) + 1.0;
            e.at = seen;
            match (e.child, next) {
                (None, n) => e.child = n,
                (Some(c), Some(n)) if c != n => e.branches = true,
                _ => {}
            }
            self.lru.touch(block);
        }
        while self.lru.len() > self.capacity {
            let old = self.lru.pop_lru().expect("over capacity");
            self.entries.remove(&old);
        }
    }

    /// Blocks remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain: `shared` blocks every request has, then `own` of its own.
    fn chain(shared: u64, id: u64, own: u64) -> Vec<BlockHash> {
        (0..shared)
            .chain((0..own).map(|b| 1_000_000 * (id + 1) + b))
            .collect()
    }

    #[test]
    fn a_template_every_group_starts_with_is_shared_and_a_groups_own_prompt_is_not() {
        let mut s = SharedPrefixes::new(10_000);
        // The first request alone shares nothing.
        assert_eq!(s.depth(&chain(1, 0, 48), 8), 0);
        // 32 groups behind one template block, each with conversations
        // that go on after its 48-block prompt.
        for round in 0..4 {
            for g in 0..32 {
                let mut c = chain(1, g, 48);
                c.push(5_000_000 + round * 100 + g);
                s.record(&c);
            }
        }
        for g in 0..32 {
            let mut c = chain(1, g, 48);
            c.push(9_000_000);
            assert_eq!(s.depth(&c, 8), 1, "group {g}");
        }
        // The third request of a new group already sees the template as
        // shared: three of three requests carry it and they branch.
        let mut fresh = SharedPrefixes::new(100);
        fresh.record(&chain(1, 0, 4));
        assert_eq!(
            fresh.depth(&chain(1, 1, 4), 8),
            0,
            "two may agree by chance"
        );
        fresh.record(&chain(1, 1, 4));
        assert_eq!(fresh.depth(&chain(1, 2, 4), 8), 1);
    }

    #[test]
    fn a_long_preamble_is_shared_to_its_end() {
        let mut s = SharedPrefixes::new(10_000);
        for id in 0..32 {
            s.record(&chain(25, id, 3));
        }
        assert_eq!(s.depth(&chain(25, 99, 3), 8), 25);
        // One endpoint: nothing to spread over.
        assert_eq!(s.depth(&chain(25, 99, 3), 1), 0);
    }

    #[test]
    fn a_conversation_that_only_grows_is_not_shared() {
        let mut s = SharedPrefixes::new(10_000);
        let turns: Vec<BlockHash> = (0..100).collect();
        for end in (10..100).step_by(10) {
            s.record(&turns[..end]);
        }
        assert_eq!(s.depth(&turns, 8), 0);
    }

    #[test]
    fn a_prefix_under_two_endpoints_share_is_not_shared() {
        let mut s = SharedPrefixes::new(10_000);
        // Prefix A is on 1 of 16 requests, with branching conversations;
        // the rest are unrelated.
        for i in 0..320 {
            if i % 16 == 0 {
                s.record(&[7, 8, 9, 10_000 + i]);
            } else {
                s.record(&[20_000 + i, 1]);
            }
        }
        assert_eq!(s.depth(&[7, 8, 9, 1], 8), 0);
        assert_eq!(s.depth(&[7, 8, 9, 1], 4), 0);
        // Among 64 endpoints, 1/16 is more than two endpoints' share.
        assert_eq!(s.depth(&[7, 8, 9, 1], 64), 3);
    }

    #[test]
    fn old_traffic_fades_and_memory_is_bounded() {
        let mut s = SharedPrefixes::new(64);
        for id in 0..8 {
            s.record(&chain(2, id, 2));
        }
        assert_eq!(s.depth(&chain(2, 50, 2), 8), 2);
        // Five half-lives of other traffic later, the template's share is
        // under one endpoint's.
        for _ in 0..(5 * HALF_LIFE as u64) {
            s.record(&[100]);
        }
        assert_eq!(s.depth(&chain(2, 50, 2), 8), 0);
        for i in 0..1000 {
            s.record(&[200 + i, 7]);
        }
        assert_eq!(s.len(), 64);
    }
}
