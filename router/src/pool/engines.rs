//! What the engines report, and whether the pool believes it: each
//! engine's cache settings checked against the routing settings (its
//! contract), its WatchCache snapshots and changes applied to the occupancy
//! index, its load reports, its stream's state. A change of the routing
//! settings checks every contract again.
//!
//! Not here: the WatchCache client itself ([`super::cache_watch`]), or the
//! index's rules (`kvroute_core::index`).

use std::sync::Arc;

use kvroute_core::contract::{Contract, EngineCache};
use kvroute_core::index::{CacheEvent, IndexError};
use kvroute_core::load::EngineLoad;

use super::endpoints::{Stream, StreamState, Streams};
use super::{Inner, Pool};
use crate::settings::Settings;

/// Blocks of a snapshot applied under one hold of the lock: about a
/// millisecond of work, so routing never waits longer for a snapshot.
pub const SNAPSHOT_CHUNK: usize = 8192;

impl Pool {
    /// Replaces the routing settings with `f(current)`, all at once. A new
    /// policy starts without the old one's learned state (the index is
    /// kept); every engine's contract is checked again: one that no longer
    /// matches loses its entries, one that matches again resubscribes for
    /// a fresh snapshot (returned in [`Streams::start`]).
    pub fn update_settings(&self, f: impl FnOnce(&Settings) -> Settings) -> Streams {
        let mut inner = self.lock();
        let settings = Arc::new(f(&inner.settings));
        if settings.policy != inner.settings.policy {
            inner.policy = settings.policy.build();
        }
        inner.index.set_offload_weight(settings.offload_weight);
        inner.settings = settings;
        let names: Vec<String> = inner.members.keys().cloned().collect();
        let mut changes = Vec::new();
        let mut streams = Streams::default();
        for name in names {
            let Some(m) = inner.members.get(&name) else {
                continue;
            };
            let Some(engine) = m.engine.clone() else {
                continue;
            };
            let was = m.contract.clone();
            let now = Contract::check(&engine, &inner.settings.hasher);
            if now == was {
                continue;
            }
            if now == Contract::Match {
                // Its updates were not indexed: start over from a snapshot.
                streams.start.extend(restart_stream(&mut inner, &name));
            } else {
                let slot = m.slot;
                inner.index.begin_remove_endpoint(slot);
                if let Some(m) = inner.members.get_mut(&name) {
                    m.contract = now.clone();
                }
            }
            changes.push((name, now));
        }
        drop(inner);
        self.finish_removals();
        for (name, contract) in changes {
            log_contract(&name, &contract);
        }
        streams
    }

    /// Applies a snapshot for the watcher `(name, generation)`: checks the
    /// engine's cache settings against the routing settings, then indexes
    /// `blocks` if they match (else drops the endpoint's entries). A stale
    /// watcher's snapshot is ignored (Ok), and so is the rest of one whose
    /// watcher became stale while it was applied. An error means the index
    /// refused it: the watcher drops the endpoint and resyncs.
    ///
    /// The old entries go a shard at a time, then the blocks come in
    /// [`SNAPSHOT_CHUNK`]s, the lock released in between: routing meanwhile
    /// sees a part of the new contents (misses, never false hits).
    pub fn apply_snapshot(
        &self,
        name: &str,
        generation: u64,
        engine: EngineCache,
        capacity: usize,
        blocks: &[u64],
        offloaded: &[&[u64]],
    ) -> Result<(), IndexError> {
        let mut inner = self.lock();
        let contract = Contract::check(&engine, &inner.settings.hasher);
        let Some(m) = inner
            .members
            .get_mut(name)
            .filter(|m| m.generation == generation)
        else {
            return Ok(());
        };
        let changed = m.contract != contract;
        m.engine = Some(engine);
        m.contract = contract.clone();
        let slot = m.slot;
        let matched = contract == Contract::Match;
        // Refused before anything changes, as the index would.
        let refused = (matched && blocks.len() > capacity).then_some(IndexError::OverCapacity {
            slot: slot.0,
            capacity,
            would_hold: blocks.len(),
        });
        if refused.is_none() {
            inner.index.begin_remove_endpoint(slot);
        }
        drop(inner);
        if changed {
            log_contract(name, &contract);
        }
        if let Some(e) = refused {
            return Err(e);
        }
        self.finish_removals();
        if !matched {
            return Ok(());
        }
        let empty = CacheEvent::Snapshot {
            capacity,
            blocks: &[],
        };
        let events = std::iter::once(empty)
            .chain(blocks.chunks(SNAPSHOT_CHUNK).map(CacheEvent::Stored))
            .chain(
                offloaded
                    .iter()
                    .flat_map(|b| b.chunks(SNAPSHOT_CHUNK))
                    .map(CacheEvent::Offloaded),
            );
        for event in events {
            let mut inner = self.lock();
            let current = inner
                .members
                .get(name)
                .is_some_and(|m| m.generation == generation && m.contract == Contract::Match);
            if !current {
                return Ok(());
            }
            inner.index.apply(slot, event)?;
        }
        Ok(())
    }

    /// Applies one WatchCache change for the watcher `(name, generation)`.
    /// A stale watcher's changes, and those of an engine whose contract
    /// does not match, are ignored (Ok). An error means the stream
    /// diverged: the watcher drops the endpoint and resyncs.
    pub fn apply_cache(
        &self,
        name: &str,
        generation: u64,
        event: CacheEvent<'_>,
    ) -> Result<(), IndexError> {
        let mut inner = self.lock();
        let Some(slot) = inner
            .members
            .get(name)
            .filter(|m| m.generation == generation && m.contract == Contract::Match)
            .map(|m| m.slot)
        else {
            return Ok(());
        };
        inner.index.apply(slot, event)
    }

    /// Records an engine's load report.
    pub fn report_load(&self, name: &str, generation: u64, load: EngineLoad) {
        let mut inner = self.lock();
        if let Some(slot) = inner
            .members
            .get(name)
            .filter(|m| m.generation == generation)
            .map(|m| m.slot)
        {
            inner.load.report(slot, load);
            drop(inner);
            self.changed.notify_waiters();
        }
    }

    /// Sets a watcher's stream state; leaving `Live` drops the endpoint's
    /// entries until a new snapshot arrives.
    pub fn set_stream(&self, name: &str, generation: u64, state: StreamState) {
        let mut inner = self.lock();
        let Some(m) = inner
            .members
            .get_mut(name)
            .filter(|m| m.generation == generation)
        else {
            return;
        };
        m.stream = state;
        m.snapshotted |= state == StreamState::Live;
        let slot = m.slot;
        if state != StreamState::Live {
            inner.index.begin_remove_endpoint(slot);
            drop(inner);
            self.finish_removals();
        }
    }
}

/// Gives member `name` a new generation, forgetting its engine, and
/// returns the stream to start for it.
fn restart_stream(inner: &mut Inner, name: &str) -> Option<Stream> {
    inner.generations += 1;
    let generation = inner.generations;
    let m = inner.members.get_mut(name)?;
    m.generation = generation;
    m.engine = None;
    m.contract = Contract::Unknown;
    let addr = m.spec.cache?;
    m.stream = StreamState::Connecting;
    Some(Stream {
        name: name.to_owned(),
        generation,
        addr,
    })
}

/// Logs a change of an engine's contract: once per change, so a
/// mismatched engine's resyncs do not repeat it.
fn log_contract(name: &str, contract: &Contract) {
    match contract {
        Contract::Mismatch(fields) => {
            let fields: Vec<String> = fields
                .iter()
                .map(|m| format!("{}: engine {}, router {}", m.field, m.engine, m.router))
                .collect();
            tracing::warn!(endpoint = %name, differ = %fields.join("; "),
                "the engine hashes its cache differently from the routing settings: \
                 its cache is not used for routing until they agree");
        }
        Contract::Match => tracing::info!(endpoint = %name, "the engine's cache settings match"),
        Contract::Unknown => {}
    }
}
