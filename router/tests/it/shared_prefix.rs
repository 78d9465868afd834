//! Cold keys behind a block every prompt shares (the chat template's header
//! and a common first sentence), over real engine sims: placed by
//! rendezvous, not herded onto the endpoint that held the template first.

use std::collections::HashMap;

use kvroute_core::keys::RoutingKey;
use kvroute_core::rendezvous::{endpoint_id, rank};
use serde_json::json;

use crate::support::*;

#[tokio::test]
async fn cold_keys_behind_a_shared_template_block_spread_as_rendezvous_says() {
    let stack = Stack::start("shared-prefix", 4, true, |_| {}, |_| {}).await;
    stack.wait_live().await;
    let ids: Vec<u64> = (0..4).map(|i| endpoint_id(&format!("sim-{i}"))).collect();
    let preamble = "You are the assistant of a large company. Answer briefly and politely. ";
    let mut per: HashMap<String, u32> = HashMap::new();
    for g in 0..16 {
        let key = format!("conversation-{g}");
        let mut body = chat(&format!("{preamble}{}", long_text(g)), "hello", 1);
        body["prompt_cache_key"] = json!(key);
        stack.wait_idle().await;
        let before = stack.router.pool.index_entries();
        let r = stack.post("/v1/chat/completions", body).await;
        assert_eq!(r.status(), 200);
        let got = r.headers()["x-kvroute-endpoint"]
            .to_str()
            .unwrap()
            .to_owned();
        eventually("the index sees the blocks", || {
            stack.router.pool.index_entries() > before
        })
        .await;
        // Two requests may share a prefix by chance; from the third on the
        // router knows the template's block is everyone's.
        if g >= 2 {
            let first = rank(RoutingKey::conversation(None, &key).0, &ids)[0];
            assert_eq!(got, format!("sim-{first}"), "{key}");
        }
        *per.entry(got).or_default() += 1;
    }
    assert_eq!(per.len(), 4, "every endpoint serves some keys: {per:?}");
    stack.stop().await;
}
