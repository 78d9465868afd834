//! The Python objects vLLM hashes, described once and written through either
//! serializer.
//!
//! A block's preimage is `(parent_digest: bytes, tokens: tuple[int, ...],
//! extra_keys: tuple | None)`; the parent of block 0 is the digest of the
//! seed string alone. [`Encoder`] is the handful of Python value kinds those
//! objects use, so the pickle and CBOR writers cannot disagree on structure.

use super::{ExtraKeysForm, Lora};

/// A serializer for the Python values that occur in a preimage. Calls arrive
/// in the order CPython's pickler visits the objects: `tuple_start`, the
/// items, `tuple_end`.
pub(crate) trait Encoder {
    /// Writes whatever precedes the top-level object.
    fn begin(&mut self);
    /// Writes whatever follows the top-level object.
    fn finish(&mut self);
    /// Opens a tuple of `len` items.
    fn tuple_start(&mut self, len: usize);
    /// Closes the tuple of `len` items opened last.
    fn tuple_end(&mut self, len: usize);
    /// A Python `bytes`.
    fn bytes(&mut self, value: &[u8]);
    /// A Python `str`.
    fn str(&mut self, value: &str);
    /// A non-negative Python `int` (token ids are `u32`).
    fn uint(&mut self, value: u32);
    /// Each of `values` as [`uint`](Self::uint) writes it.
    fn uints(&mut self, values: &[u32]) {
        for &v in values {
            self.uint(v);
        }
    }
    /// Python `None`.
    fn none(&mut self);
}

/// The extra keys of one block, already narrowed to that block (the cache
/// salt only reaches block 0).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockKeys<'a> {
    pub(crate) form: ExtraKeysForm,
    pub(crate) lora: Option<&'a Lora>,
    pub(crate) cache_salt: Option<&'a str>,
}

impl BlockKeys<'_> {
    fn write<E: Encoder>(&self, e: &mut E) {
        let len = usize::from(self.lora.is_some()) + usize::from(self.cache_salt.is_some());
        if len == 0 {
            e.none();
            return;
        }
        e.tuple_start(len);
        match self.form {
            ExtraKeysForm::Tagged => {
                if let Some(lora) = self.lora {
                    e.tuple_start(3);
                    e.str("lora");
                    e.str(&lora.name);
                    e.str(&lora.path);
                    e.tuple_end(3);
                }
                if let Some(salt) = self.cache_salt {
                    e.tuple_start(2);
                    e.str("cache_salt");
                    e.str(salt);
                    e.tuple_end(2);
                }
            }
            ExtraKeysForm::Legacy => {
                if let Some(lora) = self.lora {
                    e.str(&lora.name);
                }
                if let Some(salt) = self.cache_salt {
                    e.str(salt);
                }
            }
        }
        e.tuple_end(len);
    }
}

/// Writes `(parent, tuple(tokens), extra_keys)` as one top-level object.
pub(crate) fn write_block<E: Encoder>(e: &mut E, parent: &[u8], tokens: &[u32], keys: &BlockKeys) {
    e.begin();
    e.tuple_start(3);
    e.bytes(parent);
    e.tuple_start(tokens.len());
    e.uints(tokens);
    e.tuple_end(tokens.len());
    keys.write(e);
    e.tuple_end(3);
    e.finish();
}

/// Writes the seed string as one top-level object (the NONE_HASH preimage).
pub(crate) fn write_seed<E: Encoder>(e: &mut E, seed: &str) {
    e.begin();
    e.str(seed);
    e.finish();
}
