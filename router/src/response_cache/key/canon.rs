//! The canonical form of a request body's JSON values, hashed as they are
//! parsed: no tree of the body is ever built, so a body costs its own
//! bytes and a few digests per object member, whatever it holds (a tree of
//! `[0,0,…]` is 16 times its text).
//!
//! The form (prefix-free, so no two values feed the same bytes):
//! - `null`, `true`, `false`: one tag byte each.
//! - A number: an integer when it is one below 2^53 in magnitude, however
//!   written (`8`, `8.0`, `0`, `-0`, `0.0` are the engine's same value);
//!   else its `f64` (the engine reads it as one). An integral number of
//!   2^53 or more that is not an exact integer literal is refused
//!   ([`NUMBER`]): its value may have been rounded.
//! - A string: its length and decoded bytes.
//! - An array: its elements in order, then an end tag.
//! - An object: its member count, then its members sorted by key, each the
//!   key and the SHA-256 of its value's form. An object with a repeated
//!   key ([`DUPLICATE`]) or more than [`MAX_MEMBERS`] members
//!   ([`MEMBERS`]) is refused: which of two values an engine keeps is its
//!   own choice, and sorting is bounded.
//!
//! serde_json parses (and limits nesting to 128); this only visits.

use std::borrow::Cow;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};

/// Members an object may have (its request is not cacheable beyond).
pub const MAX_MEMBERS: usize = 1024;

/// Refused: a repeated key in an object.
pub const DUPLICATE: &str = "duplicate_key";
/// Refused: an object with more than [`MAX_MEMBERS`] members.
pub const MEMBERS: &str = "members";
/// Refused: an integral number too large to be exact.
pub const NUMBER: &str = "number";

/// Why a value has no canonical form: [`DUPLICATE`], [`MEMBERS`],
/// [`NUMBER`] or `body` (not JSON).
pub type Refused = &'static str;

/// An object's members: each key and its value's digest.
pub type Members<'b> = Vec<(Cow<'b, str>, [u8; 32])>;

/// The SHA-256 of the canonical form of the JSON value `raw`.
pub fn digest(raw: &[u8]) -> Result<[u8; 32], Refused> {
    let mut out = Sha256::new();
    let mut de = serde_json::Deserializer::from_slice(raw);
    (Canon { out: &mut out })
        .deserialize(&mut de)
        .map_err(why)?;
    de.end().map_err(why)?;
    Ok(out.finalize().into())
}

/// Feeds the form of an object with `members` into `out`, sorting them
/// first; refuses repeated keys.
pub fn object(out: &mut Sha256, members: &mut Members<'_>) -> Result<(), Refused> {
    sorted(members)?;
    feed_object(out, members);
    Ok(())
}

/// Sorts `members` by key; refuses repeated keys.
pub fn sorted(members: &mut Members<'_>) -> Result<(), Refused> {
    members.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    if members.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(DUPLICATE);
    }
    Ok(())
}

/// Feeds the form of an object with `members`, [`sorted`], into `out`.
pub fn feed_object(out: &mut Sha256, members: &Members<'_>) {
    out.update(b"{");
    out.update((members.len() as u64).to_le_bytes());
    for (key, value) in members {
        out.update((key.len() as u64).to_le_bytes());
        out.update(key.as_bytes());
        out.update(value);
    }
}

/// The refusal a serde_json error stands for.
pub fn why(e: serde_json::Error) -> Refused {
    let text = e.to_string();
    [DUPLICATE, MEMBERS, NUMBER]
        .into_iter()
        .find(|r| text.starts_with(r))
        .unwrap_or("body")
}

/// Feeds the canonical form of the value it visits into `out`.
pub struct Canon<'s> {
    pub out: &'s mut Sha256,
}

impl<'de> DeserializeSeed<'de> for Canon<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// Integers at most this large in magnitude are exact as `f64`.
const EXACT: f64 = 9_007_199_254_740_992.0;

impl Canon<'_> {
    /// An integer: zigzag-coded, its significant bytes after their count
    /// (a `0` of a large array feeds two bytes, not seventeen).
    fn integer(self, v: i128) {
        let zigzag = ((v << 1) ^ (v >> 127)) as u128;
        let bytes = zigzag.to_le_bytes();
        let n = 16 - (zigzag.leading_zeros() / 8) as usize;
        self.out.update([b'i', n as u8]);
        self.out.update(&bytes[..n]);
    }
}

impl<'de> Visitor<'de> for Canon<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.out.update(b"n");
        Ok(())
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.out.update(if v { b"t" } else { b"f" });
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.integer(i128::from(v));
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.integer(i128::from(v));
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        if v.fract() == 0.0 && v.abs() < EXACT {
            self.integer(v as i128);
        } else if v.fract() == 0.0 {
            return Err(E::custom(NUMBER));
        } else {
            self.out.update(b"d");
            self.out.update(v.to_bits().to_le_bytes());
        }
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.out.update(b"s");
        self.out.update((v.len() as u64).to_le_bytes());
        self.out.update(v.as_bytes());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.out.update(b"[");
        while seq
            .next_element_seed(Canon {
                out: &mut *self.out,
            })?
            .is_some()
        {}
        self.out.update(b"]");
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut members = Members::new();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if members.len() == MAX_MEMBERS {
                return Err(de::Error::custom(MEMBERS));
            }
            let mut value = Sha256::new();
            map.next_value_seed(Canon { out: &mut value })?;
            members.push((key, value.finalize().into()));
        }
        object(self.out, &mut members).map_err(de::Error::custom)
    }
}

/// An object's key, borrowed from the body when it has no escapes.
pub struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}
