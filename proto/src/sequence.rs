//! The incarnation and sequence rules of a `WatchCache` stream, as a pure
//! state machine: a subscriber feeds it every `CacheUpdate` before applying
//! it, and it answers whether the update may be applied or the subscriber
//! must drop the engine's entries and resubscribe.
//!
//! Not here: reading the stream, applying updates to an index, backoff.

use std::fmt;

use crate::v1::{CacheUpdate, cache_update::Update};

/// Checks a `WatchCache` stream against the protocol's incarnation and
/// sequence rules (documented on `CacheUpdate` in `cache.proto`).
///
/// Use one per stream: start each subscription with a new checker (or call
/// [`reset`](Self::reset)), since a new stream must begin with a snapshot.
/// After a [`Verdict::Resync`] the checker is back at its initial state,
/// ready for the next stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SequenceCheck {
    /// The incarnation and sequence of the last applied update; `None` until
    /// the first snapshot.
    last: Option<Position>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Position {
    incarnation: String,
    sequence: u64,
}

/// What a subscriber does with an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Verdict {
    /// Apply it. A snapshot replaces everything known about the engine.
    Apply,
    /// Don't apply it: drop everything known about the engine's cache, end
    /// the stream and resubscribe for a fresh snapshot.
    Resync(ResyncReason),
}

/// Why a subscriber must resync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncReason {
    /// A delta or load report of another incarnation than the last snapshot:
    /// the engine restarted or reset its cache.
    NewIncarnation,
    /// A delta whose sequence is not the last one + 1, or a load report whose
    /// sequence is not the last one: changes were lost (or repeated).
    Gap {
        /// The sequence the update should have carried.
        expected: u64,
        /// The sequence it carried.
        got: u64,
    },
    /// A delta or load report before the stream's first snapshot.
    DeltaBeforeSnapshot,
    /// An update with no `update` set (or one this build does not know).
    EmptyUpdate,
}

impl fmt::Display for ResyncReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResyncReason::NewIncarnation => f.write_str("new incarnation"),
            ResyncReason::Gap { expected, got } => {
                write!(f, "sequence gap: expected {expected}, got {got}")
            }
            ResyncReason::DeltaBeforeSnapshot => f.write_str("update before the first snapshot"),
            ResyncReason::EmptyUpdate => f.write_str("update with nothing set"),
        }
    }
}

impl SequenceCheck {
    /// A checker for a new stream: it expects a snapshot first.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks `update` and, when it may be applied, records its position.
    /// A [`Verdict::Resync`] resets the checker.
    pub fn observe(&mut self, update: &CacheUpdate) -> Verdict {
        let verdict = self.check(update);
        match verdict {
            Verdict::Apply => {
                self.last = Some(Position {
                    incarnation: update.incarnation.clone(),
                    sequence: update.sequence,
                })
            }
            Verdict::Resync(_) => self.reset(),
        }
        verdict
    }

    fn check(&self, update: &CacheUpdate) -> Verdict {
        let is_delta = match &update.update {
            None => return Verdict::Resync(ResyncReason::EmptyUpdate),
            Some(Update::Snapshot(_)) => return Verdict::Apply,
            Some(Update::Stored(_) | Update::Removed(_) | Update::Cleared(_)) => true,
            Some(Update::Load(_)) => false,
        };
        let Some(last) = &self.last else {
            return Verdict::Resync(ResyncReason::DeltaBeforeSnapshot);
        };
        if update.incarnation != last.incarnation {
            return Verdict::Resync(ResyncReason::NewIncarnation);
        }
        let expected = if is_delta {
            last.sequence.wrapping_add(1)
        } else {
            last.sequence
        };
        if update.sequence != expected {
            return Verdict::Resync(ResyncReason::Gap {
                expected,
                got: update.sequence,
            });
        }
        Verdict::Apply
    }

    /// Forgets the stream: the next update must be a snapshot. Call it when a
    /// stream ends and the subscriber resubscribes.
    pub fn reset(&mut self) {
        self.last = None;
    }

    /// The incarnation of the last applied update; `None` before the first
    /// snapshot.
    pub fn incarnation(&self) -> Option<&str> {
        self.last.as_ref().map(|p| p.incarnation.as_str())
    }

    /// The sequence of the last applied update; `None` before the first
    /// snapshot.
    pub fn sequence(&self) -> Option<u64> {
        self.last.as_ref().map(|p| p.sequence)
    }
}

#[cfg(test)]
mod tests;
