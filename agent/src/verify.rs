//! Checking the agent's hashing flags against the engine's own data: where a
//! `BlockStored` event carries its tokens, its hashes are recomputed with
//! `kvroute-core` under the configured algorithm, seed and block size. A
//! difference means the flags (so the routers configured the same way) do
//! not describe how this vLLM hashes, and every lookup would miss.
//!
//! What can be recomputed: chains that start at block 0 (their parent is
//! `NONE_HASH`), or whose parent was itself recomputed earlier (its full
//! digest is remembered, for a bounded number of blocks), with no extra
//! keys (no LoRA, cache salt or multimodal input: the events do not carry
//! everything those hash). Everything else is counted as unverifiable.

use std::collections::HashMap;

use kvroute_core::hash::{BlockDigest, BlockExtras, BlockHasher};

use crate::events::Stored;

/// Recomputed digests remembered for continuing chains; when full, the
/// memory starts over (verification needs samples, not every block).
const REMEMBERED: usize = 65_536;

/// What checking one event found, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    /// Recomputed and equal.
    pub matched: usize,
    /// Recomputed and different; the first difference:
    /// (reported, recomputed).
    pub mismatched: Option<(u64, u64)>,
    /// Not recomputable (see the module docs).
    pub unverifiable: usize,
}

/// Recomputes events' hashes. See the module docs.
#[derive(Debug)]
pub struct Verifier {
    hasher: BlockHasher,
    digests: HashMap<u64, BlockDigest>,
}

impl Verifier {
    /// A verifier for the configured hashing.
    pub fn new(hasher: BlockHasher) -> Self {
        Verifier {
            hasher,
            digests: HashMap::new(),
        }
    }

    /// Checks one event (whose block size the caller has checked).
    pub fn check(&mut self, s: &Stored) -> Checked {
        let bs = self.hasher.config().block_size;
        let n = s.block_hashes.len();
        let mut out = Checked::default();
        let plain = |i: usize| {
            s.lora_id.is_none()
                && s.lora_name.is_none()
                && s.extra_keys
                    .as_ref()
                    .is_none_or(|keys| keys.get(i).is_none_or(rmpv::Value::is_nil))
        };
        let parent = match s.parent_block_hash {
            None => Some(self.hasher.none_hash()),
            Some(p) => self.digests.get(&p).copied(),
        };
        let (Some(mut parent), true) = (parent, s.token_ids.len() == n * bs) else {
            out.unverifiable = n;
            return out;
        };
        for (i, (&reported, tokens)) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks(bs))
            .enumerate()
        {
            if !plain(i) {
                out.unverifiable = n - i;
                break;
            }
            // The block index matters only for the cache salt (block 0),
            // which a plain block has none of.
            let digest = self
                .hasher
                .block_digest(&parent, i, tokens, BlockExtras::default());
            if digest.to_u64() != reported {
                out.mismatched = Some((reported, digest.to_u64()));
                out.unverifiable = n - i - 1;
                break;
            }
            out.matched += 1;
            if self.digests.len() >= REMEMBERED {
                self.digests.clear();
            }
            self.digests.insert(reported, digest);
            parent = digest;
        }
        out
    }

    /// Forgets a block's digest (it left the cache).
    pub fn forget(&mut self, hash: u64) {
        self.digests.remove(&hash);
    }

    /// Forgets every digest (the cache restarted).
    pub fn clear(&mut self) {
        self.digests.clear();
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::hash::{HashAlgo, HashConfig};

    use super::*;

    fn hasher(algo: HashAlgo, seed: Option<&str>) -> BlockHasher {
        BlockHasher::new(HashConfig {
            algo,
            block_size: 4,
            seed: seed.map(str::to_owned),
            ..HashConfig::default()
        })
        .unwrap()
    }

    fn stored(h: &BlockHasher, tokens: &[u32], skip: usize) -> Stored {
        let hashes = h.hashes(tokens, BlockExtras::default());
        Stored {
            block_hashes: hashes[skip..].to_vec(),
            parent_block_hash: skip.checked_sub(1).map(|p| hashes[p]),
            token_ids: tokens[skip * 4..].to_vec(),
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
        }
    }

    #[test]
    fn the_right_flags_verify_whole_chains_and_their_children() {
        let engine = hasher(HashAlgo::Sha256, Some("7"));
        let mut v = Verifier::new(engine.clone());
        let tokens: Vec<u32> = (0..16).collect();
        let root = Stored {
            block_hashes: stored(&engine, &tokens, 0).block_hashes[..2].to_vec(),
            token_ids: tokens[..8].to_vec(),
            ..stored(&engine, &tokens, 0)
        };
        assert_eq!(v.check(&root).matched, 2);
        // The rest of the chain continues from a remembered parent.
        assert_eq!(v.check(&stored(&engine, &tokens, 2)).matched, 2);
        v.clear();
        assert_eq!(v.check(&stored(&engine, &tokens, 2)).unverifiable, 2);
    }

    #[test]
    fn a_wrong_seed_or_algorithm_is_caught() {
        let engine = hasher(HashAlgo::Sha256, Some("7"));
        let tokens: Vec<u32> = (0..8).collect();
        for wrong in [
            hasher(HashAlgo::Sha256, None),
            hasher(HashAlgo::XxhashCbor, Some("7")),
        ] {
            let c = Verifier::new(wrong).check(&stored(&engine, &tokens, 0));
            assert!(c.mismatched.is_some(), "{c:?}");
            assert_eq!((c.matched, c.unverifiable), (0, 1));
        }
    }

    #[test]
    fn blocks_with_extra_keys_or_without_tokens_are_unverifiable() {
        let engine = hasher(HashAlgo::Sha256, None);
        let mut v = Verifier::new(engine.clone());
        let tokens: Vec<u32> = (0..8).collect();
        let mut s = stored(&engine, &tokens, 0);
        s.extra_keys = Some(vec![rmpv::Value::Nil, rmpv::Value::from("salt")]);
        assert_eq!(
            v.check(&s),
            Checked {
                matched: 1,
                mismatched: None,
                unverifiable: 1
            }
        );
        s.token_ids.clear();
        assert_eq!(v.check(&s).unverifiable, 2);
    }
}
