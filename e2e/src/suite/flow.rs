//! Flow control under more load than the pool serves: `overload` (a
//! priority stream beside a flood) and `noisy_tenant` (one tenant sending
//! five times its share). Each is measured with flow control on and, for
//! comparison, off (`flowControl.enabled: false`: every request committed
//! to an engine on arrival), over fresh pods each run.

use super::load::{self, Outcome, Rotation, Sample, Shape};
use super::report::{self, Scenario};
use super::scenarios::Ctx;
use super::system::{ITL_MS, Setup, TENANT_HEADER};

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
/// the samples of each shape.
async fn run(
    ctx: &Ctx,
    name: &str,
    yaml: String,
    shapes: &[Shape],
) -> anyhow::Result<Vec<Vec<Sample>>> {
    let setup = Setup {
        router_yaml: yaml,
        ..Setup::new(PODS)
    };
    let system = ctx.system(name, setup).await?;
    let rotation = Rotation::new(system.router_addrs());
    let runs = shapes
        .iter()
        .map(|&shape| load::run(shape, rotation.clone(), system.t0));
    Ok(futures_util::future::join_all(runs).await)
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

/// A priority-10 stream at a fifth of the standard load's rate, alone;
/// then beside a priority-0 flood at six times the standard rate (about
/// twice what four pods serve), with flow control on and off.
pub async fn overload(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    const PRIORITY: &[(&str, &str)] = &[("x-gateway-inference-objective", "interactive")];
    let priority = stream(ctx, 0.2, 11, PRIORITY);
    let flood = stream(ctx, 6.0, 13, &[]);
    let yaml = |flow: &str| format!("{OBJECTIVES}{flow}");
    let alone = run(ctx, "overload-alone", yaml(FLOW), &[priority]).await?;
    let held = run(ctx, "overload", yaml(FLOW), &[priority, flood]).await?;
    let unheld = run(ctx, "overload-unheld", yaml(FLOW_OFF), &[priority, flood]).await?;
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
    s.goal(
        served >= 0.9 * unheld_served,
        format!(
            "served ≥ 90 % of what the pool serves with every request committed: {served:.1} vs {unheld_served:.1} requests/s"
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
    let yaml = |flow: &str| format!("{TENANCY}{flow}");
    let quiet = run(ctx, "noisy_tenant-quiet", yaml(FLOW), &[a, b]).await?;
    let held = run(ctx, "noisy_tenant", yaml(FLOW), &[a, b, noisy]).await?;
    let unheld = run(ctx, "noisy_tenant-unheld", yaml(FLOW_OFF), &[a, b, noisy]).await?;
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
