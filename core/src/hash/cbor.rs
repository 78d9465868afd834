//! Canonical CBOR (RFC 8949 core deterministic encoding) as
//! `cbor2.dumps(obj, canonical=True)` writes the few value kinds a preimage
//! uses: tuples as definite-length arrays, `bytes` (major type 2), `str`
//! (major type 3), non-negative ints (major type 0) and `None` (`0xf6`),
//! every head in its shortest form.
//!
//! Not here: maps, floats, tags, negative ints: preimages have none.

use super::preimage::Encoder;

const MAJOR_UINT: u8 = 0;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// Writes one CBOR item into a caller-owned buffer, which it clears first.
#[derive(Debug)]
pub(crate) struct Cbor<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Cbor<'a> {
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        out.clear();
        Self { out }
    }

    /// A head with the shortest argument encoding.
    fn head(&mut self, major: u8, arg: u64) {
        let major = major << 5;
        if arg < 24 {
            // arg < 24 fits the low 5 bits.
            self.out.push(major | arg as u8);
        } else if let Ok(arg) = u8::try_from(arg) {
            self.out.extend_from_slice(&[major | 24, arg]);
        } else if let Ok(arg) = u16::try_from(arg) {
            self.out.push(major | 25);
            self.out.extend_from_slice(&arg.to_be_bytes());
        } else if let Ok(arg) = u32::try_from(arg) {
            self.out.push(major | 26);
            self.out.extend_from_slice(&arg.to_be_bytes());
        } else {
            self.out.push(major | 27);
            self.out.extend_from_slice(&arg.to_be_bytes());
        }
    }
}

impl Encoder for Cbor<'_> {
    fn begin(&mut self) {}

    fn finish(&mut self) {}

    fn tuple_start(&mut self, len: usize) {
        self.head(MAJOR_ARRAY, len as u64);
    }

    fn tuple_end(&mut self, _len: usize) {}

    fn bytes(&mut self, value: &[u8]) {
        self.head(MAJOR_BYTES, value.len() as u64);
        self.out.extend_from_slice(value);
    }

    fn str(&mut self, value: &str) {
        self.head(MAJOR_TEXT, value.len() as u64);
        self.out.extend_from_slice(value.as_bytes());
    }

    fn uint(&mut self, value: u32) {
        self.head(MAJOR_UINT, u64::from(value));
    }

    fn none(&mut self) {
        self.out.push(NULL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cbor(f: impl FnOnce(&mut Cbor<'_>)) -> String {
        let mut out = Vec::new();
        let mut c = Cbor::new(&mut out);
        c.begin();
        f(&mut c);
        c.finish();
        out.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn uint_heads_are_shortest() {
        let cases = [
            (0, "00"),
            (23, "17"),
            (24, "1818"),
            (255, "18ff"),
            (256, "190100"),
            (65_535, "19ffff"),
            (65_536, "1a00010000"),
            (128_000, "1a0001f400"),
            (u32::MAX, "1affffffff"),
        ];
        for (value, expected) in cases {
            assert_eq!(cbor(|c| c.uint(value)), expected, "{value}");
        }
    }

    #[test]
    fn arrays_bytes_text_null() {
        assert_eq!(cbor(|c| c.tuple_start(0)), "80");
        assert_eq!(
            cbor(|c| {
                c.tuple_start(4);
                for t in 0..4 {
                    c.uint(t);
                }
                c.tuple_end(4);
            }),
            "8400010203"
        );
        assert_eq!(cbor(|c| c.tuple_start(24)), "9818");
        assert_eq!(cbor(|c| c.bytes(&[0xab; 2])), "42abab");
        assert_eq!(cbor(|c| c.bytes(&[])), "40");
        let long = cbor(|c| c.bytes(&[0; 256]));
        assert!(long.starts_with("590100"), "{}", &long[..6]);
        assert_eq!(cbor(|c| c.str("lora")), "646c6f7261");
        assert_eq!(cbor(|c| c.str("é")), "62c3a9");
        assert_eq!(
            cbor(|c| c.str("vllm-none-hash")),
            "6e766c6c6d2d6e6f6e652d68617368"
        );
        assert_eq!(cbor(|c| c.none()), "f6");
    }
}
