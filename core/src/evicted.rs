//! The recently evicted blocks: hashes of blocks that an engine removed
//! from its cache and that no engine held afterwards. A missed block found
//! here was lost to capacity pressure (`evicted`); one never seen anywhere
//! is new (`cold`).
//!
//! A set-associative table, as a CPU cache is built: a block's set is
//! chosen by a randomly keyed hash of it (an engine cannot aim its hashes
//! at one set), each set holds [`WAYS`] hashes, and a full set replaces its
//! oldest entry. So it remembers about the last `capacity` blocks evicted,
//! never more, and costs 8 bytes per block plus one byte per set; the
//! router's default (`limits.maxEvictedBlocks`, 2^20) is 8 MiB per pool.
//! An entry replaced while it was still recent enough to matter is counted
//! ([`overflow`](RecentlyEvicted::overflow)): the set is too small for the
//! eviction rate, and some `evicted` misses will be called `cold`.
//!
//! A hash of 0 marks an empty way, so a block whose hash is 0 is stored
//! as 1: two hashes in 2^64 share an entry.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use crate::hash::BlockHash;

/// Hashes per set.
pub const WAYS: usize = 8;

/// The recently evicted blocks. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct RecentlyEvicted {
    /// `sets × WAYS` hashes, 0 for an empty way.
    ways: Vec<u64>,
    /// Per set, the way to replace next.
    next: Vec<u8>,
    hasher: RandomState,
    overflow: u64,
}

impl RecentlyEvicted {
    /// A set for about `capacity` blocks (rounded up to whole sets, a
    /// power of two of them); 0 keeps none.
    pub fn new(capacity: usize) -> Self {
        let sets = if capacity == 0 {
            0
        } else {
            capacity.div_ceil(WAYS).next_power_of_two()
        };
        RecentlyEvicted {
            ways: vec![0; sets * WAYS],
            next: vec![0; sets],
            hasher: RandomState::default(),
            overflow: 0,
        }
    }

    /// Blocks it can hold.
    pub fn capacity(&self) -> usize {
        self.ways.len()
    }

    /// Remembers that `block` was evicted.
    pub fn insert(&mut self, block: BlockHash) {
        let Some(set) = self.set_of(block) else {
            return;
        };
        let h = block.max(1);
        let ways = &mut self.ways[set * WAYS..(set + 1) * WAYS];
        if ways.contains(&h) {
            return;
        }
        if let Some(free) = ways.iter_mut().find(|w| **w == 0) {
            *free = h;
            return;
        }
        let next = &mut self.next[set];
        ways[usize::from(*next)] = h;
        *next = (*next + 1) % WAYS as u8;
        self.overflow += 1;
    }

    /// Whether `block` was evicted recently.
    pub fn contains(&self, block: BlockHash) -> bool {
        self.set_of(block)
            .is_some_and(|set| self.ways[set * WAYS..(set + 1) * WAYS].contains(&block.max(1)))
    }

    /// Entries replaced by newer ones, ever.
    pub fn overflow(&self) -> u64 {
        self.overflow
    }

    fn set_of(&self, block: BlockHash) -> Option<usize> {
        let sets = self.next.len();
        (sets > 0).then(|| self.hasher.hash_one(block) as usize & (sets - 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_what_was_evicted_and_nothing_else() {
        let mut e = RecentlyEvicted::new(1024);
        for b in 0..100u64 {
            e.insert(b * 7919);
        }
        assert!((0..100u64).all(|b| e.contains(b * 7919)));
        assert!(!e.contains(3));
        assert_eq!(e.overflow(), 0);
    }

    #[test]
    fn holds_at_most_its_capacity_and_counts_what_it_replaces() {
        let mut e = RecentlyEvicted::new(64);
        assert_eq!(e.capacity(), 64);
        for b in 1..=10_000u64 {
            e.insert(b);
        }
        let held = (1..=10_000u64).filter(|&b| e.contains(b)).count();
        assert_eq!(held, 64);
        assert_eq!(e.overflow(), 10_000 - 64);
        // The newest of each set stay.
        assert!(e.contains(10_000));
    }

    #[test]
    fn zero_capacity_keeps_nothing() {
        let mut e = RecentlyEvicted::new(0);
        e.insert(5);
        assert!(!e.contains(5));
        assert_eq!(e.overflow(), 0);
    }

    #[test]
    fn a_repeated_eviction_takes_one_entry() {
        let mut e = RecentlyEvicted::new(8);
        for _ in 0..100 {
            e.insert(42);
        }
        assert_eq!(e.overflow(), 0);
        assert!(e.contains(42) && !e.contains(0));
        e.insert(0);
        assert!(e.contains(0));
    }
}
