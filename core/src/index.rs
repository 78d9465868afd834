//! The occupancy index: which endpoints of one pool hold which KV blocks.
//!
//! Engines report their block caches (WatchCache snapshots and deltas, or
//! vLLM KV events through the agent); the subscriber applies each message to
//! this index, and policies ask it, for a request's block-hash chain, how
//! long a prefix each endpoint holds. The index is pure state: it does not
//! know about streams, sequence numbers or incarnations (the subscriber
//! drops an endpoint and re-applies a snapshot when those break).
//!
//! ## Layout and memory
//!
//! - `blocks`: block hash → bitset of the slots holding it. 8 bytes of key,
//!   16 bytes of [`Holders`] (a 64-bit word inline; a boxed word slice once a
//!   pool has more than 64 slots) and a control byte in a SwissTable kept at
//!   most 7/8 full: 25 to 50 bytes per distinct block, depending on where the
//!   table is in its doubling.
//! - per endpoint: block hash → reference count (8 + 4 bytes, padded to 16,
//!   plus a control byte): 17 to 34 bytes per (block, endpoint) entry.
//!
//! So one (block, endpoint) entry costs at most about 84 bytes, and an
//! endpoint never holds more entries than the capacity (in blocks) it
//! reported: a delta that would exceed it is refused with
//! [`IndexError::OverCapacity`], and the caller resyncs that endpoint.
//!
//! Reference counts follow vLLM: two physical blocks can carry the same hash
//! (the same prefix computed twice concurrently), each stored and removed on
//! its own. The hash stays held until its last copy is removed, and every
//! copy counts against the capacity.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::hash::BlockHash;
use crate::slot::Slot;

/// A change to one endpoint's resident blocks.
#[derive(Clone, Copy, Debug)]
pub enum CacheEvent<'a> {
    /// Replace everything the endpoint holds with `blocks`; `capacity` is
    /// the endpoint's cache size in blocks.
    Snapshot {
        /// The cache's capacity in blocks.
        capacity: usize,
        /// Every resident block (a hash listed twice is two physical blocks).
        blocks: &'a [BlockHash],
    },
    /// Blocks newly cached, in chain order.
    Stored(&'a [BlockHash]),
    /// Blocks evicted.
    Removed(&'a [BlockHash]),
    /// The engine dropped its whole cache (vLLM `AllBlocksCleared`).
    Cleared,
}

/// Why an event was refused. A refused event changes nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    /// A delta for an endpoint that has no snapshot yet.
    #[error("endpoint slot {0} has no snapshot; deltas need one first")]
    NoSnapshot(u32),
    /// The endpoint would hold more blocks than the capacity it reported.
    #[error("endpoint slot {slot} would hold {would_hold} blocks, over its capacity of {capacity}")]
    OverCapacity {
        /// The endpoint.
        slot: u32,
        /// Its reported capacity.
        capacity: usize,
        /// What it would hold after the event.
        would_hold: usize,
    },
    /// A removal of a block the endpoint does not hold: the stream diverged.
    #[error("endpoint slot {slot} removed block {block:#018x}, which it does not hold")]
    NotHeld {
        /// The endpoint.
        slot: u32,
        /// The block.
        block: BlockHash,
    },
}

/// Bitset of the slots holding one block.
#[derive(Clone, Debug)]
enum Holders {
    Small(u64),
    Large(Box<[u64]>),
}

impl Holders {
    fn words(&self) -> &[u64] {
        match self {
            Holders::Small(w) => std::slice::from_ref(w),
            Holders::Large(ws) => ws,
        }
    }

    fn set(&mut self, slot: usize) {
        let (word, bit) = (slot / 64, 1u64 << (slot % 64));
        match self {
            Holders::Small(w) if word == 0 => *w |= bit,
            Holders::Small(w) => {
                let mut ws = vec![0u64; word + 1];
                ws[0] = *w;
                ws[word] = bit;
                *self = Holders::Large(ws.into_boxed_slice());
            }
            Holders::Large(ws) if word < ws.len() => ws[word] |= bit,
            Holders::Large(ws) => {
                let mut grown = vec![0u64; word + 1];
                grown[..ws.len()].copy_from_slice(ws);
                grown[word] = bit;
                *ws = grown.into_boxed_slice();
            }
        }
    }

    /// Clears `slot`; returns whether no slot is left.
    fn clear(&mut self, slot: usize) -> bool {
        let (word, bit) = (slot / 64, 1u64 << (slot % 64));
        match self {
            Holders::Small(w) => {
                if word == 0 {
                    *w &= !bit;
                }
                *w == 0
            }
            Holders::Large(ws) => {
                if let Some(w) = ws.get_mut(word) {
                    *w &= !bit;
                }
                ws.iter().all(|&w| w == 0)
            }
        }
    }
}

#[derive(Debug)]
struct EndpointBlocks {
    capacity: usize,
    /// Block → how many physical copies the endpoint holds.
    refs: HashMap<BlockHash, u32, RandomState>,
    /// Sum of `refs`: physical blocks held.
    physical: usize,
}

/// Which endpoints of one pool hold which blocks. See the module docs.
#[derive(Debug, Default)]
pub struct OccupancyIndex {
    blocks: HashMap<BlockHash, Holders, RandomState>,
    endpoints: Vec<Option<EndpointBlocks>>,
}

impl OccupancyIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event to `slot`'s blocks. On error nothing changes.
    pub fn apply(&mut self, slot: Slot, event: CacheEvent<'_>) -> Result<(), IndexError> {
        match event {
            CacheEvent::Snapshot { capacity, blocks } => self.snapshot(slot, capacity, blocks),
            CacheEvent::Stored(blocks) => self.stored(slot, blocks),
            CacheEvent::Removed(blocks) => self.removed(slot, blocks),
            CacheEvent::Cleared => {
                let capacity = self.endpoint(slot)?.capacity;
                self.snapshot(slot, capacity, &[])
            }
        }
    }

    fn endpoint(&self, slot: Slot) -> Result<&EndpointBlocks, IndexError> {
        self.endpoints
            .get(slot.index())
            .and_then(Option::as_ref)
            .ok_or(IndexError::NoSnapshot(slot.0))
    }

    fn snapshot(
        &mut self,
        slot: Slot,
        capacity: usize,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        if blocks.len() > capacity {
            return Err(IndexError::OverCapacity {
                slot: slot.0,
                capacity,
                would_hold: blocks.len(),
            });
        }
        self.remove_endpoint(slot);
        if self.endpoints.len() <= slot.index() {
            self.endpoints.resize_with(slot.index() + 1, || None);
        }
        self.endpoints[slot.index()] = Some(EndpointBlocks {
            capacity,
            refs: HashMap::with_capacity_and_hasher(blocks.len(), RandomState::default()),
            physical: 0,
        });
        self.stored(slot, blocks)
    }

    fn stored(&mut self, slot: Slot, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let ep = self
            .endpoints
            .get_mut(slot.index())
            .and_then(Option::as_mut)
            .ok_or(IndexError::NoSnapshot(slot.0))?;
        let would_hold = ep.physical + blocks.len();
        if would_hold > ep.capacity {
            return Err(IndexError::OverCapacity {
                slot: slot.0,
                capacity: ep.capacity,
                would_hold,
            });
        }
        ep.physical = would_hold;
        for &block in blocks {
            let refs = ep.refs.entry(block).or_insert(0);
            *refs += 1;
            if *refs == 1 {
                self.blocks
                    .entry(block)
                    .or_insert(Holders::Small(0))
                    .set(slot.index());
            }
        }
        Ok(())
    }

    fn removed(&mut self, slot: Slot, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let ep = self
            .endpoints
            .get_mut(slot.index())
            .and_then(Option::as_mut)
            .ok_or(IndexError::NoSnapshot(slot.0))?;
        // Check the whole batch first, so a refused event changes nothing.
        let mut pending: HashMap<BlockHash, u32, RandomState> = HashMap::default();
        for &block in blocks {
            let removing = pending.entry(block).or_insert(0);
            *removing += 1;
            if ep.refs.get(&block).copied().unwrap_or(0) < *removing {
                return Err(IndexError::NotHeld {
                    slot: slot.0,
                    block,
                });
            }
        }
        ep.physical -= blocks.len();
        for (block, n) in pending {
            let refs = ep.refs.get_mut(&block).expect("checked above");
            *refs -= n;
            if *refs == 0 {
                ep.refs.remove(&block);
                unset(&mut self.blocks, block, slot);
            }
        }
        Ok(())
    }

    /// Forgets everything `slot` holds, and the slot itself (its next event
    /// must be a snapshot).
    pub fn remove_endpoint(&mut self, slot: Slot) {
        let Some(ep) = self.endpoints.get_mut(slot.index()).and_then(Option::take) else {
            return;
        };
        for block in ep.refs.into_keys() {
            unset(&mut self.blocks, block, slot);
        }
    }

    /// For each slot, how many leading blocks of `chain` it holds, written to
    /// `out[slot]` (`out` is resized to cover every slot; slots without a
    /// snapshot get 0). One pass over the chain, stopping once no slot is
    /// still matching.
    pub fn longest_prefix(&self, chain: &[BlockHash], out: &mut Vec<u32>) {
        out.clear();
        out.resize(self.endpoints.len(), 0);
        let Some(first) = chain.first().and_then(|b| self.blocks.get(b)) else {
            return;
        };
        let mut active: Vec<u64> = first.words().to_vec();
        for (depth, block) in chain.iter().enumerate().skip(1) {
            let held = self.blocks.get(block).map_or(&[][..], Holders::words);
            let mut any = false;
            for (w, word) in active.iter_mut().enumerate() {
                let keep = *word & held.get(w).copied().unwrap_or(0);
                record(*word & !keep, w, depth as u32, out);
                *word = keep;
                any |= keep != 0;
            }
            if !any {
                return;
            }
        }
        for (w, &word) in active.iter().enumerate() {
            record(word, w, chain.len() as u32, out);
        }
    }

    /// Whether `slot` holds `block`.
    pub fn holds(&self, slot: Slot, block: BlockHash) -> bool {
        self.endpoint(slot)
            .is_ok_and(|ep| ep.refs.contains_key(&block))
    }

    /// The distinct blocks `slot` holds (empty without a snapshot).
    pub fn blocks_of(&self, slot: Slot) -> impl Iterator<Item = BlockHash> + '_ {
        self.endpoint(slot)
            .ok()
            .into_iter()
            .flat_map(|ep| ep.refs.keys().copied())
    }

    /// Physical blocks `slot` holds, and its capacity; `None` without a
    /// snapshot.
    pub fn usage(&self, slot: Slot) -> Option<(usize, usize)> {
        self.endpoint(slot).ok().map(|ep| (ep.physical, ep.capacity))
    }

    /// (block, endpoint) entries in the index.
    pub fn entries(&self) -> usize {
        self.endpoints.iter().flatten().map(|ep| ep.refs.len()).sum()
    }

    /// Distinct blocks held by any endpoint.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }
}

/// Clears `slot` from `block`'s holders, dropping the block when none is left.
fn unset(blocks: &mut HashMap<BlockHash, Holders, RandomState>, block: BlockHash, slot: Slot) {
    if let Some(holders) = blocks.get_mut(&block)
        && holders.clear(slot.index())
    {
        blocks.remove(&block);
    }
}

/// Sets `out[slot] = depth` for every slot whose bit is set in `dropped`.
#[inline]
fn record(mut dropped: u64, word: usize, depth: u32, out: &mut [u32]) {
    while dropped != 0 {
        let bit = dropped.trailing_zeros() as usize;
        if let Some(o) = out.get_mut(word * 64 + bit) {
            *o = depth;
        }
        dropped &= dropped - 1;
    }
}

#[cfg(test)]
mod tests;
