//! Flow control under more load than the pool serves: `overload` (a
//! priority stream beside a flood) and `noisy_tenant` (one tenant sending
//! five times its share). Each is measured with flow control on and, for
//! comparison, off (`flowControl.enabled: false`: every request committed
//! to an engine on arrival), over fresh pods each run.

use std::collections::BTreeMap;

use kvroute_telemetry::metrics;

use super::balance;
use super::load::{self, Outcome, Rotation, Sample, Shape};
use super::report::{self, Scenario};
use super::scenarios::Ctx;
use super::system::{EngineSetup, ITL_MS, NUM_GPU_BLOCKS, Setup, System, TENANT_HEADER};

/// Pods in both scenarios.
const PODS: usize = 4;
/// The objective the priority stream names, and its priority.
const OBJECTIVES: &str = "objectives: [{name: interactive, priority: 10}]\n";
/// Held requests give up after this (below the load's 60 s client
/// timeout): the flood's share of them gets 429.
const FLOW: &str = "flowControl: {maxWaitMs: 10000}\n";
const FLOW_OFF: &str = "flowControl: {enabled: false}\n";
/// Tenants named by the tenant header, shared caches.
const TENANCY: &str = "tenancy: {mode: shared, tenantHeader: x-tenant}\n";

/// The standard load's session rate, times `times`, with `headers`.
fn stream(
    ctx: &Ctx,
    times: f64,
    seed: u64,
    headers: &'static [(&'static str, &'static str)],
) -> Shape {
    let standard = ctx.shape(PODS);
    Shape {
        sessions_per_s: standard.sessions_per_s * times,
        seed,
        headers,
        ..standard
    }
}

/// Runs `shapes` at once through a fresh system whose routers get `yaml`;
/// the samples of each shape. The fleet's view is kept beside the logs:
/// each shape's requests (`requests-<label>.jsonl`) and its slowest with
/// their routers' records (`slowest-<label>.jsonl`), each router's
/// metrics at the end (`router-<i>.prom`), and, under `prefix`, the
/// balance of all requests over the pods and the queue's figures.
async fn run(
    ctx: &Ctx,
    s: &mut Scenario,
    (name, prefix): (&str, &str),
    yaml: String,
    shapes: &[(&str, Shape)],
) -> anyhow::Result<Vec<Vec<Sample>>> {
    let setup = Setup {
        router_yaml: yaml,
        ..Setup::new(PODS)
    };
    let system = ctx.system(name, setup).await?;
    let rotation = Rotation::new(system.router_addrs());
    let runs = shapes
        .iter()
        .map(|&(_, shape)| load::run(shape, rotation.clone(), system.t0));
    let samples = futures_util::future::join_all(runs).await;
    let logs = ctx.out.join("logs").join(name);
    for ((label, _), samples) in shapes.iter().zip(&samples) {
        load::write_samples(&logs.join(format!("requests-{label}.jsonl")), samples)?;
        let slowest = slowest(&system, samples, SLOWEST).await;
        std::fs::write(logs.join(format!("slowest-{label}.jsonl")), slowest)?;
    }
    let texts = routers_metrics(&system).await?;
    for (i, text) in texts.iter().enumerate() {
        std::fs::write(logs.join(format!("router-{i}.prom")), text)?;
    }
    balance::figures(s, prefix, &samples.concat(), &system.pod_names());
    queue_figures(s, prefix, &texts);
    Ok(samples)
}

/// The three runs of scenario `name`, its routers' YAML `yaml` followed
/// by a `flowControl:` block: the first `count` of `shapes` with flow
/// control (logs under `<name>-<suffix>`), all of `shapes` with it, and
/// all without it (`<name>-unheld`).
async fn runs(
    ctx: &Ctx,
    s: &mut Scenario,
    (name, yaml): (&str, &str),
    (suffix, count): (&str, usize),
    shapes: &[(&str, Shape)],
) -> anyhow::Result<[Vec<Vec<Sample>>; 3]> {
    let (on, off) = (format!("{yaml}{FLOW}"), format!("{yaml}{FLOW_OFF}"));
    let first = (&*format!("{name}-{suffix}"), "alone_");
    let alone = run(ctx, s, first, on.clone(), &shapes[..count]).await?;
    let held = run(ctx, s, (name, ""), on, shapes).await?;
    let unheld_name = format!("{name}-unheld");
    let unheld = run(ctx, s, (&unheld_name, "unheld_"), off, shapes).await?;
    Ok([alone, held, unheld])
}

/// Requests of each shape whose routers' records are kept.
const SLOWEST: usize = 10;

/// The `n` slowest requests to their first token in `samples`, each as
/// its client saw it beside its router's record (`/debug/requests/{id}`:
/// how long it was held and why, what it found cached), one JSON object
/// per line: where a tail request's time went.
pub(crate) async fn slowest(system: &System, samples: &[Sample], n: usize) -> String {
    let mut slowest: Vec<&Sample> = samples.iter().filter(|s| s.ttft.is_some()).collect();
    slowest.sort_by(|a, b| b.ttft.unwrap_or(0.0).total_cmp(&a.ttft.unwrap_or(0.0)));
    let mut out = String::new();
    for sample in slowest.into_iter().take(n) {
        let mut router = serde_json::Value::Null;
        for i in 0..system.router_addrs().len() {
            if let Some(id) = &sample.id
                && let Ok(recorded) = system.recorded(i, id).await
            {
                router = recorded;
                break;
            }
        }
        out += &serde_json::json!({"client": sample, "router": router}).to_string();
        out.push('\n');
    }
    out
}

/// Every router's `/metrics`.
pub(crate) async fn routers_metrics(system: &System) -> anyhow::Result<Vec<String>> {
    let mut texts = Vec::new();
    for i in 0..system.router_addrs().len() {
        texts.push(system.router_metrics(i).await?);
    }
    Ok(texts)
}

/// The queue's figures from the routers' metrics `texts`, under
/// `prefix`: requests sent at once and after a wait, and, per priority,
/// the wait of those held (p50 and p99 from the histogram's buckets).
pub(super) fn queue_figures(s: &mut Scenario, prefix: &str, texts: &[String]) {
    let mut sent = [0.0; 2];
    let mut by_priority: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for line in texts.iter().flat_map(|t| t.lines()) {
        let Some(m) = metrics::parse_line(line) else {
            continue;
        };
        match m.name {
            "kvroute_flow_dispatched_total" => match m.label("reason") {
                Some("immediate") => sent[0] += m.value,
                Some("after_wait") => sent[1] += m.value,
                _ => {}
            },
            "kvroute_flow_wait_seconds_bucket" => {
                let priority = m.label("priority").unwrap_or_default().to_owned();
                let le = m.label("le").and_then(|v| v.parse().ok());
                let le = le.unwrap_or(f64::INFINITY);
                let buckets = by_priority.entry(priority).or_default();
                match buckets.iter_mut().find(|(b, _)| *b == le) {
                    Some((_, n)) => *n += m.value,
                    None => buckets.push((le, m.value)),
                }
            }
            _ => {}
        }
    }
    s.figure(&format!("{prefix}sent_at_once"), sent[0]);
    s.figure(&format!("{prefix}sent_after_wait"), sent[1]);
    for (priority, mut buckets) in by_priority {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
            let ms = bucket_quantile(&buckets, q) * 1e3;
            s.figure(
                &format!("{prefix}priority_{priority}_held_wait_{name}_ms"),
                ms,
            );
        }
    }
}

/// Quantile `q` of a cumulative histogram's `(le, count)` buckets, in
/// order, interpolated within its bucket (0 when empty; the largest finite
/// bound when it falls in the last).
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    if total == 0.0 {
        return 0.0;
    }
    let rank = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, n) in buckets {
        if n >= rank {
            if le.is_infinite() {
                return lo;
            }
            return lo + (le - lo) * (rank - below) / (n - below).max(1e-9);
        }
        (lo, below) = (le, n);
    }
    lo
}

fn p99_ms(samples: &[Sample]) -> f64 {
    let mut ttfts: Vec<f64> = samples.iter().filter_map(|x| x.ttft).collect();
    report::quantile(&mut ttfts, 0.99) * 1e3
}

/// Requests served per second: those served whole, over the time from
/// the first sent to the last first token (a flood the pool cannot keep
/// up with drains past the load's duration).
fn served_per_s(runs: &[Vec<Sample>]) -> f64 {
    let ok: Vec<&Sample> = (runs.iter().flatten())
        .filter(|x| x.outcome == Outcome::Ok)
        .collect();
    let start = ok.iter().map(|x| x.t).fold(f64::INFINITY, f64::min);
    let end = (ok.iter().filter_map(|x| Some(x.t + x.ttft?))).fold(0.0, f64::max);
    ok.len() as f64 / (end - start).max(1e-3)
}

/// Requests that ended otherwise than served or refused with 429: a 5xx,
/// a reset, a timeout, a broken stream.
fn broken(samples: &[Sample]) -> usize {
    samples
        .iter()
        .filter(|x| !matches!(x.outcome, Outcome::Ok | Outcome::Refused(429)))
        .count()
}

fn refused_429(samples: &[Sample]) -> usize {
    (samples.iter())
        .filter(|x| x.outcome == Outcome::Refused(429))
        .count()
}

/// The priority stream's share of what the pool serves, and the whole
/// load offered over it. Four pods serve about three times the standard
/// load's rate (measured: 16 to 17 requests a second against about 5.8).
const SERVES_STANDARD: f64 = 3.0;
const PRIORITY_SHARE: f64 = 0.2;
const OFFERED: f64 = 2.0;
/// Flow control's default `reserveWindowMs`, seconds.
const RESERVE_WINDOW_S: f64 = 10.0;

/// The room the routers keep for `priority`'s requests, in blocks, on
/// average over its requests: the largest of its requests sent in the
/// reserve window before each (prompt and output, in the suite's blocks).
fn mean_reserve_blocks(priority: &[Sample], max_tokens: u64) -> f64 {
    let block_tokens = u64::from(EngineSetup::suite().block_size);
    let blocks = |x: &Sample| (x.prompt_tokens + max_tokens).div_ceil(block_tokens) as f64;
    let ok: Vec<&Sample> = (priority.iter())
        .filter(|x| x.outcome == Outcome::Ok)
        .collect();
    let largest_before = |x: &Sample| {
        (ok.iter())
            .filter(|y| y.t <= x.t && y.t >= x.t - RESERVE_WINDOW_S)
            .map(|y| blocks(y))
            .fold(0.0, f64::max)
    };
    ok.iter().map(|x| largest_before(x)).sum::<f64>() / ok.len().max(1) as f64
}

/// A priority-10 stream at a fifth of what the pool serves, alone; then
/// beside a priority-0 flood that makes the load twice what it serves,
/// with flow control on and off.
pub async fn overload(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    const PRIORITY: &[(&str, &str)] = &[("x-gateway-inference-objective", "interactive")];
    let times = PRIORITY_SHARE * SERVES_STANDARD;
    let priority = stream(ctx, times, 11, PRIORITY);
    let flood = stream(ctx, OFFERED * SERVES_STANDARD - times, 13, &[]);
    let both = [("priority", priority), ("flood", flood)];
    let [alone, held, unheld] = runs(ctx, s, ("overload", OBJECTIVES), ("alone", 1), &both).await?;
    let (alone_p99, p99, unheld_p99) = (p99_ms(&alone[0]), p99_ms(&held[0]), p99_ms(&unheld[0]));
    s.figure("priority_alone_ttft_p99_ms", alone_p99);
    s.figure("priority_ttft_p99_ms", p99);
    s.figure("priority_unheld_ttft_p99_ms", unheld_p99);
    s.figure("flood_ttft_p99_ms", p99_ms(&held[1]));
    s.figure("flood_refused_429", refused_429(&held[1]) as f64);
    s.figure("priority_refused_429", refused_429(&held[0]) as f64);
    let offered = (held.iter().map(Vec::len).sum::<usize>()) as f64 / ctx.duration.as_secs_f64();
    let (served, unheld_served) = (served_per_s(&held), served_per_s(&unheld));
    s.figure("offered_per_s", offered);
    s.figure("served_per_s", served);
    s.figure("unheld_served_per_s", unheld_served);
    let all: Vec<Sample> = held.concat();
    s.figure("unheld_broken", broken(&unheld.concat()) as f64);
    let broken = broken(&all);
    s.figure("broken", broken as f64);
    s.check(
        broken == 0,
        format!(
            "every request is served or refused with 429: {broken} of {} were not",
            all.len()
        ),
    );
    s.goal(
        p99 <= 1.5 * alone_p99,
        format!(
            "the priority stream's TTFT p99 under the flood ≤ 1.5 × alone: {p99:.0} vs {alone_p99:.0} ms (without flow control {unheld_p99:.0})"
        ),
    );
    // What the reserve leaves: the pool's throughput with every request
    // committed, less the reserve's share of each engine's blocks (the
    // flood is bound by memory).
    let reserve = mean_reserve_blocks(&held[0], priority.max_tokens);
    let left = unheld_served * (1.0 - reserve / f64::from(NUM_GPU_BLOCKS));
    s.figure("reserve_blocks_mean", reserve);
    s.figure("reserve_left_per_s", left);
    s.goal(
        served >= 0.9 * left,
        format!(
            "served ≥ 90 % of what the reserve leaves: {served:.1} vs {left:.1} requests/s ({unheld_served:.1} with every request committed, less {reserve:.0} of {NUM_GPU_BLOCKS} blocks)"
        ),
    );
    Ok(())
}

/// Two tenants at half the standard rate each, alone; then beside a third
/// sending five times their rate, with flow control on and off.
pub async fn noisy_tenant(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    const A: &[(&str, &str)] = &[(TENANT_HEADER, "quiet-a")];
    const B: &[(&str, &str)] = &[(TENANT_HEADER, "quiet-b")];
    const NOISY: &[(&str, &str)] = &[(TENANT_HEADER, "noisy")];
    let (a, b) = (stream(ctx, 0.5, 21, A), stream(ctx, 0.5, 23, B));
    let noisy = stream(ctx, 2.5, 25, NOISY);
    let all = [("a", a), ("b", b), ("noisy", noisy)];
    let [quiet, held, unheld] = runs(ctx, s, ("noisy_tenant", TENANCY), ("quiet", 2), &all).await?;
    // Two decode steps: what one request ahead at dispatch may cost.
    let steps_ms = 2.0 * f64::from(ITL_MS);
    let mut met = true;
    let mut lines = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let (before, with, without) = (p99_ms(&quiet[i]), p99_ms(&held[i]), p99_ms(&unheld[i]));
        s.figure(&format!("quiet_{name}_alone_ttft_p99_ms"), before);
        s.figure(&format!("quiet_{name}_ttft_p99_ms"), with);
        s.figure(&format!("quiet_{name}_unheld_ttft_p99_ms"), without);
        met &= with <= 1.3 * before + steps_ms;
        lines.push(format!(
            "{name} {with:.0} vs {before:.0} ms (without flow control {without:.0})"
        ));
    }
    s.figure("noisy_ttft_p99_ms", p99_ms(&held[2]));
    s.figure("noisy_refused_429", refused_429(&held[2]) as f64);
    let all: Vec<Sample> = held.concat();
    let broken = broken(&all);
    s.figure("broken", broken as f64);
    s.check(
        broken == 0,
        format!(
            "every request is served or refused with 429: {broken} of {} were not",
            all.len()
        ),
    );
    s.goal(
        met,
        format!(
            "the quiet tenants' TTFT p99 beside the noisy one ≤ 1.3 × alone + 2 decode steps: {}",
            lines.join("; ")
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantile_is_interpolated_within_its_bucket() {
        let buckets = [
            (0.01, 50.0),
            (0.1, 90.0),
            (1.0, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert_eq!(bucket_quantile(&buckets, 0.25), 0.005);
        assert!((bucket_quantile(&buckets, 0.7) - 0.055).abs() < 1e-9);
        assert!((bucket_quantile(&buckets, 0.99) - 0.91).abs() < 1e-9);
        assert_eq!(
            bucket_quantile(&[(0.01, 0.0), (f64::INFINITY, 0.0)], 0.5),
            0.0
        );
        assert_eq!(
            bucket_quantile(&[(0.01, 1.0), (f64::INFINITY, 4.0)], 0.99),
            0.01
        );
    }

    #[test]
    fn the_reserve_is_the_largest_priority_request_in_the_window_before_each() {
        let sample = |t: f64, prompt_tokens: u64, outcome: Outcome| Sample {
            t,
            endpoint: None,
            id: None,
            outcome,
            prompt_tokens,
            cached_tokens: 0,
            ttft: Some(0.1),
            itl: Vec::new(),
        };
        let samples = [
            sample(0.0, 1592, Outcome::Ok),
            sample(5.0, 792, Outcome::Ok),
            sample(6.0, 9000, Outcome::Refused(429)),
            sample(20.0, 392, Outcome::Ok),
        ];
        // 100 blocks, then still 100 (5 s later), then 25 (the first is
        // out of the window); the refused one took no room.
        assert_eq!(mean_reserve_blocks(&samples, 8), 75.0);
        assert_eq!(mean_reserve_blocks(&[], 8), 0.0);
    }
}
