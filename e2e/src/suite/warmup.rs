//! `warmup`: a named 1,500-token prefix on 4 pods of the suite's small
//! caches, under the standard load (which cycles an engine's free blocks in
//! seconds), asked for every 10 s: with `routing.warmup` warming it every
//! 2 s against without. Then a template rollout: a second prefix (the new
//! template) was added to the warm-ups before its first request, and 10
//! requests with it follow one a second.
//!
//! `warmup_saturated` (figures `sat_`) is the same with warm-ups under
//! three times the load, the engines' queues past the policy's slack: how
//! the busy skip and the budget hold warm-ups back in a saturated pool.
//!
//! Figures of each run (`off_` without warm-ups): each probe's cached share
//! of the prefix (cached tokens over the prefix's full blocks, at most 1),
//! their minimum and mean, the new template's first 10 requests' minimum,
//! warm-ups by result, and warm-ups' share of all prefill (the routers'
//! `kvroute_warmup_prefill_tokens_total` over the engines' computed prompt
//! tokens).

use std::time::Duration;

use kvroute_core::rng::SplitMix64;
use kvroute_core::tokenize::Tokenizer;
use kvroute_telemetry::metrics;
use serde_json::json;

use super::load::{self, Outcome, Rotation};
use super::report::Scenario;
use super::scenarios::{Ctx, at};
use super::system::{EngineSetup, MODEL, Setup};

const PODS: usize = 4;
/// Each engine's cache, blocks of 16 tokens: the standard load cycles its
/// free blocks in a few seconds, longer than the warm-ups' period and
/// shorter than the requests' with the prefix.
const NUM_GPU_BLOCKS: u32 = 512;
/// The prefixes' length, tokens.
const PREFIX_TOKENS: usize = 1500;
/// How long the standard load runs, seconds.
const LOAD_S: f64 = 50.0;
/// The old template's probes: from this second, every [`PROBE_EVERY_S`].
const FIRST_PROBE_S: f64 = 15.0;
const PROBE_EVERY_S: f64 = 10.0;
const PROBES: usize = 3;
/// The new template's requests, one a second from this second.
const ROLLOUT_S: f64 = 38.0;
const ROLLOUT_REQUESTS: usize = 10;
/// The warm-ups' budget in the scenario.
const MAX_SHARE: f64 = 0.05;

/// What one run measured.
struct Measured {
    probes: Vec<f64>,
    rollout: Vec<f64>,
}

pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let off = one(ctx, s, Run::Off).await?;
    let on = one(ctx, s, Run::On).await?;
    let rollout = format!("the new template's first {ROLLOUT_REQUESTS} requests find");
    let goals = [
        (
            "every request with the prefix finds",
            &on.probes,
            &off.probes,
        ),
        (rollout.as_str(), &on.rollout, &off.rollout),
    ];
    for (what, with, without) in goals {
        let (with, without) = (min(with), min(without));
        s.goal(
            with >= 0.9,
            format!(
                "with warm-ups {what} ≥ 0.9 of it cached: min {with:.2} (without: min {without:.2})"
            ),
        );
    }
    Ok(())
}

/// `warmup_saturated`: the budget's effect on a saturated pool, figures
/// and the budget's goal only.
pub async fn saturated(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    one(ctx, s, Run::Saturated).await.map(drop)
}

/// The smallest of `v`.
fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The prefix `name`'s text: its own words, about [`PREFIX_TOKENS`] tokens.
fn prefix(name: &str, seed: u64) -> String {
    let start = format!("You are the {name} support assistant. Follow these instructions exactly.");
    load::text(
        &mut SplitMix64::new(seed),
        &Tokenizer::builtin(),
        &start,
        PREFIX_TOKENS,
    )
}

/// One run of the scenario.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    /// Without warm-ups.
    Off,
    /// With warm-ups.
    On,
    /// With warm-ups, under [`SATURATED_LOAD`] times the standard load.
    Saturated,
}

/// The saturated run's load, times the standard load: the engines' queues
/// stay above the policy's slack.
const SATURATED_LOAD: f64 = 3.0;

/// Runs the load with probes, warm-ups on or not: its figures into `s`.
async fn one(ctx: &Ctx, s: &mut Scenario, run: Run) -> anyhow::Result<Measured> {
    let warm = run != Run::Off;
    let (old, new) = (prefix("v3", 31), prefix("v4", 43));
    let mut setup = Setup {
        routers: 1,
        engine: EngineSetup {
            num_gpu_blocks: NUM_GPU_BLOCKS,
            ..EngineSetup::suite()
        },
        ..Setup::new(PODS)
    };
    let (name, p) = match run {
        Run::Off => ("warmup-off", "off_"),
        Run::On => ("warmup", ""),
        Run::Saturated => ("warmup-saturated", "sat_"),
    };
    if warm {
        let entry = |name: &str, text: &str| json!({"name": name, "messages": [{"role": "system", "content": text}]});
        let warmup = json!({"warmup": {
            "everySeconds": 2,
            "maxShareOfPrefill": MAX_SHARE,
            "prefixes": [entry("support-v3", &old), entry("support-v4", &new)],
        }});
        // JSON is YAML.
        setup.router_yaml = format!("routing: {}\n", serde_json::to_string(&warmup)?);
    }
    let system = ctx.system(name, setup).await?;
    let mut shape = ctx.shape(PODS);
    shape.duration = Duration::from_secs_f64(LOAD_S);
    if run == Run::Saturated {
        shape.sessions_per_s *= SATURATED_LOAD;
    }
    let rotation = Rotation::new(system.router_addrs());
    let load = tokio::spawn(load::run(shape, rotation, system.t0));
    let client = reqwest::Client::new();
    let router = system.router_addrs()[0];
    let ask = async |system_text: &str, i: usize| {
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "system", "content": system_text},
                         {"role": "user", "content": format!("Question {i}: how do I reset my password?")}],
            "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true},
        });
        let (sample, _) = load::chat(&client, router, &body, &[], system.t0).await;
        let full = (PREFIX_TOKENS / 16 * 16) as f64;
        let share = match sample.outcome {
            Outcome::Ok => (sample.cached_tokens as f64 / full).min(1.0),
            _ => 0.0,
        };
        (share, sample)
    };
    let mut samples = Vec::new();
    let mut probes = Vec::new();
    for k in 0..PROBES {
        at(&system, FIRST_PROBE_S + k as f64 * PROBE_EVERY_S).await;
        let (share, sample) = ask(&old, k).await;
        s.figure(&format!("{p}probe_{k}_cached_share"), share);
        probes.push(share);
        samples.push(sample);
    }
    let mut rollout = Vec::new();
    for k in 0..ROLLOUT_REQUESTS {
        at(&system, ROLLOUT_S + k as f64).await;
        let (share, sample) = ask(&new, 100 + k).await;
        rollout.push(share);
        samples.push(sample);
    }
    let background = load.await?;
    let logs = ctx.out.join("logs").join(name);
    load::write_samples(&logs.join("probes.jsonl"), &samples)?;
    load::write_samples(&logs.join("requests.jsonl"), &background)?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    s.figure(&format!("{p}probe_cached_share_min"), min(&probes));
    s.figure(&format!("{p}probe_cached_share_mean"), mean(&probes));
    s.figure(&format!("{p}rollout_cached_share_min"), min(&rollout));
    s.figure(&format!("{p}rollout_cached_share_mean"), mean(&rollout));
    let text = system.router_metrics(0).await?;
    std::fs::write(logs.join("router-0.prom"), &text)?;
    let mut computed = 0.0;
    for k in 0..PODS {
        computed += system
            .engine_sum(k, "kvroute_sim_computed_prompt_tokens_total")
            .await?;
    }
    let (mut warmup_tokens, mut by_result) = (0.0, std::collections::BTreeMap::new());
    for m in text.lines().filter_map(metrics::parse_line) {
        match m.name {
            "kvroute_warmup_prefill_tokens_total" => warmup_tokens += m.value,
            "kvroute_warmups_total" => {
                let result = m.label("result").unwrap_or_default().to_owned();
                *by_result.entry(result).or_insert(0.0) += m.value;
            }
            _ => {}
        }
    }
    for (result, n) in by_result {
        s.figure(&format!("{p}warmups_{result}"), n);
    }
    if warm {
        let share = warmup_tokens / computed.max(1.0);
        s.figure(&format!("{p}warmup_prefill_share"), share);
        s.goal(
            share <= MAX_SHARE,
            format!(
                "{p}warm-ups' prefill ≤ maxShareOfPrefill ({MAX_SHARE}) of all prefill: {share:.4}"
            ),
        );
    }
    s.figure(&format!("{p}requests"), background.len() as f64);
    s.figure(
        &format!("{p}failed"),
        background
            .iter()
            .filter(|x| x.outcome != Outcome::Ok)
            .count() as f64,
    );
    Ok(Measured { probes, rollout })
}
