//! One pool's routing state: its endpoints and their health, the occupancy
//! index fed by WatchCache, each engine's contract, load accounting, and
//! the routing settings with the policy they name. Discovery replaces the
//! endpoint set and the settings; cache watchers apply engine updates; the
//! proxy asks for a ranked plan and reports outcomes.
//!
//! The pool runs no tasks: a change that needs WatchCache streams started
//! or stopped returns them as [`Streams`], and discovery, which owns the
//! watcher tasks ([`Watchers`]), runs them.
//!
//! Everything sits behind one mutex, held for microseconds: a routing
//! decision, an applied update, a counter change. No I/O happens under it.
//! Work that grows with an engine's cache is done in steps that release it
//! in between: a snapshot is applied [`SNAPSHOT_CHUNK`] blocks at a time,
//! and a forgotten endpoint's entries go one index shard at a time (hidden
//! from routing at once).

pub mod cache_watch;
pub mod health_checks;
pub mod outliers;

pub use cache_watch::Watchers;
pub use outliers::{Event, Fault, Restore};

use kvroute_core::contract::{Contract, EngineCache, Mismatch};
use kvroute_core::hash::BlockHash;
use kvroute_core::index::{Bounds, CacheEvent, IndexError, OccupancyIndex, Tier};
use kvroute_core::load::{EngineLoad, LoadTracker, Ticket};
use kvroute_core::policy::{Context, Endpoint, LeastLoaded, Policy, Reason, Request};
use kvroute_core::rendezvous::endpoint_id;
use kvroute_core::slot::{Slot, Slots};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{Notify, watch};

use self::outliers::Outlier;
use crate::config::Resilience;
use crate::explain::{Explained, ExplainedEndpoint};
use crate::settings::Settings;

/// Blocks of a snapshot applied under one hold of the lock: about a
/// millisecond of work, so routing never waits longer for a snapshot.
pub const SNAPSHOT_CHUNK: usize = 8192;

/// The clock the health state machine is given: tokio's, so tests can
/// pause it.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// An endpoint as discovery describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    /// Stable name (rendezvous hashing uses it), e.g. `pod-a:8000`.
    pub name: String,
    /// Where its HTTP API is.
    pub http: SocketAddr,
    /// Where its WatchCache stream is, if it reports its cache.
    pub cache: Option<SocketAddr>,
    /// Ready to serve.
    pub ready: bool,
    /// Terminating: no new requests.
    pub draining: bool,
}

/// A WatchCache stream's state, for metrics and debugging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamState {
    /// The endpoint reports no cache.
    None,
    /// Connecting or waiting to reconnect; its entries are dropped.
    Connecting,
    /// Snapshot applied, deltas flowing.
    Live,
}

impl StreamState {
    /// As a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            StreamState::None => "none",
            StreamState::Connecting => "connecting",
            StreamState::Live => "live",
        }
    }
}

#[derive(Debug)]
struct Member {
    spec: EndpointSpec,
    /// `spec.name`, shared by the targets of every plan.
    name: Arc<str>,
    slot: Slot,
    id: u64,
    stream: StreamState,
    /// Distinguishes this member's watcher from an older one of the same
    /// name.
    generation: u64,
    /// The cache settings of its last snapshot.
    engine: Option<EngineCache>,
    /// Those checked against the routing settings; a mismatched engine
    /// gets no cache credit (its updates are not indexed).
    contract: Contract,
}

/// One endpoint in a routing plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Its name.
    pub name: Arc<str>,
    /// Its HTTP address.
    pub http: SocketAddr,
    /// Its slot.
    pub slot: Slot,
    /// Its rendezvous identity.
    pub id: u64,
}

/// Where a request should go, in order.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Endpoints under their concurrency limit, best first.
    pub targets: Vec<Target>,
    /// Routable endpoints that were at their limit.
    pub full: usize,
    /// The policy's reason for the first.
    pub reason: Reason,
    /// Leading blocks the policy believes the first holds.
    pub cached_blocks: u32,
}

/// The WatchCache streams a change starts and stops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Streams {
    /// Streams to start, each replacing any stream of the same endpoint.
    pub start: Vec<Stream>,
    /// Endpoints whose stream stops.
    pub stop: Vec<String>,
}

/// One WatchCache stream: pool member `(name, generation)`'s, at `addr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stream {
    /// The endpoint's name.
    pub name: String,
    /// Its generation: updates from an older one are ignored.
    pub generation: u64,
    /// Its WatchCache address.
    pub addr: SocketAddr,
}

/// What a step of outlier detection changed: ejections, refused
/// ejections and restorations, in order. The pool neither logs nor counts
/// them; its caller does, once each.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use = "the caller logs and counts the health events"]
pub struct HealthEvents(Vec<Event>);

impl HealthEvents {
    /// Whether one of them is an ejection.
    pub fn ejected(&self) -> bool {
        self.0.iter().any(|e| matches!(e, Event::Ejected { .. }))
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The events, in order.
    pub fn iter(&self) -> std::slice::Iter<'_, Event> {
        self.0.iter()
    }
}

impl IntoIterator for HealthEvents {
    type Item = Event;
    type IntoIter = std::vec::IntoIter<Event>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

#[derive(Debug)]
struct Inner {
    members: BTreeMap<String, Member>,
    slots: Slots,
    index: OccupancyIndex,
    load: LoadTracker,
    /// The routing settings; `policy` is built from `settings.policy`.
    settings: Arc<Settings>,
    policy: Box<dyn Policy>,
    outlier: Outlier,
    /// For requests without a readable prompt.
    least_loaded: LeastLoaded,
    generations: u64,
    /// Whether any endpoint reports its cache: routing is then exact.
    exact: bool,
}

/// A pool. See the module docs.
pub struct Pool {
    inner: Mutex<Inner>,
    concurrency: u32,
    ready: watch::Sender<usize>,
    /// Signalled whenever a request ends, for requests queued on full
    /// endpoints.
    released: Notify,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").finish_non_exhaustive()
    }
}

/// One tier of the occupancy index, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierStats {
    /// The tier.
    pub tier: Tier,
    /// (block, endpoint) entries in it.
    pub entries: usize,
    /// Blocks dropped from it to stay within the per-endpoint bound, ever.
    pub dropped: u64,
}

/// A snapshot of one endpoint, for metrics and `/debug/pool`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EndpointStatus {
    /// Name.
    pub name: String,
    /// HTTP address.
    pub http: String,
    /// Ready per discovery.
    pub ready: bool,
    /// Draining per discovery.
    pub draining: bool,
    /// Ejected for failures right now.
    pub ejected: bool,
    /// WatchCache stream state.
    pub stream: &'static str,
    /// Requests in flight.
    pub in_flight: u32,
    /// Outstanding prefill tokens (this router's requests).
    pub prefill_tokens: u64,
    /// Predicted prefill queue, seconds: how long a new request would wait
    /// before its prefill starts, fleet-wide when the engine reports load.
    pub queue_seconds: f64,
    /// Age of the engine's last load report, seconds; `None` before one.
    pub load_report_age_seconds: Option<f64>,
    /// Blocks the index holds for it.
    pub cached_blocks: usize,
    /// Its engine contract: `unknown`, `match` or `mismatch`.
    pub contract: &'static str,
    /// The fields on which its engine differs from the routing settings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub contract_mismatches: Vec<Mismatch>,
}

impl Pool {
    /// An empty pool.
    pub fn new(settings: Settings, resilience: &Resilience, concurrency: u32) -> Arc<Self> {
        let outlier = Outlier::new(outliers::Config {
            eject_after_failures: resilience.eject_after_failures,
            base: std::time::Duration::from_millis(resilience.ejection_base_ms),
            max: std::time::Duration::from_millis(resilience.ejection_max_ms),
            max_ejected_percent: resilience.max_ejected_percent,
            unhealthy_threshold: resilience
                .health_check
                .as_ref()
                .map_or(u32::MAX, |c| c.unhealthy_threshold),
        });
        let mut index = OccupancyIndex::new();
        index.set_offload_weight(settings.offload_weight);
        Arc::new(Pool {
            inner: Mutex::new(Inner {
                members: BTreeMap::new(),
                slots: Slots::default(),
                index,
                load: LoadTracker::new(),
                policy: settings.policy.build(),
                settings: Arc::new(settings),
                outlier,
                least_loaded: LeastLoaded::default(),
                generations: 0,
                exact: false,
            }),
            concurrency,
            ready: watch::channel(0).0,
            released: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bounds what one endpoint can make the index hold, per tier (the
    /// router's `limits`); unbounded until set.
    pub fn set_index_bounds(&self, bounds: Bounds) {
        self.lock().index.set_bounds(bounds);
    }

    /// Forgets the entries of removed endpoints one index shard at a time,
    /// releasing the lock in between.
    fn finish_removals(&self) {
        while self.lock().index.remove_step() {}
    }

    /// Routable endpoints as of the last change; watch it to wait for
    /// readiness.
    pub fn ready(&self) -> watch::Receiver<usize> {
        self.ready.subscribe()
    }

    /// Routable endpoints right now (ejections expire on their own).
    pub fn routable(&self) -> usize {
        let inner = self.lock();
        let now = now();
        inner
            .members
            .values()
            .filter(|m| inner.is_routable(m, now))
            .count()
    }

    /// The routing settings now.
    pub fn settings(&self) -> Arc<Settings> {
        self.lock().settings.clone()
    }

    /// The routing settings, and whether routing is exact (some endpoint
    /// reports its cache; else approximate: the router's own memory of
    /// where prefixes went), under one lock.
    pub fn routing(&self) -> (Arc<Settings>, bool) {
        let inner = self.lock();
        (inner.settings.clone(), inner.exact)
    }

    /// Whether any engine reports holding `block` (exact mode's index).
    pub fn holds_any(&self, block: BlockHash) -> bool {
        self.lock().index.holds_any(block)
    }

    /// Replaces the routing settings with `f(current)`, all at once. A new
    /// policy starts without the old one's learned state (the index is
    /// kept); every engine's contract is checked again: one that no longer
    /// matches loses its entries, one that matches again resubscribes for
    /// a fresh snapshot (returned in [`Streams::start`]).
    pub fn update_settings(&self, f: impl FnOnce(&Settings) -> Settings) -> Streams {
        let mut inner = self.lock();
        let settings = Arc::new(f(&inner.settings));
        if settings.policy != inner.settings.policy {
            inner.policy = settings.policy.build();
        }
        inner.index.set_offload_weight(settings.offload_weight);
        inner.settings = settings;
        let names: Vec<String> = inner.members.keys().cloned().collect();
        let mut changes = Vec::new();
        let mut streams = Streams::default();
        for name in names {
            let Some(m) = inner.members.get(&name) else {
                continue;
            };
            let Some(engine) = m.engine.clone() else {
                continue;
            };
            let was = m.contract.clone();
            let now = Contract::check(&engine, &inner.settings.hasher);
            if now == was {
                continue;
            }
            if now == Contract::Match {
                // Its updates were not indexed: start over from a snapshot.
                streams.start.extend(restart_stream(&mut inner, &name));
            } else {
                let slot = m.slot;
                inner.index.begin_remove_endpoint(slot);
                if let Some(m) = inner.members.get_mut(&name) {
                    m.contract = now.clone();
                }
            }
            changes.push((name, now));
        }
        drop(inner);
        self.finish_removals();
        for (name, contract) in changes {
            log_contract(&name, &contract);
        }
        streams
    }

    /// Replaces the endpoint set: new endpoints get a slot (and a stream,
    /// in [`Streams::start`]), changed ones are updated, missing ones are
    /// forgotten everywhere (their streams in [`Streams::stop`]).
    pub fn set_endpoints(&self, specs: Vec<EndpointSpec>) -> Streams {
        let mut inner = self.lock();
        let mut streams = Streams::default();
        let wanted: BTreeMap<String, EndpointSpec> =
            specs.into_iter().map(|s| (s.name.clone(), s)).collect();
        let gone: Vec<String> = inner
            .members
            .keys()
            .filter(|n| !wanted.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            self.forget(&mut inner, &name);
            streams.stop.push(name);
        }
        for (name, spec) in wanted {
            // Same addresses: only readiness changed. Else (re)start it.
            match inner.members.get_mut(&name) {
                Some(m) if m.spec.cache == spec.cache && m.spec.http == spec.http => {
                    m.spec = spec;
                    continue;
                }
                Some(_) => {
                    self.forget(&mut inner, &name);
                    streams.stop.push(name.clone());
                }
                None => {}
            }
            let slot = inner.slots.assign(&name);
            inner.generations += 1;
            let generation = inner.generations;
            if let Some(addr) = spec.cache {
                streams.start.push(Stream {
                    name: name.clone(),
                    generation,
                    addr,
                });
            }
            let stream = if spec.cache.is_some() {
                StreamState::Connecting
            } else {
                StreamState::None
            };
            inner.members.insert(
                name.clone(),
                Member {
                    id: endpoint_id(&name),
                    name: name.as_str().into(),
                    spec,
                    slot,
                    stream,
                    generation,
                    engine: None,
                    contract: Contract::Unknown,
                },
            );
        }
        inner.exact = inner.members.values().any(|m| m.spec.cache.is_some());
        let Inner {
            members, outlier, ..
        } = &mut *inner;
        outlier.set_endpoints(members.keys().map(String::as_str));
        self.publish_ready(&inner);
        drop(inner);
        self.finish_removals();
        streams
    }

    fn forget(&self, inner: &mut Inner, name: &str) {
        if let Some(m) = inner.members.remove(name) {
            // Its entries go in steps once the lock is released.
            inner.index.begin_remove_endpoint(m.slot);
            inner.load.remove(m.slot);
            inner.policy.endpoint_removed(m.slot);
            inner.slots.release(name);
        }
    }

    fn publish_ready(&self, inner: &Inner) {
        let now = now();
        let n = inner
            .members
            .values()
            .filter(|m| inner.is_routable(m, now))
            .count();
        self.ready
            .send_if_modified(|r| std::mem::replace(r, n) != n);
    }

    /// Ranks the routable endpoints for `request`. Endpoints at their
    /// concurrency limit are left out of the targets (and counted in
    /// `full`).
    /// `readable` is false when the router could not read a prompt from the
    /// request: it then goes to the least loaded endpoint instead.
    pub fn plan(&self, request: &Request<'_>, readable: bool) -> Plan {
        self.plan_among(request, readable, &|_| true)
    }

    /// [`plan`](Self::plan) among the endpoints whose HTTP address
    /// `among` accepts (a gateway's subset hint).
    pub fn plan_among(
        &self,
        request: &Request<'_>,
        readable: bool,
        among: &dyn Fn(&SocketAddr) -> bool,
    ) -> Plan {
        let mut inner = self.lock();
        let now = now();
        let (endpoints, candidates) = inner.candidates(now, among);
        let inner = &mut *inner;
        // Field by field: the policy is borrowed mutably beside it.
        let cx = Context {
            index: inner.exact.then_some(&inner.index),
            block_tokens: inner.settings.hasher.config().block_size as u64,
            now,
        };
        let decision = if readable {
            inner.policy.rank(request, &endpoints, &cx)
        } else {
            inner.least_loaded.rank(request, &endpoints, &cx)
        };
        let mut full = 0;
        let targets = decision
            .ranked
            .iter()
            .filter(|&&i| {
                let under = endpoints[i].load.in_flight < self.concurrency;
                full += usize::from(!under);
                under
            })
            .map(|&i| candidates[i].clone())
            .collect();
        Plan {
            targets,
            full,
            reason: decision.reason,
            cached_blocks: decision.cached_blocks,
        }
    }

    /// What [`plan`](Self::plan) would decide for `request`, with every
    /// endpoint's view of it, changing nothing: the policy decides on a
    /// copy of itself.
    pub fn explain(&self, request: &Request<'_>, readable: bool) -> Explained {
        let inner = self.lock();
        let now = now();
        let prefill = inner.settings.policy.prefill_model();
        let block_tokens = inner.settings.hasher.config().block_size as u64;
        let cx = Context {
            index: inner.exact.then_some(&inner.index),
            block_tokens,
            now,
        };
        let mut leading = Vec::new();
        if inner.exact {
            inner.index.longest_prefix(request.chain, &mut leading);
        }
        let (endpoints, targets) = inner.candidates(now, &|_| true);
        let mut policy = if readable {
            inner.policy.boxed_clone()
        } else {
            inner.least_loaded.boxed_clone()
        };
        let decision = policy.rank(request, &endpoints, &cx);
        // The policies compare every routable endpoint at one rate.
        let rate = prefill.pool_rate(endpoints.iter().map(|e| &e.load));
        let ranked = decision
            .ranked
            .iter()
            .map(|&i| targets[i].name.to_string())
            .collect();
        let explained_endpoints = inner
            .members
            .values()
            .map(|m| {
                let load = inner.load.load(m.slot);
                let cached = leading.get(m.slot.index()).copied().unwrap_or(0);
                let uncached = request
                    .prompt_tokens
                    .saturating_sub(u64::from(cached) * block_tokens);
                let blocks = uncached.div_ceil(block_tokens.max(1));
                let queued = prefill.queued_s_at(&load, now, rate);
                let memory = prefill.memory_wait_s(&load, blocks, block_tokens, now);
                ExplainedEndpoint {
                    name: m.spec.name.clone(),
                    routable: inner.is_routable(m, now),
                    full: load.in_flight >= self.concurrency,
                    contract: m.contract.as_str().to_owned(),
                    cached_blocks: cached,
                    in_flight: load.in_flight,
                    queue_seconds: queued,
                    memory_wait_seconds: memory,
                    predicted_ttft_seconds: queued.max(memory)
                        + prefill.prefill_s_at(uncached, rate),
                }
            })
            .collect();
        Explained {
            policy: policy.name().to_owned(),
            reason: if readable {
                decision.reason.as_str()
            } else {
                "unreadable"
            }
            .to_owned(),
            cached_blocks: decision.cached_blocks,
            ranked,
            prefill_tokens_per_second: rate,
            endpoints: explained_endpoints,
        }
    }

    /// Counts a request sent to `target` and lets the policy learn it.
    /// The count ends when the returned guard is dropped, however the
    /// request ends: completion, error, client disconnect, stream reset or
    /// timeout.
    pub fn start(
        self: &Arc<Self>,
        request: &Request<'_>,
        target: &Target,
        uncached_tokens: u64,
    ) -> InFlight {
        // One lock for all: this is the request path.
        let mut inner = self.lock();
        inner.learn(request, target);
        let ticket = inner
            .load
            .start(target.slot, request.prompt_tokens, uncached_tokens);
        let trial = inner.outlier.begin(&target.name, now());
        drop(inner);
        let mut load = self.in_flight(ticket);
        if trial {
            load.trial = Some(target.name.clone());
        }
        load
    }

    /// The predicted time to first token at `target` for a request with
    /// `uncached_tokens` to prefill there, by the policy's prefill model
    /// over the endpoint's load now (before the request is counted).
    pub fn predicted_ttft(&self, target: &Target, uncached_tokens: u64) -> std::time::Duration {
        let inner = self.lock();
        let load = inner.load.load(target.slot);
        let block_tokens = inner.settings.hasher.config().block_size as u64;
        let s = inner.settings.policy.prefill_model().ttft_s(
            &load,
            uncached_tokens,
            block_tokens,
            now(),
        );
        std::time::Duration::try_from_secs_f64(s).unwrap_or(std::time::Duration::MAX)
    }

    /// Lets the policy learn that `target` serves `request` (approximate
    /// mode remembers where prefixes went).
    pub fn learn(&self, request: &Request<'_>, target: &Target) {
        self.lock().learn(request, target);
    }

    /// Counts a request of `prompt_tokens` (`uncached_tokens` to prefill)
    /// against `target`'s load until the returned guard is dropped, without
    /// teaching the policy anything.
    pub fn hold(
        self: &Arc<Self>,
        target: &Target,
        prompt_tokens: u64,
        uncached_tokens: u64,
    ) -> InFlight {
        let ticket = self
            .lock()
            .load
            .start(target.slot, prompt_tokens, uncached_tokens);
        self.in_flight(ticket)
    }

    fn in_flight(self: &Arc<Self>, ticket: Ticket) -> InFlight {
        InFlight {
            pool: self.clone(),
            ticket: Some(ticket),
            trial: None,
        }
    }

    /// The endpoint at HTTP address `addr`, routable or not.
    pub fn target_at(&self, addr: SocketAddr) -> Option<Target> {
        let inner = self.lock();
        inner
            .members
            .values()
            .find(|m| m.spec.http == addr)
            .map(|m| Target {
                name: m.name.clone(),
                http: m.spec.http,
                slot: m.slot,
                id: m.id,
            })
    }

    /// Resolves at the next end of a request after it is enabled.
    pub fn released(&self) -> tokio::sync::futures::Notified<'_> {
        self.released.notified()
    }

    /// The endpoint answered well.
    pub fn succeeded(&self, name: &str) -> HealthEvents {
        self.health(|o, now| o.success(name, now))
    }

    /// The endpoint failed by its own fault (see [`outliers`]).
    pub fn failed(&self, name: &str, fault: Fault) -> HealthEvents {
        self.health(|o, now| o.failure(name, fault, now))
    }

    /// An active health check of `name` passed or failed.
    pub fn checked(&self, name: &str, passed: bool) -> HealthEvents {
        self.health(|o, now| o.check(name, passed, now))
    }

    /// Ends the ejections whose time has passed.
    pub fn tick(&self) -> HealthEvents {
        self.health(Outlier::tick)
    }

    /// Runs one step of the health state machine and publishes readiness;
    /// returns its events for the caller to log and count.
    fn health(
        &self,
        step: impl FnOnce(&mut Outlier, std::time::Instant) -> Vec<Event>,
    ) -> HealthEvents {
        let mut inner = self.lock();
        let events = step(&mut inner.outlier, now());
        // Routability changes only with an event (an ejection whose time
        // passed is ended, with an event, by the step's tick).
        if !events.is_empty() {
            self.publish_ready(&inner);
        }
        HealthEvents(events)
    }

    /// Applies a snapshot for the watcher `(name, generation)`: checks the
    /// engine's cache settings against the routing settings, then indexes
    /// `blocks` if they match (else drops the endpoint's entries). A stale
    /// watcher's snapshot is ignored (Ok), and so is the rest of one whose
    /// watcher became stale while it was applied. An error means the index
    /// refused it: the watcher drops the endpoint and resyncs.
    ///
    /// The old entries go a shard at a time, then the blocks come in
    /// [`SNAPSHOT_CHUNK`]s, the lock released in between: routing meanwhile
    /// sees a part of the new contents (misses, never false hits).
    pub fn apply_snapshot(
        &self,
        name: &str,
        generation: u64,
        engine: EngineCache,
        capacity: usize,
        blocks: &[u64],
        offloaded: &[&[u64]],
    ) -> Result<(), IndexError> {
        let mut inner = self.lock();
        let contract = Contract::check(&engine, &inner.settings.hasher);
        let Some(m) = inner
            .members
            .get_mut(name)
            .filter(|m| m.generation == generation)
        else {
            return Ok(());
        };
        let changed = m.contract != contract;
        m.engine = Some(engine);
        m.contract = contract.clone();
        let slot = m.slot;
        let matched = contract == Contract::Match;
        // Refused before anything changes, as the index would.
        let refused = (matched && blocks.len() > capacity).then_some(IndexError::OverCapacity {
            slot: slot.0,
            capacity,
            would_hold: blocks.len(),
        });
        if refused.is_none() {
            inner.index.begin_remove_endpoint(slot);
        }
        drop(inner);
        if changed {
            log_contract(name, &contract);
        }
        if let Some(e) = refused {
            return Err(e);
        }
        self.finish_removals();
        if !matched {
            return Ok(());
        }
        let empty = CacheEvent::Snapshot {
            capacity,
            blocks: &[],
        };
        let events = std::iter::once(empty)
            .chain(blocks.chunks(SNAPSHOT_CHUNK).map(CacheEvent::Stored))
            .chain(
                offloaded
                    .iter()
                    .flat_map(|b| b.chunks(SNAPSHOT_CHUNK))
                    .map(CacheEvent::Offloaded),
            );
        for event in events {
            let mut inner = self.lock();
            let current = inner
                .members
                .get(name)
                .is_some_and(|m| m.generation == generation && m.contract == Contract::Match);
            if !current {
                return Ok(());
            }
            inner.index.apply(slot, event)?;
        }
        Ok(())
    }

    /// Applies one WatchCache change for the watcher `(name, generation)`.
    /// A stale watcher's changes, and those of an engine whose contract
    /// does not match, are ignored (Ok). An error means the stream
    /// diverged: the watcher drops the endpoint and resyncs.
    pub fn apply_cache(
        &self,
        name: &str,
        generation: u64,
        event: CacheEvent<'_>,
    ) -> Result<(), IndexError> {
        let mut inner = self.lock();
        let Some(slot) = inner
            .members
            .get(name)
            .filter(|m| m.generation == generation && m.contract == Contract::Match)
            .map(|m| m.slot)
        else {
            return Ok(());
        };
        inner.index.apply(slot, event)
    }

    /// Records an engine's load report.
    pub fn report_load(&self, name: &str, generation: u64, load: EngineLoad) {
        let mut inner = self.lock();
        if let Some(slot) = inner
            .members
            .get(name)
            .filter(|m| m.generation == generation)
            .map(|m| m.slot)
        {
            inner.load.report(slot, load);
        }
    }

    /// Sets a watcher's stream state; leaving `Live` drops the endpoint's
    /// entries until a new snapshot arrives.
    pub fn set_stream(&self, name: &str, generation: u64, state: StreamState) {
        let mut inner = self.lock();
        let Some(m) = inner
            .members
            .get_mut(name)
            .filter(|m| m.generation == generation)
        else {
            return;
        };
        m.stream = state;
        let slot = m.slot;
        if state != StreamState::Live {
            inner.index.begin_remove_endpoint(slot);
            drop(inner);
            self.finish_removals();
        }
    }

    /// Every endpoint's status.
    pub fn status(&self) -> Vec<EndpointStatus> {
        let inner = self.lock();
        let now = now();
        let model = inner.settings.policy.prefill_model();
        inner
            .members
            .values()
            .map(|m| {
                let load = inner.load.load(m.slot);
                EndpointStatus {
                    name: m.spec.name.clone(),
                    http: m.spec.http.to_string(),
                    ready: m.spec.ready,
                    draining: m.spec.draining,
                    ejected: inner.outlier.is_ejected(&m.spec.name, now),
                    stream: m.stream.as_str(),
                    in_flight: load.in_flight,
                    prefill_tokens: load.prefill_tokens,
                    queue_seconds: model.queued_s(&load, now),
                    load_report_age_seconds: load.engine.map(|e| e.age(now).as_secs_f64()),
                    cached_blocks: inner.index.usage(m.slot).map_or(0, |(used, _)| used),
                    contract: m.contract.as_str(),
                    contract_mismatches: m.contract.mismatches().to_vec(),
                }
            })
            .collect()
    }

    /// (block, endpoint) entries in the index, GPU tier.
    pub fn index_entries(&self) -> usize {
        self.lock().index.entries()
    }

    /// Each tier's entries and drops.
    pub fn index_stats(&self) -> [TierStats; 2] {
        let inner = self.lock();
        Tier::ALL.map(|tier| TierStats {
            tier,
            entries: inner.index.tier_entries(tier),
            dropped: inner.index.dropped(tier),
        })
    }

    /// Every endpoint's name and HTTP address, routable or not.
    pub fn members(&self) -> Vec<(String, SocketAddr)> {
        self.lock()
            .members
            .values()
            .map(|m| (m.spec.name.clone(), m.spec.http))
            .collect()
    }

    /// The HTTP addresses of every endpoint, routable or not.
    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.lock().members.values().map(|m| m.spec.http).collect()
    }
}

/// Gives member `name` a new generation, forgetting its engine, and
/// returns the stream to start for it.
fn restart_stream(inner: &mut Inner, name: &str) -> Option<Stream> {
    inner.generations += 1;
    let generation = inner.generations;
    let m = inner.members.get_mut(name)?;
    m.generation = generation;
    m.engine = None;
    m.contract = Contract::Unknown;
    let addr = m.spec.cache?;
    m.stream = StreamState::Connecting;
    Some(Stream {
        name: name.to_owned(),
        generation,
        addr,
    })
}

/// Logs a change of an engine's contract: once per change, so a
/// mismatched engine's resyncs do not repeat it.
fn log_contract(name: &str, contract: &Contract) {
    match contract {
        Contract::Mismatch(fields) => {
            let fields: Vec<String> = fields
                .iter()
                .map(|m| format!("{}: engine {}, router {}", m.field, m.engine, m.router))
                .collect();
            tracing::warn!(endpoint = %name, differ = %fields.join("; "),
                "the engine hashes its cache differently from the routing settings: \
                 its cache is not used for routing until they agree");
        }
        Contract::Match => tracing::info!(endpoint = %name, "the engine's cache settings match"),
        Contract::Unknown => {}
    }
}

impl Inner {
    /// Lets the policy learn that `target` serves `request`.
    fn learn(&mut self, request: &Request<'_>, target: &Target) {
        let endpoint = Endpoint {
            slot: target.slot,
            id: target.id,
            load: self.load.load(target.slot),
        };
        self.policy.routed(request, &endpoint);
    }

    /// The routable endpoints `among` accepts, as the policy sees them and
    /// as targets.
    fn candidates(
        &self,
        now: std::time::Instant,
        among: &dyn Fn(&SocketAddr) -> bool,
    ) -> (Vec<Endpoint>, Vec<Target>) {
        self.members
            .values()
            .filter(|m| self.is_routable(m, now) && among(&m.spec.http))
            .map(|m| {
                let endpoint = Endpoint {
                    slot: m.slot,
                    id: m.id,
                    load: self.load.load(m.slot),
                };
                let target = Target {
                    name: m.name.clone(),
                    http: m.spec.http,
                    slot: m.slot,
                    id: m.id,
                };
                (endpoint, target)
            })
            .unzip()
    }

    fn is_routable(&self, m: &Member, now: std::time::Instant) -> bool {
        m.spec.ready && !m.spec.draining && self.outlier.admits(&m.spec.name, now)
    }
}

/// A request counted against its endpoint's load. Dropping it ends the
/// count, so no path (an error, a client that goes away mid-request, a
/// reset stream, a timeout) can leak load.
#[derive(Debug)]
pub struct InFlight {
    pool: Arc<Pool>,
    ticket: Option<Ticket>,
    /// The half-open endpoint whose trial this request is: released
    /// unjudged if it ends without a success or failure reported.
    trial: Option<Arc<str>>,
}

impl InFlight {
    /// The request's first response byte arrived: its prefill is done.
    pub fn first_token(&mut self) {
        if let Some(t) = self.ticket.as_mut() {
            self.pool.lock().load.first_token(t);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            let mut inner = self.pool.lock();
            inner.load.finish(t);
            if let Some(name) = self.trial.take() {
                inner.outlier.abandon(&name);
            }
            drop(inner);
            self.pool.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests;
