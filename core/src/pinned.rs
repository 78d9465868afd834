//! Prompt blocks pinned by requests in flight, per endpoint.
//!
//! An engine admits a request when every block it takes from the free pool
//! fits: its uncached blocks, and its cached blocks that no running request
//! holds (a cached block nobody holds sits in the free pool and leaves it
//! when reused). The engines report free and cached-free blocks as counts
//! only, so the router estimates which of a request's cached blocks are
//! held: those that a request it sent to that endpoint, not finished yet,
//! also has. This keeps each request's chain from its start to its finish,
//! reference-counted per endpoint and block.
//!
//! Bounded: at most `capacity` blocks over all requests; a request whose
//! chain does not fit is pinned as far as it fits (a shorter pinned prefix
//! only makes the estimate more cautious) and counted in
//! [`Pinned::truncated`]. Memory: about 48 bytes per (endpoint, block) and
//! 8 per block of each chain kept.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::hash::BlockHash;
use crate::slot::Slot;

/// A pinned chain, to hand back to [`Pinned::unpin`]. Cloned only with
/// the [`Pinned`] it belongs to (the replay forks whole runs).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a pin must be unpinned, or its blocks count as held for ever"]
pub struct Pin(u64);

/// Chains of requests in flight, per endpoint. See the module docs.
#[derive(Clone, Debug)]
pub struct Pinned {
    capacity: usize,
    blocks: usize,
    held: HashMap<(Slot, BlockHash), u32, RandomState>,
    chains: HashMap<u64, (Slot, Vec<BlockHash>), RandomState>,
    next: u64,
    truncated: u64,
}

impl Pinned {
    /// At most `capacity` blocks kept over all requests.
    pub fn new(capacity: usize) -> Self {
        Pinned {
            capacity,
            blocks: 0,
            held: HashMap::default(),
            chains: HashMap::default(),
            next: 0,
            truncated: 0,
        }
    }

    /// Leading blocks of `chain` that a request in flight at `slot` has.
    pub fn leading(&self, slot: Slot, chain: &[BlockHash]) -> u32 {
        if self.held.is_empty() {
            return 0;
        }
        chain
            .iter()
            .take_while(|&&b| self.held.contains_key(&(slot, b)))
            .count() as u32
    }

    /// A request with `chain` was sent to `slot`.
    pub fn pin(&mut self, slot: Slot, chain: &[BlockHash]) -> Pin {
        let room = self.capacity.saturating_sub(self.blocks);
        if chain.len() > room {
            self.truncated += 1;
        }
        let chain = chain[..chain.len().min(room)].to_vec();
        for &b in &chain {
            *self.held.entry((slot, b)).or_default() += 1;
        }
        self.blocks += chain.len();
        let id = self.next;
        self.next += 1;
        self.chains.insert(id, (slot, chain));
        Pin(id)
    }

    /// The request of `pin` finished; returns how many of its blocks other
    /// requests in flight there still hold. A pin of a forgotten endpoint
    /// is ignored.
    pub fn unpin(&mut self, pin: Pin) -> u64 {
        let Some((slot, chain)) = self.chains.remove(&pin.0) else {
            return 0;
        };
        self.blocks -= chain.len();
        let mut still_held = 0;
        for b in chain {
            if let Some(n) = self.held.get_mut(&(slot, b)) {
                *n -= 1;
                if *n == 0 {
                    self.held.remove(&(slot, b));
                } else {
                    still_held += 1;
                }
            }
        }
        still_held
    }

    /// Forgets `slot`: its requests' pins are ignored from now on.
    pub fn forget(&mut self, slot: Slot) {
        self.chains.retain(|_, (s, _)| *s != slot);
        self.blocks = self.chains.values().map(|(_, c)| c.len()).sum();
        self.held.retain(|(s, _), _| *s != slot);
    }

    /// Requests pinned only in part because the capacity was reached.
    pub fn truncated(&self) -> u64 {
        self.truncated
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_count_while_a_request_that_has_them_is_in_flight() {
        let mut p = Pinned::new(100);
        let a = p.pin(Slot(0), &[1, 2, 3]);
        let b = p.pin(Slot(0), &[1, 2, 9]);
        assert_eq!(p.leading(Slot(0), &[1, 2, 3, 4]), 3);
        assert_eq!(p.leading(Slot(1), &[1, 2, 3, 4]), 0);
        p.unpin(a);
        assert_eq!(p.leading(Slot(0), &[1, 2, 3, 4]), 2);
        p.unpin(b);
        assert_eq!(p.leading(Slot(0), &[1, 2, 3, 4]), 0);
        assert_eq!((p.blocks, p.held.len(), p.chains.len()), (0, 0, 0));
    }

    #[test]
    fn the_capacity_bounds_what_is_kept_and_a_forgotten_endpoint_is_ignored() {
        let mut p = Pinned::new(4);
        let a = p.pin(Slot(0), &[1, 2, 3]);
        let b = p.pin(Slot(1), &[1, 2, 3]);
        assert_eq!((p.leading(Slot(1), &[1, 2, 3]), p.truncated()), (1, 1));
        p.forget(Slot(0));
        assert_eq!((p.leading(Slot(0), &[1]), p.blocks), (0, 1));
        p.unpin(a);
        p.unpin(b);
        assert_eq!((p.blocks, p.held.len()), (0, 0));
    }
}
