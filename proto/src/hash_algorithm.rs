//! Conversions between the wire's `HashAlgorithm` and the core's
//! [`HashAlgo`], and from an engine's `CacheConfig` to the core's
//! [`EngineCache`].

use kvroute_core::contract::EngineCache;
use kvroute_core::hash::HashAlgo;

use crate::{Error, v1};

impl TryFrom<v1::HashAlgorithm> for HashAlgo {
    type Error = Error;

    /// The core algorithm; fails on `HASH_ALGORITHM_UNSPECIFIED`, which no
    /// engine may report.
    fn try_from(value: v1::HashAlgorithm) -> Result<Self, Error> {
        match value {
            v1::HashAlgorithm::Unspecified => Err(Error::UnspecifiedHashAlgorithm),
            v1::HashAlgorithm::Sha256 => Ok(HashAlgo::Sha256),
            v1::HashAlgorithm::Sha256Cbor => Ok(HashAlgo::Sha256Cbor),
            v1::HashAlgorithm::XxhashCbor => Ok(HashAlgo::XxhashCbor),
        }
    }
}

impl From<HashAlgo> for v1::HashAlgorithm {
    fn from(value: HashAlgo) -> Self {
        match value {
            HashAlgo::Sha256 => v1::HashAlgorithm::Sha256,
            HashAlgo::Sha256Cbor => v1::HashAlgorithm::Sha256Cbor,
            HashAlgo::XxhashCbor => v1::HashAlgorithm::XxhashCbor,
        }
    }
}

/// The core algorithm of a raw `HashAlgorithm` field (prost stores enum
/// fields as `i32`, e.g. `CacheConfig::hash_algorithm`), telling an unknown
/// value apart from an unspecified one.
pub fn hash_algo_from_i32(value: i32) -> Result<HashAlgo, Error> {
    v1::HashAlgorithm::try_from(value)
        .map_err(|_| Error::UnknownHashAlgorithm(value))?
        .try_into()
}

impl From<&v1::CacheConfig> for EngineCache {
    fn from(c: &v1::CacheConfig) -> Self {
        EngineCache {
            block_size: c.block_size,
            hash_algo: hash_algo_from_i32(c.hash_algorithm).ok(),
            hash_seed_set: c.hash_seed_set,
            none_hash: c.none_hash,
            hashes_unverified: c.hash_verification_failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_core_algorithm_round_trips() {
        for algo in HashAlgo::ALL {
            let wire = v1::HashAlgorithm::from(algo);
            assert_eq!(HashAlgo::try_from(wire), Ok(algo));
            assert_eq!(hash_algo_from_i32(wire as i32), Ok(algo));
        }
    }

    #[test]
    fn wire_names_match_vllm_names() {
        for algo in HashAlgo::ALL {
            let wire = v1::HashAlgorithm::from(algo);
            let expected = format!("HASH_ALGORITHM_{}", algo.as_str().to_uppercase());
            assert_eq!(wire.as_str_name(), expected);
        }
    }

    #[test]
    fn unspecified_is_an_error() {
        assert_eq!(
            HashAlgo::try_from(v1::HashAlgorithm::Unspecified),
            Err(Error::UnspecifiedHashAlgorithm)
        );
        assert_eq!(hash_algo_from_i32(0), Err(Error::UnspecifiedHashAlgorithm));
        // A config that never set the field reads as unspecified too.
        let config = v1::CacheConfig::default();
        assert_eq!(
            hash_algo_from_i32(config.hash_algorithm),
            Err(Error::UnspecifiedHashAlgorithm)
        );
    }

    #[test]
    fn unknown_value_is_an_error() {
        assert_eq!(hash_algo_from_i32(4), Err(Error::UnknownHashAlgorithm(4)));
        assert_eq!(hash_algo_from_i32(-1), Err(Error::UnknownHashAlgorithm(-1)));
    }
}
