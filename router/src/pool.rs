//! One pool's routing state: its endpoints and their health, the occupancy
//! index fed by WatchCache, load accounting and the policy. Discovery
//! replaces the endpoint set; cache watchers apply engine updates; the
//! proxy asks for a ranked plan and reports outcomes.
//!
//! Everything sits behind one mutex, held for microseconds: a routing
//! decision, an applied update, a counter change. No I/O happens under it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvroute_core::index::{CacheEvent, IndexError, OccupancyIndex};
use kvroute_core::load::{EngineLoad, LoadTracker, Ticket};
use kvroute_core::policy::{Context, Endpoint, LeastLoaded, Policy, PolicyConfig, Reason, Request};
use kvroute_core::rendezvous::endpoint_id;
use kvroute_core::slot::{Slot, Slots};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::Resilience;

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

#[derive(Debug, Default)]
struct Health {
    consecutive_failures: u32,
    ejections: u32,
    ejected_until: Option<Instant>,
}

#[derive(Debug)]
struct Member {
    spec: EndpointSpec,
    slot: Slot,
    id: u64,
    health: Health,
    stream: StreamState,
    /// Distinguishes this member's watcher from an older one of the same
    /// name.
    generation: u64,
    watcher: Option<JoinHandle<()>>,
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}

/// One endpoint in a routing plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Its name.
    pub name: String,
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

/// Spawns a WatchCache watcher for `(name, generation)` at `addr`.
pub type WatcherSpawner =
    Arc<dyn Fn(Arc<Pool>, String, u64, SocketAddr) -> JoinHandle<()> + Send + Sync>;

#[derive(Debug)]
struct Inner {
    members: BTreeMap<String, Member>,
    slots: Slots,
    index: OccupancyIndex,
    load: LoadTracker,
    policy: Box<dyn Policy>,
    policy_config: PolicyConfig,
    /// For requests without a readable prompt.
    least_loaded: LeastLoaded,
    generations: u64,
    /// Whether any endpoint reports its cache: routing is then exact.
    exact: bool,
}

/// A pool. See the module docs.
pub struct Pool {
    inner: Mutex<Inner>,
    resilience: Resilience,
    concurrency: u32,
    block_tokens: u64,
    spawner: Option<WatcherSpawner>,
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
    /// Outstanding prefill tokens.
    pub prefill_tokens: u64,
    /// Blocks the index holds for it.
    pub cached_blocks: usize,
}

impl Pool {
    /// An empty pool. `spawner` starts WatchCache watchers (none in tests
    /// that feed the index by hand).
    pub fn new(
        policy: PolicyConfig,
        resilience: Resilience,
        concurrency: u32,
        block_tokens: u64,
        spawner: Option<WatcherSpawner>,
    ) -> Arc<Self> {
        Arc::new(Pool {
            inner: Mutex::new(Inner {
                members: BTreeMap::new(),
                slots: Slots::default(),
                index: OccupancyIndex::new(),
                load: LoadTracker::new(),
                policy: policy.build(),
                policy_config: policy,
                least_loaded: LeastLoaded::default(),
                generations: 0,
                exact: false,
            }),
            resilience,
            concurrency,
            block_tokens,
            spawner,
            ready: watch::channel(0).0,
            released: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Routable endpoints as of the last change; watch it to wait for
    /// readiness.
    pub fn ready(&self) -> watch::Receiver<usize> {
        self.ready.subscribe()
    }

    /// Routable endpoints right now (ejections expire on their own).
    pub fn routable(&self) -> usize {
        let inner = self.lock();
        let now = Instant::now();
        inner
            .members
            .values()
            .filter(|m| Self::is_routable(m, now))
            .count()
    }

    /// Replaces the policy (the operator changed it); its learned state is
    /// lost, the index is not.
    pub fn set_policy(&self, config: PolicyConfig) {
        let mut inner = self.lock();
        if inner.policy_config != config {
            inner.policy = config.build();
            inner.policy_config = config;
        }
    }

    /// Replaces the endpoint set: new endpoints get a slot (and a watcher),
    /// changed ones are updated, missing ones are forgotten everywhere.
    pub fn set_endpoints(self: &Arc<Self>, specs: Vec<EndpointSpec>) {
        let mut inner = self.lock();
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
        }
        for (name, spec) in wanted {
            // Same addresses: only readiness changed. Else (re)start it.
            match inner.members.get_mut(&name) {
                Some(m) if m.spec.cache == spec.cache && m.spec.http == spec.http => {
                    m.spec = spec;
                    continue;
                }
                Some(_) => self.forget(&mut inner, &name),
                None => {}
            }
            let slot = inner.slots.assign(&name);
            inner.generations += 1;
            let generation = inner.generations;
            let watcher = match (spec.cache, &self.spawner) {
                (Some(addr), Some(spawn)) => {
                    Some(spawn(self.clone(), name.clone(), generation, addr))
                }
                _ => None,
            };
            let stream = if spec.cache.is_some() {
                StreamState::Connecting
            } else {
                StreamState::None
            };
            inner.members.insert(
                name.clone(),
                Member {
                    id: endpoint_id(&name),
                    spec,
                    slot,
                    health: Health::default(),
                    stream,
                    generation,
                    watcher,
                },
            );
        }
        inner.exact = inner.members.values().any(|m| m.spec.cache.is_some());
        self.publish_ready(&inner);
    }

    fn forget(&self, inner: &mut Inner, name: &str) {
        if let Some(m) = inner.members.remove(name) {
            inner.index.remove_endpoint(m.slot);
            inner.load.remove(m.slot);
            inner.policy.endpoint_removed(m.slot);
            inner.slots.release(name);
        }
    }

    fn is_routable(m: &Member, now: Instant) -> bool {
        m.spec.ready && !m.spec.draining && m.health.ejected_until.is_none_or(|t| t <= now)
    }

    fn publish_ready(&self, inner: &Inner) {
        let now = Instant::now();
        let n = inner
            .members
            .values()
            .filter(|m| Self::is_routable(m, now))
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
        let mut inner = self.lock();
        let now = Instant::now();
        let candidates: Vec<(Endpoint, Target)> = inner
            .members
            .values()
            .filter(|m| Self::is_routable(m, now))
            .map(|m| {
                (
                    Endpoint {
                        slot: m.slot,
                        id: m.id,
                        load: inner.load.load(m.slot),
                    },
                    Target {
                        name: m.spec.name.clone(),
                        http: m.spec.http,
                        slot: m.slot,
                        id: m.id,
                    },
                )
            })
            .collect();
        let endpoints: Vec<Endpoint> = candidates.iter().map(|(e, _)| *e).collect();
        let inner = &mut *inner;
        let cx = Context {
            index: inner.exact.then_some(&inner.index),
            block_tokens: self.block_tokens,
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
            .map(|&i| candidates[i].1.clone())
            .collect();
        Plan {
            targets,
            full,
            reason: decision.reason,
            cached_blocks: decision.cached_blocks,
        }
    }

    /// Counts a request sent to `target` and lets the policy learn it.
    pub fn start(&self, request: &Request<'_>, target: &Target, uncached_tokens: u64) -> Ticket {
        let mut inner = self.lock();
        let load = inner.load.load(target.slot);
        let endpoint = Endpoint {
            slot: target.slot,
            id: target.id,
            load,
        };
        inner.policy.routed(request, &endpoint);
        inner.load.start(target.slot, uncached_tokens)
    }

    /// The request's first response byte arrived.
    pub fn first_token(&self, ticket: &mut Ticket) {
        self.lock().load.first_token(ticket);
    }

    /// The request ended.
    pub fn finish(&self, ticket: Ticket) {
        self.lock().load.finish(ticket);
        self.released.notify_waiters();
    }

    /// Resolves at the next [`finish`](Self::finish) after it is enabled.
    pub fn released(&self) -> tokio::sync::futures::Notified<'_> {
        self.released.notified()
    }

    /// The endpoint answered well: its failure count resets.
    pub fn succeeded(&self, name: &str) {
        let mut inner = self.lock();
        if let Some(m) = inner.members.get_mut(name) {
            m.health.consecutive_failures = 0;
            // A good answer after re-admission ends the probation.
            if m.health.ejected_until.is_none_or(|t| t <= Instant::now()) {
                m.health.ejected_until = None;
                m.health.ejections = 0;
            }
        }
    }

    /// The endpoint failed (connect error, 5xx, a broken stream). After
    /// `eject_after_failures` in a row it is ejected for
    /// `ejection_base × 2^(ejections − 1)` (capped); when that passes it
    /// is routable again on probation: one more failure ejects it for
    /// twice as long. Returns whether it was ejected now.
    pub fn failed(&self, name: &str) -> bool {
        let mut inner = self.lock();
        let r = &self.resilience;
        let Some(m) = inner.members.get_mut(name) else {
            return false;
        };
        let now = Instant::now();
        if m.health.ejected_until.is_some_and(|t| t <= now) {
            // Back from ejection: one failure is enough.
            m.health.ejected_until = None;
            m.health.consecutive_failures = r.eject_after_failures - 1;
        }
        m.health.consecutive_failures += 1;
        let eject = m.health.consecutive_failures >= r.eject_after_failures
            && m.health.ejected_until.is_none();
        if eject {
            m.health.ejections += 1;
            let factor = 1u64 << (m.health.ejections - 1).min(20);
            let ms = r
                .ejection_base_ms
                .saturating_mul(factor)
                .min(r.ejection_max_ms);
            m.health.ejected_until = Some(now + Duration::from_millis(ms));
            m.health.consecutive_failures = 0;
        }
        self.publish_ready(&inner);
        eject
    }

    /// The endpoint broke mid-response: it is ejected at once.
    pub fn broke(&self, name: &str) {
        for _ in 0..self.resilience.eject_after_failures {
            if self.failed(name) {
                return;
            }
        }
    }

    /// Applies one WatchCache event for the watcher `(name, generation)`.
    /// A stale watcher's events are ignored (Ok). An error means the
    /// stream diverged: the watcher drops the endpoint and resyncs.
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
            .filter(|m| m.generation == generation)
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
            inner.index.remove_endpoint(slot);
        }
    }

    /// Every endpoint's status.
    pub fn status(&self) -> Vec<EndpointStatus> {
        let inner = self.lock();
        let now = Instant::now();
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
                    ejected: m.health.ejected_until.is_some_and(|t| t > now),
                    stream: m.stream.as_str(),
                    in_flight: load.in_flight,
                    prefill_tokens: load.prefill_tokens,
                    cached_blocks: inner.index.usage(m.slot).map_or(0, |(used, _)| used),
                }
            })
            .collect()
    }

    /// (block, endpoint) entries in the index.
    pub fn index_entries(&self) -> usize {
        self.lock().index.entries()
    }

    /// The HTTP addresses of every endpoint, routable or not.
    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.lock().members.values().map(|m| m.spec.http).collect()
    }
}

#[cfg(test)]
mod tests;
