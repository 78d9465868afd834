//! `kvroute-e2e report --out DIR`: runs the system suite's scenarios from
//! kvroute's real binaries and writes `DIR/report.json` and a timeline PNG
//! per scenario. Exits non-zero when a scenario fails. With `--repeat N`,
//! each scenario runs N times (run k's logs and plots under `DIR/run-k/`)
//! and the report sums the runs up (`suite::repeat`). `kvroute-e2e replay`
//! drives a trace through the same system (see [`replay`]); the other
//! subcommands are benchmarks, `compare` among them (kvroute beside its
//! peers under the suite's load, see [`compare`]).

mod bench;
mod compare;
mod replay;
mod suite;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use suite::procs::Bins;
use suite::report::{Report, Scenario};
use suite::scenarios::{self, Ctx, NAMES};

/// kvroute's system suite.
#[derive(Debug, Parser)]
#[command(name = "kvroute-e2e", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the scenarios and write the report.
    Report {
        /// Directory for report.json, the plots and every process's log.
        #[arg(long)]
        out: PathBuf,
        /// Where kvroute-engine-sim, kvroute-agent, kvroute-operator and
        /// kvroute-router are; default: beside this executable (built
        /// first when run by `cargo run`).
        #[arg(long)]
        bin_dir: Option<PathBuf>,
        /// Run only these scenarios (comma-separated).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Seconds of load in each scenario, 16 (each scenario acts 8 s in
        /// and compares the windows around it) to 86,400 (a day).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(16..=86_400))]
        duration: u64,
        /// Runs of each scenario, 1 to 100. With more than one, every figure holds
        /// the median of the runs and gains `<figure>_mean` and
        /// `<figure>_ci95` (half-width of the 95 % interval of the mean,
        /// Student's t); a check or goal holds only if it held in every run.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
        repeat: u32,
        /// The venv inference-perf is installed into (created when
        /// missing); default: `target/inference-perf-venv`.
        #[arg(long)]
        inference_perf_venv: Option<PathBuf>,
    },
    /// Measure what proxying costs: kvroute-router beside nginx and
    /// SGLang's gateway, against one fixed upstream (needs wrk and nginx).
    BenchProxy(bench::Args),
    /// Send unique large prompts through kvroute-router and compare its
    /// memory after the first tenth with the end.
    BenchSoak(bench::SoakArgs),
    /// A bare hyper reverse proxy, round robin, that reads no body: the
    /// HTTP stack's floor, a target of bench-proxy.
    BareProxy(bench::BareArgs),
    /// Drive a Mooncake-format trace through the live system, per policy,
    /// beside `kvroute replay --engine vllm` on the same slice; writes
    /// `replay.json`.
    Replay(replay::Args),
    /// The semantic response cache through a router: the labelled
    /// question pairs per threshold (hit and false-hit rates), and memory
    /// at maxEntries.
    BenchSemantic(bench::SemanticArgs),
    /// The suite's standard load through kvroute and through each peer
    /// (SGLang's gateway, kvroute's baseline policies), each over fresh
    /// pods; writes `compare.json` and a table.
    Compare(compare::Args),
}

/// The longest a scenario may take, start to end.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(180);

fn main() -> anyhow::Result<()> {
    let (out, bin_dir, only, duration, repeat, inference_perf_venv) = match Cli::parse().command {
        Command::BenchProxy(args) => return bench::run(&args),
        Command::BenchSoak(args) => return bench::soak(&args),
        Command::BareProxy(args) => return bench::bare_proxy(&args),
        Command::Replay(args) => return replay::run(&args),
        Command::BenchSemantic(args) => return bench::semantic(&args),
        Command::Compare(args) => return compare::run(&args),
        Command::Report {
            out,
            bin_dir,
            only,
            duration,
            repeat,
            inference_perf_venv,
        } => (out, bin_dir, only, duration, repeat, inference_perf_venv),
    };
    for name in &only {
        anyhow::ensure!(
            NAMES.contains(&name.as_str()),
            "no scenario {name:?}; the scenarios are {NAMES:?}"
        );
    }
    let bins = Bins::locate(bin_dir)?;
    // Installed before any scenario's timeout starts: on a fresh machine
    // making the venv takes longer than a scenario may.
    let inference_perf = if only.is_empty() || only.iter().any(|o| o == "inference_perf") {
        let venv = inference_perf_venv.unwrap_or_else(suite::inference_perf::default_venv);
        suite::inference_perf::install(&venv)
    } else {
        Err("not selected".into())
    };
    for k in 1..=repeat {
        let dir = run_dir(&out, k, repeat);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // One context per run: run k of every scenario shares run k's
    // undisturbed baseline, so the runs are independent of each other.
    let ctxs: Vec<Ctx> = (1..=repeat)
        .map(|k| Ctx {
            bins: bins.clone(),
            out: run_dir(&out, k, repeat),
            duration: Duration::from_secs(duration),
            inference_perf: inference_perf.clone(),
            baseline: tokio::sync::OnceCell::new(),
        })
        .collect();
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let mut report = Report::default();
    let mut interrupted = false;
    for name in NAMES
        .iter()
        .filter(|n| only.is_empty() || only.iter().any(|o| o == *n))
    {
        let mut runs = Vec::new();
        for (k, ctx) in (1..).zip(&ctxs) {
            if repeat > 1 {
                eprintln!("kvroute-e2e: {name}, run {k} of {repeat} ...");
            } else {
                eprintln!("kvroute-e2e: {name} ...");
            }
            let mut scenario = Scenario::new(name);
            // Ctrl-C ends the scenario, so its processes are ended too.
            let result = runtime.block_on(async {
                tokio::select! {
                    r = tokio::time::timeout(SCENARIO_TIMEOUT, scenarios::run(ctx, name, &mut scenario)) => Some(r),
                    _ = tokio::signal::ctrl_c() => None,
                }
            });
            interrupted = result.is_none();
            match result {
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => scenario.error = Some(format!("{e:#}")),
                Some(Err(_)) => {
                    scenario.error = Some(format!("did not finish within {SCENARIO_TIMEOUT:?}"))
                }
                None => scenario.error = Some("interrupted".into()),
            }
            scenario.passed = scenario.error.is_none() && scenario.checks.iter().all(|c| c.passed);
            if repeat > 1 {
                scenario.plot = scenario.plot.map(|p| format!("run-{k}/{p}"));
                print_scenario(&scenario, &format!("{name}, run {k} of {repeat}"));
            }
            runs.push(scenario);
            if interrupted {
                break;
            }
        }
        let scenario = suite::repeat::combine(runs);
        let title = match scenario.runs.len() {
            0 => name.to_string(),
            n => format!("{name}, {n} runs"),
        };
        print_scenario(&scenario, &title);
        report.scenarios.push(scenario);
        suite::report::write_json(&out, &report)?;
        if interrupted {
            break;
        }
    }
    let failed: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| !s.passed)
        .map(|s| s.name.as_str())
        .collect();
    println!(
        "kvroute-e2e: {} of {} scenarios passed; report in {}",
        report.scenarios.len() - failed.len(),
        report.scenarios.len(),
        out.join("report.json").display()
    );
    anyhow::ensure!(failed.is_empty(), "failed: {}", failed.join(", "));
    Ok(())
}

/// Where run `k` of `repeat` writes its logs and plots: `out` itself when
/// there is one run.
fn run_dir(out: &std::path::Path, k: u32, repeat: u32) -> PathBuf {
    if repeat > 1 {
        out.join(format!("run-{k}"))
    } else {
        out.to_path_buf()
    }
}

fn print_scenario(s: &Scenario, title: &str) {
    let verdict = match (s.passed, &s.skipped) {
        (_, Some(_)) => "SKIP",
        (true, None) => "PASS",
        (false, None) => "FAIL",
    };
    println!("{verdict} {title}");
    for c in &s.checks {
        println!("  [{}] {}", if c.passed { "ok" } else { "FAILED" }, c.what);
    }
    for g in &s.goals {
        let met = if g.passed { "met" } else { "MISSED" };
        println!("  goal [{met}] {}", g.what);
    }
    for note in &s.notes {
        println!("  note: {note}");
    }
    if let Some(reason) = &s.skipped {
        println!("  skipped: {reason}");
    }
    if let Some(e) = &s.error {
        println!("  error: {e}");
    }
    let figures: Vec<String> = s
        .figures
        .iter()
        .map(|(k, v)| format!("{k}={v:.3}"))
        .collect();
    println!("  {}", figures.join(" "));
    for line in &s.text {
        println!("  {line}");
    }
}
