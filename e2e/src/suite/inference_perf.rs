//! `inference-perf`, the Gateway API Inference Extension's benchmark tool,
//! as a client of the system: its `shared_prefix` data (groups of prompts
//! sharing a system prompt) at fixed request rates, through a router, with
//! a tiny word-level tokenizer committed in `e2e/inference-perf/tokenizer/`
//! (built offline by `make_tokenizer.py`: no download is possible here).
//!
//! It needs Python ≥ 3.12: the suite installs it into a venv it creates
//! once (`python3.12 -m venv`, `pip install inference-perf==0.7.0`) and
//! reuses. When that cannot be done, the scenario is skipped with the
//! reason.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::procs::Proc;
use super::system::MODEL;

/// The version installed.
pub const VERSION: &str = "0.7.0";

/// The committed tokenizer's directory.
fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("inference-perf/tokenizer")
}

/// The default venv: under the workspace's `target/`.
pub fn default_venv() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/inference-perf-venv")
}

/// The `inference-perf` executable in `venv`, installed there first if
/// needed; `Err` says why it cannot be had (the scenario then skips).
pub fn install(venv: &Path) -> Result<PathBuf, String> {
    let python = python312().ok_or("no Python 3.12 (python3.12 on PATH or under ~/.pyenv)")?;
    super::procs::pip_install(
        venv,
        &python,
        &format!("inference-perf=={VERSION}"),
        "inference-perf",
    )
}

/// Python 3.12, on `PATH` or under pyenv.
fn python312() -> Option<PathBuf> {
    let works = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let on_path = PathBuf::from("python3.12");
    if works(&on_path) {
        return Some(on_path);
    }
    let versions = PathBuf::from(std::env::var_os("HOME")?).join(".pyenv/versions");
    std::fs::read_dir(versions)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("3.12"))
        .map(|e| e.path().join("bin/python3.12"))
        .find(|p| works(p))
}

/// One run's load: groups of prompts sharing a system prompt, at these
/// rates (requests per second) for these many seconds each.
#[derive(Clone, Debug)]
pub struct Load {
    /// Groups (system prompts).
    pub groups: usize,
    /// Words of each system prompt (one token each in the committed
    /// tokenizer; about two of the engines' built-in tokenizer).
    pub system_prompt_words: usize,
    /// `(rate, seconds)` stages.
    pub stages: Vec<(f64, u64)>,
}

/// What a run's summary says.
#[derive(Debug)]
pub struct Summary {
    /// Successful requests.
    pub successes: u64,
    /// Failed requests.
    pub failures: u64,
    /// Prompt tokens of the successes, as the engines reported them.
    pub prompt_tokens: f64,
    /// Cached prompt tokens, as the engines reported them.
    pub cached_tokens: f64,
    /// TTFT median and p99, seconds.
    pub ttft_p50: f64,
    /// TTFT p99, seconds.
    pub ttft_p99: f64,
}

/// Runs `exe` with `load` against the OpenAI API at `base_url`, writing its
/// config, log and reports under `dir`.
pub async fn run(exe: &Path, dir: &Path, base_url: &str, load: &Load) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(dir)?;
    let requests: f64 = load.stages.iter().map(|(r, s)| r * *s as f64).sum();
    let reports = dir.join("reports");
    let config = json!({
        "api": {"type": "chat", "streaming": true},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": base_url, "ignore_eos": true},
        "tokenizer": {"pretrained_model_name_or_path": tokenizer_dir(), "load_timeout": 30},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": load.groups,
            // Enough prompts that none repeats.
            "num_prompts_per_group": (requests / load.groups as f64).ceil() as u64 + 1,
            "system_prompt_len": load.system_prompt_words,
            "question_len": 60,
            "output_len": 24,
            "seed": 42,
            // Without it inference-perf 0.7 sends chat to /v1/completions.
            "multimodal": {},
        }},
        "load": {
            "type": "constant",
            "stages": load.stages.iter().map(|(rate, duration)| json!({"rate": rate, "duration": duration})).collect::<Vec<_>>(),
            "num_workers": 1,
            "stage_teardown_grace_seconds": 10,
            "request_timeout": 30,
        },
        "report": {"request_lifecycle": {"summary": true, "per_stage": true, "per_request": false},
                   "prometheus": {"summary": false, "per_stage": false}},
        "storage": {"local_storage": {"path": reports}},
    });
    let path = dir.join("config.yaml");
    std::fs::write(&path, serde_yaml::to_string(&config)?)?;
    let args = vec!["--config_file".to_owned(), path.display().to_string()];
    let offline = [
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
    ];
    let env: Vec<(&str, String)> = offline.iter().map(|k| (*k, "1".to_owned())).collect();
    let mut proc = Proc::spawn_program(dir, "inference-perf", exe, &args, &env)?;
    let seconds: u64 = load.stages.iter().map(|(_, s)| s).sum();
    let deadline = Instant::now() + Duration::from_secs(seconds + 120);
    let status = loop {
        if let Some(status) = proc.exit_status() {
            break status;
        }
        if Instant::now() >= deadline {
            bail!("inference-perf did not finish; see {}", dir.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if !status.success() {
        bail!(
            "inference-perf exited with {status}; see {}/inference-perf.log",
            dir.display()
        );
    }
    let file = reports.join("summary_lifecycle_metrics.json");
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("reading inference-perf's {}", file.display()))?;
    let v: Value = serde_json::from_str(&text).context("inference-perf's summary")?;
    let ok = &v["successes"];
    let ttft = &ok["latency"]["time_to_first_token"];
    Ok(Summary {
        successes: ok["count"].as_u64().unwrap_or(0),
        failures: v["failures"]["count"].as_u64().unwrap_or(0),
        prompt_tokens: ok["prompt_tokens"]["total"].as_f64().unwrap_or(0.0),
        cached_tokens: ok["prompt_tokens"]["cached"].as_f64().unwrap_or(0.0),
        ttft_p50: ttft["median"].as_f64().unwrap_or(f64::NAN),
        ttft_p99: ttft["p99"].as_f64().unwrap_or(f64::NAN),
    })
}
