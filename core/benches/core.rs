//! Criterion benchmarks of the core's hot functions. Targets on a 2-core
//! machine: hashing an 8,192-token prompt ≤ 150 µs, ranking 128 endpoints
//! ≤ 5 µs, a 512-block longest-prefix lookup over 1M entries ≤ 20 µs,
//! applying a 1,000-block stored event ≤ 100 µs.
//!
//! `cargo bench -p kvroute-core`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_core::hash::{BlockExtras, BlockHasher, HashAlgo, HashConfig};
use kvroute_core::index::{CacheEvent, OccupancyIndex};
use kvroute_core::keys::RoutingKey;
use kvroute_core::load::Load;
use kvroute_core::policy::{Context, Endpoint, KvrouteConfig, PolicyConfig, Request};
use kvroute_core::rendezvous::{endpoint_id, rank_into};
use kvroute_core::rng::SplitMix64;
use kvroute_core::slot::Slot;

/// Deterministic pseudo-random u64s.
fn random_u64s(seed: u64, n: usize) -> Vec<u64> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_u64()).collect()
}

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = random_u64s(1, 8192)
        .into_iter()
        .map(|x| (x % 128_000) as u32)
        .collect();
    let mut g = c.benchmark_group("hash_8192_tokens_bs16");
    for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::XxhashCbor] {
        let hasher = BlockHasher::new(HashConfig {
            algo,
            block_size: 16,
            seed: Some("0".into()),
            ..HashConfig::default()
        })
        .unwrap();
        g.bench_function(BenchmarkId::from_parameter(algo), |b| {
            b.iter(|| hasher.hashes(black_box(&tokens), BlockExtras::default()))
        });
    }
    g.finish();
}

fn ranking(c: &mut Criterion) {
    let mut g = c.benchmark_group("rendezvous_rank");
    for n in [16usize, 128] {
        let ids: Vec<u64> = (0..n)
            .map(|i| endpoint_id(&format!("10.0.{i}.1:8000")))
            .collect();
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        let mut key = 0u64;
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                key += 1;
                rank_into(black_box(key), &ids, &mut scratch, &mut out);
                out[0]
            })
        });
    }
    g.finish();
}

/// 16 endpoints holding 1M entries in total; every one holds the whole
/// 512-block chain, the worst case for a single pass.
fn loaded_index() -> (OccupancyIndex, Vec<u64>) {
    let chain = random_u64s(2, 512);
    let per_endpoint = (1 << 20) / 16;
    let mut index = OccupancyIndex::new();
    for slot in 0..16u32 {
        let mut blocks = chain.clone();
        blocks.extend(random_u64s(
            100 + u64::from(slot),
            per_endpoint - chain.len(),
        ));
        index
            .apply(
                Slot(slot),
                CacheEvent::Snapshot {
                    capacity: per_endpoint + 2000,
                    blocks: &blocks,
                },
            )
            .unwrap();
    }
    assert_eq!(index.entries(), 1 << 20);
    (index, chain)
}

fn index(c: &mut Criterion) {
    let (mut index, chain) = loaded_index();
    let mut out = Vec::new();
    c.bench_function("longest_prefix_512_blocks_16_endpoints_1M_entries", |b| {
        b.iter(|| {
            index.longest_prefix(black_box(&chain), &mut out);
            out[0]
        })
    });

    let mut round = 0u64;
    c.bench_function("apply_stored_1000_blocks", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                round += 1;
                let blocks = random_u64s(1_000_000 + round, 1000);
                let start = Instant::now();
                index
                    .apply(Slot(3), CacheEvent::Stored(black_box(&blocks)))
                    .unwrap();
                total += start.elapsed();
                index.apply(Slot(3), CacheEvent::Removed(&blocks)).unwrap();
            }
            total
        })
    });

    // A whole kvroute decision over the same index, for scale.
    let endpoints: Vec<Endpoint> = (0..16u32)
        .map(|i| Endpoint {
            slot: Slot(i),
            id: endpoint_id(&format!("10.0.{i}.1:8000")),
            load: Load {
                in_flight: i % 4,
                prefill_tokens: u64::from(i) * 300,
                ..Load::default()
            },
            weight: 1.0,
        })
        .collect();
    let mut policy = PolicyConfig::Kvroute(KvrouteConfig::default()).build();
    let cx = Context {
        index: Some(&index),
        block_tokens: 16,
        now: std::time::Instant::now(),
        pinned: None,
    };
    c.bench_function("kvroute_decision_512_blocks_16_endpoints_1M_entries", |b| {
        b.iter(|| {
            let request = Request {
                key: RoutingKey(7),
                chain: &chain,
                prompt_tokens: 8192,
                key_prefix_blocks: None,
                output_tokens: 256,
            };
            policy.rank(black_box(&request), &endpoints, &cx).ranked[0]
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hashing, ranking, index
}
criterion_main!(benches);
