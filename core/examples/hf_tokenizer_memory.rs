//! Benchmark: peak memory of tokenizing a large prompt with a Hugging Face
//! tokenizer, per token and per byte of text, so the router's body budget
//! can be set for it.
//!
//! No model's `tokenizer.json` can be downloaded here, so the program
//! trains a byte-level BPE (GPT-2 style, 8,000 tokens) on generated text
//! and loads it through `kvroute_core::tokenize::Tokenizer`, as the router
//! loads a model's file. The per-token cost is that of the library's
//! `Encoding` (ids, type ids, token strings, offsets, masks), which does not
//! depend on the vocabulary. Linux only (reads `/proc/self/status`).
//!
//! ```sh
//! cargo run --release -p kvroute-core --example hf_tokenizer_memory [MIB]
//! ```

use kvroute_core::tokenize::Tokenizer;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerImpl};

/// `VmHWM` and `VmRSS` of this process, kB.
fn memory_kb() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux /proc");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Text of `bytes` bytes: words from a 5,000-word vocabulary, drawn by a
/// fixed xorshift, with punctuation and digits.
fn text(bytes: usize) -> String {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let syllables = [
        "ka", "ro", "ute", "che", "blo", "ck", "pre", "fix", "ser", "ve", "lo", "ad",
    ];
    let words: Vec<String> = (0..5000)
        .map(|_| {
            let n = 1 + next() % 4;
            (0..n)
                .map(|_| syllables[(next() % syllables.len() as u64) as usize])
                .collect()
        })
        .collect();
    let mut out = String::with_capacity(bytes + 32);
    while out.len() < bytes {
        let r = next();
        out.push_str(&words[(r % words.len() as u64) as usize]);
        out.push_str(match r % 17 {
            0 => ". ",
            1 => ", ",
            2 => " 42 ",
            _ => " ",
        });
    }
    out
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .map_or(16, |a| a.parse().expect("MIB is a number"));
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(8000)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build();
    let mut bpe: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, PostProcessorWrapper, ByteLevel> =
        TokenizerImpl::new(BPE::default());
    bpe.with_pre_tokenizer(Some(ByteLevel::default()));
    bpe.with_decoder(Some(ByteLevel::default()));
    bpe.train(&mut trainer, text(1 << 20).lines().map(str::to_owned))
        .expect("training");
    let json = bpe.to_string(false).expect("serializing");
    drop(bpe);
    let tokenizer = Tokenizer::from_tokenizer_json(json.as_bytes()).expect("loading");
    let prompt = text(mib << 20);
    let (_, before) = memory_kb();
    let start = std::time::Instant::now();
    let ids = tokenizer.encode(&prompt, false).expect("encoding");
    let elapsed = start.elapsed();
    let (peak, _) = memory_kb();
    let rise = (peak.saturating_sub(before) * 1024) as f64;
    let tokens = ids.len() as f64;
    println!(
        "{mib} MiB of text, {} tokens ({:.2} bytes/token), encoded in {:.2} s ({:.2} µs/token)",
        ids.len(),
        prompt.len() as f64 / tokens,
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / tokens
    );
    println!(
        "peak memory rose by {:.0} MB: {:.0} bytes per token, {:.1}× the text",
        rise / 1e6,
        rise / tokens,
        rise / prompt.len() as f64
    );
}
