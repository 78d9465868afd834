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
//!    at a time: to the first [`PASS_TURNS`], then to the [`PASS_TURNS`]
//!    behind them that had a turn least recently (in the order of rule 1
//!    among themselves), so the work one event causes is bounded and every
//!    held request has a turn within a few passes, whatever its position:
//!    one that some endpoint can start now is not held behind the
//!    requests ahead of it (head-of-line blocking). The request ranks the
//!    endpoints with fresh state and either is dispatched or stays, naming
//!    the endpoint it waits for, if any (the gate names none for a request
//!    that must leave room for others). An endpoint a request ahead in the
//!    pass waits for, or was dispatched to, is left out of the ranking of
//!    the requests behind it: a request is never sent ahead of an earlier
//!    one waiting for the same endpoint in the same pass, and a pass does
//!    not send two requests to one endpoint before its load counts the
//!    first.
//! 3. **Bounds.** At most `maxQueued` requests and `maxQueuedBytes` of
//!    their bodies are held. A request that does not fit takes the place of
//!    the newest request of the largest flow in the lowest band below its
//!    own, else of the newest request of the largest flow in its own band
//!    when its own flow holds fewer there (so one flow cannot fill the
//!    queue and refuse every other at its priority); that one is shed
//!    (`flow_queue_full`). Else it is refused. Each held request waits at
//!    most its band's `maxWaitMs` (`flow_wait_limit`).
//! 4. **Sheddable.** A request of negative priority is never held: when it
//!    cannot start at once it is refused (`flow_sheddable`), as the Gateway
//!    API Inference Extension specifies.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Turns one pass hands out to the head of the queue, and again to the
/// requests behind it that waited longest for a turn (rule 2): bounds the
/// work one event causes.
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
    /// The pass it last had a turn in (0: none yet).
    turned: u64,
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
    /// Passes started.
    passes: u64,
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
            passes: 0,
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
        let shed = (self.displaced(priority, flow, bytes)).ok_or(ShedReason::QueueFull)?;
        let mut turn = None;
        for &victim in &shed {
            turn = self.leave(victim).or(turn);
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
                turned: 0,
            },
        );
        Ok(Pushed {
            id,
            deadline: now + self.max_wait(priority),
            shed,
            turn,
        })
    }

    /// The requests a request of `priority` from `flow` with a body of
    /// `bytes` displaces to fit (rule 3), none when it fits as it is;
    /// `None` when it cannot fit.
    fn displaced(&self, priority: i32, flow: &str, bytes: usize) -> Option<Vec<Id>> {
        let (max, max_bytes) = (self.bounds.max_queued, self.bounds.max_queued_bytes);
        let (mut len, mut held) = (self.held.len(), self.bytes);
        let own = (self.bands.get(&priority))
            .and_then(|b| b.flows.get(flow))
            .map_or(0, VecDeque::len);
        // Requests already displaced, per band and flow: the newest go.
        let mut taken: HashMap<(i32, &Arc<str>), usize> = HashMap::new();
        let mut shed = Vec::new();
        while len >= max || held + bytes > max_bytes {
            let (key, victim) = self.bands.range(..=priority).find_map(|(&p, band)| {
                let left = |name| band.flows[name].len() - taken.get(&(p, name)).unwrap_or(&0);
                let name = (band.flows.keys())
                    .filter(|name| left(name) > 0)
                    .max_by_key(|name| (left(name), std::cmp::Reverse(Arc::clone(name))))?;
                let n = left(name);
                (p < priority || n > own).then(|| ((p, name), band.flows[name][n - 1]))
            })?;
            *taken.entry(key).or_default() += 1;
            len -= 1;
            held -= self.held[&victim].bytes;
            shed.push(victim);
        }
        Some(shed)
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
            let mut flows: Vec<_> = (band.rotation.iter())
                .map(|f| band.flows[f].iter())
                .collect();
            while !flows.is_empty() && out.len() < limit {
                flows.retain_mut(|f| f.next().map(|&id| out.push(id)).is_some());
            }
            if out.len() >= limit {
                out.truncate(limit);
                break;
            }
        }
        out
    }

    /// A pass's turns (rule 2): the first [`PASS_TURNS`] in dispatch order,
    /// then the [`PASS_TURNS`] behind them that had a turn least recently,
    /// in dispatch order.
    fn turns(&self) -> VecDeque<Id> {
        let order = self.order(usize::MAX);
        if order.len() <= 2 * PASS_TURNS {
            return order.into();
        }
        let (head, rest) = order.split_at(PASS_TURNS);
        let mut behind: Vec<(u64, usize)> = (rest.iter().enumerate())
            .map(|(i, id)| (self.held[id].turned, i))
            .collect();
        behind.select_nth_unstable(PASS_TURNS - 1);
        behind.truncate(PASS_TURNS);
        behind.sort_unstable_by_key(|&(_, i)| i);
        let behind = behind.into_iter().map(|(_, i)| rest[i]);
        head.iter().copied().chain(behind).collect()
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
        self.passes += 1;
        self.pass = Some(Pass {
            turns: self.turns(),
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
            if let Some(held) = self.held.get_mut(&id) {
                held.turned = self.passes;
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
