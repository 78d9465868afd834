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
    };
    Arc::new(Semantic::new(&config, &Limits::default(), Arc::default()).unwrap())
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
