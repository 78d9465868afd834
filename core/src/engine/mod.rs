//! The engine model: vLLM v1's scheduler, as far as it shapes time to first
//! token, as a pure state machine. `kvroute-engine-sim` runs it in real
//! time and `kvroute replay --engine vllm` in virtual time; the scheduling
//! rules exist here only.
//!
//! The caller drives it in steps: [`Engine::start_step`] schedules one
//! forward pass and says when it ends; [`Engine::finish_step`] applies it
//! and returns the tokens it produced. Requests may be added and aborted at
//! any time. Time is passed in (a [`Duration`] since any fixed origin).
//!
//! The rules (vLLM v1, `Scheduler.schedule`):
//! 1. **Blocks on demand.** A request holds blocks for the tokens computed
//!    so far and those scheduled this step, nothing for its future output.
//!    A new request first reuses its longest cached prefix (at most
//!    `prompt − 1` tokens, [`pool`]).
//! 2. **Running first.** Each step has a token budget
//!    (`max_num_batched_tokens`). Running requests are scheduled first, in
//!    admission order: a decode takes one token, an unfinished prefill the
//!    rest of its prompt up to the budget (chunked prefill).
//! 3. **Preemption by recompute.** When a running request cannot get the
//!    blocks it needs, the most recently admitted running request is
//!    preempted: its blocks are freed (still cached until evicted), it goes
//!    back to the front of the waiting queue, and when admitted again it
//!    recomputes everything its cached prefix no longer covers (prompt and
//!    output so far). If that request is the one being scheduled, the
//!    running pass stops.
//! 4. **Waiting in FIFO order**, only in a step that preempted nothing,
//!    while the budget lasts and fewer than `max_num_seqs` run: the head of
//!    the queue is admitted if its prefix hit plus its first chunk fits in
//!    the free blocks; otherwise it (and everything behind it) waits.
//! 5. **Tokens.** When a step brings a request's computed tokens up to its
//!    length (prompt plus output so far), it emits one token; the last one
//!    (`max_tokens`) finishes it and frees its blocks, tail first.
//! 6. **Caching.** After each step, every block whose tokens are all
//!    computed and whose hash is known is cached. Prompt blocks' hashes come
//!    with the request; output blocks' hashes from the caller
//!    ([`Engine::add_block_hash`]) as their tokens are generated (the replay
//!    has none: its output blocks are never reused).
//! 7. **Step time.** A step that prefills `p` tokens takes
//!    `max(itl, overhead + p / rate)`; a decode-only step takes `itl`. A
//!    request's prefill overhead is paid per step, so a chunked prompt pays
//!    it once per chunk.
//!
//! 8. **KV transfer** (vLLM's KV connector, for disaggregated prefill). A
//!    request added with [`Transfer::hold`] keeps its blocks when it
//!    finishes, until [`Engine::release`]: another engine reads them. One
//!    added with [`Transfer::loaded_tokens`] is admitted with those prompt
//!    tokens computed (another engine prefilled them; all but the last,
//!    which it recomputes, as vLLM does), taking blocks for them; its full
//!    blocks are cached after its first step, as if prefilled here. A
//!    preempted request recomputes them.
//!
//! Simplified: no speculative decoding, no encoder or multimodal budget, no
//! `long_prefill_token_threshold`, no priority scheduling, no swap; step
//! time does not grow with the batch's decode count or context length; a
//! hash already cached by another block is not cached twice (see [`pool`]);
//! requests that could never fit in the pool are refused up front instead
//! of waiting for ever.

pub mod pool;

use std::collections::VecDeque;
use std::time::Duration;

use crate::hash::BlockHash;
use pool::{BlockPool, PoolEvent};

/// A request's id, chosen by the caller, unique among live requests.
pub type RequestId = u64;

/// How the engine behaves. [`Default`] is engine-sim's and the replay's.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// KV cache blocks (vLLM `num_gpu_blocks`). Default: 8192.
    pub num_blocks: usize,
    /// Tokens per block (vLLM `--block-size`). Default: 16.
    pub block_size: usize,
    /// Requests running at once (vLLM `--max-num-seqs`). Default: 256.
    pub max_num_seqs: usize,
    /// Tokens scheduled per step (vLLM `--max-num-batched-tokens`).
    /// Default: 8192, vLLM's for the OpenAI server on large GPUs.
    pub max_num_batched_tokens: usize,
    /// Prefill throughput, tokens per second; 0 makes prefill free.
    /// Default: 10,000.
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of a step that prefills. Default: 20 ms.
    pub prefill_overhead: Duration,
    /// Time of a step, at least (inter-token latency). Default: 30 ms.
    pub itl: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            num_blocks: 8192,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            prefill_tokens_per_s: 10_000.0,
            prefill_overhead: Duration::from_millis(20),
            itl: Duration::from_millis(30),
        }
    }
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Its prompt and output can never fit in the pool.
    #[error("the request needs {needed} KV blocks but the cache has {capacity}")]
    TooLarge {
        /// Blocks needed.
        needed: usize,
        /// Blocks in the pool.
        capacity: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt must contain at least one token")]
    EmptyPrompt,
}

/// What a request does beside its own computation: vLLM's KV connector,
/// for disaggregated prefill (rule 8). [`Default`]: nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfer {
    /// Prompt tokens another engine computed and sent: admitted as
    /// computed, but the last.
    pub loaded_tokens: usize,
    /// Keep its blocks when it finishes, until [`Engine::release`].
    pub hold: bool,
}

/// What happened to a request in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Admitted for the first time, with this many prompt tokens cached
    /// or loaded (rule 8).
    Admitted {
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
    },
    /// Produced output token `index` (from 0); `last` finishes it.
    Token {
        /// Its position in the output.
        index: usize,
        /// Whether it was the last one.
        last: bool,
    },
    /// Preempted: its blocks are freed and it waits to recompute.
    Preempted,
}

/// The engine's state as a load report describes it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// Requests waiting (new or preempted).
    pub waiting: u32,
    /// Requests admitted and not finished.
    pub running: u32,
    /// Blocks in the pool.
    pub num_blocks: u64,
    /// Blocks held by running requests.
    pub used_blocks: u64,
    /// Free blocks that still hold a cached prefix (evicted on reuse).
    pub cached_free_blocks: u64,
    /// Tokens still to prefill: running requests' uncomputed tokens (less
    /// the share of the step in progress already done) and waiting
    /// requests' tokens past their cached prefix now.
    pub queued_prefill_tokens: u64,
    /// Blocks the waiting requests take from the free pool to be
    /// admitted, all of them: every block but the cached ones a running
    /// request holds now.
    pub waiting_blocks: u64,
    /// Blocks the requests running and waiting will still take for their
    /// output.
    pub growth_blocks: u64,
    /// Output tokens the running requests have still to produce.
    pub remaining_decode_tokens: u64,
    /// Output tokens the waiting requests have still to produce.
    pub waiting_decode_tokens: u64,
    /// Preemptions since the engine started.
    pub preemptions: u64,
    /// Requests it runs at once (`max_num_seqs`).
    pub max_num_seqs: u64,
}

impl Load {
    /// What a load report says of memory, with decode steps of `step`: the
    /// running requests' mean remaining output at one token a step.
    pub fn memory(&self, step: Duration) -> crate::load::Memory {
        // Seconds of decode per request: `tokens` over `requests`.
        let mean_s = |tokens: u64, requests: u32| {
            if requests == 0 {
                0.0
            } else {
                tokens as f64 / f64::from(requests) * step.as_secs_f64()
            }
        };
        crate::load::Memory {
            free_blocks: self.num_blocks - self.used_blocks,
            used_blocks: self.used_blocks,
            waiting_blocks: self.waiting_blocks,
            growth_blocks: self.growth_blocks,
            remaining_decode_s: mean_s(self.remaining_decode_tokens, self.running),
            waiting_decode_s: mean_s(self.waiting_decode_tokens, self.waiting),
            running: u64::from(self.running),
            waiting: u64::from(self.waiting),
            max_num_seqs: Some(self.max_num_seqs),
        }
    }

    /// The report a router reads, taken at `at`: with the engine's prefill
    /// `rate` (tokens per second; `None` when prefill is instant) and
    /// decode steps of `step`.
    pub fn report(
        &self,
        rate: Option<f64>,
        step: Duration,
        at: std::time::Instant,
    ) -> crate::load::EngineLoad {
        crate::load::EngineLoad {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage(),
            queued_prefill_tokens: Some(self.queued_prefill_tokens),
            prefill_tokens_per_s: rate,
            memory: Some(self.memory(step)),
            reported_at: at,
        }
    }

    /// Share of blocks in use, as vLLM's `kv_cache_usage_perc`.
    pub fn kv_usage(&self) -> f32 {
        if self.num_blocks == 0 {
            0.0
        } else {
            self.used_blocks as f32 / self.num_blocks as f32
        }
    }
}

/// Prefix-cache counters since the engine started (vLLM's
/// `prefix_cache_queries` and `prefix_cache_hits`, in tokens).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Tokens looked up at admission.
    pub queries: u64,
    /// Of those, found cached.
    pub hits: u64,
    /// Requests preempted.
    pub preemptions: u64,
}

#[derive(Clone, Debug)]
struct Seq {
    id: RequestId,
    /// Hashes of the full blocks known so far (prompt, then output).
    hashes: Vec<BlockHash>,
    prompt: usize,
    max_tokens: usize,
    /// Output tokens produced.
    output: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    blocks: Vec<u32>,
    /// Leading blocks cached (by this request or found so).
    cached: usize,
    transfer: Transfer,
    admitted: bool,
    /// Aborted while its step was in flight.
    aborted: bool,
}

impl Seq {
    fn len(&self) -> usize {
        self.prompt + self.output
    }
}

#[derive(Clone, Debug)]
struct Step {
    start: Duration,
    end: Duration,
    /// (index in `running`, tokens scheduled), in running order.
    scheduled: Vec<(usize, usize)>,
    prefill_tokens: usize,
}

/// The model. See the module docs.
#[derive(Clone, Debug)]
pub struct Engine {
    config: Config,
    pool: BlockPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    step: Option<Step>,
    progress: Vec<(RequestId, Progress)>,
    counters: Counters,
    /// Blocks of finished requests kept for a transfer (rule 8).
    held: std::collections::HashMap<RequestId, Vec<u32>>,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(config: Config) -> Self {
        Engine {
            pool: BlockPool::new(config.num_blocks, config.block_size),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            step: None,
            progress: Vec::new(),
            counters: Counters::default(),
            held: std::collections::HashMap::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Queues a request: `hashes` are its prompt's full-block hashes.
    pub fn add(
        &mut self,
        id: RequestId,
        hashes: Vec<BlockHash>,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<(), Refused> {
        self.add_with(id, hashes, prompt_tokens, max_tokens, Transfer::default())
    }

    /// [`add`](Self::add) with a KV transfer (rule 8).
    pub fn add_with(
        &mut self,
        id: RequestId,
        hashes: Vec<BlockHash>,
        prompt_tokens: usize,
        max_tokens: usize,
        transfer: Transfer,
    ) -> Result<(), Refused> {
        if prompt_tokens == 0 {
            return Err(Refused::EmptyPrompt);
        }
        let max_tokens = max_tokens.max(1);
        // The last output token is never fed back: it needs no KV.
        let needed = self.pool.blocks_for(prompt_tokens + max_tokens - 1);
        if needed > self.pool.capacity() {
            return Err(Refused::TooLarge {
                needed,
                capacity: self.pool.capacity(),
            });
        }
        self.waiting.push_back(Seq {
            id,
            hashes,
            prompt: prompt_tokens,
            max_tokens,
            output: 0,
            computed: 0,
            blocks: Vec::new(),
            cached: 0,
            transfer,
            admitted: false,
            aborted: false,
        });
        Ok(())
    }

    /// Blocks a request of `num_tokens` tokens whose prompt's full blocks
    /// hash to `hashes` takes from the free pool if admitted now: all of
    /// them but the cached ones a running request holds.
    pub fn demand(&self, hashes: &[BlockHash], num_tokens: usize) -> u64 {
        let hit = self.pool.lookup(hashes, num_tokens);
        self.takes(&hashes[..hit], num_tokens)
    }

    /// [`demand`](Self::demand) with its cached prefix `hit` looked up.
    fn takes(&self, hit: &[BlockHash], num_tokens: usize) -> u64 {
        (self.pool.blocks_for(num_tokens) - self.pool.held(hit)) as u64
    }

    /// Records the hash of the next full block of `id`'s sequence (an
    /// output block, once its tokens are known). Ignored for an unknown id.
    pub fn add_block_hash(&mut self, id: RequestId, hash: BlockHash) {
        if let Some(seq) = self.seq_mut(id) {
            seq.hashes.push(hash);
        }
    }

    /// Drops a request, waiting or running, and frees its blocks. False
    /// when no such request is live.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        let Some(i) = self.running.iter().position(|s| s.id == id && !s.aborted) else {
            return false;
        };
        if self.step.is_some() {
            // Its index is in the step in flight: removed when it ends.
            let seq = &mut self.running[i];
            seq.aborted = true;
            self.pool.free(&std::mem::take(&mut seq.blocks));
        } else {
            let seq = self.running.remove(i);
            self.pool.free(&seq.blocks);
        }
        true
    }

    /// The blocks a finished request holds for a transfer (rule 8).
    pub fn held(&self, id: RequestId) -> Option<&[u32]> {
        self.held.get(&id).map(Vec::as_slice)
    }

    /// Frees the blocks a finished request held for a transfer (they stay
    /// cached until evicted). False when it holds none.
    pub fn release(&mut self, id: RequestId) -> bool {
        let Some(blocks) = self.held.remove(&id) else {
            return false;
        };
        self.pool.free(&blocks);
        true
    }

    /// Whether nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.iter().all(|s| s.aborted)
    }

    /// When the step in flight ends, if one is.
    pub fn step_end(&self) -> Option<Duration> {
        self.step.as_ref().map(|s| s.end)
    }

    /// Schedules a step at `now` (rules 1–4 and 7) unless one is in flight
    /// or there is nothing to do; returns when it ends. What it changed
    /// (admissions, preemptions) is in [`Engine::take_progress`].
    pub fn start_step(&mut self, now: Duration) -> Option<Duration> {
        if self.step.is_some() {
            return None;
        }
        let mut budget = self.config.max_num_batched_tokens.max(1);
        let mut scheduled = Vec::new();
        let mut prefill_tokens = 0;
        let mut preempted = false;
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let n = (self.running[i].len() - self.running[i].computed).min(budget);
            loop {
                let seq = &mut self.running[i];
                let needed = self.pool.blocks_for(seq.computed + n);
                let more = needed.saturating_sub(seq.blocks.len());
                if self.pool.grow(&mut seq.blocks, more) {
                    break;
                }
                let victim = self.running.pop().expect("i < len");
                self.preempt(victim);
                preempted = true;
                if i == self.running.len() {
                    break 'running;
                }
            }
            prefill_tokens += self.prefill_part(&self.running[i], n);
            scheduled.push((i, n));
            budget -= n;
            i += 1;
        }
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let hit = self.pool.lookup(&seq.hashes, seq.len());
            let local = hit * self.config.block_size;
            // Loaded tokens count once: a preempted request recomputes.
            let loaded = if seq.admitted {
                0
            } else {
                seq.transfer.loaded_tokens.min(seq.len() - 1)
            };
            let computed = local.max(loaded);
            let n = (seq.len() - computed).min(budget);
            let new = self.pool.blocks_for(computed + n) - hit;
            let Some(blocks) = self.pool.allocate(&seq.hashes, hit, new) else {
                break;
            };
            let mut seq = self.waiting.pop_front().expect("front exists");
            (seq.blocks, seq.computed, seq.cached) = (blocks, computed, hit);
            if !seq.admitted {
                seq.admitted = true;
                self.counters.queries += seq.prompt as u64;
                self.counters.hits += local as u64;
                self.progress.push((
                    seq.id,
                    Progress::Admitted {
                        cached_tokens: computed,
                    },
                ));
            }
            prefill_tokens += self.prefill_part(&seq, n);
            scheduled.push((self.running.len(), n));
            self.running.push(seq);
            budget -= n;
        }
        if scheduled.is_empty() {
            return None;
        }
        let end = now + self.duration(prefill_tokens);
        self.step = Some(Step {
            start: now,
            end,
            scheduled,
            prefill_tokens,
        });
        Some(end)
    }

    /// Tokens of `n` scheduled for `seq` that are prefill: all but a
    /// decode's single token.
    fn prefill_part(&self, seq: &Seq, n: usize) -> usize {
        let decode = n == 1 && seq.output > 0 && seq.computed + 1 == seq.len();
        if decode { 0 } else { n }
    }

    fn duration(&self, prefill_tokens: usize) -> Duration {
        let c = &self.config;
        if prefill_tokens == 0 {
            return c.itl;
        }
        let compute = if c.prefill_tokens_per_s > 0.0 {
            Duration::from_secs_f64(prefill_tokens as f64 / c.prefill_tokens_per_s)
        } else {
            Duration::ZERO
        };
        c.itl.max(c.prefill_overhead + compute)
    }

    fn preempt(&mut self, mut seq: Seq) {
        self.pool.free(&std::mem::take(&mut seq.blocks));
        seq.computed = 0;
        seq.cached = 0;
        self.counters.preemptions += 1;
        self.progress.push((seq.id, Progress::Preempted));
        self.waiting.push_front(seq);
    }

    /// Ends the step in flight (rules 5 and 6); what it produced is in
    /// [`Engine::take_progress`]. Does nothing when no step is in flight.
    pub fn finish_step(&mut self) {
        let Some(step) = self.step.take() else {
            return;
        };
        let bs = self.config.block_size;
        for &(i, n) in &step.scheduled {
            let seq = &mut self.running[i];
            if seq.aborted {
                continue;
            }
            seq.computed += n;
            let full = (seq.computed / bs).min(seq.hashes.len());
            for b in seq.cached..full {
                let parent = b.checked_sub(1).map(|p| seq.hashes[p]);
                self.pool
                    .cache(seq.blocks[b], seq.hashes[b], parent, seq.id, b);
            }
            seq.cached = seq.cached.max(full);
            if seq.computed == seq.len() {
                seq.output += 1;
                let last = seq.output == seq.max_tokens;
                self.progress.push((
                    seq.id,
                    Progress::Token {
                        index: seq.output - 1,
                        last,
                    },
                ));
                if last {
                    let blocks = std::mem::take(&mut seq.blocks);
                    if seq.transfer.hold {
                        self.held.insert(seq.id, blocks);
                    } else {
                        self.pool.free(&blocks);
                    }
                    seq.aborted = true;
                }
            }
        }
        // Finished and aborted requests leave; the order of the rest stays.
        self.running.retain(|s| !s.aborted);
    }

    /// What happened to requests since the last call, in order.
    pub fn take_progress(&mut self) -> Vec<(RequestId, Progress)> {
        std::mem::take(&mut self.progress)
    }

    /// Changes to the cached set since the last call, in order.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.pool.take_events()
    }

    /// The engine's load at `now`.
    pub fn load(&self, now: Duration) -> Load {
        let bs = self.config.block_size;
        let live = || self.running.iter().filter(|s| !s.aborted);
        // A waiting request's cached prefix now, in blocks: what it would
        // not prefill, nor need blocks for, if admitted now.
        let hits: Vec<usize> = self
            .waiting
            .iter()
            .map(|s| self.pool.lookup(&s.hashes, s.len()))
            .collect();
        // A decode's one token is not prefill.
        let mut queued: u64 = live()
            .map(|s| self.prefill_part(s, s.len() - s.computed) as u64)
            .sum();
        queued += self
            .waiting
            .iter()
            .zip(&hits)
            .map(|(s, &hit)| (s.len() - hit * bs) as u64)
            .sum::<u64>();
        if let Some(step) = &self.step {
            // Scheduled tokens are not computed until the step ends; the
            // share of its prefill done by now is.
            let total = (step.end - step.start).as_secs_f64();
            let done = if total > 0.0 {
                (now.saturating_sub(step.start).as_secs_f64() / total).min(1.0)
            } else {
                1.0
            };
            queued = queued.saturating_sub((step.prefill_tokens as f64 * done) as u64);
        }
        let waiting_blocks = self
            .waiting
            .iter()
            .zip(&hits)
            .map(|(s, &hit)| self.takes(&s.hashes[..hit], s.len()))
            .sum();
        // The last output token is never fed back: it needs no KV.
        let last = |s: &Seq| self.pool.blocks_for(s.prompt + s.max_tokens - 1);
        let growth_blocks = live()
            .map(|s| last(s).saturating_sub(s.blocks.len()))
            .chain(
                (self.waiting.iter())
                    .map(|s| last(s).saturating_sub(self.pool.blocks_for(s.len()))),
            )
            .sum::<usize>() as u64;
        Load {
            waiting: self.waiting.len() as u32,
            running: live().count() as u32,
            num_blocks: self.pool.capacity() as u64,
            used_blocks: (self.pool.capacity() - self.pool.free_blocks()) as u64,
            cached_free_blocks: self.pool.cached_free_blocks() as u64,
            queued_prefill_tokens: queued,
            waiting_blocks,
            growth_blocks,
            remaining_decode_tokens: live().map(|s| (s.max_tokens - s.output) as u64).sum(),
            waiting_decode_tokens: (self.waiting.iter())
                .map(|s| s.max_tokens.saturating_sub(s.output) as u64)
                .sum(),
            preemptions: self.counters.preemptions,
            max_num_seqs: self.config.max_num_seqs as u64,
        }
    }

    /// Prefix-cache and preemption counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Every cached block hash.
    pub fn resident(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.pool.resident()
    }

    /// Cached blocks.
    pub fn cached_blocks(&self) -> usize {
        self.pool.cached_blocks()
    }

    /// vLLM's `reset_prefix_cache`: drops every cached block; refused
    /// (false) while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    /// Forgets every cached hash without an event (the cache restarted).
    pub fn forget_cache(&mut self) {
        self.pool.forget();
    }

    fn seq_mut(&mut self, id: RequestId) -> Option<&mut Seq> {
        self.running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id && !s.aborted)
    }
}

#[cfg(test)]
mod tests;
