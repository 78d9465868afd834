//! vLLM prefix-cache block hashing, byte-exact.
//!
//! vLLM names a full KV-cache block by a chain hash: block `i` hashes
//! `(parent, tuple(tokens[i*bs:(i+1)*bs]), extra_keys_i)` where `parent` is
//! the digest of block `i - 1`, and the parent of block 0 is `NONE_HASH`, the
//! digest of the seed string (`PYTHONHASHSEED`, or `"vllm-none-hash"`). Only
//! full blocks are hashed. The tuple is serialized with pickle protocol 5
//! ([`HashAlgo::Sha256`], vLLM's default) or canonical CBOR (the `*_cbor`
//! algorithms) and hashed with SHA-256 or XXH3-128. KV events carry the last
//! 8 bytes of each digest as a big-endian `u64` ([`BlockHash`]).
//!
//! This module is responsible for producing exactly the digests a vLLM pod
//! produces for the same tokens, LoRA adapter and cache salt, for both
//! extra-key layouts ([`ExtraKeysForm`]); `tests/vllm_vectors.rs` checks it
//! against vectors taken from vLLM itself.
//!
//! Not here: multimodal and prompt-embedding extra keys (a request with
//! images or prompt embeddings hashes differently on the pod than here), the
//! random `NONE_HASH` vLLM uses when `PYTHONHASHSEED` is unset with xxhash
//! (unmatchable by design), decoding KV events, and tokenization. The pickle
//! writer does not model Python object identity: if two strings of one
//! preimage are the same Python object (say a one-character LoRA name equal
//! to a one-character cache salt), CPython pickles the second as a memo
//! reference and the `sha256` digest differs from this one.

mod cbor;
mod config;
mod digest;
mod pickle;
mod preimage;

use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::xxh3_128;

pub use config::{
    DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO, DEFAULT_SEED, ExtraKeysForm, HashAlgo, HashConfig,
    MAX_BLOCK_SIZE,
};
pub use digest::BlockDigest;

use cbor::Cbor;
use pickle::Pickle5;
use preimage::{BlockKeys, Encoder};

/// A block hash in the form KV events carry: the last 8 bytes of the block's
/// digest, big-endian (see [`BlockDigest::to_u64`]).
pub type BlockHash = u64;

/// The longest cache salt vLLM accepts, in characters.
pub const MAX_CACHE_SALT_CHARS: usize = 128;

/// A LoRA adapter as vLLM's tagged extra keys name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lora {
    /// The adapter's served name (`LoRARequest.lora_name`), hashed in both
    /// extra-key forms.
    pub name: String,
    /// The adapter's path on the pod (`LoRARequest.lora_path`), hashed only in
    /// the tagged form. KV events do not carry it, so the router must be told.
    pub path: String,
}

impl Lora {
    /// An adapter with the given served name and path.
    pub fn new(name: impl Into<String>, path: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            path: path.into(),
        }
    }
}

/// The per-request inputs to a block's extra keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockExtras<'a> {
    /// The LoRA adapter serving the request, if any; part of every block's
    /// extra keys.
    pub lora: Option<&'a Lora>,
    /// The request's `cache_salt`, if any; part of block 0's extra keys only
    /// (and so, through the chain, of every block's hash). Check it with
    /// [`validate_cache_salt`] where it enters the system.
    pub cache_salt: Option<&'a str>,
}

/// Errors from configuring or feeding the block hasher.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HashError {
    /// `block_size` was 0 or over [`MAX_BLOCK_SIZE`].
    #[error("invalid block_size {block_size}: must be 1 to 4096")]
    InvalidBlockSize {
        /// The rejected value.
        block_size: usize,
    },
    /// An algorithm name that is not one of [`HashAlgo::ALL`].
    #[error("unknown hash algorithm '{0}': expected one of sha256, sha256_cbor, xxhash_cbor")]
    UnknownAlgo(String),
    /// A cache salt vLLM would reject.
    #[error("invalid cache_salt {salt:?}: {reason}")]
    InvalidCacheSalt {
        /// The rejected salt.
        salt: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
}

/// Checks a cache salt the way vLLM's request validation does: non-empty, at
/// most [`MAX_CACHE_SALT_CHARS`] characters, and free of `@`, `/`, `\` and
/// NUL.
pub fn validate_cache_salt(salt: &str) -> Result<(), HashError> {
    let reason = if salt.is_empty() {
        "must not be empty"
    } else if salt.chars().count() > MAX_CACHE_SALT_CHARS {
        "must be at most 128 characters"
    } else if salt.contains(['@', '/', '\\', '\0']) {
        "must not contain '@', '/', '\\' or NUL"
    } else {
        return Ok(());
    };
    Err(HashError::InvalidCacheSalt {
        salt: salt.to_owned(),
        reason,
    })
}

/// Hashes token sequences into vLLM block digests for one [`HashConfig`].
///
/// Cheap to share: it holds the config and the precomputed `NONE_HASH`.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    config: HashConfig,
    none_hash: BlockDigest,
}

impl BlockHasher {
    /// A hasher for `config`; fails if `config.block_size` is not 1 to
    /// [`MAX_BLOCK_SIZE`].
    pub fn new(config: HashConfig) -> Result<Self, HashError> {
        if !(1..=MAX_BLOCK_SIZE).contains(&config.block_size) {
            return Err(HashError::InvalidBlockSize {
                block_size: config.block_size,
            });
        }
        let mut buf = Vec::new();
        encode_seed(config.algo, &mut buf, config.effective_seed());
        let none_hash = digest(config.algo, &buf);
        Ok(Self { config, none_hash })
    }

    /// The configuration this hasher was built with.
    pub fn config(&self) -> &HashConfig {
        &self.config
    }

    /// `NONE_HASH`: the digest of the seed string, the parent of block 0.
    pub fn none_hash(&self) -> BlockDigest {
        self.none_hash
    }

    /// Number of full blocks in `n_tokens` tokens; a trailing partial block
    /// is never hashed.
    pub fn full_blocks(&self, n_tokens: usize) -> usize {
        n_tokens / self.config.block_size
    }

    /// The digest of every full block of `tokens`, in order.
    pub fn digests(&self, tokens: &[u32], extras: BlockExtras<'_>) -> Vec<BlockDigest> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens.len()));
        self.for_each_digest(tokens, extras, |digest| out.push(digest));
        out
    }

    /// The KV-event form ([`BlockHash`]) of every full block of `tokens`.
    pub fn hashes(&self, tokens: &[u32], extras: BlockExtras<'_>) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens.len()));
        self.for_each_digest(tokens, extras, |digest| out.push(digest.to_u64()));
        out
    }

    /// The digest of one full block, `tokens`, under `parent` (the previous
    /// block's digest, or [`none_hash`](Self::none_hash) for block 0): for
    /// extending a chain one block at a time as a sequence grows.
    pub fn block_digest(
        &self,
        parent: &BlockDigest,
        block_index: usize,
        tokens: &[u32],
        extras: BlockExtras<'_>,
    ) -> BlockDigest {
        digest(
            self.config.algo,
            &self.block_preimage(parent, block_index, tokens, extras),
        )
    }

    /// The exact bytes hashed for one block: `tokens` under `parent`, with
    /// the cache salt applied only if `block_index` is 0. For conformance
    /// tests and debugging; [`digests`](Self::digests) is the API.
    #[doc(hidden)]
    pub fn block_preimage(
        &self,
        parent: &BlockDigest,
        block_index: usize,
        tokens: &[u32],
        extras: BlockExtras<'_>,
    ) -> Vec<u8> {
        let mut buf = Vec::new();
        self.encode_block(
            &mut buf,
            parent.as_bytes(),
            tokens,
            &self.block_keys(block_index, extras),
        );
        buf
    }

    /// The exact bytes hashed for `NONE_HASH`.
    #[doc(hidden)]
    pub fn seed_preimage(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_seed(self.config.algo, &mut buf, self.config.effective_seed());
        buf
    }

    fn for_each_digest(
        &self,
        tokens: &[u32],
        extras: BlockExtras<'_>,
        mut f: impl FnMut(BlockDigest),
    ) {
        let block_size = self.config.block_size;
        if tokens.len() < block_size {
            return;
        }
        let mut buf = Vec::with_capacity(preimage_capacity(block_size, extras));
        let mut parent = self.none_hash;
        for (index, block) in tokens.chunks_exact(block_size).enumerate() {
            parent = self.next_digest(&mut buf, &parent, index, block, extras);
            f(parent);
        }
    }

    /// The digest of block `index`, `tokens`, under `parent`, with `buf`
    /// as scratch space for its preimage.
    fn next_digest(
        &self,
        buf: &mut Vec<u8>,
        parent: &BlockDigest,
        index: usize,
        tokens: &[u32],
        extras: BlockExtras<'_>,
    ) -> BlockDigest {
        self.encode_block(
            buf,
            parent.as_bytes(),
            tokens,
            &self.block_keys(index, extras),
        );
        digest(self.config.algo, buf)
    }

    /// A chain fed one token at a time, for prompts whose tokens are never
    /// held as a whole.
    pub fn chain<'a>(&'a self, extras: BlockExtras<'a>) -> Chain<'a> {
        // Sized for the usual block; a huge configured block size grows them
        // only as tokens arrive.
        let block_size = self.config.block_size.min(1024);
        Chain {
            hasher: self,
            extras,
            parent: self.none_hash,
            index: 0,
            block: Vec::with_capacity(block_size),
            buf: Vec::with_capacity(preimage_capacity(block_size, extras)),
        }
    }

    fn block_keys<'a>(&self, block_index: usize, extras: BlockExtras<'a>) -> BlockKeys<'a> {
        BlockKeys {
            form: self.config.extra_keys,
            lora: extras.lora,
            cache_salt: if block_index == 0 {
                extras.cache_salt
            } else {
                None
            },
        }
    }

    fn encode_block(&self, buf: &mut Vec<u8>, parent: &[u8], tokens: &[u32], keys: &BlockKeys) {
        match self.config.algo {
            HashAlgo::Sha256 => preimage::write_block(&mut Pickle5::new(buf), parent, tokens, keys),
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => {
                preimage::write_block(&mut Cbor::new(buf), parent, tokens, keys)
            }
        }
    }
}

/// A block chain built one token at a time ([`BlockHasher::chain`]).
#[derive(Debug)]
pub struct Chain<'a> {
    hasher: &'a BlockHasher,
    extras: BlockExtras<'a>,
    parent: BlockDigest,
    index: usize,
    block: Vec<u32>,
    buf: Vec<u8>,
}

/// Where a [`Chain`] stands, to be resumed later with
/// [`BlockHasher::resume`] (the same hasher and extras).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainState {
    parent: BlockDigest,
    index: usize,
    block: Vec<u32>,
}

impl BlockHasher {
    /// A chain continuing from `state`, which a chain of this hasher with
    /// these `extras` reached.
    pub fn resume<'a>(&'a self, state: ChainState, extras: BlockExtras<'a>) -> Chain<'a> {
        let mut chain = self.chain(extras);
        chain.parent = state.parent;
        chain.index = state.index;
        chain.block = state.block;
        chain
    }
}

impl Chain<'_> {
    /// Where the chain stands.
    pub fn state(&self) -> ChainState {
        ChainState {
            parent: self.parent,
            index: self.index,
            block: self.block.clone(),
        }
    }

    /// Adds the next token; returns the digest of the block it completes.
    pub fn push(&mut self, token: u32) -> Option<BlockDigest> {
        self.block.push(token);
        if self.block.len() < self.hasher.config.block_size {
            return None;
        }
        self.parent = self.hasher.next_digest(
            &mut self.buf,
            &self.parent,
            self.index,
            &self.block,
            self.extras,
        );
        self.index += 1;
        self.block.clear();
        Some(self.parent)
    }
}

/// Room for one block's preimage: at most 7 bytes per token plus the
/// parent, the extra keys and some framing.
fn preimage_capacity(block_size: usize, extras: BlockExtras<'_>) -> usize {
    let extras_len = extras.lora.map_or(0, |l| l.name.len() + l.path.len())
        + extras.cache_salt.map_or(0, str::len);
    96 + 7 * block_size + extras_len
}

fn encode_seed(algo: HashAlgo, buf: &mut Vec<u8>, seed: &str) {
    fn write<E: Encoder>(mut e: E, seed: &str) {
        preimage::write_seed(&mut e, seed);
    }
    match algo {
        HashAlgo::Sha256 => write(Pickle5::new(buf), seed),
        HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => write(Cbor::new(buf), seed),
    }
}

fn digest(algo: HashAlgo, preimage: &[u8]) -> BlockDigest {
    match algo {
        HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
            BlockDigest::from_slice(&Sha256::digest(preimage))
        }
        // vLLM's xxh3_128_digest: the 128-bit value in big-endian bytes.
        HashAlgo::XxhashCbor => BlockDigest::from_slice(&xxh3_128(preimage).to_be_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(algo: HashAlgo, block_size: usize) -> BlockHasher {
        BlockHasher::new(HashConfig {
            algo,
            block_size,
            ..HashConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn a_resumed_chain_continues_where_it_stood() {
        let extras = BlockExtras {
            lora: None,
            cache_salt: Some("s"),
        };
        let tokens: Vec<u32> = (0..45).collect();
        for algo in HashAlgo::ALL {
            let h = hasher(algo, 8);
            let want = h.digests(&tokens, extras);
            for cut in [0, 5, 8, 21, 45] {
                let mut chain = h.chain(extras);
                let mut got: Vec<_> = tokens[..cut]
                    .iter()
                    .filter_map(|&t| chain.push(t))
                    .collect();
                let mut chain = h.resume(chain.state(), extras);
                got.extend(tokens[cut..].iter().filter_map(|&t| chain.push(t)));
                assert_eq!(got, want, "{algo} cut at {cut}");
            }
        }
    }

    #[test]
    fn block_digest_extends_a_chain_like_digests() {
        let lora = Lora::new("a", "/a");
        let extras = BlockExtras {
            lora: Some(&lora),
            cache_salt: Some("s"),
        };
        let tokens: Vec<u32> = (0..40).collect();
        for algo in HashAlgo::ALL {
            let h = hasher(algo, 8);
            let mut parent = h.none_hash();
            for (i, want) in h.digests(&tokens, extras).into_iter().enumerate() {
                parent = h.block_digest(&parent, i, &tokens[i * 8..(i + 1) * 8], extras);
                assert_eq!(parent, want, "{algo} block {i}");
            }
        }
    }

    #[test]
    fn block_size_zero_is_rejected_by_name() {
        let err = BlockHasher::new(HashConfig {
            block_size: 0,
            ..HashConfig::default()
        })
        .unwrap_err();
        assert!(matches!(err, HashError::InvalidBlockSize { block_size: 0 }));
        assert!(err.to_string().contains("block_size"), "{err}");
        for block_size in [MAX_BLOCK_SIZE + 1, u32::MAX as usize] {
            let err = BlockHasher::new(HashConfig {
                block_size,
                ..HashConfig::default()
            })
            .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("invalid block_size {block_size}: must be 1 to 4096")
            );
        }
        assert!(
            BlockHasher::new(HashConfig {
                block_size: MAX_BLOCK_SIZE,
                ..HashConfig::default()
            })
            .is_ok()
        );
    }

    #[test]
    fn algo_names_round_trip() {
        for algo in HashAlgo::ALL {
            assert_eq!(algo.to_string().parse::<HashAlgo>().unwrap(), algo);
            let json = serde_json::to_string(&algo).unwrap();
            assert_eq!(json, format!("\"{algo}\""));
        }
        let err = "md5".parse::<HashAlgo>().unwrap_err().to_string();
        assert!(
            err.contains("'md5'") && err.contains("sha256, sha256_cbor, xxhash_cbor"),
            "{err}"
        );
    }

    #[test]
    fn config_defaults_and_partial_serde() {
        let config = HashConfig::default();
        assert_eq!(config.algo, HashAlgo::Sha256);
        assert_eq!(config.block_size, 16);
        assert_eq!(config.effective_seed(), "vllm-none-hash");
        let parsed: HashConfig =
            serde_json::from_str(r#"{"algo": "xxhash_cbor", "seed": "0", "extra_keys": "legacy"}"#)
                .unwrap();
        assert_eq!(parsed.algo, HashAlgo::XxhashCbor);
        assert_eq!(parsed.block_size, 16);
        assert_eq!(parsed.effective_seed(), "0");
        assert_eq!(parsed.extra_keys, ExtraKeysForm::Legacy);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        for algo in HashAlgo::ALL {
            let h = hasher(algo, 4);
            let tokens: Vec<u32> = (0..11).collect();
            assert_eq!(h.full_blocks(11), 2);
            let digests = h.digests(&tokens, BlockExtras::default());
            assert_eq!(digests.len(), 2);
            assert_eq!(digests[0].as_bytes().len(), algo.digest_len());
            // The partial block changes nothing; a prefix shares its blocks.
            assert_eq!(h.digests(&tokens[..8], BlockExtras::default()), digests);
            assert_eq!(
                h.digests(&tokens[..4], BlockExtras::default()),
                digests[..1]
            );
            assert!(h.digests(&tokens[..3], BlockExtras::default()).is_empty());
            let huge = hasher(algo, MAX_BLOCK_SIZE);
            assert!(huge.digests(&tokens, BlockExtras::default()).is_empty());
            let hashes = h.hashes(&tokens, BlockExtras::default());
            assert_eq!(
                hashes,
                digests.iter().map(BlockDigest::to_u64).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn blocks_chain_through_their_parent() {
        let h = hasher(HashAlgo::Sha256Cbor, 2);
        let digests = h.digests(&[1, 2, 3, 4], BlockExtras::default());
        let second = h.block_preimage(&digests[0], 1, &[3, 4], BlockExtras::default());
        assert_eq!(
            BlockDigest::from_slice(&Sha256::digest(&second)),
            digests[1]
        );
        // Same tokens under a different parent hash differently.
        assert_ne!(h.digests(&[3, 4], BlockExtras::default())[0], digests[1]);
    }

    #[test]
    fn cache_salt_reaches_block_zero_only() {
        let h = hasher(HashAlgo::Sha256, 2);
        let salted = BlockExtras {
            cache_salt: Some("tenant"),
            ..BlockExtras::default()
        };
        let plain = h.block_preimage(&h.none_hash(), 1, &[3, 4], BlockExtras::default());
        assert_eq!(h.block_preimage(&h.none_hash(), 1, &[3, 4], salted), plain);
        assert_ne!(h.block_preimage(&h.none_hash(), 0, &[3, 4], salted), plain);
    }

    #[test]
    fn cache_salt_rules() {
        for ok in ["a", "tenant-a-3f9c", &"é".repeat(128)] {
            validate_cache_salt(ok).unwrap();
        }
        for bad in ["", "a@b", "a/b", "a\\b", "a\0b", &"x".repeat(129)] {
            let err = validate_cache_salt(bad).unwrap_err();
            assert!(err.to_string().starts_with("invalid cache_salt"), "{err}");
        }
    }
}
