//! `response_cache`: two routers share the exact response cache through
//! one real `redis-server`, and keep answering, uncached, while it is
//! down (see `docs/response-cache.md`).
//!
//! Both routers get `responseCache: {backend: redis, url, timeoutMs}`; all
//! requests are temperature-0 chat completions, so cacheable, answered as
//! JSON. `redis-server` not on `PATH` skips the scenario, unless
//! `KVROUTE_REQUIRE_REDIS=1`, which makes it an error.
//!
//! 1. **Phase A, sharing.** Each router first answers a request of its
//!    own, which connects it to Redis (while a router's first connection
//!    is being made, its other lookups are misses at once, by design).
//!    Then [`SHARED`] distinct requests through router-0
//!    (each a miss, stored in Redis just after its answer: waited for on
//!    router-0's `kvroute_response_cache_stores_total{reason="stored"}`),
//!    then the same through router-1. **Check:** ≥ 95 % of them are hits
//!    there (`shared_hit_ratio`; goal 100 %), with router-0's content.
//! 2. **Phase B, an outage.** [`RATE`] requests a second, alternately to
//!    each router, half of them new and half repeats of a recent answered
//!    one (never one in flight, so no hit comes from coalescing within a
//!    router). After [`BEFORE_KILL`] Redis is SIGKILLed; after
//!    [`OUTAGE`] it is started again on the same port, empty; the traffic
//!    goes on until both routers have served a hit again.
//!    **Check:** no request fails, in either phase (`failed` = 0).
//!    **Check:** hits resume through each router within
//!    [`RESUME_WITHIN`] of Redis answering again (`hits_resume_s`, the
//!    later router's); goal: within the breaker's 2 s plus a second.
//!    **Goal:** the outage costs a request at most one lookup's
//!    `timeoutMs`: the p99 latency of the requests sent during the outage
//!    (all misses) is at most the undisturbed misses' p99 +
//!    [`TIMEOUT_MS`] + [`SLACK_MS`]. The store happens after the answer,
//!    in a task, so it never adds to a request's latency.
//!
//! The routers' `kvroute_response_cache_store_errors_total` by reason and
//! `kvroute_response_cache_breaker_opened_total` are reported, summed.

use std::collections::{HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures_util::StreamExt as _;
use kvroute_core::rng::SplitMix64;
use kvroute_telemetry::metrics::{Sample, parse_line};
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::redis::{self, Redis};
use super::report::{self, Scenario};
use super::scenarios::Ctx;
use super::system::{MODEL, Setup, System, TENANT_HEADER};

/// Set to `1`, a missing `redis-server` fails the scenario instead of
/// skipping it (CI installs it).
const REQUIRE: &str = "KVROUTE_REQUIRE_REDIS";
/// The routers' `responseCache.timeoutMs` (its default).
const TIMEOUT_MS: u64 = 50;
/// Distinct requests of phase A.
const SHARED: usize = 50;
/// Phase A's requests in flight at once.
const CONCURRENCY: usize = 8;
/// The longest router-0 may take to have stored phase A's answers.
const STORED_WITHIN: Duration = Duration::from_secs(10);
/// Phase B's requests per second, over both routers.
const RATE: f64 = 20.0;
/// Recently answered keys a repeat is drawn from.
const RECENT: usize = 5;
/// Phase B's traffic before Redis is killed.
const BEFORE_KILL: Duration = Duration::from_secs(4);
/// How long Redis stays down.
const OUTAGE: Duration = Duration::from_secs(5);
/// The longest hits may take to resume after Redis is back.
const RESUME_WITHIN: Duration = Duration::from_secs(15);
/// The goal for it: the breaker's 2 s, then a store and a repeat.
const RESUME_GOAL_S: f64 = 3.0;
/// Scheduling slack in the outage latency goal, for a loaded 2-core
/// machine.
const SLACK_MS: f64 = 50.0;

/// One request as its client saw it.
#[derive(Clone, Debug)]
struct Shot {
    /// When it was sent, seconds since the system's start.
    t: f64,
    /// The router it went to.
    router: usize,
    /// Time to the whole answer, seconds.
    latency: f64,
    /// `x-kvroute-response-cache` and the answer's content, or why it
    /// failed.
    result: Result<(String, String), String>,
}

impl Shot {
    fn hit(&self) -> bool {
        matches!(&self.result, Ok((cache, _)) if cache == "hit")
    }

    fn content(&self) -> Option<&str> {
        self.result.as_ref().ok().map(|(_, c)| c.as_str())
    }
}

/// Runs the scenario into `s`.
pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let Some(exe) = redis::find() else {
        let why = "redis-server is not on PATH (apt-get install redis-server)";
        anyhow::ensure!(
            std::env::var(REQUIRE).as_deref() != Ok("1"),
            "{why}, and {REQUIRE}=1"
        );
        s.skipped = Some(format!("{why}; {REQUIRE}=1 makes this an error"));
        return Ok(());
    };
    // Its own log directory: the system's is emptied when it starts.
    let logs = ctx.out.join("logs").join("response_cache-redis");
    std::fs::create_dir_all(&logs)?;
    let mut redis = Redis::start(&exe, &logs).await?;
    let setup = Setup {
        router_yaml: format!(
            "responseCache: {{backend: redis, url: redis://127.0.0.1:{}, timeoutMs: {TIMEOUT_MS}}}\n",
            redis.port()
        ),
        ..Setup::new(2)
    };
    let system = ctx.system("response_cache", setup).await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut shots = shared(&system, &client, s).await?;
    shots.extend(outage(&system, &mut redis, &client, s).await?);
    let failed: Vec<&Shot> = shots.iter().filter(|x| x.result.is_err()).collect();
    s.figure("requests", shots.len() as f64);
    s.figure("failed", failed.len() as f64);
    let first = failed.first().map(|x| format!(" (first: {:?})", x.result));
    s.check(
        failed.is_empty(),
        format!(
            "no request fails, Redis up or down: {} of {} failed{}",
            failed.len(),
            shots.len(),
            first.unwrap_or_default()
        ),
    );
    store_figures(&system, s).await
}

/// Phase A: [`SHARED`] answers through router-0, then asked through
/// router-1.
async fn shared(
    system: &System,
    client: &reqwest::Client,
    s: &mut Scenario,
) -> anyhow::Result<Vec<Shot>> {
    // Each router connects to Redis with a request of its own first, as a
    // router that has served before has: while its first connection is
    // being made, its other lookups are misses, at once.
    let mut warm = Vec::new();
    for i in 0..2 {
        warm.extend(ask_all(system, client, i, &[body("Warm-up", i as u64)]).await);
        system
            .wait_for("a router to connect to Redis", STORED_WITHIN, async || {
                (stored_count(system, i).await >= 1.0).then_some(())
            })
            .await?;
    }
    let before = stored_count(system, 0).await;
    let bodies: Vec<Value> = (0..SHARED).map(|i| body("Shared", i as u64)).collect();
    let first = ask_all(system, client, 0, &bodies).await;
    let misses = first.iter().filter(|x| !x.hit()).count();
    s.check(
        misses == SHARED,
        format!(
            "a fresh Redis: every first request through router-0 is a miss: {misses} of {SHARED}"
        ),
    );
    let stored = system
        .wait_for("router-0 to store its answers", STORED_WITHIN, async || {
            let n = stored_count(system, 0).await - before;
            (n >= SHARED as f64).then_some(n)
        })
        .await;
    let stored = match stored {
        Ok((n, _)) => n,
        Err(_) => stored_count(system, 0).await - before,
    };
    s.figure("stored_by_router0", stored);
    s.check(
        stored >= SHARED as f64,
        format!(
            "router-0 stores every answer in Redis within {STORED_WITHIN:?}: {stored} of {SHARED}"
        ),
    );
    let second = ask_all(system, client, 1, &bodies).await;
    let hits = second.iter().filter(|x| x.hit()).count();
    let ratio = hits as f64 / SHARED as f64;
    s.figure("shared_hit_ratio", ratio);
    s.check(
        ratio >= 0.95,
        format!("router-0's answers are hits through router-1: {hits} of {SHARED} (≥ 95 %)"),
    );
    s.goal(
        hits == SHARED,
        format!("every one of router-0's answers is a hit through router-1: {hits} of {SHARED}"),
    );
    let same = first
        .iter()
        .zip(&second)
        .filter(|(a, b)| b.hit() && a.content() == b.content())
        .count();
    s.check(
        same == hits,
        format!("each hit carries router-0's answer: {same} of {hits}"),
    );
    Ok(warm.into_iter().chain(first).chain(second).collect())
}

/// Phase B: steady traffic through both routers while Redis is killed and
/// started again.
async fn outage(
    system: &System,
    redis: &mut Redis,
    client: &reqwest::Client,
    s: &mut Scenario,
) -> anyhow::Result<Vec<Shot>> {
    let shots = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let start = system.now();
    let traffic = tokio::spawn(traffic(
        client.clone(),
        system.router_addrs(),
        system.t0,
        stop.clone(),
        shots.clone(),
    ));
    tokio::time::sleep(BEFORE_KILL).await;
    tokio::task::block_in_place(|| redis.kill());
    let killed = system.now();
    tokio::time::sleep(OUTAGE).await;
    redis.restart().await?;
    let back = system.now();
    let resumed = |i: usize| {
        lock(&shots)
            .iter()
            .filter(|x| x.router == i && x.t >= back && x.hit())
            .map(|x| x.t - back)
            .reduce(f64::min)
    };
    let waited = system
        .wait_for("hits through both routers", RESUME_WITHIN, async || {
            Some((resumed(0)?, resumed(1)?))
        })
        .await;
    stop.store(true, Ordering::Relaxed);
    traffic.await?;
    let shots = lock(&shots).clone();

    s.figure("outage_s", back - killed);
    let during = |from: f64, to: f64| -> Vec<&Shot> {
        shots.iter().filter(|x| x.t >= from && x.t < to).collect()
    };
    let (before, down) = (during(start, killed), during(killed, back));
    let p99 = |x: &[&Shot]| {
        let mut ms: Vec<f64> = x.iter().map(|x| x.latency * 1e3).collect();
        report::quantile(&mut ms, 0.99)
    };
    let before_misses: Vec<&Shot> = before.iter().copied().filter(|x| !x.hit()).collect();
    let (undisturbed, outage) = (p99(&before_misses), p99(&down));
    s.figure("undisturbed_miss_latency_p99_ms", undisturbed);
    s.figure("outage_latency_p99_ms", outage);
    s.figure("outage_requests", down.len() as f64);
    s.figure(
        "outage_hits",
        down.iter().filter(|x| x.hit()).count() as f64,
    );
    s.figure(
        "undisturbed_hit_ratio",
        before.iter().filter(|x| x.hit()).count() as f64 / before.len().max(1) as f64,
    );
    let bound = undisturbed + TIMEOUT_MS as f64 + SLACK_MS;
    s.goal(
        outage <= bound,
        format!(
            "Redis down costs a request at most one lookup's timeout: p99 {outage:.0} ms during the outage ≤ {undisturbed:.0} ms (undisturbed misses) + {TIMEOUT_MS} + {SLACK_MS} ms"
        ),
    );
    match waited {
        Ok(((r0, r1), _)) => {
            let later = r0.max(r1);
            s.figure("hits_resume_router0_s", r0);
            s.figure("hits_resume_router1_s", r1);
            s.figure("hits_resume_s", later);
            s.check(
                true,
                format!(
                    "hits resume through both routers within {RESUME_WITHIN:?} of Redis answering again: {r0:.2} s, {r1:.2} s"
                ),
            );
            s.goal(
                later <= RESUME_GOAL_S,
                format!("hits resume within {RESUME_GOAL_S} s: {later:.2} s"),
            );
        }
        Err(_) => s.check(
            false,
            format!(
                "hits resume through both routers within {RESUME_WITHIN:?} of Redis answering again: router-0 {:?}, router-1 {:?}",
                resumed(0),
                resumed(1)
            ),
        ),
    }
    Ok(shots)
}

/// The routers' store errors by reason and breaker openings, summed.
async fn store_figures(system: &System, s: &mut Scenario) -> anyhow::Result<()> {
    let mut errors = [("timeout", 0.0), ("error", 0.0), ("breaker_open", 0.0)];
    let (mut opened, mut each_opened) = (0.0, true);
    for i in 0..system.router_admins().len() {
        let text = system.router_metrics(i).await?;
        for x in samples(&text, "kvroute_response_cache_store_errors_total") {
            if let Some(e) = errors
                .iter_mut()
                .find(|(r, _)| x.label("reason") == Some(r))
            {
                e.1 += x.value;
            }
        }
        let n = sum(&text, "kvroute_response_cache_breaker_opened_total");
        opened += n;
        each_opened &= n > 0.0;
    }
    for (reason, n) in errors {
        s.figure(&format!("store_errors_{reason}"), n);
    }
    s.figure("breaker_opened", opened);
    s.goal(
        each_opened,
        format!("each router's circuit breaker opened during the outage: {opened} openings in all"),
    );
    Ok(())
}

/// Router `i`'s answers stored in Redis so far.
async fn stored_count(system: &System, i: usize) -> f64 {
    let text = system.router_metrics(i).await.unwrap_or_default();
    samples(&text, "kvroute_response_cache_stores_total")
        .filter(|x| x.label("reason") == Some("stored"))
        .fold(0.0, |n, x| n + x.value)
}

/// The samples of metric `name` (`_total` included) in a scrape.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = Sample<'a>> {
    (text.lines().filter_map(parse_line)).filter(move |x| x.name == name)
}

/// The sum of metric `name`'s samples in a scrape.
pub(crate) fn sum(text: &str, name: &str) -> f64 {
    samples(text, name).fold(0.0, |n, x| n + x.value)
}

/// A cacheable chat request, distinct for each `label` and `n`.
fn body(label: &str, n: u64) -> Value {
    json!({
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": format!("{label} question {n}: what is the capital of country {n}?")}],
    })
}

/// Each of `bodies` through router `i`, [`CONCURRENCY`] at once, in order.
async fn ask_all(
    system: &System,
    client: &reqwest::Client,
    i: usize,
    bodies: &[Value],
) -> Vec<Shot> {
    let addr = system.router_addrs()[i];
    futures_util::stream::iter(bodies)
        .map(|b| ask(client, addr, i, b, system.t0))
        .buffered(CONCURRENCY)
        .collect()
        .await
}

/// Posts chat request `body` to the router at `addr`, as `tenant` if
/// any: the `x-kvroute-response-cache` header and the answer, a success.
pub(super) async fn chat(
    client: &reqwest::Client,
    addr: SocketAddr,
    tenant: Option<&str>,
    body: &Value,
) -> anyhow::Result<(String, Value)> {
    let mut request = client.post(format!("http://{addr}/v1/chat/completions"));
    if let Some(tenant) = tenant {
        request = request.header(TENANT_HEADER, tenant);
    }
    let response = request.json(body).send().await?;
    let status = response.status();
    let cache = (response.headers().get("x-kvroute-response-cache"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("absent")
        .to_owned();
    let text = response.text().await?;
    anyhow::ensure!(status.is_success(), "{status}: {text}");
    let v = serde_json::from_str(&text).context("the answer's JSON")?;
    Ok((cache, v))
}

/// Sends `body` to router `router` at `addr` and reads the answer.
async fn ask(
    client: &reqwest::Client,
    addr: SocketAddr,
    router: usize,
    body: &Value,
    t0: Instant,
) -> Shot {
    let sent = Instant::now();
    let result = async {
        let (cache, v) = chat(client, addr, None, body).await?;
        let content = v["choices"][0]["message"]["content"]
            .as_str()
            .context("an answer without content")?;
        anyhow::Ok((cache, content.to_owned()))
    };
    let result = result.await.map_err(|e| format!("{e:#}"));
    Shot {
        t: sent.duration_since(t0).as_secs_f64(),
        router,
        latency: sent.elapsed().as_secs_f64(),
        result,
    }
}

/// Keys of phase B: new ones, and the recently answered ones a repeat is
/// drawn from.
#[derive(Debug, Default)]
struct Keys {
    next: u64,
    answered: VecDeque<u64>,
    inflight: HashSet<u64>,
}

impl Keys {
    /// A new key or, half the time, a recently answered one not in flight.
    fn pick(&mut self, rng: &mut SplitMix64) -> u64 {
        let idle: Vec<u64> = (self.answered.iter())
            .filter(|k| !self.inflight.contains(k))
            .copied()
            .collect();
        let key = if idle.is_empty() || rng.range(0, 1) == 0 {
            self.next += 1;
            self.next
        } else {
            idle[rng.range(0, idle.len() as u64 - 1) as usize]
        };
        self.inflight.insert(key);
        key
    }

    fn answered(&mut self, key: u64) {
        self.inflight.remove(&key);
        self.answered.retain(|k| *k != key);
        self.answered.push_back(key);
        if self.answered.len() > RECENT {
            self.answered.pop_front();
        }
    }
}

/// [`RATE`] requests a second, alternately to each router, until `stop`;
/// each request's [`Shot`] into `shots`. Returns when all have ended.
async fn traffic(
    client: reqwest::Client,
    routers: Vec<SocketAddr>,
    t0: Instant,
    stop: Arc<AtomicBool>,
    shots: Arc<Mutex<Vec<Shot>>>,
) {
    let keys = Arc::new(Mutex::new(Keys::default()));
    let mut rng = SplitMix64::new(0xcac4e);
    let mut every = tokio::time::interval(Duration::from_secs_f64(1.0 / RATE));
    let mut tasks = JoinSet::new();
    for n in 0.. {
        every.tick().await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let key = lock(&keys).pick(&mut rng);
        let router = n % routers.len();
        let (client, addr, keys, shots) =
            (client.clone(), routers[router], keys.clone(), shots.clone());
        tasks.spawn(async move {
            let shot = ask(&client, addr, router, &body("Steady", key), t0).await;
            lock(&keys).answered(key);
            lock(&shots).push(shot);
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// `m`'s guard; a panicked holder does not matter here.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
