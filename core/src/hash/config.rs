//! What a pool's vLLM pods hash with: the algorithm, the block size, the
//! `PYTHONHASHSEED` and the extra-key form. Parsed once, checked by
//! [`BlockHasher::new`](super::BlockHasher::new).

use std::fmt;
use std::str::FromStr;

use super::HashError;

/// A vLLM prefix-caching hash algorithm (`--prefix-caching-hash-algo`).
///
/// The name used by [`FromStr`], [`Display`](fmt::Display) and serde is
/// vLLM's own spelling of the flag value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgo {
    /// `sha256`, vLLM's default ([`DEFAULT_HASH_ALGO`]): SHA-256 over the
    /// pickle protocol 5 bytes of the block tuple; 32-byte digests.
    Sha256,
    /// `sha256_cbor`: SHA-256 over the canonical CBOR bytes of the block
    /// tuple; 32-byte digests.
    Sha256Cbor,
    /// `xxhash_cbor`: XXH3-128 over the canonical CBOR bytes of the block
    /// tuple; 16-byte big-endian digests.
    XxhashCbor,
}

impl Default for HashAlgo {
    fn default() -> Self {
        DEFAULT_HASH_ALGO
    }
}

impl HashAlgo {
    /// Every algorithm, in the order they are listed to users.
    pub const ALL: [HashAlgo; 3] = [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::XxhashCbor];

    /// vLLM's name for the algorithm.
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Length in bytes of one digest of this algorithm.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::XxhashCbor => 16,
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HashAlgo::ALL
            .into_iter()
            .find(|algo| algo.as_str() == s)
            .ok_or_else(|| HashError::UnknownAlgo(s.to_owned()))
    }
}

/// How LoRA and cache-salt extra keys are laid out in the hashed tuple.
///
/// The two forms hash differently, so the router must use the one its pods'
/// vLLM version uses.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ExtraKeysForm {
    /// vLLM >= 0.31: `("lora", name, path)` on every block of a LoRA request,
    /// then `("cache_salt", salt)` on block 0.
    #[default]
    Tagged,
    /// vLLM 0.15 to 0.30: the bare LoRA name on every block, then the bare
    /// salt on block 0.
    Legacy,
}

/// Everything that decides a block's hash besides its tokens and extras.
///
/// Every pod of a pool must run with the same values, and the router must be
/// configured with them; a mismatch makes every lookup miss.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct HashConfig {
    /// The pods' `--prefix-caching-hash-algo`. Default: `sha256`, vLLM's
    /// default.
    pub algo: HashAlgo,
    /// Tokens per KV-cache block (`--block-size`); must be at least 1.
    /// Default: 16, vLLM's default (an attention backend may pick another
    /// when the flag is not given, so set it explicitly on the pods).
    pub block_size: usize,
    /// The pods' `PYTHONHASHSEED`, hashed as a string to make the parent of
    /// block 0. `None` means unset, for which vLLM (>= 0.29, sha256 and
    /// sha256_cbor) uses the seed `"vllm-none-hash"`. With `xxhash_cbor`, or
    /// vLLM <= 0.28, an unset `PYTHONHASHSEED` makes vLLM pick a random
    /// parent per process, which no router can match: set it on the pods.
    /// Default: `None`.
    pub seed: Option<String>,
    /// Extra-key layout of the pods' vLLM version. Default: tagged (>= 0.31).
    pub extra_keys: ExtraKeysForm,
}

/// Default block hash algorithm: `sha256`, vLLM's default.
pub const DEFAULT_HASH_ALGO: HashAlgo = HashAlgo::Sha256;
/// Default block size in tokens: 16, vLLM's default.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Largest block size in tokens: 4096. vLLM's block sizes are small (its
/// attention backends take 1 to a few hundred tokens; hybrid models round
/// theirs up to a few thousand at most), so a larger value is a typing
/// mistake, and every block would hash a multi-megabyte preimage. The
/// CacheRoutingPolicy CRD and the agent's `--block-size` use the same range.
pub const MAX_BLOCK_SIZE: usize = 4096;

impl Default for HashConfig {
    fn default() -> Self {
        Self {
            algo: DEFAULT_HASH_ALGO,
            block_size: DEFAULT_BLOCK_SIZE,
            seed: None,
            extra_keys: ExtraKeysForm::Tagged,
        }
    }
}

impl HashConfig {
    /// The seed string vLLM hashes for the parent of block 0.
    pub fn effective_seed(&self) -> &str {
        self.seed.as_deref().unwrap_or(DEFAULT_SEED)
    }
}

/// The seed vLLM uses when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";
