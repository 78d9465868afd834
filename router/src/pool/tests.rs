use std::net::SocketAddr;
use std::time::Duration;

use kvroute_core::index::{CacheEvent, IndexError};
use kvroute_core::keys::RoutingKey;
use kvroute_core::policy::{PolicyConfig, Request};

use super::*;

fn spec(name: &str, port: u16) -> EndpointSpec {
    EndpointSpec {
        name: name.into(),
        http: SocketAddr::from(([127, 0, 0, 1], port)),
        cache: None,
        ready: true,
        draining: false,
        ready_since_ms: None,
        role: Default::default(),
    }
}

fn pool(concurrency: u32) -> Arc<Pool> {
    Pool::new(
        Settings::builtin(PolicyConfig::by_name("round-robin").unwrap()),
        &Resilience {
            attempts: 3,
            eject_after_failures: 2,
            ejection_base_ms: 1000,
            ejection_max_ms: 3000,
            max_ejected_percent: 50,
            health_check: None,
            ..Resilience::default()
        },
        concurrency,
    )
}

fn request() -> Request<'static> {
    Request {
        key: RoutingKey(1),
        chain: &[],
        prompt_tokens: 10,
        key_prefix_blocks: None,
        output_tokens: 0,
    }
}

fn names(plan: &Plan) -> Vec<&str> {
    let mut n: Vec<&str> = plan.targets.iter().map(|t| &*t.name).collect();
    n.sort_unstable();
    n
}

#[tokio::test]
async fn only_ready_non_draining_endpoints_are_routed() {
    let p = pool(8);
    let mut draining = spec("b", 2);
    draining.draining = true;
    let mut unready = spec("c", 3);
    unready.ready = false;
    p.set_endpoints(vec![spec("a", 1), draining, unready]);
    assert_eq!(names(&p.plan(&request(), true)), vec!["a"]);
    assert_eq!(p.routable(), 1);
    assert_eq!(*p.ready().borrow(), 1);
}

#[tokio::test]
async fn endpoint_changes_keep_slots_and_forget_the_removed() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    let a = p
        .plan(&request(), true)
        .targets
        .into_iter()
        .find(|t| &*t.name == "a")
        .unwrap();
    let ticket = p.start(&request(), &a, 10).expect("admitted");
    p.set_endpoints(vec![spec("a", 1), spec("c", 3)]);
    let status = p.status();
    let names: Vec<&str> = status.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["a", "c"]);
    assert_eq!(status[0].in_flight, 1, "a kept its slot and its load");
    drop(ticket);
    assert_eq!(p.status()[0].in_flight, 0);
}

#[tokio::test]
async fn full_endpoints_are_left_out_of_the_plan() {
    let p = pool(1);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    let first = p.plan(&request(), true);
    let t = p
        .start(&request(), &first.targets[0], 10)
        .expect("admitted");
    let second = p.plan(&request(), true);
    assert_eq!(second.targets.len(), 1);
    assert_eq!(second.full, 1);
    assert_ne!(second.targets[0].name, first.targets[0].name);
    drop(t);
    assert_eq!(p.plan(&request(), true).targets.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn ejection_backs_off_exponentially_and_readmits() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    assert!(!p.failed("a", Fault::Status).ejected());
    let _ = p.succeeded("a"); // a success resets the count
    assert!(!p.failed("a", Fault::Status).ejected());
    assert!(p.failed("a", Fault::Status).ejected(), "two in a row eject");
    assert_eq!(names(&p.plan(&request(), true)), vec!["b"]);
    tokio::time::advance(Duration::from_millis(1001)).await;
    assert_eq!(
        names(&p.plan(&request(), true)),
        vec!["a", "b"],
        "re-admitted after 1 s"
    );
    // On probation: one failure ejects it again, for twice as long.
    assert!(p.failed("a", Fault::Status).ejected());
    tokio::time::advance(Duration::from_millis(1500)).await;
    assert_eq!(names(&p.plan(&request(), true)), vec!["b"]);
    tokio::time::advance(Duration::from_millis(600)).await;
    assert_eq!(names(&p.plan(&request(), true)), vec!["a", "b"]);
    // Capped at 3 s.
    assert!(p.failed("a", Fault::Status).ejected());
    tokio::time::advance(Duration::from_millis(3001)).await;
    assert_eq!(p.routable(), 2);
    // A good answer after re-admission clears the history.
    let _ = p.succeeded("a");
    assert!(!p.failed("a", Fault::Status).ejected());
}

#[tokio::test(start_paused = true)]
async fn of_plans_made_while_half_open_only_the_first_start_is_the_trial() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    assert!(p.failed("a", Fault::Timeout).ejected());
    tokio::time::advance(Duration::from_millis(1001)).await;
    // Both plans were made before either request started.
    let (one, two) = (p.plan(&request(), true), p.plan(&request(), true));
    let a = |plan: &Plan| {
        plan.targets
            .iter()
            .find(|t| &*t.name == "a")
            .unwrap()
            .clone()
    };
    let trial = p.start(&request(), &a(&one), 10).expect("the trial");
    assert!(
        p.start(&request(), &a(&two), 10).is_none(),
        "one trial at a time"
    );
    // Ended unjudged: the next request is the trial.
    drop(trial);
    assert!(p.start(&request(), &a(&two), 10).is_some());
}

#[tokio::test]
async fn a_broken_stream_ejects_at_once() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    assert!(p.failed("a", Fault::Stream).ejected());
    assert_eq!(names(&p.plan(&request(), true)), vec!["b"]);
}

#[tokio::test]
async fn cache_updates_from_a_stale_watcher_are_ignored() {
    let p = pool(8);
    let mut a = spec("a", 1);
    a.cache = Some(SocketAddr::from(([127, 0, 0, 1], 9)));
    p.set_endpoints(vec![a.clone()]);
    // Generation 1 is a's watcher. A snapshot from another generation is
    // ignored; its own applies.
    let engine = kvroute_core::contract::EngineCache::of(&p.settings().hasher);
    p.apply_snapshot("a", 99, engine.clone(), 8, &[1, 2], &[])
        .unwrap();
    p.apply_cache("a", 99, CacheEvent::Stored(&[3])).unwrap();
    assert_eq!(p.index_entries(), 0);
    // Changes before a snapshot has checked the contract are not indexed.
    p.apply_cache("a", 1, CacheEvent::Stored(&[3])).unwrap();
    assert_eq!(p.index_entries(), 0);
    p.apply_snapshot("a", 1, engine, 8, &[1, 2], &[]).unwrap();
    p.set_stream("a", 1, StreamState::Live);
    assert_eq!(p.index_entries(), 2);
    assert_eq!(p.status()[0].contract, "match");
    assert_eq!(p.status()[0].stream, "live");
    // Losing the stream drops the entries until the next snapshot.
    p.set_stream("a", 1, StreamState::Connecting);
    assert_eq!(p.index_entries(), 0);
}

#[tokio::test]
async fn unreadable_requests_go_to_the_least_loaded() {
    let p = Pool::new(
        Settings::builtin(PolicyConfig::default()),
        &Resilience::default(),
        8,
    );
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    let busy = p
        .plan(&request(), true)
        .targets
        .into_iter()
        .find(|t| &*t.name == "a")
        .unwrap();
    let t1 = p.start(&request(), &busy, 10).expect("admitted");
    for _ in 0..3 {
        assert_eq!(p.plan(&request(), false).targets[0].name.as_ref(), "b");
    }
    drop(t1);
}

#[tokio::test(start_paused = true)]
async fn at_most_half_the_endpoints_are_ejected_and_each_event_is_returned() {
    let p = Pool::new(
        Settings::builtin(PolicyConfig::by_name("round-robin").unwrap()),
        &Resilience {
            eject_after_failures: 1,
            health_check: None,
            ..Resilience::default()
        },
        8,
    );
    p.set_endpoints(vec![spec("a", 1), spec("b", 2), spec("c", 3), spec("d", 4)]);
    let mut events = Vec::new();
    for name in ["a", "b", "c", "d"] {
        events.extend(p.failed(name, Fault::Connect));
    }
    assert_eq!(p.routable(), 2, "two of four stay routable");
    tokio::time::advance(Duration::from_millis(5001)).await;
    events.extend(p.tick());
    assert_eq!(p.routable(), 4);
    let count = |f: &dyn Fn(&Event) -> bool| events.iter().filter(|e| f(e)).count();
    let ejected = count(&|e| matches!(e, Event::Ejected { fault, .. } if *fault == Fault::Connect));
    let refused = count(&|e| matches!(e, Event::Refused { fault, .. } if *fault == Fault::Connect));
    let restored = count(&|e| matches!(e, Event::Restored { why, .. } if *why == Restore::Expired));
    assert_eq!((ejected, refused, restored), (2, 2, 2), "{events:?}");
    assert_eq!(events.len(), 6, "{events:?}");
}

#[tokio::test]
async fn a_dropped_guard_ends_the_load() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1)]);
    let target = p.plan(&request(), true).targets[0].clone();
    let mut guards: Vec<InFlight> = (0..5)
        .map(|_| p.start(&request(), &target, 10).expect("admitted"))
        .collect();
    guards[0].first_token();
    assert_eq!(p.status()[0].in_flight, 5);
    assert_eq!(p.status()[0].prefill_tokens, 40);
    guards.clear();
    assert_eq!(p.status()[0].in_flight, 0);
    assert_eq!(p.status()[0].prefill_tokens, 0);
}

#[tokio::test]
async fn a_large_snapshot_is_applied_in_chunks_within_the_index_bounds() {
    let p = pool(8);
    p.set_index_bounds(Bounds {
        gpu: 3 * SNAPSHOT_CHUNK,
        offloaded: 10,
    });
    let mut a = spec("a", 1);
    a.cache = Some(SocketAddr::from(([127, 0, 0, 1], 9)));
    p.set_endpoints(vec![a]);
    let engine = kvroute_core::contract::EngineCache::of(&p.settings().hasher);
    let blocks: Vec<u64> = (1..=5 * SNAPSHOT_CHUNK as u64 + 7).collect();
    p.apply_snapshot("a", 1, engine.clone(), usize::MAX, &blocks, &[&[1, 2, 3]])
        .unwrap();
    let [gpu, offloaded] = p.index_stats();
    assert_eq!(gpu.entries, 3 * SNAPSHOT_CHUNK);
    assert_eq!(gpu.dropped, 2 * SNAPSHOT_CHUNK as u64 + 7);
    assert_eq!((offloaded.entries, offloaded.dropped), (3, 0));
    // The engine's capacity still refuses a snapshot larger than itself.
    assert!(matches!(
        p.apply_snapshot("a", 1, engine.clone(), 4, &blocks, &[]),
        Err(IndexError::OverCapacity { .. })
    ));
    // A new snapshot replaces the old contents; a lost stream drops them.
    p.apply_snapshot("a", 1, engine, usize::MAX, &[7, 8], &[])
        .unwrap();
    assert_eq!(p.index_entries(), 2);
    p.set_stream("a", 1, StreamState::Connecting);
    assert_eq!(p.index_stats()[0].entries, 0);
    assert!(!p.holds_any(7));
}

#[tokio::test]
async fn a_plan_says_who_held_the_prefix_and_why_they_lost() {
    let p = pool(1);
    p.set_evicted_capacity(1024);
    let with_cache = |name, port| EndpointSpec {
        cache: Some(SocketAddr::from(([127, 0, 0, 1], 9))),
        ..spec(name, port)
    };
    let streams = p.set_endpoints(vec![
        with_cache("a", 1),
        with_cache("b", 2),
        with_cache("c", 3),
    ]);
    let engine = kvroute_core::contract::EngineCache::of(&p.settings().hasher);
    for (s, blocks) in streams.start.iter().zip([&[1, 4][..], &[1, 2], &[1, 2, 3]]) {
        p.apply_snapshot(&s.name, s.generation, engine.clone(), 8, blocks, &[])
            .unwrap();
        p.set_stream(&s.name, s.generation, StreamState::Live);
    }
    // a drops block 4, which no one else holds: evicted.
    let a = &streams.start[0];
    p.apply_cache("a", a.generation, CacheEvent::Removed(&[4]))
        .unwrap();
    assert!(p.failed("b", Fault::Stream).ejected());
    let chain = [1, 2, 3, 4, 9, 10];
    let r = Request {
        key: RoutingKey(1),
        chain: &chain,
        prompt_tokens: 100,
        key_prefix_blocks: None,
        output_tokens: 0,
    };
    let c_addr = SocketAddr::from(([127, 0, 0, 1], 3));
    let seen = |plan: &Plan| plan.seen.clone().unwrap();

    // c left out by the gateway's hint: it held the most.
    let plan = p.plan_among(&r, true, &|addr| *addr != c_addr);
    assert_eq!(names(&plan), ["a"]);
    let s = seen(&plan);
    assert_eq!((s.held, s.foreign), (vec![1], vec![false]));
    assert_eq!(s.outside, Some((3, Lost::Subset)));
    assert_eq!(s.recent, 4, "blocks 1-3 held, 4 evicted, 9 never seen");

    // With c a target, b (ejected) is the best of the rest.
    let plan = p.plan(&r, true);
    assert_eq!(seen(&plan).outside, Some((2, Lost::Ejection)));
    // c full: left out, and why.
    let c = plan.targets.iter().find(|t| &*t.name == "c").unwrap();
    let _busy = p.start(&r, c, 100).expect("admitted");
    assert_eq!(seen(&p.plan(&r, true)).outside, Some((3, Lost::Queue)));
    // Unreadable prompts say nothing.
    assert_eq!(p.plan(&r, false).seen, None);
}

/// Each endpoint's slow-start weight, by name.
fn weights(p: &Pool) -> Vec<(String, f64)> {
    p.status().into_iter().map(|s| (s.name, s.weight)).collect()
}

#[tokio::test]
async fn endpoints_ready_before_the_router_started_do_not_ramp_and_later_ones_do() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    assert_eq!(weights(&p), [("a".into(), 1.0), ("b".into(), 1.0)]);

    // Listed later, with no ready time: from this router's clock, so at the
    // start of its 30 s ramp.
    p.set_endpoints(vec![spec("a", 1), spec("b", 2), spec("c", 3)]);
    let c = p.status().into_iter().find(|s| s.name == "c").unwrap();
    assert!(c.weight < 0.1, "{}", c.weight);
    assert!(c.ramp_started.is_some());
    // Still ramping in the next set; `a` turning unready and ready again
    // ramps it again.
    let mut unready = spec("a", 1);
    unready.ready = false;
    p.set_endpoints(vec![unready, spec("b", 2), spec("c", 3)]);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2), spec("c", 3)]);
    let w = weights(&p);
    assert!(w[0].1 < 0.1 && w[1].1 == 1.0 && w[2].1 < 0.1, "{w:?}");
}

#[tokio::test]
async fn discoverys_ready_time_sets_the_ramp_for_every_router() {
    let p = pool(8);
    let now_ms = super::wall_ms();
    let since = |name, port, ago_ms: i64| EndpointSpec {
        ready_since_ms: Some(now_ms - ago_ms),
        role: Default::default(),
        ..spec(name, port)
    };
    // Given in the first set too: a ready time is a ready time.
    p.set_endpoints(vec![since("a", 1, 3_600_000), since("b", 2, 15_000)]);
    let w = weights(&p);
    assert_eq!(w[0].1, 1.0);
    assert!((w[1].1 - 0.5).abs() < 0.02, "{w:?}");
    // Slow start off: everything at 1.
    p.update_settings(|s| {
        let mut s = s.clone();
        s.slow_start = Duration::ZERO;
        s
    });
    assert!(weights(&p).iter().all(|(_, w)| *w == 1.0));
}

#[tokio::test]
async fn a_ramping_endpoint_is_first_for_its_share_of_cold_keys() {
    let p = Pool::new(
        Settings::builtin(PolicyConfig::default()),
        &Resilience::default(),
        64,
    );
    let now_ms = super::wall_ms();
    let mut ramping = spec("e", 5);
    // A quarter into a 30 s ramp: weight 0.25, first for 0.25 / 4.25.
    ramping.ready_since_ms = Some(now_ms - 7_500);
    p.set_endpoints(vec![
        spec("a", 1),
        spec("b", 2),
        spec("c", 3),
        spec("d", 4),
        ramping,
    ]);
    let keys = 4_000u64;
    let firsts = (0..keys)
        .filter(|&k| {
            let request = Request {
                key: RoutingKey(k),
                ..request()
            };
            &*p.plan(&request, true).targets[0].name == "e"
        })
        .count();
    let share = firsts as f64 / keys as f64;
    assert!((share - 0.25 / 4.25).abs() < 0.02, "{share}");
}

#[tokio::test(start_paused = true)]
async fn a_long_lower_prefill_goes_only_while_another_endpoint_can_start_one() {
    let p = pool(8);
    p.set_endpoints(vec![spec("a", 1), spec("b", 2)]);
    let hold_s = 0.05;
    let long = Request {
        prompt_tokens: 20_000,
        ..request()
    };
    let plan = p.plan(&long, true);
    let (first, other) = (&plan.targets[0], &plan.targets[1]);
    assert!(
        p.leaves_room((&long, Leg::Decode), &plan, 0, hold_s),
        "both idle"
    );
    assert!(p.leaves_room((&request(), Leg::Decode), &plan, 0, hold_s));
    // The other endpoint prefills for longer than `hold_s`: the long one
    // would leave no endpoint to start a request within it.
    let _busy = p.hold(other, 20_000, 20_000);
    assert!(!p.leaves_room((&long, Leg::Decode), &plan, 0, hold_s));
    assert!(
        p.leaves_room((&request(), Leg::Decode), &plan, 0, hold_s),
        "a short one ends within it"
    );
    // Nor does it go where a prefill is queued before it.
    let _queued = p.hold(first, 20_000, 20_000);
    assert!(!p.leaves_room((&long, Leg::Decode), &plan, 0, hold_s));
}
