use super::*;

fn bounds(max_queued: usize, max_queued_bytes: usize) -> Bounds {
    Bounds {
        max_queued,
        max_queued_bytes,
        max_wait: Duration::from_secs(30),
        band_wait: BTreeMap::from([(10, Duration::from_secs(2))]),
    }
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn push(q: &mut Queue, priority: i32, flow: &str, now: Instant) -> Id {
    q.push(priority, flow, 100, now).unwrap().id
}

#[test]
fn higher_bands_first_flows_take_turns_and_each_flow_is_first_come_first_served() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 1 << 20));
    let a1 = push(&mut q, 0, "a", now);
    let a2 = push(&mut q, 0, "a", now);
    let a3 = push(&mut q, 0, "a", now);
    let b1 = push(&mut q, 0, "b", now);
    let hi = push(&mut q, 10, "a", now);
    let c1 = push(&mut q, 0, "c", now);
    assert_eq!(q.order(100), [hi, a1, b1, c1, a2, a3]);
    assert_eq!(q.order(3), [hi, a1, b1]);
    assert_eq!(q.by_priority().collect::<Vec<_>>(), [(0, 5), (10, 1)]);
    assert!(q.ahead(0) && q.ahead(10) && !q.ahead(11));
}

#[test]
fn a_flow_dispatched_to_goes_to_the_back_of_its_band() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 1 << 20));
    let a1 = push(&mut q, 0, "a", now);
    let a2 = push(&mut q, 0, "a", now);
    let b1 = push(&mut q, 0, "b", now);
    let b2 = push(&mut q, 0, "b", now);
    assert_eq!(q.kick(), Some(a1));
    assert_eq!(q.turn_done(a1, Turn::Dispatched(addr(1))), Some(b1));
    assert_eq!(q.turn_done(b1, Turn::Held(Some(addr(2)))), Some(a2));
    assert_eq!(q.turn_done(a2, Turn::Held(None)), Some(b2));
    assert_eq!(q.turn_done(b2, Turn::Held(None)), None);
    // b is now first: a was dispatched to.
    assert_eq!(q.order(10), [b1, a2, b2]);
}

#[test]
fn a_pass_leaves_out_endpoints_that_earlier_turns_wait_for_or_were_sent_to() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 1 << 20));
    let ids: Vec<Id> = (0..3).map(|_| push(&mut q, 0, "a", now)).collect();
    assert!(q.reserved().is_empty());
    assert_eq!(q.kick(), Some(ids[0]));
    assert!(q.has_turn(ids[0]) && !q.has_turn(ids[1]));
    // A turn that is not current changes nothing.
    assert_eq!(q.turn_done(ids[1], Turn::Held(Some(addr(9)))), None);
    assert_eq!(q.turn_done(ids[0], Turn::Held(Some(addr(1)))), Some(ids[1]));
    assert_eq!(q.reserved(), [addr(1)]);
    assert_eq!(q.turn_done(ids[1], Turn::Dispatched(addr(2))), Some(ids[2]));
    assert_eq!(q.reserved(), [addr(1), addr(2)]);
    assert_eq!(q.turn_done(ids[2], Turn::Held(Some(addr(3)))), None);
    // The pass is over: the next one starts with nothing reserved.
    assert!(q.reserved().is_empty());
    assert_eq!(q.len(), 2);
    assert_eq!(q.kick(), Some(ids[0]));
    assert!(q.reserved().is_empty());
}

#[test]
fn an_event_during_a_pass_starts_another_after_it() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 1 << 20));
    let a = push(&mut q, 0, "a", now);
    let b = push(&mut q, 0, "a", now);
    assert_eq!(q.kick(), Some(a));
    assert_eq!(q.kick(), None, "one pass at a time");
    assert_eq!(q.turn_done(a, Turn::Held(None)), Some(b));
    // The pass ends; the event seen during it starts the next.
    assert_eq!(q.turn_done(b, Turn::Held(None)), Some(a));
    assert_eq!(q.turn_done(a, Turn::Held(None)), Some(b));
    assert_eq!(q.turn_done(b, Turn::Held(None)), None);
    assert_eq!(q.kick(), Some(a));
}

#[test]
fn a_request_that_leaves_during_its_turn_hands_the_turn_on() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 1 << 20));
    let a = push(&mut q, 0, "a", now);
    let b = push(&mut q, 0, "b", now);
    let c = push(&mut q, 0, "c", now);
    assert_eq!(q.kick(), Some(a));
    assert_eq!(q.leave(b), None, "b's turn had not come");
    assert_eq!(q.leave(a), Some(c));
    assert_eq!(q.turn_done(c, Turn::Held(None)), None);
    assert_eq!(q.len(), 1);
    assert_eq!(q.leave(c), None);
    assert_eq!(q.kick(), None, "nothing held, no pass");
    assert!(!q.ahead(i32::MIN));
}

#[test]
fn a_full_queue_sheds_the_lowest_band_newest_of_its_largest_flow_else_refuses() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(4, 1 << 20));
    let low_a1 = push(&mut q, 0, "a", now);
    let _low_b1 = push(&mut q, 0, "b", now);
    let low_b2 = push(&mut q, 0, "b", now);
    let mid = push(&mut q, 5, "a", now);
    // b is band 0's largest flow: another of its requests is refused.
    assert_eq!(q.push(0, "b", 100, now), Err(ShedReason::QueueFull));
    let hi = q.push(10, "a", 100, now).unwrap();
    assert_eq!(hi.shed, [low_b2]);
    let hi2 = q.push(10, "a", 100, now).unwrap();
    // b and a now hold one each: the tie goes to the flow named first.
    assert_eq!(hi2.shed, [low_a1]);
    assert_eq!(q.len(), 4);
    assert!(q.order(10).contains(&mid));
}

#[test]
fn bytes_are_bounded_too_and_a_displaced_turn_is_handed_on() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 250));
    let a = q.push(0, "a", 100, now).unwrap().id;
    let b = q.push(0, "b", 100, now).unwrap().id;
    // a holds as many as the largest flow of its band.
    assert_eq!(q.push(0, "a", 100, now), Err(ShedReason::QueueFull));
    assert_eq!(q.push(10, "c", 300, now), Err(ShedReason::QueueFull));
    assert_eq!(q.kick(), Some(a));
    let hi = q.push(10, "c", 150, now).unwrap();
    // a and b hold one each: the tie goes to the flow named first, which
    // held the turn.
    assert_eq!(hi.shed, [a]);
    assert_eq!(hi.turn, Some(b));
    assert_eq!(q.len(), 2);
    assert_eq!(q.turn_done(b, Turn::Held(None)), None);
    assert_eq!(q.kick(), Some(hi.id), "the higher band first");
}

#[test]
fn negative_priorities_are_never_held_and_bands_have_their_own_wait() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(100, 1 << 20));
    assert_eq!(q.push(-1, "a", 1, now), Err(ShedReason::Sheddable));
    assert_eq!(
        q.push(0, "a", 1, now).unwrap().deadline,
        now + Duration::from_secs(30)
    );
    assert_eq!(
        q.push(10, "a", 1, now).unwrap().deadline,
        now + Duration::from_secs(2)
    );
    let mut none = Queue::new(bounds(0, 1 << 20));
    assert_eq!(none.push(10, "a", 1, now), Err(ShedReason::QueueFull));
}

/// Runs a pass to its end, every turn held waiting for `addr(1)`; returns
/// the requests that had a turn.
fn pass(q: &mut Queue) -> Vec<Id> {
    let mut turned = Vec::new();
    let mut turn = q.kick();
    while let Some(id) = turn {
        turned.push(id);
        turn = q.turn_done(id, Turn::Held(Some(addr(1))));
    }
    turned
}

#[test]
fn every_held_request_has_a_turn_within_a_few_passes_whatever_its_position() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(2000, 1 << 30));
    let ids: Vec<Id> = (0..1000).map(|_| push(&mut q, 0, "a", now)).collect();
    let mut seen = std::collections::HashSet::new();
    let mut passes = 0;
    while seen.len() < ids.len() {
        let turned = pass(&mut q);
        // The head every time, then the longest without a turn, in order.
        assert_eq!(turned.len(), 2 * PASS_TURNS);
        assert_eq!(turned[..PASS_TURNS], ids[..PASS_TURNS]);
        assert!(turned.is_sorted());
        seen.extend(turned);
        passes += 1;
    }
    assert_eq!(passes, (1000 - PASS_TURNS).div_ceil(PASS_TURNS));
    // The last request, newly arrived, has its turn in the next pass.
    let last = push(&mut q, 0, "b", now);
    assert!(pass(&mut q).contains(&last));
}

#[test]
fn a_flow_holding_fewer_displaces_the_newest_of_the_largest_flow_in_its_band() {
    let now = Instant::now();
    let mut q = Queue::new(bounds(4, 1 << 20));
    let a: Vec<Id> = (0..3).map(|_| push(&mut q, 0, "a", now)).collect();
    let b1 = push(&mut q, 0, "b", now);
    // b holds 1, a 3: b's second takes a's newest place.
    let b2 = q.push(0, "b", 100, now).unwrap();
    assert_eq!(b2.shed, [a[2]]);
    // Now a and b hold 2 each: neither displaces the other.
    assert_eq!(q.push(0, "b", 100, now), Err(ShedReason::QueueFull));
    assert_eq!(q.push(0, "a", 100, now), Err(ShedReason::QueueFull));
    let c = q.push(0, "c", 100, now).unwrap();
    // The tie goes to the flow named first.
    assert_eq!(c.shed, [a[1]]);
    assert_eq!(q.order(10), [a[0], b1, c.id, b2.id]);
    // Bytes too: a large request from a new flow displaces as many as it
    // needs, largest flow first.
    let mut q = Queue::new(bounds(100, 400));
    let a: Vec<Id> = (0..3).map(|_| push(&mut q, 0, "a", now)).collect();
    let b = push(&mut q, 0, "b", now);
    let c = q.push(0, "c", 250, now).unwrap();
    assert_eq!(c.shed, [a[2], a[1], a[0]]);
    assert_eq!(q.order(10), [b, c.id]);
    // A flow as large as the largest displaces none of its band.
    assert_eq!(q.push(0, "b", 100, now), Err(ShedReason::QueueFull));
    assert_eq!(q.len(), 2);
}
