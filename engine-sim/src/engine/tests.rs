use std::collections::BTreeSet;

use kvroute_core::hash::{BlockExtras, HashAlgo, Lora};
use kvroute_core::index::{CacheEvent, OccupancyIndex};
use kvroute_core::rng::SplitMix64;
use kvroute_core::slot::Slot;
use proptest::prelude::*;

use super::*;

fn engine(configure: impl FnOnce(&mut Config)) -> Arc<Engine> {
    let mut config = Config::test();
    configure(&mut config);
    Engine::new(config).unwrap()
}

async fn run(
    engine: &Arc<Engine>,
    prompt: Vec<u32>,
    max_tokens: u64,
    salt: Option<&str>,
) -> (u64, Vec<Token>) {
    run_with(engine, prompt, max_tokens, salt, None).await
}

async fn run_with(
    engine: &Arc<Engine>,
    prompt: Vec<u32>,
    max_tokens: u64,
    salt: Option<&str>,
    lora: Option<Lora>,
) -> (u64, Vec<Token>) {
    let mut g = engine
        .generate(Job {
            prompt,
            max_tokens,
            cache_salt: salt.map(str::to_owned),
            lora,
            admit_within_ms: None,
            admit_room_blocks: 0,
            transfer: Default::default(),
        })
        .await
        .unwrap();
    let mut tokens = Vec::new();
    while let Some(t) = g.tokens.recv().await {
        tokens.push(t);
    }
    (g.cached_tokens, tokens)
}

#[tokio::test]
async fn block_hashes_equal_vllm_vectors() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../core/tests/fixtures/vllm_vectors.json"
    ))
    .unwrap();
    let vectors: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    for case in vectors["cases_vllm_0_33_0_tagged"].as_array().unwrap() {
        let lora = case["lora"]
            .as_object()
            .map(|l| Lora::new(l["name"].as_str().unwrap(), l["path"].as_str().unwrap()));
        let tokens: Vec<u32> = vectors["tokens"][case["tokens"].as_str().unwrap()]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let e = engine(|c| {
            c.hash_algo = case["algo"].as_str().unwrap().parse::<HashAlgo>().unwrap();
            c.block_size = case["block_size"].as_u64().unwrap() as u32;
            c.hash_seed = case["pythonhashseed"].as_str().map(str::to_owned);
        });
        // One more token, so every full block of the vector is cached.
        let mut prompt = tokens.clone();
        prompt.push(1);
        run_with(&e, prompt, 1, case["cache_salt"].as_str(), lora).await;
        let resident: BTreeSet<u64> = e.resident().into_iter().collect();
        for h in case["event_block_hashes_u64"].as_array().unwrap() {
            assert!(resident.contains(&h.as_u64().unwrap()), "{case}");
        }
        checked += 1;
    }
    assert_eq!(checked, 120);
}

#[tokio::test]
async fn a_repeated_prompt_hits_its_full_blocks_and_a_salt_isolates() {
    let e = engine(|_| {});
    let prompt: Vec<u32> = (1000..1100).collect(); // 100 tokens = 6 full blocks
    let (first, _) = run(&e, prompt.clone(), 4, None).await;
    assert_eq!(first, 0);
    let (second, _) = run(&e, prompt.clone(), 4, None).await;
    assert_eq!(second, 96);
    let mut extended = prompt[..70].to_vec();
    extended.extend(5000..5050);
    let (shared, _) = run(&e, extended, 4, None).await;
    assert_eq!(shared, 64, "the 4 full blocks of the 70 shared tokens");
    let (salted, _) = run(&e, prompt.clone(), 4, Some("tenant-a")).await;
    assert_eq!(salted, 0);
    let (salted_again, _) = run(&e, prompt, 4, Some("tenant-a")).await;
    assert_eq!(salted_again, 96);
}

#[tokio::test]
async fn output_is_deterministic_per_prompt() {
    let e = engine(|_| {});
    let (_, a) = run(&e, vec![1, 2, 3], 8, None).await;
    let (_, b) = run(&e, vec![1, 2, 3], 8, None).await;
    let (_, c) = run(&e, vec![1, 2, 4], 8, None).await;
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.len(), 8);
    assert!(a[7].last && !a[6].last);
}

#[tokio::test(start_paused = true)]
async fn eviction_under_pressure_takes_tails_first_and_spares_running_requests() {
    // 12 blocks of 4 tokens; steps of 30 ms.
    let e = engine(|c| {
        c.block_size = 4;
        c.num_gpu_blocks = 12;
        c.itl_ms = 30.0;
    });
    let a: Vec<u32> = (100..113).collect(); // 3 full blocks + 1 token
    run(&e, a.clone(), 1, None).await;
    let a_hashes = e.hasher().hashes(&a, BlockExtras::default());
    // A running request holds A's first block: it reuses it, and decodes
    // three more tokens after its first.
    let mut held = e
        .generate(Job {
            prompt: a[..5].to_vec(),
            max_tokens: 4,
            cache_salt: None,
            lora: None,
            admit_within_ms: None,
            admit_room_blocks: 0,
            transfer: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(held.cached_tokens, 4);
    held.tokens.recv().await.unwrap();
    // 8 never-used blocks, then A's, freed tail first. The held request
    // took one unused block; a 9-block request takes the other 7, A's
    // partial block and evicts A's block 2, never the pinned block 0.
    let b: Vec<u32> = (200..236).collect();
    run(&e, b, 1, None).await;
    let resident: BTreeSet<u64> = e.resident().into_iter().collect();
    assert!(
        resident.contains(&a_hashes[0]),
        "pinned by the running request"
    );
    assert!(!resident.contains(&a_hashes[2]), "the tail went first");
    assert!(
        resident.contains(&a_hashes[1]),
        "the head outlives the tail"
    );
    assert!(held.tokens.recv().await.is_some(), "still running");
}

#[tokio::test]
async fn rejects_what_can_never_run() {
    let e = engine(|c| {
        c.max_model_len = 100;
        c.num_gpu_blocks = 4;
    });
    let err = e
        .generate(Job {
            prompt: vec![1; 90],
            max_tokens: 20,
            cache_salt: None,
            lora: None,
            admit_within_ms: None,
            admit_room_blocks: 0,
            transfer: Default::default(),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::TooLong { requested: 110, .. }));
    let err = e
        .generate(Job {
            prompt: vec![1; 70],
            max_tokens: 10,
            cache_salt: None,
            lora: None,
            admit_within_ms: None,
            admit_room_blocks: 0,
            transfer: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        err,
        EngineError::TooLarge {
            needed: 5,
            capacity: 4
        }
    );
    assert_eq!(
        e.generate(Job {
            prompt: vec![],
            max_tokens: 1,
            cache_salt: None,
            lora: None,
            admit_within_ms: None,
            admit_room_blocks: 0,
            transfer: Default::default(),
        })
        .await
        .unwrap_err(),
        EngineError::EmptyPrompt
    );
}

/// A WatchCache subscriber in miniature: applies messages to an index,
/// checking incarnation and sequence, resubscribing when the stream ends.
struct Mirror {
    index: OccupancyIndex,
    rx: mpsc::Receiver<feed::Message>,
    position: Option<(String, u64)>,
    resyncs: u32,
}

impl Mirror {
    fn new(engine: &Engine) -> Self {
        Mirror {
            index: OccupancyIndex::new(),
            rx: engine.subscribe().unwrap(),
            position: None,
            resyncs: 0,
        }
    }

    fn apply(&mut self, m: feed::Message, capacity: usize) {
        let slot = Slot(0);
        let update = m.update.as_ref().expect("always set");
        if let Update::Snapshot(snapshot) = update {
            self.index
                .apply(
                    slot,
                    CacheEvent::Snapshot {
                        capacity,
                        blocks: &snapshot.block_hashes,
                    },
                )
                .unwrap();
            self.position = Some((m.incarnation.clone(), m.sequence));
            return;
        }
        let (incarnation, last) = self.position.clone().expect("a snapshot comes first");
        assert_eq!(incarnation, m.incarnation);
        let event = match update {
            Update::Load(_) => {
                assert_eq!(m.sequence, last, "a load report does not advance");
                return;
            }
            Update::Stored(s) => CacheEvent::Stored(&s.block_hashes),
            Update::Removed(r) => CacheEvent::Removed(&r.block_hashes),
            Update::Cleared(_) => CacheEvent::Cleared,
            Update::Snapshot(_) => unreachable!(),
        };
        assert_eq!(m.sequence, last + 1, "no gap");
        self.index.apply(slot, event).unwrap();
        self.position = Some((incarnation, m.sequence));
    }

    /// Applies whatever is queued; resubscribes if the stream ended.
    fn drain(&mut self, engine: &Engine) {
        let capacity = engine.config().num_gpu_blocks as usize;
        loop {
            match self.rx.try_recv() {
                Ok(m) => self.apply(m, capacity),
                Err(mpsc::error::TryRecvError::Empty) => return,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.index.remove_endpoint(Slot(0));
                    self.rx = engine.subscribe().unwrap();
                    self.position = None;
                    self.resyncs += 1;
                }
            }
        }
    }

    fn resident(&self) -> BTreeSet<u64> {
        self.index.blocks_of(Slot(0)).collect()
    }
}

async fn workload(seed: u64) {
    let e = engine(|c| {
        c.block_size = 4;
        c.num_gpu_blocks = 96;
        c.subscriber_buffer = 8; // small, so the slow subscriber overflows
        c.max_num_seqs = 8;
    });
    let mut mirror = Mirror::new(&e);
    let mut rng = SplitMix64::new(seed); // reproducible workloads
    let prefixes: Vec<Vec<u32>> = (0..12)
        .map(|p| {
            (0..(4 + rng.next_u64() % 30))
                .map(|t| (p * 1000 + t) as u32)
                .collect()
        })
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..2500u64 {
        let mut prompt = prefixes[(rng.next_u64() % 12) as usize].clone();
        let extra = rng.next_u64() % 12;
        prompt.extend((0..extra).map(|t| (50_000 + rng.next_u64() % 7 + t) as u32));
        let max_tokens = 1 + rng.next_u64() % 9;
        let salt = rng.next_u64().is_multiple_of(5).then(|| "s".to_owned());
        let e2 = e.clone();
        tasks.spawn(async move {
            let mut g = e2
                .generate(Job {
                    prompt,
                    max_tokens,
                    cache_salt: salt,
                    lora: None,
                    admit_within_ms: None,
                    admit_room_blocks: 0,
                    transfer: Default::default(),
                })
                .await
                .unwrap();
            while g.tokens.recv().await.is_some() {}
        });
        if tasks.len() >= 16 {
            tasks.join_next().await;
        }
        // The subscriber keeps up most of the time, and sometimes not.
        if !rng.next_u64().is_multiple_of(50) {
            mirror.drain(&e);
        }
        if i == 1200 {
            e.restart_cache();
        }
        if i.is_multiple_of(400) {
            e.report_load();
        }
    }
    while tasks.join_next().await.is_some() {}
    mirror.drain(&e);
    e.report_load();
    mirror.drain(&e);
    let engine_resident: BTreeSet<u64> = e.resident().into_iter().collect();
    assert_eq!(mirror.resident(), engine_resident, "seed {seed}");
    assert!(
        mirror.resyncs >= 2,
        "the restart and at least one overflow force resyncs"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]
    /// After thousands of random requests, with a cache restart and slow
    /// moments that overflow the subscriber's buffer, a subscriber that
    /// applies the stream to the core index holds exactly the engine's
    /// resident set.
    #[test]
    fn a_subscriber_mirrors_the_cache(seed in any::<u64>()) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(workload(seed));
    }
}

#[tokio::test(start_paused = true)]
async fn load_reports_the_prefill_still_queued_and_the_rate() {
    let e = engine(|c| {
        c.prefill_tokens_per_s = 1000.0;
        c.prefill_overhead_ms = 0.0;
        c.max_num_seqs = 1;
    });
    for (first, len) in [(1u32, 2000u32), (100_000, 500)] {
        let e = e.clone();
        tokio::spawn(async move { run(&e, (first..first + len).collect(), 1, None).await });
        tokio::task::yield_now().await;
    }
    let load = |e: &Arc<Engine>| e.load(&e.lock());
    let now = load(&e);
    assert_eq!((now.running, now.waiting), (1, 1));
    assert_eq!(now.queued_prefill_tokens, 2000 + 500, "all of A, all of B");
    assert_eq!(now.prefill_tokens_per_s, Some(1000.0));
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(
        load(&e).queued_prefill_tokens,
        1500 + 500,
        "A is a quarter done"
    );
    tokio::time::advance(Duration::from_millis(1600)).await;
    tokio::task::yield_now().await;
    let later = load(&e);
    assert!(later.queued_prefill_tokens <= 500, "{later:?}");
    let instant = engine(|c| c.prefill_tokens_per_s = 0.0);
    assert_eq!(load(&instant).prefill_tokens_per_s, None);
}

#[tokio::test(start_paused = true)]
async fn load_reports_the_memory_a_wait_is_predicted_from() {
    let e = engine(|c| {
        c.block_size = 4;
        c.num_gpu_blocks = 10;
        c.itl_ms = 30.0;
    });
    let mut a = e
        .generate(Job {
            prompt: (1..9).collect(),
            max_tokens: 5,
            cache_salt: None,
            lora: None,
            admit_within_ms: None,
            admit_room_blocks: 0,
            transfer: Default::default(),
        })
        .await
        .unwrap();
    a.tokens.recv().await.unwrap();
    // B's 40 tokens need all 10 blocks: it waits for A to finish.
    let b = e.clone();
    tokio::spawn(async move { run(&b, (100..140).collect(), 1, None).await });
    let load = loop {
        let load = e.load(&e.lock());
        if load.waiting == 1 {
            break load;
        }
        tokio::task::yield_now().await;
    };
    // A holds its 2 prompt blocks and a third for its output; 4 of its 5
    // tokens are still to come, 30 ms each.
    assert_eq!(load.running, 1);
    assert_eq!((load.free_blocks, load.waiting_blocks), (7, 10));
    assert!((load.remaining_decode_s - 0.12).abs() < 1e-9, "{load:?}");
    // B, once it runs, holds its blocks for its one token.
    assert!((load.waiting_decode_s - 0.03).abs() < 1e-9, "{load:?}");
    let proto = load.to_proto();
    assert_eq!(
        (proto.free_blocks, proto.waiting_blocks, proto.preemptions),
        (Some(7), Some(10), Some(0))
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_bounded_below_the_queue_is_refused_with_it() {
    let e = engine(|c| {
        c.prefill_tokens_per_s = 1000.0;
        c.prefill_overhead_ms = 0.0;
    });
    let job = |first: u32, admit_within_ms| Job {
        prompt: (first..first + 2000).collect(),
        max_tokens: 1,
        cache_salt: None,
        lora: None,
        admit_within_ms,
        admit_room_blocks: 0,
        transfer: Default::default(),
    };
    // Idle: any bound is met.
    let _a = e.generate(job(1, Some(0))).await.unwrap();
    // Two seconds of A queued ahead: a bound of 1.5 s is refused, with
    // the queue; 2.5 s is met; no bound is never refused.
    let refused = e.generate(job(10_000, Some(1500))).await.unwrap_err();
    let EngineError::Busy {
        bound_ms: 1500,
        load,
        ..
    } = refused
    else {
        panic!("{refused:?}");
    };
    assert_eq!((load.queued_prefill_tokens, load.waiting), (2000, 0));
    assert!(refused.to_string().contains("1500 ms"), "{refused}");
    assert!(e.generate(job(20_000, Some(2500))).await.is_ok());
    assert!(e.generate(job(30_000, None)).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_request_whose_blocks_are_not_free_is_refused_with_the_memory() {
    let e = engine(|c| {
        c.block_size = 4;
        c.num_gpu_blocks = 10;
        c.itl_ms = 30.0;
    });
    let job = |prompt: std::ops::Range<u32>, admit_within_ms| Job {
        prompt: prompt.collect(),
        max_tokens: 5,
        cache_salt: None,
        lora: None,
        admit_within_ms,
        admit_room_blocks: 0,
        transfer: Default::default(),
    };
    // A runs, holding 3 of the 10 blocks; nothing is queued for prefill.
    let mut a = e.generate(job(1..9, None)).await.unwrap();
    a.tokens.recv().await.unwrap();
    // B's 32 tokens take 8 blocks: it would wait for A's decode.
    let refused = e.generate(job(100..132, Some(50))).await.unwrap_err();
    let EngineError::Busy {
        blocks: 8, load, ..
    } = refused
    else {
        panic!("{refused:?}");
    };
    assert_eq!((load.free_blocks, load.running), (7, 1));
    assert!(refused.to_string().contains("7 KV blocks free of the 8"));
    // A prompt of 7 blocks whose first 2 are A's takes 5: they are free.
    let shared: Vec<u32> = (1..9).chain(100..120).collect();
    let admitted = e
        .generate(Job {
            prompt: shared,
            ..job(0..0, Some(50))
        })
        .await;
    assert!(admitted.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_take_the_room_asked_for_is_refused() {
    let e = engine(|c| {
        c.block_size = 4;
        c.num_gpu_blocks = 10;
        c.itl_ms = 30.0;
    });
    let job = |prompt: std::ops::Range<u32>, admit_room_blocks| Job {
        prompt: prompt.collect(),
        max_tokens: 5,
        cache_salt: None,
        lora: None,
        admit_within_ms: Some(50),
        admit_room_blocks,
        transfer: Default::default(),
    };
    // A runs, holding 3 of the 10 blocks.
    let mut a = e.generate(job(1..9, 0)).await.unwrap();
    a.tokens.recv().await.unwrap();
    // B's 20 tokens take 5 of the 7 free: leaving 3 more does not fit,
    // leaving 2 does.
    let refused = e.generate(job(100..120, 3)).await.unwrap_err();
    assert!(
        matches!(refused, EngineError::Busy { blocks: 8, .. }),
        "{refused:?}"
    );
    assert!(e.generate(job(100..120, 2)).await.is_ok());
}
