use super::*;

const MS: Duration = Duration::from_millis(1);

/// Block size 4, 1,000 prefill tokens/s, 10 ms overhead, 30 ms steps.
fn config(num_blocks: usize) -> Config {
    Config {
        num_blocks,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        prefill_tokens_per_s: 1000.0,
        prefill_overhead: 10 * MS,
        itl: 30 * MS,
    }
}

/// Hashes of `n` full blocks of a prompt named `name`.
fn hashes(name: u64, n: usize) -> Vec<BlockHash> {
    (0..n as u64).map(|i| name * 1000 + i).collect()
}

/// Drives an engine in virtual time, logging what happened when.
struct Driver {
    engine: Engine,
    now: Duration,
    log: Vec<(Duration, RequestId, Progress)>,
}

impl Driver {
    fn new(config: Config) -> Self {
        Driver {
            engine: Engine::new(config),
            now: Duration::ZERO,
            log: Vec::new(),
        }
    }

    fn add(&mut self, id: RequestId, prompt: usize, max_tokens: usize) {
        self.add_named(id, id, prompt, max_tokens);
    }

    /// Adds request `id` whose prompt is the one named `name`.
    fn add_named(&mut self, id: RequestId, name: u64, prompt: usize, max_tokens: usize) {
        let bs = self.engine.config().block_size;
        self.engine
            .add(id, hashes(name, prompt / bs), prompt, max_tokens)
            .unwrap();
    }

    fn record(&mut self) {
        let now = self.now;
        let progress = self.engine.take_progress();
        self.log
            .extend(progress.into_iter().map(|(id, p)| (now, id, p)));
    }

    /// Runs one step; false when there was nothing to do.
    fn step(&mut self) -> bool {
        let Some(end) = self.engine.start_step(self.now) else {
            return false;
        };
        self.record();
        self.now = end;
        self.engine.finish_step();
        self.record();
        true
    }

    fn run(&mut self) {
        while self.step() {}
    }

    /// When `id` produced output token `index`.
    fn token_at(&self, id: RequestId, index: usize) -> Duration {
        self.log
            .iter()
            .find(|(_, r, p)| {
                *r == id && matches!(p, Progress::Token { index: i, .. } if *i == index)
            })
            .map(|(t, ..)| *t)
            .unwrap_or_else(|| panic!("{id} never produced token {index}: {:?}", self.log))
    }

    fn count(&self, id: RequestId, what: impl Fn(&Progress) -> bool) -> usize {
        self.log
            .iter()
            .filter(|(_, r, p)| *r == id && what(p))
            .count()
    }
}

#[test]
fn a_lone_request_prefills_in_one_step_then_decodes_one_token_per_step() {
    let mut d = Driver::new(config(64));
    d.add(1, 40, 3);
    d.run();
    // max(30 ms, 10 ms + 40 tokens at 1,000/s) = 50 ms, then 30 ms a token.
    assert_eq!(d.token_at(1, 0), 50 * MS);
    assert_eq!(d.token_at(1, 1), 80 * MS);
    assert_eq!(d.token_at(1, 2), 110 * MS);
    assert_eq!(
        d.log.last().unwrap().2,
        Progress::Token {
            index: 2,
            last: true
        }
    );
    assert!(d.engine.is_idle());
    assert_eq!(d.engine.load(d.now).used_blocks, 0, "freed at the end");
    assert_eq!(d.engine.cached_blocks(), 10, "every prompt block cached");
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() {
    let mut d = Driver::new(config(64));
    d.add(1, 150, 1);
    assert!(d.step());
    // 64 tokens: 10 ms + 64 ms.
    assert_eq!(d.now, 74 * MS);
    assert!(
        d.log
            .iter()
            .all(|(_, _, p)| !matches!(p, Progress::Token { .. }))
    );
    // A request arriving now shares the next step's budget after the
    // running one's chunk.
    d.add(2, 8, 1);
    assert!(d.step());
    assert_eq!(
        d.now,
        (74 + 74) * MS,
        "the budget caps the step at 64 tokens"
    );
    assert_eq!(d.count(2, |p| matches!(p, Progress::Admitted { .. })), 0);
    assert!(d.step());
    // 22 tokens of request 1 and 8 of request 2: 10 ms + 30 ms.
    assert_eq!(d.now, (74 + 74 + 40) * MS);
    assert_eq!(d.token_at(1, 0), d.now);
    assert_eq!(d.token_at(2, 0), d.now);
}

#[test]
fn blocks_are_taken_as_tokens_need_them() {
    let mut d = Driver::new(config(64));
    d.add(1, 8, 10);
    assert!(d.step());
    // The prompt's two blocks, none for the output yet.
    assert_eq!(d.engine.load(d.now).used_blocks, 2);
    // Token 0 made 9 tokens: the next step computes the 9th in a third
    // block; every 4 tokens after, one more.
    let used: Vec<u64> = (0..9)
        .map(|_| {
            d.step();
            d.engine.load(d.now).used_blocks
        })
        .collect();
    assert_eq!(used, [3, 3, 3, 3, 4, 4, 4, 4, 0]);
}

#[test]
fn a_decode_without_a_block_preempts_the_latest_admitted_which_recomputes() {
    // 6 blocks of 4 tokens. Both prompts (8 tokens) fit; both outputs
    // cannot.
    let mut d = Driver::new(config(6));
    d.add(1, 8, 9);
    d.add(2, 8, 9);
    d.run();
    assert_eq!(d.count(2, |p| *p == Progress::Preempted), 1);
    assert_eq!(
        d.count(1, |p| *p == Progress::Preempted),
        0,
        "the oldest runs on"
    );
    assert_eq!(d.engine.counters().preemptions, 1);
    // Both finish every token, once each, in order.
    for id in [1, 2] {
        let indices: Vec<usize> = d
            .log
            .iter()
            .filter_map(|(_, r, p)| match p {
                Progress::Token { index, .. } if *r == id => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(indices, (0..9).collect::<Vec<_>>());
    }
    // Request 2 was admitted once (its cached prefix is reported once)...
    assert_eq!(d.count(2, |p| matches!(p, Progress::Admitted { .. })), 1);
    // ...and resumed after request 1 finished, recomputing only what its
    // cached prompt blocks do not cover: its 5 output tokens, one step.
    let (preempted_at, ..) = *d
        .log
        .iter()
        .find(|(_, r, p)| *r == 2 && *p == Progress::Preempted)
        .unwrap();
    let done_1 = d.token_at(1, 8);
    assert!(preempted_at < done_1);
    let (last_before, next) = (d.token_at(2, 4), d.token_at(2, 5));
    assert!(last_before <= preempted_at);
    assert_eq!(next, done_1 + 30 * MS);
}

#[test]
fn free_cached_blocks_are_evicted_least_recently_freed_first_tail_first() {
    // 8 blocks: request 1 takes 5 (blocks 1000..=1003 and a partial one)
    // and frees them tail first behind the 3 never used. A new prompt of
    // 5 blocks takes the unused, the partial, then evicts 1003; one of 6
    // evicts 1002 too: the head outlives the tail.
    for (blocks, evicted) in [(5, vec![1003]), (6, vec![1003, 1002])] {
        let mut d = Driver::new(config(8));
        d.add(1, 17, 1);
        d.run();
        d.engine.take_events();
        d.add(2, blocks * 4, 1);
        d.step();
        let removed: Vec<u64> = d
            .engine
            .take_events()
            .into_iter()
            .flat_map(|e| match e {
                PoolEvent::Removed(h) => h,
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(removed, evicted);
    }
}

#[test]
fn a_cached_prefix_is_reused_and_only_the_rest_prefilled() {
    let mut d = Driver::new(config(64));
    d.add(1, 40, 1);
    d.run();
    let t = d.now;
    // Same prompt: 9 of 10 blocks reused (the last token is computed).
    d.add_named(2, 1, 40, 1);
    d.run();
    assert!(
        d.log
            .contains(&(t, 2, Progress::Admitted { cached_tokens: 36 }))
    );
    // 4 tokens: max(30 ms, 10 + 4 ms).
    assert_eq!(d.token_at(2, 0), t + 30 * MS);
    assert_eq!(
        d.engine.counters(),
        Counters {
            queries: 80,
            hits: 36,
            preemptions: 0
        }
    );
}

#[test]
fn waiting_requests_are_admitted_in_order_and_the_head_blocks_the_rest() {
    let mut config = config(10);
    config.max_num_seqs = 1;
    let mut d = Driver::new(config);
    d.add(1, 8, 2);
    d.add(2, 8, 1);
    d.run();
    assert!(d.token_at(2, 0) > d.token_at(1, 1), "one runs at a time");

    // Memory: the head (8 blocks) does not fit beside request 3; request
    // 5 (1 block) would, but waits behind it.
    let mut d = Driver::new(config_with_seqs(10, 8));
    d.add(3, 12, 4);
    d.step();
    d.add(4, 32, 1);
    d.add(5, 4, 1);
    d.step();
    assert_eq!(d.count(4, |p| matches!(p, Progress::Admitted { .. })), 0);
    assert_eq!(d.count(5, |p| matches!(p, Progress::Admitted { .. })), 0);
    d.run();
    assert!(d.token_at(5, 0) >= d.token_at(4, 0));
}

fn config_with_seqs(num_blocks: usize, seqs: usize) -> Config {
    Config {
        max_num_seqs: seqs,
        ..config(num_blocks)
    }
}

#[test]
fn output_blocks_are_cached_once_their_hash_is_known() {
    let mut d = Driver::new(config(16));
    d.add(1, 4, 6);
    // The prompt's block is cached after the first step; the caller names
    // the output block (tokens 4..8) when its last token is generated.
    d.step();
    assert_eq!(d.engine.cached_blocks(), 1);
    for _ in 0..4 {
        d.step();
    }
    d.engine.add_block_hash(1, 77);
    d.step();
    assert!(d.engine.resident().any(|h| h == 77));
}

#[test]
fn an_aborted_request_frees_its_blocks_even_mid_step() {
    let mut d = Driver::new(config(16));
    d.add(1, 8, 5);
    d.add(2, 8, 5);
    let end = d.engine.start_step(Duration::ZERO).unwrap();
    assert!(d.engine.abort(2));
    assert!(!d.engine.abort(2), "once");
    assert_eq!(d.engine.load(Duration::ZERO).used_blocks, 2);
    d.now = end;
    d.engine.finish_step();
    let progress = d.engine.take_progress();
    assert!(
        progress
            .iter()
            .all(|(id, p)| *id == 1 || matches!(p, Progress::Admitted { .. }))
    );
    assert_eq!(d.engine.load(end).running, 1);
    assert!(d.engine.abort(1));
    assert!(d.engine.is_idle());
    assert_eq!(d.engine.load(end).used_blocks, 0);
}

#[test]
fn requests_that_can_never_fit_are_refused() {
    let mut e = Engine::new(config(4));
    // 12 prompt tokens + 5 output (the last needs no KV): 16 tokens.
    assert_eq!(e.add(1, Vec::new(), 12, 5), Ok(()));
    assert_eq!(
        e.add(2, Vec::new(), 12, 6),
        Err(Refused::TooLarge {
            needed: 5,
            capacity: 4
        })
    );
    assert_eq!(e.add(3, Vec::new(), 0, 1), Err(Refused::EmptyPrompt));
}

#[test]
fn the_load_counts_queued_prefill_memory_and_remaining_decode() {
    let mut d = Driver::new(config(40));
    d.add(1, 40, 3);
    d.add(2, 100, 2);
    d.add(3, 8, 2);
    let load = d.engine.load(Duration::ZERO);
    assert_eq!((load.waiting, load.running), (3, 0));
    assert_eq!(load.queued_prefill_tokens, 148);
    assert_eq!(load.waiting_blocks, 10 + 25 + 2);
    let end = d.engine.start_step(Duration::ZERO).unwrap();
    // Request 1 (40 tokens) and 24 tokens of request 2, the rest of the
    // budget; request 3 waits.
    assert_eq!(end, 74 * MS);
    let half = d.engine.load(37 * MS);
    assert_eq!((half.waiting, half.running), (1, 2));
    // 148 tokens, less half of the 64 being prefilled.
    assert_eq!(half.queued_prefill_tokens, 148 - 32);
    assert_eq!(half.used_blocks, 10 + 6);
    assert_eq!(half.remaining_decode_tokens, 3 + 2);
    assert_eq!(half.waiting_blocks, 2);
}

#[test]
fn a_waiting_requests_cached_prefix_is_not_queued_prefill_but_takes_free_blocks() {
    let mut config = config(64);
    config.max_num_seqs = 1;
    let mut d = Driver::new(config);
    d.add(1, 40, 1);
    d.run();
    // Request 2 holds the only seat; request 3 repeats request 1's prompt
    // and waits: 36 of its 40 tokens (9 blocks) are cached, but no running
    // request holds them: they are free, and admitting it takes them.
    d.add(2, 8, 5);
    d.step();
    d.add_named(3, 1, 40, 1);
    let load = d.engine.load(d.now);
    assert_eq!(load.waiting, 1);
    assert_eq!(load.queued_prefill_tokens, 4);
    assert_eq!(load.waiting_blocks, 10);
}

#[test]
fn a_held_request_keeps_its_blocks_until_released() {
    let mut d = Driver::new(config(64));
    d.engine
        .add_with(
            1,
            hashes(1, 10),
            42,
            1,
            Transfer {
                hold: true,
                ..Transfer::default()
            },
        )
        .unwrap();
    d.run();
    assert!(d.engine.is_idle());
    assert_eq!(d.engine.held(1).map(<[u32]>::len), Some(11));
    assert_eq!(d.engine.load(d.now).used_blocks, 11, "held, not free");
    assert!(d.engine.release(1));
    assert!(!d.engine.release(1), "released once");
    assert_eq!(d.engine.load(d.now).used_blocks, 0);
    assert_eq!(d.engine.cached_blocks(), 10, "still cached");
}

#[test]
fn loaded_tokens_are_admitted_computed_but_the_last_and_then_cached() {
    let mut d = Driver::new(config(64));
    d.engine
        .add_with(
            1,
            hashes(1, 10),
            40,
            2,
            Transfer {
                loaded_tokens: 40,
                ..Transfer::default()
            },
        )
        .unwrap();
    d.run();
    // One token to compute: a 30 ms step, not 10 ms + 40 ms.
    assert_eq!(d.token_at(1, 0), 30 * MS);
    assert_eq!(
        d.log[0].2,
        Progress::Admitted { cached_tokens: 39 },
        "loaded tokens count as cached"
    );
    assert_eq!(d.engine.counters().hits, 0, "no local hit");
    assert_eq!(d.engine.cached_blocks(), 10, "the loaded blocks are cached");
    // The next request with that prompt hits them locally.
    d.add_named(2, 1, 40, 1);
    d.run();
    assert_eq!(d.engine.counters().hits, 36);
}
