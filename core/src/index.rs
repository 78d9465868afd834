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
//! One table per tier, block hash → bitset of the slots holding it: 8 bytes
//! of key, 16 bytes of bitset (a 64-bit word inline; a boxed word slice once
//! a pool has more than 64 slots) and a control byte, in SwissTables kept
//! between 7/16 and 7/8 full. That is 28 to 55 bytes per distinct block,
//! shared by all its holders, so a (block, endpoint) entry costs at most
//! about 55 bytes, and less when endpoints share blocks. Applying a stored
//! or removed block touches that one table once.
//!
//! Each table is split into [`SHARDS`] shards by a randomly keyed hash of the
//! block (an engine cannot aim its hashes at one shard), so growing a table
//! rehashes one shard, 1/64 of it, at a time, and forgetting an endpoint can
//! be done a shard at a time ([`begin_remove_endpoint`] and
//! [`remove_step`]): a caller that holds a lock around the index releases it
//! between steps, and no step costs more than a scan of one shard.
//!
//! [`begin_remove_endpoint`]: OccupancyIndex::begin_remove_endpoint
//! [`remove_step`]: OccupancyIndex::remove_step
//!
//! ## Bounds
//!
//! What one endpoint can make the index hold is bounded twice:
//!
//! 1. By the capacity it reported: a GPU delta that would exceed it is
//!    refused with [`IndexError::OverCapacity`] (the engine contradicts
//!    itself), and the caller resyncs that endpoint.
//! 2. By the index's own [`Bounds`], per tier and per endpoint, whatever the
//!    engine claims: blocks stored beyond the bound are dropped (the first
//!    ones of a batch are kept, in chain order) and counted
//!    ([`dropped`](OccupancyIndex::dropped)). A dropped block is one the
//!    index does not know, so it can only cost a miss, never a false hit.
//!    The tier is then *lossy* until it is complete again (a snapshot or a
//!    clear): a removal of a block it does not hold may be one it dropped,
//!    so it is ignored instead of refused. Every block the engine removes
//!    still goes: the index holds no more copies of a block than the
//!    engine does.
//!
//! The default bounds are unbounded; the router sets its own
//! (`limits.maxIndexBlocksPerEndpoint`, `limits.maxOffloadedBlocksPerEndpoint`).
//!
//! Reference counts follow vLLM: two physical blocks can carry the same hash
//! (the same prefix computed twice concurrently), each stored and removed on
//! its own. The hash stays held until its last copy is removed, and every
//! copy counts against the capacity and the bounds. Extra copies are rare
//! and live in a small side table.
//!
//! ## Evicted blocks
//!
//! A block an engine removes (a `Removed` event, not a snapshot, a clear or
//! a forgotten endpoint) that no endpoint holds afterwards goes to a bounded
//! set of [recently evicted](crate::evicted) blocks, 8 bytes each, so a
//! missed block can be told lost to capacity from never seen.
//!
//! ## Offloaded blocks
//!
//! Blocks an engine keeps on another medium than its GPU cache (vLLM's KV
//! offloading to CPU memory or disk) live in a second table of the same
//! shape, one tier for every such medium. They do not count against the
//! capacity, which is the GPU cache's, but against their own bound. A
//! request's prefix is served from the GPU as far as the GPU holds it, then
//! loaded back from the offloaded tier as far as either holds it; loading is
//! cheaper than computing but not free, so
//! [`longest_prefix`](OccupancyIndex::longest_prefix) counts each offloaded
//! block of the prefix as [`offload_weight`] of a GPU block
//! (`policy.offloadWeight`, default [`DEFAULT_OFFLOAD_WEIGHT`]).
//!
//! [`offload_weight`]: OccupancyIndex::set_offload_weight

use std::collections::HashMap;
use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use crate::evicted::RecentlyEvicted;
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

/// Shards per tier table (see the module docs).
pub const SHARDS: usize = 1 << SHARD_BITS;
const SHARD_BITS: u32 = 6;

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

/// A tier of the index: the GPU cache, or every offload medium together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The GPU cache (the medium the capacity is of).
    Gpu,
    /// Any other medium (CPU memory, disk).
    Offloaded,
}

impl Tier {
    /// Both tiers.
    pub const ALL: [Tier; 2] = [Tier::Gpu, Tier::Offloaded];

    /// As a metric label: `gpu` or `offloaded`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Offloaded => "offloaded",
        }
    }

    fn index(self) -> usize {
        match self {
            Tier::Gpu => GPU,
            Tier::Offloaded => OFFLOADED,
        }
    }
}

/// The most blocks (copies included) the index holds per endpoint and tier,
/// whatever the endpoint reports; see the module docs. The GPU bound in
/// effect is the smaller of `gpu` and the endpoint's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// GPU blocks per endpoint.
    pub gpu: usize,
    /// Offloaded blocks per endpoint.
    pub offloaded: usize,
}

impl Bounds {
    /// No bound beyond the reported capacity (the default).
    pub const UNBOUNDED: Bounds = Bounds {
        gpu: usize::MAX,
        offloaded: usize::MAX,
    };

    fn of(&self, tier: usize) -> usize {
        if tier == GPU {
            self.gpu
        } else {
            self.offloaded
        }
    }
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds::UNBOUNDED
    }
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
    /// Physical blocks held per tier (GPU, offloaded), copies included.
    held: [usize; 2],
    /// Distinct blocks held, per tier.
    distinct: [usize; 2],
    /// Per tier: blocks were dropped to stay within a bound since the tier
    /// was last complete (see the module docs).
    lossy: [bool; 2],
}

/// One shard of a tier: block → holders, and copies beyond the first.
#[derive(Clone, Debug, Default)]
struct Shard {
    blocks: HashMap<BlockHash, Holders, RandomState>,
    /// (block, slot) → copies beyond the first.
    copies: HashMap<(BlockHash, u32), u32, RandomState>,
}

/// One tier's table, in shards picked by a keyed hash of the block.
#[derive(Clone, Debug)]
struct Table {
    shards: Box<[Shard]>,
    pick: RandomState,
    /// Distinct blocks over every shard.
    len: usize,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            pick: RandomState::default(),
            len: 0,
        }
    }
}

impl Table {
    fn shard_of(&self, block: BlockHash) -> usize {
        (self.pick.hash_one(block) >> (64 - SHARD_BITS)) as usize
    }

    fn get(&self, block: &BlockHash) -> Option<&Holders> {
        self.shards[self.shard_of(*block)].blocks.get(block)
    }

    /// Adds one copy of each block to `slot`; returns the new distinct ones.
    fn store(&mut self, slot: Slot, blocks: &[BlockHash]) -> usize {
        let mut new = 0;
        for &block in blocks {
            let shard = &mut self.shards[self.shard_of(block)];
            let holders = shard.blocks.entry(block).or_insert_with(|| {
                self.len += 1;
                Holders::Small(0)
            });
            if holders.test(slot.index()) {
                *shard.copies.entry((block, slot.0)).or_insert(0) += 1;
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
        let shard = &mut self.shards[self.shard_of(block)];
        let holders = shard.blocks.get_mut(&block)?;
        if !holders.test(slot.index()) {
            return None;
        }
        let mut last_copy = true;
        if !shard.copies.is_empty()
            && let Some(extra) = shard.copies.get_mut(&(block, slot.0))
        {
            *extra -= 1;
            if *extra == 0 {
                shard.copies.remove(&(block, slot.0));
            }
            last_copy = false;
        }
        if last_copy && holders.clear(slot.index()) {
            shard.blocks.remove(&block);
            self.len -= 1;
        }
        Some(last_copy)
    }

    /// Forgets `slot`'s blocks in shard `shard`.
    fn remove_slot_in(&mut self, slot: Slot, shard: usize) {
        let shard = &mut self.shards[shard];
        let before = shard.blocks.len();
        shard
            .blocks
            .retain(|_, holders| !holders.clear(slot.index()));
        self.len -= before - shard.blocks.len();
        if !shard.copies.is_empty() {
            shard.copies.retain(|&(_, s), _| s != slot.0);
        }
    }

    /// Forgets `slot`'s blocks (`distinct` of them, some with copies).
    fn remove_slot(&mut self, slot: Slot, distinct: usize) {
        if distinct > 0 {
            for shard in 0..SHARDS {
                self.remove_slot_in(slot, shard);
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = (&BlockHash, &Holders)> {
        self.shards.iter().flat_map(|s| s.blocks.iter())
    }
}

const GPU: usize = 0;
const OFFLOADED: usize = 1;

/// A slot whose entries are being forgotten a shard at a time.
#[derive(Clone, Copy, Debug)]
struct Retiring {
    slot: Slot,
    /// The next shard to scan.
    next: usize,
}

/// Which endpoints of one pool hold which blocks. See the module docs.
#[derive(Clone, Debug)]
pub struct OccupancyIndex {
    tiers: [Table; 2],
    endpoints: Vec<Option<EndpointBlocks>>,
    offload_weight: f32,
    bounds: Bounds,
    /// Blocks dropped to stay within the bounds, per tier, ever.
    dropped: [u64; 2],
    /// Slots being forgotten; their bits in the tables are stale.
    retiring: Vec<Retiring>,
    /// Bitset of the retiring slots, which queries ignore.
    hidden: Vec<u64>,
    /// Blocks removed by their engines and then held by none.
    evicted: RecentlyEvicted,
}

impl Default for OccupancyIndex {
    fn default() -> Self {
        OccupancyIndex {
            tiers: Default::default(),
            endpoints: Vec::new(),
            offload_weight: DEFAULT_OFFLOAD_WEIGHT,
            bounds: Bounds::UNBOUNDED,
            dropped: [0, 0],
            retiring: Vec::new(),
            hidden: Vec::new(),
            evicted: RecentlyEvicted::default(),
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

    /// Sets the per-endpoint bounds. Applies to later stores: blocks held
    /// beyond a lowered bound stay until removed.
    pub fn set_bounds(&mut self, bounds: Bounds) {
        self.bounds = bounds;
    }

    /// The per-endpoint bounds.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// Remembers about the last `blocks` blocks evicted (removed by their
    /// engine and then held by none); 0, the default, none. A change
    /// forgets those remembered.
    pub fn set_evicted_capacity(&mut self, blocks: usize) {
        let fresh = RecentlyEvicted::new(blocks);
        if fresh.capacity() != self.evicted.capacity() {
            self.evicted = fresh;
        }
    }

    /// Whether an engine removed `block` recently and none has held it
    /// since ([`RecentlyEvicted`]).
    pub fn recently_evicted(&self, block: BlockHash) -> bool {
        self.evicted.contains(block)
    }

    /// Evicted blocks forgotten to make room for newer ones, ever.
    pub fn evicted_overflow(&self) -> u64 {
        self.evicted.overflow()
    }

    /// Applies one event to `slot`'s blocks. On error nothing changes.
    pub fn apply(&mut self, slot: Slot, event: CacheEvent<'_>) -> Result<(), IndexError> {
        match event {
            CacheEvent::Snapshot { capacity, blocks } => self.snapshot(slot, capacity, blocks),
            CacheEvent::Stored(blocks) => {
                let ep = self.endpoint(slot)?;
                let would_hold = ep.held[GPU] + blocks.len();
                if would_hold > ep.capacity {
                    return Err(IndexError::OverCapacity {
                        slot: slot.0,
                        capacity: ep.capacity,
                        would_hold,
                    });
                }
                self.store_bounded(slot, GPU, blocks);
                Ok(())
            }
            CacheEvent::Offloaded(blocks) => {
                self.endpoint(slot)?;
                self.store_bounded(slot, OFFLOADED, blocks);
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
        ep.held[tier] = 0;
        ep.lossy[tier] = false;
        Ok(())
    }

    fn remove_all(
        &mut self,
        slot: Slot,
        tier: usize,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        if self.endpoint(slot)?.lossy[tier] {
            // A block not held may be one dropped for the bound.
            for &block in blocks {
                self.remove(slot, tier, block);
            }
            return Ok(());
        }
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
            held: [0, 0],
            distinct: [0, 0],
            lossy: [false, false],
        });
        self.store_bounded(slot, GPU, blocks);
        Ok(())
    }

    /// Adds one copy of each block to `slot`'s `tier` as far as the tier's
    /// bound allows (capacity already checked); drops and counts the rest.
    fn store_bounded(&mut self, slot: Slot, tier: usize, blocks: &[BlockHash]) {
        let bound = self.bounds.of(tier);
        let room = bound.saturating_sub(self.endpoint_mut(slot).held[tier]);
        let kept = blocks.len().min(room);
        if kept < blocks.len() {
            self.dropped[tier] += (blocks.len() - kept) as u64;
            self.endpoint_mut(slot).lossy[tier] = true;
        }
        self.store(slot, tier, &blocks[..kept]);
    }

    /// Adds one copy of each block to `slot`'s `tier` (bounds already
    /// checked).
    fn store(&mut self, slot: Slot, tier: usize, blocks: &[BlockHash]) {
        let new = self.tiers[tier].store(slot, blocks);
        let ep = self.endpoint_mut(slot);
        ep.held[tier] += blocks.len();
        ep.distinct[tier] += new;
    }

    /// Removes one copy of `block` from `slot`'s `tier`; false if it holds
    /// none.
    fn remove(&mut self, slot: Slot, tier: usize, block: BlockHash) -> bool {
        let Some(last_copy) = self.tiers[tier].remove(slot, block) else {
            return false;
        };
        let ep = self.endpoint_mut(slot);
        ep.held[tier] -= 1;
        ep.distinct[tier] -= usize::from(last_copy);
        if last_copy && !self.holds_any(block) {
            self.evicted.insert(block);
        }
        true
    }

    /// Forgets everything `slot` holds, and the slot itself (its next event
    /// must be a snapshot). A scan of every shard: see
    /// [`begin_remove_endpoint`](Self::begin_remove_endpoint) for one in
    /// steps.
    pub fn remove_endpoint(&mut self, slot: Slot) {
        self.begin_remove_endpoint(slot);
        while let Some(i) = self.retiring.iter().position(|r| r.slot == slot) {
            self.retire_step(i);
        }
    }

    /// Forgets `slot` at once for every query and event (its next event
    /// must be a snapshot), leaving its table entries to
    /// [`remove_step`](Self::remove_step). A snapshot for the slot before
    /// they are gone finishes them first.
    pub fn begin_remove_endpoint(&mut self, slot: Slot) {
        let Some(ep) = self.endpoints.get_mut(slot.index()).and_then(Option::take) else {
            return;
        };
        if ep.distinct == [0, 0] {
            return;
        }
        let (word, bit) = (slot.index() / 64, 1u64 << (slot.index() % 64));
        if self.hidden.len() <= word {
            self.hidden.resize(word + 1, 0);
        }
        self.hidden[word] |= bit;
        self.retiring.push(Retiring { slot, next: 0 });
    }

    /// Scans one shard (of each tier) for the first endpoint being removed;
    /// returns whether any removal is still in progress.
    pub fn remove_step(&mut self) -> bool {
        if !self.retiring.is_empty() {
            self.retire_step(0);
        }
        !self.retiring.is_empty()
    }

    fn retire_step(&mut self, i: usize) {
        let Retiring { slot, next } = self.retiring[i];
        for table in &mut self.tiers {
            table.remove_slot_in(slot, next);
        }
        if next + 1 < SHARDS {
            self.retiring[i].next = next + 1;
        } else {
            self.retiring.swap_remove(i);
            self.hidden[slot.index() / 64] &= !(1u64 << (slot.index() % 64));
        }
    }

    fn is_hidden(&self, slot: usize) -> bool {
        self.hidden
            .get(slot / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }

    /// For each slot, how many leading blocks of `chain` it holds, written to
    /// `out[slot]` (`out` is resized to cover every slot; slots without a
    /// snapshot get 0). One pass over the chain, stopping once no slot is
    /// still matching. Where offloaded blocks extend a slot's GPU prefix,
    /// each counts as the offload weight of a block (rounded down).
    pub fn longest_prefix(&self, chain: &[BlockHash], out: &mut Vec<u32>) {
        self.depths(chain, false, out);
        if self.tiers[OFFLOADED].len == 0 || self.offload_weight == 0.0 {
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
        let tier =
            |t: usize, block: &BlockHash| self.tiers[t].get(block).map_or(&[][..], Holders::words);
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
        // Slots being removed hold nothing, whatever their stale bits say.
        let mut active: Vec<u64> = (0..words)
            .map(|w| first(w) & !self.hidden.get(w).copied().unwrap_or(0))
            .collect();
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
    /// (An endpoint being removed may still count: a hint, never a hit.)
    pub fn holds_any(&self, block: BlockHash) -> bool {
        self.tiers.iter().any(|t| t.get(&block).is_some())
    }

    /// Whether `slot` holds `block` in its GPU cache.
    pub fn holds(&self, slot: Slot, block: BlockHash) -> bool {
        !self.is_hidden(slot.index())
            && self.tiers[GPU]
                .get(&block)
                .is_some_and(|h| h.test(slot.index()))
    }

    /// The distinct GPU blocks `slot` holds (a scan of the whole index: for
    /// tests and debugging, not the request path).
    pub fn blocks_of(&self, slot: Slot) -> impl Iterator<Item = BlockHash> + '_ {
        let hidden = self.is_hidden(slot.index());
        self.tiers[GPU]
            .iter()
            .filter(move |(_, h)| !hidden && h.test(slot.index()))
            .map(|(&b, _)| b)
    }

    /// Physical GPU blocks `slot` holds, and its capacity; `None` without a
    /// snapshot.
    pub fn usage(&self, slot: Slot) -> Option<(usize, usize)> {
        self.endpoint(slot)
            .ok()
            .map(|ep| (ep.held[GPU], ep.capacity))
    }

    /// Distinct offloaded blocks `slot` holds.
    pub fn offloaded(&self, slot: Slot) -> usize {
        self.endpoint(slot).map_or(0, |ep| ep.distinct[OFFLOADED])
    }

    /// (block, endpoint) entries in the index, GPU tier.
    pub fn entries(&self) -> usize {
        self.tier_entries(Tier::Gpu)
    }

    /// (block, endpoint) entries in `tier` (endpoints being removed not
    /// counted).
    pub fn tier_entries(&self, tier: Tier) -> usize {
        self.endpoints
            .iter()
            .flatten()
            .map(|ep| ep.distinct[tier.index()])
            .sum()
    }

    /// Blocks dropped from `tier` to stay within the bounds, since the index
    /// was made.
    pub fn dropped(&self, tier: Tier) -> u64 {
        self.dropped[tier.index()]
    }

    /// Distinct blocks held by any endpoint's GPU cache.
    pub fn distinct_blocks(&self) -> usize {
        self.tiers[GPU].len
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
