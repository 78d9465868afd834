//! A listener's open connections, oldest first, within its cap: a new
//! connection at the cap takes the place of the oldest one with no request
//! in progress, which is told to close; when every one has a request in
//! progress, there is no place for it.
//!
//! Not here: serving a connection (`connection`), or counting refusals
//! and evictions (the accept loop does).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::connection::Activity;

/// A listener's open connections, oldest first, within its cap.
#[derive(Debug)]
pub(super) struct Connections {
    max: usize,
    open: Mutex<BTreeMap<u64, Arc<Connection>>>,
    next: AtomicU64,
    /// Notified when a connection leaves `open`.
    closed: Notify,
}

/// One open connection, as its listener sees it.
#[derive(Debug)]
pub(super) struct Connection {
    pub(super) activity: Arc<Activity>,
    /// Notified to close it, when a new connection needs its place.
    pub(super) evict: Notify,
}

/// A connection's place among its listener's [`Connections`], given up
/// when dropped.
#[derive(Debug)]
pub(super) struct Slot {
    open: Arc<Connections>,
    id: u64,
    pub(super) connection: Arc<Connection>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.open.open.lock().unwrap_or_else(|e| e.into_inner());
        open.remove(&self.id);
        drop(open);
        self.open.closed.notify_waiters();
    }
}

/// Whether a new connection was admitted, and what it cost.
pub(super) enum Admitted {
    /// Within the cap.
    Free(Slot),
    /// In the place of the oldest connection with no request in progress,
    /// which is told to close.
    Evicted(Slot),
}

impl Connections {
    pub(super) fn new(max: usize) -> Self {
        Connections {
            max: max.max(1),
            open: Mutex::default(),
            next: AtomicU64::new(0),
            closed: Notify::new(),
        }
    }

    /// A place for a new connection, or `None` when every open one has a
    /// request in progress.
    pub(super) fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mut evicted = false;
        if open.len() >= self.max {
            let idle = open
                .iter()
                .find(|(_, c)| c.activity.active.load(Ordering::SeqCst) == 0)
                .map(|(id, _)| *id)?;
            if let Some(old) = open.remove(&idle) {
                old.evict.notify_one();
            }
            evicted = true;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let connection = Arc::new(Connection {
            activity: Arc::new(Activity::new()),
            evict: Notify::new(),
        });
        open.insert(id, connection.clone());
        let slot = Slot {
            open: self.clone(),
            id,
            connection,
        };
        Some(if evicted {
            Admitted::Evicted(slot)
        } else {
            Admitted::Free(slot)
        })
    }

    /// Resolves once every admitted connection has closed (or was told to).
    pub(super) async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            if self
                .open
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return;
            }
            closed.await;
        }
    }
}
