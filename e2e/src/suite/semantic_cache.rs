//! `semantic_cache`: the semantic level of the response cache through a
//! router (see `docs/response-cache.md`), its questions embedded by a
//! separate engine-sim ([`Embedder`]: its `/v1/embeddings` test double),
//! which is killed mid-run.
//!
//! Both routers get `tenancy.tenantHeader` and `responseCache.semantic`
//! at the default threshold; requests are temperature-0 chat completions
//! (one system prompt, the question as the user message) through
//! router-0.
//!
//! 1. **Phase A, the labelled pairs** ([`replay`]): each pair of
//!    `e2e/data/semantic-pairs` under a tenant of its own, question `a`
//!    (a miss, stored), then `b`. A semantic hit on `b` is a hit when the
//!    pair means the same, a false hit when it does not; each false hit is
//!    reported to the router. **Check:** every request is answered and
//!    every `a` is a miss. **Check:** the reports are counted
//!    (`kvroute_semantic_cache_false_hits_total`). **Figures:**
//!    `hit_rate`, `false_hit_rate`. **Goal:** the false-hit rate is at
//!    most [`FALSE_HIT_GOAL`].
//! 2. **Phase B, the embeddings server killed.** [`RATE`] requests a
//!    second: a new question or, half the time, a recent one asked again
//!    in another case and punctuation (a semantic hit). After
//!    [`BEFORE_KILL`] the embeddings server is SIGKILLed; the traffic goes
//!    on for [`AFTER_KILL`]. **Check:** no request fails (`failed` = 0).
//!    **Check:** there were semantic hits before the kill, and none after
//!    it, where the embedding errors are counted. **Goal:** the p99
//!    latency after the kill is at most the undisturbed misses' p99 +
//!    [`SLACK_MS`] (a refused connection is a miss at once).
//!
//! `kvroute-e2e bench-semantic` replays the same pairs at several
//! thresholds and measures memory at `maxEntries`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures_util::StreamExt as _;
use kvroute_core::rng::SplitMix64;
use serde_json::{Value, json};

use super::procs::{Bins, Proc};
use super::report::{self, Scenario};
use super::response_cache::{chat, sum};
use super::scenarios::Ctx;
use super::system::{MODEL, STARTUP, Setup, System, TENANT_HEADER, free_ports};

/// The labelled pairs (`e2e/data/semantic-pairs/pairs.jsonl`).
pub const PAIRS: &str = include_str!("../../data/semantic-pairs/pairs.jsonl");
/// Where [`PAIRS`] is read from, for errors.
pub const PAIRS_FILE: &str = "e2e/data/semantic-pairs/pairs.jsonl";
/// The goal for phase A's false-hit rate at the default threshold.
const FALSE_HIT_GOAL: f64 = 0.02;
/// Requests in flight at once in phase A.
pub const CONCURRENCY: usize = 8;
/// Phase B's requests per second.
const RATE: f64 = 20.0;
/// Phase B's traffic before the embeddings server is killed.
const BEFORE_KILL: Duration = Duration::from_secs(4);
/// Phase B's traffic after it.
const AFTER_KILL: Duration = Duration::from_secs(4);
/// Recently answered questions a repeat is drawn from.
const RECENT: usize = 5;
/// Scheduling slack in phase B's latency goal, for a loaded 2-core
/// machine.
const SLACK_MS: f64 = 50.0;

/// One labelled pair.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Pair {
    /// Its name, `p001`…
    pub id: String,
    /// The question asked first.
    pub a: String,
    /// The question asked second.
    pub b: String,
    /// Whether they mean the same.
    pub same: bool,
    /// How they differ, if labelled.
    #[serde(default)]
    pub kind: Option<String>,
}

/// The labelled pairs in `text` (JSON lines), read from `file`.
pub fn pairs(text: &str, file: &str) -> anyhow::Result<Vec<Pair>> {
    (text.lines().filter(|l| !l.trim().is_empty()).enumerate())
        .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{file}:{}", i + 1)))
        .collect()
}

/// The embeddings server: an engine-sim serving only as one, killed on
/// drop, or another one's.
#[derive(Debug)]
pub struct Embedder {
    proc: Option<Proc>,
    /// Its base URL.
    pub url: String,
    /// The embedding model.
    pub model: String,
    /// Whether it was started by someone else.
    pub external: bool,
}

impl Embedder {
    /// Starts one on a free loopback port, its log in `logs`, and waits
    /// until it answers.
    pub async fn start(bins: &Bins, logs: &Path) -> anyhow::Result<Embedder> {
        let http = reqwest::Client::new();
        let mut last = None;
        for _ in 0..3 {
            let port = free_ports(1)?.next().context("a free port")?;
            let args = [
                format!("--listen=127.0.0.1:{port}"),
                "--cache-listen=127.0.0.1:0".to_owned(),
                format!("--model={MODEL}"),
            ];
            let mut proc = Proc::spawn(bins, logs, "embeddings", "kvroute-engine-sim", &args, &[])?;
            let url = format!("http://127.0.0.1:{port}");
            let started = Instant::now();
            while started.elapsed() < STARTUP && !proc.exited() {
                let health = http.get(format!("{url}/health")).send().await;
                if health.is_ok_and(|r| r.status().is_success()) {
                    return Ok(Embedder {
                        proc: Some(proc),
                        url,
                        model: MODEL.to_owned(),
                        external: false,
                    });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            last = Some(format!("it did not answer; see {}", proc.log().display()));
        }
        anyhow::bail!("the embeddings server: {}", last.unwrap_or_default())
    }

    /// The server at `url` serving `model`, started by someone else.
    pub fn external(url: &str, model: &str) -> Embedder {
        Embedder {
            proc: None,
            url: url.to_owned(),
            model: model.to_owned(),
            external: true,
        }
    }

    /// SIGKILL: its connections are reset, its port refuses.
    pub fn kill(&mut self) {
        if let Some(proc) = self.proc.take() {
            proc.kill();
        }
    }
}

/// The routers' configuration: tenants by header, the semantic level on
/// `embedder` at `threshold` (its default: `None`) with `max_entries`
/// (its default: `None`).
pub fn router_yaml(
    embedder: &Embedder,
    threshold: Option<f32>,
    max_entries: Option<usize>,
) -> String {
    let mut yaml = format!(
        "tenancy:\n  tenantHeader: {TENANT_HEADER}\nresponseCache:\n  semantic:\n    embeddings: {{url: {:?}, model: {:?}}}\n",
        embedder.url, embedder.model
    );
    if let Some(t) = threshold {
        yaml += &format!("    threshold: {t}\n");
    }
    if let Some(m) = max_entries {
        yaml += &format!("    maxEntries: {m}\n");
    }
    yaml
}

/// A cacheable chat request asking `question`.
pub fn body(question: &str) -> Value {
    json!({
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": question},
        ],
    })
}

/// A request's answer as its client saw it.
#[derive(Clone, Debug)]
pub struct Answer {
    /// `x-kvroute-response-cache`.
    pub cache: String,
    /// The answer's `id`.
    pub id: String,
}

/// Sends `question` as `tenant` to the router at `addr`.
pub async fn ask(
    client: &reqwest::Client,
    addr: SocketAddr,
    tenant: &str,
    question: &str,
) -> Result<Answer, String> {
    let asked = async {
        let (cache, v) = chat(client, addr, Some(tenant), &body(question)).await?;
        let id = v["id"].as_str().context("an answer without an id")?;
        anyhow::ensure!(
            v["choices"][0]["message"]["content"].is_string(),
            "an answer without content"
        );
        Ok(Answer {
            cache,
            id: id.to_owned(),
        })
    };
    asked.await.map_err(|e| format!("{e:#}"))
}

/// What one pair's replay gave.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// The tenant it was asked as.
    pub tenant: String,
    /// Whether the pair means the same.
    pub same: bool,
    /// `a`'s answer, then `b`'s.
    pub answers: Result<(Answer, Answer), String>,
}

impl Replayed {
    /// Whether `b` was a semantic hit.
    pub fn semantic_hit(&self) -> bool {
        matches!(&self.answers, Ok((_, b)) if b.cache == "semantic-hit")
    }
}

/// Each pair through the router at `addr`, [`CONCURRENCY`] pairs at once,
/// each under a tenant of its own: `a`, then `b` once `a` is answered.
pub async fn replay(client: &reqwest::Client, addr: SocketAddr, pairs: &[Pair]) -> Vec<Replayed> {
    futures_util::stream::iter(pairs)
        .map(|p| async move {
            let tenant = format!("pair-{}", p.id);
            let answers = async {
                let a = ask(client, addr, &tenant, &p.a).await?;
                let b = ask(client, addr, &tenant, &p.b).await?;
                Ok((a, b))
            };
            Replayed {
                same: p.same,
                answers: answers.await,
                tenant,
            }
        })
        .buffered(CONCURRENCY)
        .collect()
        .await
}

/// The hit rate (of pairs meaning the same) and false-hit rate (of the
/// others) of `replayed`, with their counts.
pub fn rates(replayed: &[Replayed]) -> ((usize, usize), (usize, usize)) {
    let count = |same: bool| {
        let of: Vec<&Replayed> = replayed.iter().filter(|r| r.same == same).collect();
        (of.iter().filter(|r| r.semantic_hit()).count(), of.len())
    };
    (count(true), count(false))
}

/// Runs the scenario into `s`.
pub async fn run(ctx: &Ctx, s: &mut Scenario) -> anyhow::Result<()> {
    let logs = ctx.out.join("logs").join("semantic_cache-embeddings");
    std::fs::create_dir_all(&logs)?;
    let mut embedder = Embedder::start(&ctx.bins, &logs).await?;
    let setup = Setup {
        router_yaml: router_yaml(&embedder, None, None),
        ..Setup::new(2)
    };
    let system = ctx.system("semantic_cache", setup).await?;
    embedder_checked(&system).await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    labelled_pairs(&system, &client, s).await?;
    killed(&system, &mut embedder, &client, s).await
}

/// Phase A.
async fn labelled_pairs(
    system: &System,
    client: &reqwest::Client,
    s: &mut Scenario,
) -> anyhow::Result<()> {
    let addr = system.router_addrs()[0];
    let pairs = pairs(PAIRS, PAIRS_FILE)?;
    let replayed = replay(client, addr, &pairs).await;
    let failed: Vec<&String> = (replayed.iter())
        .filter_map(|r| r.answers.as_ref().err())
        .collect();
    s.check(
        failed.is_empty(),
        format!(
            "every pair's questions are answered: {} of {} pairs failed{}",
            failed.len(),
            replayed.len(),
            failed
                .first()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        ),
    );
    let first_misses = (replayed.iter())
        .filter(|r| matches!(&r.answers, Ok((a, _)) if a.cache == "miss"))
        .count();
    s.check(
        first_misses == replayed.len(),
        format!(
            "each pair's first question is a miss: {first_misses} of {}",
            replayed.len()
        ),
    );
    let ((hits, same), (false_hits, other)) = rates(&replayed);
    let (hit_rate, false_rate) = (
        hits as f64 / same.max(1) as f64,
        false_hits as f64 / other.max(1) as f64,
    );
    s.figure("pairs", replayed.len() as f64);
    s.figure("hit_rate", hit_rate);
    s.figure("false_hit_rate", false_rate);
    s.goal(
        false_rate <= FALSE_HIT_GOAL,
        format!(
            "at the default threshold, at most {:.0} % of the pairs meaning something else are semantic hits: {false_hits} of {other} ({:.1} %)",
            FALSE_HIT_GOAL * 100.0,
            false_rate * 100.0
        ),
    );
    // Each false hit reported wrong, as its client would (a report counts
    // only from the hit's own tenant).
    let url = format!("http://{addr}/v1/kvroute/semantic-cache/false-hit");
    let mut accepted = 0;
    for r in replayed.iter().filter(|r| !r.same && r.semantic_hit()) {
        let Ok((_, b)) = &r.answers else { continue };
        let sent = (client.post(&url))
            .header(TENANT_HEADER, &r.tenant)
            .json(&json!({"id": b.id}))
            .send()
            .await;
        accepted += usize::from(sent.is_ok_and(|r| r.status().is_success()));
    }
    let counted = sum(
        &system.router_metrics(0).await?,
        "kvroute_semantic_cache_false_hits_total",
    );
    s.check(
        accepted == false_hits && counted == false_hits as f64,
        format!(
            "each false hit reported is accepted and counted: {accepted} accepted, {counted} counted, of {false_hits}"
        ),
    );
    Ok(())
}

/// One request of phase B.
#[derive(Debug)]
struct Shot {
    /// When it was sent, seconds since the phase began.
    t: f64,
    latency: f64,
    result: Result<Answer, String>,
}

impl Shot {
    fn cache(&self) -> &str {
        self.result.as_ref().map_or("failed", |a| a.cache.as_str())
    }
}

/// Phase B.
async fn killed(
    system: &System,
    embedder: &mut Embedder,
    client: &reqwest::Client,
    s: &mut Scenario,
) -> anyhow::Result<()> {
    let addr = system.router_addrs()[0];
    let errors_before = embedding_errors(system).await?;
    let start = Instant::now();
    let kill_at = BEFORE_KILL.as_secs_f64();
    let end = kill_at + AFTER_KILL.as_secs_f64();
    let mut tasks = tokio::task::JoinSet::new();
    let (tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let mut recent: VecDeque<u64> = VecDeque::new();
    let mut rng = SplitMix64::new(7);
    let (mut next, mut sent) = (0u64, 0u64);
    let mut shots = Vec::new();
    while start.elapsed().as_secs_f64() < end {
        if embedder.proc.is_some() && start.elapsed().as_secs_f64() >= kill_at {
            tokio::task::block_in_place(|| embedder.kill());
        }
        while let Ok(n) = answered.try_recv() {
            recent.push_back(n);
            if recent.len() > RECENT {
                recent.pop_front();
            }
        }
        // A new question, or a recent one in another case and punctuation.
        let (n, question) = if recent.is_empty() || rng.range(0, 1) == 0 {
            next += 1;
            (
                next,
                format!("Question {next}: how many moons does planet {next} have?"),
            )
        } else {
            let n = recent[rng.range(0, recent.len() as u64 - 1) as usize];
            let bang = "!".repeat(1 + sent as usize % 3);
            (
                n,
                format!("QUESTION {n} HOW MANY MOONS DOES PLANET {n} HAVE{bang}"),
            )
        };
        let (client, tx) = (client.clone(), tx.clone());
        let t = start.elapsed().as_secs_f64();
        tasks.spawn(async move {
            let asked = Instant::now();
            let result = ask(&client, addr, "phase-b", &question).await;
            if result.is_ok() {
                let _ = tx.send(n);
            }
            let latency = asked.elapsed().as_secs_f64();
            Shot { t, latency, result }
        });
        sent += 1;
        let due = Duration::from_secs_f64(sent as f64 / RATE);
        tokio::time::sleep(due.saturating_sub(start.elapsed())).await;
    }
    while let Some(shot) = tasks.join_next().await {
        shots.push(shot?);
    }
    let failed: Vec<&Shot> = shots.iter().filter(|x| x.result.is_err()).collect();
    s.figure("requests", shots.len() as f64);
    s.figure("failed", failed.len() as f64);
    s.check(
        failed.is_empty(),
        format!(
            "no request fails, the embeddings server up or killed: {} of {} failed{}",
            failed.len(),
            shots.len(),
            failed
                .first()
                .map(|x| format!(" (first: {:?})", x.result))
                .unwrap_or_default()
        ),
    );
    let (before, after): (Vec<&Shot>, Vec<&Shot>) = shots.iter().partition(|x| x.t < kill_at);
    let semantic = |x: &[&Shot]| x.iter().filter(|x| x.cache() == "semantic-hit").count();
    let (hits_before, hits_after) = (semantic(&before), semantic(&after));
    s.figure("semantic_hits_before_kill", hits_before as f64);
    s.figure("semantic_hits_after_kill", hits_after as f64);
    let errors = embedding_errors(system).await? - errors_before;
    s.figure("embedding_errors", errors);
    s.check(
        hits_before > 0 && hits_after == 0 && errors > 0.0,
        format!(
            "semantic hits before the kill ({hits_before} of {}), none after ({hits_after} of {}), where embedding errors are counted ({errors})",
            before.len(),
            after.len()
        ),
    );
    let p99 = |x: &[&Shot]| {
        let mut ms: Vec<f64> = x.iter().map(|x| x.latency * 1e3).collect();
        report::quantile(&mut ms, 0.99)
    };
    let undisturbed: Vec<&Shot> = (before.iter().copied())
        .filter(|x| x.cache() == "miss")
        .collect();
    let (undisturbed, after) = (p99(&undisturbed), p99(&after));
    s.figure("undisturbed_miss_latency_p99_ms", undisturbed);
    s.figure("killed_latency_p99_ms", after);
    s.goal(
        after <= undisturbed + SLACK_MS,
        format!(
            "a killed embeddings server costs a request nothing: p99 {after:.0} ms after the kill ≤ {undisturbed:.0} ms (undisturbed misses) + {SLACK_MS} ms"
        ),
    );
    Ok(())
}

/// Waits until every router of `system` has checked its embedder (the
/// semantic level is off until then, `kvroute_semantic_cache_embedder_healthy`).
pub async fn embedder_checked(system: &System) -> anyhow::Result<()> {
    let started = Instant::now();
    for i in 0..system.router_addrs().len() {
        loop {
            let text = system.router_metrics(i).await?;
            if sum(&text, "kvroute_semantic_cache_embedder_healthy") == 1.0 {
                break;
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(30),
                "router {i}'s embedder check has not passed within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Router-0's `kvroute_semantic_cache_embedding_errors_total`, summed.
async fn embedding_errors(system: &System) -> anyhow::Result<f64> {
    let text = system.router_metrics(0).await?;
    Ok(sum(&text, "kvroute_semantic_cache_embedding_errors_total"))
}
