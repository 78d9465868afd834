//! Criterion benchmarks of the router's whole routing decision, as the
//! request path makes it ([`Service::measure`]): read the body's fields,
//! render the chat template, tokenize, hash the block chain, look it up,
//! rank the endpoints, record the choice, and attribute its missed tokens.
//! Over 8 endpoints, for chats of 1 KiB, 32 KiB and 220 KiB:
//!
//! - `approx`: the default policy on the router's own memory;
//! - `exact`: the default policy on engine reports (each engine's index
//!   holds 65,536 blocks; one holds the request's prompt); `exact_unseen`:
//!   a prompt none holds;
//! - `builtin`: the built-in tokenizer and template; `hf`: a byte-level
//!   BPE tokenizer trained here with the `tokenizers` crate (its vocabulary
//!   size is printed; no model can be downloaded) with Qwen2.5's template;
//! - `follow_up`: a conversation's next turn, whose history was seen (with
//!   either tokenizer in exact mode); `first_turn`: a new conversation's;
//! - `round_robin`: a policy that reads no prompt;
//! - `semantic`: the semantic response cache's index, `nearest` in one
//!   partition of 1,000 and 10,000 questions of 256 dimensions, full (as
//!   many again inserted and evicted before), for a paraphrase of a stored
//!   question: `random` unit vectors (the hardest case for its graphs) or
//!   `low_rank` ones (near a subspace of 16 dimensions, as embeddings are,
//!   more or less); `exhaustive`: a plain scan of the same vectors. An
//!   insert's cost (its eviction and its share of the builds, amortized)
//!   and how often a paraphrase finds its question are printed.
//!
//! `cargo bench -p kvroute-router --bench decision`

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_core::contract::EngineCache;
use kvroute_core::policy::PolicyConfig;
use kvroute_core::rng::SplitMix64;
use kvroute_core::tokenize::{ChatMessage, ChatTemplate, Tokenizer, chat_prompt_tokens};
use kvroute_router::config::Config;
use kvroute_router::metrics::Metrics;
use kvroute_router::pool::{EndpointSpec, Pool};
use kvroute_router::request::Service;
use kvroute_router::response_cache::key::Key;
use kvroute_router::response_cache::semantic::index::{self, Index};
use kvroute_router::settings::Settings;
use kvroute_router::tenancy::Tenancy;
use serde_json::{Value, json};
use tokenizers::AddedToken;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

const ENDPOINTS: usize = 8;
const SIZES_KIB: [usize; 3] = [1, 32, 220];
const CHAT: &str = "/v1/chat/completions";
const QWEN_CONFIG: &str =
    include_str!("../../core/tests/fixtures/tokenize/qwen2.5-instruct.tokenizer_config.json");

/// Deterministic words from syllables, about 6 letters each.
fn words(seed: u64, bytes: usize) -> String {
    const SYLLABLES: [&str; 24] = [
        "ka", "ro", "ute", "pre", "fix", "blo", "ck", "en", "gi", "ne", "to", "ken", "ca", "che",
        "po", "ol", "re", "qu", "est", "la", "ten", "cy", "ser", "ve",
    ];
    let mut rng = SplitMix64::new(seed);
    let mut next = move || rng.next_u64();
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        let n = 1 + next() % 3;
        for _ in 0..n {
            text.push_str(SYLLABLES[(next() % 24) as usize]);
        }
        text.push(if next() % 12 == 0 { '.' } else { ' ' });
    }
    text.truncate(bytes);
    text
}

/// A byte-level BPE trained on 2 MiB of [`words`], with ChatML's special
/// tokens, as a `tokenizer.json`.
fn trained_tokenizer() -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("kvroute-bench-bpe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, words(7, 2 << 20)).unwrap();
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainerBuilder::new()
            .vocab_size(8192)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(
                specials
                    .iter()
                    .map(|t| AddedToken::from(*t, true))
                    .collect(),
            )
            .build(),
    );
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default()));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer
        .train_from_files(&mut trainer, vec![corpus.display().to_string()])
        .unwrap();
    eprintln!(
        "decision bench: trained a byte-level BPE, vocabulary {} tokens",
        tokenizer.get_vocab_size(true)
    );
    let json = tokenizer.to_string(false).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    json.into_bytes()
}

/// A chat of about `kib` KiB: a long system prompt and a short question.
fn chat(kib: usize, extra: Option<(&str, &str)>) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": words(1, kib * 1024)}),
        json!({"role": "user", "content": "What does the cache hold?"}),
    ];
    if let Some((answer, question)) = extra {
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": question}));
    }
    json!({"model": "bench", "messages": messages, "max_tokens": 16})
}

struct Setup {
    runtime: tokio::runtime::Runtime,
    service: Arc<Service>,
}

impl Setup {
    fn new(settings: Settings, exact: bool) -> Setup {
        Setup::with(settings, exact, Config::default())
    }

    fn with(settings: Settings, exact: bool, config: Config) -> Setup {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let metrics = Arc::new(Metrics::default());
        let pool = Pool::new(settings, &config.resilience, 256);
        pool.set_evicted_capacity(config.limits.max_evicted_blocks);
        let tenancy = Tenancy::load(&config.tenancy).unwrap();
        let service = Arc::new(Service::new(pool.clone(), metrics, tenancy, &config));
        let specs = (0..ENDPOINTS)
            .map(|i| EndpointSpec {
                name: format!("engine-{i}"),
                // Nothing listens: the decision makes no request.
                http: SocketAddr::from(([127, 0, 0, 1], 9)),
                cache: exact.then(|| SocketAddr::from(([127, 0, 0, 1], 9))),
                ready: true,
                draining: false,
                ready_since_ms: None,
                role: Default::default(),
            })
            .collect();
        let streams = pool.set_endpoints(specs);
        let setup = Setup { runtime, service };
        if exact {
            let engine = EngineCache::of(&pool.settings().hasher);
            let chain = setup.chain(&chat(SIZES_KIB[2], None));
            for (i, s) in streams.start.iter().enumerate() {
                // Each engine holds 65,536 blocks of other prompts; the
                // first holds this one's too.
                let mut blocks: Vec<u64> = (0..65_536u64)
                    .map(|b| (i as u64) << 40 | b.wrapping_mul(0x9e37_79b9))
                    .collect();
                if i == 0 {
                    blocks.extend(&chain);
                }
                pool.apply_snapshot(&s.name, s.generation, engine.clone(), 1 << 17, &blocks, &[])
                    .unwrap();
            }
        }
        setup
    }

    /// The chain the router computes for `body`.
    fn chain(&self, body: &Value) -> Vec<u64> {
        let bytes = Bytes::from(body.to_string());
        let explained = self
            .runtime
            .block_on(self.service.explain(CHAT, &HeaderMap::new(), bytes))
            .unwrap();
        explained
            .chain
            .iter()
            .map(|h| u64::from_str_radix(h, 16).unwrap())
            .collect()
    }

    /// Decides a 220 KiB conversation's first turn; returns it and the
    /// next turn's body, whose history this one is.
    fn seen_conversation(&self) -> (Value, Bytes) {
        let mut first = chat(SIZES_KIB[2], None);
        first["prompt_cache_key"] = json!("conversation-1");
        let mut next = chat(SIZES_KIB[2], Some(("It holds blocks.", "Which ones?")));
        next["prompt_cache_key"] = json!("conversation-1");
        self.decide(&Bytes::from(first.to_string()));
        (first, Bytes::from(next.to_string()))
    }

    fn decide(&self, body: &Bytes) -> String {
        self.runtime
            .block_on(self.service.measure(CHAT, &HeaderMap::new(), body.clone()))
            .unwrap()
    }
}

fn settings(hf: Option<&[u8]>, policy: PolicyConfig) -> Settings {
    let mut s = Settings::builtin(policy);
    if let Some(json) = hf {
        s.tokenizer = Arc::new(Tokenizer::from_tokenizer_json(json).unwrap());
        s.template = Arc::new(ChatTemplate::from_tokenizer_config(QWEN_CONFIG.as_bytes()).unwrap());
    }
    s
}

fn decisions(c: &mut Criterion) {
    let bpe = trained_tokenizer();
    for (tokenizer, hf) in [("builtin", None), ("hf", Some(bpe.as_slice()))] {
        let mut g = c.benchmark_group(format!("decision/{tokenizer}"));
        g.sample_size(10).measurement_time(Duration::from_secs(3));
        // Tokenization alone (render and encode), what exact mode cannot
        // avoid: the rest of an exact decision is its overhead.
        let s = settings(hf, PolicyConfig::default());
        for kib in SIZES_KIB {
            let body = chat(kib, None);
            let messages: Vec<ChatMessage> = body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            g.bench_with_input(
                BenchmarkId::new("tokenize_only", format!("{kib}KiB")),
                &messages,
                |b, m| {
                    b.iter(|| {
                        chat_prompt_tokens(&s.tokenizer, &s.template, m.clone())
                            .unwrap()
                            .len()
                    })
                },
            );
        }
        for (mode, exact) in [("approx", false), ("exact", true)] {
            let setup = Setup::new(settings(hf, PolicyConfig::default()), exact);
            for kib in SIZES_KIB {
                let body = Bytes::from(chat(kib, None).to_string());
                g.bench_with_input(
                    BenchmarkId::new(mode, format!("{kib}KiB")),
                    &body,
                    |b, body| b.iter(|| black_box(setup.decide(body))),
                );
            }
            if exact && hf.is_some() {
                // A conversation's next turn: its rendered prompt resumes
                // the previous turn's.
                let (mut first, next) = setup.seen_conversation();
                g.bench_with_input(
                    BenchmarkId::new("follow_up_exact", format!("{}KiB", SIZES_KIB[2])),
                    &next,
                    |b, body| b.iter(|| black_box(setup.decide(body))),
                );
                // A new conversation's first turn: computed whole and
                // remembered.
                let mut n = 0;
                g.bench_function(
                    BenchmarkId::new("first_turn_exact", format!("{}KiB", SIZES_KIB[2])),
                    |b| {
                        b.iter_batched(
                            || {
                                n += 1;
                                first["prompt_cache_key"] = json!(format!("new-{n}"));
                                Bytes::from(first.to_string())
                            },
                            |body| black_box(setup.decide(&body)),
                            criterion::BatchSize::PerIteration,
                        )
                    },
                );
            }
            if exact {
                // A prompt no engine holds: hashed only as far as its
                // first unheld block.
                let mut unseen = chat(SIZES_KIB[2], None);
                unseen["messages"][0]["content"] = json!(words(2, SIZES_KIB[2] * 1024));
                let body = Bytes::from(unseen.to_string());
                g.bench_with_input(
                    BenchmarkId::new("exact_unseen", format!("{}KiB", SIZES_KIB[2])),
                    &body,
                    |b, body| b.iter(|| black_box(setup.decide(body))),
                );
            }
        }
        g.finish();
    }

    let mut g = c.benchmark_group("decision/builtin");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    for (mode, exact) in [("approx", false), ("exact", true)] {
        let setup = Setup::new(settings(None, PolicyConfig::default()), exact);
        let (_, next) = setup.seen_conversation();
        g.bench_with_input(
            BenchmarkId::new(format!("follow_up_{mode}"), "220KiB"),
            &next,
            |b, body| b.iter(|| black_box(setup.decide(body))),
        );
    }
    // Flow control on (the default, above) and off: what the gate adds to
    // a request sent at once.
    let mut off = Config::default();
    off.flow_control.enabled = false;
    let setup = Setup::with(settings(None, PolicyConfig::default()), false, off);
    every_size(&mut g, "approx_flow_off", &setup);
    let setup = Setup::new(settings(None, PolicyConfig::RoundRobin), false);
    every_size(&mut g, "round_robin", &setup);
    g.finish();
}

/// `setup`'s decision for a chat of each of [`SIZES_KIB`], as `name`.
fn every_size(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    setup: &Setup,
) {
    for kib in SIZES_KIB {
        let body = Bytes::from(chat(kib, None).to_string());
        g.bench_with_input(
            BenchmarkId::new(name, format!("{kib}KiB")),
            &body,
            |b, body| b.iter(|| black_box(setup.decide(body))),
        );
    }
}

/// A random unit vector of `dim` dimensions.
fn unit(rng: &mut SplitMix64, dim: usize) -> Vec<f32> {
    let v: Vec<f32> = (0..dim)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect();
    normalized(v)
}

fn normalized(v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.into_iter().map(|x| x / norm).collect()
}

/// Inserts `vector` as question `n`, running the builds it hands out as
/// the router would (there on a blocking thread).
fn insert(index: &mut Index, partition: [u8; 32], vector: &[f32], n: u64) {
    let mut digest = [0; 32];
    digest[..8].copy_from_slice(&n.to_le_bytes());
    let key = Key {
        digest,
        model: "bench".into(),
    };
    let mut builds = index.insert(partition, vector, [7; 32], key).unwrap();
    while let Some(build) = builds.pop() {
        builds.extend(index.install(build.run()));
    }
}

/// Unit vectors near a subspace of 16 dimensions (as embeddings of text
/// are, more or less), each with its neighbour a paraphrase away.
struct LowRank {
    basis: Vec<Vec<f32>>,
}

impl LowRank {
    fn new(rng: &mut SplitMix64, dim: usize) -> Self {
        LowRank {
            basis: (0..16).map(|_| unit(rng, dim)).collect(),
        }
    }

    fn point(&self, z: &[f32], rng: &mut SplitMix64) -> Vec<f32> {
        let dim = self.basis[0].len();
        let noise = unit(rng, dim);
        let mut v: Vec<f32> = noise.iter().map(|e| e * 0.05).collect();
        for (b, w) in self.basis.iter().zip(z) {
            for (x, y) in v.iter_mut().zip(b) {
                *x += w * y;
            }
        }
        normalized(v)
    }

    /// A stored vector and a paraphrase of it.
    fn pair(&self, rng: &mut SplitMix64) -> (Vec<f32>, Vec<f32>) {
        let z = unit(rng, 16);
        let near: Vec<f32> = z
            .iter()
            .zip(unit(rng, 16))
            .map(|(a, e)| a + e * 0.25)
            .collect();
        (self.point(&z, rng), self.point(&near, rng))
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for ((l, x), y) in lanes.iter_mut().zip(x).zip(y) {
            *l += x * y;
        }
    }
    lanes.iter().sum()
}

fn semantic(c: &mut Criterion) {
    const DIM: usize = 256;
    let mut g = c.benchmark_group("semantic");
    g.sample_size(10).measurement_time(Duration::from_secs(2));
    let partition = index::partition(Some("tenant"), "bench");
    let mut rng = SplitMix64::new(11);
    let low_rank = LowRank::new(&mut rng, DIM);
    for data in ["random", "low_rank"] {
        for n in [1_000, 10_000] {
            // Filled twice over: the first half evicted, as in a full
            // cache; the second half's inserts are timed.
            let mut index = Index::new(n);
            let pairs: Vec<(Vec<f32>, Vec<f32>)> = (0..2 * n)
                .map(|_| match data {
                    "random" => {
                        let v = unit(&mut rng, DIM);
                        let noise = unit(&mut rng, DIM);
                        let q =
                            normalized(v.iter().zip(&noise).map(|(x, e)| x + e / 3.0).collect());
                        (v, q)
                    }
                    _ => low_rank.pair(&mut rng),
                })
                .collect();
            let mut started = std::time::Instant::now();
            for (i, (v, _)) in pairs.iter().enumerate() {
                if i == n {
                    started = std::time::Instant::now();
                }
                insert(&mut index, partition, v, i as u64);
            }
            let insert_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
            let live = || pairs.iter().enumerate().skip(n).step_by(n / 200);
            let queries: Vec<&Vec<f32>> = live().map(|(_, (_, q))| q).collect();
            let found = live()
                .filter(|(i, (_, q))| {
                    let hit = index.nearest(&partition, q, &[7; 32]).unwrap();
                    hit.is_some_and(|h| h.key.digest[..8] == (*i as u64).to_le_bytes())
                })
                .count();
            let similarity = pairs.iter().map(|(v, q)| dot(v, q)).sum::<f32>() / (2 * n) as f32;
            eprintln!(
                "semantic {data} {n}: an insert (its eviction, its share of the builds) {insert_us:.0} µs; \
                 a paraphrase (similarity {similarity:.3}) finds its question {found} times in {}; \
                 {} graphs, {} entries held, {} bytes",
                queries.len(),
                index.graphs(),
                index.held(),
                index.bytes(),
            );
            let mut i = 0;
            g.bench_function(BenchmarkId::new(format!("nearest_{data}"), n), |b| {
                b.iter(|| {
                    i = (i + 1) % queries.len();
                    black_box(index.nearest(&partition, queries[i], &[7; 32]).unwrap())
                })
            });
            if data == "random" {
                let vectors: Vec<&Vec<f32>> = pairs[n..].iter().map(|(v, _)| v).collect();
                g.bench_function(BenchmarkId::new("exhaustive", n), |b| {
                    b.iter(|| {
                        i = (i + 1) % queries.len();
                        let q = queries[i];
                        black_box(vectors.iter().map(|v| dot(v, q)).fold(f32::MIN, f32::max))
                    })
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, decisions, semantic);
criterion_main!(benches);
