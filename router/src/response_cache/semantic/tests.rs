use std::collections::HashMap;

use kvroute_engine_sim::embeddings::embed;
use proptest::prelude::*;

use super::*;
use crate::config::{Embeddings, Semantic as Config};

/// Questions that share words, so that some embed close together.
const QUESTIONS: [&str; 6] = [
    "what is a kv cache",
    "what is a kv block",
    "how do i reset my password",
    "how do i reset my router",
    "what is the capital of australia",
    "what is the capital of austria",
];

fn semantic() -> Arc<Semantic> {
    let config = Config {
        embeddings: Embeddings {
            url: "http://127.0.0.1:9".into(),
            model: "e".into(),
            api_key_file: None,
            timeout_ms: 200,
        },
        threshold: crate::config::DEFAULT_THRESHOLD,
        max_entries: 1_000,
        max_bytes: 64 << 20,
        check_interval_s: 60,
    };
    let semantic = Semantic::new(&config, &Limits::default(), Arc::default()).unwrap();
    semantic.checked(Ok(kvroute_engine_sim::embeddings::DIM));
    Arc::new(semantic)
}

proptest! {
    /// Whatever tenants ask, in any order and context, a semantic hit is
    /// always an entry its own tenant remembered in the same context; and
    /// a question asked again (in another case, with punctuation) by the
    /// same tenant in the same context is a hit.
    #[test]
    fn no_tenant_is_served_another_tenants_semantic_entry(
        asks in proptest::collection::vec(
            (proptest::option::of(0..4u8), 0..2u8, 0..QUESTIONS.len(), any::<bool>()),
            1..60,
        ),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let _in_runtime = runtime.enter();
        let semantic = semantic();
        let mut owners = HashMap::new();
        for (i, (tenant, context, q, shout)) in asks.into_iter().enumerate() {
            let owner = (tenant, context, q);
            let name = tenant.map(|t| format!("tenant-{t}"));
            let text = if shout {
                format!("{}?", QUESTIONS[q].to_uppercase())
            } else {
                QUESTIONS[q].to_owned()
            };
            let vector = embed(&text).unwrap();
            match semantic.matching(name.as_deref(), "m", vector, [context; 32]) {
                Found::Similar(hit, _) => {
                    let (t, c, _) = owners[&hit.key.digest];
                    prop_assert_eq!((t, c), (tenant, context), "another tenant's or context's entry");
                }
                Found::Unmatched(Some(remember)) => {
                    let asked_before = owners.values().any(|o| *o == owner);
                    prop_assert!(!asked_before, "{owner:?} asked again is a miss");
                    let mut digest = [0; 32];
                    digest[..8].copy_from_slice(&(i as u64).to_le_bytes());
                    owners.insert(digest, owner);
                    semantic.remember(remember, Key { digest, model: "m".into() });
                }
                Found::Unmatched(None) => prop_assert!(false, "a valid vector is refused"),
            }
        }
    }
}

#[test]
fn while_the_check_fails_nothing_is_remembered_and_a_new_dimension_empties_the_index() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _in_runtime = runtime.enter();
    let semantic = semantic();
    let key = |n: u8| Key {
        digest: [n; 32],
        model: "m".into(),
    };
    let remember =
        |text: &str| match semantic.matching(Some("t"), "m", embed(text).unwrap(), [0; 32]) {
            Found::Unmatched(Some(r)) => r,
            other => panic!("{other:?}"),
        };
    semantic.remember(remember(QUESTIONS[0]), key(0));
    assert_eq!(semantic.read().len(), 1);
    // A constant embedder: the level is off.
    let r = remember(QUESTIONS[2]);
    semantic.checked(Err(check::Failure::Similar(1.0)));
    semantic.remember(r, key(1));
    assert_eq!(semantic.read().len(), 1, "nothing remembered while off");
    let question = Question {
        text: QUESTIONS[0].into(),
        context: [0; 32],
    };
    let found = runtime.block_on(semantic.lookup(Some("t"), "m", &question));
    assert!(matches!(found, Found::Unmatched(None)), "{found:?}");
    assert_eq!(semantic.metrics.semantic_skipped.get(), 1);
    assert_eq!(semantic.metrics.embedder_healthy.get(), 0);
    // Back, at the same dimension: the entries are kept.
    semantic.checked(Ok(kvroute_engine_sim::embeddings::DIM));
    assert_eq!(semantic.read().len(), 1);
    assert_eq!(semantic.metrics.embedder_healthy.get(), 1);
    // Another model: emptied, and vectors of the old one are refused.
    let old = remember(QUESTIONS[4]);
    semantic.checked(Ok(1024));
    assert_eq!(semantic.read().len(), 0);
    semantic.remember(old, key(2));
    assert_eq!(semantic.read().len(), 0);
}
