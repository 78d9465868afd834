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
//! One table, block hash → bitset of the slots holding it: 8 bytes of key,
//! 16 bytes of bitset (a 64-bit word inline; a boxed word slice once a pool
//! has more than 64 slots) and a control byte, in a SwissTable kept between
//! 7/16 and 7/8 full. That is 28 to 55 bytes per distinct block, shared by
//! all its holders, so a (block, endpoint) entry costs at most about 55
//! bytes, and less when endpoints share blocks. Applying a stored or removed
//! block touches that one table once. An endpoint never holds more blocks
//! than the capacity it reported: a delta that would exceed it is refused
//! with [`IndexError::OverCapacity`], and the caller resyncs that endpoint.
//!
//! Reference counts follow vLLM: two physical blocks can carry the same hash
//! (the same prefix computed twice concurrently), each stored and removed on
//! its own. The hash stays held until its last copy is removed, and every
//! copy counts against the capacity. Extra copies are rare and live in a
//! small side table.
//!
//! Forgetting an endpoint (or replacing its contents with a new snapshot)
//! scans the table once: rare (an engine restart or a lost stream) and a few
//! milliseconds at a million entries.
//!
//! ## Offloaded blocks
//!
//! Blocks an engine keeps on another medium than its GPU cache (vLLM's KV
//! offloading to CPU memory or disk) live in a second table of the same
//! shape, one tier for every such medium. They do not count against the
//! capacity, which is the GPU cache's. A request's prefix is served from
//! the GPU as far as the GPU holds it, then loaded back from the offloaded
//! tier as far as either holds it; loading is cheaper than computing but not
//! free, so [`longest_prefix`](OccupancyIndex::longest_prefix) counts each
//! offloaded block of the prefix as [`offload_weight`] of a GPU block
//! (`policy.offloadWeight`, default [`DEFAULT_OFFLOAD_WEIGHT`]).
//!
//! [`offload_weight`]: OccupancyIndex::set_offload_weight

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
    /// The engine dropped its whole cache, offloaded blocks included (vLLM
    /// `AllBlocksCleared`).
    Cleared,
    /// Blocks newly kept on an offload medium (added to any GPU copies).
    Offloaded(&'a [BlockHash]),
    /// Blocks dropped from an offload medium.
    OffloadRemoved(&'a [BlockHash]),
    /// Every offloaded block dropped (the GPU cache stays).
    OffloadCleared,
    /// Every GPU block dropped (the offloaded ones stay).
    GpuCleared,
}

/// How much an offloaded block of a prefix counts, as a share of a GPU
/// block: loading it back costs less than computing it, more than nothing.
pub const DEFAULT_OFFLOAD_WEIGHT: f32 = 0.5;

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

    fn test(&self, slot: usize) -> bool {
        self.words()
            .get(slot / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
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

#[derive(Clone, Debug)]
struct EndpointBlocks {
    capacity: usize,
    /// Physical GPU blocks held, copies included.
    physical: usize,
    /// Distinct blocks held, per tier (GPU, offloaded).
    distinct: [usize; 2],
}

/// One tier's table: block → holders, and copies beyond the first.
#[derive(Clone, Debug, Default)]
struct Table {
    blocks: HashMap<BlockHash, Holders, RandomState>,
    /// (block, slot) → copies beyond the first.
    copies: HashMap<(BlockHash, u32), u32, RandomState>,
}

impl Table {
    /// Adds one copy of each block to `slot`; returns the new distinct ones.
    fn store(&mut self, slot: Slot, blocks: &[BlockHash]) -> usize {
        let mut new = 0;
        for &block in blocks {
            let holders = self.blocks.entry(block).or_insert(Holders::Small(0));
            if holders.test(slot.index()) {
                *self.copies.entry((block, slot.0)).or_insert(0) += 1;
            } else {
                holders.set(slot.index());
                new += 1;
            }
        }
        new
    }

    /// Removes one copy of `block` from `slot`: `None` if it holds none,
    /// else whether that was the last copy.
    fn remove(&mut self, slot: Slot, block: BlockHash) -> Option<bool> {
        let holders = self.blocks.get_mut(&block)?;
        if !holders.test(slot.index()) {
            return None;
        }
        let mut last_copy = true;
        if !self.copies.is_empty()
            && let Some(extra) = self.copies.get_mut(&(block, slot.0))
        {
            *extra -= 1;
            if *extra == 0 {
                self.copies.remove(&(block, slot.0));
            }
            last_copy = false;
        }
        if last_copy && holders.clear(slot.index()) {
            self.blocks.remove(&block);
        }
        Some(last_copy)
    }

    /// Forgets `slot`'s blocks (`distinct` of them, some with copies).
    fn remove_slot(&mut self, slot: Slot, distinct: usize) {
        if distinct > 0 {
            self.blocks
                .retain(|_, holders| !holders.clear(slot.index()));
        }
        if !self.copies.is_empty() {
            self.copies.retain(|&(_, s), _| s != slot.0);
        }
    }
}

const GPU: usize = 0;
const OFFLOADED: usize = 1;

/// Which endpoints of one pool hold which blocks. See the module docs.
#[derive(Clone, Debug)]
pub struct OccupancyIndex {
    tiers: [Table; 2],
    endpoints: Vec<Option<EndpointBlocks>>,
    offload_weight: f32,
}

impl Default for OccupancyIndex {
    fn default() -> Self {
        OccupancyIndex {
            tiers: Default::default(),
            endpoints: Vec::new(),
            offload_weight: DEFAULT_OFFLOAD_WEIGHT,
        }
    }
}

impl OccupancyIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// How much an offloaded block counts against a GPU one, clamped to
    /// `0..=1`.
    pub fn set_offload_weight(&mut self, weight: f32) {
        self.offload_weight = if weight.is_finite() {
            weight.clamp(0.0, 1.0)
        } else {
            DEFAULT_OFFLOAD_WEIGHT
        };
    }

    /// Applies one event to `slot`'s blocks. On error nothing changes.
    pub fn apply(&mut self, slot: Slot, event: CacheEvent<'_>) -> Result<(), IndexError> {
        match event {
            CacheEvent::Snapshot { capacity, blocks } => self.snapshot(slot, capacity, blocks),
            CacheEvent::Stored(blocks) => {
                let ep = self.endpoint(slot)?;
                let would_hold = ep.physical + blocks.len();
                if would_hold > ep.capacity {
                    return Err(IndexError::OverCapacity {
                        slot: slot.0,
                        capacity: ep.capacity,
                        would_hold,
                    });
                }
                self.store(slot, GPU, blocks);
                Ok(())
            }
            CacheEvent::Offloaded(blocks) => {
                self.endpoint(slot)?;
                self.store(slot, OFFLOADED, blocks);
                Ok(())
            }
            CacheEvent::Removed(blocks) => self.remove_all(slot, GPU, blocks),
            CacheEvent::OffloadRemoved(blocks) => self.remove_all(slot, OFFLOADED, blocks),
            CacheEvent::Cleared => {
                let capacity = self.endpoint(slot)?.capacity;
                self.snapshot(slot, capacity, &[])
            }
            CacheEvent::OffloadCleared => self.clear_tier(slot, OFFLOADED),
            CacheEvent::GpuCleared => self.clear_tier(slot, GPU),
        }
    }

    fn clear_tier(&mut self, slot: Slot, tier: usize) -> Result<(), IndexError> {
        let distinct = self.endpoint(slot)?.distinct[tier];
        self.tiers[tier].remove_slot(slot, distinct);
        let ep = self.endpoint_mut(slot);
        ep.distinct[tier] = 0;
        if tier == GPU {
            ep.physical = 0;
        }
        Ok(())
    }

    fn remove_all(
        &mut self,
        slot: Slot,
        tier: usize,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        self.endpoint(slot)?;
        for (i, &block) in blocks.iter().enumerate() {
            if !self.remove(slot, tier, block) {
                // Put back what this event removed, so a refused event
                // changes nothing.
                self.store(slot, tier, &blocks[..i]);
                return Err(IndexError::NotHeld {
                    slot: slot.0,
                    block,
                });
            }
        }
        Ok(())
    }

    fn endpoint(&self, slot: Slot) -> Result<&EndpointBlocks, IndexError> {
        self.endpoints
            .get(slot.index())
            .and_then(Option::as_ref)
            .ok_or(IndexError::NoSnapshot(slot.0))
    }

    fn endpoint_mut(&mut self, slot: Slot) -> &mut EndpointBlocks {
        self.endpoints[slot.index()]
            .as_mut()
            .expect("callers check the endpoint first")
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
            physical: 0,
            distinct: [0, 0],
        });
        self.tiers[GPU].blocks.reserve(blocks.len());
        self.store(slot, GPU, blocks);
        Ok(())
    }

    /// Adds one copy of each block to `slot`'s `tier` (capacity already
    /// checked).
    fn store(&mut self, slot: Slot, tier: usize, blocks: &[BlockHash]) {
        let new = self.tiers[tier].store(slot, blocks);
        let ep = self.endpoint_mut(slot);
        if tier == GPU {
            ep.physical += blocks.len();
        }
        ep.distinct[tier] += new;
    }

    /// Removes one copy of `block` from `slot`'s `tier`; false if it holds
    /// none.
    fn remove(&mut self, slot: Slot, tier: usize, block: BlockHash) -> bool {
        let Some(last_copy) = self.tiers[tier].remove(slot, block) else {
            return false;
        };
        let ep = self.endpoint_mut(slot);
        if tier == GPU {
            ep.physical -= 1;
        }
        ep.distinct[tier] -= usize::from(last_copy);
        true
    }

    /// Forgets everything `slot` holds, and the slot itself (its next event
    /// must be a snapshot).
    pub fn remove_endpoint(&mut self, slot: Slot) {
        let Some(ep) = self.endpoints.get_mut(slot.index()).and_then(Option::take) else {
            return;
        };
        for (tier, table) in self.tiers.iter_mut().enumerate() {
            table.remove_slot(slot, ep.distinct[tier]);
        }
    }

    /// For each slot, how many leading blocks of `chain` it holds, written to
    /// `out[slot]` (`out` is resized to cover every slot; slots without a
    /// snapshot get 0). One pass over the chain, stopping once no slot is
    /// still matching. Where offloaded blocks extend a slot's GPU prefix,
    /// each counts as the offload weight of a block (rounded down).
    pub fn longest_prefix(&self, chain: &[BlockHash], out: &mut Vec<u32>) {
        self.depths(chain, false, out);
        if self.tiers[OFFLOADED].blocks.is_empty() || self.offload_weight == 0.0 {
            return;
        }
        let mut either = Vec::new();
        self.depths(chain, true, &mut either);
        for (gpu, any) in out.iter_mut().zip(either) {
            *gpu += ((any - *gpu) as f32 * self.offload_weight) as u32;
        }
    }

    /// Leading blocks of `chain` per slot, held on the GPU (or, with
    /// `either`, on the GPU or offloaded).
    fn depths(&self, chain: &[BlockHash], either: bool, out: &mut Vec<u32>) {
        out.clear();
        out.resize(self.endpoints.len(), 0);
        let words = self.endpoints.len().div_ceil(64).max(1);
        let tier = |t: usize, block: &BlockHash| {
            self.tiers[t]
                .blocks
                .get(block)
                .map_or(&[][..], Holders::words)
        };
        let held = |block: &BlockHash| {
            let gpu = tier(GPU, block);
            let offloaded = if either { tier(OFFLOADED, block) } else { &[] };
            move |w: usize| {
                gpu.get(w).copied().unwrap_or(0) | offloaded.get(w).copied().unwrap_or(0)
            }
        };
        let Some(first) = chain.first() else {
            return;
        };
        let first = held(first);
        let mut active: Vec<u64> = (0..words).map(first).collect();
        if active.iter().all(|&w| w == 0) {
            return;
        }
        for (depth, block) in chain.iter().enumerate().skip(1) {
            let held = held(block);
            let mut any = false;
            for (w, word) in active.iter_mut().enumerate() {
                let keep = *word & held(w);
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

    /// Whether any endpoint holds `block`, on the GPU or offloaded. A chain
    /// none of whose endpoints holds its block `k` has no prefix held past
    /// `k`: [`longest_prefix`](Self::longest_prefix) needs no later block.
    pub fn holds_any(&self, block: BlockHash) -> bool {
        self.tiers.iter().any(|t| t.blocks.contains_key(&block))
    }

    /// Whether `slot` holds `block` in its GPU cache.
    pub fn holds(&self, slot: Slot, block: BlockHash) -> bool {
        self.tiers[GPU]
            .blocks
            .get(&block)
            .is_some_and(|h| h.test(slot.index()))
    }

    /// The distinct GPU blocks `slot` holds (a scan of the whole index: for
    /// tests and debugging, not the request path).
    pub fn blocks_of(&self, slot: Slot) -> impl Iterator<Item = BlockHash> + '_ {
        self.tiers[GPU]
            .blocks
            .iter()
            .filter(move |(_, h)| h.test(slot.index()))
            .map(|(&b, _)| b)
    }

    /// Physical GPU blocks `slot` holds, and its capacity; `None` without a
    /// snapshot.
    pub fn usage(&self, slot: Slot) -> Option<(usize, usize)> {
        self.endpoint(slot)
            .ok()
            .map(|ep| (ep.physical, ep.capacity))
    }

    /// Distinct offloaded blocks `slot` holds.
    pub fn offloaded(&self, slot: Slot) -> usize {
        self.endpoint(slot).map_or(0, |ep| ep.distinct[OFFLOADED])
    }

    /// (block, endpoint) entries in the index, GPU tier.
    pub fn entries(&self) -> usize {
        self.endpoints
            .iter()
            .flatten()
            .map(|ep| ep.distinct[GPU])
            .sum()
    }

    /// Distinct blocks held by any endpoint's GPU cache.
    pub fn distinct_blocks(&self) -> usize {
        self.tiers[GPU].blocks.len()
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
