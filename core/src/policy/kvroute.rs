//! `kvroute`, the default policy. Its rule, in words: **an endpoint may
//! answer later than the fastest one by at most the prefill time its cached
//! prefix saves (times `latency_slack`); among those, the longest cached
//! prefix wins, ties by rendezvous rank.**
//!
//! 1. **Predicted time to first token.** For each endpoint: the prefill
//!    queued there (fleet-wide from the engine's load report when it sends
//!    one, else this router's own count) at the pool's prefill rate, plus
//!    this request's own prefill: a fixed overhead and its uncached tokens
//!    at that rate ([`PrefillModel`]). The rate is one for the whole pool:
//!    the median of the rates its engines report, else the configured
//!    default ([`PrefillModel::pool_rate`]). Endpoints that are equally
//!    fast by the pool's model are equal: the noise of each engine's
//!    measured rate, or a new engine not measured yet, never decides a
//!    cold key; equal queues give equal predictions, and rule 4 decides.
//! 2. **Slack earned by saved prefill.** Let F be the endpoint with the
//!    lowest prediction. Another endpoint is eligible when its prediction
//!    exceeds F's by at most `latency_slack × (1 + W / P) × (S + overhead)`:
//!    - S is the prefill time its longer cached prefix saves over F's (0
//!      when it holds no more than F);
//!    - W is the shortest prefill queue in the pool (in seconds) and P this
//!      request's own prefill time at F, so W / P counts the requests like
//!      this one already waiting even where the wait is shortest.
//!
//!    The reason: prefill saved on one endpoint is time every request
//!    queued behind it there gets back. With idle endpoints (W = 0) and a
//!    slack of 1, a request spends at most what it saves the next one in
//!    line (break even); when every endpoint has a queue, about W / P more
//!    requests wait behind it and the saving is worth that much more. Below
//!    one prefill overhead, predictions do not tell endpoints apart. A long
//!    queue is never joined for a short prefix.
//! 3. **Warm first, beyond what is shared.** Among the eligible, the
//!    longest cached prefix wins: from the engines' reported occupancy when
//!    there is an index (exact mode), else from this router's own routing
//!    history. In exact mode a prefix this router sent is counted at its
//!    endpoint until the engine could have reported it ([`InFlight`]):
//!    engines report blocks once computed, and a second request with the
//!    same new prefix, arriving while the first still waits, would
//!    otherwise look cold everywhere and compute it again elsewhere.
//!
//!    A prefix that carries more than two endpoints' share of the traffic
//!    and branches ([`SharedPrefixes`]: a chat template's header, a
//!    preamble or tool list every prompt starts with) is not warmth: every
//!    endpoint counts as holding it, in rules 1 to 3 alike. Every endpoint
//!    that serves any of its requests holds it after the first, so it
//!    must not decide where a new group or conversation lives: that is
//!    rendezvous's (rule 4), and the group's later traffic follows the
//!    prefix of its own that it leaves there. A prefix routing key
//!    ([`Request::key_prefix_blocks`]) is taken from as many blocks past
//!    the shared ones ([`RoutingKey::past_shared`]), so groups behind a
//!    preamble longer than the key still spread.
//! 4. **Cold keys are deterministic.** Equal prefixes (no prefix at all, in
//!    particular) are ordered by the rendezvous score of the routing key, so
//!    every router replica makes the same choice among endpoints that are
//!    equally fast, and a scale-out moves about 1/(N+1) of the keys. The
//!    score is weighted by each endpoint's slow-start ramp
//!    ([`Endpoint::weight`]): a new endpoint's share of cold keys grows
//!    over the window; warm prefixes are not affected.
//! 5. **The rest is the retry order:** the remaining eligible endpoints in
//!    the same order, then the others, fastest first.
//! 6. **The engine has the last word.** Each endpoint is asked to start
//!    the request within the wait predicted there plus
//!    `admission_tolerance_ms`, or refuse it at once with its queue
//!    ([`crate::admission`]); the router then ranks again with that queue.
//!    Router replicas that share a burst's stale report thus stop queueing
//!    behind each other at the endpoint that looked fastest.
//!
//! The wait for KV memory in the predictions counts every block a request
//! takes from the engine's free pool: its cached blocks too, unless a
//! request in flight there holds them ([`crate::load::demand_blocks`]).
//!
//! With a slack of 0 and no shared prefix this is `min-ttft` (lowest
//! prediction; ties to the longest prefix, then rendezvous); with an
//! infinite slack, longest prefix then rendezvous, ignoring load.
//!
//! Tenancy needs nothing here: salted tenants have different keys and
//! different block hashes, so they never share a choice by accident.

use std::time::{Duration, Instant};

use super::in_flight::InFlight;
use super::memory::PrefixMemory;
use super::min_ttft::{Predicted, predict_ttft};
use super::shared::SharedPrefixes;
use super::*;
use crate::load::PrefillModel;

/// Configuration of [`Kvroute`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Seconds of extra predicted latency a request may take per second of
    /// prefill its cached prefix saves (plus one prefill overhead), against
    /// the fastest endpoint, when some endpoint is idle; more when all have
    /// queues (see the module docs). 0: always the fastest; infinite: always
    /// the longest prefix. Default: 1 (break even).
    pub latency_slack: f64,
    /// How prefill time is predicted. Default: [`PrefillModel::default`].
    pub engine: PrefillModel,
    /// Blocks per endpoint remembered in approximate mode; in exact mode,
    /// blocks of prefixes in flight (sent, not yet reported) over all
    /// endpoints; and blocks of recent prompts whose share of the traffic
    /// is counted. Default: 32768.
    pub memory_blocks: usize,
    /// How much longer than predicted an endpoint may make a request wait
    /// before its prefill starts, in milliseconds, before it refuses it
    /// ([`crate::admission`]); engines that do not check ignore it. `null`:
    /// ask for no check. Default: 50.
    pub admission_tolerance_ms: Option<f64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            latency_slack: 1.0,
            engine: PrefillModel::default(),
            memory_blocks: 32768,
            admission_tolerance_ms: Some(50.0),
        }
    }
}

impl Config {
    /// Checks the configuration: a slack of 0 or more (infinity allowed),
    /// and a usable prefill model.
    pub fn validate(&self) -> Result<(), String> {
        if self.latency_slack.is_nan() || self.latency_slack < 0.0 {
            return Err(format!(
                "latencySlack must be 0 or more, got {}",
                self.latency_slack
            ));
        }
        if let Some(t) = self.admission_tolerance_ms
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(format!(
                "admissionToleranceMs must be a number of 0 or more (or null for no check), got {t}"
            ));
        }
        self.engine.validate()
    }
}

/// kvroute's default policy. See the module docs.
#[derive(Clone, Debug)]
pub struct Kvroute {
    config: Config,
    memory: PrefixMemory,
    in_flight: InFlight,
    shared: SharedPrefixes,
    /// Whether the last ranking had an occupancy index.
    exact: bool,
    /// When the last ranking ran, and per endpoint its predictions and
    /// whether only the in-flight memory made it hold more of the prompt
    /// than the index says.
    ranked_at: Option<Instant>,
    predicted_by_slot: Vec<(Slot, Predicted, bool)>,
    by_slot: Vec<u32>,
    indexed: Vec<u32>,
    cached: Vec<u32>,
    /// `cached`, at least the shared depth.
    credited: Vec<u32>,
    scores: Vec<u64>,
    predicted: Vec<Predicted>,
}

impl Kvroute {
    /// A policy with `config`.
    pub fn new(config: Config) -> Self {
        Kvroute {
            memory: PrefixMemory::new(config.memory_blocks),
            in_flight: InFlight::new(config.memory_blocks),
            shared: SharedPrefixes::new(config.memory_blocks),
            config,
            exact: false,
            ranked_at: None,
            predicted_by_slot: Vec::new(),
            by_slot: Vec::new(),
            indexed: Vec::new(),
            cached: Vec::new(),
            credited: Vec::new(),
            scores: Vec::new(),
            predicted: Vec::new(),
        }
    }
}

/// The key `request` is placed by when `depth` leading blocks are shared:
/// a prefix key moves past them ([`RoutingKey::past_shared`]), any other
/// key stays.
fn placement_key(request: &Request<'_>, depth: u32) -> RoutingKey {
    let chain = request.chain;
    let end = request.key_prefix_blocks.map_or(0, |p| {
        (depth as usize).saturating_add(p as usize).min(chain.len())
    });
    if depth == 0 || end <= depth as usize {
        return request.key;
    }
    request.key.past_shared(chain[end - 1])
}

impl Policy for Kvroute {
    fn name(&self) -> &'static str {
        "kvroute"
    }

    /// Past the leading blocks many keys share (rule 3).
    fn placement(&self, request: &Request<'_>, endpoints: usize) -> RoutingKey {
        placement_key(request, self.shared.depth(request.chain, endpoints))
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
            Some(index) => {
                index.longest_prefix(request.chain, &mut self.by_slot);
                per_candidate(&self.by_slot, endpoints, &mut self.indexed);
                self.in_flight.expire(cx.now);
                self.in_flight
                    .extend_prefixes(request.chain, &mut self.by_slot);
            }
            None => self.memory.longest_prefix(request.chain, &mut self.by_slot),
        }
        per_candidate(&self.by_slot, endpoints, &mut self.cached);
        let depth = self.shared.depth(request.chain, n);
        self.credited.clear();
        self.credited
            .extend(self.cached.iter().map(|&c| c.max(depth)));
        scores(placement_key(request, depth), endpoints, &mut self.scores);
        let config = &self.config;
        let rate = config.engine.pool_rate(endpoints.iter().map(|e| &e.load));
        predict_ttft(
            &config.engine,
            rate,
            request,
            endpoints,
            &self.credited,
            cx,
            &mut self.predicted,
        );
        let (cached, scores) = (&self.credited, &self.scores);
        let ttft = |i: usize| self.predicted[i].ttft;
        let fastest = (0..n)
            .min_by(|&a, &b| ttft(a).total_cmp(&ttft(b)))
            .expect("non-empty");
        let uncached = |i: usize| uncached_tokens(request, cached[i], cx.block_tokens);
        let overhead_s = config.engine.prefill_overhead_ms / 1000.0;
        let shortest_queue = self
            .predicted
            .iter()
            .map(|p| p.queued)
            .fold(f64::INFINITY, f64::min);
        // At least a millisecond: a fully cached prompt with no overhead
        // configured takes no prefill at all.
        let own_prefill = config
            .engine
            .prefill_s_at(uncached(fastest), rate)
            .max(1e-3);
        let slack = config.latency_slack * (1.0 + shortest_queue / own_prefill);
        let eligible: Vec<bool> = (0..n)
            .map(|i| {
                let extra = ttft(i) - ttft(fastest);
                let saved = uncached(fastest).saturating_sub(uncached(i));
                let saved_s = saved as f64 / rate;
                // Checked apart: ∞ × 0 is NaN.
                extra <= 0.0 || slack == f64::INFINITY || extra <= slack * (saved_s + overhead_s)
            })
            .collect();
        let eligible = |i: usize| eligible[i];
        let preference = |a: &usize, b: &usize| {
            cached[*b]
                .cmp(&cached[*a])
                .then(scores[*b].cmp(&scores[*a]))
        };
        let mut ranked: Vec<usize> = (0..n).collect();
        ranked.sort_by(|a, b| {
            eligible(*b).cmp(&eligible(*a)).then_with(|| {
                if eligible(*a) {
                    preference(a, b)
                } else {
                    ttft(*a)
                        .total_cmp(&ttft(*b))
                        .then(scores[*b].cmp(&scores[*a]))
                }
            })
        });
        let preferred = (0..n).min_by(preference).expect("non-empty");
        self.ranked_at = Some(cx.now);
        self.predicted_by_slot.clear();
        let (indexed, held) = (&self.indexed, &self.cached);
        self.predicted_by_slot.extend((0..n).map(|i| {
            let followed = self.exact && held[i] > indexed.get(i).copied().unwrap_or(0);
            (endpoints[i].slot, self.predicted[i], followed)
        }));
        let choice = ranked[0];
        let reason = match (choice == preferred, cached[choice] > depth) {
            (false, _) => Reason::Spill,
            (true, true) => Reason::Warm,
            (true, false) => Reason::Cold,
        };
        Decision {
            ranked,
            reason,
            cached_blocks: held[choice],
        }
    }

    fn routed(&mut self, request: &Request<'_>, endpoint: &Endpoint) {
        self.shared.record(request.chain);
        if !self.exact {
            self.memory.record(endpoint.slot, request.chain);
            return;
        }
        // The engine reports the prefix by its first token; the report
        // reaches the index at most a report's age later. A request sent
        // after one still in flight does not renew the claim: an engine
        // that never reports (a broken agent) is followed for one window,
        // not for as long as the prefix keeps coming.
        let Some(&(
            _,
            Predicted {
                ttft: predicted, ..
            },
            followed,
        )) = self
            .predicted_by_slot
            .iter()
            .find(|(slot, ..)| *slot == endpoint.slot)
        else {
            return;
        };
        if let Some(at) = self.ranked_at.filter(|_| !followed) {
            // Never NaN in practice; a bad prediction just remembers less.
            let until = Duration::try_from_secs_f64(predicted.min(3600.0)).unwrap_or_default()
                + Duration::from_millis(self.config.engine.max_report_age_ms);
            self.in_flight
                .record(endpoint.slot, request.chain, at + until);
        }
    }

    fn admit_within(&self, candidate: usize) -> Option<f64> {
        let tolerance_s = self.config.admission_tolerance_ms? / 1000.0;
        Some(self.predicted(candidate)?.queued + tolerance_s)
    }

    fn predicted(&self, candidate: usize) -> Option<Predicted> {
        let (_, predicted, _) = self.predicted_by_slot.get(candidate)?;
        Some(*predicted)
    }

    fn endpoint_removed(&mut self, slot: Slot) {
        self.memory.forget(slot);
        self.in_flight.forget(slot);
    }

    fn boxed_clone(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests;
