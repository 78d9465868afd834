use super::*;
use crate::v1::{
    AllBlocksCleared, BlocksRemoved, BlocksStored, CacheConfig, CacheSnapshot, LoadReport,
};

fn update(incarnation: &str, sequence: u64, update: Option<Update>) -> CacheUpdate {
    CacheUpdate {
        incarnation: incarnation.to_owned(),
        sequence,
        update,
    }
}

fn snapshot(incarnation: &str, sequence: u64) -> CacheUpdate {
    let snapshot = CacheSnapshot {
        config: Some(CacheConfig::default()),
        block_hashes: vec![1, 2, 3],
        load: Some(LoadReport::default()),
        ..Default::default()
    };
    update(incarnation, sequence, Some(Update::Snapshot(snapshot)))
}

fn stored(incarnation: &str, sequence: u64) -> CacheUpdate {
    let stored = BlocksStored {
        block_hashes: vec![4, 5],
        parent_block_hash: Some(3),
        ..Default::default()
    };
    update(incarnation, sequence, Some(Update::Stored(stored)))
}

fn removed(incarnation: &str, sequence: u64) -> CacheUpdate {
    let removed = BlocksRemoved {
        block_hashes: vec![5],
        ..Default::default()
    };
    update(incarnation, sequence, Some(Update::Removed(removed)))
}

fn cleared(incarnation: &str, sequence: u64) -> CacheUpdate {
    update(
        incarnation,
        sequence,
        Some(Update::Cleared(AllBlocksCleared::default())),
    )
}

fn load(incarnation: &str, sequence: u64) -> CacheUpdate {
    update(
        incarnation,
        sequence,
        Some(Update::Load(LoadReport::default())),
    )
}

/// A checker that has applied a snapshot of incarnation "a" at `sequence`.
fn after_snapshot(sequence: u64) -> SequenceCheck {
    let mut check = SequenceCheck::new();
    assert_eq!(check.observe(&snapshot("a", sequence)), Verdict::Apply);
    check
}

fn resync(reason: ResyncReason) -> Verdict {
    Verdict::Resync(reason)
}

#[test]
fn a_well_formed_stream_applies_everything() {
    let mut check = SequenceCheck::new();
    let stream = [
        snapshot("a", 7),
        load("a", 7),
        stored("a", 8),
        removed("a", 9),
        load("a", 9),
        load("a", 9),
        cleared("a", 10),
        stored("a", 11),
    ];
    for u in &stream {
        assert_eq!(check.observe(u), Verdict::Apply, "{u:?}");
    }
    assert_eq!(check.incarnation(), Some("a"));
    assert_eq!(check.sequence(), Some(11));
}

#[test]
fn the_first_snapshot_may_have_any_sequence() {
    for sequence in [0, 1, u64::MAX] {
        let check = after_snapshot(sequence);
        assert_eq!(check.sequence(), Some(sequence));
    }
}

#[test]
fn each_delta_kind_before_a_snapshot_resyncs() {
    for u in [
        stored("a", 1),
        removed("a", 1),
        cleared("a", 1),
        load("a", 0),
    ] {
        let mut check = SequenceCheck::new();
        assert_eq!(
            check.observe(&u),
            resync(ResyncReason::DeltaBeforeSnapshot),
            "{u:?}"
        );
    }
}

#[test]
fn each_delta_kind_must_advance_by_one() {
    for delta in [stored, removed, cleared] {
        let mut check = after_snapshot(5);
        assert_eq!(check.observe(&delta("a", 6)), Verdict::Apply);
        assert_eq!(check.sequence(), Some(6));
    }
}

#[test]
fn a_skipped_delta_is_a_gap() {
    for delta in [stored, removed, cleared] {
        let mut check = after_snapshot(5);
        assert_eq!(
            check.observe(&delta("a", 7)),
            resync(ResyncReason::Gap {
                expected: 6,
                got: 7
            })
        );
    }
}

#[test]
fn a_repeated_delta_is_a_gap() {
    let mut check = after_snapshot(5);
    assert_eq!(check.observe(&stored("a", 6)), Verdict::Apply);
    assert_eq!(
        check.observe(&stored("a", 6)),
        resync(ResyncReason::Gap {
            expected: 7,
            got: 6
        })
    );
}

#[test]
fn a_load_report_repeats_the_sequence_without_advancing_it() {
    let mut check = after_snapshot(5);
    assert_eq!(check.observe(&load("a", 5)), Verdict::Apply);
    assert_eq!(check.sequence(), Some(5));
    assert_eq!(check.observe(&stored("a", 6)), Verdict::Apply);
}

#[test]
fn a_load_report_ahead_or_behind_is_a_gap() {
    let mut check = after_snapshot(5);
    assert_eq!(
        check.observe(&load("a", 6)),
        resync(ResyncReason::Gap {
            expected: 5,
            got: 6
        })
    );
    let mut check = after_snapshot(5);
    assert_eq!(
        check.observe(&load("a", 4)),
        resync(ResyncReason::Gap {
            expected: 5,
            got: 4
        })
    );
}

#[test]
fn a_delta_or_load_of_another_incarnation_resyncs() {
    // Even with the sequence that would otherwise be right.
    for u in [
        stored("b", 6),
        removed("b", 6),
        cleared("b", 6),
        load("b", 5),
    ] {
        let mut check = after_snapshot(5);
        assert_eq!(
            check.observe(&u),
            resync(ResyncReason::NewIncarnation),
            "{u:?}"
        );
    }
}

#[test]
fn an_empty_update_resyncs_before_or_after_a_snapshot() {
    let mut check = SequenceCheck::new();
    assert_eq!(
        check.observe(&update("a", 0, None)),
        resync(ResyncReason::EmptyUpdate)
    );
    let mut check = after_snapshot(5);
    assert_eq!(
        check.observe(&update("a", 6, None)),
        resync(ResyncReason::EmptyUpdate)
    );
}

#[test]
fn a_second_snapshot_is_always_accepted() {
    // Same incarnation, any sequence (backwards included).
    for sequence in [0, 3, 5, 6, 100] {
        let mut check = after_snapshot(5);
        assert_eq!(check.observe(&snapshot("a", sequence)), Verdict::Apply);
        assert_eq!(check.sequence(), Some(sequence));
        assert_eq!(check.observe(&stored("a", sequence + 1)), Verdict::Apply);
    }
    // A new incarnation: the stream continues from it.
    let mut check = after_snapshot(5);
    assert_eq!(check.observe(&snapshot("b", 0)), Verdict::Apply);
    assert_eq!(check.incarnation(), Some("b"));
    assert_eq!(check.observe(&stored("b", 1)), Verdict::Apply);
    assert_eq!(
        check.observe(&stored("a", 6)),
        resync(ResyncReason::NewIncarnation)
    );
}

#[test]
fn a_resync_resets_the_checker() {
    let mut check = after_snapshot(5);
    assert_eq!(
        check.observe(&stored("a", 9)),
        resync(ResyncReason::Gap {
            expected: 6,
            got: 9
        })
    );
    assert_eq!(check, SequenceCheck::new());
    // The next stream must start with a snapshot again.
    assert_eq!(
        check.observe(&stored("a", 6)),
        resync(ResyncReason::DeltaBeforeSnapshot)
    );
    assert_eq!(check.observe(&snapshot("a", 9)), Verdict::Apply);
    assert_eq!(check.observe(&stored("a", 10)), Verdict::Apply);
}

#[test]
fn reset_forgets_the_stream() {
    let mut check = after_snapshot(5);
    check.reset();
    assert_eq!(check.incarnation(), None);
    assert_eq!(check.sequence(), None);
    assert_eq!(
        check.observe(&stored("a", 6)),
        resync(ResyncReason::DeltaBeforeSnapshot)
    );
}

#[test]
fn reasons_read_well_in_logs() {
    let gap = ResyncReason::Gap {
        expected: 6,
        got: 9,
    };
    assert_eq!(gap.to_string(), "sequence gap: expected 6, got 9");
    assert_eq!(ResyncReason::NewIncarnation.to_string(), "new incarnation");
}
