use std::time::Duration;

use proptest::prelude::*;

use super::super::testing::*;
use super::*;
use crate::load::EngineLoad;

fn rank(pool: &Pool, key: u64, chain: &[u64]) -> Decision {
    Kvroute::new(Config::default()).rank(&request(key, chain), &pool.endpoints, &pool.cx())
}

fn with_slack(slack: f64) -> Kvroute {
    Kvroute::new(Config {
        latency_slack: slack,
        ..Config::default()
    })
}

#[test]
fn cold_keys_go_to_the_rendezvous_first_choice() {
    let pool = Pool::test().replicas(5);
    for key in 0..100 {
        let d = rank(&pool, key, &[key + 1000, key + 2000]);
        assert_eq!(d.ranked[0], pool.rendezvous_first(key), "key {key}");
        assert_eq!((d.reason, d.cached_blocks), (Reason::Cold, 0));
        assert_permutation(&d, 5);
    }
}

/// An idle engine that reports `rate` tokens per second, or none yet.
fn measured(pool: &mut Pool, i: usize, rate: Option<f64>) {
    pool.endpoints[i].load.engine = Some(EngineLoad {
        waiting: 0,
        running: 0,
        kv_usage: 0.0,
        queued_prefill_tokens: Some(0),
        prefill_tokens_per_s: rate,
        memory: None,
        reported_at: pool.now,
    });
}

#[test]
fn cold_key_placement_is_equal_across_pods_with_different_measured_rates() {
    // The system suite's engines: 20,000 tokens/s plus 5 ms. Five idle
    // pods whose agents measured 14,000 to 26,000 tokens/s, and a sixth
    // just added, not measured yet. A cold 309-token prompt takes 11.9 ms
    // at the fastest measured rate and 22.1 ms at the slowest: more than
    // one overhead apart, so per-pod rates would make the fastest pod
    // first for most keys. By the pool's one rate they are equal, and
    // rendezvous decides, the new pod included.
    let mut pool = Pool::test().replicas(6);
    let rates = [
        Some(14_000.0),
        Some(17_000.0),
        Some(20_000.0),
        Some(23_000.0),
        Some(26_000.0),
        None,
    ];
    for (i, rate) in rates.into_iter().enumerate() {
        measured(&mut pool, i, rate);
    }
    let mut p = Kvroute::new(Config {
        engine: PrefillModel {
            prefill_tokens_per_second: 20_000.0,
            prefill_overhead_ms: 5.0,
            ..PrefillModel::default()
        },
        ..Config::default()
    });
    let mut firsts = [0u32; 6];
    for key in 0..1000 {
        let chain: Vec<u64> = (0..19).map(|b| key * 100 + b).collect();
        let d = p.rank(&request(key, &chain), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked[0], pool.rendezvous_first(key), "key {key}: {d:?}");
        assert_eq!(d.reason, Reason::Cold);
        firsts[d.ranked[0]] += 1;
    }
    // Each pod, the new one too, is first for about a sixth of the keys.
    for (i, n) in firsts.iter().enumerate() {
        assert!(
            (120..=215).contains(n),
            "pod {i} first for {n} of 1,000: {firsts:?}"
        );
    }
}

#[test]
fn the_longest_cached_prefix_wins() {
    let chain: Vec<u64> = (1..=10).collect();
    let pool = Pool::test()
        .replicas(4)
        .holds(0, &chain[..2])
        .holds(1, &chain[..7])
        .holds(3, &chain[3..]); // no leading block: holds no prefix
    let d = rank(&pool, 9, &chain);
    assert_eq!(
        (d.ranked[0], d.reason, d.cached_blocks),
        (1, Reason::Warm, 7)
    );
    assert_eq!(d.ranked[1], 0, "the next longest prefix is the first retry");
}

#[test]
fn a_warm_prefix_stays_on_its_holder_while_its_queue_costs_less_than_it_saves() {
    // 256 blocks of 16 tokens plus 5: 4,101 tokens, 410.1 ms of prefill at
    // 10,000 tokens per second. The holder has 4,096 of them cached (409.6
    // ms saved); elsewhere the request takes 20 + 410.1 ms.
    let chain: Vec<u64> = (1..=256).collect();
    let key = 5;
    // Pick the holder so that it is not the rendezvous first choice:
    // staying there is then the cache's doing, not the hash's.
    let holder = (Pool::test().replicas(4).rendezvous_first(key) + 1) % 4;
    // Holder: queued / 10,000 + 20 ms (its queued request) + 20.5 ms. It may
    // be later than 430.1 ms by (409.6 + 20) ms × slack 1: warm while
    // queued / 10 + 40.5 ≤ 859.7, that is queued ≤ 8,192 tokens.
    for (queued, warm) in [
        (0u64, true),
        (4000, true),
        (8100, true),
        (8300, false),
        (40_000, false),
    ] {
        let pool = Pool::test()
            .replicas(4)
            .holds(holder, &chain)
            .prefill(holder, queued);
        let d = rank(&pool, key, &chain);
        if warm {
            assert_eq!(
                (d.ranked[0], d.reason),
                (holder, Reason::Warm),
                "queued {queued}"
            );
        } else {
            assert_eq!(d.reason, Reason::Spill, "queued {queued}");
            assert_eq!(d.ranked[0], pool.rendezvous_first(key), "queued {queued}");
            assert_eq!(*d.ranked.last().unwrap(), holder);
        }
    }
}

#[test]
fn when_every_endpoint_has_a_queue_a_warm_prefix_earns_more_slack() {
    // The same 4,101-token request; the holder saves 409.6 ms. The other
    // endpoint has 4,281 tokens queued: 448.1 ms with its overhead, the
    // shortest queue, about 1.04 of this request's own 430.1 ms prefill
    // there. The slack factor is 1 + 448.1 / 430.1 = 2.042: the holder may
    // be 2.042 × 429.6 = 877.2 ms later than the other (878.2 ms), so with
    // up to 4,281 + 12,868 = 17,149 tokens queued. With an idle pool the
    // limit would be 4,281 + 8,392 tokens.
    let chain: Vec<u64> = (1..=256).collect();
    for (queued, warm) in [
        (12_000u64, true),
        (15_000, true),
        (17_100, true),
        (17_200, false),
    ] {
        let pool = Pool::test()
            .replicas(2)
            .prefill(0, 4281)
            .holds(1, &chain)
            .prefill(1, queued);
        let d = rank(&pool, 3, &chain);
        assert_eq!(d.ranked[0] == 1, warm, "queued {queued}: {d:?}");
    }
}

#[test]
fn the_engines_report_counts_every_routers_requests() {
    // This router sent nothing to the holder, but its engine reports
    // 20,000 tokens queued (other routers' requests): 2 s, far over the
    // slack, so the prefix is spilled.
    let chain: Vec<u64> = (1..=64).collect();
    let mut pool = Pool::test().replicas(3).holds(0, &chain);
    let d = rank(&pool, 1, &chain);
    assert_eq!((d.ranked[0], d.reason), (0, Reason::Warm));
    let report = EngineLoad {
        waiting: 1,
        running: 1,
        kv_usage: 0.2,
        queued_prefill_tokens: Some(20_000),
        prefill_tokens_per_s: None,
        memory: None,
        reported_at: pool.now,
    };
    pool.endpoints[0].load.engine = Some(report);
    let d = rank(&pool, 1, &chain);
    assert_eq!(d.reason, Reason::Spill);
    // Two seconds later the engine has worked through it.
    pool.now += Duration::from_millis(2020);
    let d = rank(&pool, 1, &chain);
    assert_eq!((d.ranked[0], d.reason), (0, Reason::Warm));
}

#[test]
fn a_warm_prefix_is_spilled_when_its_holder_must_first_wait_for_memory() {
    // The holder's prefill queue is empty, but its KV memory is full: 10
    // free blocks, 100 needed by its waiting requests, running requests
    // with R s of decode left on average. This 4,101-token request takes
    // 257 blocks there: 256 are cached, but no request in flight holds
    // them, so they come from the free pool too. A deficit of 347 of 900
    // used blocks held by 8 requests clears when ⌈347 × 8 / 900⌉ = 4 have
    // finished, at 4/9 of 2R s, then its own 20.5 ms prefill; elsewhere
    // it takes 430.1 ms, and the prefix saves 429.6 ms (+ 20 ms overhead)
    // of slack. Warm while 0.8889 R + 0.0205 ≤ 0.4301 + 0.4296,
    // R ≤ 0.944 s.
    let chain: Vec<u64> = (1..=256).collect();
    for (remaining_s, warm) in [(0.0, true), (0.9, true), (1.0, false)] {
        let mut pool = Pool::test().replicas(3).holds(0, &chain);
        pool.endpoints[0].load.engine = Some(EngineLoad {
            waiting: 3,
            running: 8,
            kv_usage: 0.99,
            queued_prefill_tokens: Some(0),
            prefill_tokens_per_s: None,
            memory: Some(crate::load::Memory {
                growth_blocks: 0,
                free_blocks: 10,
                used_blocks: 900,
                waiting_blocks: 100,
                remaining_decode_s: remaining_s,
                waiting_decode_s: 2.0 * remaining_s,
                running: 8,
                waiting: 3,
                max_num_seqs: None,
            }),
            reported_at: pool.now,
        });
        let d = rank(&pool, 1, &chain);
        assert_eq!(d.ranked[0] == 0, warm, "{remaining_s} s left: {d:?}");
    }
}

#[test]
fn approximate_mode_learns_from_its_own_routing() {
    let pool = Pool::test().replicas(4);
    let cx = pool.approximate();
    let mut p = Kvroute::new(Config::default());
    let chain = [11, 12, 13];
    let first = p.rank(&request(1, &chain), &pool.endpoints, &cx);
    assert_eq!(first.reason, Reason::Cold);
    // Routed somewhere else than the hash says (a retry, say): it learns
    // where the blocks actually went.
    let target = (first.ranked[0] + 1) % 4;
    p.routed(&request(1, &chain), &pool.endpoints[target]);
    let again = p.rank(&request(2, &[11, 12, 99]), &pool.endpoints, &cx);
    assert_eq!(
        (again.ranked[0], again.reason, again.cached_blocks),
        (target, Reason::Warm, 2)
    );
    p.endpoint_removed(pool.endpoints[target].slot);
    let after = p.rank(&request(2, &[11, 12, 99]), &pool.endpoints, &cx);
    assert_eq!(after.reason, Reason::Cold);
}

#[test]
fn exact_mode_learns_from_routing_only_until_the_engines_could_report() {
    let mut pool = Pool::test().replicas(2);
    let mut p = Kvroute::new(Config::default());
    let d = p.rank(&request(1, &[1, 2]), &pool.endpoints, &pool.cx());
    p.routed(&request(1, &[1, 2]), &pool.endpoints[1 - d.ranked[0]]);
    pool.now += Duration::from_secs(3);
    let again = p.rank(&request(1, &[1, 2]), &pool.endpoints, &pool.cx());
    assert_eq!(again.ranked, d.ranked, "only the engines' reports count");
}

#[test]
fn no_endpoints_no_panic() {
    let pool = Pool::test();
    let d = rank(&pool, 1, &[1]);
    assert!(d.ranked.is_empty());
}

#[test]
fn configs_are_checked() {
    assert!(Config::default().validate().is_ok());
    let infinite = Config {
        latency_slack: f64::INFINITY,
        ..Config::default()
    };
    assert!(infinite.validate().is_ok());
    for slack in [-1.0, f64::NAN] {
        let c = Config {
            latency_slack: slack,
            ..Config::default()
        };
        assert!(c.validate().unwrap_err().contains("latencySlack"));
    }
}

/// A pool of random loads and cached prefixes of a 64-block chain.
fn random_pool(loads: &[(u32, u64)], held: &[usize], chain: &[u64]) -> Pool {
    let mut pool = Pool::test().replicas(loads.len() as u32);
    for (i, &(in_flight, prefill)) in loads.iter().enumerate() {
        pool = pool.prefill(i, prefill).in_flight(i, in_flight.max(1));
        pool = pool.holds(i, &chain[..held.get(i).copied().unwrap_or(0)]);
    }
    pool
}

proptest! {
    /// Slack 0: the choice has the lowest predicted TTFT (min-ttft).
    #[test]
    fn no_slack_is_the_lowest_predicted_ttft(
        loads in prop::collection::vec((1u32..12, 0u64..40_000), 1..9),
        held in prop::collection::vec(0usize..64, 1..9),
        key in any::<u64>(),
    ) {
        let chain: Vec<u64> = (1..=64).collect();
        let pool = random_pool(&loads, &held, &chain);
        let cx = pool.cx();
        let req = request(key, &chain);
        let d = with_slack(0.0).rank(&req, &pool.endpoints, &cx);
        assert_permutation(&d, loads.len());
        let model = PrefillModel::default();
        let ttft = |i: usize| {
            let cached = held.get(i).copied().unwrap_or(0) as u32;
            model.ttft_s(&pool.endpoints[i].load, uncached_tokens(&req, cached, 16), 16, cx.now)
        };
        let best = (0..loads.len()).map(ttft).fold(f64::INFINITY, f64::min);
        prop_assert_eq!(ttft(d.ranked[0]), best);
        let reference = MinTtft::new(Default::default()).rank(&req, &pool.endpoints, &cx);
        prop_assert_eq!(ttft(reference.ranked[0]), best);
    }

    /// Unbounded slack: longest prefix, then rendezvous, whatever the load.
    #[test]
    fn unbounded_slack_is_longest_prefix_then_rendezvous(
        loads in prop::collection::vec((1u32..12, 0u64..400_000), 1..9),
        held in prop::collection::vec(0usize..4, 1..9),
        key in any::<u64>(),
    ) {
        let chain: Vec<u64> = (1..=64).collect();
        let pool = random_pool(&loads, &held, &chain);
        let d = with_slack(f64::INFINITY).rank(&request(key, &chain), &pool.endpoints, &pool.cx());
        assert_permutation(&d, loads.len());
        let depth = |i: usize| held.get(i).copied().unwrap_or(0);
        let longest = (0..loads.len()).map(depth).max().unwrap();
        let holders: Vec<usize> = (0..loads.len()).filter(|&i| depth(i) == longest).collect();
        let ids: Vec<u64> = holders.iter().map(|&i| pool.endpoints[i].id).collect();
        let first = holders[crate::rendezvous::rank(key, &ids)[0]];
        prop_assert_eq!(d.ranked[0], first);
        prop_assert_eq!(d.cached_blocks as usize, longest);
    }

    /// Any slack: the choice is later than the fastest by at most the
    /// slack × (1 + shortest queue / own prefill) × (its saved prefill + one
    /// overhead), and no endpoint within its own such limit holds a longer
    /// prefix.
    #[test]
    fn the_choice_is_within_its_slack_and_the_warmest_there(
        loads in prop::collection::vec((1u32..12, 0u64..40_000), 1..9),
        held in prop::collection::vec(0usize..64, 1..9),
        key in any::<u64>(),
        slack in 0.0f64..5.0,
    ) {
        let chain: Vec<u64> = (1..=64).collect();
        let pool = random_pool(&loads, &held, &chain);
        let cx = pool.cx();
        let req = request(key, &chain);
        let d = with_slack(slack).rank(&req, &pool.endpoints, &cx);
        let model = PrefillModel::default();
        let depth = |i: usize| held.get(i).copied().unwrap_or(0);
        let uncached = |i: usize| uncached_tokens(&req, depth(i) as u32, 16);
        let ttft = |i: usize| model.ttft_s(&pool.endpoints[i].load, uncached(i), cx.block_tokens, cx.now);
        let fastest = (0..loads.len()).min_by(|&a, &b| ttft(a).total_cmp(&ttft(b))).unwrap();
        let shortest_queue = (0..loads.len())
            .map(|i| model.queued_s(&pool.endpoints[i].load, cx.now))
            .fold(f64::INFINITY, f64::min);
        let own_prefill = model.prefill_s(&pool.endpoints[fastest].load, uncached(fastest));
        let factor = slack * (1.0 + shortest_queue / own_prefill);
        let within = |i: usize| {
            let saved = uncached(fastest).saturating_sub(uncached(i)) as f64 / 10_000.0;
            ttft(i) - ttft(fastest) <= factor * (saved + 0.020) + 1e-12
        };
        prop_assert!(within(d.ranked[0]));
        let warmest = (0..loads.len()).filter(|&i| within(i)).map(depth).max().unwrap();
        prop_assert_eq!(depth(d.ranked[0]), warmest);
    }
}

#[test]
fn a_prefix_in_flight_counts_at_its_endpoint_until_it_could_have_been_reported() {
    // Exact mode, nothing reported yet. A request with a new 64-block
    // prefix goes to its key's rendezvous choice; a second request with the
    // same prefix but another key follows it there (the engine has not
    // computed, hence not reported, the blocks yet), until the first's
    // predicted first token plus a report's age has passed.
    let mut pool = Pool::test().replicas(4);
    let chain: Vec<u64> = (1..=64).collect();
    let mut p = Kvroute::new(Config::default());
    let first = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
    let to = first.ranked[0];
    assert_eq!(first.reason, Reason::Cold);
    p.routed(&request(1, &chain), &pool.endpoints[to]);
    let other = (2..)
        .find(|&key| pool.rendezvous_first(key) != to)
        .expect("some key prefers another endpoint");
    let second = p.rank(&request(other, &chain), &pool.endpoints, &pool.cx());
    assert_eq!(
        (second.ranked[0], second.reason, second.cached_blocks),
        (to, Reason::Warm, 64)
    );
    // Sent there because the first is in flight, it does not renew the
    // claim: an engine that never reports is followed for one window.
    p.routed(&request(other, &chain), &pool.endpoints[to]);
    // 1,029 tokens: 20 ms + 102.9 ms predicted, plus 2 s of report age.
    pool.now += Duration::from_millis(2_200);
    let later = p.rank(&request(other, &chain), &pool.endpoints, &pool.cx());
    assert_eq!(
        (later.ranked[0], later.reason),
        (pool.rendezvous_first(other), Reason::Cold)
    );
}

#[test]
fn each_endpoint_is_asked_to_start_within_its_predicted_wait_and_the_tolerance() {
    let mut pool = Pool::test().replicas(2);
    for i in 0..2 {
        measured(&mut pool, i, Some(10_000.0));
    }
    // Endpoint 1 has a second of prefill queued.
    pool.endpoints[1]
        .load
        .engine
        .as_mut()
        .unwrap()
        .queued_prefill_tokens = Some(10_000);
    let mut policy = Kvroute::new(Config::default());
    assert_eq!(policy.admit_within(0), None, "nothing ranked yet");
    policy.rank(&request(7, &[1, 2]), &pool.endpoints, &pool.cx());
    let within = |p: &Kvroute, i: usize| p.admit_within(i).unwrap();
    assert!((within(&policy, 0) - 0.05).abs() < 1e-9);
    assert!((within(&policy, 1) - 1.05).abs() < 1e-9);
    let mut off = Kvroute::new(Config {
        admission_tolerance_ms: None,
        ..Config::default()
    });
    off.rank(&request(7, &[1, 2]), &pool.endpoints, &pool.cx());
    assert_eq!(off.admit_within(0), None);
    let bad = Config {
        admission_tolerance_ms: Some(-1.0),
        ..Config::default()
    };
    assert!(bad.validate().unwrap_err().contains("admissionToleranceMs"));
}

#[cfg(test)]
mod shared;
