//! One replay run: a policy over a trace at N replicas, with the scale-out
//! fork, reduced to the figures `kvroute replay` reports.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::engine as model;
use kvroute_core::keys::RoutingKey;
use kvroute_core::lru::Lru;
use kvroute_core::policy::{PolicyConfig, Reason};
use serde::Serialize;

use super::sim::{Outcome, Sim, admit, leading_hits};
use super::trace::{Trace, TraceRequest};
use super::vllm::VllmSim;

/// How requests get their routing key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// The first K block ids.
    Prefix(usize),
    /// The session id (the prefix of 2 blocks when a request has none).
    Session,
}

/// A prefix key's blocks at most: more than any template and first
/// message, and K plus the shared blocks stays far from overflowing.
const MAX_KEY_BLOCKS: usize = 1024;

impl std::str::FromStr for KeySource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "session" {
            return Ok(KeySource::Session);
        }
        s.strip_prefix('p')
            .and_then(|k| k.parse::<usize>().ok())
            .filter(|k| (1..=MAX_KEY_BLOCKS).contains(k))
            .map(KeySource::Prefix)
            .ok_or_else(|| {
                format!(
                    "expected pK (K from 1 to {MAX_KEY_BLOCKS} leading block ids, e.g. p2) or session, got {s:?}"
                )
            })
    }
}

impl KeySource {
    /// The routing key of `request`, whose first `shared` blocks every
    /// request shares, and for a prefix key the K blocks it spans past
    /// them. A prefix key covers the shared blocks and K blocks more: the
    /// router's prefix key is sized to reach past a template into the first
    /// message, and a key that ended inside the template would be one key for
    /// the whole trace. (The `kvroute` policy moves a prefix key past what it
    /// finds shared by itself; the baselines do not.)
    pub fn key(self, request: &TraceRequest, shared: usize) -> (RoutingKey, Option<u32>) {
        let prefix = |k: usize| {
            let end = (shared + k).min(request.hash_ids.len());
            (
                RoutingKey::prefix_ids(None, &request.hash_ids[..end]),
                Some(k as u32),
            )
        };
        match (self, &request.session_id) {
            (KeySource::Session, Some(session)) => (RoutingKey::conversation(None, session), None),
            (KeySource::Session, None) => prefix(2),
            (KeySource::Prefix(k), _) => prefix(k),
        }
    }
}

/// Policies whose first choice is never skipped for load: `spill` is null.
const NO_SPILL: [&str; 4] = ["round-robin", "least-loaded", "random", "modulo"];

/// One row of results; the JSON keys are an interface.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PolicyResult {
    pub policy: String,
    pub replicas: usize,
    pub routers: usize,
    pub token_hit_rate: f64,
    pub req_max_over_mean: f64,
    pub prefill_max_over_mean: f64,
    pub ttft_mean_s: f64,
    pub ttft_p99_s: f64,
    pub spill: Option<f64>,
    pub keys_moved: f64,
    pub hit_dip: f64,
    /// Requests an engine refused (they can never fit; `--engine vllm`).
    pub refused: usize,
}

/// Hit rate of one cache of `capacity` blocks (None: never evicts) serving
/// the whole trace.
pub fn single_cache_hit(trace: &Trace, capacity: Option<usize>, block_tokens: u64) -> f64 {
    let mut cache = Lru::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in &trace.requests {
        let m = leading_hits(&cache, &r.hash_ids) as u64;
        hit += (m * block_tokens).min(r.input_length);
        total += r.input_length;
        admit(
            &mut cache,
            &r.hash_ids,
            capacity.unwrap_or(usize::MAX),
            |_| {},
            |_| {},
        );
    }
    ratio(hit, total)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn max_over_mean(values: &[u64]) -> f64 {
    let mean = values.iter().sum::<u64>() as f64 / values.len().max(1) as f64;
    let max = values.iter().copied().max().unwrap_or(0) as f64;
    if mean == 0.0 { 1.0 } else { max / mean }
}

/// The nearest-rank percentile `p` (0..=100) of `values`.
fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// The replay parameters shared by every run.
#[derive(Clone, Debug)]
pub struct Setup {
    pub block_tokens: u64,
    pub key: KeySource,
    /// Blocks per replica at each replica count (engine blocks under
    /// `--engine vllm`).
    pub capacity: usize,
    /// Router replicas.
    pub routers: usize,
    /// How late routers learn cache contents and engine load, seconds.
    pub report_lag_s: f64,
    /// The engine model: `None` for the simple one.
    pub vllm: Option<Vllm>,
}

/// `--engine vllm`: the engines' settings (their pool is `capacity`) and
/// every request's engine-block hashes.
#[derive(Clone, Debug)]
pub struct Vllm {
    pub config: model::Config,
    pub hashes: Arc<Vec<Vec<u64>>>,
}

impl Vllm {
    /// The settings and hashes for `trace`.
    pub fn new(trace: &Trace, config: model::Config, block_tokens: u64) -> Self {
        let hashes = trace
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| super::vllm::engine_hashes(r, block_tokens, config.block_size, i as u64))
            .collect();
        Vllm {
            config,
            hashes: Arc::new(hashes),
        }
    }
}

/// The replicas of one run, under either engine model.
#[derive(Clone, Debug)]
enum Replicas {
    /// The simple model knows each outcome at once.
    Simple(Sim, Vec<Option<Outcome>>),
    Vllm(VllmSim),
}

impl Replicas {
    /// Routes request `i` with its key and the trace blocks a prefix key
    /// spans (`block_tokens` tokens each).
    fn route(
        &mut self,
        i: usize,
        request: &TraceRequest,
        (key, blocks): (RoutingKey, Option<u32>),
        block_tokens: u64,
    ) -> (usize, Reason) {
        match self {
            Replicas::Simple(sim, outcomes) => {
                let o = sim.step(request, (key, blocks));
                outcomes[i] = Some(o);
                (o.replica, o.reason)
            }
            Replicas::Vllm(sim) => {
                // The engines' chains are of their own, smaller blocks.
                let per = (block_tokens / sim.block_size().max(1)) as u32;
                sim.route(i, request, (key, blocks.map(|b| b.saturating_mul(per))))
            }
        }
    }

    /// Adds a replica; the requests routed from now on arrive at
    /// `arrivals`.
    fn scale_out(&mut self, arrivals: impl IntoIterator<Item = f64>) {
        match self {
            Replicas::Simple(sim, _) => sim.add_replica(),
            Replicas::Vllm(sim) => {
                sim.add_replica();
                sim.expect(arrivals);
            }
        }
    }

    /// Each request's outcome, by trace position; `None` for those not
    /// routed here or refused.
    fn finish(self) -> (Vec<Option<Outcome>>, usize) {
        match self {
            Replicas::Simple(_, outcomes) => (outcomes, 0),
            Replicas::Vllm(sim) => {
                let refused = sim.refused();
                (sim.finish(), refused)
            }
        }
    }
}

/// Runs `policy` over `trace` at `replicas` replicas. The scale-out fork
/// happens at the middle request: one branch keeps N replicas, the other
/// adds an empty one, and both serve the next 10 % of requests.
pub fn run(trace: &Trace, config: &PolicyConfig, replicas: usize, setup: &Setup) -> PolicyResult {
    let policy = config.build();
    let name = policy.name().to_owned();
    let n = trace.requests.len();
    let arrivals = || trace.requests.iter().map(|r| r.arrival_s);
    let mut sim = match &setup.vllm {
        None => Replicas::Simple(
            Sim::new(
                policy,
                setup.routers,
                setup.report_lag_s,
                replicas,
                setup.capacity,
                setup.block_tokens,
            ),
            vec![None; n],
        ),
        Some(vllm) => Replicas::Vllm(VllmSim::new(
            policy,
            setup.routers,
            setup.report_lag_s,
            replicas,
            model::Config {
                num_blocks: setup.capacity,
                ..vllm.config.clone()
            },
            vllm.hashes.clone(),
            arrivals(),
        )),
    };
    let fork_at = n / 2;
    let window = fork_at..(fork_at + n.div_ceil(10)).min(n);

    let mut spills = 0u64;
    let mut grown: Option<Replicas> = None;
    // Routing key → (replica kept, replica grown), first request in the window.
    let mut first_choices: HashMap<RoutingKey, (usize, usize)> = HashMap::new();
    for (i, request) in trace.requests.iter().enumerate() {
        if i == fork_at {
            let mut fork = sim.clone();
            fork.scale_out(arrivals().skip(window.start).take(window.len()));
            grown = Some(fork);
        }
        let key = setup.key.key(request, trace.shared_blocks);
        let (kept, reason) = sim.route(i, request, key, setup.block_tokens);
        spills += u64::from(reason == Reason::Spill);
        if window.contains(&i) {
            let fork = grown.as_mut().expect("forked at the window's start");
            let (other, _) = fork.route(i, request, key, setup.block_tokens);
            first_choices.entry(key.0).or_insert((kept, other));
        }
    }

    let (outcomes, refused) = sim.finish();
    let grown = grown.map_or_else(|| vec![None; n], |g| g.finish().0);
    let mut requests = vec![0u64; replicas];
    let mut prefill = vec![0u64; replicas];
    let (mut hit, mut total) = (0u64, 0u64);
    let mut ttfts = Vec::with_capacity(n);
    for (o, r) in outcomes.iter().zip(&trace.requests) {
        let Some(o) = o else { continue };
        requests[o.replica] += 1;
        prefill[o.replica] += o.uncached_tokens;
        hit += o.cached_tokens;
        total += r.input_length;
        ttfts.push(o.ttft_s);
    }
    let (mut kept_hit, mut grown_hit, mut window_tokens) = (0u64, 0u64, 0u64);
    for i in window {
        if let (Some(kept), Some(other)) = (outcomes[i], grown[i]) {
            kept_hit += kept.cached_tokens;
            grown_hit += other.cached_tokens;
            window_tokens += trace.requests[i].input_length;
        }
    }

    let moved = first_choices.values().filter(|(a, b)| a != b).count();
    let ttft_mean_s = ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64;
    PolicyResult {
        spill: (!NO_SPILL.contains(&name.as_str())).then(|| spills as f64 / n as f64),
        policy: name,
        replicas,
        routers: setup.routers,
        token_hit_rate: ratio(hit, total),
        req_max_over_mean: max_over_mean(&requests),
        prefill_max_over_mean: max_over_mean(&prefill),
        ttft_mean_s,
        ttft_p99_s: percentile(&mut ttfts, 99.0),
        keys_moved: moved as f64 / first_choices.len().max(1) as f64,
        hit_dip: ratio(kept_hit, window_tokens) - ratio(grown_hit, window_tokens),
        refused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_sources() {
        assert_eq!("p2".parse(), Ok(KeySource::Prefix(2)));
        assert_eq!("session".parse(), Ok(KeySource::Session));
        assert!("p0".parse::<KeySource>().is_err());
        assert!("x".parse::<KeySource>().is_err());
        let r = |ids: Vec<u64>, session: Option<&str>| TraceRequest {
            arrival_s: 0.0,
            input_length: 1,
            output_length: 1,
            hash_ids: ids,
            session_id: session.map(str::to_owned),
        };
        let p2 = KeySource::Prefix(2);
        assert_eq!(
            p2.key(&r(vec![1, 2, 3], None), 0),
            p2.key(&r(vec![1, 2, 4], None), 0)
        );
        assert_ne!(
            p2.key(&r(vec![1, 2, 3], None), 0),
            p2.key(&r(vec![1, 3], None), 0)
        );
        assert_eq!(
            p2.key(&r(vec![1], None), 0).0,
            KeySource::Prefix(1).key(&r(vec![1, 9], None), 0).0
        );
        // A prefix key names its length for the policy; a session key none.
        assert_eq!(p2.key(&r(vec![1], None), 0).1, Some(2));
        let s = KeySource::Session;
        assert_eq!(s.key(&r(vec![1], Some("a")), 0).1, None);
        assert_eq!(
            s.key(&r(vec![1], Some("a")), 0),
            s.key(&r(vec![2], Some("a")), 0)
        );
        assert_eq!(
            s.key(&r(vec![1, 2, 3], None), 0),
            p2.key(&r(vec![1, 2, 9], None), 0)
        );
        // Behind 2 shared blocks, p2 still tells requests apart by their own
        // first two blocks, and the session fallback with it.
        let t = |own: &[u64]| r([&[70, 71], own].concat(), None);
        assert_ne!(p2.key(&t(&[1, 2]), 2), p2.key(&t(&[1, 3]), 2));
        assert_eq!(p2.key(&t(&[1, 2, 3]), 2), p2.key(&t(&[1, 2, 4]), 2));
        assert_eq!(s.key(&t(&[1, 2, 3]), 2), p2.key(&t(&[1, 2, 9]), 2));
        assert_eq!(p2.key(&t(&[]), 2), p2.key(&r(vec![70, 71], None), 0));
    }

    #[test]
    fn percentiles_and_spread() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut v, 100.0), 100.0);
        assert_eq!(percentile(&mut [], 99.0), 0.0);
        assert_eq!(max_over_mean(&[1, 1, 4]), 2.0);
        assert_eq!(max_over_mean(&[0, 0]), 1.0);
    }
}
