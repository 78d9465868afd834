//! `warmup_routers`: two routers and the operators share one set of
//! warm-ups. The pool's CacheRoutingPolicy names two prefixes (one from a
//! ConfigMap labelled `kvroute.dev/warmup=true`) with 2 owners each,
//! warmed every 2 s; no other traffic, so every request an engine finishes
//! is a warm-up. Four windows, each counted on the engines (which a router
//! restart does not reset) against the periods that fell due in it:
//!
//! 1. steady: both routers named by the operator;
//! 2. a router restart: router 1's pod not ready, killed, started again,
//!    ready again;
//! 3. a leader change: the operator holding the Lease killed;
//! 4. control: the router pods deleted, so the operator names none and
//!    each router sends its own (twice the warm-ups).
//!
//! Goal: in windows 1–3 the warm-ups are one per prefix, owner and period,
//! within one per prefix and owner. Checked too: the policy's
//! `status.warmup` lists each prefix's owners and the routers that sent,
//! and keeps moving after the leader change (the routers report to the new
//! status writer).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_core::warmup;
use kvroute_telemetry::metrics;
use serde_json::json;

use super::report::Scenario;
use super::scenarios::{Ctx, at};
use super::system::{NAMESPACE, Setup, System};

const PODS: usize = 4;
const EVERY_MS: u64 = 2000;
const OWNERS: u64 = 2;
const PREFIXES: [&str; 2] = ["support", "billing"];

pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let spec = json!({
        "everySeconds": EVERY_MS / 1000,
        "owners": OWNERS,
        "maxShareOfPrefill": 1.0,
        "prefixes": [
            {"name": PREFIXES[0], "configMapRef": {"name": "prompts", "key": "support"}},
            {"name": PREFIXES[1], "messages": [{"role": "system", "content": "You answer billing questions for Acme. Be brief."}]},
        ],
    });
    let setup = Setup {
        // JSON is YAML.
        policy_yaml: format!("  warmup: {spec}\n"),
        ..Setup::new(PODS)
    };
    let mut system = ctx.system("warmup_routers", setup).await?;
    system.apply_yaml(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: prompts, namespace: {NAMESPACE}, labels: {{kvroute.dev/warmup: \"true\"}}}}\ndata: {{support: \"You are the Acme support assistant. Answer in English.\"}}\n"
    ))?;
    // Both prefixes warmed. A router sends a prefix's warm-ups only to
    // the owners it ranks first for, so look at the two together.
    let sys = &system;
    sys.wait_for(
        "both prefixes warmed",
        Duration::from_secs(30),
        async || {
            let mut text = String::new();
            for i in 0..2 {
                text += &sys.router_metrics(i).await.ok()?;
            }
            let warmed = |p: &&str| text.contains(&format!("prefix=\"{p}\""));
            PREFIXES.iter().all(warmed).then_some(())
        },
    )
    .await?;
    // The policy's status says so, once the leader has written it.
    let ready = sys
        .wait_for("WarmupReady", Duration::from_secs(10), async || {
            let policy = sys.policy()?;
            let conditions = policy["status"]["conditions"].as_array()?.clone();
            let c = conditions
                .into_iter()
                .find(|c| c["type"] == "WarmupReady")?;
            (c["status"] == "True").then(|| c["message"].as_str().unwrap_or("").to_owned())
        })
        .await;
    s.check(
        ready.is_ok(),
        format!("the policy's WarmupReady condition is True: {ready:?}"),
    );
    let start = system.now() + 1.0;
    let mut window = Window::open(&system, start).await?;

    at(&system, start + 16.0).await;
    let steady = window.close(&system).await?;
    report(s, "steady", &steady, true);
    let listed = status_since(&system, wall_ms() - 5_000).await;
    let ok = (listed.as_ref()).is_ok_and(|(p, _)| p.iter().all(|p| p.owners == OWNERS as usize));
    let text = match &listed {
        Ok((p, _)) => (p.iter())
            .map(|p| {
                format!(
                    "{}: {} owners sent by {}",
                    p.name,
                    p.owners,
                    p.sent_by.join(", ")
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) => e.to_string(),
    };
    s.check(
        ok,
        format!(
            "status.warmup lists both prefixes sent in the last 5 s, {OWNERS} owners each: {text}"
        ),
    );
    // Each router's share so far: both send.
    for i in 0..2 {
        let text = system.router_metrics(i).await?;
        let sent: f64 = (text.lines().filter_map(metrics::parse_line))
            .filter(|m| m.name == "kvroute_warmups_total")
            .filter(|m| matches!(m.label("result"), Some("sent" | "repaired")))
            .map(|m| m.value)
            .sum();
        s.figure(&format!("router_{i}_sent_until_steady_end"), sent);
    }

    window = Window::open(&system, system.now()).await?;
    system.write_router_pod(1, false)?;
    system.kill_router(1);
    at(&system, window.t + 4.0).await;
    system.start_router(1).await?;
    at(&system, window.t + 14.0).await;
    let restart = window.close(&system).await?;
    report(s, "router_restart", &restart, true);

    window = Window::open(&system, system.now()).await?;
    let leader = system.leader().unwrap_or(0);
    let killed_ms = wall_ms();
    system.kill_operator(leader);
    let moved = status_since(&system, killed_ms).await;
    if let Ok((_, after)) = &moved {
        s.figure("status_warmup_after_leader_change_s", *after);
    }
    s.check(
        moved.is_ok(),
        format!(
            "status.warmup shows sends after the leader change: {}",
            moved
                .as_ref()
                .map_or_else(|e| e.to_string(), |(_, t)| format!("{t:.1} s later"))
        ),
    );
    at(&system, window.t + 12.0).await;
    let leader_change = window.close(&system).await?;
    report(s, "leader_change", &leader_change, true);

    for i in 0..2 {
        system.delete_router_pod(i);
    }
    at(&system, system.now() + 2.0).await;
    window = Window::open(&system, system.now()).await?;
    at(&system, window.t + 12.0).await;
    let unnamed = window.close(&system).await?;
    report(s, "unnamed", &unnamed, false);
    if let Some(why) = system.exited() {
        anyhow::bail!("{why}");
    }
    Ok(())
}

/// A prefix in the policy's `status.warmup`.
struct Listed {
    name: String,
    owners: usize,
    sent_by: Vec<String>,
}

/// Waits (up to 10 s) until the policy's `status.warmup` has every prefix
/// sent since `since_ms`: the prefixes, and how long the wait took.
async fn status_since(system: &System, since_ms: u64) -> anyhow::Result<(Vec<Listed>, f64)> {
    let since = jiff::Timestamp::from_millisecond(since_ms as i64)?.as_second();
    system
        .wait_for("status.warmup", Duration::from_secs(10), async || {
            let policy = system.policy()?;
            let prefixes = policy["status"]["warmup"]["prefixes"].as_array()?.clone();
            let listed: Vec<Listed> = (prefixes.iter())
                .filter(|p| {
                    let time = p["lastSentTime"].as_str().and_then(|t| t.parse().ok());
                    time.is_some_and(|t: jiff::Timestamp| t.as_second() >= since)
                })
                .map(|p| {
                    let owners = p["owners"].as_array().cloned().unwrap_or_default();
                    let mut sent_by: Vec<String> = (owners.iter())
                        .filter_map(|o| Some(o["sentBy"].as_str()?.to_owned()))
                        .collect();
                    sent_by.sort();
                    sent_by.dedup();
                    Listed {
                        name: p["name"].as_str().unwrap_or("").to_owned(),
                        owners: owners.len(),
                        sent_by,
                    }
                })
                .collect();
            (listed.len() == PREFIXES.len()).then_some(listed)
        })
        .await
}

/// Engine requests and periods between two moments.
struct Window {
    /// When it opened, seconds since the system's start.
    t: f64,
    wall_ms: u64,
    requests: Vec<u64>,
}

/// What a window counted.
struct Counted {
    /// Warm-ups each engine finished.
    per_pod: Vec<u64>,
    /// Periods of each prefix that fell due.
    periods: Vec<u64>,
}

impl Window {
    async fn open(system: &System, t: f64) -> anyhow::Result<Window> {
        at(system, t).await;
        Ok(Window {
            t,
            wall_ms: wall_ms(),
            requests: requests(system).await?,
        })
    }

    async fn close(&self, system: &System) -> anyhow::Result<Counted> {
        let end = wall_ms();
        let now = requests(system).await?;
        let per_pod = (now.iter().zip(&self.requests))
            .map(|(n, b)| n.saturating_sub(*b))
            .collect();
        let periods = PREFIXES
            .iter()
            .map(|p| warmup::period(p, EVERY_MS, end) - warmup::period(p, EVERY_MS, self.wall_ms))
            .collect();
        Ok(Counted { per_pod, periods })
    }
}

async fn requests(system: &System) -> anyhow::Result<Vec<u64>> {
    let mut each = Vec::new();
    for k in 0..PODS {
        each.push(system.engine_requests(k).await?);
    }
    Ok(each)
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The window's figures; with `goal`, whether it sent one warm-up per
/// prefix, owner and period within one per prefix and owner.
fn report(s: &mut Scenario, name: &str, c: &Counted, goal: bool) {
    let sent: u64 = c.per_pod.iter().sum();
    let expected: u64 = c.periods.iter().map(|p| p * OWNERS).sum();
    let per = sent as f64 / expected.max(1) as f64;
    s.figure(&format!("{name}_warmups"), sent as f64);
    s.figure(&format!("{name}_expected"), expected as f64);
    s.figure(&format!("{name}_per_prefix_owner_period"), per);
    for (k, n) in c.per_pod.iter().enumerate() {
        s.figure(&format!("{name}_pod_{k}"), *n as f64);
    }
    let slack = PREFIXES.len() as u64 * OWNERS;
    if goal {
        s.goal(
            sent.abs_diff(expected) <= slack,
            format!(
                "{name}: warm-ups per prefix, owner and period = 1 (± 1 per prefix and owner): {sent} for {expected} ({per:.2})"
            ),
        );
    }
}
