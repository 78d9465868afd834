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

fn bounded(gpu: usize, offloaded: usize) -> OccupancyIndex {
    let mut index = OccupancyIndex::new();
    index.set_bounds(Bounds { gpu, offloaded });
    index
}

#[test]
fn stores_beyond_the_bound_are_dropped_and_counted_never_refused() {
    // The engine claims a huge cache; the index keeps 3 blocks of it.
    let mut index = bounded(3, 10);
    snap(&mut index, 0, usize::MAX, &[1]);
    index
        .apply(Slot(0), CacheEvent::Stored(&[2, 3, 4, 5]))
        .unwrap();
    assert_eq!(index.usage(Slot(0)), Some((3, usize::MAX)));
    assert_eq!(index.dropped(Tier::Gpu), 2);
    assert_eq!(index.dropped(Tier::Offloaded), 0);
    // The first blocks of a batch are kept, in chain order: a miss past 3.
    assert_eq!(prefixes(&index, &[1, 2, 3, 4, 5]), vec![3]);
    // Removing a dropped block is no divergence, and changes nothing held.
    index.apply(Slot(0), CacheEvent::Removed(&[5, 4])).unwrap();
    assert_eq!(index.usage(Slot(0)), Some((3, usize::MAX)));
    // A removed block that was held goes, and frees room.
    index.apply(Slot(0), CacheEvent::Removed(&[2])).unwrap();
    assert!(!index.holds(Slot(0), 2));
    assert_eq!(prefixes(&index, &[1, 2, 3]), vec![1]);
    index.apply(Slot(0), CacheEvent::Stored(&[6, 7])).unwrap();
    assert!(index.holds(Slot(0), 6) && !index.holds(Slot(0), 7));
    assert_eq!(index.dropped(Tier::Gpu), 3);
    assert_eq!(index.tier_entries(Tier::Gpu), 3);
}

#[test]
fn a_copy_dropped_for_the_bound_never_outlives_the_engines_last_copy() {
    let mut index = bounded(2, 10);
    snap(&mut index, 0, 100, &[1, 2]);
    // A second copy of 1 does not fit: the index holds 1 once, the engine
    // twice.
    index.apply(Slot(0), CacheEvent::Stored(&[1])).unwrap();
    assert_eq!(index.dropped(Tier::Gpu), 1);
    index.apply(Slot(0), CacheEvent::Removed(&[1])).unwrap();
    assert!(
        !index.holds(Slot(0), 1),
        "a miss while the engine has one copy left"
    );
    index.apply(Slot(0), CacheEvent::Removed(&[1])).unwrap();
    assert!(!index.holds(Slot(0), 1));
    assert_eq!(index.usage(Slot(0)), Some((1, 100)));
}

#[test]
fn the_reported_capacity_still_bounds_below_the_index_bound() {
    let mut index = bounded(10, 10);
    snap(&mut index, 0, 3, &[1, 2]);
    assert_eq!(
        index.apply(Slot(0), CacheEvent::Stored(&[3, 4])),
        Err(IndexError::OverCapacity {
            slot: 0,
            capacity: 3,
            would_hold: 4
        })
    );
    assert_eq!(index.dropped(Tier::Gpu), 0);
}

#[test]
fn a_snapshot_over_the_bound_is_truncated_and_a_complete_one_is_strict_again() {
    let mut index = bounded(2, 10);
    snap(&mut index, 0, 1000, &[1, 2, 3, 4]);
    assert_eq!(index.usage(Slot(0)), Some((2, 1000)));
    assert_eq!(index.dropped(Tier::Gpu), 2);
    // Lossy: removing what it may have dropped is fine.
    index.apply(Slot(0), CacheEvent::Removed(&[4])).unwrap();
    // A clear makes the tier complete: unknown removals diverge again.
    index.apply(Slot(0), CacheEvent::GpuCleared).unwrap();
    index.apply(Slot(0), CacheEvent::Stored(&[5])).unwrap();
    assert_eq!(
        index.apply(Slot(0), CacheEvent::Removed(&[6])),
        Err(IndexError::NotHeld { slot: 0, block: 6 })
    );
    snap(&mut index, 0, 1000, &[7]);
    assert_eq!(
        index.apply(Slot(0), CacheEvent::Removed(&[8])),
        Err(IndexError::NotHeld { slot: 0, block: 8 })
    );
}

#[test]
fn offloaded_blocks_have_their_own_bound() {
    let mut index = bounded(10, 2);
    snap(&mut index, 0, 4, &[1]);
    index
        .apply(Slot(0), CacheEvent::Offloaded(&[2, 3, 4, 5]))
        .unwrap();
    assert_eq!(index.offloaded(Slot(0)), 2);
    assert_eq!(index.dropped(Tier::Offloaded), 2);
    assert_eq!(index.tier_entries(Tier::Offloaded), 2);
    assert_eq!(index.dropped(Tier::Gpu), 0);
    index
        .apply(Slot(0), CacheEvent::OffloadRemoved(&[5, 2]))
        .unwrap();
    assert_eq!(index.offloaded(Slot(0)), 1);
    index.apply(Slot(0), CacheEvent::OffloadCleared).unwrap();
    assert_eq!(
        index.apply(Slot(0), CacheEvent::OffloadRemoved(&[9])),
        Err(IndexError::NotHeld { slot: 0, block: 9 })
    );
    // Zero keeps no offloaded block at all.
    let mut index = bounded(10, 0);
    snap(&mut index, 0, 4, &[1]);
    index.apply(Slot(0), CacheEvent::Offloaded(&[2])).unwrap();
    assert_eq!(index.offloaded(Slot(0)), 0);
    assert!(!index.holds_any(2));
}

#[test]
fn an_endpoint_removed_in_steps_is_gone_at_once_for_queries() {
    let mut index = OccupancyIndex::new();
    let blocks: Vec<u64> = (0..10_000).collect();
    snap(&mut index, 0, 20_000, &blocks);
    snap(&mut index, 1, 20_000, &blocks[..5]);
    index
        .apply(Slot(0), CacheEvent::Offloaded(&[20_000]))
        .unwrap();
    index.begin_remove_endpoint(Slot(0));
    assert_eq!(prefixes(&index, &blocks[..8]), vec![0, 5]);
    assert!(!index.holds(Slot(0), 7));
    assert_eq!(index.blocks_of(Slot(0)).count(), 0);
    assert_eq!(index.entries(), 5);
    assert_eq!(
        index.apply(Slot(0), CacheEvent::Stored(&[1])),
        Err(IndexError::NoSnapshot(0))
    );
    let mut steps = 0;
    while index.remove_step() {
        steps += 1;
    }
    assert_eq!(steps, SHARDS - 1);
    assert_eq!(index.distinct_blocks(), 5);
    assert!(!index.holds_any(20_000));
    // A snapshot for a slot still being removed finishes the removal first.
    snap(&mut index, 2, 20_000, &blocks);
    index.begin_remove_endpoint(Slot(2));
    index.remove_step();
    snap(&mut index, 2, 20_000, &[3]);
    assert!(!index.remove_step(), "nothing left to remove");
    assert_eq!(index.blocks_of(Slot(2)).collect::<Vec<_>>(), vec![3]);
    assert_eq!(prefixes(&index, &[0, 1, 2, 3]), vec![0, 4, 0]);
}

proptest! {
    /// Whatever an honest engine with a cache larger than the bounds does
    /// (stores and removals of blocks it holds, clears), the index holds a
    /// sub-multiset of the engine's blocks within the bound: a dropped block
    /// costs a miss, never a false hit, and nothing is refused.
    #[test]
    fn bounded_index_holds_a_subset_of_the_engine(
        ops in prop::collection::vec((0u8..5, prop::collection::vec(0u64..10, 0..6)), 1..120),
        chain in prop::collection::vec(0u64..10, 0..8),
    ) {
        const BOUND: usize = 4;
        let mut index = bounded(BOUND, BOUND);
        let mut engine: [HashMap<u64, u32>; 2] = Default::default();
        snap(&mut index, 0, usize::MAX, &[]);
        for (kind, blocks) in ops {
            let tier = usize::from(kind % 2 == 1);
            match kind {
                0 | 1 => {
                    let event = if tier == 0 { CacheEvent::Stored(&blocks) } else { CacheEvent::Offloaded(&blocks) };
                    prop_assert!(index.apply(Slot(0), event).is_ok());
                    for &b in &blocks { *engine[tier].entry(b).or_default() += 1; }
                }
                2 | 3 => {
                    // The engine removes only what it holds.
                    let mut removed = Vec::new();
                    for &b in &blocks {
                        if let Some(n) = engine[tier].get_mut(&b) {
                            *n -= 1;
                            if *n == 0 { engine[tier].remove(&b); }
                            removed.push(b);
                        }
                    }
                    let event = if tier == 0 { CacheEvent::Removed(&removed) } else { CacheEvent::OffloadRemoved(&removed) };
                    prop_assert!(index.apply(Slot(0), event).is_ok());
                }
                _ => {
                    prop_assert!(index.apply(Slot(0), CacheEvent::GpuCleared).is_ok());
                    engine[0].clear();
                }
            }
            let (used, _) = index.usage(Slot(0)).unwrap();
            prop_assert!(used <= BOUND && index.offloaded(Slot(0)) <= BOUND);
            for b in index.blocks_of(Slot(0)) {
                prop_assert!(engine[0].contains_key(&b), "block {} is held but the engine removed it", b);
            }
        }
        let mut out = Vec::new();
        index.longest_prefix(&chain, &mut out);
        let mut naive = OccupancyIndex::new();
        let all = |m: &HashMap<u64, u32>| m.iter().flat_map(|(&b, &n)| std::iter::repeat_n(b, n as usize)).collect::<Vec<_>>();
        snap(&mut naive, 0, usize::MAX, &all(&engine[0]));
        naive.apply(Slot(0), CacheEvent::Offloaded(&all(&engine[1]))).unwrap();
        let mut want = Vec::new();
        naive.longest_prefix(&chain, &mut want);
        prop_assert!(out.first().copied().unwrap_or(0) <= want.first().copied().unwrap_or(0));
    }
}
