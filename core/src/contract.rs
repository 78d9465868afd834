//! The engine contract: the cache settings an engine reports (the first
//! message of its WatchCache stream), checked against a router's block
//! hashing. A router whose block size, algorithm or seed differs from an
//! engine's computes hashes the engine never holds; every prefix looks cold
//! while routing reports itself cache-aware. The router gives a mismatched
//! engine no cache credit and the operator reports it on the policy; both
//! check with [`Contract::check`].
//!
//! Pure: no I/O, no clock.

use crate::hash::{BlockHasher, HashAlgo};

/// An engine's reported cache settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineCache {
    /// Tokens per block.
    pub block_size: u32,
    /// Its hash algorithm; `None` when the engine named one this build
    /// does not know.
    pub hash_algo: Option<HashAlgo>,
    /// Whether its hash seed is set.
    pub hash_seed_set: bool,
    /// Its `NONE_HASH` in `u64` form, when it reports one.
    pub none_hash: Option<u64>,
    /// Whether hashes recomputed from the engine's own tokens differed from
    /// the ones it reported (the agent checks vLLM's events): its real
    /// algorithm or seed is not the one reported.
    pub hashes_unverified: bool,
}

impl EngineCache {
    /// What an engine hashing exactly as `hasher` reports.
    pub fn of(hasher: &BlockHasher) -> Self {
        EngineCache {
            block_size: hasher.config().block_size as u32,
            hash_algo: Some(hasher.config().algo),
            hash_seed_set: hasher.config().seed.is_some(),
            none_hash: Some(hasher.none_hash().to_u64()),
            hashes_unverified: false,
        }
    }
}

/// One field on which an engine and the router differ.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    /// The router setting's name (`blockSize`, `hashAlgo`, `hashSeed`).
    pub field: &'static str,
    /// The engine's value.
    pub engine: String,
    /// The router's value.
    pub router: String,
}

/// What the router knows of an endpoint's contract.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Contract {
    /// No snapshot yet, or the endpoint reports no cache.
    #[default]
    Unknown,
    /// The engine hashes as the router does.
    Match,
    /// It does not: these fields differ.
    Mismatch(Vec<Mismatch>),
}

impl Contract {
    /// The states, as metric labels.
    pub const STATES: [&'static str; 3] = ["unknown", "match", "mismatch"];

    /// Checks `engine` against the router's `hasher`.
    pub fn check(engine: &EngineCache, hasher: &BlockHasher) -> Self {
        let router = hasher.config();
        let mut differ = Vec::new();
        let mut field = |field, engine: String, router: String| {
            differ.push(Mismatch {
                field,
                engine,
                router,
            });
        };
        if engine.block_size as usize != router.block_size {
            field(
                "blockSize",
                engine.block_size.to_string(),
                router.block_size.to_string(),
            );
        }
        if engine.hash_algo != Some(router.algo) {
            let name = engine.hash_algo.map_or("unknown", HashAlgo::as_str);
            field("hashAlgo", name.into(), router.algo.to_string());
        } else {
            // Same algorithm: equal NONE_HASHes mean equal seeds. Without
            // one, only whether a seed is set can be compared.
            let ours = hasher.none_hash().to_u64();
            let seed = |set: bool| if set { "set" } else { "unset" }.to_owned();
            match engine.none_hash {
                Some(theirs) if theirs != ours => field(
                    "hashSeed",
                    format!("NONE_HASH {theirs:#018x}"),
                    format!("NONE_HASH {ours:#018x}"),
                ),
                None if engine.hash_seed_set != router.seed.is_some() => field(
                    "hashSeed",
                    seed(engine.hash_seed_set),
                    seed(router.seed.is_some()),
                ),
                _ => {}
            }
        }
        if engine.hashes_unverified {
            field(
                "hashes",
                "differ from hashes recomputed from its tokens".into(),
                format!("{} with the configured seed", router.algo),
            );
        }
        if differ.is_empty() {
            Contract::Match
        } else {
            Contract::Mismatch(differ)
        }
    }

    /// As a metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Contract::Unknown => "unknown",
            Contract::Match => "match",
            Contract::Mismatch(_) => "mismatch",
        }
    }

    /// The differing fields (none unless mismatched).
    pub fn mismatches(&self) -> &[Mismatch] {
        match self {
            Contract::Mismatch(m) => m,
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::HashConfig;

    fn hasher(block_size: usize, algo: HashAlgo, seed: Option<&str>) -> BlockHasher {
        BlockHasher::new(HashConfig {
            algo,
            block_size,
            seed: seed.map(str::to_owned),
            ..HashConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn the_same_hashing_matches() {
        let h = hasher(16, HashAlgo::Sha256, Some("42"));
        assert_eq!(Contract::check(&EngineCache::of(&h), &h), Contract::Match);
    }

    #[test]
    fn each_differing_field_is_named() {
        let router = hasher(16, HashAlgo::Sha256, None);
        let other_size = EngineCache::of(&hasher(32, HashAlgo::Sha256, None));
        assert_eq!(
            Contract::check(&other_size, &router).mismatches(),
            [Mismatch {
                field: "blockSize",
                engine: "32".into(),
                router: "16".into()
            }]
        );
        let other_algo = EngineCache::of(&hasher(16, HashAlgo::XxhashCbor, None));
        let c = Contract::check(&other_algo, &router);
        assert_eq!(c.as_str(), "mismatch");
        assert_eq!(c.mismatches()[0].field, "hashAlgo");
        assert_eq!(c.mismatches()[0].engine, "xxhash_cbor");
        // Another seed: only NONE_HASH tells, and it does.
        let other_seed = EngineCache::of(&hasher(16, HashAlgo::Sha256, Some("1")));
        let c = Contract::check(&other_seed, &router);
        assert_eq!(c.mismatches().len(), 1);
        assert_eq!(c.mismatches()[0].field, "hashSeed");
    }

    #[test]
    fn without_none_hash_only_whether_a_seed_is_set_is_compared() {
        let router = hasher(16, HashAlgo::Sha256, Some("1"));
        let mut engine = EngineCache::of(&hasher(16, HashAlgo::Sha256, Some("2")));
        engine.none_hash = None;
        assert_eq!(Contract::check(&engine, &router), Contract::Match);
        engine.hash_seed_set = false;
        let c = Contract::check(&engine, &router);
        assert_eq!(
            c.mismatches(),
            [Mismatch {
                field: "hashSeed",
                engine: "unset".into(),
                router: "set".into()
            }]
        );
    }

    #[test]
    fn hashes_that_failed_verification_are_a_mismatch() {
        let h = hasher(16, HashAlgo::Sha256, None);
        let mut engine = EngineCache::of(&h);
        engine.hashes_unverified = true;
        let c = Contract::check(&engine, &h);
        assert_eq!(c.mismatches().len(), 1);
        assert_eq!(c.mismatches()[0].field, "hashes");
    }

    #[test]
    fn an_unknown_algorithm_is_a_mismatch() {
        let router = hasher(16, HashAlgo::Sha256, None);
        let mut engine = EngineCache::of(&router);
        engine.hash_algo = None;
        assert_eq!(
            Contract::check(&engine, &router).mismatches()[0].field,
            "hashAlgo"
        );
    }
}
