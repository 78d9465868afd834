use proptest::prelude::*;

use super::*;

fn sim(a: &str, b: &str) -> f32 {
    cosine(&embed(a).unwrap(), &embed(b).unwrap())
}

#[test]
fn words_are_lowercased_alphanumeric_runs() {
    assert_eq!(
        words("What's the KV-cache hit rate of Llama-3.1, in %?"),
        [
            "whats", "the", "kv", "cache", "hit", "rate", "of", "llama", "3", "1", "in"
        ]
    );
    assert_eq!(
        words("Ünïcode CAFÉ 東京 max_tokens"),
        ["ünïcode", "café", "東京", "max", "tokens"]
    );
    assert!(words(" ?!... -- ").is_empty());
}

#[test]
fn text_without_words_has_no_embedding() {
    assert_eq!(embed(""), None);
    assert_eq!(embed(" ?!... "), None);
}

#[test]
fn the_hashing_rule_is_pinned() {
    // A benchmark may recompute these vectors offline: changing the rule
    // must be deliberate. "kv cache" is two words and one bigram, norm 1.5.
    assert_eq!(xxh3_64(b"kv"), 0x315e_a577_7716_fb9e);
    let v = embed("kv cache").unwrap();
    let nonzero: Vec<(usize, f32)> = v
        .iter()
        .enumerate()
        .filter(|(_, x)| **x != 0.0)
        .map(|(i, x)| (i, *x))
        .collect();
    assert_eq!(
        nonzero,
        [(158, 1.0 / 1.5), (194, -0.5 / 1.5), (238, 1.0 / 1.5)]
    );
}

#[test]
fn case_and_punctuation_do_not_matter() {
    for (a, b) in [
        ("What is a KV cache?", "what is a kv cache"),
        (
            "What's the capital of Australia?",
            "whats the capital of australia",
        ),
        (
            "How do I enable two-factor authentication?",
            "how do i enable two factor authentication",
        ),
        ("What does max_tokens do?", "what does MAX_TOKENS do"),
    ] {
        assert_eq!(embed(a), embed(b), "{a} / {b}");
        assert!((sim(a, b) - 1.0).abs() < 1e-6);
    }
}

#[test]
fn order_counts_only_through_bigrams() {
    let s = sim(
        "In Python, how do I reverse a list?",
        "How do I reverse a list in Python?",
    );
    assert!(s > 0.75 && s < 0.99, "{s}");
    let s = sim("Is a square a rectangle?", "Is a rectangle a square?");
    assert!(s > 0.5 && s < 0.99, "{s}");
}

#[test]
fn unrelated_questions_are_far_apart() {
    for (a, b) in [
        ("What is a KV cache?", "How long should I boil an egg?"),
        (
            "How do I reset my password?",
            "Who wrote Pride and Prejudice?",
        ),
        (
            "What port does PostgreSQL use by default?",
            "Can I bring a power bank on a plane?",
        ),
    ] {
        let s = sim(a, b);
        assert!(s.abs() < 0.25, "{a} / {b}: {s}");
    }
}

#[test]
fn shared_words_are_all_it_sees() {
    // A paraphrase without shared words is far; a near miss is near.
    let paraphrase = sim(
        "How do I track my order?",
        "Where can I see where my package is right now?",
    );
    let near_miss = sim("How do I reset my password?", "How do I reset my router?");
    assert!(paraphrase < 0.5, "{paraphrase}");
    assert!(near_miss > 0.6, "{near_miss}");
    // The same words and word pairs, the opposite question.
    let swapped = sim(
        "Can I switch from the monthly plan to the annual plan mid-cycle?",
        "Can I switch from the annual plan to the monthly plan mid-cycle?",
    );
    assert!((swapped - 1.0).abs() < 1e-6, "{swapped}");
}

proptest! {
    #[test]
    fn embeddings_are_unit_vectors_and_deterministic(text in "\\PC{0,64}") {
        if let Some(v) = embed(&text) {
            prop_assert_eq!(v.len(), DIM);
            let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            prop_assert!((norm - 1.0).abs() < 1e-5, "{}", norm);
            prop_assert_eq!(Some(v), embed(&text));
        } else {
            prop_assert!(words(&text).is_empty());
        }
    }

    #[test]
    fn ascii_case_does_not_matter(text in "[ -~]{0,64}") {
        prop_assert_eq!(embed(&text), embed(&text.to_ascii_uppercase()));
    }
}
