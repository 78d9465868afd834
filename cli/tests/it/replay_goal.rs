//! The routing goal of issue #11, checked on Mooncake's public synthetic
//! trace: at N = 4, 8, 16 with one router, `kvroute` (default settings) has
//! a TTFT mean within 3 % of the lowest of every other policy and of the
//! reference min-predicted-TTFT figures, a hit rate at most 0.005 below
//! that lowest-TTFT policy's, a TTFT p99 within 10 % of the reference's,
//! and a scale-out hit dip of at most 0.01.
//!
//! The trace is third-party data and not in this repository: the test reads
//! it from `../shared/data/traces/` beside the checkout (as CI has it, or
//! `KVROUTE_TRACE`) and skips with a message when it is absent, unless
//! `KVROUTE_REQUIRE_TRACE=1` (set by CI), where an absent trace fails the
//! test so that CI cannot pass without running the check. The replay runs
//! in virtual time: the figures are deterministic.

use std::path::PathBuf;
use std::process::Command;

/// The reference figures of the issue: (N, hit, TTFT mean s, TTFT p99 s).
const REFERENCE: [(usize, f64, f64, f64); 3] = [
    (4, 0.453, 4.21, 15.9),
    (8, 0.456, 0.921, 5.54),
    (16, 0.480, 0.849, 5.53),
];

fn trace() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KVROUTE_TRACE") {
        return Some(PathBuf::from(path));
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/traces/mooncake_synthetic_trace.jsonl");
    path.exists().then_some(path)
}

#[test]
fn kvroute_meets_the_goal_on_the_synthetic_trace() {
    let Some(trace) = trace() else {
        assert!(
            std::env::var_os("KVROUTE_REQUIRE_TRACE").is_none_or(|v| v != "1"),
            "KVROUTE_REQUIRE_TRACE=1 but Mooncake's synthetic trace is not at \
             ../shared/data/traces/ (or set KVROUTE_TRACE to its path)"
        );
        eprintln!(
            "skipped: Mooncake's synthetic trace is not at ../shared/data/traces/ \
             (set KVROUTE_TRACE to its path to run this check)"
        );
        return;
    };
    let json = std::env::temp_dir().join(format!("kvroute-goal-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["replay", "--trace"])
        .arg(&trace)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let rows = v["results"].as_array().unwrap();
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    for (n, ref_hit, ref_ttft, ref_p99) in REFERENCE {
        let at_n: Vec<&serde_json::Value> = rows
            .iter()
            .filter(|r| r["replicas"].as_u64() == Some(n as u64))
            .collect();
        let kvroute = at_n.iter().find(|r| r["policy"] == "kvroute").unwrap();
        // The lowest TTFT mean among the other policies and the reference,
        // with its hit rate.
        let (best_ttft, best_hit) = at_n
            .iter()
            .filter(|r| r["policy"] != "kvroute")
            .map(|r| (f(r, "ttft_mean_s"), f(r, "token_hit_rate")))
            .chain([(ref_ttft, ref_hit)])
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap();
        let (ttft, hit) = (f(kvroute, "ttft_mean_s"), f(kvroute, "token_hit_rate"));
        assert!(
            ttft <= 1.03 * best_ttft,
            "N = {n}: TTFT mean {ttft} > 1.03 × {best_ttft}"
        );
        assert!(
            hit >= best_hit - 0.005,
            "N = {n}: hit {hit} < {best_hit} − 0.005"
        );
        let p99 = f(kvroute, "ttft_p99_s");
        assert!(
            p99 <= 1.10 * ref_p99,
            "N = {n}: p99 {p99} > 1.10 × {ref_p99}"
        );
        let dip = f(kvroute, "hit_dip");
        assert!(dip <= 0.01, "N = {n}: scale-out hit dip {dip}");
    }
}
