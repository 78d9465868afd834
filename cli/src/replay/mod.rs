//! `kvroute replay`: replays a Mooncake-format trace against N simulated
//! replicas under every routing policy, with the router's own policy code,
//! and prints a table per N (plus JSON for tools).
//!
//! Two engine models: the simple one in [`sim`] (`--engine simple`, the
//! default) and vLLM v1's scheduler in [`vllm`] (`--engine vllm`, the
//! model engine-sim runs). One run and its figures in [`run`].

mod plot;
mod run;
mod sim;
mod trace;
mod vllm;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::Context as _;
use kvroute_core::policy::{ApproxPrefixConfig, KvrouteConfig, PolicyConfig, RandomConfig};
use serde::Serialize;

use run::{KeySource, PolicyResult, Setup, Vllm};
use trace::Trace;

/// Flags of `kvroute replay`.
#[derive(Clone, Debug, clap::Args)]
pub struct ReplayArgs {
    /// The trace: Mooncake JSON lines, plain or .gz.
    #[arg(long, value_name = "PATH")]
    trace: PathBuf,

    /// Replica counts to simulate, comma-separated.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "4,8,16", value_parser = clap::value_parser!(u32).range(1..=4096))]
    replicas: Vec<u32>,

    /// Share of the trace's distinct blocks the whole pool can cache (under
    /// `--engine vllm`, in engine blocks, unless `--num-gpu-blocks`).
    #[arg(long, value_name = "F", default_value_t = 0.3, value_parser = parse_fraction)]
    cache_frac: f64,

    /// The engine model: `simple` (an LRU cache and a FIFO prefill server
    /// per replica) or `vllm` (vLLM v1's scheduler: blocks on demand, a
    /// token budget per step with chunked prefill, preemption; the model
    /// kvroute-engine-sim runs).
    #[arg(long, value_name = "MODEL", default_value = "simple", value_parser = ["simple", "vllm"])]
    engine: String,

    /// `--engine vllm`: KV blocks per replica (default: from --cache-frac).
    #[arg(long, value_name = "B", value_parser = clap::value_parser!(u64).range(1..=MAX_GPU_BLOCKS))]
    num_gpu_blocks: Option<u64>,

    /// `--engine vllm`: tokens per engine block (vLLM --block-size).
    #[arg(long, value_name = "T", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    block_size: u64,

    /// `--engine vllm`: requests running at once per replica (vLLM
    /// --max-num-seqs), 1 to 4,294,967,295 as engine-sim takes it.
    #[arg(long, value_name = "S", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    max_num_seqs: u64,

    /// `--engine vllm`: tokens scheduled per step (vLLM
    /// --max-num-batched-tokens), 1 to 4,294,967,295 as engine-sim takes
    /// it.
    #[arg(long, value_name = "T", default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    max_num_batched_tokens: u64,

    /// Tokens per trace block id, 1 to 4,096 (as the router's
    /// `routing.blockSize`).
    #[arg(long, value_name = "T", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=MAX_BLOCK_TOKENS))]
    block_tokens: u64,

    /// Routing key: pK (hash of the first K block ids) or session.
    #[arg(long, value_name = "KEY", default_value = "p2")]
    key: KeySource,

    /// Policies to run: all, or a comma-separated list of names.
    #[arg(long, value_name = "LIST", default_value = "all")]
    policies: String,

    /// Router replicas the requests are spread over, round robin. Each
    /// knows only its own requests in flight.
    #[arg(long, value_name = "R", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    routers: u32,

    /// How late routers learn the replicas' cache contents and load
    /// reports, in milliseconds.
    #[arg(long, value_name = "L", default_value_t = 100, value_parser = clap::value_parser!(u32).range(0..=3_600_000))]
    report_lag_ms: u32,

    /// Rounds the trace's arrival times down to multiples of Q milliseconds
    /// (0: as recorded), so requests come in bursts at the same instant,
    /// as from batch jobs, agents fanning out or retries after an incident.
    #[arg(long, value_name = "Q", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=3_600_000))]
    quantize_arrivals_ms: u32,

    /// Prepends K blocks shared by every request of the trace, as a chat
    /// template's header is (0: the trace as recorded). Prompts grow by K ×
    /// --block-tokens tokens; a pK routing key covers the K blocks and its
    /// own K more.
    #[arg(long, value_name = "K", default_value_t = 0, value_parser = parse_shared_blocks)]
    shared_prefix_blocks: usize,

    /// The kvroute policy's `latencySlack` (default: the policy's own).
    #[arg(long, value_name = "S", value_parser = parse_slack)]
    latency_slack: Option<f64>,

    /// The kvroute policy's `admissionToleranceMs`, or `off` for no
    /// admission checks (default: the policy's own).
    #[arg(long, value_name = "MS", value_parser = parse_tolerance)]
    admission_tolerance_ms: Option<Tolerance>,

    /// Seed of the random policy.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,

    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "OUT")]
    json: Option<PathBuf>,

    /// Also plot hit rate against TTFT mean per policy and N, with kvroute's
    /// latency slack swept as a curve, to this .svg or .png file.
    #[arg(long, value_name = "OUT")]
    plot: Option<PathBuf>,
}

fn parse_slack(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f >= 0.0 => Ok(f),
        _ => Err("expected a number ≥ 0 (inf for no limit)".to_owned()),
    }
}

/// An engine's blocks at most, as engine-sim's `--num-gpu-blocks` takes
/// them.
const MAX_GPU_BLOCKS: u64 = 1 << 26;

/// Tokens per trace block at most: the router's bound on an engine block
/// (`routing.blockSize`), so a block's tokens times any block count here
/// fits a `u64` with room to spare.
const MAX_BLOCK_TOKENS: u64 = kvroute_core::hash::MAX_BLOCK_SIZE as u64;

/// At most this many shared blocks: 1,024 blocks of 512 tokens are half a
/// million tokens, past any template.
const MAX_SHARED_BLOCKS: usize = 1024;

fn parse_shared_blocks(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(k) if k <= MAX_SHARED_BLOCKS => Ok(k),
        _ => Err(format!(
            "expected a whole number of blocks from 0 to {MAX_SHARED_BLOCKS}"
        )),
    }
}

/// `--admission-tolerance-ms`: milliseconds, or no check.
#[derive(Clone, Copy, Debug)]
struct Tolerance(Option<f64>);

fn parse_tolerance(s: &str) -> Result<Tolerance, String> {
    match s {
        "off" => Ok(Tolerance(None)),
        _ => match s.parse::<f64>() {
            Ok(f) if f.is_finite() && f >= 0.0 => Ok(Tolerance(Some(f))),
            _ => Err("expected milliseconds ≥ 0, or off".to_owned()),
        },
    }
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err("expected a number in (0, 1]".to_owned()),
    }
}

/// Trace statistics and capacities, the `meta` of the JSON output.
#[derive(Debug, Serialize)]
struct Meta {
    trace: String,
    requests: usize,
    distinct_blocks: usize,
    input_tokens: u64,
    duration_s: f64,
    block_tokens: u64,
    cache_frac: f64,
    /// `simple` or `vllm`.
    engine: String,
    /// `--engine vllm`: the engines' settings (blocks per replica are in
    /// `capacities`).
    #[serde(skip_serializing_if = "Option::is_none")]
    vllm: Option<VllmMeta>,
    key: String,
    /// Router replicas.
    routers: u32,
    /// How late routers learn cache contents and load, milliseconds.
    report_lag_ms: u32,
    /// Arrivals rounded down to multiples of this, milliseconds (0: as
    /// recorded).
    quantize_arrivals_ms: u32,
    /// Distinct arrival times.
    instants: usize,
    /// Leading blocks prepended to every request (`--shared-prefix-blocks`).
    shared_prefix_blocks: usize,
    /// Hit rate of one cache that never evicts.
    infinite_hit: f64,
    /// Hit rate of one LRU cache of floor(cache_frac × D) blocks.
    pooled_hit: f64,
    /// Blocks per replica, by replica count.
    capacities: Vec<Capacity>,
}

#[derive(Debug, Serialize)]
struct VllmMeta {
    block_size: u64,
    max_num_seqs: u64,
    max_num_batched_tokens: u64,
    prefill_tokens_per_s: f64,
    prefill_overhead_ms: f64,
    itl_ms: f64,
}

#[derive(Debug, Serialize)]
struct Capacity {
    replicas: usize,
    blocks_per_replica: usize,
}

#[derive(Debug, Serialize)]
struct Output {
    meta: Meta,
    results: Vec<PolicyResult>,
}

/// The policies to run, configured for the replay: memories of cache
/// contents are sized like the replicas' caches, as an operator would.
fn policies(args: &ReplayArgs, capacity: usize) -> anyhow::Result<Vec<PolicyConfig>> {
    let names: Vec<&str> = if args.policies == "all" {
        PolicyConfig::NAMES.to_vec()
    } else {
        args.policies.split(',').map(str::trim).collect()
    };
    names
        .into_iter()
        .map(|name| {
            let config = PolicyConfig::by_name(name).with_context(|| {
                format!(
                    "unknown policy {name:?} in --policies (expected all or some of: {})",
                    PolicyConfig::NAMES.join(", ")
                )
            })?;
            Ok(match config {
                PolicyConfig::Random(_) => PolicyConfig::Random(RandomConfig { seed: args.seed }),
                PolicyConfig::ApproxPrefix(c) => PolicyConfig::ApproxPrefix(ApproxPrefixConfig {
                    capacity_blocks: capacity,
                    ..c
                }),
                PolicyConfig::Kvroute(_) => kvroute(capacity, args),
                other => other,
            })
        })
        .collect()
}

/// `kvroute` as the replay runs it: its memory sized like a replica's
/// cache, with the latency slack and admission tolerance given.
fn kvroute(capacity: usize, args: &ReplayArgs) -> PolicyConfig {
    let c = KvrouteConfig::default();
    PolicyConfig::Kvroute(KvrouteConfig {
        memory_blocks: capacity,
        latency_slack: args.latency_slack.unwrap_or(c.latency_slack),
        admission_tolerance_ms: args
            .admission_tolerance_ms
            .map_or(c.admission_tolerance_ms, |t| t.0),
        ..c
    })
}

/// Runs the replay and prints the tables to `out`.
pub fn run(args: &ReplayArgs, out: &mut impl Write) -> anyhow::Result<()> {
    // Fail on bad flags before any work.
    policies(args, 1)?;
    if let Some(path) = &args.plot {
        kvroute_plot::format(path)?;
    }
    let mut trace = Trace::load(&args.trace)?;
    trace.quantize(args.quantize_arrivals_ms);
    trace.share_prefix(args.shared_prefix_blocks, args.block_tokens)?;
    let distinct = trace.distinct_blocks();
    let pooled = (args.cache_frac * distinct as f64).floor() as usize;
    let is_vllm = args.engine == "vllm";
    // Blocks per replica, in the engine's blocks.
    let per_replica = |n: u32| match (is_vllm, args.num_gpu_blocks) {
        (false, _) => pooled / n as usize,
        (true, Some(b)) => b as usize,
        (true, None) => {
            let tokens = pooled as f64 * args.block_tokens as f64;
            (tokens / args.block_size as f64).floor() as usize / n as usize
        }
    };
    // The fewest replicas get the most blocks each; past what
    // --num-gpu-blocks takes, the engines' pools would not fit memory.
    let most = args.replicas.iter().min().map_or(0, |&n| per_replica(n));
    anyhow::ensure!(
        !is_vllm || most <= MAX_GPU_BLOCKS as usize,
        "--engine vllm: --cache-frac {} of {distinct} blocks of {} tokens is {most} engine blocks \
         per replica, over {MAX_GPU_BLOCKS}; pass --num-gpu-blocks or a smaller --cache-frac",
        args.cache_frac,
        args.block_tokens
    );
    let vllm = is_vllm.then(|| {
        let config = kvroute_core::engine::Config {
            block_size: args.block_size as usize,
            max_num_seqs: args.max_num_seqs as usize,
            max_num_batched_tokens: args.max_num_batched_tokens as usize,
            ..kvroute_core::engine::Config::default()
        };
        Vllm::new(&trace, config, args.block_tokens)
    });
    let first = trace.requests.first().map_or(0.0, |r| r.arrival_s);
    let last = trace.requests.last().map_or(0.0, |r| r.arrival_s);
    let meta = Meta {
        trace: args.trace.display().to_string(),
        requests: trace.requests.len(),
        distinct_blocks: distinct,
        input_tokens: trace.requests.iter().map(|r| r.input_length).sum(),
        duration_s: last - first,
        block_tokens: args.block_tokens,
        cache_frac: args.cache_frac,
        engine: args.engine.clone(),
        vllm: vllm.as_ref().map(|v| VllmMeta {
            block_size: args.block_size,
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            prefill_tokens_per_s: v.config.prefill_tokens_per_s,
            prefill_overhead_ms: v.config.prefill_overhead.as_secs_f64() * 1000.0,
            itl_ms: v.config.itl.as_secs_f64() * 1000.0,
        }),
        key: match args.key {
            KeySource::Prefix(k) => format!("p{k}"),
            KeySource::Session => "session".to_owned(),
        },
        routers: args.routers,
        report_lag_ms: args.report_lag_ms,
        quantize_arrivals_ms: args.quantize_arrivals_ms,
        instants: trace.instants(),
        shared_prefix_blocks: args.shared_prefix_blocks,
        infinite_hit: run::single_cache_hit(&trace, None, args.block_tokens),
        pooled_hit: run::single_cache_hit(&trace, Some(pooled), args.block_tokens),
        capacities: args
            .replicas
            .iter()
            .map(|&n| Capacity {
                replicas: n as usize,
                blocks_per_replica: per_replica(n),
            })
            .collect(),
    };
    writeln!(
        out,
        "trace {}: {} requests over {:.0} s, {} distinct blocks of {} tokens; key {}",
        meta.trace, meta.requests, meta.duration_s, distinct, args.block_tokens, meta.key
    )?;
    writeln!(
        out,
        "{} router(s), cache contents and load known {} ms late",
        args.routers, args.report_lag_ms
    )?;
    if args.quantize_arrivals_ms > 0 {
        writeln!(
            out,
            "arrivals rounded down to {} ms: {} distinct instants",
            args.quantize_arrivals_ms, meta.instants
        )?;
    }
    if args.shared_prefix_blocks > 0 {
        writeln!(
            out,
            "{} shared block(s) prepended to every request (a template's {} tokens)",
            args.shared_prefix_blocks,
            args.shared_prefix_blocks as u64 * args.block_tokens
        )?;
    }
    writeln!(
        out,
        "one cache: infinite hit {:.4}, pooled LRU of {} blocks (cache_frac {}) hit {:.4}",
        meta.infinite_hit, pooled, args.cache_frac, meta.pooled_hit
    )?;
    match &meta.vllm {
        None => writeln!(out, "engine simple: LRU cache and FIFO prefill per replica")?,
        Some(v) => writeln!(
            out,
            "engine vllm: blocks of {} tokens, max-num-seqs {}, max-num-batched-tokens {}, \
             prefill {} tokens/s + {} ms per step, steps of {} ms at least",
            v.block_size,
            v.max_num_seqs,
            v.max_num_batched_tokens,
            v.prefill_tokens_per_s,
            v.prefill_overhead_ms,
            v.itl_ms
        )?,
    }

    let progress = std::io::stderr().is_terminal();
    let mut results = Vec::new();
    let mut panels = Vec::new();
    for cap in &meta.capacities {
        let setup = Setup {
            block_tokens: args.block_tokens,
            key: args.key,
            capacity: cap.blocks_per_replica,
            routers: args.routers as usize,
            report_lag_s: f64::from(args.report_lag_ms) / 1000.0,
            vllm: vllm.clone(),
        };
        let configs = policies(args, cap.blocks_per_replica)?;
        let mut rows = Vec::new();
        for (i, config) in configs.iter().enumerate() {
            if progress {
                eprint!(
                    "\r\x1b[Kreplay: N={} policy {}/{}",
                    cap.replicas,
                    i + 1,
                    configs.len()
                );
            }
            rows.push(run::run(&trace, config, cap.replicas, &setup));
        }
        if progress {
            eprint!("\r\x1b[K");
        }
        print_table(out, cap, &rows)?;
        if args.plot.is_some() {
            let sweep = plot::SWEEP
                .iter()
                .map(|&slack| {
                    let config = kvroute(
                        cap.blocks_per_replica,
                        &ReplayArgs {
                            latency_slack: Some(slack),
                            ..args.clone()
                        },
                    );
                    (slack, run::run(&trace, &config, cap.replicas, &setup))
                })
                .collect();
            panels.push(plot::Panel {
                replicas: cap.replicas,
                rows: rows.clone(),
                sweep,
            });
        }
        results.extend(rows);
    }

    if let Some(path) = &args.json {
        let output = Output { meta, results };
        let json = serde_json::to_string_pretty(&output)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        writeln!(out, "\nwrote {}", path.display())?;
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "{}: {} router(s), report lag {} ms, cache_frac {}",
            args.trace.file_name().map_or_else(
                || args.trace.display().to_string(),
                |n| n.to_string_lossy().into_owned()
            ),
            args.routers,
            args.report_lag_ms,
            args.cache_frac
        );
        plot::write(path, &title, &panels)?;
        writeln!(out, "wrote {}", path.display())?;
    }
    Ok(())
}

fn print_table(out: &mut impl Write, cap: &Capacity, rows: &[PolicyResult]) -> anyhow::Result<()> {
    writeln!(
        out,
        "\nN = {} replicas, {} blocks each",
        cap.replicas, cap.blocks_per_replica
    )?;
    writeln!(
        out,
        "{:<20} {:>7} {:>9} {:>9} {:>10} {:>10} {:>7} {:>7} {:>8}",
        "policy", "hit", "req max/", "prefill", "TTFT mean", "TTFT p99", "spill", "keys", "hit dip"
    )?;
    writeln!(
        out,
        "{:<20} {:>7} {:>9} {:>9} {:>10} {:>10} {:>7} {:>7} {:>8}",
        "", "", "mean", "max/mean", "s", "s", "", "moved", ""
    )?;
    for r in rows {
        let spill = r.spill.map_or("-".to_owned(), |s| format!("{s:.3}"));
        writeln!(
            out,
            "{:<20} {:>7.4} {:>9.3} {:>9.3} {:>10.3} {:>10.3} {:>7} {:>7.3} {:>8.4}",
            r.policy,
            r.token_hit_rate,
            r.req_max_over_mean,
            r.prefill_max_over_mean,
            r.ttft_mean_s,
            r.ttft_p99_s,
            spill,
            r.keys_moved,
            r.hit_dip
        )?;
    }
    let refused: usize = rows.iter().map(|r| r.refused).sum();
    if refused > 0 {
        writeln!(
            out,
            "refused (never fit in {} blocks): {}",
            cap.blocks_per_replica,
            rows.iter()
                .map(|r| format!("{} {}", r.policy, r.refused))
                .collect::<Vec<_>>()
                .join(", ")
        )?;
    }
    Ok(())
}
