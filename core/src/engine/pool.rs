//! vLLM's KV block pool, as far as routing can tell: which blocks are
//! cached, which are pinned, and what gets evicted first.
//!
//! - The pool has a fixed number of blocks. A block in use by a running
//!   request has a reference count above zero and is never evicted.
//! - Only full blocks are cached, keyed by their hash (the u64 of vLLM's KV
//!   events). A request that starts with cached blocks reuses them, up to
//!   `num_tokens - 1` tokens (vLLM always computes the last prompt token).
//! - Blocks whose count drops to zero join the tail of a free queue, still
//!   cached; allocation takes from the head and evicts what it takes. A
//!   request's blocks are freed tail first, so a sequence's tail is evicted
//!   before its head.
//! - Every change to the cached set is recorded as an event (stored in chain
//!   order, removed, cleared), in order, for the WatchCache stream.
//!
//! Unlike vLLM, a block whose hash is already cached by another block (the
//! same prefix computed twice concurrently) is not cached again: the pool
//! keeps one copy of each hash. vLLM keeps both and reports both; the router
//! handles either.
//!
//! Memory: 16 bytes per block plus a hash-map entry (about 16 bytes) per
//! cached block.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::hash::BlockHash;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    /// Free-queue links; meaningful while `ref_cnt == 0`.
    prev: u32,
    next: u32,
}

/// A change to the set of cached blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolEvent {
    /// Blocks cached, in chain order: blocks `first..first + hashes.len()`
    /// of `request`'s sequence; `parent` is the hash before the first.
    Stored {
        /// The request whose blocks these are (its content is the
        /// caller's to describe).
        request: u64,
        /// The position of the first block in the request's sequence.
        first: usize,
        /// The blocks.
        hashes: Vec<BlockHash>,
        /// The hash of the block before the first, if any.
        parent: Option<BlockHash>,
    },
    /// Blocks evicted.
    Removed(Vec<BlockHash>),
    /// Every cached block dropped.
    Cleared,
}

/// The pool. See the module docs.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    free_head: u32,
    free_tail: u32,
    free_len: usize,
    /// Free blocks that hold a hash.
    cached_free: usize,
    cached: HashMap<BlockHash, u32, RandomState>,
    events: Vec<PoolEvent>,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = BlockPool {
            block_size: block_size.max(1),
            blocks: Vec::with_capacity(num_blocks),
            free_head: NIL,
            free_tail: NIL,
            free_len: 0,
            cached_free: 0,
            cached: HashMap::default(),
            events: Vec::new(),
        };
        for id in 0..num_blocks as u32 {
            pool.blocks.push(Block {
                ref_cnt: 0,
                hash: None,
                prev: NIL,
                next: NIL,
            });
            pool.push_free(id);
        }
        pool
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks not in use by any request (cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.free_len
    }

    /// Free blocks that still hold a cached prefix.
    pub fn cached_free_blocks(&self) -> usize {
        self.cached_free
    }

    /// Share of blocks in use, as vLLM's `kv_cache_usage_perc`.
    pub fn usage(&self) -> f32 {
        if self.blocks.is_empty() {
            0.0
        } else {
            1.0 - self.free_len as f32 / self.blocks.len() as f32
        }
    }

    /// Every cached block hash.
    pub fn resident(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.cached.keys().copied()
    }

    /// Cached blocks.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Leading blocks of `hashes` a request of `num_tokens` tokens can
    /// reuse (at most `num_tokens - 1` tokens' worth).
    pub fn lookup(&self, hashes: &[BlockHash], num_tokens: usize) -> usize {
        let max = num_tokens.saturating_sub(1) / self.block_size;
        hashes
            .iter()
            .take(max)
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// How many of `hashes` (cached) a running request holds.
    pub fn held(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.cached
                    .get(h)
                    .is_some_and(|&b| self.blocks[b as usize].ref_cnt > 0)
            })
            .count()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Pins the cached blocks of `hashes[..hit]` (found by [`lookup`]) and
    /// takes `new` more, if the pool has them besides the cached ones.
    /// `None` (and nothing changed) when it has not.
    ///
    /// [`lookup`]: BlockPool::lookup
    pub fn allocate(&mut self, hashes: &[BlockHash], hit: usize, new: usize) -> Option<Vec<u32>> {
        let hit_ids: Vec<u32> = hashes[..hit].iter().map(|h| self.cached[h]).collect();
        let hit_free = hit_ids
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count();
        if self.free_len - hit_free < new {
            return None;
        }
        for &b in &hit_ids {
            self.pin(b);
        }
        let mut blocks = hit_ids;
        for _ in 0..new {
            blocks.push(self.take_free().expect("checked above"));
        }
        Some(blocks)
    }

    /// Takes `n` more blocks for a growing sequence (evicting the least
    /// recently freed cached blocks), appended to `blocks`; false (and
    /// nothing taken) when fewer than `n` are free.
    pub fn grow(&mut self, blocks: &mut Vec<u32>, n: usize) -> bool {
        if self.free_len < n {
            return false;
        }
        for _ in 0..n {
            blocks.push(self.take_free().expect("checked above"));
        }
        true
    }

    /// Caches `block`, now full, under `hash`, as block `index` of
    /// `request`'s sequence; `parent` is the hash of the block before it.
    /// Does nothing if the hash is already cached.
    pub fn cache(
        &mut self,
        block: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        request: u64,
        index: usize,
    ) {
        if self.cached.contains_key(&hash) || self.blocks[block as usize].hash.is_some() {
            return;
        }
        self.blocks[block as usize].hash = Some(hash);
        self.cached.insert(hash, block);
        match self.events.last_mut() {
            Some(PoolEvent::Stored {
                request: r,
                first,
                hashes,
                ..
            }) if *r == request
                && *first + hashes.len() == index
                && hashes.last().copied() == parent =>
            {
                hashes.push(hash);
            }
            _ => self.events.push(PoolEvent::Stored {
                request,
                first: index,
                hashes: vec![hash],
                parent,
            }),
        }
    }

    /// Releases a request's blocks, tail first.
    pub fn free(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.push_free(b);
            }
        }
    }

    /// Drops every cached block (vLLM's `reset_prefix_cache`). Refused
    /// (false) while any block is in use, as vLLM does.
    pub fn reset(&mut self) -> bool {
        if self.free_len != self.blocks.len() {
            return false;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        self.cached_free = 0;
        self.events.push(PoolEvent::Cleared);
        true
    }

    /// Forgets every cached hash, pinned blocks' included, without an event:
    /// the cache restarted, and subscribers start over from a snapshot of a
    /// new incarnation. Blocks in use stay in use.
    pub fn forget(&mut self) {
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        self.cached_free = 0;
        self.events.clear();
    }

    /// The events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }

    fn pin(&mut self, b: u32) {
        if self.blocks[b as usize].ref_cnt == 0 {
            self.unlink(b);
        }
        self.blocks[b as usize].ref_cnt += 1;
    }

    fn take_free(&mut self) -> Option<u32> {
        let b = self.free_head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        self.blocks[b as usize].ref_cnt = 1;
        if let Some(hash) = self.blocks[b as usize].hash.take() {
            self.cached.remove(&hash);
            match self.events.last_mut() {
                Some(PoolEvent::Removed(hashes)) => hashes.push(hash),
                _ => self.events.push(PoolEvent::Removed(vec![hash])),
            }
        }
        Some(b)
    }

    fn push_free(&mut self, b: u32) {
        let tail = self.free_tail;
        {
            let block = &mut self.blocks[b as usize];
            block.prev = tail;
            block.next = NIL;
        }
        match tail {
            NIL => self.free_head = b,
            t => self.blocks[t as usize].next = b,
        }
        self.free_tail = b;
        self.free_len += 1;
        self.cached_free += usize::from(self.blocks[b as usize].hash.is_some());
    }

    fn unlink(&mut self, b: u32) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        match prev {
            NIL => self.free_head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.free_tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
        self.free_len -= 1;
        self.cached_free -= usize::from(self.blocks[b as usize].hash.is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a request of `hashes.len()` full blocks (block size 4) through
    /// prefill: allocate, cache every block, return its blocks.
    fn prefill(pool: &mut BlockPool, hashes: &[u64]) -> Vec<u32> {
        let tokens = hashes.len() * 4 + 1;
        let hit = pool.lookup(hashes, tokens);
        let blocks = pool
            .allocate(hashes, hit, pool.blocks_for(tokens) - hit)
            .unwrap();
        let mut parent = None;
        for (i, &h) in hashes.iter().enumerate() {
            pool.cache(blocks[i], h, parent, 7, i);
            parent = Some(h);
        }
        blocks
    }

    #[test]
    fn reuses_the_cached_prefix_up_to_num_tokens_minus_one() {
        let mut pool = BlockPool::new(10, 4);
        let a = prefill(&mut pool, &[1, 2, 3]);
        pool.free(&a);
        assert_eq!(pool.lookup(&[1, 2, 3], 13), 3);
        assert_eq!(pool.lookup(&[1, 2, 9], 13), 2);
        // 12 tokens = exactly 3 full blocks: vLLM computes the last token,
        // so only 2 blocks are reused.
        assert_eq!(pool.lookup(&[1, 2, 3], 12), 2);
        let b = pool.allocate(&[1, 2, 3], 3, 1).unwrap();
        assert_eq!(&b[..3], &a[..3]);
        assert_eq!(b.len(), 4);
    }

    #[test]
    fn evicts_tails_before_heads_and_never_pinned_blocks() {
        let mut pool = BlockPool::new(6, 4);
        // Request A: blocks 1, 2, 3 (+ a partial block), freed.
        let a = prefill(&mut pool, &[1, 2, 3]);
        pool.free(&a);
        // Request B pins block 1 (A's head) and takes two more.
        let mut b = pool.allocate(&[1, 7], 1, 2).unwrap();
        pool.take_events();
        // B holds 3 of 6; the 3 free are, freed tail first, A's partial
        // block, its block 3 and its block 2. Taking them evicts 3 before
        // 2; 1 is pinned and stays.
        assert_eq!(pool.free_blocks(), 3);
        assert!(pool.grow(&mut b, 2));
        assert_eq!(pool.take_events(), vec![PoolEvent::Removed(vec![3])]);
        assert!(pool.grow(&mut b, 1));
        assert_eq!(pool.take_events(), vec![PoolEvent::Removed(vec![2])]);
        assert!(!pool.grow(&mut b, 1), "the rest is pinned");
        assert_eq!(pool.lookup(&[1], 5), 1);
    }

    #[test]
    fn allocation_waits_when_blocks_are_short() {
        let mut pool = BlockPool::new(4, 4);
        let a = pool.allocate(&[], 0, 3).unwrap();
        assert_eq!(a.len(), 3);
        assert!(pool.allocate(&[], 0, 2).is_none());
        let mut b = pool.allocate(&[], 0, 1).unwrap();
        assert!(!pool.grow(&mut b, 1));
        assert_eq!(pool.usage(), 1.0);
    }

    #[test]
    fn a_cached_free_block_counts_once_when_pinned_by_its_own_request() {
        let mut pool = BlockPool::new(3, 4);
        let a = prefill(&mut pool, &[1, 2]);
        pool.free(&a);
        // 3 free blocks, two of them the cached hit: the hit plus one new
        // block fits, the hit plus two does not.
        assert!(pool.allocate(&[1, 2], 2, 2).is_none());
        assert!(pool.allocate(&[1, 2], 2, 1).is_some());
    }

    #[test]
    fn events_follow_the_cache_in_order() {
        let mut pool = BlockPool::new(6, 4);
        let a = prefill(&mut pool, &[1, 2]);
        assert_eq!(
            pool.take_events(),
            vec![PoolEvent::Stored {
                request: 7,
                first: 0,
                hashes: vec![1, 2],
                parent: None,
            }]
        );
        // A duplicate hash is not cached twice.
        let b = pool.allocate(&[5], 0, 1).unwrap();
        pool.cache(b[0], 1, None, 8, 0);
        assert!(pool.take_events().is_empty());
        pool.free(&a);
        pool.free(&b);
        assert!(pool.reset());
        assert_eq!(pool.take_events(), vec![PoolEvent::Cleared]);
        assert_eq!(pool.cached_blocks(), 0);
        let c = pool.allocate(&[], 0, 1).unwrap();
        assert!(!pool.reset(), "refused while a block is in use");
        pool.free(&c);
    }
}
