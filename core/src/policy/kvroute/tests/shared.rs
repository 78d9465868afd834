//! Rule 3's shared prefixes and the memory demand of cached blocks: the
//! issue's cases, each failing on the policy that ranked every cached
//! block as warmth and asked memory for uncached blocks only.

use std::time::Duration;

use super::super::super::testing::*;
use super::super::*;
use crate::engine::{self as model, Progress};
use crate::index::CacheEvent;
use crate::pinned::Pinned;

/// Routes requests with `keys` and `chains` through one policy over an
/// idle pool of `n` endpoints where endpoint 0 already holds `held`; each
/// choice then holds its chain (exact mode: the engines report it). The
/// first choice of each, and the request as ranked.
fn place(
    n: u32,
    held: &[u64],
    requests: &[(Request<'_>, bool)],
    approximate: bool,
) -> (Pool, Vec<usize>) {
    let mut pool = Pool::test().replicas(n);
    for i in 0..n as usize {
        pool = pool.holds(i, if i == 0 { held } else { &[] });
    }
    let mut p = Kvroute::new(Config::default());
    if approximate {
        p.routed(&requests[0].0, &pool.endpoints[0]);
    }
    let mut firsts = Vec::new();
    for (request, _) in requests {
        let cx = if approximate {
            pool.approximate()
        } else {
            pool.cx()
        };
        let d = p.rank(request, &pool.endpoints, &cx);
        let first = d.ranked[0];
        p.routed(request, &pool.endpoints[first]);
        let slot = pool.endpoints[first].slot;
        pool.index
            .apply(slot, CacheEvent::Stored(request.chain))
            .unwrap();
        firsts.push(first);
    }
    (pool, firsts)
}

/// `shared` blocks every prompt starts with, then `own` of prompt `id`.
fn chain(shared: u64, id: u64, own: u64) -> Vec<u64> {
    (0..shared)
        .chain((0..own).map(|b| 1_000_000 * (id + 1) + b))
        .collect()
}

#[test]
fn a_shared_prefix_does_not_pull_cold_keys_off_their_rendezvous_endpoints() {
    for (shared, approximate) in [(1, false), (16, false), (1, true), (16, true)] {
        let chains: Vec<Vec<u64>> = (0..32).map(|g| chain(shared, g, 10)).collect();
        let requests: Vec<(Request<'_>, bool)> = chains
            .iter()
            .enumerate()
            .map(|(g, c)| (request(g as u64, c), true))
            .collect();
        let (pool, firsts) = place(8, &chains[0][..shared as usize], &requests, approximate);
        // Two requests may share a prefix by chance: from the third on,
        // the shared one is known, and every cold key is rendezvous's.
        for (g, &first) in firsts.iter().enumerate().skip(2) {
            assert_eq!(
                first,
                pool.rendezvous_first(g as u64),
                "{shared} shared blocks, approximate {approximate}, key {g}"
            );
        }
    }
}

#[test]
fn prompts_behind_a_preamble_longer_than_their_key_spread_by_their_own_parts() {
    // 32 single-turn system prompts behind one 400-token preamble (25
    // blocks): the prefix key (16 blocks) is the preamble's for all of
    // them, one key. Past the shared blocks, each prompt's own 16 blocks
    // place it.
    let chains: Vec<Vec<u64>> = (0..32).map(|g| chain(25, g, 20)).collect();
    let key = RoutingKey::prefix_ids(None, &chains[0][..16]);
    let requests: Vec<(Request<'_>, bool)> = chains
        .iter()
        .map(|c| {
            let request = Request {
                key,
                chain: c,
                prompt_tokens: c.len() as u64 * 16 + 5,
                key_prefix_blocks: Some(16),
                output_tokens: 0,
            };
            (request, true)
        })
        .collect();
    let (pool, firsts) = place(8, &chains[0][..25], &requests, false);
    let mut per = [0; 8];
    for (g, &first) in firsts.iter().enumerate().skip(2) {
        let own = key.past_shared(chains[g][25 + 16 - 1]);
        assert_eq!(first, pool.rendezvous_first(own.0), "prompt {g}");
        per[first] += 1;
    }
    assert!(per.iter().filter(|&&c| c > 0).count() >= 6, "{per:?}");
}

#[test]
fn a_group_below_two_endpoints_share_keeps_its_conversations_together() {
    // 16 groups behind a template block, 4 conversations each: a group's
    // own prompt is 1/16 of the traffic, less than two of 8 endpoints'
    // share, so its conversations follow it.
    let mut chains = Vec::new();
    for conversation in 0..4 {
        for g in 0..16 {
            let mut c = chain(1, g, 12);
            c.push(9_000_000 + conversation * 100 + g);
            chains.push(c);
        }
    }
    let requests: Vec<(Request<'_>, bool)> = chains
        .iter()
        .enumerate()
        .map(|(i, c)| (request(i as u64 % 16, c), true))
        .collect();
    let (_, firsts) = place(8, &[0], &requests, false);
    for i in 16..firsts.len() {
        assert_eq!(firsts[i], firsts[i % 16], "request {i}");
    }
}

#[test]
fn a_follow_up_whose_cached_blocks_are_free_waits_where_the_engine_would_make_it() {
    // An engine of 64 blocks of 16 tokens. Request A (41 blocks) runs a
    // long decode; conversation B's first turn (20 blocks) ran and
    // finished: its blocks are cached and free. 23 blocks are free, 20 of
    // them B's. B's follow-up has 24 blocks: 20 cached, 4 new.
    let config = model::Config {
        num_blocks: 64,
        max_num_batched_tokens: 2048,
        ..model::Config::default()
    };
    let mut engine = model::Engine::new(config);
    let b: Vec<u64> = (100..124).collect();
    let a: Vec<u64> = (1..=41).collect();
    let mut now = Duration::ZERO;
    fn run(engine: &mut model::Engine, now: &mut Duration, until_idle: bool) {
        while let Some(end) = engine.start_step(*now) {
            *now = end;
            engine.finish_step();
            if !until_idle {
                break;
            }
        }
    }
    engine.add(1, b[..20].to_vec(), 20 * 16, 1).unwrap();
    run(&mut engine, &mut now, true);
    engine.add(2, a.clone(), 41 * 16, 50).unwrap();
    run(&mut engine, &mut now, false);
    assert_eq!(engine.load(now).used_blocks, 41);
    // The engine leaves the follow-up waiting for A.
    engine.add(3, b.clone(), 24 * 16, 1).unwrap();
    engine.take_progress();
    run(&mut engine, &mut now, false);
    assert!(
        !(engine.take_progress())
            .iter()
            .any(|&(id, p)| id == 3 && matches!(p, Progress::Admitted { .. })),
        "the engine made it wait"
    );
    engine.abort(3);

    // The router, from the engine's report: the follow-up's 20 cached
    // blocks are no less taken from the free pool.
    let mut pool = Pool::test().replicas(2).holds(0, &b[..20]).holds(1, &[]);
    let report = engine
        .load(now)
        .report(Some(10_000.0), Duration::from_millis(30), pool.now);
    pool.endpoints[0].load.engine = Some(report);
    let request = request(7, &b);
    let d = Kvroute::new(Config::default()).rank(&request, &pool.endpoints, &pool.cx());
    assert_eq!(d.ranked[0], 1, "{d:?}: endpoint 0 must first wait for A");
    // Had a request in flight there held B's blocks, they would not come
    // from the free pool, and the warm endpoint would be first.
    let mut pinned = Pinned::new(100);
    let _in_flight = pinned.pin(pool.endpoints[0].slot, &b[..20]);
    let cx = Context {
        pinned: Some(&pinned),
        ..pool.cx()
    };
    let d = Kvroute::new(Config::default()).rank(&request, &pool.endpoints, &cx);
    assert_eq!((d.ranked[0], d.reason), (0, Reason::Warm), "{d:?}");
}
