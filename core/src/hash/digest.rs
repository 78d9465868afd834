//! A block digest as vLLM keeps it: the raw bytes of the hash function's
//! output, stored inline.

use std::fmt;

use super::BlockHash;

/// The full digest of one block: 32 bytes for the SHA-256 algorithms, 16 for
/// XXH3-128 (big-endian). Stored inline, so copying it never allocates.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest {
    // Bytes past `len` are always zero, so the derived traits compare only
    // the digest.
    bytes: [u8; BlockDigest::MAX_LEN],
    len: u8,
}

impl BlockDigest {
    /// The longest digest any supported algorithm produces.
    pub const MAX_LEN: usize = 32;

    /// Wraps a digest of at most [`MAX_LEN`](Self::MAX_LEN) bytes.
    ///
    /// # Panics
    /// If `digest` is longer than `MAX_LEN`; hash functions here never are.
    pub(crate) fn from_slice(digest: &[u8]) -> Self {
        assert!(
            digest.len() <= Self::MAX_LEN,
            "digest of {} bytes",
            digest.len()
        );
        let mut bytes = [0; Self::MAX_LEN];
        bytes[..digest.len()].copy_from_slice(digest);
        // Cannot truncate: checked against MAX_LEN (32) above.
        Self {
            bytes,
            len: digest.len() as u8,
        }
    }

    /// The digest bytes, exactly as vLLM holds them (`BlockHash` bytes).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// Lower-case hex of [`as_bytes`](Self::as_bytes).
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = String::with_capacity(self.as_bytes().len() * 2);
        for &b in self.as_bytes() {
            hex.push(char::from(DIGITS[usize::from(b >> 4)]));
            hex.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
        hex
    }

    /// The form KV events carry: the last 8 bytes of the digest read
    /// big-endian (vLLM's `int.from_bytes(digest, "big") & (2**64 - 1)`).
    pub fn to_u64(&self) -> BlockHash {
        let bytes = self.as_bytes();
        let tail = &bytes[bytes.len().saturating_sub(8)..];
        tail.iter().fold(0, |acc, &b| (acc << 8) | u64::from(b))
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Display for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u64_is_the_big_endian_tail() {
        let mut raw = [0u8; 32];
        raw[24..].copy_from_slice(&[0x1f, 0, 0, 0, 0, 0, 0x07, 0x49]);
        let digest = BlockDigest::from_slice(&raw);
        assert_eq!(digest.to_u64(), 0x1f00_0000_0000_0749);
        assert_eq!(digest.as_bytes(), &raw);
    }

    #[test]
    fn short_digests_keep_their_length() {
        let digest = BlockDigest::from_slice(&[0xab; 16]);
        assert_eq!(digest.as_bytes().len(), 16);
        assert_eq!(digest.to_hex(), "ab".repeat(16));
        assert_eq!(digest.to_u64(), 0xabab_abab_abab_abab);
        assert_ne!(digest, BlockDigest::from_slice(&[0xab; 17]));
        assert_eq!(format!("{digest:?}"), "ab".repeat(16));
    }
}
