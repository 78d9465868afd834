//! Conformance with vLLM: every vector in `fixtures/vllm_vectors.json` (an
//! exact copy of the vectors produced by running vLLM 0.33.0 and 0.30.0) must
//! come out of `kvroute_core::hash` unchanged. Each test counts what it
//! checked against what the file holds, so a skipped case fails.

use std::sync::OnceLock;

use kvroute_core::hash::{
    BlockDigest, BlockExtras, BlockHasher, ExtraKeysForm, HashAlgo, HashConfig, Lora,
};
use serde_json::Value;

fn vectors() -> &'static Value {
    static VECTORS: OnceLock<Value> = OnceLock::new();
    VECTORS.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/vllm_vectors.json"
        );
        let text = std::fs::read_to_string(path).expect("read vllm_vectors.json");
        serde_json::from_str(&text).expect("parse vllm_vectors.json")
    })
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} is not a string in {v}"))
}

fn array_of<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} is not an array in {v}"))
}

fn tokens_named(name: &str) -> Vec<u32> {
    array_of(&vectors()["tokens"], name)
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token is an integer")).expect("token fits u32"))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hasher(
    algo: HashAlgo,
    block_size: usize,
    seed: Option<&str>,
    form: ExtraKeysForm,
) -> BlockHasher {
    BlockHasher::new(HashConfig {
        algo,
        block_size,
        seed: seed.map(str::to_owned),
        extra_keys: form,
    })
    .expect("valid config")
}

/// Checks one case of a `cases_*` list; returns a label for messages.
fn check_case(case: &Value, form: ExtraKeysForm) -> String {
    let algo: HashAlgo = str_of(case, "algo").parse().expect("known algo");
    let seed = case["pythonhashseed"].as_str();
    let block_size = usize::try_from(case["block_size"].as_u64().expect("block_size")).unwrap();
    let tokens = tokens_named(str_of(case, "tokens"));
    let lora = case["lora"]
        .as_object()
        .map(|l| Lora::new(l["name"].as_str().unwrap(), l["path"].as_str().unwrap()));
    let extras = BlockExtras {
        lora: lora.as_ref(),
        cache_salt: case["cache_salt"].as_str(),
    };
    let label = format!(
        "{form:?} {algo} seed={seed:?} tokens={} bs={block_size} variant={}",
        str_of(case, "tokens"),
        str_of(case, "variant")
    );

    let h = hasher(algo, block_size, seed, form);
    assert_eq!(
        h.none_hash().to_hex(),
        str_of(case, "none_hash_hex"),
        "none_hash: {label}"
    );

    let expected_hex: Vec<&str> = array_of(case, "block_hashes_hex")
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let digests = h.digests(&tokens, extras);
    let got_hex: Vec<String> = digests.iter().map(BlockDigest::to_hex).collect();
    assert_eq!(got_hex, expected_hex, "block_hashes_hex: {label}");

    let expected_u64: Vec<u64> = array_of(case, "event_block_hashes_u64")
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(
        h.hashes(&tokens, extras),
        expected_u64,
        "event_block_hashes_u64: {label}"
    );
    assert_eq!(
        digests.iter().map(BlockDigest::to_u64).collect::<Vec<_>>(),
        expected_u64,
        "digest.to_u64: {label}"
    );
    label
}

/// Checks every case of list `key`, which must exercise each of `algos`.
fn check_cases(key: &str, form: ExtraKeysForm, algos: &[HashAlgo]) {
    let cases = array_of(vectors(), key);
    assert!(!cases.is_empty(), "{key} is empty");
    let mut checked = 0;
    let mut seen = std::collections::BTreeSet::new();
    for case in cases {
        check_case(case, form);
        seen.insert(str_of(case, "algo"));
        checked += 1;
    }
    assert_eq!(
        checked,
        cases.len(),
        "{key}: checked {checked} of {}",
        cases.len()
    );
    let expected: std::collections::BTreeSet<&str> = algos.iter().map(|a| a.as_str()).collect();
    assert_eq!(seen, expected, "{key}: algorithms covered");
}

#[test]
fn tagged_cases_vllm_0_33_0() {
    check_cases(
        "cases_vllm_0_33_0_tagged",
        ExtraKeysForm::Tagged,
        &HashAlgo::ALL,
    );
}

#[test]
fn legacy_untagged_cases_vllm_0_30_0() {
    // The vLLM 0.30 vectors include no xxhash_cbor case.
    check_cases(
        "cases_vllm_0_30_0_legacy_untagged",
        ExtraKeysForm::Legacy,
        &[HashAlgo::Sha256, HashAlgo::Sha256Cbor],
    );
}

#[test]
fn preimage_examples_are_byte_exact() {
    let examples = vectors()["preimage_examples"]
        .as_object()
        .expect("preimage_examples");
    let lora_used = &vectors()["lora_used"];
    let lora = Lora::new(str_of(lora_used, "name"), str_of(lora_used, "path"));
    let lora_salt = BlockExtras {
        lora: Some(&lora),
        cache_salt: Some("tenant-a-3f9c"),
    };
    let tokens = [0, 1, 2, 3];
    let mut checked = 0;

    let cbor = hasher(HashAlgo::Sha256Cbor, 4, None, ExtraKeysForm::Tagged);
    let pickle = hasher(HashAlgo::Sha256, 4, None, ExtraKeysForm::Tagged);
    // The pickle example's parent is the sha256_cbor NONE_HASH (its bytes
    // are what the example shows), so both use that parent.
    let parent = cbor.none_hash();

    for (name, example) in examples {
        match name.as_str() {
            "none_hash_sha256_cbor_default" => {
                assert_eq!(str_of(example, "seed"), cbor.config().effective_seed());
                assert_eq!(
                    hex(&cbor.seed_preimage()),
                    str_of(example, "cbor_hex"),
                    "{name}"
                );
                assert_eq!(
                    cbor.none_hash().to_hex(),
                    str_of(example, "digest_hex"),
                    "{name}"
                );
            }
            "block0_tokens_0_3_plain_cbor_hex" => {
                let bytes = cbor.block_preimage(&parent, 0, &tokens, BlockExtras::default());
                assert_eq!(hex(&bytes), example.as_str().unwrap(), "{name}");
            }
            "block0_tokens_0_3_plain_sha256_cbor_hex" => {
                assert_eq!(
                    cbor.digests(&tokens, BlockExtras::default())[0].to_hex(),
                    example.as_str().unwrap(),
                    "{name}"
                );
            }
            "block0_tokens_0_3_lora_salt_cbor_hex" => {
                let bytes = cbor.block_preimage(&parent, 0, &tokens, lora_salt);
                assert_eq!(hex(&bytes), example.as_str().unwrap(), "{name}");
            }
            "block0_tokens_0_3_lora_salt_pickle5_hex" => {
                let bytes = pickle.block_preimage(&parent, 0, &tokens, lora_salt);
                assert_eq!(hex(&bytes), example.as_str().unwrap(), "{name}");
            }
            other => panic!("preimage example {other} has no check"),
        }
        checked += 1;
    }
    assert_eq!(checked, examples.len());
}

/// The KV-event sample: vLLM's BlockPool with block size 4, sha256_cbor,
/// PYTHONHASHSEED unset. Request A is tokens 0..=9 with LoRA and cache salt
/// (two full blocks), request B is [7, 7, 7, 7, 8, 8] (one full block).
#[test]
fn kv_event_sample_block_hashes() {
    let Some(sample) = vectors().get("kv_event_sample_vllm_0_33_0") else {
        panic!("kv_event_sample_vllm_0_33_0 missing from the fixture");
    };
    let lora_used = &vectors()["lora_used"];
    let lora = Lora::new(str_of(lora_used, "name"), str_of(lora_used, "path"));
    let h = hasher(HashAlgo::Sha256Cbor, 4, None, ExtraKeysForm::Tagged);

    let req_a = h.digests(
        &(0..10).collect::<Vec<u32>>(),
        BlockExtras {
            lora: Some(&lora),
            cache_salt: Some("tenant-a-3f9c"),
        },
    );
    let req_b = h.digests(&[7, 7, 7, 7, 8, 8], BlockExtras::default());
    let mut checked = 0;
    for (key, got) in [
        ("reqA_block_hashes_hex", &req_a),
        ("reqB_block_hashes_hex", &req_b),
    ] {
        let expected: Vec<&str> = array_of(sample, key)
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            got.iter().map(BlockDigest::to_hex).collect::<Vec<_>>(),
            expected,
            "{key}"
        );
        checked += 1;
    }
    assert_eq!(checked, 2);

    // The decoded BlockStored events carry the same hashes in u64 form.
    let events = sample["decoded"][1]
        .as_array()
        .expect("decoded[1] is the event list");
    let stored: Vec<Vec<u64>> = events
        .iter()
        .filter(|event| event["type"] == "BlockStored")
        .map(|event| {
            array_of(event, "block_hashes")
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        stored,
        vec![
            req_a.iter().map(BlockDigest::to_u64).collect::<Vec<_>>(),
            req_b.iter().map(BlockDigest::to_u64).collect::<Vec<_>>(),
        ]
    );
}
