//! The load: users of a few assistants whose long system prompts they
//! share (the `shared_prefix` shape of inference-perf; one session in five
//! has a short system prompt of its own instead), in sessions of one
//! to five turns whose history grows (a conversation carries a
//! `prompt_cache_key`; one-turn questions do not). Sessions arrive at a
//! fixed rate, open loop; every request streams; each is measured as a
//! client sees it. Requests go to the routers in turn, skipping a router
//! taken out of rotation, as a Service does with a router that is not
//! ready; behind a [`Rotation::retrying`] one, a request that got no
//! response byte at all is sent once more, to the other router, as a
//! client behind a Kubernetes Service would.
//!
//! The content is deterministic (a seed), so two runs send the same
//! prompts in the same order.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use kvroute_core::rng::SplitMix64;
use kvroute_core::tokenize::Tokenizer;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::system::{MODEL, pod_name};

/// The response header naming the endpoint that served a request.
const ENDPOINT_HEADER: &str = "x-kvroute-endpoint";

/// The workload's shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Assistants, each with its own system prompt.
    pub groups: usize,
    /// Tokens of each system prompt.
    pub system_tokens: usize,
    /// Tokens of a preamble every assistant's system prompt starts with
    /// (a common safety preamble or tool list), before its own
    /// `system_tokens`; 0 for none.
    pub preamble_tokens: usize,
    /// Sessions started per second.
    pub sessions_per_s: f64,
    /// How long sessions keep arriving.
    pub duration: Duration,
    /// Output tokens per reply.
    pub max_tokens: u64,
    /// Tokens of context a later turn pastes, at least and at most.
    pub pasted_tokens: (u64, u64),
    /// Seed of the content.
    pub seed: u64,
    /// Headers every request carries (a tenant, an objective).
    pub headers: &'static [(&'static str, &'static str)],
}

impl Shape {
    /// The suite's load for `pods` pods: 4 assistants per pod, each
    /// with a 768-token system prompt (48 blocks of 16 tokens: the
    /// prompts fill 75 % of the pool's cache, three times one engine's),
    /// half a session a second per pod, one to five turns per session,
    /// replies of 24 tokens.
    pub fn standard(pods: usize, duration: Duration) -> Shape {
        Shape {
            groups: 4 * pods,
            system_tokens: 768,
            preamble_tokens: 0,
            sessions_per_s: 0.5 * pods as f64,
            duration,
            max_tokens: 24,
            pasted_tokens: (150, 400),
            seed: 7,
            headers: &[],
        }
    }
}

/// How a request ended, as its client saw it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Streamed to the end with usage.
    Ok,
    /// Answered with an error status before any content.
    Refused(u16),
    /// No response byte at all: the connection was refused, or reset or
    /// closed before the status line (safe to send again elsewhere).
    Unanswered(String),
    /// A success status, then nothing before the body ended or broke.
    Failed(String),
    /// The stream began, then ended with an error event.
    BrokeWithError,
    /// The stream began, then stopped without an error event or usage.
    Truncated(String),
}

impl Outcome {
    /// Failed before any content reached the client.
    pub fn failed_unstarted(&self) -> bool {
        matches!(
            self,
            Outcome::Refused(_) | Outcome::Unanswered(_) | Outcome::Failed(_)
        )
    }

    /// Failed after content had reached the client: the stream broke.
    pub fn failed_started(&self) -> bool {
        matches!(self, Outcome::BrokeWithError | Outcome::Truncated(_))
    }
}

/// One request's measurement.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sample {
    /// When it was sent, seconds since the system's start.
    pub t: f64,
    /// The pod that served it, per the router's response header.
    pub endpoint: Option<String>,
    /// Its `x-request-id`, as the router answered it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// How it ended.
    pub outcome: Outcome,
    /// Prompt tokens, as the engine reported.
    pub prompt_tokens: u64,
    /// Cached prompt tokens, as the engine reported.
    pub cached_tokens: u64,
    /// Time to the first content, seconds.
    pub ttft: Option<f64>,
    /// Seconds between each content event and the one before it, as the
    /// client read them (inter-token latency).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub itl: Vec<f64>,
}

/// Every request as its client saw it, one JSON object per line, into
/// `path`: the per-request view behind the percentiles.
pub fn write_samples(path: &std::path::Path, samples: &[Sample]) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let mut out = String::new();
    for s in samples {
        out += &serde_json::to_string(s).context("serializing a sample")?;
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Which routers take requests: a Service's ready endpoints.
#[derive(Debug)]
pub struct Rotation {
    routers: Vec<SocketAddr>,
    in_rotation: Vec<AtomicBool>,
    next: AtomicUsize,
    /// Whether an unanswered request is sent once more, elsewhere.
    retry: bool,
    /// Requests sent a second time.
    retried: AtomicUsize,
}

impl Rotation {
    /// Every router in rotation; a failed request is not sent again.
    pub fn new(routers: Vec<SocketAddr>) -> Arc<Rotation> {
        Self::build(routers, false)
    }

    /// Every router in rotation; a request that got no response byte
    /// ([`Outcome::Unanswered`]) is sent once more, to the next router
    /// other than the one that failed it, as clients behind a Kubernetes
    /// Service retry a connection refused or reset.
    pub fn retrying(routers: Vec<SocketAddr>) -> Arc<Rotation> {
        Self::build(routers, true)
    }

    fn build(routers: Vec<SocketAddr>, retry: bool) -> Arc<Rotation> {
        let in_rotation = routers.iter().map(|_| AtomicBool::new(true)).collect();
        Arc::new(Rotation {
            routers,
            in_rotation,
            next: AtomicUsize::new(0),
            retry,
            retried: AtomicUsize::new(0),
        })
    }

    /// Whether router `i` is in rotation.
    pub fn is_in(&self, i: usize) -> bool {
        self.in_rotation[i].load(Ordering::SeqCst)
    }

    /// Requests sent a second time so far.
    pub fn retried(&self) -> usize {
        self.retried.load(Ordering::Relaxed)
    }

    /// Where a request `failed` at goes again: the next router after it,
    /// in rotation if any is.
    fn other(&self, failed: SocketAddr) -> SocketAddr {
        let n = self.routers.len();
        let at = self.routers.iter().position(|r| *r == failed).unwrap_or(0);
        let others = (1..n).map(|k| (at + k) % n);
        others
            .clone()
            .find(|i| self.in_rotation[*i].load(Ordering::SeqCst))
            .or_else(|| others.clone().next())
            .map_or(failed, |i| self.routers[i])
    }

    /// Takes router `i` out of rotation or puts it back.
    pub fn set(&self, i: usize, in_rotation: bool) {
        self.in_rotation[i].store(in_rotation, Ordering::SeqCst);
    }

    /// The next router in rotation (the first if none is).
    pub fn pick(&self) -> SocketAddr {
        let n = self.routers.len();
        for _ in 0..n {
            let i = self.next.fetch_add(1, Ordering::Relaxed) % n;
            if self.in_rotation[i].load(Ordering::SeqCst) {
                return self.routers[i];
            }
        }
        self.routers[0]
    }
}

const WORDS: &[&str] = &[
    "account", "answer", "before", "billing", "branch", "budget", "cache", "check", "client",
    "code", "contract", "data", "deploy", "detail", "error", "file", "flight", "function", "hotel",
    "invoice", "issue", "legal", "limit", "module", "order", "owner", "policy", "price", "project",
    "query", "refund", "release", "reply", "request", "review", "route", "rule", "service",
    "summary", "ticket", "train", "update", "user", "value", "version",
];

/// Text of at least `tokens` built-in tokens.
pub fn text(rng: &mut SplitMix64, tokenizer: &Tokenizer, start: &str, tokens: usize) -> String {
    let count = |s: &str| tokenizer.encode(s, false).map_or(s.len() / 4, |t| t.len());
    let mut out = start.to_owned();
    while count(&out) < tokens {
        for _ in 0..12 {
            out.push(' ');
            out.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        }
        out.push('.');
    }
    out
}

/// The system prompts of `shape`, each after the shared preamble if any.
pub fn system_prompts(shape: &Shape) -> Vec<String> {
    let tokenizer = Tokenizer::builtin();
    let mut rng = SplitMix64::new(shape.seed);
    // Its own stream, so the prompts after it are the same with or without.
    let preamble = match shape.preamble_tokens {
        0 => String::new(),
        n => {
            let mut rng = SplitMix64::new(shape.seed ^ 0x7072_6561_6d62_6c65);
            let start = "Every assistant follows these rules.";
            text(&mut rng, &tokenizer, start, n) + "\n\n"
        }
    };
    (0..shape.groups)
        .map(|g| {
            let start = format!("You are assistant {g}. Follow these instructions exactly.");
            preamble.clone() + &text(&mut rng, &tokenizer, &start, shape.system_tokens)
        })
        .collect()
}

/// Runs `shape` against the routers of `rotation`, measuring from `t0`,
/// until every session has ended. Sessions are capped at 256 at once
/// (arrivals wait beyond that).
pub async fn run(shape: Shape, rotation: Arc<Rotation>, t0: Instant) -> Vec<Sample> {
    let systems = Arc::new(system_prompts(&shape));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("an HTTP client without TLS builds");
    let limit = Arc::new(tokio::sync::Semaphore::new(256));
    let mut sessions = JoinSet::new();
    let count = (shape.sessions_per_s * shape.duration.as_secs_f64()).round() as u64;
    let start = tokio::time::Instant::now();
    for i in 0..count {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / shape.sessions_per_s))
            .await;
        let Ok(permit) = limit.clone().acquire_owned().await else {
            break;
        };
        let (systems, samples, client, rotation) = (
            systems.clone(),
            samples.clone(),
            client.clone(),
            rotation.clone(),
        );
        sessions.spawn(async move {
            session(shape, i, &systems, &client, &rotation, t0, &samples).await;
            drop(permit);
        });
    }
    while sessions.join_next().await.is_some() {}
    let mut samples = std::mem::take(&mut *samples.lock().unwrap_or_else(PoisonError::into_inner));
    samples.sort_by(|a: &Sample, b| a.t.total_cmp(&b.t));
    samples
}

/// Session `i`: one to five turns on one system prompt, each turn's
/// history the previous turns and replies.
async fn session(
    shape: Shape,
    i: u64,
    systems: &[String],
    client: &reqwest::Client,
    rotation: &Rotation,
    t0: Instant,
    samples: &Mutex<Vec<Sample>>,
) {
    let tokenizer = Tokenizer::builtin();
    let mut rng = SplitMix64::new(shape.seed ^ (i + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    // The first sessions take the system prompts in turn, so every
    // assistant is in use from the start; later ones pick at random, except
    // every fifth, whose system prompt is its own (a prefix no engine has:
    // new work for rendezvous hashing to place).
    let pick = rng.next_u64() % systems.len() as u64;
    let own;
    let system = if i >= systems.len() as u64 && i % 5 == 4 {
        own = text(&mut rng, &tokenizer, &format!("You are helper {i}."), 300);
        &own
    } else {
        &systems[if i < systems.len() as u64 { i } else { pick } as usize]
    };
    let turns = rng.range(1, 5);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for turn in 0..turns {
        // A question first; later turns paste more context.
        let words = if turn == 0 {
            rng.range(40, 120)
        } else {
            rng.range(shape.pasted_tokens.0, shape.pasted_tokens.1)
        } as usize;
        let user = text(
            &mut rng,
            &tokenizer,
            &format!("Question {i}.{turn}:"),
            words,
        );
        messages.push(json!({"role": "user", "content": user}));
        let mut body = json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": shape.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if turns > 1 {
            body["prompt_cache_key"] = json!(format!("conversation-{}-{i}", shape.seed));
        }
        let (sample, reply) = send(client, rotation, &body, shape.headers, t0).await;
        let ok = sample.outcome == Outcome::Ok;
        samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sample);
        if !ok {
            return;
        }
        messages.push(json!({"role": "assistant", "content": reply}));
    }
}

/// Sends `body` to the next router in `rotation`, and once more to another
/// when the rotation retries and no response byte came: one measurement,
/// from when it was first sent.
async fn send(
    client: &reqwest::Client,
    rotation: &Rotation,
    body: &Value,
    headers: &[(&str, &str)],
    t0: Instant,
) -> (Sample, String) {
    let addr = rotation.pick();
    let (first, reply) = chat(client, addr, body, headers, t0).await;
    if !(rotation.retry && matches!(first.outcome, Outcome::Unanswered(_))) {
        return (first, reply);
    }
    rotation.retried.fetch_add(1, Ordering::Relaxed);
    let (mut again, reply) = chat(client, rotation.other(addr), body, headers, t0).await;
    // The client waited for both attempts.
    again.ttft = again.ttft.map(|ttft| ttft + (again.t - first.t));
    again.t = first.t;
    (again, reply)
}

/// Sends one streaming chat completion to `addr` with `headers` and reads
/// it to the end: the measurement and the reply's text.
pub async fn chat(
    client: &reqwest::Client,
    addr: SocketAddr,
    body: &Value,
    headers: &[(&str, &str)],
    t0: Instant,
) -> (Sample, String) {
    stream(client, addr, "/v1/chat/completions", body, headers, t0).await
}

/// Sends one streaming request (a chat completion or a completion) to
/// `path` on `addr` with `headers` and reads it to the end: the
/// measurement and the reply's text.
pub async fn stream(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
    t0: Instant,
) -> (Sample, String) {
    let sent = Instant::now();
    let mut sample = Sample {
        t: sent.duration_since(t0).as_secs_f64(),
        endpoint: None,
        id: None,
        outcome: Outcome::Ok,
        prompt_tokens: 0,
        cached_tokens: 0,
        ttft: None,
        itl: Vec::new(),
    };
    let mut request = client.post(format!("http://{addr}{path}")).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => {
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                why = format!("{why}: {cause}");
                source = cause.source();
            }
            sample.outcome = Outcome::Unanswered(why);
            return (sample, String::new());
        }
    };
    sample.endpoint = response
        .headers()
        .get(ENDPOINT_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(|e| pod_name(e).to_owned());
    sample.id = (response.headers().get("x-request-id"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if !response.status().is_success() {
        sample.outcome = Outcome::Refused(response.status().as_u16());
        return (sample, String::new());
    }
    let mut events = Events::default();
    let mut bytes = response.bytes_stream();
    let mut ended = None;
    while let Some(chunk) = bytes.next().await {
        match chunk {
            Ok(chunk) => events.feed(&chunk, sent),
            Err(e) => {
                ended = Some(format!("reading the stream: {e}"));
                break;
            }
        }
    }
    sample.ttft = events.ttft.map(|d| d.as_secs_f64());
    sample.itl = events.itl;
    sample.outcome = match (events.error, events.usage, ended) {
        (true, _, _) => Outcome::BrokeWithError,
        (false, Some((prompt, cached)), None) => {
            sample.prompt_tokens = prompt;
            sample.cached_tokens = cached;
            Outcome::Ok
        }
        (false, _, ended) if events.any => Outcome::Truncated(
            ended.unwrap_or_else(|| "the stream ended without usage or an error event".into()),
        ),
        (false, _, ended) => {
            Outcome::Failed(ended.unwrap_or_else(|| "an empty response body".into()))
        }
    };
    (sample, events.reply)
}

/// What a chat completion's or a completion's server-sent events carried
/// so far.
#[derive(Debug, Default)]
struct Events {
    pending: Vec<u8>,
    any: bool,
    reply: String,
    ttft: Option<Duration>,
    /// When the last content came, and the gaps between them, seconds.
    last: Option<Duration>,
    itl: Vec<f64>,
    usage: Option<(u64, u64)>,
    error: bool,
}

impl Events {
    /// Takes more bytes; handles every complete event in them.
    fn feed(&mut self, bytes: &[u8], sent: Instant) {
        self.any |= !bytes.is_empty();
        self.pending.extend_from_slice(bytes);
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue; // [DONE]
                };
                self.error |= v.get("error").is_some();
                let choice = &v["choices"][0];
                let content = choice["delta"]["content"]
                    .as_str()
                    .or_else(|| choice["text"].as_str())
                    .unwrap_or("");
                if !content.is_empty() {
                    let now = sent.elapsed();
                    self.ttft.get_or_insert(now);
                    if let Some(last) = self.last.replace(now) {
                        self.itl.push((now - last).as_secs_f64());
                    }
                    self.reply.push_str(content);
                }
                if let Some(prompt) = v["usage"]["prompt_tokens"].as_u64() {
                    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0);
                    self.usage = Some((prompt, cached));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_classify_a_stream() {
        let sent = Instant::now();
        let mut e = Events::default();
        let token = r#"data: {"choices":[{"index":0,"delta":{"content":" the"}}]}"#;
        let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let all = format!("{token}\n\n{usage}\n\ndata: [DONE]\n\n");
        let (a, b) = all.as_bytes().split_at(17);
        e.feed(a, sent);
        e.feed(b, sent);
        assert!(e.ttft.is_some() && !e.error);
        assert_eq!((e.reply.as_str(), e.usage), (" the", Some((40, 32))));
        e.feed(b"data: {\"error\": {\"message\": \"x\"}}\n\n", sent);
        assert!(e.error);
    }

    #[test]
    fn events_read_a_completion_stream() {
        let sent = Instant::now();
        let mut e = Events::default();
        let token = r#"data: {"choices":[{"index":0,"text":" the","finish_reason":null}]}"#;
        let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":512,"prompt_tokens_details":{"cached_tokens":496}}}"#;
        e.feed(format!("{token}\n\n{usage}\n\n").as_bytes(), sent);
        assert!(e.ttft.is_some() && !e.error);
        assert_eq!((e.reply.as_str(), e.usage), (" the", Some((512, 496))));
    }

    #[test]
    fn a_retry_goes_to_another_router_in_rotation_if_any() {
        let routers: Vec<SocketAddr> = (1..=3)
            .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
            .collect();
        let r = Rotation::retrying(routers.clone());
        assert_eq!(r.other(routers[0]), routers[1]);
        assert_eq!(r.other(routers[2]), routers[0]);
        r.set(1, false);
        assert_eq!(r.other(routers[0]), routers[2]);
        r.set(2, false);
        r.set(0, false);
        // None in rotation: still another router.
        assert_eq!(r.other(routers[0]), routers[1]);
        let one = Rotation::retrying(routers[..1].to_vec());
        assert_eq!(one.other(routers[0]), routers[0]);
    }

    #[test]
    fn system_prompts_are_deterministic_and_long_enough() {
        let shape = Shape::standard(4, Duration::from_secs(1));
        let a = system_prompts(&shape);
        assert_eq!(a, system_prompts(&shape));
        let tokenizer = Tokenizer::builtin();
        for s in &a {
            let n = tokenizer.encode(s, false).unwrap().len();
            assert!((768..868).contains(&n), "{n}");
        }
    }

    #[test]
    fn a_preamble_is_shared_by_every_system_prompt_and_changes_nothing_else() {
        let plain = Shape::standard(2, Duration::from_secs(1));
        let shape = Shape {
            preamble_tokens: 500,
            ..plain
        };
        let (with, without) = (system_prompts(&shape), system_prompts(&plain));
        let preamble = with[0].strip_suffix(without[0].as_str()).unwrap();
        let tokenizer = Tokenizer::builtin();
        let n = tokenizer.encode(preamble, false).unwrap().len();
        assert!((500..600).contains(&n), "{n}");
        for (w, p) in with.iter().zip(&without) {
            assert_eq!(w.strip_prefix(preamble), Some(p.as_str()));
        }
    }
}
