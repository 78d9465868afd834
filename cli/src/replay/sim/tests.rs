use kvroute_core::policy::PolicyConfig;

use super::*;

fn req(t: f64, input: u64, output: u64, ids: &[u64]) -> TraceRequest {
    TraceRequest {
        arrival_s: t,
        input_length: input,
        output_length: output,
        hash_ids: ids.to_vec(),
        session_id: None,
    }
}

fn sim(policy: &str, replicas: usize, capacity: usize, block_tokens: u64) -> Sim {
    let policy = PolicyConfig::by_name(policy).unwrap().build();
    Sim::new(policy, replicas, capacity, block_tokens)
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
    let first = s.step(&req(0.0, 25, 1, &[1, 2, 3]), RoutingKey(0));
    assert_eq!((first.cached_tokens, first.uncached_tokens), (0, 25));
    // Same first two blocks: 20 tokens cached. Three blocks would be 30,
    // capped at the prompt's 25.
    let second = s.step(&req(1.0, 28, 1, &[1, 2, 9]), RoutingKey(0));
    assert_eq!(second.cached_tokens, 20);
    let third = s.step(&req(2.0, 25, 1, &[1, 2, 3]), RoutingKey(0));
    assert_eq!(third.cached_tokens, 25);
}

#[test]
fn prefill_is_fifo_per_replica() {
    let mut s = sim("round-robin", 1, 100, 16);
    let a = s.step(&req(0.0, 10_000, 5, &[]), RoutingKey(0));
    let b = s.step(&req(0.0, 10_000, 5, &[]), RoutingKey(0));
    let c = s.step(&req(0.5, 5_000, 5, &[]), RoutingKey(0));
    assert!((a.ttft_s - 1.02).abs() < 1e-9);
    assert!((b.ttft_s - 2.04).abs() < 1e-9, "waits for a: {}", b.ttft_s);
    assert!((c.ttft_s - (2.04 + 0.52 - 0.5)).abs() < 1e-9);
    // Idle again long after: only its own prefill.
    let d = s.step(&req(100.0, 1_000, 5, &[]), RoutingKey(0));
    assert!((d.ttft_s - 0.12).abs() < 1e-9);
}

#[test]
fn load_counts_in_flight_until_completion() {
    let mut s = sim("round-robin", 1, 100, 16);
    // Prefill ends at 0.02 + 0.1; completes 0.03 × 10 later.
    let a = s.step(&req(0.0, 1_000, 10, &[]), RoutingKey(0));
    let (end, done) = (a.ttft_s, a.ttft_s + 0.3);
    let r = &mut s.replicas[0];
    let state = |r: &Replica| {
        (
            r.load().in_flight,
            r.load().prefill_tokens,
            r.load().decoding,
        )
    };
    r.advance(0.1);
    assert_eq!(state(r), (1, 1_000, 0));
    r.advance(end);
    assert_eq!(state(r), (1, 0, 1), "past prefill at its end");
    r.advance(done);
    assert_eq!(state(r), (0, 0, 0), "completing at t no longer counts at t");
}

#[test]
fn the_index_mirrors_the_caches() {
    let mut s = sim("kvroute", 2, 3, 16);
    for (i, ids) in [[1u64, 2, 3], [4, 5, 6], [1, 2, 7], [8, 9, 10]]
        .iter()
        .enumerate()
    {
        s.step(&req(i as f64, 48, 1, ids), RoutingKey(i as u64));
    }
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
        s.step(&req(k as f64, 32, 1, &[k, k + 100]), RoutingKey(k));
    }
    let mut kept = s.clone();
    let mut grown = s.clone();
    grown.add_replica();
    assert_eq!((kept.replicas.len(), grown.replicas.len()), (3, 4));
    assert!(grown.replicas[3].cache.is_empty());
    let mut moved = 0;
    for k in 0..30u64 {
        let r = req(100.0 + k as f64, 32, 1, &[k, k + 100]);
        let a = kept.step(&r, RoutingKey(k));
        let b = grown.step(&r, RoutingKey(k));
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
