use kvroute_core::policy::PolicyConfig;

use super::*;

use super::super::trace::req;

fn sim(policy: &str, replicas: usize, capacity: usize, block_tokens: u64) -> Sim {
    let policy = PolicyConfig::by_name(policy).unwrap().build();
    Sim::new(policy, 1, 0.0, replicas, capacity, block_tokens)
}

#[test]
fn admission_touches_last_to_first_then_evicts_lru() {
    let mut cache = Lru::new();
    let (mut ins, mut ev) = (Vec::new(), Vec::new());
    admit(&mut cache, &[1, 2, 3], 3, |i| ins.push(i), |e| ev.push(e));
    assert_eq!(
        cache.iter().collect::<Vec<_>>(),
        vec![1, 2, 3],
        "1 is the most recent"
    );
    admit(&mut cache, &[4], 3, |i| ins.push(i), |e| ev.push(e));
    assert_eq!((ins, ev), (vec![3, 2, 1, 4], vec![3]));
    // A request longer than the cache keeps its head, loses its tail.
    let mut small = Lru::new();
    admit(&mut small, &[1, 2, 3], 2, |_| {}, |_| {});
    assert_eq!(small.iter().collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(leading_hits(&small, &[1, 2, 3]), 2);
    assert_eq!(leading_hits(&small, &[2, 1]), 2);
    assert_eq!(leading_hits(&small, &[3, 1]), 0);
}

#[test]
fn matching_happens_before_insertion() {
    let mut s = sim("round-robin", 1, 100, 10);
    let first = s.step(&req(0.0, 25, 1, &[1, 2, 3]), (RoutingKey(0), None));
    assert_eq!((first.cached_tokens, first.uncached_tokens), (0, 25));
    // Same first two blocks: 20 tokens cached. Three blocks would be 30,
    // capped at the prompt's 25.
    let second = s.step(&req(1.0, 28, 1, &[1, 2, 9]), (RoutingKey(0), None));
    assert_eq!(second.cached_tokens, 20);
    let third = s.step(&req(2.0, 25, 1, &[1, 2, 3]), (RoutingKey(0), None));
    assert_eq!(third.cached_tokens, 25);
}

#[test]
fn prefill_is_fifo_per_replica() {
    let mut s = sim("round-robin", 1, 100, 16);
    let a = s.step(&req(0.0, 10_000, 5, &[]), (RoutingKey(0), None));
    let b = s.step(&req(0.0, 10_000, 5, &[]), (RoutingKey(0), None));
    let c = s.step(&req(0.5, 5_000, 5, &[]), (RoutingKey(0), None));
    assert!((a.ttft_s - 1.02).abs() < 1e-9);
    assert!((b.ttft_s - 2.04).abs() < 1e-9, "waits for a: {}", b.ttft_s);
    assert!((c.ttft_s - (2.04 + 0.52 - 0.5)).abs() < 1e-9);
    // Idle again long after: only its own prefill.
    let d = s.step(&req(100.0, 1_000, 5, &[]), (RoutingKey(0), None));
    assert!((d.ttft_s - 0.12).abs() < 1e-9);
}

#[test]
fn a_router_counts_its_own_requests_until_completion() {
    let mut s = sim("round-robin", 1, 100, 16);
    // Prefill ends at 0.02 + 0.1; completes 0.03 × 10 later.
    let a = s.step(&req(0.0, 1_000, 10, &[]), (RoutingKey(0), None));
    let (end, done) = (a.ttft_s, a.ttft_s + 0.3);
    let mut state = |t: f64| {
        let l = s.routers[0].load(0, t, t);
        (l.in_flight, l.prefill_tokens, l.decoding, l.active_tokens)
    };
    assert_eq!(state(0.1), (1, 1_000, 0, 1_000));
    assert_eq!(state(end), (1, 0, 1, 1_000), "past prefill at its end");
    assert_eq!(
        state(done),
        (0, 0, 0, 0),
        "completing at t no longer counts at t"
    );
}

#[test]
fn reports_describe_the_replica_as_of_the_lag() {
    let mut s = sim("round-robin", 1, 100, 16);
    // a: prefill 0 → 1.02, b: 1.02 → 2.04 (both 10,000 tokens), c at 1.5.
    s.step(&req(0.0, 10_000, 100, &[]), (RoutingKey(0), None));
    s.step(&req(0.0, 10_000, 100, &[]), (RoutingKey(0), None));
    s.step(&req(1.5, 1_000, 100, &[]), (RoutingKey(0), None));
    let at = s.epoch;
    let r = s.replicas[0].report(0.52, at);
    // a half done (5,000 left), b waiting (10,000); c not yet arrived.
    assert_eq!(
        (r.queued_prefill_tokens, r.waiting, r.running),
        (Some(15_000), 1, 1)
    );
    // a decoding, b 0.58 s in (4,400 left), c waiting (1,000).
    let r = s.replicas[0].report(1.6, at);
    assert_eq!(
        (r.queued_prefill_tokens, r.waiting, r.running),
        (Some(5_400), 1, 2)
    );
    // The router knows c at once, the report does not: it is unreported.
    let l = s.routers[0].load(0, 1.6, 1.4);
    assert_eq!(
        (l.unreported_prefill_tokens, l.unreported_requests),
        (1_000, 1)
    );
    assert_eq!((l.prefill_tokens, l.decoding), (11_000, 1));
}

#[test]
fn cache_contents_reach_the_routers_after_the_lag() {
    let policy = PolicyConfig::by_name("kvroute").unwrap().build();
    let mut s = Sim::new(policy, 2, 0.5, 2, 100, 16);
    let first = s.step(&req(0.0, 64, 1, &[1, 2, 3, 4]), (RoutingKey(1), None));
    assert_eq!(s.index.blocks_of(Slot(first.replica as u32)).count(), 0);
    // 0.2 s later the second router does not know yet where the prefix is.
    s.step(&req(0.2, 64, 1, &[7, 8]), (RoutingKey(2), None));
    assert_eq!(s.index.blocks_of(Slot(first.replica as u32)).count(), 0);
    s.step(&req(0.6, 64, 1, &[9]), (RoutingKey(3), None));
    assert_eq!(s.index.blocks_of(Slot(first.replica as u32)).count(), 4);
    // Routers take turns.
    assert_eq!(s.next_router, 1);
}

#[test]
fn the_index_mirrors_the_caches() {
    let mut s = sim("kvroute", 2, 3, 16);
    for (i, ids) in [[1u64, 2, 3], [4, 5, 6], [1, 2, 7], [8, 9, 10]]
        .iter()
        .enumerate()
    {
        s.step(&req(i as f64, 48, 1, ids), (RoutingKey(i as u64), None));
    }
    s.deliver(f64::INFINITY);
    for (r, replica) in s.replicas.iter().enumerate() {
        let mut cached: Vec<u64> = replica.cache.iter().collect();
        let mut indexed: Vec<u64> = s.index.blocks_of(Slot(r as u32)).collect();
        cached.sort_unstable();
        indexed.sort_unstable();
        assert_eq!(cached, indexed, "replica {r}");
        assert!(cached.len() <= 3);
    }
}

#[test]
fn a_fork_keeps_state_and_adds_an_empty_replica() {
    let mut s = sim("rendezvous", 3, 100, 16);
    for k in 0..30u64 {
        s.step(&req(k as f64, 32, 1, &[k, k + 100]), (RoutingKey(k), None));
    }
    let mut kept = s.clone();
    let mut grown = s.clone();
    grown.add_replica();
    assert_eq!((kept.replicas.len(), grown.replicas.len()), (3, 4));
    assert!(grown.replicas[3].cache.is_empty());
    let mut moved = 0;
    for k in 0..30u64 {
        let r = req(100.0 + k as f64, 32, 1, &[k, k + 100]);
        let a = kept.step(&r, (RoutingKey(k), None));
        let b = grown.step(&r, (RoutingKey(k), None));
        if a.replica == b.replica {
            // Same replica, same state: same hit.
            assert_eq!(a.cached_tokens, b.cached_tokens);
            assert_eq!(a.cached_tokens, 32);
        } else {
            // Rendezvous only moves keys to the new replica, where it misses.
            assert_eq!(b.replica, 3);
            assert_eq!(b.cached_tokens, 0);
            moved += 1;
        }
    }
    assert!(moved > 0 && moved < 15, "moved {moved} of 30");
}

/// The reference rule of issue #11, written out: for each replica `cost =
/// max(0, F − arrival) + 0.020 + uncached / 10000`, the lowest wins, ties
/// by fewest in flight. Returns each replica's (cost, in flight).
fn reference_keys(s: &Sim, r: &TraceRequest) -> Vec<(f64, usize)> {
    let cost = |i: usize| {
        let rep = &s.replicas[i];
        let m = leading_hits(&rep.cache, &r.hash_ids) as u64;
        let uncached = r.input_length - (m * s.block_tokens).min(r.input_length);
        (rep.free_at - r.arrival_s).max(0.0) + 0.020 + uncached as f64 / 10_000.0
    };
    let in_flight = |i: usize| {
        s.replicas[i]
            .served
            .iter()
            .filter(|x| x.arrival <= r.arrival_s && x.completion > r.arrival_s)
            .count()
    };
    (0..s.replicas.len())
        .map(|i| (cost(i), in_flight(i)))
        .collect()
}

#[test]
fn min_ttft_is_the_reference_rule() {
    // A small hand-made trace over 3 replicas: shared prefixes, bursts that
    // queue, and idle gaps. Where the reference ties (idle, equally cached
    // replicas with as many in flight) any of the tied replicas is right.
    let trace = [
        req(0.0, 5_000, 50, &[1, 2, 3, 4, 5]),
        req(0.0, 3_000, 10, &[6, 7, 8]),
        req(0.1, 5_100, 20, &[1, 2, 3, 4, 5, 9]),
        req(0.2, 9_000, 5, &[10, 11, 12, 13, 14, 15, 16, 17, 18]),
        req(0.25, 3_050, 5, &[6, 7, 8, 19]),
        req(
            0.3,
            12_000,
            30,
            &[1, 2, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
        ),
        req(0.35, 5_000, 5, &[1, 2, 3, 4, 5]),
        req(3.0, 2_000, 5, &[1, 2]),
        req(3.0, 4_000, 5, &[10, 11, 12, 13]),
        req(3.1, 6_000, 5, &[30, 31, 32, 33, 34, 35]),
        req(3.2, 1_000, 5, &[6]),
    ];
    let mut s = sim("min-ttft", 3, 100, 1_000);
    for (i, r) in trace.iter().enumerate() {
        let keys = reference_keys(&s, r);
        let best = keys
            .iter()
            .copied()
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .unwrap();
        let got = s.step(r, (RoutingKey(i as u64), None));
        let (cost, in_flight) = keys[got.replica];
        assert!(
            (cost - best.0).abs() < 1e-9 && in_flight == best.1,
            "request {i}: chose {} {keys:?}",
            got.replica
        );
        assert!((got.ttft_s - cost).abs() < 1e-9, "the cost is the TTFT");
    }
}

/// Two routers, two idle replicas, and two cold requests at the same
/// instant whose keys rank the same replica first: without admission
/// checks the second queues behind the first; with them the replica
/// refuses it and it goes to the other one, a refusal's round trip later.
#[test]
fn a_burst_across_routers_is_spread_by_refusals() {
    use kvroute_core::policy::KvrouteConfig;
    let run = |tolerance: Option<f64>, keys: (u64, u64)| {
        let config = PolicyConfig::Kvroute(KvrouteConfig {
            admission_tolerance_ms: tolerance,
            ..KvrouteConfig::default()
        });
        let mut s = Sim::new(config.build(), 2, 0.1, 2, 100, 16);
        let a = s.step(&req(1.0, 10_000, 5, &[1]), (RoutingKey(keys.0), None));
        let b = s.step(&req(1.0, 10_000, 5, &[2]), (RoutingKey(keys.1), None));
        (a, b)
    };
    // Keys whose first choice is the same replica.
    let key = (1..)
        .find(|&k| {
            let (a, b) = run(None, (0, k));
            a.replica == b.replica
        })
        .unwrap();
    let (a, b) = run(None, (0, key));
    assert!((a.ttft_s - 1.02).abs() < 1e-9);
    assert!(
        (b.ttft_s - 2.04).abs() < 1e-9,
        "queued behind a: {}",
        b.ttft_s
    );
    let (a, b) = run(Some(50.0), (0, key));
    assert_ne!(a.replica, b.replica);
    assert!((a.ttft_s - 1.02).abs() < 1e-9);
    assert!(
        (b.ttft_s - (1.02 + REFUSAL_S)).abs() < 1e-9,
        "refused once: {}",
        b.ttft_s
    );
}
