//! One data-parallel rank of the engine, as the agent serves it: vLLM's
//! event batches go in (live, or replayed after a gap), the resident set
//! and a WatchCache [`Feed`] come out. No I/O: the subscriber loop
//! ([`crate::zmq`]) and the scraper ([`crate::load`]) drive it.
//!
//! The rules:
//! - a batch with the next sequence number is applied; its effective
//!   changes go to subscribers as deltas;
//! - a gap asks for a replay ([`Step::Replay`]); replayed batches are
//!   applied in order, then the batch that revealed the gap; if the gap is
//!   still there, the set is cleared and a new incarnation starts, so
//!   routers resync from an empty (cold, never wrong) snapshot;
//! - a sequence number at or below the last applied means vLLM restarted:
//!   cleared, new incarnation;
//! - more GPU blocks than the engine's capacity (removals missed) is a set
//!   known wrong: cleared, new incarnation;
//! - a `BlockStored` whose block size is not the configured one is skipped
//!   (counted as malformed, `block_size`), and it, or a `block_size` other
//!   than the configured one in `vllm:cache_config_info`, is a fault: the
//!   rank stops serving (a clear error on WatchCache and `/readyz`), since
//!   every hash a router computes would be wrong;
//! - the fault lasts while the engine says so, and clears when both agree
//!   with the configured size again: the scrapes' `cache_config_info`
//!   does, and either a `BlockStored` of the configured size came, or a
//!   whole scrape interval passed with none of another size (an idle
//!   engine, out of service while the rank does not serve, sends no
//!   events to clear it). The set holds no block of the odd size, so
//!   serving resumes with the same incarnation;
//! - a hash recomputed from the event's tokens that differs from the
//!   reported one sets `hash_verification_failed` in the config (and sends
//!   every subscriber a new snapshot), which routers' contract check reads.

use std::sync::{Arc, Mutex, MutexGuard};

use kvroute_core::hash::BlockHasher;
use kvroute_proto::feed::{Feed, Message, Source};
use kvroute_proto::v1::{self, cache_update::Update};
use tokio::sync::mpsc;

use crate::events::{Batch, Event, Message as Batched};
use crate::metrics::Metrics;
use crate::resident::{Change, DEFAULT_MEDIUM, MAX_OFFLOADED_BLOCKS, Resident, Sequence, Verdict};
use crate::verify::Verifier;

/// What the caller must do after a live batch.
#[derive(Debug)]
pub enum Step {
    /// Nothing: applied.
    Done,
    /// Ask vLLM's replay socket for batches `from` on, feed them to
    /// [`Rank::replayed`], then call [`Rank::after_replay`] with `pending`.
    Replay {
        /// The first missing sequence number.
        from: u64,
        /// The batch that revealed the gap.
        pending: Batched,
    },
}

struct State {
    resident: Resident,
    sequence: Sequence,
    feed: Feed,
    verifier: Verifier,
    config: v1::CacheConfig,
    load: v1::LoadReport,
    /// The block size of the last `BlockStored` of another size than the
    /// configured one, while it stands.
    events_block_size: Option<u32>,
    /// Such a `BlockStored` came since the last scrape.
    odd_since_scrape: bool,
    /// `vllm:cache_config_info`'s block size at the last scrape, when not
    /// the configured one.
    metrics_block_size: Option<u32>,
    /// Why the rank does not serve, when it does not (from the above).
    fault: Option<String>,
    /// A batch or a replay arrived, or the stream was quiet long enough.
    synced: bool,
}

/// One rank's state. Cheap to share behind an `Arc`.
pub struct Rank {
    /// The rank's number.
    pub rank: u32,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl Rank {
    /// A rank whose engine hashes as `hasher` says (the agent's flags), with
    /// `config` as its WatchCache config (capacity 0 until known).
    pub fn new(
        rank: u32,
        hasher: BlockHasher,
        config: v1::CacheConfig,
        buffer: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        Rank {
            rank,
            state: Mutex::new(State {
                resident: Resident::default(),
                sequence: Sequence::default(),
                feed: Feed::new(buffer),
                verifier: Verifier::new(hasher),
                config,
                load: v1::LoadReport::default(),
                events_block_size: None,
                odd_since_scrape: false,
                metrics_block_size: None,
                fault: None,
                synced: false,
            }),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A batch from the live stream.
    pub fn live(&self, message: Batched) -> Step {
        let mut state = self.lock();
        match state.sequence.judge(message.seq) {
            Verdict::Next => {}
            Verdict::Duplicate => return Step::Done,
            Verdict::Restart => self.restart_locked(&mut state, "sequence reset"),
            Verdict::Gap { from, to } => {
                self.metrics.gap(self.rank, to - from + 1);
                return Step::Replay {
                    from,
                    pending: message,
                };
            }
        }
        self.apply(&mut state, message.seq, &message.batch);
        Step::Done
    }

    /// A batch from a replay; applied if it is the next one (replies may
    /// repeat batches already applied).
    pub fn replayed(&self, seq: u64, batch: &Batch) {
        let mut state = self.lock();
        if state.sequence.is_next(seq) {
            self.apply(&mut state, seq, batch);
        }
    }

    /// After a replay: applies `pending` if the gap is filled (or finds it
    /// applied by the replay); otherwise starts over (cleared, new
    /// incarnation) from `pending`.
    pub fn after_replay(&self, pending: Batched) {
        let mut state = self.lock();
        let applied = state.sequence.has(pending.seq);
        let filled = applied || matches!(state.sequence.judge(pending.seq), Verdict::Next);
        self.metrics.replay(self.rank, filled);
        if applied {
            state.sequence.replayed_after(pending.seq);
            return;
        }
        if !filled {
            self.restart_locked(&mut state, "unfillable gap");
        }
        self.apply(&mut state, pending.seq, &pending.batch);
    }

    /// The engine restarted (seen from outside, e.g. `/health`): cleared,
    /// new incarnation.
    pub fn restart(&self, reason: &'static str) {
        let mut state = self.lock();
        self.restart_locked(&mut state, reason);
    }

    fn restart_locked(&self, state: &mut State, reason: &'static str) {
        if let Some(left_out) = self.metrics.log_allowed(self.rank, reason) {
            tracing::warn!(
                rank = self.rank,
                reason,
                left_out,
                "starting a new incarnation: the resident set is cleared"
            );
        }
        self.metrics.restart(self.rank, reason);
        state.resident.clear();
        state.sequence.reset();
        state.verifier.clear();
        state.feed.restart();
    }

    fn apply(&self, state: &mut State, seq: u64, batch: &Batch) {
        state.sequence.applied(seq);
        state.synced = true;
        let block_size = state.config.block_size;
        // The engine's last word on its block size in this batch.
        let last_size = batch.events.iter().rev().find_map(|e| match e {
            Event::Stored(s) => Some(s.block_size),
            _ => None,
        });
        let odd = |e: &Event| matches!(e, Event::Stored(s) if s.block_size != block_size);
        let kept;
        let batch = match batch.events.iter().filter(|e| odd(e)).count() {
            0 => batch,
            skipped => {
                for _ in 0..skipped {
                    self.metrics.malformed(self.rank, "block_size");
                }
                kept = Batch {
                    ts: batch.ts,
                    events: batch.events.iter().filter(|e| !odd(e)).cloned().collect(),
                    dp_rank: batch.dp_rank,
                };
                &kept
            }
        };
        match last_size {
            Some(size) if size != block_size => {
                state.events_block_size = Some(size);
                state.odd_since_scrape = true;
            }
            Some(_) => state.events_block_size = None,
            None => {}
        }
        self.refresh_fault(state);
        self.metrics.batch(self.rank, &batch.events);
        let mut mismatch = None;
        for event in &batch.events {
            let Event::Stored(s) = event else { continue };
            let checked = state.verifier.check(s);
            self.metrics.verified(self.rank, &checked);
            mismatch = mismatch.or(checked.mismatched);
        }
        if let Some((reported, recomputed)) = mismatch
            && !state.config.hash_verification_failed
        {
            tracing::error!(
                rank = self.rank,
                reported = format_args!("{reported:#018x}"),
                recomputed = format_args!("{recomputed:#018x}"),
                "vLLM's block hashes differ from those recomputed from its tokens: \
                 --prefix-caching-hash-algo or PYTHONHASHSEED is not what vLLM runs with"
            );
            state.config.hash_verification_failed = true;
            let snapshot = snapshot(state);
            state.feed.resnapshot(snapshot);
        }
        let (changes, skipped) = state.resident.apply(batch);
        for _ in 0..skipped {
            self.metrics.malformed(self.rank, "too_many_media");
        }
        for change in changes {
            let update = match change {
                Change::Stored {
                    medium,
                    hashes,
                    parent,
                } => Update::Stored(v1::BlocksStored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    medium: wire_medium(medium),
                }),
                Change::Removed { medium, hashes } => {
                    for &h in &hashes {
                        if !state.resident.holds(&medium, h) {
                            state.verifier.forget(h);
                        }
                    }
                    Update::Removed(v1::BlocksRemoved {
                        block_hashes: hashes,
                        medium: wire_medium(medium),
                    })
                }
                Change::Cleared { medium } => Update::Cleared(v1::AllBlocksCleared {
                    medium: medium.map(wire_medium),
                }),
            };
            state.feed.change(update);
        }
        // More blocks than the cache holds: removals were missed (lost
        // without a gap in the numbering), so the set is known wrong.
        let capacity = state.config.capacity_blocks as usize;
        let over = (capacity > 0 && state.resident.count(DEFAULT_MEDIUM) > capacity)
            || state
                .resident
                .counts()
                .iter()
                .any(|(m, &n)| *m != DEFAULT_MEDIUM && n > MAX_OFFLOADED_BLOCKS);
        if over {
            self.restart_locked(state, "over capacity");
        }
    }

    /// Recomputes the fault from what the engine last said of its block
    /// size: a rank that starts to disagree stops serving (its streams
    /// end: every hash a router computes would be wrong); one that agrees
    /// again serves. Logged on each change only.
    fn refresh_fault(&self, state: &mut State) {
        let configured = state.config.block_size;
        let said: Vec<String> = [
            state
                .events_block_size
                .map(|bs| format!("vLLM stores blocks of {bs} tokens")),
            state
                .metrics_block_size
                .map(|bs| format!("vLLM's cache_config_info says block_size {bs}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        let fault = (!said.is_empty()).then(|| {
            format!(
                "{} but the agent was started with --block-size {configured}: start it (and the \
                 routers) with vLLM's block size",
                said.join(" and ")
            )
        });
        if fault == state.fault {
            return;
        }
        match &fault {
            Some(fault) => {
                tracing::error!(rank = self.rank, "{fault}");
                state.feed.end_streams();
            }
            None => tracing::warn!(
                rank = self.rank,
                block_size = configured,
                "vLLM's events and cache_config_info agree with --block-size again: serving"
            ),
        }
        state.fault = fault;
    }

    /// The stream was quiet since subscribing: nothing to wait for.
    pub fn quiet(&self) {
        self.lock().synced = true;
    }

    /// The engine's capacity (`num_gpu_blocks`) and block size as its
    /// metrics report them, at each scrape; a new capacity sends every
    /// subscriber a new snapshot.
    pub fn engine_config(&self, capacity: u64, block_size: Option<u32>) {
        let mut state = self.lock();
        let configured = state.config.block_size;
        state.metrics_block_size = block_size.filter(|&bs| bs != configured);
        if block_size == Some(configured) {
            // An odd `BlockStored` stands until a whole interval between
            // scrapes brings none (or one of the configured size comes).
            if !std::mem::take(&mut state.odd_since_scrape) {
                state.events_block_size = None;
            }
        }
        self.refresh_fault(&mut state);
        if capacity != state.config.capacity_blocks {
            state.config.capacity_blocks = capacity;
            let snapshot = snapshot(&state);
            state.feed.resnapshot(snapshot);
        }
    }

    /// The engine's load now.
    pub fn report_load(&self, load: v1::LoadReport) {
        let mut state = self.lock();
        state.load = load;
        state.feed.load(load);
    }

    /// Why the rank cannot serve yet, if it cannot.
    pub fn not_ready(&self) -> Option<String> {
        not_ready(&self.lock()).map(|status| status.message().to_owned())
    }

    /// Physical blocks per medium, and the subscribers connected.
    pub fn stats(&self) -> (Vec<(String, usize)>, usize) {
        let state = self.lock();
        let counts = state
            .resident
            .counts()
            .into_iter()
            .map(|(m, n)| (m.to_owned(), n))
            .collect();
        (counts, state.feed.subscribers())
    }

    /// The incarnation and the last change's sequence.
    pub fn position(&self) -> (String, u64) {
        let state = self.lock();
        (state.feed.incarnation().to_owned(), state.feed.sequence())
    }

    /// Ends every stream (on shutdown).
    pub fn end_streams(&self) {
        self.lock().feed.end_streams();
    }
}

/// The proto's name of a medium: empty for the GPU cache.
fn wire_medium(medium: String) -> String {
    if medium == DEFAULT_MEDIUM {
        String::new()
    } else {
        medium
    }
}

fn snapshot(state: &State) -> v1::CacheSnapshot {
    v1::CacheSnapshot {
        config: Some(state.config.clone()),
        block_hashes: state.resident.blocks(DEFAULT_MEDIUM).collect(),
        load: Some(state.load),
        offloaded: state
            .resident
            .media()
            .filter(|m| *m != DEFAULT_MEDIUM)
            .map(|m| v1::MediumBlocks {
                medium: m.to_owned(),
                block_hashes: state.resident.blocks(m).collect(),
            })
            .collect(),
    }
}

/// Why `state` cannot be served: a fault, or not yet.
fn not_ready(state: &State) -> Option<tonic::Status> {
    if let Some(fault) = &state.fault {
        Some(tonic::Status::failed_precondition(fault.clone()))
    } else if state.config.capacity_blocks == 0 {
        Some(tonic::Status::unavailable(
            "the engine's capacity (num_gpu_blocks in vllm:cache_config_info) is not known yet",
        ))
    } else if !state.synced {
        Some(tonic::Status::unavailable(
            "waiting for vLLM's KV events: not subscribed yet, or no batch yet (an idle engine \
             counts as in sync after the quiet period)",
        ))
    } else {
        None
    }
}

impl Source for Rank {
    fn subscribe(&self) -> Result<mpsc::Receiver<Message>, tonic::Status> {
        let mut state = self.lock();
        if let Some(status) = not_ready(&state) {
            return Err(status);
        }
        let snapshot = snapshot(&state);
        Ok(state.feed.subscribe(snapshot))
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::hash::HashConfig;

    use super::*;
    use crate::events::Stored;

    fn rank() -> Rank {
        let hasher = BlockHasher::new(HashConfig::default()).unwrap();
        let config = v1::CacheConfig {
            block_size: 16,
            capacity_blocks: 100,
            ..Default::default()
        };
        Rank::new(0, hasher, config, 64, Arc::new(Metrics::new()))
    }

    fn batch(seq: u64, events: Vec<Event>) -> Batched {
        Batched {
            topic: Vec::new(),
            seq,
            batch: Batch {
                ts: 0.0,
                events,
                dp_rank: None,
            },
        }
    }

    fn stored(hashes: &[u64], medium: &str) -> Event {
        Event::Stored(Stored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            lora_id: None,
            medium: Some(medium.into()),
            lora_name: None,
            extra_keys: None,
        })
    }

    #[test]
    fn media_reach_subscribers_apart_from_the_gpu_cache() {
        let r = rank();
        assert!(matches!(
            r.live(batch(0, vec![stored(&[1, 2], "GPU"), stored(&[3], "CPU")])),
            Step::Done
        ));
        let mut rx = r.subscribe().unwrap();
        let first = rx.try_recv().unwrap();
        let Some(Update::Snapshot(s)) = &first.update else {
            panic!("{first:?}")
        };
        let mut gpu = s.block_hashes.clone();
        gpu.sort_unstable();
        assert_eq!(gpu, [1, 2]);
        assert_eq!(
            s.offloaded,
            [v1::MediumBlocks {
                medium: "CPU".into(),
                block_hashes: vec![3]
            }]
        );
        r.live(batch(
            1,
            vec![Event::Removed {
                block_hashes: vec![3, 1],
                medium: Some("CPU".into()),
            }],
        ));
        let next = rx.try_recv().unwrap();
        assert_eq!(
            next.update,
            Some(Update::Removed(v1::BlocksRemoved {
                block_hashes: vec![3],
                medium: "CPU".into()
            })),
            "1 is not on the CPU: not passed on"
        );
        assert_eq!(next.sequence, first.sequence + 1);
    }

    #[test]
    fn more_blocks_than_the_cache_holds_starts_over() {
        let r = rank();
        let (incarnation, _) = r.position();
        let blocks: Vec<u64> = (0..100).collect();
        r.live(batch(0, vec![stored(&blocks, "GPU")]));
        assert_eq!(r.position().0, incarnation, "100 of 100 fit");
        r.live(batch(1, vec![stored(&[1000], "GPU")]));
        assert_ne!(r.position().0, incarnation, "101 of 100 do not");
        assert!(r.stats().0.is_empty(), "cleared");
    }

    fn sized(hashes: &[u64], block_size: u32) -> Event {
        let Event::Stored(s) = stored(hashes, "GPU") else {
            unreachable!()
        };
        Event::Stored(Stored { block_size, ..s })
    }

    #[test]
    fn an_odd_block_size_stops_serving_until_the_engine_agrees_again() {
        let r = rank();
        let (incarnation, _) = r.position();
        r.live(batch(0, vec![sized(&[1], 16), sized(&[2], 4)]));
        let why = r.not_ready().expect("faulted");
        assert!(why.contains("blocks of 4 tokens"), "{why}");
        assert_eq!(r.stats().0, [("GPU".to_owned(), 1)], "block 2 skipped");
        r.live(batch(1, vec![sized(&[3], 16)]));
        assert_eq!(r.not_ready(), None, "the events agree again");

        // An idle engine: its scrapes clear it once an interval passes
        // with no odd event.
        r.live(batch(2, vec![sized(&[4], 4)]));
        r.engine_config(100, Some(16));
        assert!(
            r.not_ready().is_some(),
            "the odd event came in this interval"
        );
        r.engine_config(100, Some(16));
        assert_eq!(r.not_ready(), None);

        // The engine's own config disagreeing holds until it agrees.
        r.engine_config(100, Some(8));
        r.live(batch(3, vec![sized(&[5], 16)]));
        let why = r.not_ready().expect("faulted");
        assert!(why.contains("block_size 8"), "{why}");
        r.engine_config(100, Some(16));
        assert_eq!(r.not_ready(), None);
        assert_eq!(r.stats().0, [("GPU".to_owned(), 3)], "1, 3 and 5");
        assert_eq!(r.position().0, incarnation, "same incarnation");
    }

    #[test]
    fn a_gap_asks_for_a_replay_and_an_unfilled_one_starts_over() {
        let r = rank();
        r.live(batch(0, vec![stored(&[1], "GPU")]));
        let (incarnation, _) = r.position();
        let Step::Replay { from, pending } = r.live(batch(3, vec![stored(&[4], "GPU")])) else {
            panic!("a gap")
        };
        assert_eq!(from, 1);
        r.replayed(1, &batch(1, vec![stored(&[2], "GPU")]).batch);
        r.after_replay(pending);
        assert_ne!(r.position().0, incarnation, "batch 2 never came");
        assert_eq!(
            r.stats().0,
            [("GPU".to_owned(), 1)],
            "only block 4 is known"
        );
    }
}
