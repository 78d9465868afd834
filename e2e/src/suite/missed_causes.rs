//! `missed_causes`: each cause of a missed prompt token injected on a small
//! system of its own, and the share of that phase's missed tokens the
//! routers attribute to it ([`super::missed`]).
//!
//! The phases, each measuring the routers' counters over its measured part:
//!
//! 1. **cold**: 2 pods; prompts no engine has seen.
//! 2. **evicted**: 2 pods of 64 blocks (1,024 tokens) each; 8 distinct
//!    prompts of 40 blocks sent round after round, so each is evicted
//!    before it comes back (320 blocks against 128). The first round warms
//!    up; the next two are measured.
//! 3. **routed_elsewhere**: 2 pods; prompts warmed on pod-0 (sent to its
//!    engine, not through a router), then pod-0 made busy (requests sent
//!    straight to its engine, 4 running and the rest queued) until both
//!    routers rank pod-1 first; then the warm prompts through the routers.
//! 4. **diverged**: 2 pods; one 60-block system prompt with a fixed-width
//!    timestamp on its first line, a new timestamp per request. The first
//!    request each router sees is `cold` by definition, so 60 requests.
//! 5. **contract**: one pod, its blocks of 32 tokens where the policy says 16;
//!    measured once both routers mark its contract a mismatch.
//! 6. **engine_shortfall**: one pod whose engine waits 1 s before
//!    admitting a request; a prompt warmed on it (straight to its engine)
//!    until the routers' index holds it, then sent through a router, and
//!    the engine's cache reset once that router has routed it (its
//!    `kvroute_routed_total` moved) and before the engine admits it.
//!
//! Goal per phase: at least [`GOAL_SHARE`] of the missed tokens other than
//! `partial_block` attributed to the injected cause. Checks: every
//! measured request succeeds and every phase missed some tokens (else it
//! measured nothing). Waits poll conditions; none sleeps a fixed time.

use std::time::Duration;

use anyhow::Context as _;
use kvroute_core::rng::SplitMix64;
use kvroute_core::tokenize::Tokenizer;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::load::{self, Outcome, Sample};
use super::missed::{CAUSES, Missed, sum};
use super::report::Scenario;
use super::scenarios::Ctx;
use super::system::{EngineSetup, MODEL, Setup, System, pod_name};

/// The phases, each named for the cause it injects.
pub const PHASES: [&str; 6] = [
    "cold",
    "evicted",
    "routed_elsewhere",
    "diverged",
    "contract",
    "engine_shortfall",
];

/// The goal: this share of a phase's missed tokens other than
/// `partial_block` attributed to its cause.
pub const GOAL_SHARE: f64 = 0.95;

/// How long any one condition is waited for.
const WAIT: Duration = Duration::from_secs(10);

/// Runs every phase into `s`: figures `<phase>_<cause>_share`,
/// `<phase>_attributed_share`, `<phase>_missed_tokens`, a goal and checks
/// per phase, and the table in `s.text`.
pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for phase in PHASES {
        let started = std::time::Instant::now();
        let name = format!("missed_causes-{phase}");
        let measured = match phase {
            "cold" => cold(ctx, &name).await,
            "evicted" => evicted(ctx, &name).await,
            "routed_elsewhere" => routed_elsewhere(ctx, &name).await,
            "diverged" => diverged(ctx, &name).await,
            "contract" => contract(ctx, &name).await,
            "engine_shortfall" => engine_shortfall(ctx, &name).await,
            other => anyhow::bail!("no phase {other:?}"),
        };
        s.figure(&format!("{phase}_s"), started.elapsed().as_secs_f64());
        match measured {
            Ok(Measured {
                system,
                missed,
                sent,
            }) => {
                let samples: Vec<Sample> = sent.iter().map(|x| x.sample.clone()).collect();
                if !record(s, phase, &missed, &samples) {
                    diagnose(s, phase, &system, &sent).await;
                }
                rows.push((phase, missed));
            }
            // One phase that could not run does not hide the others.
            Err(e) => s.check(false, format!("{phase}: the phase runs: {e:#}")),
        }
    }
    s.text = table(&rows);
    Ok(())
}

/// Figures, goal and checks of one phase; whether it met its goal.
fn record(s: &mut Scenario, phase: &str, missed: &Missed, samples: &[Sample]) -> bool {
    for cause in CAUSES {
        s.figure(&format!("{phase}_{cause}_share"), missed.share(cause));
    }
    let attributed = missed.attributed(phase);
    s.figure(&format!("{phase}_attributed_share"), attributed);
    s.figure(&format!("{phase}_missed_tokens"), missed.total());
    s.figure(&format!("{phase}_unreported_tokens"), missed.unreported);
    if phase == "routed_elsewhere" {
        for (reason, tokens) in &missed.elsewhere_by_reason {
            s.figure(&format!("routed_elsewhere_{reason}_tokens"), *tokens);
        }
    }
    let failed = samples.iter().filter(|x| x.outcome != Outcome::Ok).count();
    s.check(
        failed == 0,
        format!(
            "{phase}: every measured request succeeds: {failed} of {} failed",
            samples.len()
        ),
    );
    let sent: u64 = samples
        .iter()
        .map(|x| x.prompt_tokens.saturating_sub(x.cached_tokens))
        .sum();
    s.check(
        missed.total() > 0.0,
        format!(
            "{phase}: the routers count missed tokens: {:.0} (the engines reported {sent})",
            missed.total()
        ),
    );
    let top = CAUSES
        .iter()
        .filter(|c| **c != "partial_block")
        .max_by(|a, b| missed.tokens(a).total_cmp(&missed.tokens(b)))
        .copied()
        .unwrap_or("none");
    s.goal(
        attributed >= GOAL_SHARE,
        format!(
            "{phase}: ≥ {:.0} % of the missed tokens other than partial_block attributed to {phase}: {:.1} % (largest cause {top}, {:.1} %)",
            GOAL_SHARE * 100.0,
            attributed * 100.0,
            missed.share(top) * 100.0,
        ),
    );
    attributed >= GOAL_SHARE
}

/// Requests noted when a phase misses its goal.
const DIAGNOSED: usize = 3;

/// Notes the routers' records (`/debug/requests/{id}`) of the
/// [`DIAGNOSED`] requests of `phase` with the most missed tokens of
/// another cause than the phase's and `partial_block`: which cause took
/// them, and what the router expected there.
async fn diagnose(s: &mut Scenario, phase: &str, system: &System, sent: &[Sent]) {
    let mut others = Vec::new();
    for x in sent {
        let Ok(r) = system.recorded(x.router, &x.id).await else {
            continue;
        };
        let other: u64 = (r["missed"].as_array().into_iter().flatten())
            .filter(|m| !matches!(m[0].as_str(), Some(c) if c == phase || c == "partial_block"))
            .filter_map(|m| m[1].as_u64())
            .sum();
        if other > 0 {
            others.push((other, x, r));
        }
    }
    others.sort_by_key(|(other, ..)| std::cmp::Reverse(*other));
    let count = others.len();
    for (_, x, r) in others.into_iter().take(DIAGNOSED) {
        s.notes.push(format!(
            "{phase}: {} on router-{}: endpoint {}, prompt {} tokens, expected cached {}, cached {}, missed {}{} (of {count} requests with other causes)",
            x.id,
            x.router,
            r["endpoint"].as_str().unwrap_or("?"),
            r["prompt_tokens"],
            r["expected_cached_tokens"],
            r["cached_tokens"],
            r["missed"],
            r["routed_elsewhere_reason"]
                .as_str()
                .map(|w| format!(" (elsewhere: {w})"))
                .unwrap_or_default(),
        ));
    }
}

/// Phase × cause shares of the missed tokens, the injected cause's share
/// of those outside `partial_block`, and the missed tokens.
pub fn table(rows: &[(&str, Missed)]) -> Vec<String> {
    let short = |c: &str| {
        match c {
            "partial_block" => "partial",
            "routed_elsewhere" => "elsewhere",
            "engine_shortfall" => "shortfall",
            other => other,
        }
        .to_owned()
    };
    let mut header = format!("{:<17}", "phase");
    for cause in CAUSES {
        header += &format!(" {:>9}", short(cause));
    }
    header += &format!(" {:>10} {:>8}", "attributed", "missed");
    let mut lines = vec![header];
    for (phase, m) in rows {
        let mut line = format!("{phase:<17}");
        for cause in CAUSES {
            line += &format!(" {:>8.1}%", m.share(cause) * 100.0);
        }
        line += &format!(" {:>9.1}% {:>8.0}", m.attributed(phase) * 100.0, m.total());
        lines.push(line);
    }
    lines
}

/// A streamed chat request with usage, `max_tokens` 2.
fn chat_body(messages: Value) -> Value {
    json!({
        "model": MODEL,
        "messages": messages,
        "max_tokens": 2,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// `n` prompts of about `tokens` tokens starting `label`, from `seed`:
/// distinct from each other and, with another label, from any other
/// phase's.
fn prompts(label: &str, seed: u64, n: usize, tokens: usize) -> Vec<Value> {
    let tokenizer = Tokenizer::builtin();
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|i| {
            let text = load::text(&mut rng, &tokenizer, &format!("{label} {i}:"), tokens);
            chat_body(json!([{"role": "user", "content": text}]))
        })
        .collect()
}

/// A request a phase measured: how it went, and where to ask about it.
#[derive(Debug)]
struct Sent {
    sample: Sample,
    /// The router it went through.
    router: usize,
    /// Its `x-request-id`.
    id: String,
}

/// Sends `body` through router `i` as request `id`.
async fn send(system: &System, i: usize, body: &Value, id: String) -> Sent {
    let client = reqwest::Client::new();
    let addr = system.router_addrs()[i];
    let headers = [("x-request-id", id.as_str())];
    let (sample, _) = load::chat(&client, addr, body, &headers, system.t0).await;
    Sent {
        sample,
        router: i,
        id,
    }
}

/// Sends `bodies` one after the other, to the routers in turn, with ids
/// `<tag>-<n>`.
async fn through_routers(system: &System, tag: &str, bodies: &[Value]) -> Vec<Sent> {
    let mut sent = Vec::new();
    for (n, body) in bodies.iter().enumerate() {
        sent.push(send(system, n % 2, body, format!("{tag}-{n}")).await);
    }
    sent
}

/// Sends `bodies` to pod `k`'s engine, bypassing the routers, one after
/// the other; fails if one fails.
async fn to_engine(system: &System, k: usize, bodies: &[Value]) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    for body in bodies {
        let (sample, _) = load::chat(&client, system.engine_addr(k), body, &[], system.t0).await;
        anyhow::ensure!(
            sample.outcome == Outcome::Ok,
            "a request straight to pod-{k}'s engine: {:?}",
            sample.outcome
        );
    }
    Ok(())
}

/// What router `i` explains of `body`: pod `k`'s cached blocks, the
/// prompt's tokens and the endpoint ranked first.
async fn explained(
    system: &System,
    i: usize,
    body: &Value,
    k: usize,
) -> Option<(u64, u64, String)> {
    let e = system.explain(i, body, &[]).await.ok()?;
    let name = format!("pod-{k}");
    let blocks = e["decision"]["endpoints"]
        .as_array()?
        .iter()
        .find(|x| pod_name(x["name"].as_str().unwrap_or("")) == name)?["cached_blocks"]
        .as_u64()?;
    let first = pod_name(e["decision"]["ranked"][0].as_str()?).to_owned();
    Some((blocks, e["prompt_tokens"].as_u64()?, first))
}

/// Waits until both routers' index holds `body`'s prompt on pod `k`, to
/// its last full block but one (the engine computes a prompt's last token
/// whatever it holds).
async fn wait_held(system: &System, body: &Value, k: usize) -> anyhow::Result<()> {
    system
        .wait_for(
            &format!("both routers to see pod-{k} hold a prompt"),
            WAIT,
            async || {
                for i in 0..2 {
                    let (blocks, tokens, _) = explained(system, i, body, k).await?;
                    if blocks + 1 < tokens / 16 {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await?;
    Ok(())
}

/// A system for `name`, and the routers' counters at its start.
async fn start(ctx: &Ctx, name: &str, setup: Setup) -> anyhow::Result<(System, Missed)> {
    let system = ctx.system(name, setup).await?;
    let start = Missed::read(&system).await?;
    Ok((system, start))
}

/// What a phase measured: the routers' counters' change over its
/// measured part and its requests, on the system it ran on (kept for
/// [`diagnose`]).
struct Measured {
    system: System,
    missed: Missed,
    sent: Vec<Sent>,
}

impl Measured {
    /// The counters' change on `system` since `start`.
    async fn since(system: System, start: &Missed, sent: Vec<Sent>) -> anyhow::Result<Measured> {
        let missed = Missed::read(&system).await?.since(start);
        Ok(Measured {
            system,
            missed,
            sent,
        })
    }
}

async fn cold(ctx: &Ctx, name: &str) -> anyhow::Result<Measured> {
    let (system, start) = start(ctx, name, Setup::new(2)).await?;
    let sent = through_routers(&system, "cold", &prompts("Cold", 0xc01d, 20, 300)).await;
    Measured::since(system, &start, sent).await
}

async fn evicted(ctx: &Ctx, name: &str) -> anyhow::Result<Measured> {
    let setup = Setup {
        engine: EngineSetup {
            num_gpu_blocks: 64,
            max_model_len: 1024,
            ..EngineSetup::suite()
        },
        ..Setup::new(2)
    };
    let system = ctx.system(name, setup).await?;
    let bodies = prompts("Evicted", 0xe71c, 8, 640);
    through_routers(&system, "evicted-warm-up", &bodies).await;
    let start = Missed::read(&system).await?;
    let mut sent = through_routers(&system, "evicted-2", &bodies).await;
    sent.extend(through_routers(&system, "evicted-3", &bodies).await);
    Measured::since(system, &start, sent).await
}

async fn routed_elsewhere(ctx: &Ctx, name: &str) -> anyhow::Result<Measured> {
    // Room for the warm prompts and every busy request: nothing is evicted.
    let setup = Setup {
        engine: EngineSetup {
            num_gpu_blocks: 8192,
            max_num_seqs: 4,
            ..EngineSetup::suite()
        },
        ..Setup::new(2)
    };
    let system = ctx.system(name, setup).await?;
    let warm = prompts("Warm", 0x3a53, 6, 1200);
    to_engine(&system, 0, &warm).await?;
    for body in &warm {
        wait_held(&system, body, 0).await?;
    }
    // Busy: 4 long replies running, the rest queued behind them.
    let mut busy = JoinSet::new();
    let client = reqwest::Client::new();
    for mut body in prompts("Busy", 0xb05e, 40, 1000) {
        body["max_tokens"] = json!(500);
        let (client, addr, t0) = (client.clone(), system.engine_addr(0), system.t0);
        busy.spawn(async move { load::chat(&client, addr, &body, &[], t0).await });
    }
    system
        .wait_for(
            "both routers to rank pod-1 first for a warm prompt",
            WAIT,
            async || {
                for i in 0..2 {
                    let (_, _, first) = explained(&system, i, &warm[0], 0).await?;
                    if first != "pod-1" {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await?;
    let start = Missed::read(&system).await?;
    let sent = through_routers(&system, "routed_elsewhere", &warm).await;
    let measured = Measured::since(system, &start, sent).await;
    busy.abort_all();
    measured
}

/// `n` timestamps, one a minute from 17:00:00 on 2026-12-02, ISO 8601 to
/// the second: the same width, so the same number of tokens.
pub fn timestamps(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let (h, m, sec) = (17 + i / 60, i % 60, (i * 7) % 60);
            format!("2026-12-02T{h:02}:{m:02}:{sec:02}Z")
        })
        .collect()
}

/// The diverged phase's requests: one long system prompt under a new
/// timestamp each, the same question.
pub fn timestamped(n: usize) -> Vec<Value> {
    let tokenizer = Tokenizer::builtin();
    let mut rng = SplitMix64::new(0xd17e);
    let rest = load::text(&mut rng, &tokenizer, "You are the support assistant.", 960);
    timestamps(n)
        .into_iter()
        .map(|ts| {
            chat_body(json!([
                {"role": "system", "content": format!("Current time: {ts}\n{rest}")},
                {"role": "user", "content": "What is the refund policy?"},
            ]))
        })
        .collect()
}

async fn diverged(ctx: &Ctx, name: &str) -> anyhow::Result<Measured> {
    let (system, start) = start(ctx, name, Setup::new(2)).await?;
    let sent = through_routers(&system, "diverged", &timestamped(60)).await;
    Measured::since(system, &start, sent).await
}

async fn contract(ctx: &Ctx, name: &str) -> anyhow::Result<Measured> {
    // Blocks of 32 tokens where the policy says 16.
    let setup = Setup {
        odd_pod: Some(0),
        odd_block_size: Some(32),
        ..Setup::new(1)
    };
    let system = ctx.system(name, setup).await?;
    // The routers learn an engine's contract from what it publishes.
    to_engine(&system, 0, &prompts("Contract warm-up", 0xc0de, 1, 100)).await?;
    system
        .wait_for("both routers to mark pod-0 a mismatch", WAIT, async || {
            system
                .on_both_routers(|e| e.iter().all(|e| e.contract == "mismatch"))
                .await
        })
        .await?;
    let start = Missed::read(&system).await?;
    let sent = through_routers(&system, "contract", &prompts("Contract", 0xc0df, 16, 300)).await;
    Measured::since(system, &start, sent).await
}

/// Engine-sim's delay before admitting a request in the
/// `engine_shortfall` phase: the time to see the router's decision and
/// reset the engine's cache.
const SHORTFALL_DELAY_MS: u64 = 1000;

async fn engine_shortfall(ctx: &Ctx, name: &str) -> anyhow::Result<Measured> {
    let setup = Setup {
        engine: EngineSetup {
            extra_latency_ms: SHORTFALL_DELAY_MS,
            ..EngineSetup::suite()
        },
        ..Setup::new(1)
    };
    let (system, start) = start(ctx, name, setup).await?;
    let mut sent = Vec::new();
    for (n, body) in prompts("Shortfall", 0x5f0a, 4, 640).into_iter().enumerate() {
        let i = n % 2;
        to_engine(&system, 0, std::slice::from_ref(&body)).await?;
        wait_held(&system, &body, 0).await?;
        let routed = async || {
            let text = system.router_metrics(i).await.ok()?;
            Some(sum(&text, "kvroute_routed_total"))
        };
        let before = routed().await.context("router metrics")?;
        let request = send(&system, i, &body, format!("engine_shortfall-{n}"));
        let reset = async {
            system
                .wait_for("the router to route the request", WAIT, async || {
                    (routed().await? > before).then_some(())
                })
                .await?;
            // Before the engine admits it: refused once it runs.
            system
                .reset_prefix_cache(0)
                .await
                .context("resetting the engine's cache within its admission delay")
        };
        let (x, reset) = tokio::join!(request, reset);
        reset?;
        sent.push(x);
    }
    Measured::since(system, &start, sent).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamped_prompts_differ_only_in_the_timestamp_and_have_one_length() {
        let bodies = timestamped(60);
        let template = kvroute_core::tokenize::Tokenizer::builtin();
        let lengths: Vec<usize> = bodies
            .iter()
            .map(|b| {
                let system = b["messages"][0]["content"].as_str().unwrap();
                template.encode(system, false).unwrap().len()
            })
            .collect();
        assert!(lengths.iter().all(|n| *n == lengths[0]), "{lengths:?}");
        // At least 10 full blocks after the first line.
        assert!(lengths[0] >= 60 * 16, "{}", lengths[0]);
        let distinct: std::collections::BTreeSet<String> =
            bodies.iter().map(|b| b.to_string()).collect();
        assert_eq!(distinct.len(), 60);
    }

    #[test]
    fn the_table_has_a_row_per_phase_and_the_attributed_share() {
        let m = Missed::parse(
            "kvroute_missed_prompt_tokens_total{cause=\"cold\"} 95\n\
             kvroute_missed_prompt_tokens_total{cause=\"unknown\"} 5\n\
             kvroute_missed_prompt_tokens_total{cause=\"partial_block\"} 100\n",
        );
        let lines = table(&[("cold", m)]);
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("attributed") && lines[0].contains("shortfall"));
        assert!(lines[1].starts_with("cold"));
        assert!(lines[1].contains("95.0%"), "{}", lines[1]);
        assert!(lines[1].trim_end().ends_with("200"), "{}", lines[1]);
    }
}
