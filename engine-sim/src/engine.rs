//! The engine: `kvroute-core`'s model of vLLM's scheduler
//! ([`kvroute_core::engine`]) run in real time by one driver task, the
//! tokens and block hashes of each request, and a fan-out of every cache
//! change to WatchCache subscribers in the order the cache changed.
//!
//! The model decides what runs and how long each step takes (all delays
//! divided by `time_scale`); this module hashes prompts, generates the
//! words, hashes full output blocks for the model, and tells clients.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use kvroute_core::admission;
use kvroute_core::engine::pool::PoolEvent as ModelEvent;
use kvroute_core::engine::{self as model, Progress, Refused, RequestId};
use kvroute_core::hash::{BlockDigest, BlockExtras, BlockHash, BlockHasher, HashConfig, Lora};
use kvroute_core::tokenize::Tokenizer;
use kvroute_proto::feed::{self, Feed, Source};
use kvroute_proto::v1::{self, cache_update::Update};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::config::Config;
use crate::kv_events::{self, PoolEvent, Publisher};
use crate::metrics::Metrics;

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
    /// Blocks not held by a running request.
    pub free_blocks: u64,
    /// Of those, holding a cached prefix.
    pub cached_free_blocks: u64,
    /// Blocks the waiting requests take from the free pool.
    pub waiting_blocks: u64,
    /// Blocks the requests will still take for their output.
    pub growth_blocks: u64,
    /// Seconds until the running requests finish, on average.
    pub remaining_decode_s: f64,
    /// Seconds a waiting request decodes once it runs, on average.
    pub waiting_decode_s: f64,
    /// Requests preempted so far.
    pub preemptions: u64,
    /// Requests run at once.
    pub max_num_seqs: u32,
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
            free_blocks: Some(self.free_blocks),
            cached_free_blocks: Some(self.cached_free_blocks),
            waiting_blocks: Some(self.waiting_blocks),
            growth_blocks: Some(self.growth_blocks),
            remaining_decode_s: Some(self.remaining_decode_s),
            waiting_decode_s: Some(self.waiting_decode_s),
            preemptions: Some(self.preemptions),
            max_num_seqs: Some(self.max_num_seqs),
        }
    }
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
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
    /// The request asked to start its prefill sooner than the queue
    /// allows ([`kvroute_core::admission`]).
    #[error(
        "the engine would not start this request within the {bound_ms} ms it asked for: {} prompt tokens queued, {} requests waiting, {} KV blocks free of the {blocks} it takes (with the room it asked to leave)",
        load.queued_prefill_tokens,
        load.waiting,
        load.free_blocks
    )]
    Busy {
        /// The bound the request carried.
        bound_ms: u64,
        /// KV blocks it takes from the free pool, and the room it asked to
        /// leave there.
        blocks: u64,
        /// The engine's load, for the router.
        load: LoadReport,
    },
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
    /// Refuse unless its prefill can start within this many milliseconds
    /// ([`kvroute_core::admission`]).
    pub admit_within_ms: Option<u64>,
    /// KV blocks to leave free beyond its own when that check admits it
    /// ([`kvroute_core::admission::ROOM_HEADER`]).
    pub admit_room_blocks: u64,
    /// Disaggregated prefill: tokens loaded from a producer, or its blocks
    /// held for a consumer once it finishes ([`crate::transfer`]).
    pub transfer: model::Transfer,
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
    /// The engine's id of the request (names a held transfer).
    pub id: RequestId,
    /// Prompt tokens served from the prefix cache, or loaded from a
    /// producer.
    pub cached_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens; ends after the last one. Dropping it cancels the
    /// request and frees its blocks. Unbounded as vLLM's output queue is:
    /// the engine never waits for a client; a request's output is bounded
    /// by its `max_tokens`.
    pub tokens: mpsc::UnboundedReceiver<Token>,
}

/// A request the engine serves: what the model does not know.
struct Live {
    /// Prompt and output so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Digests of the full blocks so far, to chain output blocks on.
    digests: Vec<BlockDigest>,
    lora: Option<Lora>,
    cache_salt: Option<String>,
    /// Its blocks are held for a transfer when it finishes.
    hold: bool,
    /// Seeds the words generated.
    seed: u64,
    arrival: Instant,
    admitted_at: Option<Instant>,
    /// When its last token came.
    last_token_at: Option<Instant>,
    /// Told the cached tokens at admission.
    admitted: Option<oneshot::Sender<u64>>,
    tx: mpsc::UnboundedSender<Token>,
    /// Finished or abandoned: dropped (ending the client's stream) once
    /// the step's cache events, which may name its blocks, are published.
    done: bool,
}

struct State {
    model: model::Engine,
    requests: HashMap<RequestId, Live>,
    next_id: RequestId,
    feed: Feed,
    /// vLLM-format KV events, when the engine publishes them.
    kv_events: Option<Publisher>,
    metrics: Metrics,
    /// Finished requests whose blocks the model holds for a consumer,
    /// until read or expired: at most one per block of the pool.
    holds: HashMap<RequestId, Hold>,
}

/// A finished request's blocks, held for a consumer to read.
#[derive(Clone, Debug, PartialEq)]
pub struct Hold {
    /// Hashes of its prompt's full blocks.
    pub hashes: Vec<BlockHash>,
    /// Its prompt tokens.
    pub tokens: usize,
    /// The blocks held (vLLM's `remote_block_ids`).
    pub blocks: Vec<u32>,
    /// When they are freed unread.
    pub deadline: Instant,
}

/// A simulated engine. Cheap to share behind an `Arc`.
pub struct Engine {
    config: Config,
    hasher: BlockHasher,
    state: Mutex<State>,
    /// The model's time 0.
    origin: Instant,
    /// Woken when a request arrives: its work is news for routers.
    arrived: Notify,
    /// Woken when the driver may have work (or the engine is dropped).
    work: Arc<Notify>,
    /// Names this engine in `kv_transfer_params` (vLLM's engine id).
    engine_id: String,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.config.model)
            .finish_non_exhaustive()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Lets the driver see the engine is gone.
        self.work.notify_one();
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

/// The model's configuration for `config`, its delays divided by the time
/// scale.
fn model_config(config: &Config) -> model::Config {
    let scaled = |ms: f64| Duration::from_secs_f64((ms / 1000.0 / config.time_scale).max(0.0));
    model::Config {
        num_blocks: config.num_gpu_blocks as usize,
        block_size: config.block_size as usize,
        max_num_seqs: config.max_num_seqs as usize,
        max_num_batched_tokens: config.max_num_batched_tokens as usize,
        prefill_tokens_per_s: config.prefill_tokens_per_s * config.time_scale,
        prefill_overhead: scaled(config.prefill_overhead_ms),
        itl: scaled(config.itl_ms),
    }
}

impl Engine {
    /// An engine for `config` (validated by the caller), with its driver
    /// task started on the current tokio runtime.
    pub fn new(config: Config) -> Result<Arc<Self>, kvroute_core::hash::HashError> {
        let hasher = BlockHasher::new(HashConfig {
            algo: config.hash_algo,
            block_size: config.block_size as usize,
            seed: config.hash_seed.clone(),
            ..HashConfig::default()
        })?;
        let state = State {
            model: model::Engine::new(model_config(&config)),
            requests: HashMap::new(),
            next_id: 0,
            feed: Feed::new(config.subscriber_buffer as usize),
            kv_events: None,
            metrics: Metrics::new(&config.model, config.max_model_len),
            holds: HashMap::new(),
        };
        let engine_id = {
            use std::hash::{BuildHasher, Hasher};
            let random = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            format!("sim-{random:016x}")
        };
        let work = Arc::new(Notify::new());
        let engine = Arc::new(Engine {
            config,
            hasher,
            state: Mutex::new(state),
            origin: Instant::now(),
            arrived: Notify::new(),
            work: work.clone(),
            engine_id,
        });
        tokio::spawn(drive(Arc::downgrade(&engine), work));
        Ok(engine)
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

    /// The model's clock now.
    fn now(&self) -> Duration {
        Instant::now() - self.origin
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
        let extras = BlockExtras {
            lora: job.lora.as_ref(),
            cache_salt: job.cache_salt.as_deref(),
        };
        let digests = self.hasher.digests(&job.prompt, extras);
        let hashes: Vec<BlockHash> = digests.iter().map(BlockDigest::to_u64).collect();
        let (admitted_tx, admitted_rx) = oneshot::channel();
        let (tx, tokens) = mpsc::unbounded_channel();
        let id = {
            let mut state = self.lock();
            // Checked under the lock that admits it: requests arriving at
            // once are checked in turn, each behind the ones before.
            if let Some(bound_ms) = job.admit_within_ms {
                let config = state.model.config();
                let (overhead, itl) = (config.prefill_overhead, config.itl);
                let rate = self.config.prefill_tokens_per_s * self.config.time_scale;
                let report = state.model.load(self.now()).report(
                    (rate > 0.0).then_some(rate),
                    itl,
                    std::time::Instant::now(),
                );
                let overhead_ms = overhead.as_secs_f64() * 1000.0;
                let blocks = state.model.demand(&hashes, job.prompt.len());
                let blocks = blocks.saturating_add(job.admit_room_blocks);
                if !admission::admits(bound_ms, report, overhead_ms, blocks) {
                    let load = self.load(&state);
                    return Err(EngineError::Busy {
                        bound_ms,
                        blocks,
                        load,
                    });
                }
            }
            let id = state.next_id;
            let max_tokens = job.max_tokens.max(1) as usize;
            match (state.model).add_with(id, hashes, job.prompt.len(), max_tokens, job.transfer) {
                Ok(()) => {}
                Err(Refused::TooLarge { needed, capacity }) => {
                    return Err(EngineError::TooLarge { needed, capacity });
                }
                Err(Refused::EmptyPrompt) => return Err(EngineError::EmptyPrompt),
            }
            state.next_id += 1;
            state.requests.insert(
                id,
                Live {
                    seed: xxh3_64(bytes_of(&job.prompt).as_slice()),
                    prompt_len: job.prompt.len(),
                    tokens: job.prompt,
                    digests,
                    lora: job.lora,
                    cache_salt: job.cache_salt,
                    hold: job.transfer.hold,
                    arrival: Instant::now(),
                    admitted_at: None,
                    last_token_at: None,
                    admitted: Some(admitted_tx),
                    tx,
                    done: false,
                },
            );
            id
        };
        self.work.notify_one();
        self.arrived.notify_one();
        let cached_tokens = admitted_rx.await.map_err(|_| EngineError::Stopped)?;
        Ok(Generation {
            id,
            cached_tokens,
            prompt_tokens: prompt_len,
            tokens,
        })
    }

    /// Starts a step if there is work; returns when it ends.
    fn start_step(&self) -> Option<Duration> {
        let mut state = self.lock();
        // Requests whose clients left go before the step schedules them.
        let gone: Vec<RequestId> = state
            .requests
            .iter()
            .filter(|(_, r)| r.tx.is_closed() || r.admitted.as_ref().is_some_and(|a| a.is_closed()))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            state.model.abort(id);
            state.requests.remove(&id);
        }
        let end = state.model.start_step(self.now());
        self.apply_progress(&mut state);
        self.publish(&mut state);
        end
    }

    /// Ends the step in flight: hands out its tokens.
    fn finish_step(&self) {
        let mut state = self.lock();
        state.model.finish_step();
        self.apply_progress(&mut state);
        self.publish(&mut state);
        state.requests.retain(|_, r| !r.done);
    }

    /// Tells clients what the model did; hashes full output blocks for it.
    fn apply_progress(&self, state: &mut State) {
        let bs = self.config.block_size as usize;
        let now = Instant::now();
        let State {
            model,
            requests,
            metrics,
            holds,
            ..
        } = state;
        for (id, progress) in model.take_progress() {
            let Some(live) = requests.get_mut(&id) else {
                continue;
            };
            match progress {
                Progress::Admitted { cached_tokens } => {
                    live.admitted_at = Some(now);
                    metrics.computed_prompt_tokens += (live.prompt_len - cached_tokens) as u64;
                    if let Some(tx) = live.admitted.take()
                        && tx.send(cached_tokens as u64).is_err()
                    {
                        model.abort(id);
                        live.done = true;
                    }
                }
                Progress::Preempted => metrics.preemptions += 1,
                Progress::Token { index, last } => {
                    let word = (xxh3_64_with_seed(&(index as u64).to_le_bytes(), live.seed)
                        % WORDS.len() as u64) as usize;
                    live.tokens.push(word_ids()[word]);
                    if index == 0 {
                        metrics.observe_ttft((now - live.arrival).as_secs_f64());
                        let prefill = live.admitted_at.map_or(Duration::ZERO, |t| now - t);
                        metrics.observe_prefill(live.prompt_len as u64, prefill.as_secs_f64());
                    }
                    if let Some(previous) = live.last_token_at.replace(now) {
                        metrics.observe_itl((now - previous).as_secs_f64());
                    }
                    metrics.generation_tokens += 1;
                    if live.tokens.len().is_multiple_of(bs) {
                        let i = live.tokens.len() / bs - 1;
                        let parent = i
                            .checked_sub(1)
                            .map_or(self.hasher.none_hash(), |p| live.digests[p]);
                        let extras = BlockExtras {
                            lora: live.lora.as_ref(),
                            cache_salt: live.cache_salt.as_deref(),
                        };
                        let digest =
                            self.hasher
                                .block_digest(&parent, i, &live.tokens[i * bs..], extras);
                        live.digests.push(digest);
                        model.add_block_hash(id, digest.to_u64());
                    }
                    let token = Token {
                        text: WORDS[word],
                        index: index as u64,
                        last,
                    };
                    if live.tx.send(token).is_err() {
                        model.abort(id);
                        live.done = true;
                    }
                    if last {
                        metrics.requests_finished += 1;
                        metrics.observe_output(index as u64 + 1);
                        live.done = true;
                        if let Some(blocks) = live.hold.then(|| model.held(id)).flatten() {
                            let hold = Hold {
                                hashes: (live.digests[..live.prompt_len / bs].iter())
                                    .map(BlockDigest::to_u64)
                                    .collect(),
                                tokens: live.prompt_len,
                                blocks: blocks.to_vec(),
                                deadline: now + self.scaled_s(self.config.kv_transfer_timeout_s),
                            };
                            holds.insert(id, hold);
                        }
                    }
                }
            }
        }
    }

    /// `seconds` of simulated time, divided by the time scale.
    pub fn scaled_s(&self, seconds: f64) -> Duration {
        Duration::from_secs_f64((seconds / self.config.time_scale).max(0.0))
    }

    /// The id this engine names itself by in `kv_transfer_params`.
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The blocks request `id` holds for a consumer, if it does.
    pub fn hold(&self, id: RequestId) -> Option<Hold> {
        self.lock().holds.get(&id).cloned()
    }

    /// Takes request `id`'s hold for a read: it no longer expires; the
    /// caller [`release`](Self::release)s its blocks when done.
    pub fn take_hold(&self, id: RequestId) -> Option<Hold> {
        self.lock().holds.remove(&id)
    }

    /// Frees the blocks request `id` held (they stay cached).
    pub fn release(&self, id: RequestId) {
        if self.lock().model.release(id) {
            self.work.notify_one();
        }
    }

    /// Counts a transfer's outcome.
    pub fn count_transfer(&self, result: crate::metrics::TransferResult) {
        self.lock().metrics.count_transfer(result);
    }

    /// Frees holds past their deadline, counted `expired`; returns the
    /// next deadline.
    fn expire_holds(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut state = self.lock();
        if state.holds.is_empty() {
            return None;
        }
        let State {
            holds,
            model,
            metrics,
            ..
        } = &mut *state;
        holds.retain(|&id, hold| {
            let live = hold.deadline > now;
            if !live {
                model.release(id);
                metrics.count_transfer(crate::metrics::TransferResult::Expired);
            }
            live
        });
        holds.values().map(|h| h.deadline).min()
    }

    /// vLLM's `lora_id` and name of an adapter: its position among the
    /// served adapters, from 1.
    fn lora_id(&self, lora: Option<&Lora>) -> Option<(u64, String)> {
        let lora = lora?;
        let modules = &self.config.lora_modules;
        let id = modules.iter().position(|l| l.name == lora.name);
        Some((id.map_or(0, |i| i as u64 + 1), lora.name.clone()))
    }

    /// What a stored-blocks event of the model says, with the blocks'
    /// tokens and extra keys as vLLM's `BlockStored` carries them.
    fn describe(&self, state: &State, event: ModelEvent) -> PoolEvent {
        let bs = self.config.block_size as usize;
        match event {
            ModelEvent::Stored {
                request,
                first,
                hashes,
                parent,
            } => {
                let live = state.requests.get(&request);
                let token_ids = live.map_or_else(Vec::new, |l| {
                    l.tokens[first * bs..(first + hashes.len()) * bs].to_vec()
                });
                let lora = live.and_then(|l| self.lora_id(l.lora.as_ref()));
                let extra_keys = (first..first + hashes.len())
                    .map(|i| {
                        let salt = live.and_then(|l| l.cache_salt.clone()).filter(|_| i == 0);
                        lora.iter()
                            .map(|(_, name)| name.clone())
                            .chain(salt)
                            .collect()
                    })
                    .collect();
                PoolEvent::Stored {
                    hashes,
                    parent,
                    token_ids,
                    extra_keys,
                    lora,
                }
            }
            ModelEvent::Removed(hashes) => PoolEvent::Removed(hashes),
            ModelEvent::Cleared => PoolEvent::Cleared,
        }
    }

    /// Sends the model's pending cache events to every subscriber, in
    /// order, and publishes them as one vLLM event batch.
    fn publish(&self, state: &mut State) {
        let events: Vec<PoolEvent> = state
            .model
            .take_events()
            .into_iter()
            .map(|e| self.describe(state, e))
            .collect();
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

    fn load(&self, state: &State) -> LoadReport {
        let load = state.model.load(self.now());
        let rate = self.config.prefill_tokens_per_s * self.config.time_scale;
        let memory = load.memory(state.model.config().itl);
        LoadReport {
            waiting: load.waiting,
            running: load.running,
            kv_usage: load.kv_usage(),
            used_blocks: load.used_blocks,
            queued_prefill_tokens: load.queued_prefill_tokens,
            prefill_tokens_per_s: (rate > 0.0).then_some(rate),
            free_blocks: memory.free_blocks,
            cached_free_blocks: load.cached_free_blocks,
            waiting_blocks: memory.waiting_blocks,
            growth_blocks: memory.growth_blocks,
            remaining_decode_s: memory.remaining_decode_s,
            waiting_decode_s: memory.waiting_decode_s,
            preemptions: load.preemptions,
            max_num_seqs: self.config.max_num_seqs,
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
        let load = self.load(&state).to_proto();
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
        state.model.forget_cache();
        state.feed.restart();
        if let Some(kv) = &state.kv_events {
            kv.restart();
        }
    }

    /// vLLM's `reset_prefix_cache`: drops every cached block; refused while
    /// requests run.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut state = self.lock();
        let done = state.model.reset_prefix_cache();
        self.publish(&mut state);
        done
    }

    /// Every cached block now (for tests and debugging).
    pub fn resident(&self) -> Vec<BlockHash> {
        self.lock().model.resident().collect()
    }

    /// The incarnation and the sequence of the last change.
    pub fn position(&self) -> (String, u64) {
        let state = self.lock();
        (state.feed.incarnation().to_owned(), state.feed.sequence())
    }

    /// Prometheus text exposition of vLLM's metrics.
    pub fn metrics_text(&self) -> String {
        let state = self.lock();
        let load = self.load(&state);
        let counters = state.model.counters();
        state.metrics.render(
            &self.config,
            &load,
            (counters.queries, counters.hits),
            state.model.cached_blocks(),
        )
    }
}

/// Runs the model in real time while the engine lives: a step when there
/// is work, sleeping until it ends; otherwise waiting for a request.
async fn drive(engine: Weak<Engine>, work: Arc<Notify>) {
    loop {
        let (end, expiry) = {
            let Some(engine) = engine.upgrade() else {
                return;
            };
            let expiry = engine.expire_holds();
            (engine.start_step().map(|end| engine.origin + end), expiry)
        };
        match end {
            Some(end) => {
                if end > Instant::now() {
                    tokio::time::sleep_until(end).await;
                } else {
                    // Zero-time steps (instant test engines) still let
                    // clients run.
                    tokio::task::yield_now().await;
                }
                let Some(engine) = engine.upgrade() else {
                    return;
                };
                engine.finish_step();
            }
            None => match expiry {
                Some(at) => {
                    tokio::select! {
                        _ = work.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => work.notified().await,
            },
        }
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
            block_hashes: state.model.resident().collect(),
            load: Some(self.load(&state).to_proto()),
            offloaded: Vec::new(),
        };
        Ok(state.feed.subscribe(snapshot))
    }
}

fn bytes_of(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests;
