//! The model column: `kvroute replay --engine vllm` on the same slice, with
//! the same engines, policies, routers and block mapping as the live run,
//! in virtual time.
//!
//! The routing key: the live routers key a request by its first
//! `2 × block_tokens` prompt tokens (the policy's `routingKey` is set so),
//! which are exactly its first two block ids' runs; the model's `--key p2`
//! keys by those two ids. Both group requests alike; the key values differ
//! (tokens against ids), so a cold key may rank pods differently, as
//! between two seeds.
//!
//! The report lag: the live routers learn cache contents within
//! milliseconds (KV events through the agents) but load only when an agent
//! reads its engine's `/metrics`, every 20 ms of real time, so a report is
//! on average 10 ms old (engine-sim's own streams, with `--watch-engines`,
//! report 10 ms after arrivals): 10 ms × the time scale, in trace time.
//!
//! Not here: the live run. The model's JSON is `kvroute replay --json`'s
//! (`cli/src/replay/mod.rs`; a binary crate, so its rows are read here by
//! their documented keys).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

/// What the model run needs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The `kvroute` binary.
    pub kvroute: PathBuf,
    /// The slice, as a trace file.
    pub slice: PathBuf,
    /// Where its JSON goes.
    pub json: PathBuf,
    /// Pods (replicas).
    pub pods: usize,
    /// Policies, comma-separated.
    pub policies: String,
    /// Engine KV blocks per pod.
    pub num_gpu_blocks: u32,
    /// Tokens per engine block.
    pub block_size: u32,
    /// Requests running at once per engine.
    pub max_num_seqs: u32,
    /// Tokens per trace block id.
    pub block_tokens: u64,
    /// The share of distinct blocks the pool caches (sizes the policies'
    /// memories as the engines were sized).
    pub cache_frac: f64,
    /// Router replicas.
    pub routers: usize,
    /// Trace milliseconds before routers learn engine reports.
    pub report_lag_ms: u32,
    /// The routing key, `pK`.
    pub key: String,
}

/// One policy's figures from the model, in trace seconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figures {
    /// Token hit rate.
    pub hit: f64,
    /// TTFT mean.
    pub ttft_mean_s: f64,
    /// TTFT 99th percentile.
    pub ttft_p99_s: f64,
    /// The hit rate of the tenth of the slice after its middle, without a
    /// replica added there less with one.
    pub hit_dip: f64,
}

/// A row of `kvroute replay --json`'s `results`.
#[derive(Debug, Deserialize)]
struct Row {
    policy: String,
    token_hit_rate: f64,
    ttft_mean_s: f64,
    ttft_p99_s: f64,
    hit_dip: f64,
}

#[derive(Debug, Deserialize)]
struct Output {
    results: Vec<Row>,
}

/// The model's figures by policy, or why there are none.
pub type Model = Result<Vec<(String, Figures)>, String>;

impl Settings {
    /// The `kvroute replay` command line.
    pub fn args(&self) -> Vec<String> {
        [
            "replay".to_owned(),
            format!("--trace={}", self.slice.display()),
            format!("--replicas={}", self.pods),
            "--engine=vllm".to_owned(),
            format!("--num-gpu-blocks={}", self.num_gpu_blocks),
            format!("--block-size={}", self.block_size),
            format!("--max-num-seqs={}", self.max_num_seqs),
            format!("--block-tokens={}", self.block_tokens),
            format!("--cache-frac={}", self.cache_frac),
            format!("--policies={}", self.policies),
            format!("--routers={}", self.routers),
            format!("--report-lag-ms={}", self.report_lag_ms),
            format!("--key={}", self.key),
            format!("--json={}", self.json.display()),
        ]
        .into()
    }

    /// Runs the model.
    pub fn run(&self) -> Model {
        if !self.kvroute.is_file() {
            return Err(format!(
                "no model: {} is missing (cargo build -p kvroute-cli)",
                self.kvroute.display()
            ));
        }
        let out = Command::new(&self.kvroute)
            .args(self.args())
            .output()
            .map_err(|e| format!("no model: running {}: {e}", self.kvroute.display()))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("'--engine") {
                return Err(format!(
                    "no model: this kvroute has no `replay --engine vllm` yet ({})",
                    first_line(&err)
                ));
            }
            return Err(format!(
                "no model: kvroute replay failed ({}): {}",
                out.status,
                first_line(&err)
            ));
        }
        read(&self.json)
    }
}

fn first_line(text: &str) -> &str {
    text.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
}

/// The figures in a `kvroute replay --json` file.
fn read(path: &Path) -> Model {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("no model: reading {}: {e}", path.display()))?;
    let output: Output = serde_json::from_str(&text)
        .map_err(|e| format!("no model: {} is not replay JSON: {e}", path.display()))?;
    Ok(output
        .results
        .into_iter()
        .map(|r| {
            let figures = Figures {
                hit: r.token_hit_rate,
                ttft_mean_s: r.ttft_mean_s,
                ttft_p99_s: r.ttft_p99_s,
                hit_dip: r.hit_dip,
            };
            (r.policy, figures)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_replays_rows_and_says_why_there_are_none() {
        let dir = std::env::temp_dir().join(format!("kvroute-e2e-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("model.json");
        std::fs::write(
            &json,
            r#"{"meta": {}, "results": [{"policy": "kvroute", "replicas": 8, "routers": 2,
                "token_hit_rate": 0.49, "req_max_over_mean": 1.2, "prefill_max_over_mean": 1.1,
                "ttft_mean_s": 0.9, "ttft_p99_s": 5.5, "spill": 0.1, "keys_moved": 0.1,
                "hit_dip": 0.004}]}"#,
        )
        .unwrap();
        let model = read(&json).unwrap();
        assert_eq!(model[0].0, "kvroute");
        assert_eq!(model[0].1.hit, 0.49);
        assert_eq!(model[0].1.hit_dip, 0.004);
        let settings = Settings {
            kvroute: dir.join("no-such-kvroute"),
            slice: dir.join("slice.jsonl"),
            json,
            pods: 8,
            policies: "kvroute".into(),
            num_gpu_blocks: 1,
            block_size: 16,
            max_num_seqs: 256,
            block_tokens: 512,
            cache_frac: 0.3,
            routers: 2,
            report_lag_ms: 20,
            key: "p2".into(),
        };
        let err = settings.run().unwrap_err();
        assert!(err.contains("no-such-kvroute is missing"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
