//! Pickle protocol 5 exactly as CPython's C pickler (`_pickle.c`) writes the
//! few value kinds a preimage uses, including its framing.
//!
//! Only what vLLM's `sha256` algorithm feeds `pickle.dumps(obj, protocol=5)`
//! is supported: `bytes`, `str`, non-negative `int` below 2**32, `None` and
//! tuples. Not supported: object identity. CPython memoizes `bytes`, `str`
//! and tuples by identity and writes a `BINGET` when the same object occurs
//! twice in one pickle; this writer treats every value as a fresh object. In a
//! vLLM preimage two values are the same object only in corner cases (say a
//! one-character LoRA name equal to a one-character cache salt, both
//! CPython's cached one-character string), which this module does not model.
//!
//! Framing follows `_Pickler_Write`, `_Pickler_OpcodeBoundary`,
//! `_Pickler_CommitFrame` and `_Pickler_write_bytes`:
//! - after `PROTO`, the first write opens a frame (a 9-byte `FRAME` header
//!   reserved in front of the data);
//! - at the start of saving any object (every `save()` call: each token,
//!   string, tuple, `None`), a frame that has reached 64 KiB is committed; the
//!   next write opens a new one. Opcodes that close a tuple, `MEMOIZE` and
//!   `STOP` are written without that check;
//! - a `bytes` or `str` payload of 64 KiB or more commits the open frame and
//!   is written with its header outside any frame;
//! - committing a frame shorter than 4 bytes drops its header.

use super::preimage::Encoder;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const TUPLE1: u8 = 0x85;
const NONE: u8 = b'N';
const MEMOIZE: u8 = 0x94;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;

const FRAME_HEADER_SIZE: usize = 9;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_SIZE_TARGET: usize = 64 * 1024;

/// Writes one pickle into a caller-owned buffer, which it clears first, so a
/// hasher can reuse one allocation for every block.
#[derive(Debug)]
pub(crate) struct Pickle5<'a> {
    out: &'a mut Vec<u8>,
    framing: bool,
    /// Offset of the open frame's reserved header, if a frame is open.
    frame_start: Option<usize>,
}

impl<'a> Pickle5<'a> {
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        out.clear();
        Self {
            out,
            framing: false,
            frame_start: None,
        }
    }

    fn write(&mut self, data: &[u8]) {
        if self.framing && self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(data);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let frame_len = self.out.len() - start - FRAME_HEADER_SIZE;
        if frame_len >= FRAME_SIZE_MIN {
            self.out[start] = FRAME;
            self.out[start + 1..start + FRAME_HEADER_SIZE]
                .copy_from_slice(&(frame_len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// CPython's `_Pickler_OpcodeBoundary`, called at the start of `save()`.
    fn opcode_boundary(&mut self) {
        if let Some(start) = self.frame_start
            && self.out.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET
        {
            self.commit_frame();
        }
    }

    /// CPython's `_Pickler_write_bytes`: large payloads bypass framing.
    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        let bypass = data.len() >= FRAME_SIZE_TARGET;
        let framing = self.framing;
        if bypass {
            self.commit_frame();
            self.framing = false;
        }
        self.write(header);
        self.write(data);
        self.framing = framing;
    }

    /// A length-prefixed `bytes`/`str` with its short, 4-byte and 8-byte
    /// opcodes, then `MEMOIZE`.
    fn sized(&mut self, ops: [u8; 3], data: &[u8]) {
        self.opcode_boundary();
        let len = data.len();
        let mut header = [0u8; 9];
        let header_len = if let Ok(short) = u8::try_from(len) {
            header[..2].copy_from_slice(&[ops[0], short]);
            2
        } else if let Ok(len) = u32::try_from(len) {
            header[0] = ops[1];
            header[1..5].copy_from_slice(&len.to_le_bytes());
            5
        } else {
            header[0] = ops[2];
            header[1..9].copy_from_slice(&(len as u64).to_le_bytes());
            9
        };
        self.write_payload(&header[..header_len], data);
        self.write(&[MEMOIZE]);
    }
}

impl Encoder for Pickle5<'_> {
    fn begin(&mut self) {
        self.write(&[PROTO, 5]);
        self.framing = true;
    }

    fn finish(&mut self) {
        self.write(&[STOP]);
        self.commit_frame();
        self.framing = false;
    }

    fn tuple_start(&mut self, len: usize) {
        self.opcode_boundary();
        match len {
            // The empty tuple is a singleton: CPython never memoizes it.
            0 => self.write(&[EMPTY_TUPLE]),
            1..=3 => {}
            _ => self.write(&[MARK]),
        }
    }

    fn tuple_end(&mut self, len: usize) {
        match len {
            0 => {}
            // TUPLE1, TUPLE2, TUPLE3 are consecutive opcodes; len - 1 <= 2.
            1..=3 => self.write(&[TUPLE1 + (len - 1) as u8, MEMOIZE]),
            _ => self.write(&[TUPLE, MEMOIZE]),
        }
    }

    fn bytes(&mut self, value: &[u8]) {
        self.sized([SHORT_BINBYTES, BINBYTES, BINBYTES8], value);
    }

    fn str(&mut self, value: &str) {
        self.sized(
            [SHORT_BINUNICODE, BINUNICODE, BINUNICODE8],
            value.as_bytes(),
        );
    }

    fn uint(&mut self, value: u32) {
        self.opcode_boundary();
        let (op, len) = int_opcode(value);
        self.write(&op[..len]);
    }

    /// The hot path of hashing: a block's tokens. When they cannot reach
    /// the frame's size target and a frame is open (or none is wanted), no
    /// opcode boundary or frame start can happen among them: the opcodes
    /// are appended as they are.
    fn uints(&mut self, values: &[u32]) {
        let most = values.len() * INT_OPCODE_MAX;
        let room = match self.frame_start {
            Some(start) => self.out.len() - start - FRAME_HEADER_SIZE + most < FRAME_SIZE_TARGET,
            None => !self.framing,
        };
        if !room {
            for &v in values {
                self.uint(v);
            }
            return;
        }
        // Opcodes of fixed size into a buffer, appended a chunk at a time:
        // no copy of a variable length per token.
        let mut buf = [0u8; 64 * INT_OPCODE_MAX];
        for chunk in values.chunks(64) {
            let mut n = 0;
            for &v in chunk {
                let (op, len) = int_opcode(v);
                buf[n..n + INT_OPCODE_MAX].copy_from_slice(&op);
                n += len;
            }
            self.out.extend_from_slice(&buf[..n]);
        }
    }

    fn none(&mut self) {
        self.opcode_boundary();
        self.write(&[NONE]);
    }
}

/// The longest opcode [`int_opcode`] writes.
const INT_OPCODE_MAX: usize = 7;

/// The opcode pickle writes for a non-negative `value`, and its length
/// (the bytes after it are padding). Without a branch on the value's size
/// (BININT1, BININT2 or BININT): token ids mix them at random.
fn int_opcode(value: u32) -> ([u8; INT_OPCODE_MAX], usize) {
    const OPS: [u8; 3] = [BININT1, BININT2, BININT];
    const LENS: [usize; 3] = [2, 3, 5];
    let le = value.to_le_bytes();
    if value > 0x7fff_ffff {
        // Does not fit a signed 32-bit BININT: LONG1 with the minimal
        // two's-complement little-endian bytes, here 4 bytes plus a zero
        // sign byte.
        return ([LONG1, 5, le[0], le[1], le[2], le[3], 0], 7);
    }
    let size = usize::from(value > 0xff) + usize::from(value > 0xffff);
    ([OPS[size], le[0], le[1], le[2], le[3], 0, 0], LENS[size])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::ExtraKeysForm;
    use crate::hash::preimage::{BlockKeys, write_block, write_seed};

    fn pickle(f: impl FnOnce(&mut Pickle5<'_>)) -> Vec<u8> {
        let mut out = Vec::new();
        let mut p = Pickle5::new(&mut out);
        p.begin();
        f(&mut p);
        p.finish();
        out
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `pickle.dumps(value, protocol=5)`: a frame only from 4 bytes of
    /// content (opcode + argument + STOP) up.
    #[test]
    fn ints_at_each_opcode_boundary() {
        let cases: [(u32, &str); 8] = [
            (0, "80054b002e"),
            (255, "80054bff2e"),
            (256, "80059504000000000000004d00012e"),
            (65535, "80059504000000000000004dffff2e"),
            (65536, "80059506000000000000004a000001002e"),
            (0x7fff_ffff, "80059506000000000000004affffff7f2e"),
            (0x8000_0000, "80059508000000000000008a0500000080002e"),
            (u32::MAX, "80059508000000000000008a05ffffffff002e"),
        ];
        for (value, expected) in cases {
            assert_eq!(hex(&pickle(|p| p.uint(value))), expected, "{value}");
        }
    }

    /// A block's tokens at once, near and across the frame's size target,
    /// pickle as token after token does.
    #[test]
    fn uints_write_what_uint_does() {
        let values: Vec<u32> = (0..30_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> (i % 33).min(31))
            .collect();
        for n in [0, 1, 3, 16, 9_000, 13_000, 16_000, 30_000] {
            let tuple = |p: &mut Pickle5<'_>, at_once: bool| {
                p.tuple_start(n);
                if at_once {
                    p.uints(&values[..n]);
                } else {
                    values[..n].iter().for_each(|&v| p.uint(v));
                }
                p.tuple_end(n);
            };
            let one_by_one = pickle(|p| (0..3).for_each(|_| tuple(p, false)));
            let at_once = pickle(|p| (0..3).for_each(|_| tuple(p, true)));
            assert_eq!(one_by_one, at_once, "{n}");
        }
    }

    #[test]
    fn tuples_of_each_length() {
        let expected = [
            // ()  -> EMPTY_TUPLE, no MEMOIZE, frame of 2 bytes dropped
            "8005292e",
            // (7,) -> K 07 TUPLE1 MEMOIZE
            "80059505000000000000004b0785942e",
            "80059507000000000000004b074b0786942e",
            "80059509000000000000004b074b074b0787942e",
            // 4 items -> MARK ... TUPLE MEMOIZE
            "8005950c00000000000000284b074b074b074b0774942e",
        ];
        for (len, expected) in expected.into_iter().enumerate() {
            let bytes = pickle(|p| {
                p.tuple_start(len);
                for _ in 0..len {
                    p.uint(7);
                }
                p.tuple_end(len);
            });
            assert_eq!(hex(&bytes), expected, "tuple of {len}");
        }
    }

    #[test]
    fn none_bytes_and_strings() {
        assert_eq!(hex(&pickle(|p| p.none())), "80054e2e");
        assert_eq!(
            hex(&pickle(|p| p.bytes(b"ab"))),
            "800595060000000000000043026162942e"
        );
        // str lengths count UTF-8 bytes: 'é' is 2.
        assert_eq!(
            hex(&pickle(|p| p.str("é"))),
            "80059506000000000000008c02c3a9942e"
        );
        assert_eq!(
            hex(&pickle(|p| p.str("vllm-none-hash"))),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );

        let long = pickle(|p| p.bytes(&[0; 256]));
        assert_eq!(hex(&long[..16]), "80059507010000000000004200010000");
        assert_eq!(long.len(), 274);
        let long = pickle(|p| p.str(&"é".repeat(128)));
        assert_eq!(hex(&long[..16]), "80059507010000000000005800010000");
        assert_eq!(hex(&long[long.len() - 3..]), "a9942e");
    }

    #[test]
    fn seed_preimage_is_a_pickled_str() {
        let mut out = Vec::new();
        write_seed(&mut Pickle5::new(&mut out), "vllm-none-hash");
        assert_eq!(
            hex(&out),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
    }

    /// `pickle.dumps((bytes(32), (0,) * n, None), protocol=5)` for a block
    /// size far beyond 64 KiB of opcodes.
    fn zero_block(n: usize) -> Vec<u8> {
        let keys = BlockKeys {
            form: ExtraKeysForm::Tagged,
            lora: None,
            cache_salt: None,
        };
        let mut out = Vec::new();
        write_block(&mut Pickle5::new(&mut out), &[0; 32], &vec![0; n], &keys);
        out
    }

    fn frame_header(bytes: &[u8], at: usize) -> usize {
        assert_eq!(bytes[at], FRAME, "FRAME opcode at {at}");
        let len: [u8; 8] = bytes[at + 1..at + 9].try_into().unwrap();
        usize::try_from(u64::from_le_bytes(len)).unwrap()
    }

    /// Layout: PROTO (2, unframed), FRAME header (9), then the frame:
    /// `C 20 <32> MEMOIZE` (35) + MARK (1) = 36 bytes before token 0, and
    /// 2 bytes (`K 00`) per token. The check runs before each token is saved,
    /// so the frame is cut before token k where 36 + 2k >= 65536, k = 32750.
    #[test]
    fn frames_split_before_the_save_that_finds_64k() {
        let bytes = zero_block(40_000);
        assert_eq!(frame_header(&bytes, 2), 65_536);
        let second = 2 + 9 + 65_536;
        // Tokens 32750..40000 (7250 * 2), TUPLE MEMOIZE, N, TUPLE3 MEMOIZE, STOP.
        assert_eq!(frame_header(&bytes, second), 7_250 * 2 + 2 + 1 + 2 + 1);
        assert_eq!(hex(&bytes[second + 9..second + 13]), "4b004b00");
        assert_eq!(bytes.len(), second + 9 + 14_506);
        assert_eq!(*bytes.last().unwrap(), STOP);
    }

    /// With exactly 32750 tokens the frame reaches 65536 bytes after the last
    /// token, but no object save follows until `None`: the tuple's
    /// `TUPLE MEMOIZE` stay in the first frame (65538 bytes) and the cut
    /// comes before `N`. A checker that ran after each save would cut before
    /// `TUPLE` instead.
    #[test]
    fn closing_opcodes_stay_in_the_full_frame() {
        let bytes = zero_block(32_750);
        assert_eq!(frame_header(&bytes, 2), 65_538);
        assert_eq!(hex(&bytes[2 + 9 + 65_536..2 + 9 + 65_538]), "7494");
        let second = 2 + 9 + 65_538;
        assert_eq!(frame_header(&bytes, second), 4);
        assert_eq!(hex(&bytes[second + 9..]), "4e87942e");
        assert_eq!(bytes.len(), 65_562);

        // One token fewer: the cut is still before N, at exactly 65536.
        let bytes = zero_block(32_749);
        assert_eq!(frame_header(&bytes, 2), 65_536);
        assert_eq!(frame_header(&bytes, 2 + 9 + 65_536), 4);
    }

    /// A 64 KiB payload commits the open frame and is written unframed; the
    /// `MEMOIZE` after it opens a new frame. Here no frame was open yet.
    #[test]
    fn large_payloads_bypass_frames() {
        let text = "x".repeat(70_000);
        let bytes = pickle(|p| {
            p.tuple_start(1);
            p.str(&text);
            p.tuple_end(1);
        });
        assert_eq!(hex(&bytes[..7]), "80055870110100");
        assert_eq!(bytes.len(), 2 + 5 + 70_000 + 9 + 4);
        assert_eq!(hex(&bytes[7 + 70_000..]), "9504000000000000009485942e");

        // An open frame is committed first.
        let bytes = pickle(|p| {
            p.tuple_start(2);
            p.uint(1);
            p.str(&text);
            p.tuple_end(2);
        });
        // 'K 01' is only 2 bytes: too short for a frame, header dropped.
        assert_eq!(hex(&bytes[..9]), "80054b015870110100");
        assert_eq!(hex(&bytes[9 + 70_000..]), "9504000000000000009486942e");
    }
}
