//! engine-sim publishing vLLM's ZMQ events → the agent → a WatchCache
//! subscriber applying the stream to kvroute-core's index: the subscriber
//! ends with exactly the sim's resident set, across a gap replay fills, a
//! gap it cannot fill, and an engine restart.

use std::time::Duration;

use kvroute_agent::Agent;
use kvroute_core::index::{CacheEvent, OccupancyIndex};
use kvroute_core::slot::Slot;
use kvroute_engine_sim::Sim;
use kvroute_engine_sim::engine::Job;
use kvroute_engine_sim::kv_events::Fault;
use kvroute_proto::v1::cache_reporter_client::CacheReporterClient;
use kvroute_proto::v1::{CacheUpdate, WatchCacheRequest, cache_update::Update};
use kvroute_proto::{SequenceCheck, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use tonic::Streaming;

const BLOCK_SIZE: usize = 4;

/// A sim publishing vLLM's KV events (configured by `sim`, and with a
/// replay socket when `replay`) and an agent following it (configured by
/// `agent`).
async fn sim_and_agent(
    replay: bool,
    sim: impl FnOnce(&mut kvroute_engine_sim::Config),
    agent: impl FnOnce(&mut kvroute_agent::Config),
) -> (Sim, Agent) {
    let mut config = kvroute_engine_sim::Config::test();
    config.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
    config.kv_events_replay_endpoint = replay.then(|| "tcp://127.0.0.1:0".into());
    sim(&mut config);
    let sim = kvroute_engine_sim::start(config).await.unwrap();
    let (events, replay) = sim.kv_events.as_ref().unwrap().bound.clone();
    let mut config = kvroute_agent::Config::loopback(events, format!("http://{}", sim.http_addr));
    config.kv_events_replay_endpoint = replay;
    agent(&mut config);
    let agent = kvroute_agent::start(config).await.unwrap();
    (sim, agent)
}

async fn stack(replay: bool) -> (Sim, Agent) {
    let (sim, agent) = sim_and_agent(
        replay,
        |c| {
            c.block_size = BLOCK_SIZE as u32;
            c.num_gpu_blocks = 64;
        },
        |c| c.block_size = BLOCK_SIZE as u32,
    )
    .await;
    ready(&agent).await;
    (sim, agent)
}

async fn ready(agent: &Agent) {
    for _ in 0..500 {
        if agent.ranks[0].not_ready().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("not ready: {:?}", agent.ranks[0].not_ready());
}

async fn generate(sim: &Sim, prompt: Vec<u32>) {
    let job = Job {
        prompt,
        max_tokens: 3,
        cache_salt: None,
        lora: None,
        admit_within_ms: None,
        admit_room_blocks: 0,
        transfer: Default::default(),
    };
    let mut g = sim.engine.generate(job).await.unwrap();
    while g.tokens.recv().await.is_some() {}
}

/// A subscriber that mirrors the agent's stream in an index, resyncing as
/// the protocol says.
struct Mirror {
    addr: std::net::SocketAddr,
    stream: Streaming<CacheUpdate>,
    check: SequenceCheck,
    index: OccupancyIndex,
    incarnations: Vec<String>,
}

async fn subscribe(addr: std::net::SocketAddr) -> Streaming<CacheUpdate> {
    let mut client = CacheReporterClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    client
        .watch_cache(WatchCacheRequest {
            subscriber: "test".into(),
        })
        .await
        .unwrap()
        .into_inner()
}

impl Mirror {
    async fn new(agent: &Agent) -> Self {
        let addr = agent.cache_addrs[0];
        Mirror {
            addr,
            stream: subscribe(addr).await,
            check: SequenceCheck::new(),
            index: OccupancyIndex::new(),
            incarnations: Vec::new(),
        }
    }

    fn apply(&mut self, u: &CacheUpdate) -> bool {
        if let Verdict::Resync(_) = self.check.observe(u) {
            return false;
        }
        let slot = Slot(0);
        let event = match u.update.as_ref().unwrap() {
            Update::Snapshot(s) => {
                if self.incarnations.last() != Some(&u.incarnation) {
                    self.incarnations.push(u.incarnation.clone());
                }
                CacheEvent::Snapshot {
                    capacity: s.config.as_ref().unwrap().capacity_blocks as usize,
                    blocks: &s.block_hashes,
                }
            }
            Update::Stored(s) => CacheEvent::Stored(&s.block_hashes),
            Update::Removed(r) => CacheEvent::Removed(&r.block_hashes),
            Update::Cleared(_) => CacheEvent::Cleared,
            Update::Load(_) => return true,
        };
        self.index.apply(slot, event).is_ok()
    }

    fn blocks(&self) -> Vec<u64> {
        let mut b: Vec<u64> = self.index.blocks_of(Slot(0)).collect();
        b.sort_unstable();
        b
    }

    /// Reads until no change comes for 300 ms (load reports keep coming).
    async fn settle(&mut self) {
        let mut quiet_since = tokio::time::Instant::now();
        while quiet_since.elapsed() < Duration::from_millis(300) {
            let Ok(next) =
                tokio::time::timeout(Duration::from_millis(300), self.stream.message()).await
            else {
                return;
            };
            match next {
                Ok(Some(u)) if self.apply(&u) => {
                    if !matches!(u.update, Some(Update::Load(_))) {
                        quiet_since = tokio::time::Instant::now();
                    }
                }
                _ => {
                    self.index.remove_endpoint(Slot(0));
                    self.check = SequenceCheck::new();
                    self.stream = subscribe(self.addr).await;
                }
            }
        }
    }

    /// Reads until the mirror holds exactly the sim's resident set.
    async fn converge(&mut self, sim: &Sim) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mut want = sim.engine.resident();
            want.sort_unstable();
            if self.blocks() == want {
                return;
            }
            let next = tokio::time::timeout_at(deadline, self.stream.message()).await;
            let Ok(next) = next else {
                panic!("no convergence: mirror {:?}, sim {want:?}", self.blocks());
            };
            match next {
                Ok(Some(u)) if self.apply(&u) => {}
                _ => {
                    // Ended or broke the rules: start over from a snapshot.
                    self.index.remove_endpoint(Slot(0));
                    self.check = SequenceCheck::new();
                    self.stream = subscribe(self.addr).await;
                }
            }
        }
    }
}

/// The sum of `family`'s samples whose `kind` label is `kind`, read with
/// the agent's own exposition parser.
fn counter(text: &str, family: &str, kind: &str) -> u64 {
    text.lines()
        .filter_map(kvroute_telemetry::metrics::parse_line)
        .filter(|s| s.name == family && s.label("kind") == Some(kind))
        .map(|s| s.value as u64)
        .sum()
}

async fn agent_metrics(agent: &Agent) -> String {
    reqwest::get(format!("http://{}/metrics", agent.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Prompts that share prefixes: `root` picks one of a few 2-block roots,
/// `tail` the rest.
fn prompts() -> impl Strategy<Value = Vec<(u8, Vec<u32>)>> {
    prop::collection::vec((0u8..4, prop::collection::vec(1u32..500, 1..20)), 10..30)
}

async fn run(sim: &Sim, workload: &[(u8, Vec<u32>)]) {
    for (root, tail) in workload {
        let mut prompt: Vec<u32> = (0..2 * BLOCK_SIZE as u32)
            .map(|t| t + 1000 * u32::from(*root))
            .collect();
        prompt.extend(tail);
        generate(sim, prompt).await;
    }
}

#[test]
fn a_randomized_workload_ends_with_the_sims_set_across_gaps_and_restarts() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut runner = TestRunner::new(RunnerConfig {
        cases: 4,
        max_shrink_iters: 0,
        ..RunnerConfig::default()
    });
    runner
        .run(
            &(prompts(), prompts(), prompts(), prompts()),
            |(a, b, c, d)| {
                rt.block_on(async {
                    let (sim, agent) = stack(true).await;
                    let publisher = sim.kv_events.clone().unwrap();
                    let mut mirror = Mirror::new(&agent).await;
                    run(&sim, &a).await;
                    mirror.converge(&sim).await;

                    // Batches missing from the live stream: replay fills them.
                    let first = agent.ranks[0].position().0;
                    publisher.inject(Fault::SkipLive(3));
                    run(&sim, &b).await;
                    mirror.converge(&sim).await;
                    assert_eq!(agent.ranks[0].position().0, first, "same incarnation");

                    // Batches lost for good: a new incarnation from an empty set,
                    // which never claims a block the sim lacks, and converges as
                    // the sim's cache turns over.
                    publisher.inject(Fault::Lose(2));
                    run(&sim, &c).await;
                    run(&sim, &d).await;
                    mirror.settle().await;
                    let held = sim.engine.resident();
                    let stale: Vec<u64> = mirror
                        .blocks()
                        .into_iter()
                        .filter(|b| !held.contains(b))
                        .collect();
                    assert!(
                        stale.is_empty(),
                        "the mirror claims evicted blocks {stale:?}"
                    );
                    // 64 blocks turn over completely under fresh prompts.
                    let fresh: Vec<(u8, Vec<u32>)> = (0..40u32)
                        .map(|i| (9, (0..12).map(|t| 5000 + i * 16 + t).collect()))
                        .collect();
                    run(&sim, &fresh).await;
                    mirror.converge(&sim).await;

                    // The engine restarts: numbering starts over.
                    sim.engine.restart_cache();
                    run(&sim, &a).await;
                    mirror.converge(&sim).await;

                    let text = agent_metrics(&agent).await;
                    assert!(
                        counter(&text, "kvroute_agent_replays_total", "filled") >= 1,
                        "{text}"
                    );
                    assert!(
                        counter(&text, "kvroute_agent_replays_total", "unfillable") >= 1,
                        "{text}"
                    );
                    assert!(
                        counter(&text, "kvroute_agent_restarts_total", "sequence reset") >= 1,
                        "{text}"
                    );
                    assert_eq!(
                        counter(
                            &text,
                            "kvroute_agent_hash_verification_blocks_total",
                            "mismatch"
                        ),
                        0
                    );
                    assert!(
                        counter(
                            &text,
                            "kvroute_agent_hash_verification_blocks_total",
                            "match"
                        ) > 0
                    );
                    agent.shutdown().await;
                    sim.shutdown().await;
                });
                Ok(())
            },
        )
        .unwrap();
}

#[tokio::test]
async fn a_block_size_other_than_vllms_stops_serving_with_a_clear_error() {
    // The agent is told 16, vLLM's default; the engine runs 4.
    let (sim, agent) = sim_and_agent(false, |c| c.block_size = 4, |_| {}).await;
    let readyz = || async {
        let r = reqwest::get(format!("http://{}/readyz", agent.admin_addr))
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    kvroute_testkit::eventually(
        "/readyz refuses the engine's block_size 4",
        Duration::from_secs(5),
        || async {
            let (status, body) = readyz().await;
            (status == 503 && body.contains("block_size 4")).then_some(())
        },
    )
    .await;
    let (status, body) = readyz().await;
    assert_eq!(status, 503);
    assert!(body.contains("--block-size 16"), "{body}");
    let mut client = CacheReporterClient::connect(format!("http://{}", agent.cache_addrs[0]))
        .await
        .unwrap();
    let err = client
        .watch_cache(WatchCacheRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("block_size 4"), "{}", err.message());
    agent.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sims_prefill_figures_reach_subscribers_as_load() {
    let (sim, agent) = sim_and_agent(
        false,
        |c| {
            c.prefill_tokens_per_s = 50_000.0;
            c.prefill_overhead_ms = 1.0;
        },
        |_| {},
    )
    .await;
    ready(&agent).await;
    let mut stream = subscribe(agent.cache_addrs[0]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut round = 0u32;
    let load = loop {
        // Fresh prompts keep the prefill counters growing between scrapes.
        generate(&sim, (0..400).map(|t| t + 1000 * round).collect()).await;
        round += 1;
        let next = tokio::time::timeout_at(deadline, stream.message())
            .await
            .expect("prefill figures within 10 s")
            .unwrap()
            .unwrap();
        if let Some(Update::Load(l)) = next.update
            && l.prefill_tokens_per_s.is_some()
            && l.queued_prefill_tokens.is_some()
        {
            break l;
        }
    };
    let rate = load.prefill_tokens_per_s.unwrap();
    // 400 uncached tokens in 1 ms + 8 ms: about 44,000 tokens/s.
    assert!(rate > 20_000.0 && rate <= 50_000.0, "{rate}");
    agent.shutdown().await;
    sim.shutdown().await;
}
