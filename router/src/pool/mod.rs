//! One pool's routing state: its endpoints and their health, the occupancy
//! index fed by WatchCache, each engine's contract, load accounting, and
//! the routing settings with the policy they name. Discovery replaces the
//! endpoint set and the settings; cache watchers apply engine updates; the
//! proxy asks for a ranked plan and reports outcomes.
//!
//! The pool runs no tasks: a change that needs WatchCache streams started
//! or stopped returns them as [`Streams`], and discovery, which owns the
//! watcher tasks ([`Watchers`]), runs them. It logs and counts no health
//! event either: an outcome reported to it returns the [`HealthEvents`] it
//! caused, for the caller to log and count.
//!
//! Everything sits behind one mutex, held for microseconds: a routing
//! decision, an applied update, a counter change. No I/O happens under it.
//! Work that grows with an engine's cache is done in steps that release it
//! in between: a snapshot is applied [`SNAPSHOT_CHUNK`] blocks at a time,
//! and a forgotten endpoint's entries go one index shard at a time (hidden
//! from routing at once).
//!
//! This file holds the [`Pool`] handle and its lock; the rest, one job a
//! file: `endpoints` (the endpoint table and the streams it asks for),
//! `engines` (what the engines report: contracts, snapshots, changes,
//! load), `routing` (plans, explanations, in-flight requests), `health`
//! (outcomes into the [`outliers`] state machine), `startup` (whether a
//! starting router has every engine's first snapshot), `status` (snapshots
//! for metrics and `/debug/pool`), `decisions` (the last decisions, for
//! `/debug/pool`'s shares). The tasks that keep a pool current from the
//! engines are here too: [`cache_watch`] and [`health_checks`].

pub mod cache_watch;
mod decisions;
mod endpoints;
mod engines;
mod health;
pub mod health_checks;
pub mod outliers;
mod routing;
mod startup;
mod status;

pub use cache_watch::Watchers;
pub use decisions::RECENT_DECISIONS;
pub use endpoints::{EndpointSpec, Stream, StreamState, Streams};
pub use engines::SNAPSHOT_CHUNK;
pub use health::HealthEvents;
pub use outliers::{Event, Fault, Restore};
pub use routing::{InFlight, Leg, Lost, Plan, PrefixOwner, Seen, Target};
pub use startup::{GaveUp, Waiting};
pub use status::{EndpointStatus, TierStats};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use kvroute_core::hash::BlockHash;
use kvroute_core::index::{Bounds, OccupancyIndex};
use kvroute_core::load::LoadTracker;
use kvroute_core::policy::{LeastLoaded, Policy};
use kvroute_core::slot::Slots;
use tokio::sync::{Notify, watch};

use self::endpoints::Member;
use self::outliers::Outlier;
use self::startup::{Engine, Startup};
use crate::config::Resilience;
use crate::settings::Settings;

/// The clock the health state machine is given: tokio's, so tests can
/// pause it.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// The wall clock, Unix milliseconds: slow-start ramps are timed by it,
/// because the ready times discovery gives are wall-clock times that every
/// router replica shares.
fn wall_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The pool's state, under its one lock.
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
    /// Whether the router holds every engine's first snapshot yet.
    startup: Startup,
    /// Whether an endpoint set was applied: endpoints that turn ready
    /// after it ramp up from this router's clock when discovery gives no
    /// ready time (`endpoints`' module docs).
    watching: bool,
}

/// A pool. See the module docs.
pub struct Pool {
    inner: Mutex<Inner>,
    concurrency: u32,
    ready: watch::Sender<usize>,
    /// Signalled whenever an endpoint's load changes (a request starts or
    /// ends, its engine reports or refuses), for requests held at the
    /// router ([`crate::flow`]).
    changed: Notify,
    /// The last decisions; its own lock, off the routing one.
    decisions: Mutex<decisions::Decisions>,
    /// The pool's `InferenceObjective`s from the operator: name → priority.
    objectives: Mutex<Arc<HashMap<String, i32>>>,
    /// The warm-ups asked for, and the pool's routers.
    pub warmup: crate::warmup::Source,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").finish_non_exhaustive()
    }
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
                startup: Startup::new(std::time::Duration::from_millis(
                    resilience.snapshot_wait_ms,
                )),
                watching: false,
            }),
            concurrency,
            ready: watch::channel(0).0,
            changed: Notify::new(),
            decisions: Mutex::default(),
            objectives: Mutex::default(),
            warmup: crate::warmup::Source::default(),
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

    /// Whether a starting router has its engines' first snapshots (see
    /// `startup.rs`'s rules); the [`GaveUp`] the moment its bounded wait
    /// runs out, for the caller to log and count.
    pub fn startup(&self) -> (Result<(), Waiting>, Option<GaveUp>) {
        let Inner {
            members, startup, ..
        } = &mut *self.lock();
        let engines = members.values().map(|m| Engine {
            name: &m.spec.name,
            wanted: m.spec.ready && !m.spec.draining && m.spec.cache.is_some(),
            delivered: m.snapshotted,
        });
        startup.check(now(), engines)
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

    /// Remembers about the last `blocks` blocks evicted
    /// (`limits.maxEvictedBlocks`).
    pub fn set_evicted_capacity(&self, blocks: usize) {
        self.lock().index.set_evicted_capacity(blocks);
    }

    /// Replaces the pool's objectives (the operator's); returns whether
    /// they changed.
    pub fn set_objectives(&self, objectives: HashMap<String, i32>) -> bool {
        let mut current = self.objectives.lock().unwrap_or_else(|e| e.into_inner());
        let changed = **current != objectives;
        *current = Arc::new(objectives);
        changed
    }

    /// The pool's objectives (the operator's): name → priority.
    pub fn objectives(&self) -> Arc<HashMap<String, i32>> {
        self.objectives
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Resolves at the next change of an endpoint's load after it is
    /// enabled.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
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
}

impl Inner {
    fn is_routable(&self, m: &Member, now: std::time::Instant) -> bool {
        m.spec.ready && !m.spec.draining && self.outlier.admits(&m.spec.name, now)
    }

    /// `m`'s slow-start weight at wall-clock time `now_ms`: its share of
    /// new keys, 0 to 1 ([`kvroute_core::slow_start`]).
    fn weight(&self, m: &Member, now_ms: i64) -> f64 {
        use kvroute_core::slow_start::{ready_for, weight};
        let elapsed = m.ramp_from_ms.map(|t| ready_for(t, now_ms));
        weight(elapsed, self.settings.slow_start)
    }
}

impl crate::prompt::Holds for Pool {
    /// Held, or evicted recently: the chain goes on as far as its missed
    /// blocks can be told evicted from never seen.
    fn holds_any(&self, block: BlockHash) -> bool {
        let inner = self.lock();
        inner.index.holds_any(block) || inner.index.recently_evicted(block)
    }
}

#[cfg(test)]
mod tests;
