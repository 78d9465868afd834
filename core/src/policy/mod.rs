//! Routing policies: given a request and the candidate endpoints, a ranked
//! list (first = the choice, the rest = the retry order) and a reason.
//!
//! One policy per file, each with a `Config` whose `Default` is documented.
//! `kvroute` is the default; the others are the baselines it is measured
//! against in `kvroute replay`, and they run the same code in the router.
//!
//! Policies see only what is passed in: candidates (already filtered to
//! ready, non-draining, non-ejected endpoints) with their load, the request's
//! routing key and block-hash chain, and for exact cache-aware routing the
//! pool's occupancy index. They never do I/O.

mod approx_prefix;
mod exact_prefix_load;
mod in_flight;
mod kvroute;
mod least_loaded;
pub mod memory;
mod min_ttft;
mod modulo;
mod parameters;
mod random;
mod rendezvous;
mod rendezvous_bounded;
mod round_robin;
mod shared;

use std::time::Instant;

use serde::{Deserialize, Deserializer, Serialize};

use crate::hash::BlockHash;
use crate::index::OccupancyIndex;
use crate::keys::RoutingKey;
use crate::load::Load;
use crate::pinned::Pinned;
use crate::slot::Slot;

pub use approx_prefix::{ApproxPrefix, Config as ApproxPrefixConfig};
pub use exact_prefix_load::{Config as ExactPrefixLoadConfig, ExactPrefixLoad};
pub use kvroute::{Config as KvrouteConfig, Kvroute};
pub use least_loaded::LeastLoaded;
pub use min_ttft::{Config as MinTtftConfig, MinTtft, Predicted};
pub use modulo::Modulo;
pub use parameters::PolicyParameters;
pub use random::{Config as RandomConfig, Random};
pub use rendezvous::Rendezvous;
pub use rendezvous_bounded::{Config as RendezvousBoundedConfig, RendezvousBounded};
pub use round_robin::RoundRobin;

/// A candidate endpoint as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Endpoint {
    /// The endpoint's slot in the pool (index and load are by slot).
    pub slot: Slot,
    /// Its rendezvous identity ([`crate::rendezvous::endpoint_id`]).
    pub id: u64,
    /// Its current load.
    pub load: Load,
    /// Its share of new keys, 0 to 1: 1, less while it ramps up after
    /// becoming ready ([`crate::slow_start`]). Cold keys and ties are ranked
    /// by the weighted rendezvous score ([`scores`]); warm prefixes ignore
    /// it. The caller computes it for the moment of the decision.
    pub weight: f64,
}

/// What a policy knows about a request.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The routing key.
    pub key: RoutingKey,
    /// The prompt's block-hash chain (full blocks only).
    pub chain: &'a [BlockHash],
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// When `key` was made from the prompt's first tokens
    /// ([`crate::keys::KeyMode::Prefix`]): how many blocks they span.
    /// The `kvroute` policy then takes the key from as many blocks past
    /// what many keys share ([`RoutingKey::past_shared`]).
    pub key_prefix_blocks: Option<u32>,
    /// The most tokens it may generate (`max_tokens`), 0 when unknown:
    /// KV blocks it takes as it decodes.
    pub output_tokens: u64,
}

/// Pool-wide facts a policy may use.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    /// The engines' reported occupancy, when they report it (exact mode).
    /// `None` in approximate mode.
    pub index: Option<&'a OccupancyIndex>,
    /// Tokens per block of `Request::chain`.
    pub block_tokens: u64,
    /// The time of the decision: engine load reports age against it.
    pub now: Instant,
    /// Blocks held by this router's requests in flight, per endpoint.
    pub pinned: Option<&'a Pinned>,
}

/// Why the first endpoint was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// It holds the longest known cached prefix of the request.
    Warm,
    /// No preference from any cache: the policy's plain first choice.
    Cold,
    /// The policy's preferred endpoint was over its load bound; this is the
    /// next one.
    Spill,
}

impl Reason {
    /// The reason as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Warm => "warm",
            Reason::Cold => "cold",
            Reason::Spill => "spill",
        }
    }
}

/// A policy's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Positions into the candidate slice, best first: a permutation of all
    /// candidates. Empty only when there were no candidates.
    pub ranked: Vec<usize>,
    /// Why `ranked[0]` was chosen.
    pub reason: Reason,
    /// Leading blocks of the request the policy believes `ranked[0]` holds.
    pub cached_blocks: u32,
}

impl Decision {
    fn cold(ranked: Vec<usize>) -> Self {
        Decision {
            ranked,
            reason: Reason::Cold,
            cached_blocks: 0,
        }
    }

    /// A ranking by a cost that weighs cached prefixes (`cached`, by
    /// candidate): warm when the first choice holds the longest prefix any
    /// candidate holds, cold when none holds any, else a spill.
    fn by_cost(ranked: Vec<usize>, cached: &[u32]) -> Self {
        let best_cached = cached.iter().copied().max().unwrap_or(0);
        let cached_blocks = ranked.first().map_or(0, |&i| cached[i]);
        let reason = if best_cached == 0 {
            Reason::Cold
        } else if cached_blocks == best_cached {
            Reason::Warm
        } else {
            Reason::Spill
        };
        Decision {
            ranked,
            reason,
            cached_blocks,
        }
    }
}

/// A routing policy. Router, replay and tests drive it the same way: `rank`
/// for each request, `routed` once the request was actually sent (perhaps to
/// a retry endpoint), `endpoint_removed` when an endpoint leaves the pool.
pub trait Policy: Send + std::fmt::Debug {
    /// The policy's name, as in configuration.
    fn name(&self) -> &'static str;

    /// Ranks `endpoints` for `request`. Must not panic on any input,
    /// including no endpoints.
    fn rank(&mut self, request: &Request<'_>, endpoints: &[Endpoint], cx: &Context<'_>)
    -> Decision;

    /// The request was sent to `endpoint`. Policies with memory learn here.
    fn routed(&mut self, _request: &Request<'_>, _endpoint: &Endpoint) {}

    /// How long the candidate at position `candidate` of the last ranking
    /// may make that request wait before its prefill starts, in seconds,
    /// before it should refuse it ([`crate::admission`]). `None`: no bound
    /// (the default).
    fn admit_within(&self, _candidate: usize) -> Option<f64> {
        None
    }

    /// What the last [`rank`](Self::rank) predicted for its request at
    /// `candidate` (a position in that call's candidates): the wait before
    /// its prefill starts and its time to first token. `None` when the
    /// policy predicts none (the default).
    fn predicted(&self, _candidate: usize) -> Option<Predicted> {
        None
    }

    /// The key a cold `request` is placed by among `endpoints` endpoints
    /// (their rendezvous order): its own, unless the policy moves it.
    fn placement(&self, request: &Request<'_>, _endpoints: usize) -> RoutingKey {
        request.key
    }

    /// `slot` left the pool; forget it.
    fn endpoint_removed(&mut self, _slot: Slot) {}

    /// A copy of the policy with its state (the replay benchmark forks runs).
    fn boxed_clone(&self) -> Box<dyn Policy>;
}

/// A policy by name with its configuration, as written in YAML:
/// `{name: kvroute, loadBound: 0.25}` or just `{name: round-robin}`. A
/// parameter the policy does not have is an error naming it, also on the
/// policies that have none (`{name: round-robin, slack: 2}`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "name", rename_all = "kebab-case")]
pub enum PolicyConfig {
    /// Each endpoint in turn.
    RoundRobin,
    /// Fewest requests in flight.
    LeastLoaded,
    /// Uniformly at random, from a seed.
    Random(RandomConfig),
    /// `key mod N` over the candidates in the order given.
    Modulo,
    /// Rendezvous hash of the key, ignoring load.
    Rendezvous,
    /// Rendezvous hash of the key, skipping endpoints over a bound on
    /// in-flight requests.
    RendezvousBounded(RendezvousBoundedConfig),
    /// Longest prefix from the router's own routing history, SGLang style.
    ApproxPrefix(ApproxPrefixConfig),
    /// Longest reported prefix with a load penalty, Dynamo and llm-d style.
    ExactPrefixLoad(ExactPrefixLoadConfig),
    /// Lowest predicted time to first token.
    MinTtft(MinTtftConfig),
    /// kvroute's default: warm first among the endpoints whose predicted
    /// time to first token is within a slack of the best; rendezvous for
    /// cold keys.
    Kvroute(KvrouteConfig),
}

/// [`PolicyConfig`] as read: the same variants, the parameter-less ones as
/// empty structs, because serde ignores every other field of an internally
/// tagged unit variant and so would take `slack` on round robin silently.
#[derive(Deserialize)]
#[serde(tag = "name", rename_all = "kebab-case", deny_unknown_fields)]
enum Written {
    RoundRobin {},
    LeastLoaded {},
    Random(RandomConfig),
    Modulo {},
    Rendezvous {},
    RendezvousBounded(RendezvousBoundedConfig),
    ApproxPrefix(ApproxPrefixConfig),
    ExactPrefixLoad(ExactPrefixLoadConfig),
    MinTtft(MinTtftConfig),
    Kvroute(KvrouteConfig),
}

impl<'de> Deserialize<'de> for PolicyConfig {
    /// Reads the map inside the deserializer's own `visit_map`, so that a
    /// format that tracks where it is (YAML) names the policy's field in
    /// the error (`routing.policy: unknown field `slack``). A derived
    /// internally tagged enum buffers the map first and fails after the
    /// format has left the field.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = PolicyConfig;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a policy: {name: <policy>, <parameter>: <value>, ...}")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<PolicyConfig, A::Error> {
                let mut fields = serde_json::Map::new();
                while let Some((key, value)) = map.next_entry::<String, serde_json::Value>()? {
                    fields.insert(key, value);
                }
                Written::deserialize(serde_json::Value::Object(fields))
                    .map(PolicyConfig::from)
                    .map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_map(Fields)
    }
}

impl From<Written> for PolicyConfig {
    fn from(w: Written) -> Self {
        match w {
            Written::RoundRobin {} => PolicyConfig::RoundRobin,
            Written::LeastLoaded {} => PolicyConfig::LeastLoaded,
            Written::Random(c) => PolicyConfig::Random(c),
            Written::Modulo {} => PolicyConfig::Modulo,
            Written::Rendezvous {} => PolicyConfig::Rendezvous,
            Written::RendezvousBounded(c) => PolicyConfig::RendezvousBounded(c),
            Written::ApproxPrefix(c) => PolicyConfig::ApproxPrefix(c),
            Written::ExactPrefixLoad(c) => PolicyConfig::ExactPrefixLoad(c),
            Written::MinTtft(c) => PolicyConfig::MinTtft(c),
            Written::Kvroute(c) => PolicyConfig::Kvroute(c),
        }
    }
}

impl Default for PolicyConfig {
    /// `kvroute` with its defaults ([`KvrouteConfig`]).
    fn default() -> Self {
        PolicyConfig::Kvroute(KvrouteConfig::default())
    }
}

impl PolicyConfig {
    /// Every policy name, in the order they are listed to users (the
    /// default is [`PolicyConfig::default`]'s, whatever its place here).
    pub const NAMES: [&'static str; 10] = [
        "kvroute",
        "round-robin",
        "least-loaded",
        "random",
        "modulo",
        "rendezvous",
        "rendezvous-bounded",
        "approx-prefix",
        "exact-prefix-load",
        "min-ttft",
    ];

    /// The policy `name` with its default configuration.
    pub fn by_name(name: &str) -> Option<Self> {
        Some(match name {
            "kvroute" => PolicyConfig::Kvroute(Default::default()),
            "round-robin" => PolicyConfig::RoundRobin,
            "least-loaded" => PolicyConfig::LeastLoaded,
            "random" => PolicyConfig::Random(Default::default()),
            "modulo" => PolicyConfig::Modulo,
            "rendezvous" => PolicyConfig::Rendezvous,
            "rendezvous-bounded" => PolicyConfig::RendezvousBounded(Default::default()),
            "approx-prefix" => PolicyConfig::ApproxPrefix(Default::default()),
            "exact-prefix-load" => PolicyConfig::ExactPrefixLoad(Default::default()),
            "min-ttft" => PolicyConfig::MinTtft(Default::default()),
            _ => return None,
        })
    }

    /// Checks what types cannot (the time-denominated policies need a
    /// usable prefill model and slack).
    pub fn validate(&self) -> Result<(), String> {
        match self {
            PolicyConfig::Kvroute(c) => c.validate(),
            PolicyConfig::MinTtft(c) => c.engine.validate(),
            _ => Ok(()),
        }
    }

    /// The `kvroute` policy's `admissionToleranceMs`; `None` for the
    /// others.
    pub fn admission_tolerance_ms(&self) -> Option<f64> {
        match self {
            PolicyConfig::Kvroute(c) => c.admission_tolerance_ms,
            _ => None,
        }
    }

    /// The `kvroute` policy's `latencySlack`; `None` for the others.
    pub fn latency_slack(&self) -> Option<f64> {
        match self {
            PolicyConfig::Kvroute(c) => Some(c.latency_slack),
            _ => None,
        }
    }

    /// How this policy predicts prefill time; the default model for
    /// policies that do not (for status and metrics).
    pub fn prefill_model(&self) -> crate::load::PrefillModel {
        match self {
            PolicyConfig::Kvroute(c) => c.engine.clone(),
            PolicyConfig::MinTtft(c) => c.engine.clone(),
            _ => crate::load::PrefillModel::default(),
        }
    }

    /// Whether the policy reads the request (its routing key, chain or
    /// prompt length). Round robin, least loaded and random rank endpoints
    /// without it, so the router need not tokenize prompts for them.
    pub fn reads_request(&self) -> bool {
        !matches!(
            self,
            PolicyConfig::RoundRobin | PolicyConfig::LeastLoaded | PolicyConfig::Random(_)
        )
    }

    /// Whether the policy reads a request's chain, in exact mode, only as
    /// far as engines hold its blocks, so the router may stop hashing it
    /// past a block no engine holds. The approximate-prefix baseline
    /// remembers whole chains of its own.
    pub fn reads_held_prefix_only(&self) -> bool {
        !matches!(self, PolicyConfig::ApproxPrefix(_))
    }

    /// A fresh policy.
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyConfig::RoundRobin => Box::new(RoundRobin::default()),
            PolicyConfig::LeastLoaded => Box::new(LeastLoaded::default()),
            PolicyConfig::Random(c) => Box::new(Random::new(c.clone())),
            PolicyConfig::Modulo => Box::new(Modulo),
            PolicyConfig::Rendezvous => Box::new(Rendezvous::default()),
            PolicyConfig::RendezvousBounded(c) => Box::new(RendezvousBounded::new(c.clone())),
            PolicyConfig::ApproxPrefix(c) => Box::new(ApproxPrefix::new(c.clone())),
            PolicyConfig::ExactPrefixLoad(c) => Box::new(ExactPrefixLoad::new(c.clone())),
            PolicyConfig::MinTtft(c) => Box::new(MinTtft::new(c.clone())),
            PolicyConfig::Kvroute(c) => Box::new(Kvroute::new(c.clone())),
        }
    }
}

/// Rendezvous scores of `endpoints` for `key`, by candidate position,
/// weighted by each endpoint's [`Endpoint::weight`]: higher wins. With
/// every weight 1 (no endpoint ramping up) the plain scores, so the order
/// is exactly the unweighted one; else the IEEE bits of the weighted
/// scores ([`crate::rendezvous::weighted_score`], never negative, so the
/// bits order as the values do), in which a ramping endpoint is first for
/// its share of keys and the others keep their order among themselves.
fn scores(key: RoutingKey, endpoints: &[Endpoint], out: &mut Vec<u64>) {
    use crate::rendezvous::{score, weighted_score};
    out.clear();
    let plain = endpoints.iter().map(|e| score(key.0, e.id));
    if endpoints.iter().all(|e| e.weight >= 1.0) {
        out.extend(plain);
    } else {
        let weights = endpoints.iter().map(|e| e.weight);
        out.extend(
            plain
                .zip(weights)
                .map(|(s, w)| weighted_score(s, w).to_bits()),
        );
    }
}

/// `request`'s leading blocks each candidate holds per the engines' index,
/// into `out` (all 0 in approximate mode); `by_slot` is scratch space.
fn indexed_prefixes(
    request: &Request<'_>,
    endpoints: &[Endpoint],
    cx: &Context<'_>,
    by_slot: &mut Vec<u32>,
    out: &mut Vec<u32>,
) {
    match cx.index {
        Some(index) => index.longest_prefix(request.chain, by_slot),
        None => by_slot.clear(),
    }
    per_candidate(by_slot, endpoints, out);
}

/// `chain`'s cached leading blocks per candidate, from `by_slot` (indexed by
/// slot, as the index fills it).
fn per_candidate(by_slot: &[u32], endpoints: &[Endpoint], out: &mut Vec<u32>) {
    out.clear();
    out.extend(
        endpoints
            .iter()
            .map(|e| by_slot.get(e.slot.index()).copied().unwrap_or(0)),
    );
}

/// Uncached prompt tokens when `cached_blocks` leading blocks are cached.
fn uncached_tokens(request: &Request<'_>, cached_blocks: u32, block_tokens: u64) -> u64 {
    let cached = u64::from(cached_blocks).saturating_mul(block_tokens);
    request.prompt_tokens.saturating_sub(cached)
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests;
