//! A router's own memory of where it sent which prefix blocks.
//!
//! In approximate mode (engines that report nothing), cache-aware policies
//! assume an endpoint holds the blocks of the requests they sent it, up to a
//! per-endpoint capacity, evicting least recently routed blocks first: the
//! approach of SGLang's router and the Gateway API Inference Extension's
//! prefix scorer. It answers the same longest-prefix question as the
//! occupancy index, because it is one.

use crate::hash::BlockHash;
use crate::index::{CacheEvent, OccupancyIndex};
use crate::lru::Lru;
use crate::slot::Slot;

/// Remembered prefix blocks per endpoint, LRU-bounded.
#[derive(Clone, Debug)]
pub struct PrefixMemory {
    capacity: usize,
    index: OccupancyIndex,
    lrus: Vec<Lru>,
}

impl PrefixMemory {
    /// A memory holding at most `capacity` blocks per endpoint.
    pub fn new(capacity: usize) -> Self {
        PrefixMemory {
            capacity: capacity.max(1),
            index: OccupancyIndex::new(),
            lrus: Vec::new(),
        }
    }

    fn remember(&mut self, slot: Slot, block: BlockHash) {
        if self.lrus.len() <= slot.index() {
            self.lrus.resize_with(slot.index() + 1, Lru::new);
        }
        if self.index.usage(slot).is_none() {
            // The LRU bounds memory; the index needs no capacity of its own.
            let empty = CacheEvent::Snapshot {
                capacity: usize::MAX,
                blocks: &[],
            };
            self.index
                .apply(slot, empty)
                .expect("an empty snapshot fits");
        }
        if !self.lrus[slot.index()].touch(block) {
            self.index
                .apply(slot, CacheEvent::Stored(&[block]))
                .expect("capacity is unbounded");
        }
        while self.lrus[slot.index()].len() > self.capacity {
            let old = self.lrus[slot.index()].pop_lru().expect("non-empty");
            self.index
                .apply(slot, CacheEvent::Removed(&[old]))
                .expect("held, as the LRU had it");
        }
    }

    /// Records that `chain` was sent to `slot`. Blocks are touched from the
    /// last to the first, so a prefix outlives its tails, as in vLLM.
    pub fn record(&mut self, slot: Slot, chain: &[BlockHash]) {
        for &block in chain.iter().rev() {
            self.remember(slot, block);
        }
    }

    /// For each slot, how many leading blocks of `chain` it was sent
    /// (see [`OccupancyIndex::longest_prefix`]).
    pub fn longest_prefix(&self, chain: &[BlockHash], out: &mut Vec<u32>) {
        self.index.longest_prefix(chain, out);
    }

    /// Blocks remembered for `slot`.
    pub fn held(&self, slot: Slot) -> usize {
        self.lrus.get(slot.index()).map_or(0, Lru::len)
    }

    /// Forgets `slot`.
    pub fn forget(&mut self, slot: Slot) {
        self.index.remove_endpoint(slot);
        if let Some(lru) = self.lrus.get_mut(slot.index()) {
            lru.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_up_to_capacity_dropping_tails_first() {
        let mut m = PrefixMemory::new(3);
        m.record(Slot(0), &[1, 2, 3]);
        let mut out = Vec::new();
        m.longest_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out, vec![3]);
        m.record(Slot(0), &[1, 9]); // 3 is now least recent
        m.longest_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out, vec![2]);
        assert_eq!(m.held(Slot(0)), 3);
        let copy = m.clone();
        m.forget(Slot(0));
        m.longest_prefix(&[1, 2], &mut out);
        assert_eq!(out, vec![0]);
        copy.longest_prefix(&[1, 9], &mut out);
        assert_eq!(out, vec![2], "a clone keeps its own state");
    }
}
