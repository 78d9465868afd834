//! A deterministic text embedding for tests: a **test double**, not a
//! language model. It stands in for a real embedding model wherever kvroute
//! needs vectors whose cosine similarity grows with shared words (the
//! semantic response cache's tests, the demo, benchmarks), so none of them
//! needs a model. Its similarities mean nothing about meaning beyond shared
//! words. A paraphrase in other words is far ("How do I track my order?" /
//! "Where can I see where my package is right now?": 0.21), a question
//! about something else in the same words is near ("How do I reset my
//! password?" / "... my router?": 0.85), and the same words in another
//! order with the same adjacent pairs are identical ("switch from the
//! monthly plan to the annual plan" and back: 1.0). A similarity threshold
//! tuned on it says nothing about a real model.
//!
//! The rule, which [`embed`] implements and a benchmark may reimplement:
//!
//! 1. **Words.** Each character is lowercased (`char::to_lowercase`, no
//!    Unicode normalization). Letters and digits (`char::is_alphanumeric`,
//!    any script) make up words; apostrophes (`'` and `’`) are dropped
//!    without splitting, so "What's" and "whats" are the same word; every
//!    other character (space, punctuation, symbols) separates words.
//!    ([`words`])
//! 2. **Features.** Every word (a unigram, weight [`UNIGRAM_WEIGHT`] 1.0)
//!    and every pair of adjacent words joined by one space (a bigram, weight
//!    [`BIGRAM_WEIGHT`] 0.5). A feature string never collides with another
//!    kind: words contain no space. Word order therefore counts only through
//!    the bigrams: the same words reordered score high, but below 1.
//! 3. **Signed hashing.** A feature's `h = xxh3_64(utf8 bytes)` (seed 0)
//!    adds `weight` to component `h % DIM` ([`DIM`] = 256) when bit 63 of
//!    `h` is 0, and subtracts it when it is 1, so colliding features cancel
//!    on average instead of piling up.
//! 4. **Normalization.** The vector is divided by its L2 norm, so its norm
//!    is 1 and the cosine of two embeddings is their dot product
//!    ([`cosine`]). Text without words has no direction: [`embed`] answers
//!    `None`, as it does in the (contrived) case where the signed features
//!    cancel to the zero vector.
//!
//! The cost is linear in the text's length: one pass over the characters
//! and one hash per feature, with a 1 KiB vector per text. Not here: the
//! HTTP API and its limits ([`crate::http::embeddings`]).

use xxhash_rust::xxh3::xxh3_64;

/// Components in an embedding.
pub const DIM: usize = 256;

/// What a word (unigram) adds to its component.
pub const UNIGRAM_WEIGHT: f32 = 1.0;

/// What a pair of adjacent words (bigram) adds to its component: half a
/// word, so shared words dominate and order refines.
pub const BIGRAM_WEIGHT: f32 = 0.5;

/// The words of `text`, lowercased (rule 1 of the module doc).
pub fn words(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if c == '\'' || c == '’' {
            continue;
        }
        if c.is_alphanumeric() {
            word.extend(c.to_lowercase());
        } else if !word.is_empty() {
            words.push(std::mem::take(&mut word));
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// The unit-length embedding of `text`; `None` when it has no words (or,
/// for contrived text, its features cancel out).
pub fn embed(text: &str) -> Option<Vec<f32>> {
    embed_words(&words(text))
}

/// The unit-length embedding of words as [`words`] splits them; `None` when
/// there are none or their features cancel out.
pub fn embed_words(words: &[String]) -> Option<Vec<f32>> {
    let mut v = vec![0f32; DIM];
    let mut add = |feature: &str, weight: f32| {
        let h = xxh3_64(feature.as_bytes());
        let sign = if h >> 63 == 0 { 1.0 } else { -1.0 };
        v[(h % DIM as u64) as usize] += sign * weight;
    };
    let mut bigram = String::new();
    for (i, word) in words.iter().enumerate() {
        add(word, UNIGRAM_WEIGHT);
        if let Some(next) = words.get(i + 1) {
            bigram.clear();
            bigram.push_str(word);
            bigram.push(' ');
            bigram.push_str(next);
            add(&bigram, BIGRAM_WEIGHT);
        }
    }
    let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    if norm == 0.0 {
        return None;
    }
    Some(v.iter().map(|x| (f64::from(*x) / norm) as f32).collect())
}

/// The cosine similarity of two vectors of one length; 0 when either is
/// the zero vector.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut dot, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        dot += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    (dot / (aa.sqrt() * bb.sqrt())) as f32
}

#[cfg(test)]
mod tests;
