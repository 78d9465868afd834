//! The demo's workload, and driving it through the router: tenants chatting
//! with a few assistants whose long system prompts they share, in
//! multi-turn conversations whose history grows turn by turn, plus one-off
//! questions. Every request streams; each is measured as a client sees it.
//!
//! The content is deterministic (a fixed seed), so both policies get the
//! same prompts; replies come from the engines (deterministic too).
//!
//! Not here: the fleet ([`super::stack`]) or the statistics
//! ([`super::report`]).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures_util::{StreamExt as _, TryStreamExt as _, stream};
use kvroute_core::rng::SplitMix64;
use kvroute_core::tokenize::Tokenizer;
use serde_json::{Value, json};

use super::stack::TENANT_HEADER;

/// The model the sims serve.
pub const MODEL: &str = "kvroute-sim";

/// The response header naming the engine that served a request.
const ENDPOINT_HEADER: &str = "x-kvroute-endpoint";

/// Tenants, as a gateway would name them.
const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];

/// The shared assistants and their system prompts' lengths in tokens.
const ASSISTANTS: [(&str, usize); 4] = [
    ("the support desk", 1800),
    ("the coding helper", 1400),
    ("the contracts reviewer", 1100),
    ("the travel planner", 1600),
];

/// How big the workload is.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Multi-turn conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Single questions without a conversation key.
    pub one_offs: usize,
    /// Sessions (conversations or one-offs) running at once.
    pub in_flight: usize,
    /// Time between session starts: users arrive one after another, not
    /// all at the same instant.
    pub arrival_gap: Duration,
    /// Seed of the content.
    pub seed: u64,
}

/// One user message and the reply length asked for.
#[derive(Clone, Debug)]
pub struct Turn {
    /// The user's message.
    pub user: String,
    /// The reply's length, tokens.
    pub max_tokens: u64,
}

/// A conversation (with a `prompt_cache_key`) or a one-off question
/// (without one, a single turn).
#[derive(Clone, Debug)]
pub struct Session {
    /// The conversation id, sent as `prompt_cache_key`.
    pub id: Option<String>,
    /// The tenant, sent in [`TENANT_HEADER`].
    pub tenant: &'static str,
    /// Index into [`Workload::systems`].
    pub system: usize,
    /// The user's turns, in order.
    pub turns: Vec<Turn>,
}

/// The whole workload, in submission order.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The system prompts.
    pub systems: Vec<String>,
    /// Conversations with one-offs interleaved.
    pub sessions: Vec<Session>,
    /// Sessions running at once.
    pub in_flight: usize,
    /// Time between session starts.
    pub arrival_gap: Duration,
}

/// What one request measured.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Zero-based turn within its session.
    pub turn: usize,
    /// The engine that served it (the router's endpoint header).
    pub endpoint: String,
    /// Prompt tokens, as the engine reported.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache, as it reported.
    pub cached_tokens: u64,
    /// From sending the request to the first content token.
    pub ttft: Duration,
}

fn pick<'a>(rng: &mut SplitMix64, items: &[&'a str]) -> &'a str {
    items[(rng.next_u64() % items.len() as u64) as usize]
}

const WORDS: &[&str] = &[
    "account", "answer", "always", "before", "billing", "booking", "branch", "budget", "cache",
    "case", "check", "client", "code", "contract", "customer", "data", "date", "deploy", "detail",
    "error", "every", "file", "flight", "follow", "function", "give", "hotel", "invoice", "issue",
    "keep", "later", "legal", "limit", "list", "make", "module", "must", "never", "note", "order",
    "owner", "party", "plan", "policy", "price", "project", "query", "refund", "release", "reply",
    "request", "review", "route", "rule", "safe", "service", "share", "short", "should", "step",
    "summary", "team", "term", "test", "ticket", "time", "train", "trip", "update", "user",
    "value", "version", "when", "with", "write", "your",
];

/// A sentence of 6 to 16 words.
fn sentence(rng: &mut SplitMix64) -> String {
    let n = rng.range(6, 16);
    let mut s = String::new();
    for i in 0..n {
        let w = pick(rng, WORDS);
        if i == 0 {
            let mut c = w.chars();
            s.extend(c.next().map(|c| c.to_ascii_uppercase()));
            s.push_str(c.as_str());
        } else {
            s.push(' ');
            s.push_str(w);
        }
    }
    s.push_str(". ");
    s
}

/// Text of about `tokens` tokens of the built-in tokenizer (a sentence
/// more at most), after `start`.
fn text(rng: &mut SplitMix64, tokenizer: &Tokenizer, start: &str, tokens: usize) -> String {
    let count = |s: &str| tokenizer.encode(s, false).map_or(s.len() / 4, |t| t.len());
    let mut out = start.to_owned();
    while count(out.trim_end()) < tokens {
        out.push_str(&sentence(rng));
    }
    out.trim_end().to_owned()
}

impl Workload {
    /// The workload of `shape`.
    pub fn new(shape: Shape) -> Self {
        let tokenizer = Tokenizer::builtin();
        let mut rng = SplitMix64::new(shape.seed);
        let systems = ASSISTANTS
            .iter()
            .map(|(name, tokens)| {
                let start = format!("You are {name}. Follow these instructions exactly. ");
                text(&mut rng, &tokenizer, &start, *tokens)
            })
            .collect();
        let mut sessions = Vec::new();
        let one_off_every = match shape.one_offs {
            0 => usize::MAX,
            n => shape.conversations.div_ceil(n).max(1),
        };
        let mut one_offs = 0;
        for c in 0..shape.conversations {
            let tenant = TENANTS[c % TENANTS.len()];
            let turns = (0..shape.turns)
                .map(|t| {
                    // First a question; later turns paste more context.
                    let tokens = if t == 0 {
                        rng.range(80, 200)
                    } else {
                        rng.range(150, 400)
                    };
                    Turn {
                        user: text(&mut rng, &tokenizer, "", tokens as usize),
                        max_tokens: rng.range(16, 40),
                    }
                })
                .collect();
            sessions.push(Session {
                id: Some(format!("{tenant}-conv-{c}")),
                tenant,
                system: (rng.next_u64() % ASSISTANTS.len() as u64) as usize,
                turns,
            });
            if (c + 1) % one_off_every == 0 && one_offs < shape.one_offs {
                one_offs += 1;
                let tokens = rng.range(40, 160) as usize;
                sessions.push(Session {
                    id: None,
                    tenant: TENANTS[(c + 1) % TENANTS.len()],
                    system: (rng.next_u64() % ASSISTANTS.len() as u64) as usize,
                    turns: vec![Turn {
                        user: text(&mut rng, &tokenizer, "", tokens),
                        max_tokens: rng.range(16, 48),
                    }],
                });
            }
        }
        Workload {
            systems,
            sessions,
            in_flight: shape.in_flight,
            arrival_gap: shape.arrival_gap,
        }
    }

    /// Distinct tenants.
    pub fn tenants(&self) -> usize {
        let mut t: Vec<&str> = self.sessions.iter().map(|s| s.tenant).collect();
        t.sort_unstable();
        t.dedup();
        t.len()
    }

    /// Each system prompt's length in built-in tokenizer tokens.
    pub fn system_tokens(&self) -> Vec<usize> {
        let tokenizer = Tokenizer::builtin();
        self.systems
            .iter()
            .map(|s| tokenizer.encode(s, false).map_or(0, |t| t.len()))
            .collect()
    }

    /// Requests in the workload.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// Sends the whole workload to the router at `base` (`http://host:port`):
    /// sessions start [`Workload::arrival_gap`] apart, at most
    /// [`Workload::in_flight`] at a time. Fails on the first request that
    /// fails.
    pub async fn run(&self, client: &reqwest::Client, base: &str) -> anyhow::Result<Vec<Sample>> {
        let url = format!("{base}/v1/chat/completions");
        let start = tokio::time::Instant::now();
        let gap = self.arrival_gap;
        let url = &url;
        let per_session: Vec<Vec<Sample>> =
            stream::iter(self.sessions.iter().enumerate().map(|(i, s)| async move {
                tokio::time::sleep_until(start + gap * i as u32).await;
                session(client, url, &self.systems[s.system], s).await
            }))
            .buffer_unordered(self.in_flight.max(1))
            .try_collect()
            .await?;
        Ok(per_session.into_iter().flatten().collect())
    }
}

/// Runs one session's turns in order, appending each reply to the history.
async fn session(
    client: &reqwest::Client,
    url: &str,
    system: &str,
    s: &Session,
) -> anyhow::Result<Vec<Sample>> {
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut samples = Vec::with_capacity(s.turns.len());
    for (turn, t) in s.turns.iter().enumerate() {
        messages.push(json!({"role": "user", "content": t.user}));
        let mut body = json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": t.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(id) = &s.id {
            body["prompt_cache_key"] = json!(id);
        }
        let (sample, reply) = chat(client, url, s.tenant, &body, turn)
            .await
            .with_context(|| {
                let id = s.id.as_deref().unwrap_or("one-off");
                format!("{id}, turn {}", turn + 1)
            })?;
        messages.push(json!({"role": "assistant", "content": reply}));
        samples.push(sample);
    }
    Ok(samples)
}

/// Sends one streaming chat completion and reads it to the end: the
/// measurement and the reply's text.
async fn chat(
    client: &reqwest::Client,
    url: &str,
    tenant: &str,
    body: &Value,
    turn: usize,
) -> anyhow::Result<(Sample, String)> {
    let sent = Instant::now();
    let response = client
        .post(url)
        .header(TENANT_HEADER, tenant)
        .json(body)
        .send()
        .await
        .context("sending the request")?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        anyhow::bail!("the router answered {status}: {}", text.trim());
    }
    let endpoint = response
        .headers()
        .get(ENDPOINT_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("unknown")
        .to_owned();
    let mut events = Events::default();
    let mut bytes = response.bytes_stream();
    while let Some(chunk) = bytes.next().await {
        events.feed(&chunk.context("reading the stream")?, sent)?;
    }
    let ttft = events.ttft.context("the stream carried no content")?;
    let (prompt_tokens, cached_tokens) = events
        .usage
        .context("the stream ended without a usage chunk")?;
    let sample = Sample {
        turn,
        endpoint,
        prompt_tokens,
        cached_tokens,
        ttft,
    };
    Ok((sample, events.reply))
}

/// What a chat completion's server-sent events carried so far.
#[derive(Debug, Default)]
struct Events {
    pending: Vec<u8>,
    reply: String,
    ttft: Option<Duration>,
    /// `(prompt_tokens, cached_tokens)` of the usage chunk.
    usage: Option<(u64, u64)>,
}

impl Events {
    /// Takes more bytes; handles every complete event in them.
    fn feed(&mut self, bytes: &[u8], sent: Instant) -> anyhow::Result<()> {
        self.pending.extend_from_slice(bytes);
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                self.data(data, sent)?;
            }
        }
        Ok(())
    }

    fn data(&mut self, data: &str, sent: Instant) -> anyhow::Result<()> {
        if data == "[DONE]" {
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).context("a stream chunk is not JSON")?;
        if let Some(error) = v.get("error") {
            anyhow::bail!("the stream broke: {error}");
        }
        // The first chunk only announces the role: TTFT waits for text.
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if !content.is_empty() {
            self.ttft.get_or_insert_with(|| sent.elapsed());
            self.reply.push_str(content);
        }
        let usage = &v["usage"];
        if let Some(prompt) = usage["prompt_tokens"].as_u64() {
            let cached = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            self.usage = Some((prompt, cached));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            conversations: 8,
            turns: 3,
            one_offs: 4,
            in_flight: 4,
            arrival_gap: Duration::ZERO,
            seed: 7,
        }
    }

    #[test]
    fn the_workload_is_deterministic_and_shaped_as_asked() {
        let a = Workload::new(shape());
        let b = Workload::new(shape());
        assert_eq!(a.systems, b.systems);
        assert_eq!(a.requests(), 8 * 3 + 4);
        let conversations = a.sessions.iter().filter(|s| s.id.is_some()).count();
        assert_eq!(conversations, 8);
        for (x, y) in a.sessions.iter().zip(&b.sessions) {
            assert_eq!(x.id, y.id);
            assert_eq!(x.turns[0].user, y.turns[0].user);
        }
        let tokenizer = Tokenizer::builtin();
        for (system, (_, tokens)) in a.systems.iter().zip(ASSISTANTS) {
            let n = tokenizer.encode(system, false).unwrap().len();
            assert!((tokens..tokens + 40).contains(&n), "{n} vs {tokens}");
        }
    }

    #[test]
    fn events_yield_the_reply_ttft_and_usage() {
        let mut e = Events::default();
        let sent = Instant::now();
        let role = r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        e.feed(format!("{role}\n\n").as_bytes(), sent).unwrap();
        assert!(e.ttft.is_none());
        let token = r#"data: {"choices":[{"index":0,"delta":{"content":" the"}}]}"#;
        let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let all = format!("{token}\n\n{usage}\n\ndata: [DONE]\n\n");
        let (a, b) = all.as_bytes().split_at(17);
        e.feed(a, sent).unwrap();
        e.feed(b, sent).unwrap();
        assert!(e.ttft.is_some());
        assert_eq!(e.reply, " the");
        assert_eq!(e.usage, Some((40, 32)));
        let err = e.feed(b"data: {\"error\": {\"message\": \"x\"}}\n\n", sent);
        assert!(err.is_err());
    }
}
