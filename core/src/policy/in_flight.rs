//! Prefixes a router sent that the engines have not reported yet.
//!
//! An engine reports a prompt's blocks once it has computed them (vLLM emits
//! `BlockStored` after the prefill step), so between routing a new prefix
//! and that report reaching the occupancy index, the index knows nothing of
//! it: a second request with the same new prefix, arriving while the first
//! is still queued, looks cold everywhere and may be sent elsewhere to
//! compute it again. Under load, when queues are seconds long, that is
//! common. This remembers each routed chain on its endpoint until the
//! request's predicted first token plus the age a report may have, by
//! when the index should hold it (or the engine has evicted it, which the
//! index then says). Bounded: at most `capacity` blocks over all entries,
//! the soonest to expire dropped first.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use crate::hash::BlockHash;
use crate::slot::Slot;

/// One routed chain: (expiry, routing order, endpoint, chain).
type Entry = (Instant, u64, Slot, Vec<BlockHash>);

/// Chains in flight, per endpoint, until they expire.
#[derive(Clone, Debug)]
pub struct InFlight {
    capacity: usize,
    /// Blocks over all entries.
    blocks: usize,
    /// Entries, soonest to expire first.
    entries: BinaryHeap<Reverse<Entry>>,
    /// Per block, the endpoints it is in flight to and how many entries
    /// hold it there.
    held: HashMap<BlockHash, Vec<(Slot, u32)>>,
    next: u64,
}

impl InFlight {
    /// At most `capacity` blocks remembered over all entries.
    pub fn new(capacity: usize) -> Self {
        InFlight {
            capacity: capacity.max(1),
            blocks: 0,
            entries: BinaryHeap::new(),
            held: HashMap::new(),
            next: 0,
        }
    }

    /// `chain` was sent to `slot`; remember it until `expires`. A chain
    /// longer than the capacity keeps its leading blocks.
    pub fn record(&mut self, slot: Slot, chain: &[BlockHash], expires: Instant) {
        let chain = &chain[..chain.len().min(self.capacity)];
        if chain.is_empty() {
            return;
        }
        while self.blocks + chain.len() > self.capacity {
            self.pop();
        }
        for &block in chain {
            let slots = self.held.entry(block).or_default();
            match slots.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, n)) => *n += 1,
                None => slots.push((slot, 1)),
            }
        }
        self.blocks += chain.len();
        self.entries
            .push(Reverse((expires, self.next, slot, chain.to_vec())));
        self.next += 1;
    }

    /// Forgets what expired by `now`.
    pub fn expire(&mut self, now: Instant) {
        while self
            .entries
            .peek()
            .is_some_and(|Reverse((at, ..))| *at <= now)
        {
            self.pop();
        }
    }

    fn pop(&mut self) {
        let Some(Reverse((_, _, slot, chain))) = self.entries.pop() else {
            return;
        };
        self.blocks -= chain.len();
        for block in chain {
            let Some(slots) = self.held.get_mut(&block) else {
                continue;
            };
            if let Some(i) = slots.iter().position(|(s, _)| *s == slot) {
                slots[i].1 -= 1;
                if slots[i].1 == 0 {
                    slots.swap_remove(i);
                }
            }
            if slots.is_empty() {
                self.held.remove(&block);
            }
        }
    }

    /// Raises `by_slot[s]` (leading blocks of `chain` known at slot `s`) to
    /// what is in flight there, growing `by_slot` as needed.
    pub fn extend_prefixes(&self, chain: &[BlockHash], by_slot: &mut Vec<u32>) {
        if self.held.is_empty() {
            return;
        }
        let Some(first) = chain.first().and_then(|b| self.held.get(b)) else {
            return;
        };
        let holds = |slot: Slot, block: &BlockHash| {
            self.held
                .get(block)
                .is_some_and(|slots| slots.iter().any(|(s, _)| *s == slot))
        };
        for &(slot, _) in first {
            let n = chain.iter().take_while(|b| holds(slot, b)).count() as u32;
            if by_slot.len() <= slot.index() {
                by_slot.resize(slot.index() + 1, 0);
            }
            by_slot[slot.index()] = by_slot[slot.index()].max(n);
        }
    }

    /// Forgets `slot`.
    pub fn forget(&mut self, slot: Slot) {
        self.entries.retain(|Reverse((_, _, s, _))| *s != slot);
        self.blocks = self.entries.iter().map(|Reverse(e)| e.3.len()).sum();
        for slots in self.held.values_mut() {
            slots.retain(|(s, _)| *s != slot);
        }
        self.held.retain(|_, slots| !slots.is_empty());
    }

    /// Blocks remembered over all entries.
    #[cfg(test)]
    fn blocks(&self) -> usize {
        self.blocks
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn prefixes(f: &InFlight, chain: &[BlockHash]) -> Vec<u32> {
        let mut by_slot = vec![0; 3];
        f.extend_prefixes(chain, &mut by_slot);
        by_slot
    }

    #[test]
    fn chains_count_until_they_expire_and_shared_blocks_until_the_last() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut f = InFlight::new(100);
        f.record(Slot(0), &[1, 2, 3], s(10));
        f.record(Slot(0), &[1, 2], s(5));
        f.record(Slot(2), &[1, 2, 3, 4], s(20));
        assert_eq!(prefixes(&f, &[1, 2, 3, 4, 5]), vec![3, 0, 4]);
        // A gap ends the prefix; another first block matches nothing.
        assert_eq!(prefixes(&f, &[1, 9, 3]), vec![1, 0, 1]);
        assert_eq!(prefixes(&f, &[9, 1]), vec![0, 0, 0]);
        f.expire(s(5));
        assert_eq!(prefixes(&f, &[1, 2, 3]), vec![3, 0, 3]);
        f.expire(s(10));
        assert_eq!(prefixes(&f, &[1, 2, 3]), vec![0, 0, 3]);
        assert_eq!(f.blocks(), 4);
        f.forget(Slot(2));
        assert_eq!((prefixes(&f, &[1]), f.blocks()), (vec![0, 0, 0], 0));
        // The slot's entries went with it: a new endpoint in the slot
        // keeps what it is sent.
        f.record(Slot(2), &[1], s(30));
        f.expire(s(25));
        assert_eq!(prefixes(&f, &[1]), vec![0, 0, 1]);
    }

    #[test]
    fn the_capacity_drops_the_soonest_to_expire_first() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut f = InFlight::new(4);
        f.record(Slot(0), &[1, 2], s(20));
        f.record(Slot(1), &[1, 2], s(10));
        f.record(Slot(2), &[1, 2, 3], s(30));
        assert_eq!(prefixes(&f, &[1, 2, 3]), vec![0, 0, 3]);
        assert_eq!(f.blocks(), 3);
        // A chain over the capacity keeps its leading blocks.
        f.record(Slot(1), &[7, 8, 9, 10, 11], s(40));
        assert_eq!(prefixes(&f, &[7, 8, 9, 10, 11]), vec![0, 4, 0]);
        assert_eq!(f.blocks(), 4);
    }
}
