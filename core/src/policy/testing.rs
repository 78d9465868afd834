//! Fixture builders for policy tests: `Pool::test().replicas(3)`.

use super::*;
use crate::index::CacheEvent;
use crate::rendezvous::endpoint_id;

pub(crate) struct Pool {
    pub endpoints: Vec<Endpoint>,
    pub index: OccupancyIndex,
    pub block_tokens: u64,
    pub now: Instant,
}

impl Pool {
    pub fn test() -> Self {
        Pool {
            endpoints: Vec::new(),
            index: OccupancyIndex::new(),
            block_tokens: 16,
            now: Instant::now(),
        }
    }

    pub fn replicas(mut self, n: u32) -> Self {
        self.endpoints = (0..n)
            .map(|i| Endpoint {
                slot: Slot(i),
                id: endpoint_id(&format!("10.0.0.{i}:8000")),
                load: Load::default(),
                weight: 1.0,
            })
            .collect();
        self
    }

    pub fn in_flight(mut self, i: usize, n: u32) -> Self {
        self.endpoints[i].load.in_flight = n;
        self
    }

    /// Endpoint `i` ramping up at weight `w` (slow start).
    pub fn weight(mut self, i: usize, w: f64) -> Self {
        self.endpoints[i].weight = w;
        self
    }

    pub fn prefill(mut self, i: usize, tokens: u64) -> Self {
        self.endpoints[i].load.prefill_tokens = tokens;
        self.endpoints[i].load.in_flight = self.endpoints[i].load.in_flight.max(1);
        self
    }

    pub fn holds(mut self, i: usize, blocks: &[BlockHash]) -> Self {
        let slot = self.endpoints[i].slot;
        self.index
            .apply(
                slot,
                CacheEvent::Snapshot {
                    capacity: 1 << 20,
                    blocks,
                },
            )
            .unwrap();
        self
    }

    pub fn cx(&self) -> Context<'_> {
        Context {
            index: Some(&self.index),
            block_tokens: self.block_tokens,
            now: self.now,
            pinned: None,
        }
    }

    /// The same facts without the index (approximate mode).
    pub fn approximate(&self) -> Context<'_> {
        Context {
            index: None,
            ..self.cx()
        }
    }

    /// Position of the rendezvous first choice for `key`.
    pub fn rendezvous_first(&self, key: u64) -> usize {
        let ids: Vec<u64> = self.endpoints.iter().map(|e| e.id).collect();
        crate::rendezvous::rank(key, &ids)[0]
    }
}

/// A request with key `key` and a chain of `blocks` 16-token blocks.
pub(crate) fn request(key: u64, chain: &[BlockHash]) -> Request<'_> {
    Request {
        key: RoutingKey(key),
        chain,
        prompt_tokens: chain.len() as u64 * 16 + 5,
        key_prefix_blocks: None,
        output_tokens: 0,
    }
}

/// Asserts `d.ranked` is a permutation of `0..n`.
pub(crate) fn assert_permutation(d: &Decision, n: usize) {
    let mut r = d.ranked.clone();
    r.sort_unstable();
    assert_eq!(r, (0..n).collect::<Vec<_>>(), "{d:?}");
}
