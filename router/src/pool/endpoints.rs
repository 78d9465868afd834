//! The pool's endpoint table: discovery's endpoint set, each member's
//! slot, rendezvous identity, watcher generation and slow-start ramp, and
//! the WatchCache streams a change of the set starts and stops
//! ([`Streams`]).
//!
//! When a member's slow-start ramp starts ([`ramp_from`]), in wall-clock
//! Unix milliseconds:
//! 1. Discovery's ready time when it gives one (the operator's, from the
//!    pod's Ready condition; the static file's `readySince`): one time for
//!    every router replica, so they agree on the ramp.
//! 2. Else, when this router saw it turn ready: it was not ready, or not
//!    listed, in an earlier endpoint set. Replicas that saw it at
//!    different moments ramp it a little apart.
//! 3. Else (ready in the first endpoint set this router applied, with no
//!    ready time) it does not ramp: it was ready before this router
//!    started, and a restarted router must not take a warm pod's keys
//!    away for a window.
//!
//! A member that stops being ready loses its ramp; it ramps again when it
//! is ready again.
//!
//! Not here: what a member's engine reports (`engines`), routing among
//! the members (`routing`), their health (`health`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_core::contract::{Contract, EngineCache};
use kvroute_core::rendezvous::endpoint_id;
use kvroute_core::role::Role;
use kvroute_core::slot::Slot;

use super::routing::Target;
use super::{Inner, Pool};

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
    /// When it last became ready, wall-clock Unix milliseconds, if
    /// discovery knows: the start of its slow-start ramp.
    pub ready_since_ms: Option<i64>,
    /// What it does in a disaggregated pool.
    pub role: Role,
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

/// A row of the table: one endpoint and its watcher's state.
#[derive(Debug)]
pub(super) struct Member {
    pub(super) spec: EndpointSpec,
    /// `spec.name`, shared by the targets of every plan.
    pub(super) name: Arc<str>,
    pub(super) slot: Slot,
    pub(super) id: u64,
    pub(super) stream: StreamState,
    /// Distinguishes this member's watcher from an older one of the same
    /// name.
    pub(super) generation: u64,
    /// The cache settings of its last snapshot.
    pub(super) engine: Option<EngineCache>,
    /// Those checked against the routing settings; a mismatched engine
    /// gets no cache credit (its updates are not indexed).
    pub(super) contract: Contract,
    /// Its stream has delivered a snapshot (been live) at least once.
    pub(super) snapshotted: bool,
    /// When its slow-start ramp started, wall-clock Unix milliseconds;
    /// `None`: not ramping (see the module docs).
    pub(super) ramp_from_ms: Option<i64>,
}

/// When `spec`'s ramp starts, given the member it replaces (`was`),
/// whether an endpoint set was applied before this one (`watching`) and
/// the wall clock now (`now_ms`). See the module docs.
fn ramp_from(
    spec: &EndpointSpec,
    was: Option<(bool, Option<i64>)>,
    watching: bool,
    now_ms: i64,
) -> Option<i64> {
    if !spec.ready {
        return None;
    }
    if let Some(t) = spec.ready_since_ms {
        return Some(t);
    }
    match was {
        Some((true, from)) => from,
        _ if watching => Some(now_ms),
        _ => None,
    }
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

impl Pool {
    /// Replaces the endpoint set: new endpoints get a slot (and a stream,
    /// in [`Streams::start`]), changed ones are updated, missing ones are
    /// forgotten everywhere (their streams in [`Streams::stop`]).
    pub fn set_endpoints(&self, specs: Vec<EndpointSpec>) -> Streams {
        let mut inner = self.lock();
        let (watching, now_ms) = (inner.watching, super::wall_ms());
        inner.watching = true;
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
            let was = (inner.members.get(&name)).map(|m| (m.spec.ready, m.ramp_from_ms));
            let ramp_from_ms = ramp_from(&spec, was, watching, now_ms);
            // Same addresses: only readiness changed. Else (re)start it.
            match inner.members.get_mut(&name) {
                Some(m) if m.spec.cache == spec.cache && m.spec.http == spec.http => {
                    m.spec = spec;
                    m.ramp_from_ms = ramp_from_ms;
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
                    snapshotted: false,
                    ramp_from_ms,
                },
            );
        }
        inner.exact = inner.members.values().any(|m| m.spec.cache.is_some());
        if !inner.members.is_empty() {
            inner.startup.start(super::now());
        }
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

    /// Forgets the entries of removed endpoints one index shard at a time,
    /// releasing the lock in between.
    pub(super) fn finish_removals(&self) {
        while self.lock().index.remove_step() {}
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
                admit_within_ms: None,
                predicted: None,
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
