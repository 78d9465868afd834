//! `kvroute-e2e bench-proxy`: what a proxy costs, kvroute-router side by
//! side with nginx and SGLang's gateway, against the same fixed upstream.
//!
//! Every target is driven by `wrk` (one thread) at each concurrency with
//! each body size, streaming and not. Per run: requests/s, latency p50 and
//! p99 (added = minus the direct run's), the proxy's CPU time per request
//! (its process tree's, from `/proc`) and its peak resident memory. The
//! order of targets rotates across repetitions and each figure is the
//! median of the repetitions; ratios to nginx's figures are what compares
//! across machines, since absolute figures on a shared 2-core box move
//! from run to run.

mod measure;
mod targets;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use serde_json::json;

use crate::suite::procs::{Bins, pip_install};
use targets::{Bed, MODEL, Target};

/// SGLang's gateway version installed for comparison.
const SMG_VERSION: &str = "1.13.0";

/// The bench's settings.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for bench-proxy.md, bench-proxy.json and the logs.
    #[arg(long)]
    pub out: PathBuf,
    /// Where kvroute-router and kvroute-engine-sim are (as for `report`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Seconds of measured load per run (after a 1 s warm-up).
    #[arg(long, default_value_t = 5)]
    pub duration: u64,
    /// Repetitions; figures are their medians.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Client connections (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 64])]
    pub connections: Vec<usize>,
    /// Chat body sizes in KiB (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 200])]
    pub body_kib: Vec<usize>,
    /// Only these targets (comma-separated; `direct` and `nginx` always
    /// run, as the baselines).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Also run streaming requests (`stream: true`, an event-stream
    /// answer).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub stream: bool,
    /// The venv SGLang's gateway is installed into (created when missing);
    /// default: `target/smg-venv`.
    #[arg(long)]
    pub smg_venv: Option<PathBuf>,
}

/// One load run: body size, streaming, connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
struct Cell {
    kib: usize,
    stream: bool,
    connections: usize,
}

/// One target's figures in one run.
#[derive(Clone, Copy, Debug, Serialize)]
struct Sample {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// The proxy's CPU per request, µs (none for `direct`).
    cpu_us: Option<f64>,
    failed: u64,
}

/// Medians over the repetitions.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Figures {
    rate: f64,
    p50_added_ms: f64,
    p99_added_ms: f64,
    cpu_us: Option<f64>,
    failed: u64,
}

/// Runs the bench and writes its report.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let targets: Vec<Target> = Target::ALL
        .into_iter()
        .filter(|t| {
            matches!(t, Target::Direct | Target::Nginx)
                || args.only.is_empty()
                || args.only.iter().any(|o| o == t.name())
        })
        .collect();
    for o in &args.only {
        let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
        anyhow::ensure!(
            names.contains(&o.as_str()),
            "no target {o:?}; the targets are {names:?}"
        );
    }
    anyhow::ensure!(
        args.repeats >= 1 && args.duration >= 1,
        "--repeats and --duration must be at least 1"
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let bins = Bins::locate(args.bin_dir.clone())?;
    let smg = if targets.iter().any(|t| t.name().starts_with("smg")) {
        let venv = args
            .smg_venv
            .clone()
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/smg-venv"));
        pip_install(
            &venv,
            Path::new("python3"),
            &format!("smg=={SMG_VERSION}"),
            "smg",
        )
    } else {
        Err("not selected".into())
    };
    if let Err(why) = &smg {
        eprintln!("kvroute-e2e: SGLang's gateway is skipped: {why}");
    }
    let sims = targets.contains(&Target::KvrouteExact);
    let bed = Bed::start(bins, &args.out, sims, smg.clone())?;

    let mut bodies = BTreeMap::new();
    for &kib in &args.body_kib {
        for stream in [false, true] {
            let path = args.out.join(format!("body-{kib}k-{stream}.json"));
            std::fs::write(&path, chat_body(kib * 1024, stream))?;
            bodies.insert((kib, stream), path);
        }
    }
    let script = args.out.join("bench.lua");
    std::fs::write(&script, measure::WRK_SCRIPT)?;
    let probe = chat_body(1024, false);
    let mut cells = Vec::new();
    for &kib in &args.body_kib {
        for stream in [false, true].into_iter().filter(|s| !s || args.stream) {
            for &connections in &args.connections {
                cells.push(Cell {
                    kib,
                    stream,
                    connections,
                });
            }
        }
    }

    let mut samples: BTreeMap<(Cell, Target), Vec<Sample>> = BTreeMap::new();
    let mut peak_rss: BTreeMap<Target, u64> = BTreeMap::new();
    let mut skipped: BTreeMap<Target, String> = BTreeMap::new();
    let duration = Duration::from_secs(args.duration);
    for rep in 0..args.repeats {
        let mut order = targets.clone();
        let turn = rep % order.len();
        order.rotate_left(turn);
        for &target in &order {
            if skipped.contains_key(&target) {
                continue;
            }
            eprintln!(
                "kvroute-e2e: repetition {} of {}: {}",
                rep + 1,
                args.repeats,
                target.name()
            );
            let running = match bed.run(target, &probe) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("kvroute-e2e: {} is skipped: {e:#}", target.name());
                    skipped.insert(target, format!("{e:#}"));
                    continue;
                }
            };
            for &cell in &cells {
                let body = &bodies[&(cell.kib, cell.stream)];
                let warm = Duration::from_secs(1);
                measure::wrk(
                    &script,
                    &running.url,
                    body,
                    cell.stream,
                    cell.connections,
                    warm,
                )?;
                let pids = running.root.map(measure::tree).unwrap_or_default();
                let cpu_before = measure::cpu_us(&pids);
                let w = measure::wrk(
                    &script,
                    &running.url,
                    body,
                    cell.stream,
                    cell.connections,
                    duration,
                )?;
                let cpu = measure::cpu_us(&pids).saturating_sub(cpu_before);
                samples.entry((cell, target)).or_default().push(Sample {
                    rate: w.rate(),
                    p50_ms: w.p50_us as f64 / 1e3,
                    p99_ms: w.p99_us as f64 / 1e3,
                    cpu_us: running.root.map(|_| cpu as f64 / w.requests.max(1) as f64),
                    failed: w.errors + w.bad_status,
                });
            }
            if let Some(root) = running.root {
                let peak = measure::memory_kib(&measure::tree(root), "VmHWM");
                let e = peak_rss.entry(target).or_default();
                *e = (*e).max(peak);
            }
        }
    }

    let figures: BTreeMap<(Cell, Target), Figures> = samples
        .iter()
        .map(|(&(cell, target), s)| {
            let direct = samples.get(&(cell, Target::Direct));
            let base = |f: fn(&Sample) -> f64| direct.map_or(0.0, |d| median(d.iter().map(f)));
            let fig = Figures {
                rate: median(s.iter().map(|x| x.rate)),
                p50_added_ms: median(s.iter().map(|x| x.p50_ms)) - base(|x| x.p50_ms),
                p99_added_ms: median(s.iter().map(|x| x.p99_ms)) - base(|x| x.p99_ms),
                cpu_us: s
                    .iter()
                    .all(|x| x.cpu_us.is_some())
                    .then(|| median(s.iter().filter_map(|x| x.cpu_us))),
                failed: s.iter().map(|x| x.failed).sum(),
            };
            ((cell, target), fig)
        })
        .collect();
    let goals = goals(&figures);
    let markdown = render(
        args, &cells, &targets, &figures, &peak_rss, &skipped, &goals,
    );
    print!("{markdown}");
    std::fs::write(args.out.join("bench-proxy.md"), &markdown)?;
    let cells_json: Vec<_> = cells
        .iter()
        .map(|&cell| {
            let rows: BTreeMap<&str, _> = targets
                .iter()
                .filter_map(|&t| {
                    let f = figures.get(&(cell, t))?;
                    Some((
                        t.name(),
                        json!({"figures": f, "samples": samples[&(cell, t)]}),
                    ))
                })
                .collect();
            json!({"cell": cell, "targets": rows})
        })
        .collect();
    let report = json!({
        "machine": machine(),
        "duration_s": args.duration,
        "repeats": args.repeats,
        "cells": cells_json,
        "peak_rss_mib": peak_rss.iter().map(|(t, k)| (t.name(), *k as f64 / 1024.0)).collect::<BTreeMap<_, _>>(),
        "skipped": skipped.iter().map(|(t, why)| (t.name(), why)).collect::<BTreeMap<_, _>>(),
        "goals": goals.iter().map(|g| json!({"goal": g.what, "measured": g.measured, "met": g.met})).collect::<Vec<_>>(),
    });
    std::fs::write(
        args.out.join("bench-proxy.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    eprintln!(
        "kvroute-e2e: report in {}",
        args.out.join("bench-proxy.md").display()
    );
    Ok(())
}

/// A chat completion body of about `bytes` bytes: a short system prompt
/// and a user message of words.
fn chat_body(bytes: usize, stream: bool) -> String {
    const WORDS: [&str; 12] = [
        "cache", "router", "prefix", "block", "engine", "token", "stream", "pool", "request",
        "latency", "replica", "the",
    ];
    let mut text = String::with_capacity(bytes);
    let mut i = 0usize;
    while text.len() + 200 < bytes {
        text.push_str(WORDS[(i * 7 + i / 5) % WORDS.len()]);
        text.push(' ');
        i += 1;
    }
    let mut body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 4,
    });
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body.to_string()
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One of the goals, as a ratio measured in this run.
struct Goal {
    what: String,
    measured: f64,
    met: bool,
}

/// The product's goals against nginx and SGLang's gateway, from the runs
/// that have them: 1 KiB at 64 connections, 200 KiB at 16, not streaming.
fn goals(figures: &BTreeMap<(Cell, Target), Figures>) -> Vec<Goal> {
    let small = Cell {
        kib: 1,
        stream: false,
        connections: 64,
    };
    let large = Cell {
        kib: 200,
        stream: false,
        connections: 16,
    };
    let mut goals = Vec::new();
    let mut ratio = |what: &str,
                     cell: Cell,
                     t: Target,
                     base: Target,
                     f: fn(&Figures) -> Option<f64>,
                     at_most: Option<f64>,
                     at_least: Option<f64>| {
        let (Some(a), Some(b)) = (
            figures.get(&(cell, t)).and_then(f),
            figures.get(&(cell, base)).and_then(f),
        ) else {
            return;
        };
        let measured = a / b;
        let met = at_most.is_none_or(|m| measured <= m) && at_least.is_none_or(|m| measured >= m);
        goals.push(Goal {
            what: format!(
                "{} {what} ({} KiB, {} connections)",
                t.name(),
                cell.kib,
                cell.connections
            ),
            measured,
            met,
        });
    };
    let cpu = |f: &Figures| f.cpu_us;
    let rate = |f: &Figures| Some(f.rate);
    let p99 = |f: &Figures| Some(f.p99_added_ms.max(0.001));
    ratio(
        "CPU per request ≤ 1 × nginx's",
        small,
        Target::KvrouteRoundRobin,
        Target::Nginx,
        cpu,
        Some(1.0),
        None,
    );
    ratio(
        "CPU per request ≤ 1 × nginx's",
        large,
        Target::KvrouteRoundRobin,
        Target::Nginx,
        cpu,
        Some(1.0),
        None,
    );
    ratio(
        "req/s ≥ 0.9 × nginx's",
        small,
        Target::KvrouteRoundRobin,
        Target::Nginx,
        rate,
        None,
        Some(0.9),
    );
    for t in [Target::KvrouteApprox, Target::KvrouteExact] {
        ratio(
            "CPU per request ≤ 1.5 × nginx's",
            small,
            t,
            Target::Nginx,
            cpu,
            Some(1.5),
            None,
        );
        ratio(
            "CPU per request ≤ 10 × nginx's",
            large,
            t,
            Target::Nginx,
            cpu,
            Some(10.0),
            None,
        );
        ratio(
            "p99 added latency ≤ 1.5 × nginx's",
            small,
            t,
            Target::Nginx,
            p99,
            Some(1.5),
            None,
        );
        ratio(
            "req/s ≥ 5 × SGLang's cache-aware gateway's",
            small,
            t,
            Target::SmgCacheAware,
            rate,
            None,
            Some(5.0),
        );
    }
    goals
}

fn render(
    args: &Args,
    cells: &[Cell],
    targets: &[Target],
    figures: &BTreeMap<(Cell, Target), Figures>,
    peak_rss: &BTreeMap<Target, u64>,
    skipped: &BTreeMap<Target, String>,
    goals: &[Goal],
) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Proxy cost\n\n{}; wrk -t1, {} s per run after 1 s of warm-up, median of {}; fixed-response nginx upstream on 4 ports.\n",
        machine(),
        args.duration,
        args.repeats
    );
    for cell in cells {
        let _ = writeln!(
            md,
            "## {} KiB chat, {}, {} connections\n\n| target | req/s | × nginx | p50 added ms | p99 added ms | × nginx | CPU µs/req | × nginx | failed |\n|---|---|---|---|---|---|---|---|---|",
            cell.kib,
            if cell.stream {
                "streaming"
            } else {
                "not streaming"
            },
            cell.connections
        );
        let nginx = figures.get(&(*cell, Target::Nginx));
        for t in targets {
            let Some(f) = figures.get(&(*cell, *t)) else {
                continue;
            };
            let x = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if *t != Target::Direct && b > 0.0 => format!("{:.2}", a / b),
                _ => "—".into(),
            };
            let cpu = f.cpu_us.map_or("—".into(), |c| format!("{c:.0}"));
            let _ = writeln!(
                md,
                "| {} | {:.0} | {} | {:.2} | {:.2} | {} | {} | {} | {} |",
                t.name(),
                f.rate,
                x(Some(f.rate), nginx.map(|n| n.rate)),
                f.p50_added_ms,
                f.p99_added_ms,
                x(Some(f.p99_added_ms), nginx.map(|n| n.p99_added_ms)),
                cpu,
                x(f.cpu_us, nginx.and_then(|n| n.cpu_us)),
                f.failed
            );
        }
        md.push('\n');
    }
    md.push_str("## Peak resident memory\n\n| target | MiB |\n|---|---|\n");
    for (t, kib) in peak_rss {
        let _ = writeln!(md, "| {} | {:.1} |", t.name(), *kib as f64 / 1024.0);
    }
    for (t, why) in skipped {
        let _ = writeln!(md, "\n{} skipped: {why}", t.name());
    }
    md.push_str("\n## Goals\n\n| goal | measured | met |\n|---|---|---|\n");
    for g in goals {
        let _ = writeln!(
            md,
            "| {} | {:.2} | {} |",
            g.what,
            g.measured,
            if g.met { "yes" } else { "no" }
        );
    }
    md
}

/// The CPU model and core count, from `/proc/cpuinfo`.
fn machine() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|x| x.1.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores ({model})")
}
