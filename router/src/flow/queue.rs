//! The flow-control queue's rules: a pure state machine over held
//! requests. It reads no clock (every call that needs one takes `now`),
//! does no I/O and knows nothing of endpoints but their addresses; the
//! gate ([`super::Gate`]) calls it under its lock and wakes the requests
//! it names.
//!
//! The rules:
//! 1. **Bands, then flows, then arrival.** Held requests are ordered by
//!    priority, higher first. Within a band the flows (tenants) take turns:
//!    the first request of each flow in the band's rotation, then the
//!    second of each, and so on; a flow that is dispatched to moves to the
//!    back of the rotation. Within a flow, first come first served.
//! 2. **Passes.** An event that may let a held request start (an engine's
//!    report, a request's end or start, a refusal, an arrival, a timer)
//!    starts a pass, or marks the running one to be followed by another.
//!    A pass hands a turn to each held request in the order of rule 1, one
//!    at a time, at most [`PASS_TURNS`]: the request ranks the endpoints
//!    with fresh state and either is dispatched or stays, naming the
//!    endpoint it waits for, if any (the gate names none for a request
//!    that must leave room for others). An endpoint a request ahead in the pass waits
//!    for, or was dispatched to, is left out of the ranking of the requests
//!    behind it: a request is never sent ahead of an earlier one waiting
//!    for the same endpoint, and a pass does not send two requests to one
//!    endpoint before its load counts the first.
//! 3. **Bounds.** At most `maxQueued` requests and `maxQueuedBytes` of
//!    their bodies are held. A request that does not fit takes the place of
//!    the newest request of the largest flow in the lowest band below its
//!    own (that one is shed, `flow_queue_full`), else it is refused. Each
//!    held request waits at most its band's `maxWaitMs`
//!    (`flow_wait_limit`).
//! 4. **Sheddable.** A request of negative priority is never held: when it
//!    cannot start at once it is refused (`flow_sheddable`), as the Gateway
//!    API Inference Extension specifies.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Turns one pass hands out at most: bounds the work one event causes.
pub const PASS_TURNS: usize = 64;

/// A held request.
pub type Id = u64;

/// Why a request is refused or shed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShedReason {
    /// The queue is at `maxQueued` or `maxQueuedBytes` (rule 3).
    QueueFull,
    /// It waited its band's `maxWaitMs` (rule 3).
    WaitLimit,
    /// Negative priority and nowhere to start it (rule 4).
    Sheddable,
}

impl ShedReason {
    /// The error `code` and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::QueueFull => "flow_queue_full",
            ShedReason::WaitLimit => "flow_wait_limit",
            ShedReason::Sheddable => "flow_sheddable",
        }
    }
}

/// The queue's bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Requests held at most.
    pub max_queued: usize,
    /// Body bytes held at most.
    pub max_queued_bytes: usize,
    /// How long a request waits at most.
    pub max_wait: Duration,
    /// Per priority, a wait other than `max_wait`.
    pub band_wait: BTreeMap<i32, Duration>,
}

/// What a pass's turn ended in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// Dispatched to this endpoint: it left the queue.
    Dispatched(SocketAddr),
    /// Still held, waiting for this endpoint (`None`: for none in
    /// particular).
    Held(Option<SocketAddr>),
}

/// A request admitted to the queue.
#[derive(Debug, PartialEq, Eq)]
pub struct Pushed {
    /// Its id.
    pub id: Id,
    /// When it gives up (its band's wait limit).
    pub deadline: Instant,
    /// Requests it displaced (rule 3), to answer `flow_queue_full`.
    pub shed: Vec<Id>,
    /// The turn to hand out when a displaced request held it.
    pub turn: Option<Id>,
}

#[derive(Debug)]
struct Held {
    priority: i32,
    flow: Arc<str>,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Band {
    /// Each flow's held requests, oldest first.
    flows: HashMap<Arc<str>, VecDeque<Id>>,
    /// Whose turn comes first (rule 1).
    rotation: VecDeque<Arc<str>>,
}

#[derive(Debug, Default)]
struct Pass {
    turns: VecDeque<Id>,
    /// Whose turn it is.
    current: Option<Id>,
    /// Endpoints left out for the rest of the pass (rule 2).
    reserved: Vec<SocketAddr>,
    /// Another pass is due after this one.
    again: bool,
}

/// The queue. See the module docs.
#[derive(Debug)]
pub struct Queue {
    bounds: Bounds,
    bands: BTreeMap<i32, Band>,
    held: HashMap<Id, Held>,
    bytes: usize,
    next: Id,
    pass: Option<Pass>,
}

impl Queue {
    /// An empty queue.
    pub fn new(bounds: Bounds) -> Self {
        Queue {
            bounds,
            bands: BTreeMap::new(),
            held: HashMap::new(),
            bytes: 0,
            next: 0,
            pass: None,
        }
    }

    /// Requests held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Whether a request of `priority` arriving now must queue behind
    /// held ones: any is held at its priority or above.
    pub fn ahead(&self, priority: i32) -> bool {
        self.bands.range(priority..).next().is_some()
    }

    /// Held requests per priority.
    pub fn by_priority(&self) -> impl Iterator<Item = (i32, usize)> + '_ {
        (self.bands.iter()).map(|(&p, b)| (p, b.flows.values().map(VecDeque::len).sum()))
    }

    /// How long a request of `priority` may wait.
    pub fn max_wait(&self, priority: i32) -> Duration {
        (self.bounds.band_wait.get(&priority).copied()).unwrap_or(self.bounds.max_wait)
    }

    /// Holds a request of `priority` from `flow` with a body of `bytes`
    /// that cannot start now (rules 3 and 4).
    pub fn push(
        &mut self,
        priority: i32,
        flow: &str,
        bytes: usize,
        now: Instant,
    ) -> Result<Pushed, ShedReason> {
        if priority < 0 {
            return Err(ShedReason::Sheddable);
        }
        let b = &self.bounds;
        if b.max_queued == 0 || bytes > b.max_queued_bytes {
            return Err(ShedReason::QueueFull);
        }
        let (max, max_bytes) = (self.bounds.max_queued, self.bounds.max_queued_bytes);
        let fits = |len: usize, held: usize| len < max && held + bytes <= max_bytes;
        let (below, below_bytes) = (self.held.values())
            .filter(|h| h.priority < priority)
            .fold((0, 0), |(n, b), h| (n + 1, b + h.bytes));
        if !fits(self.held.len() - below, self.bytes - below_bytes) {
            return Err(ShedReason::QueueFull);
        }
        let (mut shed, mut turn) = (Vec::new(), None);
        while !fits(self.held.len(), self.bytes) {
            let victim = self.victim(priority).expect("counted above");
            turn = self.leave(victim).or(turn);
            shed.push(victim);
        }
        let id = self.next;
        self.next += 1;
        let flow: Arc<str> = Arc::from(flow);
        let band = self.bands.entry(priority).or_default();
        let queue = band.flows.entry(flow.clone()).or_insert_with(|| {
            band.rotation.push_back(flow.clone());
            VecDeque::new()
        });
        queue.push_back(id);
        self.bytes += bytes;
        self.held.insert(
            id,
            Held {
                priority,
                flow,
                bytes,
            },
        );
        Ok(Pushed {
            id,
            deadline: now + self.max_wait(priority),
            shed,
            turn,
        })
    }

    /// The newest request of the largest flow in the lowest band below
    /// `priority` (rule 3).
    fn victim(&self, priority: i32) -> Option<Id> {
        let (_, band) = self.bands.range(..priority).next()?;
        let (_, queue) = (band.flows.iter())
            .max_by_key(|(name, q)| (q.len(), std::cmp::Reverse(Arc::clone(name))))?;
        queue.back().copied()
    }

    /// Takes a request out of the queue (it left, was shed or gave up).
    /// Returns the next turn to hand out when it held the turn.
    pub fn leave(&mut self, id: Id) -> Option<Id> {
        self.remove(id);
        let pass = self.pass.as_mut()?;
        pass.turns.retain(|&t| t != id);
        if pass.current == Some(id) {
            return self.next_turn();
        }
        None
    }

    fn remove(&mut self, id: Id) -> bool {
        let Some(held) = self.held.remove(&id) else {
            return false;
        };
        self.bytes -= held.bytes;
        let band = self
            .bands
            .get_mut(&held.priority)
            .expect("held in its band");
        let queue = band.flows.get_mut(&held.flow).expect("held in its flow");
        queue.retain(|&h| h != id);
        if queue.is_empty() {
            band.flows.remove(&held.flow);
            band.rotation.retain(|f| *f != held.flow);
        }
        if band.flows.is_empty() {
            self.bands.remove(&held.priority);
        }
        true
    }

    /// The held requests in dispatch order (rule 1), at most `limit`.
    pub fn order(&self, limit: usize) -> Vec<Id> {
        let mut out = Vec::new();
        for band in self.bands.values().rev() {
            for depth in 0.. {
                let before = out.len();
                for flow in &band.rotation {
                    if let Some(&id) = band.flows[flow].get(depth) {
                        out.push(id);
                        if out.len() == limit {
                            return out;
                        }
                    }
                }
                if out.len() == before {
                    break;
                }
            }
        }
        out
    }

    /// Something changed that may let a held request start: starts a pass
    /// and returns the first turn, or marks the running pass to be
    /// followed by another (rule 2).
    pub fn kick(&mut self) -> Option<Id> {
        if let Some(pass) = self.pass.as_mut() {
            pass.again = true;
            return None;
        }
        if self.held.is_empty() {
            return None;
        }
        self.pass = Some(Pass {
            turns: self.order(PASS_TURNS).into(),
            ..Pass::default()
        });
        self.next_turn()
    }

    /// Whether `id` holds the turn.
    pub fn has_turn(&self, id: Id) -> bool {
        self.pass.as_ref().is_some_and(|p| p.current == Some(id))
    }

    /// Endpoints the request whose turn it is must leave out.
    pub fn reserved(&self) -> &[SocketAddr] {
        self.pass.as_ref().map_or(&[], |p| &p.reserved)
    }

    /// The turn of `id` ended in `turn`; returns the next turn, if any.
    pub fn turn_done(&mut self, id: Id, turn: Turn) -> Option<Id> {
        let pass = self.pass.as_mut().filter(|p| p.current == Some(id))?;
        match turn {
            Turn::Dispatched(addr) => {
                pass.reserved.push(addr);
                if let Some(held) = self.held.get(&id) {
                    let band = self
                        .bands
                        .get_mut(&held.priority)
                        .expect("held in its band");
                    if let Some(i) = band.rotation.iter().position(|f| *f == held.flow) {
                        let flow = band.rotation.remove(i).expect("present");
                        band.rotation.push_back(flow);
                    }
                }
                self.remove(id);
            }
            Turn::Held(addr) => pass.reserved.extend(addr),
        }
        self.next_turn()
    }

    fn next_turn(&mut self) -> Option<Id> {
        let pass = self.pass.as_mut()?;
        while let Some(id) = pass.turns.pop_front() {
            if self.held.contains_key(&id) {
                pass.current = Some(id);
                return Some(id);
            }
        }
        let again = pass.again;
        self.pass = None;
        if again { self.kick() } else { None }
    }
}

#[cfg(test)]
mod tests;
