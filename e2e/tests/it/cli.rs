//! `kvroute-e2e`'s flags, through the real binary: numbers past their
//! bounds are usage errors naming the flag (exit 2), refused before any
//! work, never a panic.

use std::process::Command;

fn kvroute_e2e(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute-e2e"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn huge_numbers_are_refused_naming_the_flag() {
    let out = std::env::temp_dir().join(format!("kvroute-e2e-cli-{}", std::process::id()));
    let out = out.to_str().unwrap();
    let max = u64::MAX.to_string();
    // A peer that needs no install: nothing is fetched before the flags
    // are read, even on today's code.
    fn compare<'a>(out: &'a str, flags: &[&'a str]) -> Vec<&'a str> {
        [
            &["compare", "--out", out, "--peers", "round-robin"][..],
            flags,
        ]
        .concat()
    }
    let cases = [
        // The issue's: an overflow adding durations.
        ("--duration", compare(out, &["--duration", &max])),
        ("--duration", compare(out, &["--duration", "86401"])),
        ("--blocks", compare(out, &["--blocks", "0"])),
        ("--blocks", compare(out, &["--blocks", "67108865"])),
        ("--repeat", compare(out, &["--repeat", "101"])),
        (
            "--preamble-tokens",
            compare(out, &["--preamble-tokens", &max]),
        ),
        (
            "--preamble-tokens",
            compare(out, &["--preamble-tokens", "16385"]),
        ),
        (
            "--duration",
            vec!["report", "--out", out, "--duration", &max],
        ),
        (
            "--duration",
            vec!["report", "--out", out, "--duration", "15"],
        ),
        (
            "--block-tokens",
            vec![
                "replay",
                "--out",
                out,
                "--trace",
                "t.jsonl",
                "--block-tokens",
                &max,
            ],
        ),
    ];
    for (flag, args) in cases {
        let run = kvroute_e2e(&args);
        let stderr = String::from_utf8(run.stderr).unwrap();
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    assert!(
        !std::path::Path::new(out).exists(),
        "refused before any work"
    );
}
