//! `router_killed`: router-0 is SIGKILLed under load, as a node failure or
//! the OOM killer would, and started again once the Service has taken it
//! out of rotation, as the kubelet restarts a killed container (whose pod
//! is then not ready until its readiness probe passes).
//!
//! The clients are those of a Kubernetes Service over the two routers:
//! a readiness probe every [`PROBE_EVERY`] on each router's `/readyz` takes
//! it out of rotation after [`FAILURE_THRESHOLD`] failures in a row and
//! puts it back after one success, and a request that got no response
//! byte at all (connection refused or reset) is sent once more, to the
//! other router ([`Rotation::retrying`]). What that promises:
//!
//! 1. **Check:** no request fails before its stream started
//!    (`failed_unstarted` = 0): the kill cost nothing a client could not
//!    resend. A stream the kill cut (`failed_started`) is reported, not
//!    checked: its bytes were on their way, and no proxy can resend them.
//! 2. **Check:** the restarted router is ready only with every engine's
//!    snapshot in its index (all its WatchCache streams live when its
//!    `/readyz` first answers 200), so it never routes cold for want of
//!    them. Here the snapshots follow discovery within milliseconds, so
//!    this would hold without the gate too; `router/tests/it/startup.rs`
//!    shows the gate with a snapshot held back.
//! 3. **Goal:** the cached-token ratio of the requests sent in the
//!    [`AFTER_S`] after the kill (`cached_ratio_after_kill`) is within the
//!    undisturbed run's interval for the same window
//!    (`undisturbed_cached_ratio_after_kill`): judged across runs, under
//!    `report --repeat 3` ([`super::repeat`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::load::{Rotation, Sample};
use super::report::{self, Scenario};
use super::scenarios::{Ctx, EVENT_AT, at, latency_figures};
use super::system::{Setup, System};

/// How often the Service's readiness probe asks each router (the chart's
/// asks every 2 s; faster here so a short run sees the router back).
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// Failed probes in a row that take a router out of rotation (Kubernetes'
/// default `failureThreshold`): meanwhile requests still reach the killed
/// router, and their clients retry; one passed probe puts it back.
const FAILURE_THRESHOLD: u32 = 3;
/// The longest the Service may take to notice the killed router.
const OUT_WITHIN: Duration = Duration::from_secs(10);
/// The window after the kill whose cached ratio is compared, seconds.
const AFTER_S: f64 = 20.0;
/// The longest the restarted router may take to be back in rotation.
const BACK_WITHIN: Duration = Duration::from_secs(20);

/// Runs the scenario into `s`.
pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let baseline = ctx.baseline().await?;
    let mut system = ctx.system("router_killed", Setup::new(4)).await?;
    let rotation = Rotation::retrying(system.router_addrs());
    let load = tokio::spawn(super::load::run(
        ctx.shape(system.pods.len()),
        rotation.clone(),
        system.t0,
    ));
    let probe = tokio::spawn(probe(system.router_admins(), rotation.clone()));
    at(&system, EVENT_AT).await;
    tokio::task::block_in_place(|| system.kill_router(0));
    system.mark("router-0 SIGKILLed");
    let killed = system.now();
    system
        .wait_for("the Service to drop router-0", OUT_WITHIN, async || {
            (!rotation.is_in(0)).then_some(())
        })
        .await?;
    system.mark("router-0 out of rotation");
    system.start_router(0).await?;
    // Its streams when it first says it is ready.
    system
        .wait_for("router-0 to be ready again", BACK_WITHIN, async || {
            system.router_ready(0).await.then_some(())
        })
        .await?;
    let live_at_ready = live_streams(&system, 0).await?;
    let back_at = system.now();
    system.mark("router-0 ready again");
    let samples = load.await?;
    probe.abort();

    let count = |f: &dyn Fn(&Sample) -> bool| samples.iter().filter(|x| f(x)).count();
    let unstarted = count(&|x| x.outcome.failed_unstarted());
    let started = count(&|x| x.outcome.failed_started());
    let pods = system.pods.len();
    s.figure("requests", samples.len() as f64);
    s.figure("failed_unstarted", unstarted as f64);
    s.figure("failed_started", started as f64);
    s.figure("retried", rotation.retried() as f64);
    s.figure("ready_again_s", back_at - killed);
    s.figure("live_streams_when_ready", live_at_ready as f64);
    let after = |x: &[Sample]| report::hit_ratio(report::between(x, killed, killed + AFTER_S));
    s.figure("cached_ratio_after_kill", after(&samples));
    s.figure("undisturbed_cached_ratio_after_kill", after(&baseline));
    let first = samples
        .iter()
        .find(|x| x.outcome.failed_unstarted())
        .map(|x| format!(" (first: {:?})", x.outcome));
    s.check(
        unstarted == 0,
        format!(
            "no request fails before its stream started, one retry on the other router allowed: {unstarted} of {} failed{}",
            samples.len(),
            first.unwrap_or_default()
        ),
    );
    s.check(
        live_at_ready == pods,
        format!(
            "the restarted router is ready only with every engine's snapshot: {live_at_ready} of {pods} streams live when it first said ready"
        ),
    );
    s.interval_goal(
        "cached_ratio_after_kill",
        "undisturbed_cached_ratio_after_kill",
        &format!("the cached ratio in the {AFTER_S} s after the kill is within the undisturbed run's interval"),
    );
    latency_figures(s, "", &samples);
    super::balance::figures(s, "", &samples, &system.pod_names());
    ctx.plot(
        s,
        "router-0 SIGKILLed under load, restarted",
        vec![("undisturbed", &baseline), ("this run", &samples)],
        &system.marks,
    )
}

/// The Service's readiness probe: every [`PROBE_EVERY`], each router (by
/// its admin address) asked for `/readyz`, which passes on a 200 within a
/// second; [`FAILURE_THRESHOLD`] failures in a row take it out of
/// rotation, a pass puts it back.
async fn probe(admins: Vec<SocketAddr>, rotation: Arc<Rotation>) {
    let client = reqwest::Client::new();
    let mut failures = vec![0; admins.len()];
    let mut every = tokio::time::interval(PROBE_EVERY);
    loop {
        every.tick().await;
        for (i, admin) in admins.iter().enumerate() {
            let answer = client
                .get(format!("http://{admin}/readyz"))
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            if answer.is_ok_and(|r| r.status().is_success()) {
                failures[i] = 0;
                rotation.set(i, true);
            } else {
                failures[i] += 1;
                if failures[i] >= FAILURE_THRESHOLD {
                    rotation.set(i, false);
                }
            }
        }
    }
}

/// How many of router `i`'s WatchCache streams are live.
async fn live_streams(system: &System, i: usize) -> anyhow::Result<usize> {
    let endpoints = system.endpoints(i).await?;
    Ok(endpoints.iter().filter(|e| e.stream == "live").count())
}
