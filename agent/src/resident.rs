//! What one vLLM engine holds, rebuilt from its events: the resident block
//! hashes per medium, and where the batch sequence stands. Pure: the
//! subscriber feeds it decoded messages and acts on its verdicts (ask for a
//! replay, start a new incarnation).

use std::collections::{BTreeMap, HashMap};

use crate::events::{Batch, Event};

/// The medium vLLM names when an event gives none: the GPU cache.
pub const DEFAULT_MEDIUM: &str = "GPU";

/// Media kept apart; events naming a further one are skipped (medium names
/// label metrics, and come from the engine).
pub const MAX_MEDIA: usize = 8;

/// The most blocks one offload medium may hold (its size is not reported;
/// 16M blocks is 256M tokens at block size 16). More means the set is
/// wrong.
pub const MAX_OFFLOADED_BLOCKS: usize = 1 << 24;

/// What a live batch's sequence number says about the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch (or the first one seen): apply it.
    Next,
    /// Batches `from..=to` were missed: replay them before this one.
    Gap {
        /// The first missing sequence number.
        from: u64,
        /// The last missing one.
        to: u64,
    },
    /// Already applied from a replay (which brings everything up to the
    /// moment it ran, so the live stream repeats some of it): skip it.
    Duplicate,
    /// At or below the last one applied: vLLM numbers batches from 0 and
    /// never repeats one while it runs, so the engine restarted. Clear and
    /// start a new incarnation.
    Restart,
}

/// Where the batch sequence stands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sequence {
    /// The last batch applied.
    last: Option<u64>,
    /// Live batches in `(lo, hi]` were applied from a replay.
    replayed: Option<(u64, u64)>,
}

impl Sequence {
    /// Judges batch `seq` from the live stream.
    pub fn judge(&self, seq: u64) -> Verdict {
        if let Some((lo, hi)) = self.replayed
            && seq > lo
            && seq <= hi
        {
            return Verdict::Duplicate;
        }
        match self.last {
            None => Verdict::Next,
            Some(last) if seq <= last => Verdict::Restart,
            Some(last) if seq == last + 1 => Verdict::Next,
            Some(last) => Verdict::Gap {
                from: last + 1,
                to: seq - 1,
            },
        }
    }

    /// Whether a replayed batch `seq` is the next to apply (replies may
    /// repeat what the live stream already brought).
    pub fn is_next(&self, seq: u64) -> bool {
        self.last.is_none_or(|last| seq == last + 1)
    }

    /// Whether batch `seq` has been applied (by a replay, say).
    pub fn has(&self, seq: u64) -> bool {
        self.last.is_some_and(|last| seq <= last)
    }

    /// A replay ran after live batch `seq` revealed a gap, and applied
    /// through [`has`](Self::has): live batches after `seq` up to there are
    /// duplicates.
    pub fn replayed_after(&mut self, seq: u64) {
        if let Some(last) = self.last
            && last > seq
        {
            self.replayed = Some((seq, last));
        }
    }

    /// Batch `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
        if self.replayed.is_some_and(|(_, hi)| seq > hi) {
            self.replayed = None;
        }
    }

    /// Forgets everything (a restart, or a gap that cannot be filled).
    pub fn reset(&mut self) {
        *self = Sequence::default();
    }
}

/// The resident blocks of one medium: a multiset of hashes (vLLM can hold
/// two physical blocks with the same hash, each stored and removed on its
/// own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Medium {
    blocks: HashMap<u64, u32>,
    physical: usize,
}

/// A change to the resident set, as applied: only what changed it (a
/// removal of a block not held is dropped, as the subscriber's index would
/// refuse it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Blocks stored on `medium`, in chain order.
    Stored {
        /// The medium.
        medium: String,
        /// The blocks.
        hashes: Vec<u64>,
        /// The parent of the first.
        parent: Option<u64>,
    },
    /// Blocks removed from `medium`.
    Removed {
        /// The medium.
        medium: String,
        /// The blocks.
        hashes: Vec<u64>,
    },
    /// Every block of `medium` (all media when `None`) dropped.
    Cleared {
        /// The medium.
        medium: Option<String>,
    },
}

/// The resident block hashes per medium.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    media: BTreeMap<String, Medium>,
}

/// The medium's name, `GPU` when the event names none.
fn medium_name(medium: Option<&str>) -> &str {
    medium.unwrap_or(DEFAULT_MEDIUM)
}

impl Resident {
    /// Applies a batch's events in order; returns what changed, and how
    /// many events were skipped for naming a medium beyond [`MAX_MEDIA`].
    pub fn apply(&mut self, batch: &Batch) -> (Vec<Change>, usize) {
        let mut changes = Vec::with_capacity(batch.events.len());
        let mut skipped = 0;
        for event in &batch.events {
            if let Event::Stored(s) = event
                && self.media.len() >= MAX_MEDIA
                && !self.media.contains_key(medium_name(s.medium.as_deref()))
            {
                skipped += 1;
                continue;
            }
            match event {
                Event::Stored(s) => {
                    let medium = medium_name(s.medium.as_deref());
                    let set = self.medium(medium);
                    for &h in &s.block_hashes {
                        *set.blocks.entry(h).or_insert(0) += 1;
                    }
                    set.physical += s.block_hashes.len();
                    if !s.block_hashes.is_empty() {
                        changes.push(Change::Stored {
                            medium: medium.to_owned(),
                            hashes: s.block_hashes.clone(),
                            parent: s.parent_block_hash,
                        });
                    }
                }
                Event::Removed {
                    block_hashes,
                    medium,
                } => {
                    let medium = medium_name(medium.as_deref());
                    let Some(set) = self.media.get_mut(medium) else {
                        continue;
                    };
                    let mut removed = Vec::with_capacity(block_hashes.len());
                    for &h in block_hashes {
                        if let Some(n) = set.blocks.get_mut(&h) {
                            *n -= 1;
                            if *n == 0 {
                                set.blocks.remove(&h);
                            }
                            set.physical -= 1;
                            removed.push(h);
                        }
                    }
                    if !removed.is_empty() {
                        changes.push(Change::Removed {
                            medium: medium.to_owned(),
                            hashes: removed,
                        });
                    }
                }
                Event::Unknown(_) => {}
                Event::Cleared { medium } => {
                    match medium {
                        Some(m) => {
                            self.media.remove(m);
                        }
                        None => self.media.clear(),
                    }
                    changes.push(Change::Cleared {
                        medium: medium.clone(),
                    });
                }
            }
        }
        self.media.retain(|_, set| set.physical > 0);
        (changes, skipped)
    }

    fn medium(&mut self, medium: &str) -> &mut Medium {
        self.media.entry(medium.to_owned()).or_default()
    }

    /// The blocks on `medium`, each copy once.
    pub fn blocks(&self, medium: &str) -> impl Iterator<Item = u64> + '_ {
        self.media.get(medium).into_iter().flat_map(|set| {
            set.blocks
                .iter()
                .flat_map(|(&h, &n)| std::iter::repeat_n(h, n as usize))
        })
    }

    /// The media holding blocks, in name order.
    pub fn media(&self) -> impl Iterator<Item = &str> {
        self.media.keys().map(String::as_str)
    }

    /// Physical blocks per medium.
    pub fn counts(&self) -> BTreeMap<&str, usize> {
        self.media
            .iter()
            .map(|(m, set)| (m.as_str(), set.physical))
            .collect()
    }

    /// Physical blocks on `medium`.
    pub fn count(&self, medium: &str) -> usize {
        self.media.get(medium).map_or(0, |set| set.physical)
    }

    /// Whether `medium` holds `hash`.
    pub fn holds(&self, medium: &str, hash: u64) -> bool {
        self.media
            .get(medium)
            .is_some_and(|set| set.blocks.contains_key(&hash))
    }

    /// Forgets every block.
    pub fn clear(&mut self) {
        self.media.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Stored;

    fn stored(hashes: &[u64], medium: Option<&str>) -> Event {
        Event::Stored(Stored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            lora_id: None,
            medium: medium.map(str::to_owned),
            lora_name: None,
            extra_keys: None,
        })
    }

    fn batch(events: Vec<Event>) -> Batch {
        Batch {
            ts: 0.0,
            events,
            dp_rank: None,
        }
    }

    #[test]
    fn events_build_the_set_per_medium() {
        let mut r = Resident::default();
        let (changes, _) = r.apply(&batch(vec![
            stored(&[1, 2, 3, 3], None),
            stored(&[9], Some("CPU")),
            Event::Removed {
                block_hashes: vec![2, 42, 3],
                medium: Some("GPU".into()),
            },
        ]));
        assert_eq!(
            changes[2],
            Change::Removed {
                medium: "GPU".into(),
                hashes: vec![2, 3]
            },
            "a block not held is not passed on"
        );
        let mut gpu: Vec<u64> = r.blocks("GPU").collect();
        gpu.sort_unstable();
        assert_eq!(gpu, [1, 3], "one copy of 3 is left");
        assert_eq!(r.counts(), BTreeMap::from([("CPU", 1), ("GPU", 2)]));
        r.apply(&batch(vec![Event::Cleared {
            medium: Some("CPU".into()),
        }]));
        assert_eq!(r.counts(), BTreeMap::from([("GPU", 2)]));
        r.apply(&batch(vec![Event::Cleared { medium: None }]));
        assert!(r.counts().is_empty());
    }

    #[test]
    fn sequence_verdicts() {
        let mut s = Sequence::default();
        assert_eq!(s.judge(7), Verdict::Next, "the first batch seen");
        s.applied(7);
        assert_eq!(s.judge(8), Verdict::Next);
        s.applied(8);
        assert_eq!(s.judge(11), Verdict::Gap { from: 9, to: 10 });
        assert!(
            !s.is_next(8) && s.is_next(9),
            "a replay repeats 8, then brings 9"
        );
        s.applied(9);
        s.applied(10);
        s.applied(11);
        s.replayed_after(11 - 2);
        assert_eq!(s.judge(10), Verdict::Duplicate, "replayed, then live");
        assert_eq!(s.judge(12), Verdict::Next);
        assert_eq!(s.judge(0), Verdict::Restart, "numbering started over");
        assert_eq!(s.judge(8), Verdict::Restart);
        s.reset();
        assert_eq!(s.judge(0), Verdict::Next);
        assert!(s.is_next(0));
    }
}
