//! The engine: a FIFO scheduler over the block pool, one serial prefill
//! server, per-request decode, and a fan-out of every cache change to
//! WatchCache subscribers in the order the cache changed.
//!
//! Timing: a request is admitted when fewer than `max_num_seqs` run and the
//! pool can hold its prompt while keeping the blocks every running request
//! may still need for its output (so decode never runs out of blocks).
//! Its prefill starts when the prefill server is free and takes
//! `overhead + uncached tokens / rate`; then one token every `itl`. All
//! delays are divided by `time_scale`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use kvroute_core::hash::{BlockDigest, BlockExtras, BlockHash, BlockHasher, HashConfig, Lora};
use kvroute_core::tokenize::Tokenizer;
use kvroute_proto::feed::{self, Feed, Source};
use kvroute_proto::v1::{self, cache_update::Update};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::config::Config;
use crate::kv_events::{self, Publisher};
use crate::metrics::Metrics;
use crate::pool::{BlockPool, Content, PoolEvent};

/// The engine's own load, as WatchCache reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Requests waiting for admission.
    pub waiting: u32,
    /// Requests admitted and not finished.
    pub running: u32,
    /// Share of blocks in use.
    pub kv_usage: f32,
    /// Blocks in use.
    pub used_blocks: u64,
    /// Prompt tokens still to prefill: admitted requests' uncached tokens
    /// not yet prefilled, and every token of waiting requests.
    pub queued_prefill_tokens: u64,
    /// Prefill rate, tokens per second (time scale included); `None` when
    /// prefill is instant.
    pub prefill_tokens_per_s: Option<f64>,
}

impl LoadReport {
    /// As WatchCache sends it.
    pub fn to_proto(self) -> v1::LoadReport {
        v1::LoadReport {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage,
            used_blocks: self.used_blocks,
            queued_prefill_tokens: Some(self.queued_prefill_tokens),
            prefill_tokens_per_s: self.prefill_tokens_per_s,
        }
    }
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EngineError {
    /// Prompt plus output exceeds the model length.
    #[error(
        "This model's maximum context length is {max} tokens. However, you requested {requested} tokens ({prompt} in the messages, {output} in the completion). Please reduce the length of the messages or completion."
    )]
    TooLong {
        /// The limit.
        max: u64,
        /// What was asked.
        requested: u64,
        /// Prompt tokens.
        prompt: u64,
        /// Output tokens.
        output: u64,
    },
    /// The request can never fit in the cache.
    #[error("the request needs {needed} KV blocks but the cache has {capacity}")]
    TooLarge {
        /// Blocks needed.
        needed: usize,
        /// Blocks in the pool.
        capacity: usize,
    },
    /// The engine dropped the request before admitting it.
    #[error("the engine stopped before admitting the request")]
    Stopped,
    /// The prompt has no tokens.
    #[error("the prompt must contain at least one token")]
    EmptyPrompt,
}

/// What a request asks the engine for.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens to generate.
    pub max_tokens: u64,
    /// vLLM `cache_salt`, hashed into block 0.
    pub cache_salt: Option<String>,
    /// The LoRA adapter the request names, hashed into every block.
    pub lora: Option<Lora>,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    /// Its text.
    pub text: &'static str,
    /// Zero-based position in the output.
    pub index: u64,
    /// Whether it is the last one (the output reached `max_tokens`).
    pub last: bool,
}

/// An admitted request: its cache hit and its tokens as they come.
#[derive(Debug)]
pub struct Generation {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens; ends after the last one. Dropping it cancels the
    /// request and frees its blocks.
    pub tokens: mpsc::Receiver<Token>,
}

struct Waiter {
    hashes: Vec<BlockHash>,
    num_tokens: usize,
    future_blocks: usize,
    tx: oneshot::Sender<Admission>,
}

#[derive(Debug)]
struct Admission {
    blocks: Vec<u32>,
    cached_blocks: usize,
    future_blocks: usize,
    prefill_start: Instant,
    prefill_end: Instant,
}

struct State {
    pool: BlockPool,
    waiting: VecDeque<Waiter>,
    running: u32,
    /// Blocks promised to running requests' remaining output.
    reserved: usize,
    prefill_free_at: Instant,
    /// Admitted prefills not yet finished, in FIFO order: (start, end,
    /// uncached tokens).
    prefills: VecDeque<(Instant, Instant, u64)>,
    feed: Feed,
    /// vLLM-format KV events, when the engine publishes them.
    kv_events: Option<Publisher>,
    metrics: Metrics,
}

/// A simulated engine. Cheap to share behind an `Arc`.
pub struct Engine {
    config: Config,
    hasher: BlockHasher,
    state: Mutex<State>,
    /// Woken when a request arrives: its work is news for routers.
    arrived: Notify,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.config.model)
            .finish_non_exhaustive()
    }
}

/// Words the engine generates, each one built-in token with its leading
/// space (four letters at most).
const WORDS: [&str; 32] = [
    " the", " of", " and", " to", " in", " is", " that", " it", " for", " on", " with", " as",
    " was", " at", " by", " be", " this", " from", " or", " an", " are", " not", " but", " have",
    " they", " one", " all", " can", " more", " time", " when", " will",
];

fn word_ids() -> &'static [u32; 32] {
    static IDS: OnceLock<[u32; 32]> = OnceLock::new();
    IDS.get_or_init(|| {
        let tokenizer = Tokenizer::builtin();
        WORDS.map(|w| {
            let ids = tokenizer
                .encode(w, false)
                .expect("the builtin tokenizer never fails");
            debug_assert_eq!(ids.len(), 1, "{w:?}");
            ids[0]
        })
    })
}

impl Engine {
    /// An engine for `config` (validated by the caller).
    pub fn new(config: Config) -> Result<Arc<Self>, kvroute_core::hash::HashError> {
        let hasher = BlockHasher::new(HashConfig {
            algo: config.hash_algo,
            block_size: config.block_size as usize,
            seed: config.hash_seed.clone(),
            ..HashConfig::default()
        })?;
        let state = State {
            pool: BlockPool::new(config.num_gpu_blocks as usize, config.block_size as usize),
            waiting: VecDeque::new(),
            running: 0,
            reserved: 0,
            prefill_free_at: Instant::now(),
            prefills: VecDeque::new(),
            feed: Feed::new(config.subscriber_buffer as usize),
            kv_events: None,
            metrics: Metrics::new(&config.model, config.max_model_len),
        };
        Ok(Arc::new(Engine {
            config,
            hasher,
            state: Mutex::new(state),
            arrived: Notify::new(),
        }))
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The block hasher (the engine's vLLM hashing settings).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug; the state is still
        // consistent enough to serve, so do not cascade it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn scaled(&self, ms: f64) -> Duration {
        Duration::from_secs_f64((ms / 1000.0 / self.config.time_scale).max(0.0))
    }

    /// Queues `job`, waits for its admission and starts generating.
    pub async fn generate(self: &Arc<Self>, job: Job) -> Result<Generation, EngineError> {
        let prompt_len = job.prompt.len() as u64;
        if prompt_len == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        let total = prompt_len + job.max_tokens;
        if total > self.config.max_model_len {
            return Err(EngineError::TooLong {
                max: self.config.max_model_len,
                requested: total,
                prompt: prompt_len,
                output: job.max_tokens,
            });
        }
        let bs = self.config.block_size as usize;
        let capacity = self.config.num_gpu_blocks as usize;
        let needed = (total as usize).div_ceil(bs);
        if needed > capacity {
            return Err(EngineError::TooLarge { needed, capacity });
        }
        let extras = BlockExtras {
            lora: job.lora.as_ref(),
            cache_salt: job.cache_salt.as_deref(),
        };
        let digests = self.hasher.digests(&job.prompt, extras);
        let hashes: Vec<BlockHash> = digests.iter().map(BlockDigest::to_u64).collect();
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.lock();
            state.waiting.push_back(Waiter {
                hashes: hashes.clone(),
                num_tokens: job.prompt.len(),
                future_blocks: needed - job.prompt.len().div_ceil(bs),
                tx,
            });
            self.admit(&mut state);
        }
        self.arrived.notify_one();
        let admission = rx.await.map_err(|_| EngineError::Stopped)?;
        let cached_tokens = (admission.cached_blocks * bs) as u64;
        let (token_tx, token_rx) = mpsc::channel(64);
        let run = Run {
            engine: self.clone(),
            blocks: admission.blocks,
            future_blocks: admission.future_blocks,
        };
        let engine = self.clone();
        tokio::spawn(async move {
            engine
                .run(
                    run,
                    job,
                    digests,
                    hashes,
                    admission.cached_blocks,
                    (admission.prefill_start, admission.prefill_end),
                    token_tx,
                )
                .await
        });
        Ok(Generation {
            cached_tokens,
            prompt_tokens: prompt_len,
            tokens: token_rx,
        })
    }

    /// Admits waiting requests in FIFO order while they fit.
    fn admit(&self, state: &mut State) {
        let bs = self.config.block_size as u64;
        while state.running < self.config.max_num_seqs {
            let Some(front) = state.waiting.front() else {
                break;
            };
            if front.tx.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            let reserve = state.reserved + front.future_blocks;
            let Some(alloc) = state
                .pool
                .allocate(&front.hashes, front.num_tokens, reserve)
            else {
                break;
            };
            let waiter = state.waiting.pop_front().expect("front exists");
            let uncached = waiter.num_tokens as u64 - alloc.cached_blocks as u64 * bs;
            let rate_ms = if self.config.prefill_tokens_per_s > 0.0 {
                uncached as f64 * 1000.0 / self.config.prefill_tokens_per_s
            } else {
                0.0
            };
            let duration = self.scaled(self.config.prefill_overhead_ms + rate_ms);
            let start = state.prefill_free_at.max(Instant::now());
            state.prefill_free_at = start + duration;
            state
                .prefills
                .push_back((start, start + duration, uncached));
            let admission = Admission {
                blocks: alloc.blocks,
                cached_blocks: alloc.cached_blocks,
                future_blocks: waiter.future_blocks,
                prefill_start: start,
                prefill_end: start + duration,
            };
            state.running += 1;
            state.reserved += waiter.future_blocks;
            if let Err(admission) = waiter.tx.send(admission) {
                // The client left between the check and now.
                state.pool.free(&admission.blocks);
                state.running -= 1;
                state.reserved -= admission.future_blocks;
            }
        }
        self.publish(state);
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        self: Arc<Self>,
        mut run: Run,
        job: Job,
        mut digests: Vec<BlockDigest>,
        hashes: Vec<BlockHash>,
        cached_blocks: usize,
        (prefill_start, prefill_end): (Instant, Instant),
        tx: mpsc::Sender<Token>,
    ) {
        let bs = self.config.block_size as usize;
        let arrival = Instant::now();
        wait_until(prefill_end).await;
        {
            let mut state = self.lock();
            let mut parent = cached_blocks.checked_sub(1).map(|i| hashes[i]);
            for (i, &hash) in hashes.iter().enumerate().skip(cached_blocks) {
                let content = self.content(&job, i, &job.prompt[i * bs..(i + 1) * bs]);
                state.pool.cache(run.blocks[i], hash, parent, content);
                parent = Some(hash);
            }
            state
                .metrics
                .observe_ttft((Instant::now() - arrival).as_secs_f64());
            let prefill = (prefill_end - prefill_start).as_secs_f64();
            state
                .metrics
                .observe_prefill(job.prompt.len() as u64, prefill);
            self.publish(&mut state);
        }
        let extras = BlockExtras {
            lora: job.lora.as_ref(),
            cache_salt: job.cache_salt.as_deref(),
        };
        let seed = xxh3_64(bytes_of(&job.prompt).as_slice());
        let mut tokens = job.prompt;
        let itl = self.scaled(self.config.itl_ms);
        for index in 0..job.max_tokens {
            if index > 0 && !itl.is_zero() {
                tokio::time::sleep(itl).await;
            }
            let word =
                (xxh3_64_with_seed(&index.to_le_bytes(), seed) % WORDS.len() as u64) as usize;
            tokens.push(word_ids()[word]);
            {
                let mut state = self.lock();
                if tokens.len() > run.blocks.len() * bs {
                    let block = state.pool.grow().expect("reserved at admission");
                    run.blocks.push(block);
                    run.future_blocks -= 1;
                    state.reserved -= 1;
                }
                if tokens.len().is_multiple_of(bs) {
                    let i = tokens.len() / bs - 1;
                    let parent = i
                        .checked_sub(1)
                        .map_or(self.hasher.none_hash(), |p| digests[p]);
                    let digest = self
                        .hasher
                        .block_digest(&parent, i, &tokens[i * bs..], extras);
                    let parent_hash = i.checked_sub(1).map(|p| digests[p].to_u64());
                    let content = Content {
                        tokens: &tokens[i * bs..],
                        lora: self.lora_id(job.lora.as_ref()),
                        salt: None,
                    };
                    state
                        .pool
                        .cache(run.blocks[i], digest.to_u64(), parent_hash, content);
                    digests.push(digest);
                    self.publish(&mut state);
                }
                state.metrics.generation_tokens += 1;
            }
            let token = Token {
                text: WORDS[word],
                index,
                last: index + 1 == job.max_tokens,
            };
            if tx.send(token).await.is_err() {
                return; // the client left: `run` frees the blocks
            }
        }
        self.lock().metrics.requests_finished += 1;
    }

    /// vLLM's `lora_id` and name of an adapter: its position among the
    /// served adapters, from 1.
    fn lora_id<'a>(&self, lora: Option<&'a Lora>) -> Option<(u64, &'a str)> {
        let lora = lora?;
        let modules = &self.config.lora_modules;
        let id = modules.iter().position(|l| l.name == lora.name);
        Some((id.map_or(0, |i| i as u64 + 1), lora.name.as_str()))
    }

    /// What block `i` of `job`'s prompt, `tokens`, holds besides its hash.
    fn content<'a>(&self, job: &'a Job, i: usize, tokens: &'a [u32]) -> Content<'a> {
        Content {
            tokens,
            lora: self.lora_id(job.lora.as_ref()),
            salt: if i == 0 {
                job.cache_salt.as_deref()
            } else {
                None
            },
        }
    }

    /// Sends the pool's pending events to every subscriber, in order, and
    /// publishes them as one vLLM event batch.
    fn publish(&self, state: &mut State) {
        let events = state.pool.take_events();
        if events.is_empty() {
            return;
        }
        if let Some(kv) = &state.kv_events {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64();
            kv.send(kv_events::encode_batch(
                ts,
                &events,
                self.config.block_size,
                0,
            ));
        }
        for event in events {
            let update = match event {
                PoolEvent::Stored { hashes, parent, .. } => Update::Stored(v1::BlocksStored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    medium: String::new(),
                }),
                PoolEvent::Removed(hashes) => Update::Removed(v1::BlocksRemoved {
                    block_hashes: hashes,
                    medium: String::new(),
                }),
                PoolEvent::Cleared => Update::Cleared(v1::AllBlocksCleared::default()),
            };
            state.feed.change(update);
        }
    }

    fn load(&self, state: &mut State) -> LoadReport {
        let capacity = state.pool.capacity();
        let now = Instant::now();
        while state
            .prefills
            .front()
            .is_some_and(|&(_, end, _)| end <= now)
        {
            state.prefills.pop_front();
        }
        // The prefill in progress counts for its unfinished share.
        let admitted: f64 = state
            .prefills
            .iter()
            .map(|&(start, end, tokens)| {
                let total = (end - start).as_secs_f64();
                let left = (end - start.max(now)).as_secs_f64();
                if total > 0.0 {
                    tokens as f64 * left / total
                } else {
                    0.0
                }
            })
            .sum();
        let waiting: usize = state.waiting.iter().map(|w| w.num_tokens).sum();
        let rate = self.config.prefill_tokens_per_s * self.config.time_scale;
        LoadReport {
            waiting: state.waiting.len() as u32,
            running: state.running,
            kv_usage: state.pool.usage(),
            used_blocks: (capacity - state.pool.free_blocks()) as u64,
            queued_prefill_tokens: admitted.round() as u64 + waiting as u64,
            prefill_tokens_per_s: (rate > 0.0).then_some(rate),
        }
    }

    /// The cache's configuration, as WatchCache reports it.
    pub fn cache_config(&self) -> v1::CacheConfig {
        let c = &self.config;
        v1::CacheConfig {
            block_size: c.block_size,
            hash_algorithm: v1::HashAlgorithm::from(c.hash_algo).into(),
            hash_seed_set: c.hash_seed.is_some(),
            capacity_blocks: c.num_gpu_blocks,
            model: c.model.clone(),
            none_hash: Some(self.hasher.none_hash().to_u64()),
            hash_verification_failed: false,
        }
    }

    /// Starts publishing vLLM's KV events (the engine's changes from now
    /// on) through `publisher`.
    pub fn publish_kv_events(&self, publisher: Publisher) {
        self.lock().kv_events = Some(publisher);
    }

    /// Resolves once a request has arrived since the last call.
    pub async fn arrival(&self) {
        self.arrived.notified().await;
    }

    /// Sends a load report to every subscriber.
    pub fn report_load(&self) {
        let mut state = self.lock();
        let load = self.load(&mut state).to_proto();
        state.feed.load(load);
    }

    /// Ends every WatchCache stream (on shutdown).
    pub fn end_streams(&self) {
        self.lock().feed.end_streams();
    }

    /// Subscribers connected.
    pub fn subscribers(&self) -> usize {
        self.lock().feed.subscribers()
    }

    /// Restarts the cache: a new incarnation with nothing cached; every
    /// subscriber's stream ends (they resubscribe for a snapshot), and KV
    /// event numbering starts over, as when vLLM restarts.
    pub fn restart_cache(&self) {
        let mut state = self.lock();
        state.pool.forget();
        state.feed.restart();
        if let Some(kv) = &state.kv_events {
            kv.restart();
        }
    }

    /// vLLM's `reset_prefix_cache`: drops every cached block; refused while
    /// requests run.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut state = self.lock();
        let done = state.pool.reset();
        self.publish(&mut state);
        done
    }

    /// Every cached block now (for tests and debugging).
    pub fn resident(&self) -> Vec<BlockHash> {
        self.lock().pool.resident().collect()
    }

    /// The incarnation and the sequence of the last change.
    pub fn position(&self) -> (String, u64) {
        let state = self.lock();
        (state.feed.incarnation().to_owned(), state.feed.sequence())
    }

    /// Prometheus text exposition of vLLM's metrics.
    pub fn metrics_text(&self) -> String {
        let mut state = self.lock();
        let load = self.load(&mut state);
        state.metrics.render(
            &self.config,
            &load,
            (state.pool.queries, state.pool.hits),
            state.pool.cached_blocks(),
        )
    }
}

impl Source for Engine {
    /// A new WatchCache subscriber: its first message is a snapshot, then
    /// every change in order. The stream ends if it falls
    /// `subscriber_buffer` messages behind.
    fn subscribe(&self) -> Result<mpsc::Receiver<feed::Message>, tonic::Status> {
        let mut state = self.lock();
        let snapshot = v1::CacheSnapshot {
            config: Some(self.cache_config()),
            block_hashes: state.pool.resident().collect(),
            load: Some(self.load(&mut state).to_proto()),
            offloaded: Vec::new(),
        };
        Ok(state.feed.subscribe(snapshot))
    }
}

fn bytes_of(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

async fn wait_until(t: Instant) {
    if t > Instant::now() {
        tokio::time::sleep_until(t).await;
    }
}

/// A running request's hold on the engine; dropping it frees its blocks
/// and admits the next waiting requests.
struct Run {
    engine: Arc<Engine>,
    blocks: Vec<u32>,
    future_blocks: usize,
}

impl Drop for Run {
    fn drop(&mut self) {
        let engine = self.engine.clone();
        let mut state = engine.lock();
        state.pool.free(&self.blocks);
        state.running -= 1;
        state.reserved -= self.future_blocks;
        engine.admit(&mut state);
    }
}

#[cfg(test)]
mod tests;
