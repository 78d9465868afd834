//! Publishing one pool's [`PoolState`] on its watch channel: only when the
//! content changed, with a higher version.
//!
//! Versions: each change sets `version = max(previous + 1, clock())`, where
//! the index's clock is wall-clock microseconds in production. Routers
//! ignore a state whose version is not higher than the one they applied, so
//! a plain counter from 1 would make a restarted operator (or a failover to
//! a replica that started earlier) unheard until its counter caught up; a
//! clock-based floor keeps versions comparable across restarts and
//! replicas. With a clock that returns 0 (tests) each change adds exactly 1.
//!
//! Not here: computing the content ([`super::Index`] does).

use kvroute_proto::v1::{self, PoolState};
use tokio::sync::watch;

/// A source of version floors, e.g. [`wall_clock_micros`].
pub type Clock = fn() -> u64;

/// Microseconds since the Unix epoch (0 if the system clock is before it).
pub fn wall_clock_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// What a pool's state says, apart from its identity and version.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Content {
    /// The pool exists.
    pub(super) exists: bool,
    /// Its endpoints, sorted by name; empty when it does not exist.
    pub(super) endpoints: Vec<v1::Endpoint>,
    /// The effective policy; `None` when it does not exist.
    pub(super) policy: Option<v1::RoutingPolicy>,
    /// Its `InferenceObjective`s, sorted by name; empty when it does not
    /// exist.
    pub(super) objectives: Vec<v1::Objective>,
    /// Its ready routers' pod names, sorted.
    pub(super) routers: Vec<String>,
    /// Where routers report warm-ups; empty when unknown.
    pub(super) status_writer: String,
}

/// A channel for pool `namespace/name` holding "does not exist", version 0:
/// lower than any real state, so a router that already has a state (from
/// another replica, or before a restart) keeps it.
pub(super) fn channel(namespace: &str, name: &str) -> watch::Sender<PoolState> {
    watch::Sender::new(PoolState {
        namespace: namespace.to_owned(),
        pool: name.to_owned(),
        version: 0,
        endpoints: Vec::new(),
        policy: None,
        pool_exists: false,
        objectives: Vec::new(),
        routers: Vec::new(),
        status_writer: String::new(),
    })
}

/// Publishes `content` on `tx` with the next version, unless `tx` already
/// holds exactly that; returns whether it published (and so notified).
pub(super) fn publish(tx: &watch::Sender<PoolState>, content: Content, clock: Clock) -> bool {
    tx.send_if_modified(|state| {
        let same = state.pool_exists == content.exists
            && state.endpoints == content.endpoints
            && state.policy == content.policy
            && state.objectives == content.objectives
            && state.routers == content.routers
            && state.status_writer == content.status_writer;
        if same {
            return false;
        }
        state.version = next_version(state.version, clock());
        state.pool_exists = content.exists;
        state.endpoints = content.endpoints;
        state.policy = content.policy;
        state.objectives = content.objectives;
        state.routers = content.routers;
        state.status_writer = content.status_writer;
        true
    })
}

/// The version after `previous`, at least `now`.
pub(super) fn next_version(previous: u64, now: u64) -> u64 {
    previous.saturating_add(1).max(now)
}
