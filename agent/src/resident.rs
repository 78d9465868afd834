//! What one vLLM engine holds, rebuilt from its events: the resident block
//! hashes per medium, and where the batch sequence stands. Pure: the
//! subscriber feeds it decoded messages and acts on its verdicts (ask for a
//! replay, start a new incarnation).

use std::collections::{BTreeMap, HashSet};

use crate::events::{Batch, Event};

/// The medium vLLM names when an event gives none: the GPU cache.
pub const DEFAULT_MEDIUM: &str = "GPU";

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
}

impl Sequence {
    /// Judges batch `seq` from the live stream.
    pub fn judge(&self, seq: u64) -> Verdict {
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

    /// Batch `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
    }

    /// Forgets everything (a restart, or a gap that cannot be filled).
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// The resident block hashes per medium.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    media: BTreeMap<String, HashSet<u64>>,
}

impl Resident {
    /// Applies a batch's events in order.
    pub fn apply(&mut self, batch: &Batch) {
        for event in &batch.events {
            match event {
                Event::Stored(s) => {
                    self.set(s.medium.as_deref())
                        .extend(s.block_hashes.iter().copied());
                }
                Event::Removed {
                    block_hashes,
                    medium,
                } => {
                    let set = self.set(medium.as_deref());
                    for h in block_hashes {
                        set.remove(h);
                    }
                }
                Event::Cleared { medium: Some(m) } => {
                    self.media.remove(m);
                }
                Event::Cleared { medium: None } => self.media.clear(),
            }
        }
        self.media.retain(|_, set| !set.is_empty());
    }

    fn set(&mut self, medium: Option<&str>) -> &mut HashSet<u64> {
        self.media
            .entry(medium.unwrap_or(DEFAULT_MEDIUM).to_owned())
            .or_default()
    }

    /// The blocks on `medium`.
    pub fn blocks(&self, medium: &str) -> impl Iterator<Item = u64> + '_ {
        self.media.get(medium).into_iter().flatten().copied()
    }

    /// Blocks per medium.
    pub fn counts(&self) -> BTreeMap<&str, usize> {
        self.media
            .iter()
            .map(|(m, set)| (m.as_str(), set.len()))
            .collect()
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
        r.apply(&batch(vec![
            stored(&[1, 2, 3], None),
            stored(&[9], Some("CPU")),
            Event::Removed {
                block_hashes: vec![2, 42],
                medium: Some("GPU".into()),
            },
        ]));
        let mut gpu: Vec<u64> = r.blocks("GPU").collect();
        gpu.sort_unstable();
        assert_eq!(gpu, [1, 3]);
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
        assert_eq!(s.judge(0), Verdict::Restart, "numbering started over");
        assert_eq!(s.judge(8), Verdict::Restart);
        s.reset();
        assert_eq!(s.judge(0), Verdict::Next);
        assert!(s.is_next(0));
    }
}
