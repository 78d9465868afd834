//! `kvroute-e2e replay`: a Mooncake-format trace through the live system
//! (the system suite's engine-sim and agent pods, two operators, two
//! routers, streamed HTTP), beside `kvroute replay --engine vllm` on the
//! same slice: the check that the model the policies are tuned on is the
//! system users run.
//!
//! Per policy, a fresh system (cold caches) gets the slice open loop at
//! the trace's timestamps divided by the time scale, with engines running
//! that many times faster, so every time is in trace seconds once
//! multiplied back. With `--scale-out`, a second run per policy adds a pod
//! at the slice's middle request and compares the hit rate of the next
//! tenth of the slice with the first run's. With `--watch-engines` the
//! routers follow engine-sim's own WatchCache streams rather than the
//! agents', to tell the policy's model from the agents' view of load.
//!
//! Not here: the token mapping and sizing ([`trace`]), the sending
//! ([`drive`]), the figures ([`figures`]), the model ([`model`]).

pub mod drive;
pub mod figures;
pub mod model;
pub mod trace;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail, ensure};
use kvroute_core::policy::PolicyConfig;
use serde::Serialize;

use crate::suite::load::{Rotation, Sample};
use crate::suite::procs::Bins;
use crate::suite::system::{EngineSetup, Setup, System};
use figures::Live;
use trace::{Request, Sizing};

/// Tokens per engine KV block (vLLM's default).
const BLOCK_SIZE: u32 = 16;
/// The engines' timing, engine-sim's defaults and the replay model's
/// constants: prefill at this many uncached tokens per second ...
const PREFILL_TOKENS_PER_S: u32 = 10_000;
/// ... plus this much per prefill ...
const PREFILL_OVERHEAD_MS: u32 = 20;
/// ... and this much per output token.
const ITL_MS: u32 = 30;
/// How often each agent reads its engine's load, real milliseconds.
const LOAD_INTERVAL_MS: u32 = 20;
/// Router replicas (the system's).
const ROUTERS: usize = 2;
/// Live and model agree when their hit rates differ by at most this ...
const HIT_TOLERANCE: f64 = 0.02;
/// ... and their TTFT means by at most this share of the live one.
const TTFT_TOLERANCE: f64 = 0.15;

/// Flags of `kvroute-e2e replay`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The trace: Mooncake JSON lines (`timestamp` ms, `input_length`,
    /// `output_length`, `hash_ids`).
    #[arg(long, value_name = "PATH")]
    trace: PathBuf,
    /// Replay the first K requests by arrival (default: all).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    requests: Option<u64>,
    /// Pods (engine-sim and agent each).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=200))]
    pods: u64,
    /// Arrivals come this many times faster than the trace's timestamps,
    /// and the engines run this many times faster than real time.
    #[arg(long, value_name = "S", default_value_t = 3.0)]
    time_scale: f64,
    /// Policies, comma-separated, each run on its own fresh system.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "kvroute,min-ttft,round-robin"
    )]
    policies: Vec<String>,
    /// Tokens per trace block id: a multiple of the engines' block size, 16,
    /// up to 4,096 (as `kvroute replay --block-tokens`, which models it).
    #[arg(long, value_name = "T", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=4096))]
    block_tokens: u64,
    /// Share of the slice's distinct blocks the pool caches, as `kvroute
    /// replay --cache-frac` sizes replicas (each engine is raised to hold
    /// the slice's largest request).
    #[arg(long, value_name = "F", default_value_t = 0.3)]
    cache_frac: f64,
    /// Requests each engine runs at once (engine-sim's default).
    #[arg(long, value_name = "S", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_num_seqs: u32,
    /// Routers follow engine-sim's own WatchCache streams (exact queued
    /// prefill work) instead of the agents' (vLLM's metrics: waiting
    /// requests times the mean prompt, as with a real vLLM).
    #[arg(long)]
    watch_engines: bool,
    /// Also run each policy with a pod added at the slice's middle
    /// request, and compare the hit rate of the next tenth of the slice.
    #[arg(long)]
    scale_out: bool,
    /// Where kvroute-engine-sim, kvroute-agent, kvroute-operator,
    /// kvroute-router and kvroute (for the model) are; default: beside
    /// this executable.
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Directory for replay.json and every process's log.
    #[arg(long)]
    out: PathBuf,
}

/// `replay.json`.
#[derive(Debug, Serialize)]
struct Output {
    trace: String,
    requests: usize,
    pods: usize,
    time_scale: f64,
    block_tokens: u64,
    cache_frac: f64,
    /// The engines' size, the same in the live system and the model.
    sizing: Sizing,
    max_model_len: u64,
    max_num_seqs: u32,
    routers: usize,
    /// Routers followed engine-sim's own WatchCache, not the agents'.
    watch_engines: bool,
    /// The model's routing key and report lag (see `model.rs`).
    key: String,
    report_lag_ms: u32,
    /// Why the model column is absent, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    model_note: Option<String>,
    results: Vec<Row>,
}

/// One policy's results.
#[derive(Debug, Serialize)]
struct Row {
    policy: String,
    #[serde(flatten)]
    live: Live,
    /// Real seconds the live run took, start to last response.
    wall_s: f64,
    model: Option<model::Figures>,
    /// Whether live and model agree (hit within 0.02, TTFT mean within
    /// 15 % of the live one); null without a model.
    agrees: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scale_out: Option<ScaleOut>,
}

/// The scale-out dip: the hit rate of the window after the middle request
/// without a pod added there, and with one.
#[derive(Debug, Serialize)]
struct ScaleOut {
    /// Requests `[from, to)` of the slice.
    window: [usize; 2],
    hit_without: f64,
    hit_with: f64,
    /// `hit_without − hit_with`.
    dip: f64,
    /// The run with the pod added, whole.
    with: Live,
}

/// Runs the live replay and writes `replay.json`; fails when a request
/// failed or live and model disagree.
pub fn run(args: &Args) -> anyhow::Result<()> {
    ensure!(
        args.time_scale.is_finite() && args.time_scale > 0.0,
        "--time-scale must be > 0, got {}",
        args.time_scale
    );
    ensure!(
        args.cache_frac > 0.0 && args.cache_frac <= 1.0,
        "--cache-frac must be in (0, 1], got {}",
        args.cache_frac
    );
    ensure!(
        args.block_tokens.is_multiple_of(u64::from(BLOCK_SIZE)),
        "--block-tokens {} is not a multiple of the engines' block size {BLOCK_SIZE}: a trace \
         block would end inside an engine block, and the engines' hits could not be the replay's",
        args.block_tokens
    );
    let policies = args
        .policies
        .iter()
        .map(|p| {
            PolicyConfig::NAMES
                .iter()
                .copied()
                .find(|n| n == p)
                .with_context(|| {
                    format!(
                        "unknown policy {p:?} in --policies (expected some of: {})",
                        PolicyConfig::NAMES.join(", ")
                    )
                })
        })
        .collect::<anyhow::Result<Vec<&'static str>>>()?;
    let bins = Bins::locate(args.bin_dir.clone())?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let limit = args.requests.map(|k| k as usize);
    let requests: Arc<[Request]> = trace::load(&args.trace, limit, args.block_tokens)?.into();
    let pods = args.pods as usize;
    let sizing = Sizing::of(
        &requests,
        pods,
        args.cache_frac,
        args.block_tokens,
        BLOCK_SIZE,
    )?;
    let engine = EngineSetup {
        num_gpu_blocks: sizing.num_gpu_blocks,
        block_size: BLOCK_SIZE,
        max_model_len: sizing.longest.max(32_768),
        max_num_seqs: args.max_num_seqs,
        prefill_tokens_per_s: PREFILL_TOKENS_PER_S,
        prefill_overhead_ms: PREFILL_OVERHEAD_MS,
        itl_ms: ITL_MS,
        time_scale: args.time_scale,
        extra_latency_ms: 0,
    };
    // How old a router's view of engine load is on average (see model.rs).
    let report_lag_ms = (f64::from(LOAD_INTERVAL_MS) * args.time_scale / 2.0).round() as u32;

    let model = run_model(args, &bins, &requests, &sizing, report_lag_ms)?;
    let mut output = Output {
        trace: args.trace.display().to_string(),
        requests: requests.len(),
        pods,
        time_scale: args.time_scale,
        block_tokens: args.block_tokens,
        cache_frac: args.cache_frac,
        sizing,
        max_model_len: engine.max_model_len,
        max_num_seqs: args.max_num_seqs,
        routers: ROUTERS,
        watch_engines: args.watch_engines,
        key: "p2".into(),
        report_lag_ms,
        model_note: model.as_ref().err().cloned(),
        results: Vec::new(),
    };
    let last = requests.last().map_or(0.0, |r| r.timestamp) - requests[0].timestamp;
    println!(
        "kvroute-e2e replay: {} requests over {:.0} s of {} at {}× on {pods} pods, {} KV blocks \
         each ({} distinct trace blocks, cache_frac {})",
        requests.len(),
        last / 1000.0,
        output.trace,
        args.time_scale,
        sizing.num_gpu_blocks,
        sizing.distinct_blocks,
        args.cache_frac
    );
    if let Some(note) = &output.model_note {
        println!("  {note}");
    }
    print_header();

    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    for policy in policies {
        let setup = Setup {
            policy,
            engine: engine.clone(),
            prefix_tokens: Some(2 * args.block_tokens as usize),
            load_interval_ms: LOAD_INTERVAL_MS,
            watch_engines: args.watch_engines,
            ..Setup::new(pods)
        };
        let logs = args.out.join("logs");
        let (samples, wall_s) = interruptible(
            &runtime,
            run_live(&bins, &logs.join(policy), &setup, &requests, args, false),
        )?;
        let live = Live::of(&samples, args.time_scale);
        let model = model
            .as_ref()
            .ok()
            .and_then(|m| m.iter().find(|(p, _)| p == policy))
            .map(|(_, f)| f.clone());
        let agrees = model.as_ref().map(|m| {
            (live.hit - m.hit).abs() <= HIT_TOLERANCE
                && (live.ttft_mean_s - m.ttft_mean_s).abs() <= TTFT_TOLERANCE * live.ttft_mean_s
        });
        let scale_out = if args.scale_out {
            let logs = logs.join(format!("{policy}-scale-out"));
            let (grown, _) = interruptible(
                &runtime,
                run_live(&bins, &logs, &setup, &requests, args, true),
            )?;
            let window = figures::scale_out_window(requests.len());
            let without = figures::hit(&samples[window.clone()]);
            let with = figures::hit(&grown[window.clone()]);
            Some(ScaleOut {
                window: [window.start, window.end],
                hit_without: without,
                hit_with: with,
                dip: without - with,
                with: Live::of(&grown, args.time_scale),
            })
        } else {
            None
        };
        let row = Row {
            policy: policy.to_owned(),
            live,
            wall_s,
            model,
            agrees,
            scale_out,
        };
        print_row(&row);
        output.results.push(row);
        write_json(&args.out, &output)?;
    }
    println!(
        "kvroute-e2e replay: results in {}",
        args.out.join("replay.json").display()
    );
    let failed: usize = output.results.iter().map(|r| r.live.failed).sum();
    let disagree: Vec<&str> = output
        .results
        .iter()
        .filter(|r| r.agrees == Some(false))
        .map(|r| r.policy.as_str())
        .collect();
    ensure!(failed == 0, "{failed} requests failed: see the logs");
    ensure!(
        disagree.is_empty(),
        "live and model disagree for {} (hit within {HIT_TOLERANCE}, TTFT mean within {}%)",
        disagree.join(", "),
        TTFT_TOLERANCE * 100.0
    );
    Ok(())
}

/// Runs the model on the slice, written to a temporary file.
fn run_model(
    args: &Args,
    bins: &Bins,
    requests: &[Request],
    sizing: &Sizing,
    report_lag_ms: u32,
) -> anyhow::Result<model::Model> {
    let dir = std::env::temp_dir().join(format!("kvroute-e2e-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let slice = dir.join("slice.jsonl");
    trace::write(&slice, requests)?;
    let settings = model::Settings {
        kvroute: bins.path("kvroute"),
        slice,
        json: args.out.join("model.json"),
        pods: args.pods as usize,
        policies: args.policies.join(","),
        num_gpu_blocks: sizing.num_gpu_blocks,
        block_size: BLOCK_SIZE,
        max_num_seqs: args.max_num_seqs,
        block_tokens: args.block_tokens,
        cache_frac: args.cache_frac,
        routers: ROUTERS,
        report_lag_ms,
        key: "p2".into(),
    };
    let model = settings.run();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(model)
}

/// One live run on a fresh system: the samples in request order and the
/// real seconds from the first request to the last response. With `grow`,
/// a pod joins the pool just before the middle request.
async fn run_live(
    bins: &Bins,
    logs: &Path,
    setup: &Setup,
    requests: &Arc<[Request]>,
    args: &Args,
    grow: bool,
) -> anyhow::Result<(Vec<Sample>, f64)> {
    let mut system = System::start(bins, logs, setup.clone()).await?;
    let extra = if grow {
        Some(system.start_pod().await?)
    } else {
        None
    };
    let rotation = Rotation::new(system.router_addrs());
    let began = Instant::now();
    let start = tokio::time::Instant::now();
    let mut driver = tokio::spawn(drive::send(
        requests.clone(),
        args.block_tokens,
        args.time_scale,
        rotation,
        start,
        system.t0,
    ));
    if let Some(k) = extra {
        let mid = figures::scale_out_window(requests.len()).start;
        let before = drive::offset(requests, mid.saturating_sub(1), args.time_scale);
        let at = drive::offset(requests, mid, args.time_scale);
        tokio::time::sleep_until(start + (before + at) / 2).await;
        system.write_pod(k, true)?;
    }
    // Poll the processes while the requests run: one that dies fails the
    // run with its log named, rather than as thousands of failed requests.
    let samples = loop {
        tokio::select! {
            done = &mut driver => break done.context("the request driver failed")?,
            _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {
                if let Some(name) = system.exited() {
                    bail!("{name} exited during the run; see {}", logs.join(format!("{name}.log")).display());
                }
            }
        }
    };
    write_samples(&logs.join("requests.jsonl"), &samples, args.time_scale)?;
    Ok((samples, began.elapsed().as_secs_f64()))
}

/// Each request's measurement as a JSON line, in request order, times in
/// trace seconds.
fn write_samples(path: &Path, samples: &[Sample], time_scale: f64) -> anyhow::Result<()> {
    let mut text = String::new();
    for (i, s) in samples.iter().enumerate() {
        let line = serde_json::json!({
            "request": i,
            "sent_s": s.t * time_scale,
            "endpoint": s.endpoint,
            "outcome": format!("{:?}", s.outcome),
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "ttft_s": s.ttft.map(|t| t * time_scale),
        });
        text += &line.to_string();
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Runs `run` to its end, or until Ctrl-C (then its processes end too).
fn interruptible<T>(
    runtime: &tokio::runtime::Runtime,
    run: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    runtime.block_on(async {
        tokio::select! {
            r = run => r,
            _ = tokio::signal::ctrl_c() => bail!("interrupted"),
        }
    })
}

fn write_json(out: &Path, output: &Output) -> anyhow::Result<()> {
    let path = out.join("replay.json");
    let json = serde_json::to_string_pretty(output)?;
    std::fs::write(&path, json + "\n").with_context(|| format!("writing {}", path.display()))
}

fn print_header() {
    println!(
        "{:<12} {:>6} {:>9} {:>8} {:>8} {:>6} {:>7} {:>7} | {:>6} {:>9} {:>8} {:>6}",
        "policy",
        "hit",
        "TTFT mean",
        "p50",
        "p99",
        "failed",
        "refused",
        "wall s",
        "model",
        "TTFT mean",
        "p99",
        "agree"
    );
}

fn print_row(r: &Row) {
    let model = match &r.model {
        Some(m) => format!(
            "{:>6.4} {:>9.3} {:>8.3} {:>6}",
            m.hit,
            m.ttft_mean_s,
            m.ttft_p99_s,
            if r.agrees == Some(true) { "yes" } else { "NO" }
        ),
        None => format!("{:>6} {:>9} {:>8} {:>6}", "-", "-", "-", "-"),
    };
    let l = &r.live;
    println!(
        "{:<12} {:>6.4} {:>9.3} {:>8.3} {:>8.3} {:>6} {:>7} {:>7.0} | {model}",
        r.policy, l.hit, l.ttft_mean_s, l.ttft_p50_s, l.ttft_p99_s, l.failed, l.refused, r.wall_s
    );
    if let Some(s) = &r.scale_out {
        let model_dip = r
            .model
            .as_ref()
            .map_or("-".to_owned(), |m| format!("{:.4}", m.hit_dip));
        println!(
            "{:<12} scale-out: requests {}..{} hit {:.4} without the added pod, {:.4} with it: dip {:.4} (model {model_dip})",
            "", s.window[0], s.window[1], s.hit_without, s.hit_with, s.dip
        );
    }
}
