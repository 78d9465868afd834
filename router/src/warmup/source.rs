//! Where the warm-ups in effect come from ([`Source`]): the router's own
//! `routing.warmup`, replaced by the operator's when its policy sets one,
//! with the pool's routers the operator names; and which requests touched
//! each prefix on its owners (what `skipped_resident` reads).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{ReportTarget, wall_ms};
use crate::config::Warmup;

/// The warm-ups asked for and the pool's routers: the router's own
/// `routing.warmup`, replaced by the operator's when its policy sets one.
#[derive(Debug)]
pub struct Source {
    own: Mutex<Option<Arc<Warmup>>>,
    pub(super) effective: watch::Sender<Option<Arc<Warmup>>>,
    routers: Mutex<Arc<[String]>>,
    /// Where to report sent warm-ups; none without the operator.
    report_to: Mutex<Option<ReportTarget>>,
    /// Each prefix's marker block and when a request with it last went to
    /// each of its owners (`skipped_resident`); empty without warm-ups.
    touches: Mutex<Vec<Touches>>,
    /// Whether `touches` has any prefix: requests skip its lock otherwise.
    watching: AtomicBool,
}

/// A prefix's requests at its owners.
#[derive(Debug, Default)]
struct Touches {
    /// A request whose chain has `hash` at `block` starts with the prefix
    /// (all but its last block or two, which the template's end may
    /// change).
    block: usize,
    hash: u64,
    /// Its owners, and when each last got such a request, Unix ms.
    owners: Vec<(Arc<str>, Option<u64>)>,
}

impl Default for Source {
    fn default() -> Self {
        Source {
            own: Mutex::new(None),
            effective: watch::Sender::new(None),
            routers: Mutex::new(Arc::from([])),
            report_to: Mutex::new(None),
            touches: Mutex::new(Vec::new()),
            watching: AtomicBool::new(false),
        }
    }
}

impl Source {
    /// The router's own `routing.warmup`, in effect until the operator
    /// sets one.
    pub fn set_own(&self, warmup: Option<Warmup>) {
        let warmup = warmup.map(Arc::new);
        *self.own.lock().unwrap_or_else(|e| e.into_inner()) = warmup.clone();
        self.effective.send_replace(warmup);
    }

    /// The operator's warm-ups: `None` or no prefixes, the router's own.
    /// Returns whether the effective ones changed.
    pub fn set_operator(&self, warmup: Option<Warmup>) -> bool {
        let warmup = match warmup.filter(|w| !w.prefixes.is_empty()) {
            Some(w) => Some(Arc::new(w)),
            None => self.own.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        };
        self.effective.send_if_modified(|current| {
            let changed = *current != warmup;
            *current = warmup;
            changed
        })
    }

    /// The pool's router pods, as the operator names them.
    pub fn set_routers(&self, routers: &[String]) {
        let mut current = self.routers.lock().unwrap_or_else(|e| e.into_inner());
        if **current != *routers {
            *current = Arc::from(routers);
        }
    }

    /// Where to report sent warm-ups: the operator's status writer.
    pub fn set_report_to(&self, target: Option<ReportTarget>) {
        *self.report_to.lock().unwrap_or_else(|e| e.into_inner()) = target;
    }

    pub(super) fn report_to(&self) -> Option<ReportTarget> {
        self.report_to
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A request whose blocks hash to `chain` went to `endpoint`: it
    /// touched the prefixes it starts with there. Without warm-ups it takes no lock.
    pub(crate) fn touched(&self, chain: &[u64], endpoint: &Arc<str>) {
        if !self.watching.load(Ordering::Relaxed) {
            return;
        }
        let mut touches = self.touches.lock().unwrap_or_else(|e| e.into_inner());
        for t in touches.iter_mut() {
            if chain.get(t.block) != Some(&t.hash) {
                continue;
            }
            if let Some(owner) = t.owners.iter_mut().find(|o| o.0 == *endpoint) {
                owner.1 = Some(wall_ms());
            }
        }
    }

    /// Forgets every touch; `prefixes` prefixes are watched from now.
    pub(super) fn reset_touches(&self, prefixes: usize) {
        let mut touches = self.touches.lock().unwrap_or_else(|e| e.into_inner());
        *touches = (0..prefixes).map(|_| Touches::default()).collect();
        self.watching.store(prefixes > 0, Ordering::Relaxed);
    }

    /// Watches the prefix at `i` for requests to `owners`, by its block at
    /// `block` hashing to `hash`; keeps what its owners already had.
    pub(super) fn watch(&self, i: usize, (block, hash): (usize, u64), owners: &[Arc<str>]) {
        let mut touches = self.touches.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = touches.get_mut(i) else {
            return;
        };
        let same = t.block == block && t.hash == hash;
        let owners = owners.iter().map(|o| {
            let last = t.owners.iter().find(|(name, _)| name == o);
            (o.clone(), last.and_then(|l| l.1).filter(|_| same))
        });
        *t = Touches {
            block,
            hash,
            owners: owners.collect(),
        };
    }

    /// When a request with the prefix at `i` last went to `owner`.
    pub(super) fn last_touch(&self, i: usize, owner: &Arc<str>) -> Option<u64> {
        let touches = self.touches.lock().unwrap_or_else(|e| e.into_inner());
        let t = touches.get(i)?;
        t.owners.iter().find(|o| o.0 == *owner)?.1
    }

    /// The warm-ups in effect.
    pub fn current(&self) -> Option<Arc<Warmup>> {
        self.effective.borrow().clone()
    }

    /// The pool's router pods, as the operator names them.
    pub fn routers(&self) -> Arc<[String]> {
        self.routers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
