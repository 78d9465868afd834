//! `disaggregated`: one long-prompt load on 2 prefill + 4 decode pods,
//! disaggregated at `minUncachedTokens` 256, against 6 `both` pods
//! aggregated; the threshold swept at 0 and 1,024, the run at 0 with a
//! prefill pod killed three quarters in.
//!
//! The load: every session its own 2,048-token system prompt (its first
//! turn prefills it cold), later turns pasting 200 to 2,000 tokens of
//! context (documents, retrieved passages), replies of 64 tokens. A long
//! prefill on an engine that decodes stretches every decode step of that
//! batch (the suite's engines: 5 ms + 2,048 tokens at 20,000 a second,
//! about 100 ms, against 20 ms a token): disaggregation keeps those
//! prefills off the decode pods; the threshold decides which are long.
//!
//! Figures of each run, under its prefix: inter-token latency p99 and TTFT
//! p50 (clients' view, requests sent before any kill), the prefill cached
//! share (1 − prompt tokens the engines computed over the prompt tokens
//! served: a disaggregated request computes on its prefill pod, its
//! decode pod loads), how the routers served them
//! (`kvroute_disaggregated_requests_total` by result), requests per pod,
//! where a disaggregated request's TTFT goes (the prefill leg's mean, the
//! decode leg's mean share: the transfer's, with the decode pod's queue and
//! first step), and requests that failed.

use kvroute_telemetry::metrics;

use super::balance;
use super::flow::routers_metrics;
use super::load::{self, Outcome, Rotation, Sample, Shape};
use super::report::{self, Scenario};
use super::scenarios::{Ctx, at};
use super::system::{EngineSetup, Setup};

/// Pods in each run, and of those the prefill pods when disaggregated.
const PODS: usize = 6;
const PREFILL_PODS: usize = 2;
/// Each session's own system prompt, and its replies, in tokens.
const SYSTEM_TOKENS: usize = 2048;
const PASTED_TOKENS: (u64, u64) = (200, 2000);
const MAX_TOKENS: u64 = 64;

/// One run: its name, prefix, and `minUncachedTokens` (`None`:
/// aggregated), and whether a prefill pod is killed.
struct Run {
    name: &'static str,
    prefix: &'static str,
    threshold: Option<u64>,
    kill: bool,
}

const RUNS: [Run; 4] = [
    Run {
        name: "disaggregated-off",
        prefix: "aggregated_",
        threshold: None,
        kill: false,
    },
    Run {
        name: "disaggregated",
        prefix: "",
        threshold: Some(256),
        kill: false,
    },
    Run {
        name: "disaggregated-0",
        prefix: "t0_",
        threshold: Some(0),
        kill: true,
    },
    Run {
        name: "disaggregated-1024",
        prefix: "t1024_",
        threshold: Some(1024),
        kill: false,
    },
];

/// What one run measured.
struct Measured {
    itl_p99_ms: f64,
    ttft_p50_ms: f64,
    cached_share: f64,
    failed: usize,
}

pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let mut measured = Vec::new();
    for r in &RUNS {
        measured.push(one(ctx, s, r).await?);
    }
    let (aggregated, split) = (&measured[0], &measured[1]);
    s.goal(
        split.itl_p99_ms <= 0.7 * aggregated.itl_p99_ms,
        format!(
            "inter-token latency p99 ≥ 30 % lower disaggregated: {:.1} vs {:.1} ms",
            split.itl_p99_ms, aggregated.itl_p99_ms
        ),
    );
    s.goal(
        split.ttft_p50_ms <= 1.2 * aggregated.ttft_p50_ms,
        format!(
            "TTFT p50 within 1.2 × aggregated: {:.1} vs {:.1} ms",
            split.ttft_p50_ms, aggregated.ttft_p50_ms
        ),
    );
    s.goal(
        split.cached_share >= aggregated.cached_share,
        format!(
            "prefill cached share at least aggregated's: {:.3} vs {:.3}",
            split.cached_share, aggregated.cached_share
        ),
    );
    let killed = &measured[2];
    s.check(
        killed.failed == 0,
        format!(
            "a prefill pod killed under load (threshold 0): {} requests failed",
            killed.failed
        ),
    );
    Ok(())
}

/// Runs `r` on a fresh system: its figures into `s`.
async fn one(ctx: &Ctx, s: &mut Scenario, r: &Run) -> anyhow::Result<Measured> {
    let mut setup = Setup {
        engine: EngineSetup {
            num_gpu_blocks: 8192,
            ..EngineSetup::suite()
        },
        ..Setup::new(PODS)
    };
    if let Some(min) = r.threshold {
        setup.prefill_pods = Some(PREFILL_PODS);
        setup.disaggregate_from = Some(min);
    }
    let mut system = ctx.system(r.name, setup).await?;
    let standard = ctx.shape(PODS);
    let shape = Shape {
        groups: (standard.sessions_per_s * ctx.duration.as_secs_f64()).ceil() as usize,
        system_tokens: SYSTEM_TOKENS,
        pasted_tokens: PASTED_TOKENS,
        max_tokens: MAX_TOKENS,
        ..standard
    };
    let rotation = Rotation::new(system.router_addrs());
    let load = tokio::spawn(load::run(shape, rotation, system.t0));
    // The killed pod's engine counts stop with it: read them first.
    let mut computed_before_kill = 0.0;
    let mut kill_at = f64::INFINITY;
    if r.kill {
        kill_at = 0.75 * ctx.duration.as_secs_f64();
        at(&system, kill_at).await;
        computed_before_kill = system.engine_sum(0, COMPUTED).await?;
        system.mark("prefill pod killed");
        system.delete_pod(0);
    }
    let samples = load.await?;
    let logs = ctx.out.join("logs").join(r.name);
    load::write_samples(&logs.join("requests.jsonl"), &samples)?;
    let texts = routers_metrics(&system).await?;
    for (i, text) in texts.iter().enumerate() {
        std::fs::write(logs.join(format!("router-{i}.prom")), text)?;
    }
    let p = r.prefix;
    // Requests per pod: the pods that answer clients (decode pods when
    // disaggregated), and the legs each prefill pod served.
    let answering: Vec<String> = (0..PODS)
        .filter(|&k| system.role(k) != "prefill")
        .map(|k| system.pods[k].name.clone())
        .collect();
    balance::figures(s, p, &samples, &answering);
    let mut computed = computed_before_kill;
    for k in 0..PODS {
        if r.kill && k == 0 {
            continue;
        }
        computed += system.engine_sum(k, COMPUTED).await?;
        if system.role(k) == "prefill" {
            let legs = system.engine_requests(k).await? as f64;
            s.figure(&format!("{p}prefill_legs_{}", system.pods[k].name), legs);
        }
    }
    for (result, n) in served(&texts) {
        s.figure(&format!("{p}served_{result}"), n);
    }
    // Where a disaggregated request's TTFT goes: the prefill leg, then the
    // decode leg's first byte (the KV transfer, the decode pod's queue
    // and first step), as the routers measured them.
    let legs = total(&texts, "kvroute_prefill_leg_seconds_count");
    if legs > 0.0 {
        let leg_s = total(&texts, "kvroute_prefill_leg_seconds_sum") / legs;
        s.figure(&format!("{p}prefill_leg_mean_ms"), leg_s * 1e3);
        let share = "kvroute_kv_transfer_ttft_share";
        let mean = total(&texts, &format!("{share}_sum"))
            / total(&texts, &format!("{share}_count")).max(1.0);
        s.figure(&format!("{p}transfer_ttft_share_mean"), mean);
    }
    let ok = |x: &Sample| x.outcome == Outcome::Ok;
    let before: Vec<&Sample> = (samples.iter())
        .filter(|x| ok(x) && x.t + x.ttft.unwrap_or(0.0) < kill_at - 1.0)
        .collect();
    let mut itls: Vec<f64> = (before.iter())
        .flat_map(|x| x.itl.iter().copied())
        .collect();
    let mut ttfts: Vec<f64> = before.iter().filter_map(|x| x.ttft).collect();
    let prompt: u64 = (samples.iter().filter(|x| ok(x)))
        .map(|x| x.prompt_tokens)
        .sum();
    let m = Measured {
        itl_p99_ms: report::quantile(&mut itls, 0.99) * 1e3,
        ttft_p50_ms: report::quantile(&mut ttfts, 0.5) * 1e3,
        cached_share: 1.0 - computed / (prompt as f64).max(1.0),
        failed: samples.iter().filter(|x| x.outcome != Outcome::Ok).count(),
    };
    s.figure(&format!("{p}itl_p99_ms"), m.itl_p99_ms);
    s.figure(
        &format!("{p}itl_p50_ms"),
        report::quantile(&mut itls, 0.5) * 1e3,
    );
    s.figure(&format!("{p}ttft_p50_ms"), m.ttft_p50_ms);
    s.figure(
        &format!("{p}ttft_p99_ms"),
        report::quantile(&mut ttfts, 0.99) * 1e3,
    );
    s.figure(&format!("{p}prefill_cached_share"), m.cached_share);
    s.figure(&format!("{p}requests"), samples.len() as f64);
    s.figure(&format!("{p}failed"), m.failed as f64);
    Ok(m)
}

/// engine-sim's prompt tokens prefilled (not cached, not loaded).
const COMPUTED: &str = "kvroute_sim_computed_prompt_tokens_total";

/// The sum of `name`'s samples over the routers' metrics `texts`.
fn total(texts: &[String], name: &str) -> f64 {
    (texts.iter().flat_map(|t| t.lines()))
        .filter_map(metrics::parse_line)
        .filter(|m| m.name == name)
        .map(|m| m.value)
        .sum()
}

/// `kvroute_disaggregated_requests_total` by result, summed over the
/// routers' metrics `texts`.
fn served(texts: &[String]) -> Vec<(String, f64)> {
    let mut by: std::collections::BTreeMap<String, f64> = Default::default();
    for m in texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(metrics::parse_line)
    {
        if m.name == "kvroute_disaggregated_requests_total" {
            *by.entry(m.label("result").unwrap_or_default().to_owned())
                .or_default() += m.value;
        }
    }
    by.into_iter().collect()
}
