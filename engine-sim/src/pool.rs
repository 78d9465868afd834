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

use std::collections::HashMap;

use kvroute_core::hash::BlockHash;

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
    /// Blocks cached, in chain order; `parent` is the hash before the first.
    Stored {
        /// The blocks.
        hashes: Vec<BlockHash>,
        /// The hash of the block before the first, if any.
        parent: Option<BlockHash>,
        /// Their tokens, block after block.
        token_ids: Vec<u32>,
        /// Each block's extra keys as vLLM's events list them: the LoRA
        /// adapter's name, then the cache salt on block 0.
        extra_keys: Vec<Vec<String>>,
        /// The LoRA adapter (vLLM's `lora_id` and `lora_name`), if any.
        lora: Option<(u64, String)>,
    },
    /// Blocks evicted.
    Removed(Vec<BlockHash>),
    /// Every cached block dropped.
    Cleared,
}

/// What vLLM's `BlockStored` event says of a block besides its hash.
#[derive(Clone, Copy, Debug, Default)]
pub struct Content<'a> {
    /// The block's tokens.
    pub tokens: &'a [u32],
    /// The request's LoRA adapter: vLLM's `lora_id` and name.
    pub lora: Option<(u64, &'a str)>,
    /// The request's cache salt, given for block 0 only.
    pub salt: Option<&'a str>,
}

/// Blocks handed to a request.
#[derive(Debug, Default)]
pub struct Allocation {
    /// Block ids in sequence order.
    pub blocks: Vec<u32>,
    /// Leading blocks that were already cached.
    pub cached_blocks: usize,
}

/// The pool. See the module docs.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    free_head: u32,
    free_tail: u32,
    free_len: usize,
    cached: HashMap<BlockHash, u32>,
    events: Vec<PoolEvent>,
    /// Prompt tokens looked up, and of those found cached (vLLM's
    /// prefix-cache queries and hits).
    pub queries: u64,
    /// See `queries`.
    pub hits: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = BlockPool {
            block_size,
            blocks: Vec::with_capacity(num_blocks),
            free_head: NIL,
            free_tail: NIL,
            free_len: 0,
            cached: HashMap::new(),
            events: Vec::new(),
            queries: 0,
            hits: 0,
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

    /// Blocks not in use by any request (cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.free_len
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

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Allocates a request's prompt of `num_tokens` tokens whose full-block
    /// hashes are `hashes`, reusing its cached prefix, if the pool can also
    /// still hand out `reserve` more blocks afterwards. `None` when it
    /// cannot (the request waits).
    pub fn allocate(
        &mut self,
        hashes: &[BlockHash],
        num_tokens: usize,
        reserve: usize,
    ) -> Option<Allocation> {
        let hit = self.lookup(hashes, num_tokens);
        let hit_ids: Vec<u32> = hashes[..hit].iter().map(|h| self.cached[h]).collect();
        let hit_free = hit_ids
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count();
        let new = self.blocks_for(num_tokens).saturating_sub(hit);
        if self.free_len - hit_free < new + reserve {
            return None;
        }
        self.queries += num_tokens as u64;
        self.hits += (hit * self.block_size) as u64;
        for &b in &hit_ids {
            self.pin(b);
        }
        let mut blocks = hit_ids;
        for _ in 0..new {
            blocks.push(self.take_free().expect("checked above"));
        }
        Some(Allocation {
            blocks,
            cached_blocks: hit,
        })
    }

    /// Takes one more block for a growing sequence (evicting the least
    /// recently freed cached block if needed). `None` when every block is
    /// in use.
    pub fn grow(&mut self) -> Option<u32> {
        self.take_free()
    }

    /// Caches `block`, now full, under `hash`; `parent` is the hash of the
    /// block before it in its sequence. Does nothing if the hash is already
    /// cached.
    pub fn cache(
        &mut self,
        block: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        content: Content<'_>,
    ) {
        if self.cached.contains_key(&hash) || self.blocks[block as usize].hash.is_some() {
            return;
        }
        self.blocks[block as usize].hash = Some(hash);
        self.cached.insert(hash, block);
        let keys: Vec<String> = content
            .lora
            .map(|(_, name)| name)
            .into_iter()
            .chain(content.salt)
            .map(str::to_owned)
            .collect();
        match self.events.last_mut() {
            Some(PoolEvent::Stored {
                hashes,
                token_ids,
                extra_keys,
                ..
            }) if hashes.last().copied() == parent => {
                hashes.push(hash);
                token_ids.extend_from_slice(content.tokens);
                extra_keys.push(keys);
            }
            _ => self.events.push(PoolEvent::Stored {
                hashes: vec![hash],
                parent,
                token_ids: content.tokens.to_vec(),
                extra_keys: vec![keys],
                lora: content.lora.map(|(id, name)| (id, name.to_owned())),
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a request of `hashes.len()` full blocks (block size 4) through
    /// prefill: allocate, cache every block, return its allocation.
    fn prefill(pool: &mut BlockPool, hashes: &[u64]) -> Allocation {
        let tokens = hashes.len() * 4 + 1;
        let a = pool.allocate(hashes, tokens, 0).unwrap();
        let mut parent = None;
        for (i, &h) in hashes.iter().enumerate() {
            pool.cache(a.blocks[i], h, parent, Content::default());
            parent = Some(h);
        }
        a
    }

    #[test]
    fn reuses_the_cached_prefix_up_to_num_tokens_minus_one() {
        let mut pool = BlockPool::new(10, 4);
        let a = prefill(&mut pool, &[1, 2, 3]);
        pool.free(&a.blocks);
        assert_eq!(pool.lookup(&[1, 2, 3], 13), 3);
        assert_eq!(pool.lookup(&[1, 2, 9], 13), 2);
        // 12 tokens = exactly 3 full blocks: vLLM computes the last token,
        // so only 2 blocks are reused.
        assert_eq!(pool.lookup(&[1, 2, 3], 12), 2);
        let b = pool.allocate(&[1, 2, 3], 13, 0).unwrap();
        assert_eq!(b.cached_blocks, 3);
        assert_eq!(&b.blocks[..3], &a.blocks[..3]);
        assert_eq!(b.blocks.len(), 4);
        assert_eq!((pool.queries, pool.hits), (13 + 13, 12));
    }

    #[test]
    fn evicts_tails_before_heads_and_never_pinned_blocks() {
        let mut pool = BlockPool::new(6, 4);
        // Request A: blocks 1, 2, 3 (+ a partial block), freed.
        let a = prefill(&mut pool, &[1, 2, 3]);
        pool.free(&a.blocks);
        // Request B pins block 1 (A's head) and is still running.
        let b = pool.allocate(&[1, 7], 9, 0).unwrap();
        assert_eq!(b.cached_blocks, 1);
        pool.take_events();
        // The pool has 6 blocks: B holds 3; the 3 free are A's tail block 3,
        // A's block 2 and A's partial block, freed tail first. Taking them
        // evicts 3 before 2; 1 is pinned and stays.
        assert_eq!(pool.grow().map(|_| ()), Some(()));
        assert_eq!(pool.grow().map(|_| ()), Some(()));
        assert_eq!(pool.take_events(), vec![PoolEvent::Removed(vec![3])]);
        pool.grow().unwrap();
        assert_eq!(pool.take_events(), vec![PoolEvent::Removed(vec![2])]);
        assert_eq!(pool.grow(), None, "the rest is pinned");
        assert!(pool.lookup(&[1], 5) == 1);
    }

    #[test]
    fn allocation_waits_when_blocks_are_short() {
        let mut pool = BlockPool::new(4, 4);
        let a = pool.allocate(&[], 12, 0).unwrap();
        assert_eq!(a.blocks.len(), 3);
        assert!(pool.allocate(&[], 8, 0).is_none());
        assert!(pool.allocate(&[], 4, 1).is_none(), "reserve counts");
        assert!(pool.allocate(&[], 4, 0).is_some());
        assert_eq!(pool.usage(), 1.0);
    }

    #[test]
    fn events_follow_the_cache_in_order() {
        let mut pool = BlockPool::new(6, 4);
        let a = prefill(&mut pool, &[1, 2]);
        assert_eq!(
            pool.take_events(),
            vec![PoolEvent::Stored {
                hashes: vec![1, 2],
                parent: None,
                token_ids: Vec::new(),
                extra_keys: vec![Vec::new(), Vec::new()],
                lora: None,
            }]
        );
        // A duplicate hash is not cached twice.
        let b = pool.allocate(&[5], 5, 0).unwrap();
        pool.cache(b.blocks[0], 1, None, Content::default());
        assert!(pool.take_events().is_empty());
        pool.free(&a.blocks);
        pool.free(&b.blocks);
        assert!(pool.reset());
        assert_eq!(pool.take_events(), vec![PoolEvent::Cleared]);
        assert_eq!(pool.cached_blocks(), 0);
        let c = pool.allocate(&[], 4, 0).unwrap();
        assert!(!pool.reset(), "refused while a block is in use");
        pool.free(&c.blocks);
    }
}
