//! Volatile prefixes: prompts whose early blocks change on every request (a
//! timestamp or request id in a system prompt) although what follows is the
//! same. No prefix cache can serve them, and chained block hashes cannot
//! show why: one changed token changes every later hash. So beside the
//! chained hashes of recent requests this keeps the hashes of recent
//! blocks' contents alone (unchained), and flags a request whose chain is
//! new from an early block on while most of its later blocks' contents
//! were seen recently.
//!
//! Everything is bounded: both sketches are LRU sets of [`SKETCH`]
//! hashes, only a prompt's first [`BLOCKS`] blocks are looked at, and at
//! most [`OFFENDERS`] offenders are kept (the least frequent goes). Only
//! hashes and offsets are kept, never text.

use std::collections::HashMap;

use kvroute_core::lru::Lru;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Hashes per sketch.
pub const SKETCH: usize = 1 << 16;
/// Leading blocks of a prompt looked at.
pub const BLOCKS: usize = 64;
/// A chain that is new from a block before this one on is "new early".
pub const EARLY_BLOCKS: usize = 16;
/// Later blocks needed to judge, of which at least half must be known.
pub const MIN_LATER_BLOCKS: usize = 4;
/// Offenders kept.
pub const OFFENDERS: usize = 256;

/// Where a flagged request's chain left what was seen before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// The first block whose chained hash was new.
    pub block: usize,
    /// The content hash of the first later block that was seen before: it
    /// names the stable part the volatile block sits in front of.
    pub anchor: u64,
}

impl Divergence {
    /// Whether it is early enough to call the prefix volatile.
    pub fn early(&self) -> bool {
        self.block < EARLY_BLOCKS
    }
}

/// A recurring volatile prefix, for `/debug/prefixes`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Offender {
    /// [`Divergence::anchor`], hex.
    pub anchor: String,
    /// Token offset of the first changed block, as last seen.
    pub diverges_at_token: u64,
    /// Requests flagged.
    pub requests: u64,
    /// Model label of the last one.
    pub model: String,
    /// Tenant label of the last one.
    pub tenant: String,
}

/// The sketches and the offenders. See the module docs.
#[derive(Debug, Default)]
pub struct Volatility {
    chains: Lru,
    contents: Lru,
    offenders: HashMap<u64, Offender>,
}

impl Volatility {
    /// Looks at one request of a tenant (`tenant`, a hash of its name, 0
    /// for none): `first`, its first block's chained hash (which carries
    /// its extra keys: salt, adapter), and `contents`, its blocks'
    /// unchained content hashes (the first [`BLOCKS`] at most). Its chained
    /// hashes are folded from both, so the request's own chain need not
    /// reach past its first block (exact mode stops hashing where no engine
    /// holds a block). Each tenant's hashes are its own: one tenant's
    /// prompts never make another's look seen. Remembers both and returns
    /// where the request diverged from a recent prompt whose later contents
    /// recur, early or not ([`Divergence::early`]).
    pub fn observe(
        &mut self,
        tenant: u64,
        first: Option<u64>,
        contents: &[u64],
    ) -> Option<Divergence> {
        let own = |h: u64| {
            if tenant == 0 {
                h
            } else {
                xxh3_64_with_seed(&h.to_le_bytes(), tenant)
            }
        };
        let contents: Vec<u64> = contents.iter().take(BLOCKS).map(|&c| own(c)).collect();
        let mut h = own(first?);
        let chain: Vec<u64> = (contents.iter().enumerate())
            .map(|(i, c)| {
                if i > 0 {
                    h = xxh3_64_with_seed(&c.to_le_bytes(), h);
                }
                h
            })
            .collect();
        let flagged = chain
            .iter()
            .position(|h| !self.chains.contains(*h))
            .and_then(|d| {
                let later = &contents[d + 1..];
                let seen: Vec<u64> = later
                    .iter()
                    .copied()
                    .filter(|c| self.contents.contains(*c))
                    .collect();
                (later.len() >= MIN_LATER_BLOCKS && seen.len() * 2 >= later.len()).then(|| {
                    Divergence {
                        block: d,
                        anchor: seen[0],
                    }
                })
            });
        for (sketch, hashes) in [
            (&mut self.chains, &chain[..]),
            (&mut self.contents, &contents[..]),
        ] {
            for &h in hashes {
                sketch.touch(h);
            }
            while sketch.len() > SKETCH {
                sketch.pop_lru();
            }
        }
        flagged
    }

    /// Counts a flagged request under its anchor.
    pub fn record(&mut self, d: &Divergence, block_size: usize, model: &str, tenant: &str) {
        if !self.offenders.contains_key(&d.anchor) && self.offenders.len() >= OFFENDERS {
            // Make room: the least frequent goes.
            if let Some(least) = self
                .offenders
                .iter()
                .min_by_key(|(_, o)| o.requests)
                .map(|(k, _)| *k)
            {
                self.offenders.remove(&least);
            }
        }
        let o = self.offenders.entry(d.anchor).or_insert_with(|| Offender {
            anchor: format!("{:016x}", d.anchor),
            diverges_at_token: 0,
            requests: 0,
            model: String::new(),
            tenant: String::new(),
        });
        o.requests += 1;
        o.diverges_at_token = (d.block * block_size) as u64;
        model.clone_into(&mut o.model);
        tenant.clone_into(&mut o.tenant);
    }

    /// The offenders, most frequent first.
    pub fn offenders(&self) -> Vec<Offender> {
        let mut all: Vec<Offender> = self.offenders.values().cloned().collect();
        all.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.anchor.cmp(&b.anchor)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt of `blocks` blocks whose block `volatile` differs per
    /// `request`: contents are `block id` (or a per-request value), chained
    /// hashes fold the contents so far.
    fn prompt(blocks: usize, volatile: Option<usize>, request: u64) -> (Vec<u64>, Vec<u64>) {
        let contents: Vec<u64> = (0..blocks as u64)
            .map(|b| {
                if Some(b as usize) == volatile {
                    1_000_000 + request
                } else {
                    b
                }
            })
            .collect();
        let mut chain = Vec::new();
        let mut h = 0xcbf2_9ce4_8422_2325_u64;
        for c in &contents {
            h = (h ^ c).wrapping_mul(0x100_0000_01b3);
            chain.push(h);
        }
        (chain, contents)
    }

    #[test]
    fn a_changing_early_block_before_a_stable_rest_is_flagged() {
        let mut v = Volatility::default();
        let (c, k) = prompt(20, Some(2), 0);
        assert_eq!(
            v.observe(0, c.first().copied(), &k),
            None,
            "nothing seen yet"
        );
        for r in 1..10 {
            let (c, k) = prompt(20, Some(2), r);
            let d = v.observe(0, c.first().copied(), &k).expect("flagged");
            assert_eq!(d.block, 2);
            assert_eq!(d.anchor, 3, "the first stable block after it");
            v.record(&d, 16, "m", "t");
        }
        let top = v.offenders();
        assert_eq!(top.len(), 1);
        assert_eq!((top[0].requests, top[0].diverges_at_token), (9, 32));
    }

    #[test]
    fn repeats_new_prompts_and_growing_conversations_are_not() {
        let mut v = Volatility::default();
        let (c, k) = prompt(20, None, 0);
        v.observe(0, c.first().copied(), &k);
        assert_eq!(
            v.observe(0, c.first().copied(), &k),
            None,
            "a repeat is all known"
        );
        // A conversation that grows: new only at its end.
        let (c, k) = prompt(30, None, 0);
        assert_eq!(v.observe(0, c.first().copied(), &k), None);
        // New prompts with contents never seen.
        for r in 0..5 {
            let contents: Vec<u64> = (0..20).map(|b| 5_000 + r * 100 + b).collect();
            let chain: Vec<u64> = contents.iter().map(|c| c ^ 0xabc).collect();
            assert_eq!(v.observe(0, chain.first().copied(), &contents), None);
        }
        // A late change is not early.
        let (c, k) = prompt(40, Some(EARLY_BLOCKS + 2), 7);
        let late = v.observe(0, c.first().copied(), &k).expect("diverged");
        assert!(!late.early());
    }

    #[test]
    fn tenants_do_not_see_each_others_prompts() {
        let mut v = Volatility::default();
        let (c, k) = prompt(20, Some(0), 0);
        v.observe(1, c.first().copied(), &k);
        let (c, k) = prompt(20, Some(0), 1);
        assert_eq!(v.observe(2, c.first().copied(), &k), None, "another tenant");
        assert!(v.observe(1, c.first().copied(), &k).is_some(), "the same");
    }

    #[test]
    fn state_stays_bounded() {
        let mut v = Volatility::default();
        for r in 0..(SKETCH as u64 / 8) {
            let contents: Vec<u64> = (0..BLOCKS as u64 * 2).map(|b| r << 20 | b).collect();
            let chain: Vec<u64> = contents.iter().map(|c| !c).collect();
            v.observe(0, chain.first().copied(), &contents);
            let d = Divergence {
                block: 0,
                anchor: r,
            };
            v.record(&d, 16, "m", "t");
        }
        assert!(v.chains.len() <= SKETCH && v.contents.len() <= SKETCH);
        assert_eq!(v.offenders.len(), OFFENDERS);
    }
}
