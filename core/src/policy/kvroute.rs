//! `kvroute`, the default policy. Its rules, in order:
//!
//! 1. **Bounded work.** An endpoint is over the bound when its estimated
//!    queued work exceeds `(1 + load_bound) × mean + headroom_tokens`, or its
//!    in-flight requests reach `(1 + request_bound) × mean +
//!    headroom_requests`. Endpoints under the bound come first; one over it
//!    is never chosen while another is under it. The headroom keeps a lightly
//!    loaded pool from spilling a warm prefix for nothing.
//! 2. **Warm first.** Among those under the bound, the longest cached prefix
//!    wins: from the engines' reported occupancy when there is an index
//!    (exact mode), else from this router's own routing history.
//! 3. **Cold keys are deterministic.** Equal prefixes (no prefix at all, in
//!    particular) are ordered by the rendezvous score of the routing key, so
//!    every router replica makes the same choice and a scale-out moves about
//!    1/(N+1) of the keys.
//! 4. **The rest is the retry order:** the remaining endpoints under the
//!    bound in the same order, then those over it, least work first.
//!
//! Tenancy needs nothing here: salted tenants have different keys and
//! different block hashes, so they never share a choice by accident.

use super::memory::PrefixMemory;
use super::*;
use crate::load::WorkModel;

/// Configuration of [`Kvroute`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// ε of the work bound `(1 + ε) × mean work + headroom_tokens`.
    /// Default: 0.5.
    pub load_bound: f64,
    /// Absolute headroom of the work bound, in prompt tokens. Default: 4096
    /// (about 0.4 s of prefill at 10,000 tokens per second): below that, a
    /// queue is not worth losing a cached prefix for.
    pub headroom_tokens: u64,
    /// ε of the in-flight bound `(1 + ε) × mean in flight +
    /// headroom_requests`. Default: 0.25.
    pub request_bound: f64,
    /// Absolute headroom of the in-flight bound, in requests. Default: 2.
    pub headroom_requests: u32,
    /// How load becomes work. Default: [`WorkModel::default`].
    pub work: WorkModel,
    /// Blocks per endpoint remembered in approximate mode. Default: 32768.
    pub memory_blocks: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            load_bound: 0.5,
            headroom_tokens: 4096,
            request_bound: 0.25,
            headroom_requests: 2,
            work: WorkModel::default(),
            memory_blocks: 32768,
        }
    }
}

/// kvroute's default policy. See the module docs.
#[derive(Clone, Debug)]
pub struct Kvroute {
    config: Config,
    memory: PrefixMemory,
    /// Whether the last ranking had an occupancy index.
    exact: bool,
    by_slot: Vec<u32>,
    cached: Vec<u32>,
    scores: Vec<u64>,
    work: Vec<u64>,
}

impl Kvroute {
    /// A policy with `config`.
    pub fn new(config: Config) -> Self {
        Kvroute {
            memory: PrefixMemory::new(config.memory_blocks),
            config,
            exact: false,
            by_slot: Vec::new(),
            cached: Vec::new(),
            scores: Vec::new(),
            work: Vec::new(),
        }
    }
}

impl Policy for Kvroute {
    fn name(&self) -> &'static str {
        "kvroute"
    }

    fn rank(
        &mut self,
        request: &Request<'_>,
        endpoints: &[Endpoint],
        cx: &Context<'_>,
    ) -> Decision {
        let n = endpoints.len();
        if n == 0 {
            return Decision::cold(Vec::new());
        }
        self.exact = cx.index.is_some();
        match cx.index {
            Some(index) => index.longest_prefix(request.chain, &mut self.by_slot),
            None => self.memory.longest_prefix(request.chain, &mut self.by_slot),
        }
        per_candidate(&self.by_slot, endpoints, &mut self.cached);
        scores(request.key, endpoints, &mut self.scores);
        self.work.clear();
        self.work
            .extend(endpoints.iter().map(|e| self.config.work.work(&e.load)));

        let c = &self.config;
        let mean_work = self.work.iter().sum::<u64>() as f64 / n as f64;
        let work_bound = (1.0 + c.load_bound) * mean_work + c.headroom_tokens as f64;
        let in_flight: u64 = endpoints.iter().map(|e| u64::from(e.load.in_flight)).sum();
        let request_bound =
            (1.0 + c.request_bound) * in_flight as f64 / n as f64 + f64::from(c.headroom_requests);
        let over: Vec<bool> = (0..n)
            .map(|i| {
                self.work[i] as f64 > work_bound
                    || f64::from(endpoints[i].load.in_flight) >= request_bound
            })
            .collect();

        let (cached, scores, work) = (&self.cached, &self.scores, &self.work);
        let preference = |a: &usize, b: &usize| {
            cached[*b]
                .cmp(&cached[*a])
                .then(scores[*b].cmp(&scores[*a]))
        };
        let mut ranked: Vec<usize> = (0..n).collect();
        ranked.sort_by(|a, b| {
            over[*a].cmp(&over[*b]).then_with(|| {
                if over[*a] {
                    work[*a].cmp(&work[*b]).then(scores[*b].cmp(&scores[*a]))
                } else {
                    preference(a, b)
                }
            })
        });
        let preferred = (0..n).min_by(preference).expect("non-empty");
        let choice = ranked[0];
        let reason = match (choice == preferred, cached[choice] > 0) {
            (false, _) => Reason::Spill,
            (true, true) => Reason::Warm,
            (true, false) => Reason::Cold,
        };
        Decision {
            ranked,
            reason,
            cached_blocks: cached[choice],
        }
    }

    fn routed(&mut self, request: &Request<'_>, endpoint: &Endpoint) {
        // Exact mode learns from the engines; remembering would only cost.
        if !self.exact {
            self.memory.record(endpoint.slot, request.chain);
        }
    }

    fn endpoint_removed(&mut self, slot: Slot) {
        self.memory.forget(slot);
    }

    fn boxed_clone(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests;
