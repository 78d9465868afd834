use kvroute_core::rng::SplitMix64;
use proptest::prelude::*;

use super::*;

const DIM: usize = 32;
const A: [u8; 32] = [0xa; 32];
const B: [u8; 32] = [0xb; 32];
const CONTEXT: [u8; 32] = [1; 32];
/// Small batches: graphs and merges from a few entries.
const SMALL: Shape = Shape {
    batch: 16,
    fanout: 4,
    ef: 16,
    ef_construction: 40,
};
const BATCH: usize = SMALL.batch;
const FANOUT: usize = SMALL.fanout;

fn small(max_entries: usize) -> Index {
    Index::with_shape(max_entries, SMALL)
}

/// A random unit vector of `dim` dimensions.
fn unit(rng: &mut SplitMix64, dim: usize) -> Vec<f32> {
    let v: Vec<f32> = (0..dim)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect();
    let norm = dot(&v, &v).sqrt();
    v.into_iter().map(|x| x / norm).collect()
}

fn key(n: u64) -> Key {
    let mut digest = [0; 32];
    digest[..8].copy_from_slice(&n.to_le_bytes());
    Key {
        digest,
        model: "m".into(),
    }
}

/// Which entry a key is.
fn n(key: &Key) -> u64 {
    u64::from_le_bytes(key.digest[..8].try_into().unwrap())
}

/// Runs `builds` and every build their installs hand out.
fn settle(index: &mut Index, mut builds: Vec<Build>) {
    while let Some(build) = builds.pop() {
        builds.extend(index.install(build.run()));
    }
}

/// Inserts `vector` as entry `n`, running the builds due.
fn put(index: &mut Index, partition: [u8; 32], vector: &[f32], context: [u8; 32], n: u64) {
    let builds = index.insert(partition, vector, context, key(n)).unwrap();
    settle(index, builds);
}

fn graphs(index: &Index, partition: &[u8; 32]) -> usize {
    index
        .partitions
        .get(partition)
        .map_or(0, |p| p.graphs.len())
}

#[test]
fn an_exact_vector_is_found_with_similarity_one() {
    let mut rng = SplitMix64::new(1);
    let mut index = small(10_000);
    let vectors: Vec<Vec<f32>> = (0..700).map(|_| unit(&mut rng, DIM)).collect();
    for (i, v) in vectors.iter().enumerate() {
        put(&mut index, A, v, CONTEXT, i as u64);
    }
    assert!(graphs(&index, &A) >= 2, "most are in graphs");
    for (i, v) in vectors.iter().enumerate() {
        let hit = index.nearest(&A, v, &CONTEXT).unwrap().unwrap();
        assert_eq!(n(&hit.key), i as u64);
        assert!((hit.similarity - 1.0).abs() < 1e-5, "{}", hit.similarity);
    }
    assert_eq!(index.nearest(&B, &vectors[0], &CONTEXT), Ok(None));
}

#[test]
fn an_entry_of_another_context_is_never_returned() {
    let mut rng = SplitMix64::new(2);
    let mut index = small(10_000);
    let other = [2; 32];
    let asked = unit(&mut rng, DIM);
    put(&mut index, A, &asked, other, 0);
    assert_eq!(index.nearest(&A, &asked, &CONTEXT), Ok(None));
    // Many others in the query's context, in graphs and in `fresh`: the
    // nearest of them is found, never the exact match of another context.
    for i in 1..300 {
        put(&mut index, A, &unit(&mut rng, DIM), CONTEXT, i);
    }
    assert!(graphs(&index, &A) >= 1);
    let hit = index.nearest(&A, &asked, &CONTEXT).unwrap().unwrap();
    assert_ne!(n(&hit.key), 0);
    assert!(hit.similarity < 0.99);
    let hit = index.nearest(&A, &asked, &other).unwrap().unwrap();
    assert_eq!((n(&hit.key), hit.similarity > 0.9999), (0, true));
}

proptest! {
    // Each case builds graphs: a few dozen cases keep the test to seconds.
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever is inserted where, a search in one partition returns only
    /// an entry inserted into it, with the query's context, and live.
    #[test]
    fn no_partition_sees_another_partitions_entries(
        inserts in proptest::collection::vec((0..2u8, 0..2u8, any::<u64>()), 1..700),
        max_entries in 1..400usize,
    ) {
        let mut index = small(max_entries);
        let mut owner = Vec::new();
        for (i, (partition, context, seed)) in inserts.into_iter().enumerate() {
            let v = unit(&mut SplitMix64::new(seed), 8);
            let (partition, context) = ([partition; 32], [context; 32]);
            // Search before inserting: what it finds is another entry.
            if let Some(hit) = index.nearest(&partition, &v, &context).unwrap() {
                let found = n(&hit.key) as usize;
                prop_assert_eq!(owner[found], (partition, context));
                prop_assert!(found + max_entries >= i, "{found} was evicted");
            }
            put(&mut index, partition, &v, context, i as u64);
            owner.push((partition, context));
            prop_assert!(index.len() <= max_entries);
        }
    }
}

#[test]
fn live_entries_and_memory_stay_bounded() {
    let dim = 64;
    let max_entries = 1_000;
    let mut rng = SplitMix64::new(3);
    let mut index = small(max_entries);
    let per_entry = graph::ENTRY_BYTES + 4 * dim + 1 + graph::GRAPH_BYTES;
    let partitions = [A, B, [0xc; 32]];
    for i in 0..3 * max_entries {
        let p = partitions[(rng.next_u64() % 3) as usize];
        put(&mut index, p, &unit(&mut rng, dim), CONTEXT, i as u64);
        assert!(index.len() <= max_entries);
        assert!(index.held() <= 2 * max_entries);
        assert!(index.bytes() <= 2 * max_entries * (per_entry + 32) + 3 * 1024);
        assert_eq!(index.bytes(), index.bytes_counted());
    }
    assert_eq!(index.len(), max_entries);
    assert_eq!(index.partitions(), 3);
    // Builds run as handed out: about as many dead entries as live ones
    // at most.
    assert!(index.held() <= 2 * max_entries);
    eprintln!(
        "{} live, {} held, {} bytes ({} per live entry)",
        index.len(),
        index.held(),
        index.bytes(),
        index.bytes() / index.len()
    );
}

#[test]
fn memory_stays_bounded_when_builds_are_never_installed() {
    let max_entries = 600;
    let mut rng = SplitMix64::new(4);
    let mut index = small(max_entries);
    let mut held_back = Vec::new();
    for i in 0..6 * max_entries as u64 {
        // One partition's builds are installed, the others' kept.
        let p = [(i % 3) as u8; 32];
        let builds = index
            .insert(p, &unit(&mut rng, DIM), CONTEXT, key(i))
            .unwrap();
        for build in builds {
            if build.partition[0] == 0 {
                settle(&mut index, vec![build]);
            } else {
                held_back.push(build);
            }
        }
        assert!(index.len() <= max_entries);
        assert!(index.held() <= 2 * max_entries);
        assert_eq!(index.bytes(), index.bytes_counted());
    }
    assert!(!held_back.is_empty());
}

/// At the most dimensions an embedder may answer, an entry is about
/// 65 KiB: `max_bytes` bounds what the index holds, dead entries waiting
/// in graphs included, whatever `max_entries` allows.
#[test]
fn max_bytes_bounds_the_index_at_16384_dimensions() {
    let dim = crate::response_cache::semantic::embeddings::MAX_DIM;
    let max_bytes = 4 << 20;
    let mut rng = SplitMix64::new(11);
    let mut index = small(10_000).with_max_bytes(max_bytes);
    let per_entry = graph::ENTRY_BYTES + 4 * dim + 1 + graph::GRAPH_BYTES + 32;
    let mut most = 0;
    for i in 0..160 {
        put(&mut index, A, &unit(&mut rng, dim), CONTEXT, i);
        assert!(index.bytes() <= max_bytes, "{} at {i}", index.bytes());
        assert_eq!(index.bytes(), index.bytes_counted());
        most = most.max(index.len());
    }
    assert!(index.graphs() >= 1, "entries went into graphs");
    // Evictions free memory, they do not empty the index.
    assert!(index.len() * per_entry * 4 >= max_bytes, "{}", index.len());
    assert!(most * per_entry <= max_bytes && most < 160, "{most}");
    eprintln!(
        "{per_entry} bytes an entry at {dim} dimensions; at most {most} of {max_bytes} bytes"
    );
}

#[test]
fn a_new_dimension_empties_the_index_and_refuses_the_old_one() {
    let mut rng = SplitMix64::new(12);
    let mut index = small(10_000);
    assert!(
        !index.set_dimension(DIM),
        "a first dimension empties nothing"
    );
    let mut kept = Vec::new();
    for i in 0..BATCH as u64 {
        kept.extend(
            index
                .insert(A, &unit(&mut rng, DIM), CONTEXT, key(i))
                .unwrap(),
        );
    }
    assert_eq!(kept.len(), 1, "a build handed out");
    assert!(!index.set_dimension(DIM), "the same dimension keeps them");
    assert_eq!(index.len(), BATCH);
    assert!(index.set_dimension(8));
    assert_eq!((index.len(), index.held(), index.bytes()), (0, 0, 0));
    let old = unit(&mut rng, DIM);
    assert!(matches!(
        index.insert(A, &old, CONTEXT, key(99)),
        Err(IndexError::Dimension {
            expected: 8,
            got: DIM
        })
    ));
    put(&mut index, A, &unit(&mut rng, 8), CONTEXT, 100);
    // The old build, installed late, is dropped.
    for build in kept {
        assert!(index.install(build.run()).is_empty());
    }
    assert_eq!((index.len(), index.graphs()), (1, 0));
    assert_eq!(index.bytes(), index.bytes_counted());
}

#[test]
fn the_oldest_are_evicted_first() {
    let mut rng = SplitMix64::new(5);
    let max_entries = 300;
    let mut index = small(max_entries);
    let vectors: Vec<Vec<f32>> = (0..1_000).map(|_| unit(&mut rng, DIM)).collect();
    for (i, v) in vectors.iter().enumerate() {
        let p = if i % 2 == 0 { A } else { B };
        put(&mut index, p, v, CONTEXT, i as u64);
    }
    assert_eq!(index.len(), max_entries);
    for (i, v) in vectors.iter().enumerate() {
        let p = if i % 2 == 0 { A } else { B };
        let found = index
            .nearest(&p, v, &CONTEXT)
            .unwrap()
            .filter(|hit| n(&hit.key) == i as u64);
        assert_eq!(found.is_some(), i >= 1_000 - max_entries, "entry {i}");
    }
    // A partition whose entries are all evicted is forgotten.
    for i in 1_000..1_000 + max_entries as u64 {
        put(&mut index, B, &unit(&mut rng, DIM), CONTEXT, i);
    }
    assert_eq!(index.partitions(), 1);
    assert_eq!(index.nearest(&A, &vectors[998], &CONTEXT), Ok(None));
}

#[test]
fn graphs_are_built_and_merged_and_still_found() {
    let mut rng = SplitMix64::new(6);
    let mut index = small(10_000);
    let vectors: Vec<Vec<f32>> = (0..BATCH * FANOUT * 2 + 5)
        .map(|_| unit(&mut rng, DIM))
        .collect();
    for (i, v) in vectors.iter().enumerate() {
        put(&mut index, A, v, CONTEXT, i as u64);
        let p = &index.partitions[&A];
        let built = p.graphs.iter().map(Graph::len).sum::<usize>();
        assert_eq!(built, (i + 1) / BATCH * BATCH, "built by batch");
        assert!(p.fresh.len() < BATCH);
        for tier in 0..4 {
            let of_tier = (p.graphs.iter())
                .filter(|g| g.tier(BATCH, FANOUT) == tier)
                .count();
            assert!(of_tier < FANOUT, "merged");
        }
    }
    // 8 batches: merged in two graphs of 4.
    let sizes: Vec<usize> = index.partitions[&A].graphs.iter().map(Graph::len).collect();
    assert_eq!(sizes, [BATCH * FANOUT, BATCH * FANOUT]);
    for (i, v) in vectors.iter().enumerate() {
        let hit = index.nearest(&A, v, &CONTEXT).unwrap().unwrap();
        assert_eq!(n(&hit.key), i as u64);
    }
}

#[test]
fn entries_being_built_are_found_and_a_dropped_build_is_handed_out_again() {
    let mut rng = SplitMix64::new(7);
    let mut index = small(10_000);
    let vectors: Vec<Vec<f32>> = (0..BATCH + 10).map(|_| unit(&mut rng, DIM)).collect();
    let mut due = Vec::new();
    for (i, v) in vectors.iter().enumerate() {
        due.extend(index.insert(A, v, CONTEXT, key(i as u64)).unwrap());
    }
    assert_eq!(due.len(), 1, "one build per partition at a time");
    let build = due.pop().unwrap();
    assert_eq!(build.len(), BATCH);
    let found = |index: &Index| {
        (vectors.iter().enumerate()).all(|(i, v)| {
            let hit = index.nearest(&A, v, &CONTEXT).unwrap().unwrap();
            n(&hit.key) == i as u64
        })
    };
    assert!(found(&index), "while the build is out");

    // Dropped: handed out again, with what has come since.
    drop(build);
    let mut due = (index.insert(A, &unit(&mut rng, DIM), CONTEXT, key(999))).unwrap();
    assert_eq!(due.len(), 1);
    let build = due.pop().unwrap();
    assert_eq!(build.len(), BATCH + 11);
    let built = build.run();
    assert!(found(&index), "while the result is out");
    assert!(index.install(built).is_empty());
    assert_eq!(graphs(&index, &A), 1);
    assert!(index.partitions[&A].fresh.is_empty());
    assert!(found(&index), "installed");
}

#[test]
fn a_graph_mostly_dead_is_rebuilt() {
    let mut rng = SplitMix64::new(8);
    let mut index = small(2 * BATCH);
    for i in 0..2 * BATCH as u64 {
        put(&mut index, A, &unit(&mut rng, DIM), CONTEXT, i);
    }
    assert_eq!(graphs(&index, &A), 2);
    // Evicting half of the oldest graph and one more rebuilds it.
    for i in 0..BATCH as u64 / 2 + 1 {
        put(&mut index, B, &unit(&mut rng, DIM), CONTEXT, 1_000 + i);
    }
    let sizes: Vec<usize> = index.partitions[&A].graphs.iter().map(Graph::len).collect();
    assert_eq!(sizes, [BATCH / 2 - 1, BATCH]);
    assert_eq!(index.held(), index.len());
}

#[test]
fn vectors_refused_change_nothing() {
    let mut rng = SplitMix64::new(9);
    let mut index = small(10);
    let v = unit(&mut rng, DIM);
    put(&mut index, A, &v, CONTEXT, 0);
    let short = unit(&mut rng, DIM - 1);
    let refused = index.insert(A, &short, CONTEXT, key(1));
    assert_eq!(
        refused.unwrap_err(),
        IndexError::Dimension {
            expected: DIM,
            got: DIM - 1
        }
    );
    let mut nan = v.clone();
    nan[3] = f32::NAN;
    assert_eq!(
        index.insert(A, &nan, CONTEXT, key(1)).unwrap_err(),
        IndexError::NotFinite
    );
    let long: Vec<f32> = v.iter().map(|x| x * 2.0).collect();
    assert!(matches!(
        index.insert(A, &long, CONTEXT, key(1)),
        Err(IndexError::NotUnit { .. })
    ));
    assert_eq!(
        index.insert(A, &[], CONTEXT, key(1)).unwrap_err(),
        IndexError::Dimension {
            expected: DIM,
            got: 0
        }
    );
    assert_eq!(index.len(), 1);
    assert!(index.nearest(&A, &short, &CONTEXT).is_err());
    assert!(index.nearest(&A, &nan, &CONTEXT).is_err());
    assert_eq!(n(&index.nearest(&A, &v, &CONTEXT).unwrap().unwrap().key), 0);
    assert!(matches!(
        Index::new(10).insert(A, &[0.0; 4], CONTEXT, key(1)),
        Err(IndexError::NotUnit { .. })
    ));
}

#[test]
fn partitions_are_of_tenant_and_model_each_whole() {
    assert_ne!(partition(None, "m"), partition(Some(""), "m"));
    assert_ne!(partition(Some("ab"), "c"), partition(Some("a"), "bc"));
    assert_ne!(partition(Some("t"), "m"), partition(Some("u"), "m"));
    assert_eq!(partition(Some("t"), "m"), partition(Some("t"), "m"));
}

/// Searched with each stored vector, the index returns that entry: HNSW
/// is approximate, but at most 1 % may be missed.
#[test]
fn recall_of_stored_vectors_is_at_least_99_percent() {
    let dim = 256;
    let mut rng = SplitMix64::new(10);
    // All in one graph of the default search parameters, through merges.
    let shape = Shape {
        batch: 125,
        fanout: 4,
        ..Shape::default()
    };
    let mut index = Index::with_shape(10_000, shape);
    let vectors: Vec<Vec<f32>> = (0..2_000).map(|_| unit(&mut rng, dim)).collect();
    for (i, v) in vectors.iter().enumerate() {
        put(&mut index, A, v, CONTEXT, i as u64);
    }
    let found = (vectors.iter().enumerate())
        .filter(|(i, v)| {
            let hit = index.nearest(&A, v, &CONTEXT).unwrap();
            hit.is_some_and(|h| n(&h.key) == *i as u64)
        })
        .count();
    assert_eq!((index.graphs(), index.partitions[&A].fresh.len()), (1, 0));
    assert!(found * 100 >= vectors.len() * 99, "{found}");
}

/// The router shares the index between threads behind a lock and runs
/// builds on blocking threads.
#[test]
fn the_index_is_shared_and_builds_sent() {
    fn shared<T: Send + Sync>() {}
    fn sent<T: Send>() {}
    shared::<Index>();
    sent::<Build>();
    sent::<Built>();
}
