use proptest::prelude::*;

use super::super::testing::*;
use super::*;

fn rank(pool: &Pool, key: u64, chain: &[u64]) -> Decision {
    Kvroute::new(Config::default()).rank(&request(key, chain), &pool.endpoints, &pool.cx())
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
fn a_warm_prefix_stays_on_its_holder_until_the_bound() {
    let chain: Vec<u64> = (1..=32).collect();
    let key = 5;
    // Pick the holder so that it is not the rendezvous first choice:
    // staying there is then the cache's doing, not the hash's.
    let holder = (Pool::test().replicas(4).rendezvous_first(key) + 1) % 4;
    // Work bound with everyone else idle: (1.5 × w / 4) + 4096 ≥ w while
    // w ≤ 4096 / 0.625 = 6553.6 tokens.
    for queued in [0u64, 1000, 4000, 6000, 6500] {
        let pool = Pool::test()
            .replicas(4)
            .holds(holder, &chain)
            .prefill(holder, queued.saturating_sub(200));
        let d = rank(&pool, key, &chain);
        assert_eq!(
            (d.ranked[0], d.reason),
            (holder, Reason::Warm),
            "queued {queued}"
        );
    }
    for queued in [6700u64, 20_000] {
        let pool = Pool::test()
            .replicas(4)
            .holds(holder, &chain)
            .prefill(holder, queued - 200);
        let d = rank(&pool, key, &chain);
        assert_eq!(d.reason, Reason::Spill, "queued {queued}");
        assert_eq!(d.ranked[0], pool.rendezvous_first(key));
        assert_eq!(*d.ranked.last().unwrap(), holder);
    }
}

#[test]
fn request_counts_are_bounded_too() {
    let chain: Vec<u64> = (1..=4).collect();
    // Bound: 1.25 × 6 / 3 + 2 = 4.5 requests. 4 in flight is under it, 5
    // is over (the other endpoints hold one each).
    for (in_flight, holder_wins) in [(4u32, true), (5, false)] {
        let mut pool = Pool::test()
            .replicas(3)
            .holds(0, &chain)
            .in_flight(1, 1)
            .in_flight(2, 1);
        pool = pool.in_flight(0, in_flight);
        let total = in_flight + 2;
        assert_eq!(
            f64::from(in_flight) < 1.25 * f64::from(total) / 3.0 + 2.0,
            holder_wins
        );
        let d = rank(&pool, 1, &chain);
        assert_eq!(d.ranked[0] == 0, holder_wins, "{in_flight} in flight");
    }
}

#[test]
fn approximate_mode_learns_from_its_own_routing() {
    let pool = Pool::test().replicas(4);
    let cx = Context {
        index: None,
        block_tokens: 16,
    };
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
fn exact_mode_does_not_learn_from_routing() {
    let pool = Pool::test().replicas(2);
    let mut p = Kvroute::new(Config::default());
    let d = p.rank(&request(1, &[1, 2]), &pool.endpoints, &pool.cx());
    p.routed(&request(1, &[1, 2]), &pool.endpoints[1 - d.ranked[0]]);
    let again = p.rank(&request(1, &[1, 2]), &pool.endpoints, &pool.cx());
    assert_eq!(again.ranked, d.ranked, "only the engines' reports count");
}

#[test]
fn no_endpoints_no_panic() {
    let pool = Pool::test();
    let d = rank(&pool, 1, &[1]);
    assert!(d.ranked.is_empty());
}

proptest! {
    /// Never an endpoint over the bound while another is under it; the
    /// ranking is a permutation with every under-bound endpoint first.
    #[test]
    fn never_over_the_bound_while_another_is_under(
        loads in prop::collection::vec((0u32..12, 0u64..40_000, 0u32..6), 1..9),
        held in prop::collection::vec(0usize..6, 1..9),
        key in any::<u64>(),
    ) {
        let chain: Vec<u64> = (1..=5).collect();
        let mut pool = Pool::test().replicas(loads.len() as u32);
        for (i, &(in_flight, prefill, decoding)) in loads.iter().enumerate() {
            pool.endpoints[i].load = Load { in_flight: in_flight.max(decoding), prefill_tokens: prefill, decoding, engine: None };
            let depth = held.get(i).copied().unwrap_or(0);
            pool = pool.holds(i, &chain[..depth]);
        }
        let c = Config::default();
        let n = loads.len() as f64;
        let work: Vec<f64> = pool.endpoints.iter().map(|e| c.work.work(&e.load) as f64).collect();
        let flights: Vec<f64> = pool.endpoints.iter().map(|e| f64::from(e.load.in_flight)).collect();
        let work_bound = (1.0 + c.load_bound) * work.iter().sum::<f64>() / n + c.headroom_tokens as f64;
        let req_bound = (1.0 + c.request_bound) * flights.iter().sum::<f64>() / n + f64::from(c.headroom_requests);
        let over = |i: usize| work[i] > work_bound || flights[i] >= req_bound;

        let d = rank(&pool, key, &chain);
        assert_permutation(&d, loads.len());
        let under = (0..loads.len()).filter(|&i| !over(i)).count();
        for (pos, &i) in d.ranked.iter().enumerate() {
            prop_assert_eq!(over(i), pos >= under, "position {} endpoint {}", pos, i);
        }
        if under > 0 {
            // Warm first among those under the bound.
            let best = (0..loads.len()).filter(|&i| !over(i)).map(|i| held.get(i).copied().unwrap_or(0)).max().unwrap();
            prop_assert_eq!(d.cached_blocks as usize, best);
        }
    }
}
