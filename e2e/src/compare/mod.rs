//! `kvroute-e2e compare`: the suite's standard load through kvroute and
//! through each peer, each over fresh pods, side by side.
//!
//! 1. Every system gets the same pods: `--pods` engine sims with
//!    `--blocks` KV blocks each and the suite's timing
//!    ([`EngineSetup::suite`]), started fresh for each run of each system.
//! 2. kvroute is `--routers` routers under the default policy, following
//!    the sims' own WatchCache, their policy's `engine` set to the sims'
//!    rate and overhead, as the suite sets it ([`System`]). A peer named
//!    after one of kvroute's baseline policies (`round-robin`, …) is the
//!    same system under that policy; `smg` is SGLang's gateway,
//!    `smg launch --policy cache_aware` with its defaults, one gateway
//!    over the same pods.
//! 3. The load is the suite's ([`Shape::standard`]), with every
//!    assistant's system prompt after a shared preamble of
//!    `--preamble-tokens`; requests go to the routers in turn.
//! 4. Per-pod requests are each engine's own count
//!    (`vllm:request_success_total`), the same whatever routed them;
//!    their balance is [`Balance`]'s, over every pod.
//! 5. Installing `smg` happens before any run and counts against none;
//!    when it cannot be installed the peer is skipped with the reason.
//!
//! Writes `compare.json` (`{runs: [...], skipped: [...]}`) and
//! `compare.md` (the table it prints). A benchmark, not a check: it fails
//! only when a run could not be made.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_core::policy::PolicyConfig;
use serde::Serialize;

use crate::bench::{install_smg, smg_args};
use crate::suite::balance::Balance;
use crate::suite::flow::{routers_metrics, slowest};
use crate::suite::load::{self, Outcome, Rotation, Sample, Shape};
use crate::suite::procs::{Bins, Proc};
use crate::suite::report::{hit_ratio, quantile};
use crate::suite::system::{EngineSetup, NUM_GPU_BLOCKS, Setup, System, free_ports};

/// The peer that is SGLang's gateway.
const SMG: &str = "smg";
/// kvroute with its flow control off: every request sent on arrival.
const NO_FLOW: &str = "kvroute-no-flow";

/// How long a run may take beyond its load: starting the system, and the
/// last sessions' turns.
const RUN_SLACK: Duration = Duration::from_secs(120);

/// How long SGLang's gateway may take to answer.
const SMG_STARTUP: Duration = Duration::from_secs(60);

/// The comparison's settings.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The systems kvroute is compared with (comma-separated): `smg`
    /// (SGLang's gateway, cache-aware), `kvroute-no-flow` (kvroute with
    /// `flowControl.enabled: false`) or a kvroute baseline policy
    /// (`round-robin`, `least-loaded`, …).
    #[arg(long, value_delimiter = ',', default_value = "smg,round-robin", value_parser = peer)]
    pub peers: Vec<String>,
    /// Pods (engine sims) behind every system.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub pods: u32,
    /// Each engine's KV cache, blocks of 16 tokens, 1 to 67,108,864 (as
    /// engine-sim's `--num-gpu-blocks`).
    #[arg(long, default_value_t = NUM_GPU_BLOCKS, value_parser = clap::value_parser!(u32).range(1..=(1 << 26)))]
    pub blocks: u32,
    /// kvroute's routers (and a baseline policy's).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub routers: u32,
    /// Runs of every system, 1 to 100; each run starts fresh pods.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Tokens of a preamble every assistant's system prompt starts with,
    /// 0 to 16,384 (a session's turns must still fit the engines'
    /// 32,768-token context).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16_384))]
    pub preamble_tokens: u32,
    /// Seconds sessions keep arriving in each run, 1 to 86,400 (a day).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub duration: u64,
    /// Where kvroute's binaries are (as for `report`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Directory for compare.json, compare.md and the logs.
    #[arg(long)]
    pub out: PathBuf,
    /// The venv SGLang's gateway is installed into (as for bench-proxy);
    /// default: `target/smg-venv`.
    #[arg(long)]
    pub smg_venv: Option<PathBuf>,
}

/// A peer's name, if it is one.
fn peer(name: &str) -> Result<String, String> {
    let policies = PolicyConfig::NAMES.iter().filter(|n| **n != "kvroute");
    if name == SMG || name == NO_FLOW || policies.clone().any(|n| *n == name) {
        return Ok(name.to_owned());
    }
    let known: Vec<&str> = [SMG, NO_FLOW]
        .into_iter()
        .chain(policies.copied())
        .collect();
    Err(format!(
        "unknown peer {name:?}; the peers are {}",
        known.join(", ")
    ))
}

/// One run of one system.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// `kvroute` or the peer's name.
    pub system: String,
    /// Which run, from 1.
    pub run: u32,
    /// Requests sent.
    pub requests: usize,
    /// Requests that did not stream to the end.
    pub failed: usize,
    /// Cached over prompt tokens of the completed requests, as the
    /// engines reported them.
    pub cached: f64,
    /// Time to first token of the completed requests, milliseconds:
    /// median, ...
    pub ttft_p50_ms: f64,
    /// ... 90th and ...
    pub ttft_p90_ms: f64,
    /// ... 99th percentiles, and ...
    pub ttft_p99_ms: f64,
    /// ... mean.
    pub ttft_mean_ms: f64,
    /// The busiest pod's requests over the mean per pod, by the engines'
    /// own counts ([`Balance`]).
    pub pod_requests_max_over_mean: f64,
    /// Pods with under a quarter of the mean pod's requests.
    pub idle_pods: usize,
}

/// A system that was not run, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    /// `kvroute` or the peer's name.
    pub system: String,
    /// Why.
    pub reason: String,
}

/// What `compare.json` holds.
#[derive(Debug, Default, Serialize)]
pub struct Comparison {
    /// Every run of every system, in the order they ran.
    pub runs: Vec<Row>,
    /// Peers not run (`smg` when it cannot be installed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
    /// Runs that could not be made, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Skipped>,
}

/// Runs the comparison and writes its report.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let bins = Bins::locate(args.bin_dir.clone())?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut comparison = Comparison::default();
    let mut systems = vec!["kvroute".to_owned()];
    let mut smg = None;
    for p in &args.peers {
        if systems.contains(p) {
            continue;
        }
        if p == SMG {
            // Before any run, so it counts against none.
            match install_smg(args.smg_venv.clone()) {
                Ok(exe) => smg = Some(exe),
                Err(reason) => {
                    eprintln!("kvroute-e2e: {SMG} is skipped: {reason}");
                    let (system, reason) = (p.clone(), format!("cannot be installed: {reason}"));
                    comparison.skipped.push(Skipped { system, reason });
                    continue;
                }
            }
        }
        systems.push(p.clone());
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let limit = Duration::from_secs(args.duration) + RUN_SLACK;
    'runs: for k in 1..=args.repeat {
        // Each run in another order, so no system always goes first.
        let mut order = systems.clone();
        let first = (k as usize - 1) % order.len();
        order.rotate_left(first);
        for system in &order {
            eprintln!(
                "kvroute-e2e: compare: {system}, run {k} of {} ...",
                args.repeat
            );
            let one = one_run(&bins, args, system, smg.as_deref(), k);
            let result = runtime.block_on(async {
                tokio::select! {
                    r = tokio::time::timeout(limit, one) => Some(r),
                    _ = tokio::signal::ctrl_c() => None,
                }
            });
            let error = match result {
                Some(Ok(Ok(row))) => {
                    println!(
                        "{}",
                        table(std::slice::from_ref(&row))
                            .lines()
                            .last()
                            .unwrap_or("")
                    );
                    comparison.runs.push(row);
                    None
                }
                Some(Ok(Err(e))) => Some(format!("run {k}: {e:#}")),
                Some(Err(_)) => Some(format!("run {k}: did not finish within {limit:?}")),
                None => Some(format!("run {k}: interrupted")),
            };
            if let Some(reason) = error {
                eprintln!("kvroute-e2e: compare: {system}: {reason}");
                let interrupted = reason.ends_with("interrupted");
                let system = system.clone();
                comparison.errors.push(Skipped { system, reason });
                if interrupted {
                    break 'runs;
                }
            }
        }
    }
    write(&args.out, &comparison)?;
    println!("{}", table(&comparison.runs));
    for s in &comparison.skipped {
        println!("skipped {}: {}", s.system, s.reason);
    }
    println!(
        "kvroute-e2e: compare: {} runs; compare.json and compare.md in {}",
        comparison.runs.len(),
        args.out.display()
    );
    anyhow::ensure!(
        comparison.errors.is_empty(),
        "{} runs could not be made: {}",
        comparison.errors.len(),
        (comparison.errors.iter())
            .map(|e| format!("{}: {}", e.system, e.reason))
            .collect::<Vec<_>>()
            .join("; ")
    );
    Ok(())
}

/// Run `k` of `system` over fresh pods.
async fn one_run(
    bins: &Bins,
    args: &Args,
    system: &str,
    smg: Option<&Path>,
    k: u32,
) -> anyhow::Result<Row> {
    let pods = args.pods as usize;
    let through_smg = system == SMG;
    let policy = match system {
        SMG | NO_FLOW => "kvroute",
        name => PolicyConfig::NAMES
            .into_iter()
            .find(|n| *n == name)
            .with_context(|| format!("no policy {name:?}"))?,
    };
    let setup = Setup {
        routers: if through_smg {
            0
        } else {
            args.routers as usize
        },
        policy,
        watch_engines: true,
        engine: EngineSetup {
            num_gpu_blocks: args.blocks,
            ..EngineSetup::suite()
        },
        router_yaml: if system == NO_FLOW {
            "flowControl: {enabled: false}\n".to_owned()
        } else {
            String::new()
        },
        ..Setup::new(pods)
    };
    let logs = args.out.join("logs").join(format!("{system}-run-{k}"));
    let sys = System::start(bins, &logs, setup).await?;
    let (_gateway, addrs) = if through_smg {
        let exe = smg.context("smg is not installed")?;
        let (proc, addr) = start_smg(&sys, exe, &logs).await?;
        (Some(proc), vec![addr])
    } else {
        (None, sys.router_addrs())
    };
    let before = engine_requests(&sys).await?;
    let shape = Shape {
        preamble_tokens: args.preamble_tokens as usize,
        ..Shape::standard(pods, Duration::from_secs(args.duration))
    };
    let samples = load::run(shape, Rotation::new(addrs), Instant::now()).await;
    load::write_samples(&logs.join("requests.jsonl"), &samples)?;
    // The requests at and above the p90, each beside its router's record.
    let tenth = slowest(&sys, &samples, samples.len().div_ceil(10)).await;
    std::fs::write(logs.join("slowest.jsonl"), tenth)?;
    for (i, text) in routers_metrics(&sys).await?.iter().enumerate() {
        std::fs::write(logs.join(format!("router-{i}.prom")), text)?;
    }
    let after = engine_requests(&sys).await?;
    let served: Vec<u64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    Ok(row(system, k, &samples, &served))
}

/// Every pod's finished requests, by its engine.
async fn engine_requests(sys: &System) -> anyhow::Result<Vec<u64>> {
    let mut counts = Vec::new();
    for k in 0..sys.pods.len() {
        counts.push(sys.engine_requests(k).await?);
    }
    Ok(counts)
}

/// SGLang's gateway over `sys`'s pods, once it answers.
async fn start_smg(
    sys: &System,
    exe: &Path,
    logs: &Path,
) -> anyhow::Result<(Proc, std::net::SocketAddr)> {
    let mut ports = free_ports(2)?;
    let (port, prometheus) = (ports.next().unwrap_or(0), ports.next().unwrap_or(0));
    let workers: Vec<String> = (0..sys.pods.len())
        .map(|k| format!("http://{}", sys.engine_addr(k)))
        .collect();
    let args = smg_args(port, prometheus, "cache_aware", &workers);
    let proc = Proc::spawn_program(logs, SMG, exe, &args, &[])?.graceful();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/models");
    let answers = async || {
        let r = client.get(&url).send().await.ok()?;
        r.status().is_success().then_some(())
    };
    sys.wait_for("SGLang's gateway to answer", SMG_STARTUP, answers)
        .await
        .with_context(|| format!("see {}", proc.log().display()))?;
    Ok((proc, addr))
}

/// The figures of run `k` of `system`: `samples` as the client saw them,
/// `served` per pod as the engines counted them.
fn row(system: &str, k: u32, samples: &[Sample], served: &[u64]) -> Row {
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.outcome == Outcome::Ok)
        .collect();
    let mut ttfts: Vec<f64> = ok.iter().filter_map(|s| s.ttft).map(|t| t * 1e3).collect();
    let mean = ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64;
    let balance = Balance::of(served);
    Row {
        system: system.to_owned(),
        run: k,
        requests: samples.len(),
        failed: samples.len() - ok.len(),
        cached: hit_ratio(ok.iter().copied()),
        ttft_p50_ms: quantile(&mut ttfts, 0.5),
        ttft_p90_ms: quantile(&mut ttfts, 0.9),
        ttft_p99_ms: quantile(&mut ttfts, 0.99),
        ttft_mean_ms: mean,
        pod_requests_max_over_mean: balance.max_over_mean,
        idle_pods: balance.idle_pods,
    }
}

/// The runs as a Markdown table.
fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| system | run | requests | failed | cached | TTFT p50 ms | p90 ms | p99 ms | mean ms | pod requests max/mean | idle pods |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {} | {} | {:.1} % | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {} |\n",
            r.system,
            r.run,
            r.requests,
            r.failed,
            r.cached * 100.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.ttft_mean_ms,
            r.pod_requests_max_over_mean,
            r.idle_pods
        );
    }
    out.trim_end().to_owned()
}

/// Writes `compare.json` and `compare.md` into `dir`.
fn write(dir: &Path, comparison: &Comparison) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(comparison).context("serializing the comparison")?;
    std::fs::write(dir.join("compare.json"), json + "\n").context("writing compare.json")?;
    std::fs::write(dir.join("compare.md"), table(&comparison.runs) + "\n")
        .context("writing compare.md")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn an_unknown_peer_exits_2_naming_it() {
        let e = Cli::try_parse_from(["compare", "--out", "x", "--peers", "smg,nginx"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("unknown peer \"nginx\""), "{e}");
        let ok = Cli::try_parse_from(["compare", "--out", "x"]).unwrap();
        assert_eq!(ok.args.peers, ["smg", "round-robin"]);
        assert_eq!((ok.args.pods, ok.args.blocks, ok.args.routers), (8, 256, 2));
    }

    #[test]
    fn a_row_counts_failures_and_balance_over_every_pod() {
        let sample = |outcome, ttft_ms: f64| Sample {
            t: 0.0,
            endpoint: None,
            id: None,
            outcome,
            prompt_tokens: 100,
            cached_tokens: 50,
            ttft: Some(ttft_ms / 1e3),
            itl: Vec::new(),
        };
        let samples = [
            sample(Outcome::Ok, 10.0),
            sample(Outcome::Ok, 30.0),
            sample(Outcome::Refused(429), 1000.0),
        ];
        let r = row("smg", 2, &samples, &[2, 0, 0, 0]);
        assert_eq!((r.requests, r.failed, r.run), (3, 1, 2));
        assert_eq!(r.cached, 0.5);
        assert_eq!(
            (r.ttft_p50_ms, r.ttft_p99_ms, r.ttft_mean_ms),
            (10.0, 30.0, 20.0)
        );
        // The mean is over the 4 pods: 0.5 a pod.
        assert_eq!((r.pod_requests_max_over_mean, r.idle_pods), (4.0, 3));
        let json = serde_json::to_value(Comparison {
            runs: vec![r],
            ..Comparison::default()
        })
        .unwrap();
        let mut keys: Vec<&str> = (json["runs"][0].as_object().unwrap().keys())
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        let mut wanted = [
            "system",
            "run",
            "requests",
            "failed",
            "cached",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "ttft_mean_ms",
            "pod_requests_max_over_mean",
            "idle_pods",
        ];
        wanted.sort_unstable();
        assert_eq!(keys, wanted);
        assert!(table(&[]).lines().count() == 2);
    }
}
