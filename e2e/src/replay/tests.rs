//! The live replay's token mapping against a real engine: on a tiny
//! hand-made trace, the cached tokens engine-sim reports are the replay
//! model's hits.

use std::collections::HashSet;
use std::time::Instant;

use kvroute_engine_sim::Config;

use super::trace;
use crate::suite::load::{self, Outcome};

/// Blocks of 32 tokens: two engine blocks each. No partial last block is
/// reused (the one case where an engine caches less than the replay
/// credits, as the trace module documents); request 4 reuses the whole
/// of request 1 and adds a block; the others share one or two blocks.
const TRACE: &str = r#"
{"timestamp": 0, "input_length": 96, "output_length": 3, "hash_ids": [1, 2, 3]}
{"timestamp": 10, "input_length": 80, "output_length": 1, "hash_ids": [1, 2, 4]}
{"timestamp": 20, "input_length": 40, "output_length": 2, "hash_ids": [1, 5]}
{"timestamp": 30, "input_length": 128, "output_length": 4, "hash_ids": [1, 2, 3, 6]}
{"timestamp": 40, "input_length": 20, "output_length": 1, "hash_ids": [7]}
{"timestamp": 50, "input_length": 50, "output_length": 1, "hash_ids": [9, 10]}
{"timestamp": 60, "input_length": 140, "output_length": 2, "hash_ids": [1, 2, 3, 6, 11]}
{"timestamp": 70, "input_length": 64, "output_length": 1, "hash_ids": [9, 13]}
"#;

#[tokio::test]
async fn engines_cached_tokens_are_the_models_hits() {
    const T: u64 = 32;
    let sim = kvroute_engine_sim::start(Config {
        num_gpu_blocks: 4096,
        ..Config::test()
    })
    .await
    .expect("engine-sim starts");
    let requests = trace::parse(TRACE.trim().as_bytes(), None, T).unwrap();
    let client = reqwest::Client::new();
    // The replay's rule on one replica that never evicts: the leading run
    // of ids seen before, in tokens, at most the prompt.
    let mut seen = HashSet::new();
    let mut hits = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        let m = r
            .hash_ids
            .iter()
            .take_while(|id| seen.contains(*id))
            .count() as u64;
        let model = (m * T).min(r.input_length);
        seen.extend(r.hash_ids.iter().copied());
        let body = trace::body(r, T);
        let (sample, _) = load::stream(
            &client,
            sim.http_addr,
            "/v1/completions",
            &body,
            &[],
            Instant::now(),
        )
        .await;
        assert_eq!(sample.outcome, Outcome::Ok, "request {i}");
        assert_eq!(sample.prompt_tokens, r.input_length, "request {i}");
        hits.push((sample.cached_tokens, model));
    }
    let (engine, model): (Vec<u64>, Vec<u64>) = hits.into_iter().unzip();
    assert_eq!(engine, model);
    assert_eq!(model, [0, 64, 32, 96, 0, 0, 128, 32]);
    sim.shutdown().await;
}
