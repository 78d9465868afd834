//! The built-in tokenizer: a vocabulary-free, deterministic stand-in for a
//! real tokenizer, about four characters per token. The exact rules are in
//! the [module docs](super); this file is their only implementation.

use xxhash_rust::xxh3::xxh3_64;

/// Ids below this are reserved (for special tokens a test or simulator may
/// want) and never produced by [`token_id`].
pub const FIRST_ID: u32 = 256;

/// One past the largest id [`token_id`] produces.
pub const END_ID: u32 = 100_000;

/// The most ASCII alphanumerics one word piece carries.
const WORD_CHUNK: usize = 4;

/// Splits `text` into pieces, left to right, and calls `f` with each: a
/// word (an optional leading ASCII space and a run of ASCII alphanumerics)
/// cut into chunks of at most [`WORD_CHUNK`] alphanumerics, the space
/// staying on the first chunk; any other character is a piece of its own.
/// A callback rather than a `Vec<&str>`, which at 16 bytes per piece of
/// about 4 bytes would cost [`encode`] four times its text.
fn for_each_piece<'t>(text: &'t str, mut f: impl FnMut(&'t str)) {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let run_start =
            if bytes[i] == b' ' && bytes.get(i + 1).is_some_and(u8::is_ascii_alphanumeric) {
                i + 1
            } else {
                i
            };
        if bytes[run_start].is_ascii_alphanumeric() {
            let run_end = alphanumeric_run_end(bytes, run_start + 1);
            // All boundaries below sit on ASCII bytes, so slicing is safe.
            let mut start = i;
            let mut end = (run_start + WORD_CHUNK).min(run_end);
            loop {
                f(&text[start..end]);
                if end == run_end {
                    break;
                }
                start = end;
                end = (start + WORD_CHUNK).min(run_end);
            }
            i = run_end;
        } else {
            let len = text[i..].chars().next().map_or(1, char::len_utf8);
            f(&text[i..i + len]);
            i += len;
        }
    }
}

/// Where the run of ASCII alphanumerics at `bytes[from..]` ends. Eight
/// bytes at a time (SWAR): a word's end is then one `trailing_zeros`, not a
/// branch per byte that mispredicts at every word's end, which was the
/// splitter's largest cost.
fn alphanumeric_run_end(bytes: &[u8], mut from: usize) -> usize {
    const LANES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x80 * LANES;
    // Per lane of a byte below 0x80: the high bit is set when it is at
    // least `lo` and at most `hi` (no sum carries into the next lane).
    let within = |t: u64, lo: u8, hi: u8| {
        ((t + u64::from(0x80 - lo) * LANES) & !(t + u64::from(0x7f - hi) * LANES)) & HIGH
    };
    while let Some(chunk) = bytes.get(from..from + 8) {
        let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let t = x & !HIGH;
        let alphanumeric = (within(t, b'0', b'9') | within(t | (0x20 * LANES), b'a', b'z')) & !x;
        let other = !alphanumeric & HIGH;
        if other != 0 {
            return from + (other.trailing_zeros() / 8) as usize;
        }
        from += 8;
    }
    from + bytes[from..]
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric())
        .count()
}

/// The pieces of `text`, for tests of the splitting rules.
#[cfg(test)]
fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for_each_piece(text, |piece| out.push(piece));
    out
}

/// The id of one piece: `256 + xxh3_64(piece) % 99_744`.
pub fn token_id(piece: &str) -> u32 {
    let span = u64::from(END_ID - FIRST_ID);
    // The remainder is below 99_744, so it fits in a u32.
    FIRST_ID + (xxh3_64(piece.as_bytes()) % span) as u32
}

/// Calls `f` with the id of each piece of `text`, holding none of them.
pub fn encode_each(text: &str, mut f: impl FnMut(u32)) {
    for_each_piece(text, |piece| f(token_id(piece)));
}

/// Encodes `text` with the built-in rules.
pub fn encode(text: &str) -> Vec<u32> {
    // Sized exactly by a counting pass, so the ids cost 4 bytes a piece
    // (about the text on English, twice it on code at 1.8 bytes a piece) and
    // are never reallocated. A guess plus growth is not cheaper in memory:
    // glibc may place the first guess in its heap (its mmap threshold rises
    // to the size of the last large block freed), and growing copies it to a
    // new block while the old one stays resident. On a 30 MiB prompt with
    // `text.len() / 4 + 1` the router's peak rose by 4.09× the body against
    // 3.09× when exact (`router/tests/it/memory.rs`). The pass costs about 1 ns
    // a byte (118 against 85 ms on 30 MiB, release).
    let mut n = 0;
    for_each_piece(text, |_| n += 1);
    let mut ids = Vec::with_capacity(n);
    for_each_piece(text, |piece| ids.push(token_id(piece)));
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_words_into_chunks_of_four_alphanumerics() {
        assert_eq!(pieces("Hello, world"), ["Hell", "o", ",", " worl", "d"]);
        assert_eq!(pieces("abcdefghij"), ["abcd", "efgh", "ij"]);
        assert_eq!(pieces(" abcd"), [" abcd"]);
        assert_eq!(pieces("a1b2c3"), ["a1b2", "c3"]);
    }

    #[test]
    fn spaces_attach_only_to_a_following_alphanumeric() {
        assert_eq!(pieces("a  b"), ["a", " ", " b"]);
        assert_eq!(pieces("x ,"), ["x", " ", ","]);
        assert_eq!(pieces(" "), [" "]);
        assert_eq!(pieces("end "), ["end", " "]);
        assert_eq!(pieces("\tab\ncd"), ["\t", "ab", "\n", "cd"]);
        assert_eq!(pieces("a_b-c"), ["a", "_", "b", "-", "c"]);
        assert_eq!(
            pieces("<|im_start|>"),
            ["<", "|", "im", "_", "star", "t", "|", ">"]
        );
    }

    #[test]
    fn non_ascii_characters_are_single_pieces() {
        assert_eq!(pieces("café"), ["caf", "é"]);
        assert_eq!(pieces(" über"), [" ", "ü", "ber"]);
        assert_eq!(pieces("日本語"), ["日", "本", "語"]);
        assert_eq!(pieces("a🦀b"), ["a", "🦀", "b"]);
    }

    #[test]
    fn pieces_concatenate_back_to_the_text() {
        let text = "  The year 2024: naïve   café-owners\r\nsaid \"hi\"!  ";
        assert_eq!(pieces(text).concat(), text);
        assert!(pieces("").is_empty());
    }

    proptest::proptest! {
        /// The eight-byte scan finds the run a byte-by-byte one finds.
        #[test]
        fn runs_end_where_a_byte_scan_ends_them(
            bytes in proptest::collection::vec(proptest::prop_oneof![
                proptest::prelude::any::<u8>(),
                proptest::prelude::Just(b'a'),
                proptest::prelude::Just(b'Z'),
                proptest::prelude::Just(b'5'),
            ], 0..40),
            from in 0usize..40,
        ) {
            let from = from.min(bytes.len());
            let scanned = from + bytes[from..].iter().take_while(|b| b.is_ascii_alphanumeric()).count();
            proptest::prop_assert_eq!(alphanumeric_run_end(&bytes, from), scanned);
        }
    }

    #[test]
    fn every_byte_is_classified_as_is_ascii_alphanumeric_does() {
        for b in 0..=255u8 {
            let mut bytes = [b'a'; 9];
            bytes[3] = b;
            let end = if b.is_ascii_alphanumeric() { 9 } else { 3 };
            assert_eq!(alphanumeric_run_end(&bytes, 0), end, "byte {b:#04x}");
        }
    }

    #[test]
    fn ids_are_pinned() {
        // Computed once from the rules (and cross-checked with Python's
        // `xxhash.xxh3_64_intdigest`); a change here silently invalidates
        // every block an engine simulator has cached.
        assert_eq!(encode("Hello, world"), [79479, 15371, 60414, 6590, 66410]);
        assert_eq!(encode(" über\n日"), [77199, 56366, 30904, 97500, 56836]);
    }

    #[test]
    fn ids_stay_in_range() {
        let text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. \
                    0123456789 !@#$%^&*() ñ 日本 🦀";
        for id in encode(text) {
            assert!((FIRST_ID..END_ID).contains(&id), "id {id} out of range");
        }
        assert_eq!(token_id(""), FIRST_ID + (xxh3_64(b"") % 99_744) as u32);
    }

    #[test]
    fn about_four_characters_per_token_on_english() {
        let text = "The router must compute exactly the token ids an engine \
                    will see for a request, so that it can hash the same KV \
                    cache blocks. Both the engine simulator and the router \
                    call this module, so they agree by construction. A \
                    paragraph of ordinary English prose, with punctuation and \
                    a few longer words such as deterministic, should come out \
                    at roughly four characters per token.";
        let ratio = text.chars().count() as f64 / encode(text).len() as f64;
        assert!((3.0..=5.0).contains(&ratio), "{ratio} characters per token");
    }
}
