//! The captured vLLM messages (the project's copy of the vLLM vectors)
//! decode to their documented meaning.

use kvroute_agent::events::{Event, decode_batch, decode_message};
use serde_json::Value;

fn vectors() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../core/tests/fixtures/vllm_vectors.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

/// Checks `event` against the documented `want` (a JSON map, or the
/// positional array of the older form, with the type first).
fn check(event: &Event, want: &Value) {
    let field = |name: &str, index: usize| -> Value {
        match want {
            Value::Object(m) => m.get(name).cloned().unwrap_or(Value::Null),
            Value::Array(a) => a.get(index).cloned().unwrap_or(Value::Null),
            _ => panic!("{want}"),
        }
    };
    let kind = field("type", 0);
    match event {
        Event::Stored(s) => {
            assert_eq!(kind, "BlockStored");
            assert_eq!(s.block_hashes, u64s(&field("block_hashes", 1)));
            assert_eq!(s.parent_block_hash, field("parent_block_hash", 2).as_u64());
            let tokens: Vec<u32> = u64s(&field("token_ids", 3))
                .into_iter()
                .map(|t| t as u32)
                .collect();
            assert_eq!(s.token_ids, tokens);
            assert_eq!(
                Some(u64::from(s.block_size)),
                field("block_size", 4).as_u64()
            );
            assert_eq!(s.lora_id, field("lora_id", 5).as_u64());
            assert_eq!(s.medium.as_deref(), field("medium", 6).as_str());
            assert_eq!(s.lora_name.as_deref(), field("lora_name", 7).as_str());
            let keys = field("extra_keys", 8);
            match &s.extra_keys {
                None => assert!(keys.is_null()),
                Some(k) => assert_eq!(k.len(), keys.as_array().unwrap().len()),
            }
        }
        Event::Removed {
            block_hashes,
            medium,
        } => {
            assert_eq!(kind, "BlockRemoved");
            assert_eq!(*block_hashes, u64s(&field("block_hashes", 1)));
            assert_eq!(medium.as_deref(), field("medium", 2).as_str());
        }
        Event::Cleared { .. } => assert_eq!(kind, "AllBlocksCleared"),
        Event::Unknown(other) => panic!("the samples hold only known types, not {other}"),
    }
}

#[test]
fn the_tagged_sample_decodes_to_its_meaning() {
    let v = vectors();
    let s = &v["kv_event_sample_vllm_0_33_0"];
    let topic = s["frame0_topic"].as_str().unwrap().as_bytes().to_vec();
    let seq = hex(s["frame1_seq_hex"].as_str().unwrap());
    let payload = hex(s["frame2_payload_hex"].as_str().unwrap());
    let m = decode_message(&[&topic, &seq, &payload]).unwrap();
    assert_eq!(m.topic, b"kv@pod-0");
    assert_eq!(m.seq, 0);
    let want = &s["decoded"];
    assert_eq!(m.batch.ts, want[0].as_f64().unwrap());
    assert_eq!(m.batch.dp_rank, Some(0));
    let events = want[1].as_array().unwrap();
    assert_eq!(m.batch.events.len(), events.len());
    for (e, w) in m.batch.events.iter().zip(events) {
        check(e, w);
    }
    // The second batch, and the replayed one, are the same cleared cache.
    let second = &s["second_batch"];
    let b = decode_batch(&hex(second["payload_hex"].as_str().unwrap())).unwrap();
    assert_eq!(b.events, [Event::Cleared { medium: None }]);
    let replayed = &s["replay_DEALER_frames_hex"][0];
    let frames: Vec<Vec<u8>> = replayed.as_array().unwrap()[1..]
        .iter()
        .map(|f| hex(f.as_str().unwrap()))
        .collect();
    let r = decode_message(&[&frames[0], &frames[1], &frames[2]]).unwrap();
    assert_eq!((r.topic.as_slice(), r.seq), (&b"kv@pod-0"[..], 1));
    assert_eq!(r.batch, b);
}

#[test]
fn the_positional_sample_decodes_to_its_meaning() {
    let v = vectors();
    let s = &v["kv_event_sample_legacy_array_like_vllm_0_20_0"];
    let b = decode_batch(&hex(s["payload_hex"].as_str().unwrap())).unwrap();
    let want = &s["decoded"];
    assert_eq!(b.ts, want[0].as_f64().unwrap());
    let events = want[1].as_array().unwrap();
    assert_eq!(b.events.len(), events.len());
    for (e, w) in b.events.iter().zip(events) {
        check(e, w);
    }
}

#[test]
fn the_tagged_sample_rebuilds_the_engines_set() {
    use kvroute_agent::events::Batch;
    use kvroute_agent::resident::Resident;
    let v = vectors();
    let s = &v["kv_event_sample_vllm_0_33_0"];
    let b = decode_batch(&hex(s["frame2_payload_hex"].as_str().unwrap())).unwrap();
    // Before the final reset: request B's one block, A's two evicted.
    let (last, before) = b.events.split_last().unwrap();
    let mut r = Resident::default();
    r.apply(&Batch {
        events: before.to_vec(),
        ..b.clone()
    });
    let b_hash =
        u64::from_str_radix(&s["reqB_block_hashes_hex"][0].as_str().unwrap()[48..], 16).unwrap();
    assert_eq!(r.blocks("GPU").collect::<Vec<_>>(), [b_hash]);
    r.apply(&Batch {
        events: vec![last.clone()],
        ..b
    });
    assert!(r.counts().is_empty());
}

/// vLLM's own hashes verify under the flags it ran with (sha256_cbor, no
/// PYTHONHASHSEED, block size 4) and fail under others: the LoRA and
/// salted request A is unverifiable, plain request B is checked.
#[test]
fn the_tagged_sample_verifies_under_vllms_flags_only() {
    use kvroute_agent::verify::Verifier;
    use kvroute_core::hash::{BlockHasher, HashAlgo, HashConfig};
    let v = vectors();
    let s = &v["kv_event_sample_vllm_0_33_0"];
    let b = decode_batch(&hex(s["frame2_payload_hex"].as_str().unwrap())).unwrap();
    let stored: Vec<_> = b
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Stored(s) => Some(s),
            _ => None,
        })
        .collect();
    let hasher = |algo, seed: Option<&str>| {
        BlockHasher::new(HashConfig {
            algo,
            block_size: 4,
            seed: seed.map(str::to_owned),
            ..HashConfig::default()
        })
        .unwrap()
    };
    let mut right = Verifier::new(hasher(HashAlgo::Sha256Cbor, None));
    let a = right.check(stored[0]);
    assert_eq!((a.matched, a.unverifiable, a.mismatched), (0, 2, None));
    let b = right.check(stored[1]);
    assert_eq!((b.matched, b.mismatched), (1, None));
    for (algo, seed) in [(HashAlgo::Sha256, None), (HashAlgo::Sha256Cbor, Some("0"))] {
        let c = Verifier::new(hasher(algo, seed)).check(stored[1]);
        assert!(c.mismatched.is_some(), "{algo} {seed:?}");
    }
}
