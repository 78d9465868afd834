//! `kvroute hash` as other tools call it: the built binary, run on every vLLM
//! vector in the core's fixture, plus its text format and usage errors.

use std::process::{Command, Output};

use serde_json::Value;

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("run kvroute")
}

fn vectors() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../core/tests/fixtures/vllm_vectors.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("read fixture")).expect("parse")
}

/// `kvroute hash` arguments for one vector case.
fn case_args(vectors: &Value, case: &Value, legacy: bool) -> Vec<String> {
    let tokens: Vec<String> = vectors["tokens"][case["tokens"].as_str().unwrap()]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap().to_string())
        .collect();
    let mut args = vec![
        "hash".to_owned(),
        "--algo".to_owned(),
        case["algo"].as_str().unwrap().to_owned(),
        "--block-size".to_owned(),
        case["block_size"].as_u64().unwrap().to_string(),
        "--tokens".to_owned(),
        tokens.join(","),
        "--json".to_owned(),
    ];
    if let Some(seed) = case["pythonhashseed"].as_str() {
        args.extend(["--seed".to_owned(), seed.to_owned()]);
    }
    if let Some(salt) = case["cache_salt"].as_str() {
        args.extend(["--cache-salt".to_owned(), salt.to_owned()]);
    }
    if let Some(lora) = case["lora"].as_object() {
        args.extend([
            "--lora-name".to_owned(),
            lora["name"].as_str().unwrap().to_owned(),
        ]);
        args.extend([
            "--lora-path".to_owned(),
            lora["path"].as_str().unwrap().to_owned(),
        ]);
    }
    if legacy {
        args.push("--legacy-extra-keys".to_owned());
    }
    args
}

#[test]
fn json_output_matches_every_vector() {
    let vectors = vectors();
    let mut checked = 0;
    let mut total = 0;
    for (key, legacy) in [
        ("cases_vllm_0_33_0_tagged", false),
        ("cases_vllm_0_30_0_legacy_untagged", true),
    ] {
        let cases = vectors[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} missing"));
        total += cases.len();
        for case in cases {
            let args = case_args(&vectors, case, legacy);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = kvroute(&args);
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let stdout = String::from_utf8(out.stdout).unwrap();
            assert_eq!(stdout.lines().count(), 1, "one JSON line: {stdout}");
            let got: Value = serde_json::from_str(&stdout).unwrap();
            assert_eq!(got.as_object().unwrap().len(), 3, "{stdout}");
            // Key order is part of the interface.
            let at = |key: &str| stdout.find(&format!("\"{key}\":")).expect(key);
            assert!(stdout.starts_with("{\"none_hash_hex\":"), "{stdout}");
            assert!(
                at("block_hashes_hex") < at("event_block_hashes_u64"),
                "{stdout}"
            );
            for field in [
                "none_hash_hex",
                "block_hashes_hex",
                "event_block_hashes_u64",
            ] {
                assert_eq!(got[field], case[field], "{field} for {args:?}");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, total);
    assert!(total > 0);
}

#[test]
fn text_output_is_index_hex_u64_per_block() {
    let tokens: Vec<String> = (0..64).map(|t: u32| t.to_string()).collect();
    let out = kvroute(&[
        "hash",
        "--algo",
        "sha256_cbor",
        "--block-size",
        "16",
        "--tokens",
        &tokens.join(","),
    ]);
    assert!(out.status.success());
    assert!(out.stderr.is_empty());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "0 dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749 2233398808101521225\n\
         1 c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c 17911472383915781900\n\
         2 117dad852830e0103c12d7c7f8b7cf58434ea8751d1f42ee07b1c93711e4da6c 554445467503876716\n\
         3 c8d5e6f4474de3fedaf244a4a77b875c7b37aebd04530b5c4bd5fbb7d9d8aeab 5464550489936408235\n"
    );
}

/// Runs `args`, expects exit code 2, nothing on stdout and one stderr line
/// that starts with "error:" and names `argument`.
fn assert_usage_error(args: &[&str], argument: &str) -> String {
    let out = kvroute(args);
    assert_eq!(out.status.code(), Some(2), "{args:?}");
    assert!(out.stdout.is_empty(), "{args:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(
        stderr.contains(argument),
        "{args:?} should name {argument}: {stderr}"
    );
    stderr
}

/// `kvroute hash --algo sha256 --block-size 4` followed by `extra`.
fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["hash", "--algo", "sha256", "--block-size", "4"];
    args.extend_from_slice(extra);
    args
}

#[test]
fn usage_errors_are_one_line_naming_the_argument() {
    let base = ["hash", "--block-size", "4", "--tokens", "1,2,3,4"];
    assert_eq!(
        assert_usage_error(&base, "--algo"),
        "error: missing required argument --algo\n"
    );

    let stderr = assert_usage_error(
        &[
            "hash",
            "--algo",
            "md5",
            "--block-size",
            "4",
            "--tokens",
            "1",
        ],
        "--algo",
    );
    assert!(
        stderr.contains("'md5'") && stderr.contains("sha256_cbor"),
        "{stderr}"
    );

    let stderr = assert_usage_error(&with(&["--tokens", "1,x,3"]), "--tokens");
    assert!(
        stderr.starts_with("error: invalid value 'x' for --tokens: "),
        "{stderr}"
    );

    assert_usage_error(
        &[
            "hash",
            "--algo",
            "sha256",
            "--block-size",
            "0",
            "--tokens",
            "1",
        ],
        "--block-size",
    );
    assert_usage_error(
        &with(&["--tokens", "1", "--lora-name", "sql-lora"]),
        "--lora-path",
    );
    assert_usage_error(
        &with(&["--tokens", "1", "--lora-path", "/adapters/x"]),
        "--lora-name",
    );
    for salt in ["a/b", "a@b", "a\\b", "", &"x".repeat(129)] {
        assert_usage_error(
            &with(&["--tokens", "1", "--cache-salt", salt]),
            "--cache-salt",
        );
    }
}

#[test]
fn help_and_version_exit_zero() {
    for args in [&["--help"][..], &["--version"], &["hash", "--help"]] {
        let out = kvroute(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
}
