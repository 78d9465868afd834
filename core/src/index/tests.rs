use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;

fn snap(index: &mut OccupancyIndex, slot: u32, capacity: usize, blocks: &[u64]) {
    index
        .apply(Slot(slot), CacheEvent::Snapshot { capacity, blocks })
        .unwrap();
}

fn prefixes(index: &OccupancyIndex, chain: &[u64]) -> Vec<u32> {
    let mut out = Vec::new();
    index.longest_prefix(chain, &mut out);
    out
}

#[test]
fn longest_prefix_per_endpoint() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 10, &[1, 2, 3]);
    snap(&mut index, 1, 10, &[1, 2]);
    snap(&mut index, 2, 10, &[2, 3]); // holds later blocks but not the first
    snap(&mut index, 4, 10, &[1, 3, 4]); // a hole at block 2
    assert_eq!(prefixes(&index, &[1, 2, 3, 4]), vec![3, 2, 0, 0, 1]);
    assert_eq!(prefixes(&index, &[9, 1]), vec![0; 5]);
    assert_eq!(prefixes(&index, &[]), vec![0; 5]);
}

#[test]
fn deltas_add_remove_and_clear() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 4, &[1]);
    index.apply(Slot(0), CacheEvent::Stored(&[2, 3])).unwrap();
    assert_eq!(prefixes(&index, &[1, 2, 3]), vec![3]);
    index.apply(Slot(0), CacheEvent::Removed(&[2])).unwrap();
    assert_eq!(prefixes(&index, &[1, 2, 3]), vec![1]);
    assert!(index.holds(Slot(0), 3));
    index.apply(Slot(0), CacheEvent::Cleared).unwrap();
    assert_eq!(index.entries(), 0);
    assert_eq!(index.distinct_blocks(), 0);
    assert_eq!(
        index.usage(Slot(0)),
        Some((0, 4)),
        "capacity survives a clear"
    );
}

#[test]
fn a_snapshot_replaces_everything() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 4, &[1, 2]);
    snap(&mut index, 0, 8, &[3]);
    assert!(!index.holds(Slot(0), 1));
    assert_eq!(index.blocks_of(Slot(0)).collect::<Vec<_>>(), vec![3]);
    assert_eq!(index.usage(Slot(0)), Some((1, 8)));
    assert_eq!(index.distinct_blocks(), 1);
}

#[test]
fn capacity_is_never_exceeded_and_a_refused_event_changes_nothing() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 3, &[1, 2]);
    let err = index
        .apply(Slot(0), CacheEvent::Stored(&[3, 4]))
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::OverCapacity {
            slot: 0,
            capacity: 3,
            would_hold: 4
        }
    );
    assert_eq!(index.usage(Slot(0)), Some((2, 3)));
    assert!(!index.holds(Slot(0), 3));
    let err = index
        .apply(
            Slot(1),
            CacheEvent::Snapshot {
                capacity: 1,
                blocks: &[5, 6],
            },
        )
        .unwrap_err();
    assert!(matches!(err, IndexError::OverCapacity { slot: 1, .. }));
    assert_eq!(index.usage(Slot(1)), None);
}

#[test]
fn deltas_before_a_snapshot_and_unknown_removals_are_refused() {
    let mut index = OccupancyIndex::new();
    assert_eq!(
        index.apply(Slot(3), CacheEvent::Stored(&[1])),
        Err(IndexError::NoSnapshot(3))
    );
    assert_eq!(
        index.apply(Slot(3), CacheEvent::Cleared),
        Err(IndexError::NoSnapshot(3))
    );
    snap(&mut index, 0, 4, &[1, 2]);
    // Removing 2 twice in one batch is one more than it holds.
    let err = index
        .apply(Slot(0), CacheEvent::Removed(&[1, 2, 2]))
        .unwrap_err();
    assert_eq!(err, IndexError::NotHeld { slot: 0, block: 2 });
    assert_eq!(prefixes(&index, &[1, 2]), vec![2], "nothing was removed");
}

#[test]
fn duplicate_copies_are_reference_counted() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 4, &[1]);
    index.apply(Slot(0), CacheEvent::Stored(&[1])).unwrap();
    assert_eq!(index.usage(Slot(0)), Some((2, 4)));
    assert_eq!(index.entries(), 1);
    index.apply(Slot(0), CacheEvent::Removed(&[1])).unwrap();
    assert!(index.holds(Slot(0), 1), "one copy is still resident");
    index.apply(Slot(0), CacheEvent::Removed(&[1])).unwrap();
    assert!(!index.holds(Slot(0), 1));
}

#[test]
fn removing_an_endpoint_forgets_its_entries_only() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 4, &[1, 2]);
    snap(&mut index, 1, 4, &[1]);
    index.remove_endpoint(Slot(0));
    assert_eq!(prefixes(&index, &[1, 2]), vec![0, 1]);
    assert_eq!(index.distinct_blocks(), 1);
    assert_eq!(
        index.apply(Slot(0), CacheEvent::Stored(&[1])),
        Err(IndexError::NoSnapshot(0))
    );
}

#[test]
fn more_than_64_endpoints() {
    let mut index = OccupancyIndex::new();
    for slot in 0..130u32 {
        let depth = (slot % 5) as u64;
        let blocks: Vec<u64> = (0..depth).collect();
        snap(&mut index, slot, 8, &blocks);
    }
    let out = prefixes(&index, &[0, 1, 2, 3, 4, 5]);
    for (slot, &depth) in out.iter().enumerate() {
        assert_eq!(depth, (slot % 5) as u32, "slot {slot}");
    }
    assert_eq!(out.len(), 130);
    index.remove_endpoint(Slot(129));
    index.remove_endpoint(Slot(3));
    let out = prefixes(&index, &[0, 1, 2, 3]);
    assert_eq!(out[129], 0);
    assert_eq!(out[3], 0);
    assert_eq!(out[128], 3);
}

#[derive(Clone, Debug)]
enum Op {
    Snapshot(u32, Vec<u64>),
    Stored(u32, Vec<u64>),
    Removed(u32, Vec<u64>),
    Cleared(u32),
    Drop(u32),
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0u32..70;
    let blocks = prop::collection::vec(0u64..12, 0..6);
    prop_oneof![
        (slot.clone(), blocks.clone()).prop_map(|(s, b)| Op::Snapshot(s, b)),
        (slot.clone(), blocks.clone()).prop_map(|(s, b)| Op::Stored(s, b)),
        (slot.clone(), blocks).prop_map(|(s, b)| Op::Removed(s, b)),
        slot.clone().prop_map(Op::Cleared),
        slot.prop_map(Op::Drop),
    ]
}

proptest! {
    /// The index agrees with a naive model (per-endpoint multisets) after any
    /// sequence of events, refused ones included.
    #[test]
    fn matches_a_naive_model(ops in prop::collection::vec(op(), 1..80), chain in prop::collection::vec(0u64..12, 0..8)) {
        const CAP: usize = 8;
        let mut index = OccupancyIndex::new();
        let mut model: HashMap<u32, HashMap<u64, u32>> = HashMap::new();
        for op in ops {
            match op {
                Op::Snapshot(s, b) => {
                    let ok = index.apply(Slot(s), CacheEvent::Snapshot { capacity: CAP, blocks: &b }).is_ok();
                    prop_assert_eq!(ok, b.len() <= CAP);
                    if ok {
                        let m = model.entry(s).or_default();
                        m.clear();
                        for x in b { *m.entry(x).or_default() += 1; }
                    }
                }
                Op::Stored(s, b) => {
                    let ok = index.apply(Slot(s), CacheEvent::Stored(&b)).is_ok();
                    let expect = model.get(&s).is_some_and(|m| m.values().sum::<u32>() as usize + b.len() <= CAP);
                    prop_assert_eq!(ok, expect);
                    if ok {
                        let m = model.get_mut(&s).unwrap();
                        for x in b { *m.entry(x).or_default() += 1; }
                    }
                }
                Op::Removed(s, b) => {
                    let ok = index.apply(Slot(s), CacheEvent::Removed(&b)).is_ok();
                    let expect = model.get(&s).is_some_and(|m| {
                        let mut want: HashMap<u64, u32> = HashMap::new();
                        for &x in &b { *want.entry(x).or_default() += 1; }
                        want.iter().all(|(x, n)| m.get(x).copied().unwrap_or(0) >= *n)
                    });
                    prop_assert_eq!(ok, expect);
                    if ok {
                        let m = model.get_mut(&s).unwrap();
                        for x in b {
                            let n = m.get_mut(&x).unwrap();
                            *n -= 1;
                            if *n == 0 { m.remove(&x); }
                        }
                    }
                }
                Op::Cleared(s) => {
                    let ok = index.apply(Slot(s), CacheEvent::Cleared).is_ok();
                    prop_assert_eq!(ok, model.contains_key(&s));
                    if let Some(m) = model.get_mut(&s) { m.clear(); }
                }
                Op::Drop(s) => {
                    index.remove_endpoint(Slot(s));
                    model.remove(&s);
                }
            }
        }
        let mut out = Vec::new();
        index.longest_prefix(&chain, &mut out);
        for s in 0..70u32 {
            let got = out.get(s as usize).copied().unwrap_or(0);
            let want = model.get(&s).map_or(0, |m| chain.iter().take_while(|b| m.contains_key(b)).count() as u32);
            prop_assert_eq!(got, want, "slot {}", s);
            let held: BTreeSet<u64> = index.blocks_of(Slot(s)).collect();
            let model_held: BTreeSet<u64> = model.get(&s).map(|m| m.keys().copied().collect()).unwrap_or_default();
            prop_assert_eq!(held, model_held);
        }
        for b in 0..12u64 {
            prop_assert_eq!(index.holds_any(b), model.values().any(|m| m.contains_key(&b)), "block {}", b);
        }
        let entries: usize = model.values().map(|m| m.len()).sum();
        prop_assert_eq!(index.entries(), entries);
        let distinct: BTreeSet<u64> = model.values().flat_map(|m| m.keys().copied()).collect();
        prop_assert_eq!(index.distinct_blocks(), distinct.len());
    }
}

#[test]
fn offloaded_blocks_extend_a_prefix_at_their_weight_and_never_fill_capacity() {
    let mut index = OccupancyIndex::new();
    snap(&mut index, 0, 2, &[1, 2]);
    snap(&mut index, 1, 2, &[1]);
    // Offloaded blocks do not count against the GPU capacity of 2.
    index
        .apply(Slot(0), CacheEvent::Offloaded(&[3, 4, 5, 6]))
        .unwrap();
    index
        .apply(Slot(1), CacheEvent::Offloaded(&[2, 3, 4, 5, 6]))
        .unwrap();
    assert_eq!(index.usage(Slot(0)), Some((2, 2)));
    assert_eq!(index.offloaded(Slot(1)), 5);
    assert!(
        index.holds_any(6) && !index.holds_any(7),
        "offloaded blocks are held"
    );
    // Slot 0: 2 on the GPU, then 4 offloaded at 0.5 = 4. Slot 1: 1, then 5.
    assert_eq!(prefixes(&index, &[1, 2, 3, 4, 5, 6]), vec![4, 3]);
    index.set_offload_weight(1.0);
    assert_eq!(prefixes(&index, &[1, 2, 3, 4, 5, 6]), vec![6, 6]);
    index.set_offload_weight(0.0);
    assert_eq!(prefixes(&index, &[1, 2, 3, 4, 5, 6]), vec![2, 1]);
    index.set_offload_weight(1.0);
    // A prefix may start offloaded: vLLM loads it back.
    assert_eq!(prefixes(&index, &[2, 3]), vec![2, 2]);
    index
        .apply(Slot(1), CacheEvent::OffloadRemoved(&[4]))
        .unwrap();
    assert_eq!(prefixes(&index, &[1, 2, 3, 4, 5]), vec![5, 3]);
    assert!(
        index
            .apply(Slot(1), CacheEvent::OffloadRemoved(&[4]))
            .is_err(),
        "no longer held"
    );
    index.apply(Slot(1), CacheEvent::GpuCleared).unwrap();
    assert_eq!(index.usage(Slot(1)), Some((0, 2)));
    assert_eq!(
        prefixes(&index, &[2, 3]),
        vec![2, 2],
        "1's offloaded tier stays"
    );
    index.apply(Slot(1), CacheEvent::Stored(&[1])).unwrap();
    index.apply(Slot(0), CacheEvent::OffloadCleared).unwrap();
    assert_eq!(prefixes(&index, &[1, 2, 3, 4, 5]), vec![2, 3]);
    assert_eq!(index.usage(Slot(0)), Some((2, 2)), "the GPU tier stays");
    // Forgetting the endpoint forgets both tiers.
    index.remove_endpoint(Slot(1));
    assert_eq!(prefixes(&index, &[1, 2, 3]), vec![2, 0]);
    assert_eq!(index.distinct_blocks(), 2);
}
