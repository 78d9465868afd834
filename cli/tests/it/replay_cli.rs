//! `kvroute replay` end to end: a tiny trace whose figures are worked out by
//! hand, the JSON interface, and usage errors.

use std::path::PathBuf;
use std::process::Command;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-replay-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn kvroute(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .unwrap()
}

/// Four requests, block ids of 10 tokens: D = 3 distinct blocks.
const TRACE: &str = r#"{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}
{"timestamp": 1000, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}
{"timestamp": 2000, "input_length": 30, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 3000, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}
"#;

#[test]
fn figures_of_a_hand_worked_trace() {
    let dir = temp_dir("hand");
    let trace = dir.join("trace.jsonl");
    let json = dir.join("out.json");
    std::fs::write(&trace, TRACE).unwrap();
    let out = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--replicas",
        "2",
        "--cache-frac",
        "1",
        "--block-tokens",
        "10",
        "--policies",
        "round-robin,kvroute",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("N = 2 replicas, 1 blocks each"), "{stdout}");

    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let meta = &v["meta"];
    assert_eq!(meta["requests"], 4);
    assert_eq!(meta["distinct_blocks"], 3);
    // One cache: the 2nd, 3rd and 4th requests hit 20 tokens each, of 90.
    assert!((meta["infinite_hit"].as_f64().unwrap() - 60.0 / 90.0).abs() < 1e-9);
    assert!((meta["pooled_hit"].as_f64().unwrap() - 60.0 / 90.0).abs() < 1e-9);
    assert_eq!(meta["capacities"][0]["blocks_per_replica"], 1);

    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    let keys: Vec<&str> = results[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    let mut expected = vec![
        "policy",
        "replicas",
        "routers",
        "token_hit_rate",
        "req_max_over_mean",
        "prefill_max_over_mean",
        "ttft_mean_s",
        "ttft_p99_s",
        "spill",
        "keys_moved",
        "hit_dip",
        "refused",
    ];
    expected.sort_unstable();
    assert_eq!(sorted, expected);

    // Round robin, one block per replica: A gets requests 1 and 3, B 2 and
    // 4. Each replica keeps only block 1 (admission touches the last id
    // first, so the head survives): requests 3 and 4 hit 10 tokens each.
    let rr = &results[0];
    assert_eq!(rr["policy"], "round-robin");
    assert!((rr["token_hit_rate"].as_f64().unwrap() - 20.0 / 90.0).abs() < 1e-9);
    assert_eq!(rr["req_max_over_mean"], 1.0);
    assert!(rr["spill"].is_null());
    // TTFTs: 0.022, 0.022, 0.022 (20 uncached), 0.021 (10 uncached).
    assert!((rr["ttft_mean_s"].as_f64().unwrap() - 0.02175).abs() < 1e-9);
    assert!((rr["ttft_p99_s"].as_f64().unwrap() - 0.022).abs() < 1e-9);
    assert!(results[1]["spill"].is_number(), "kvroute reports spill");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_gets_a_clear_error() {
    let dir = temp_dir("bad");
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, "{\"timestamp\": 0}\n").unwrap();
    let out = kvroute(&["replay", "--trace", trace.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("line 1") && stderr.contains("input_length"),
        "{stderr}"
    );

    std::fs::write(&trace, TRACE).unwrap();
    let out = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "kvroute,nope",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("unknown policy \"nope\"")
    );

    let out = kvroute(&["replay", "--trace", trace.to_str().unwrap(), "--key", "q3"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--key"), "{stderr}");

    let out = kvroute(&["replay", "--trace", dir.join("missing").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));

    let pdf = dir.join("plot.pdf");
    let out = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--plot",
        pdf.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "fails before any work");
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("must end in .svg or .png")
    );
    assert!(!pdf.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_shared_template_lengthens_every_prompt() {
    let dir = temp_dir("shared");
    let trace = dir.join("trace.jsonl");
    let json = dir.join("out.json");
    std::fs::write(&trace, TRACE).unwrap();
    let run = |k: &str| {
        kvroute(&[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--replicas",
            "2",
            "--block-tokens",
            "10",
            "--policies",
            "round-robin",
            "--shared-prefix-blocks",
            k,
            "--json",
            json.to_str().unwrap(),
        ])
    };
    let out = run("1");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("1 shared block(s) prepended to every request"),
        "{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let meta = &v["meta"];
    assert_eq!(meta["shared_prefix_blocks"], 1);
    assert_eq!(meta["distinct_blocks"], 4);
    // Prompts of 30, 30, 40, 30 tokens; one cache hits the 2nd, 3rd and
    // 4th for 30 tokens each (the template and blocks 1 and 2).
    assert!((meta["infinite_hit"].as_f64().unwrap() - 90.0 / 130.0).abs() < 1e-9);

    for bad in ["two", "2000", "-1"] {
        let out = kvroute(&[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            &format!("--shared-prefix-blocks={bad}"),
        ]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(
            stderr.contains("--shared-prefix-blocks")
                && stderr.contains("expected a whole number of blocks from 0 to 1024"),
            "{stderr}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn routers_and_plots() {
    let dir = temp_dir("plot");
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, TRACE).unwrap();
    let (svg, png, json) = (dir.join("p.svg"), dir.join("p.png"), dir.join("o.json"));
    for plot in [&svg, &png] {
        let out = kvroute(&[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--replicas",
            "2,3",
            "--block-tokens",
            "10",
            "--routers",
            "2",
            "--report-lag-ms",
            "0",
            "--plot",
            plot.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            stdout.contains("2 router(s), cache contents and load known 0 ms late"),
            "{stdout}"
        );
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["meta"]["routers"], 2);
    assert!(
        v["results"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["routers"] == 2)
    );

    // One panel per N with every policy named, and the slack curve.
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100]);
    for label in [
        "N = 2 replicas",
        "N = 3 replicas",
        "min-ttft",
        "round-robin",
        "kvroute, latencySlack swept",
    ] {
        assert!(text.contains(label), "{label} missing");
    }
    // A PNG of the same figure: 560 × 560 per panel, RGB.
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), (1120, 560));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Flags past their bounds are usage errors naming the flag (exit 2),
/// never a panic or a wrapped figure; sizes past what memory holds are
/// clear errors too.
#[test]
fn huge_numbers_are_refused_naming_the_flag() {
    let dir = temp_dir("huge");
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, TRACE).unwrap();
    let trace = trace.to_str().unwrap();
    let max = u64::MAX.to_string();
    let usage: [(&str, &[&str]); 8] = [
        // The issue's: a wrapped figure with the simple engine, a
        // "capacity overflow" panic with vLLM's.
        (
            "--block-tokens",
            &["--shared-prefix-blocks", "1024", "--block-tokens", &max],
        ),
        (
            "--block-tokens",
            &[
                "--shared-prefix-blocks",
                "1024",
                "--block-tokens",
                &max,
                "--engine",
                "vllm",
            ],
        ),
        ("--block-tokens", &["--block-tokens", "4097"]),
        ("--block-tokens", &["--block-tokens", "0"]),
        ("--key", &["--key", "p18446744073709551615"]),
        ("--key", &["--key", "p1025"]),
        (
            "--max-num-seqs",
            &["--engine", "vllm", "--max-num-seqs", &max],
        ),
        (
            "--max-num-batched-tokens",
            &["--engine", "vllm", "--max-num-batched-tokens", &max],
        ),
    ];
    for (flag, flags) in usage {
        let out = kvroute(&[&["replay", "--trace", trace][..], flags].concat());
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(flag), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{flags:?}");
    }

    // The largest bounds together run, with the prompts' figures exact.
    let out = kvroute(&[
        "replay",
        "--trace",
        trace,
        "--shared-prefix-blocks",
        "1024",
        "--block-tokens",
        "4096",
        "--replicas",
        "2",
        "--policies",
        "round-robin",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("(a template's 4194304 tokens)"), "{stdout}");

    // A trace's own lengths are bounded: a file, not a flag (exit 1).
    let long = dir.join("long.jsonl");
    std::fs::write(
        &long,
        format!("{{\"timestamp\": 0, \"input_length\": {max}, \"output_length\": 1, \"hash_ids\": [1]}}\n"),
    )
    .unwrap();
    for engine in ["simple", "vllm"] {
        let out = kvroute(&[
            "replay",
            "--trace",
            long.to_str().unwrap(),
            "--engine",
            engine,
        ]);
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("line 1: input_length"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }

    // Engine blocks from --cache-frac past what --num-gpu-blocks takes:
    // 17,500 distinct blocks of 4,096 tokens are 71,680,000 blocks of one
    // token, refused before any hashing.
    let wide = dir.join("wide.jsonl");
    let lines: Vec<String> = (0..5u64)
        .map(|r| {
            let ids: Vec<String> = (r * 3500..(r + 1) * 3500).map(|i| i.to_string()).collect();
            format!(
                "{{\"timestamp\": {r}, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": [{}]}}",
                3500 * 4096,
                ids.join(",")
            )
        })
        .collect();
    std::fs::write(&wide, lines.join("\n")).unwrap();
    let out = kvroute(&[
        "replay",
        "--trace",
        wide.to_str().unwrap(),
        "--engine",
        "vllm",
        "--block-tokens",
        "4096",
        "--block-size",
        "1",
        "--cache-frac",
        "1",
        "--replicas",
        "1",
    ]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("71680000 engine blocks per replica, over 67108864")
            && stderr.contains("--num-gpu-blocks"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
