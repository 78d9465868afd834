//! Serving `WatchCache`: one engine's cache changes, numbered and fanned
//! out to every subscriber, each stream starting with a snapshot. Shared by
//! every reporter (engine-sim, and the agent beside vLLM), so all of them
//! keep the incarnation and sequence rules documented on
//! [`CacheUpdate`](v1::CacheUpdate) the same way.
//!
//! A [`Feed`] is plain state: its owner keeps it under the same lock as the
//! cache it describes, so a snapshot and the deltas after it can never
//! interleave wrongly. [`Reporter`] serves any [`Source`] of such streams
//! over gRPC.

use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::v1::{self, cache_update::Update};

/// A message on a stream. Shared between subscribers; each stream clones
/// it when it encodes it.
pub type Message = Arc<v1::CacheUpdate>;

/// The numbered changes of one cache and its subscribers.
#[derive(Debug)]
pub struct Feed {
    incarnation: String,
    sequence: u64,
    subscribers: Vec<mpsc::Sender<Message>>,
    buffer: usize,
}

/// A new incarnation id: 16 hex digits, unique across processes and
/// restarts (a randomly keyed hash of the time, the process and a counter).
pub fn new_incarnation() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::hash::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}", h.finish())
}

impl Feed {
    /// A feed of a new incarnation whose subscribers may fall `buffer`
    /// messages behind before their stream is ended.
    pub fn new(buffer: usize) -> Self {
        Feed {
            incarnation: new_incarnation(),
            sequence: 0,
            subscribers: Vec::new(),
            buffer: buffer.max(1),
        }
    }

    /// The current incarnation.
    pub fn incarnation(&self) -> &str {
        &self.incarnation
    }

    /// The number of the last change.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Subscribers connected.
    pub fn subscribers(&self) -> usize {
        self.subscribers.len()
    }

    fn message(&self, update: Update) -> Message {
        Arc::new(v1::CacheUpdate {
            incarnation: self.incarnation.clone(),
            sequence: self.sequence,
            update: Some(update),
        })
    }

    /// A new subscriber; `snapshot` is the cache now, sent first.
    pub fn subscribe(&mut self, snapshot: v1::CacheSnapshot) -> mpsc::Receiver<Message> {
        let (tx, rx) = mpsc::channel(self.buffer);
        if tx
            .try_send(self.message(Update::Snapshot(snapshot)))
            .is_ok()
        {
            self.subscribers.push(tx);
        }
        rx
    }

    /// A change (`stored`, `removed` or `cleared`): numbered and sent.
    pub fn change(&mut self, update: Update) {
        debug_assert!(matches!(
            update,
            Update::Stored(_) | Update::Removed(_) | Update::Cleared(_)
        ));
        self.sequence += 1;
        let message = self.message(update);
        self.send(&message);
    }

    /// A load report (not a change).
    pub fn load(&mut self, load: v1::LoadReport) {
        let message = self.message(Update::Load(load));
        self.send(&message);
    }

    /// Sends every subscriber a fresh snapshot (for example because the
    /// cache's configuration changed); each replaces what it knew.
    pub fn resnapshot(&mut self, snapshot: v1::CacheSnapshot) {
        let message = self.message(Update::Snapshot(snapshot));
        self.send(&message);
    }

    /// A new incarnation with nothing changed yet; every stream ends (its
    /// subscriber resubscribes and gets the new incarnation's snapshot).
    pub fn restart(&mut self) {
        self.incarnation = new_incarnation();
        self.sequence = 0;
        self.subscribers.clear();
    }

    /// Ends every stream (on shutdown).
    pub fn end_streams(&mut self) {
        self.subscribers.clear();
    }

    /// Sends `message` to every subscriber; one that is full or gone is
    /// dropped, which ends its stream (it resubscribes for a snapshot).
    fn send(&mut self, message: &Message) {
        self.subscribers
            .retain(|tx| tx.try_send(message.clone()).is_ok());
    }
}

/// Anything that hands out `WatchCache` streams (a [`Feed`]'s owner).
pub trait Source: Send + Sync + 'static {
    /// A new stream: a snapshot, then every change in order; or why the
    /// source cannot serve one now.
    fn subscribe(&self) -> Result<mpsc::Receiver<Message>, Status>;
}

/// Serves `CacheReporter.WatchCache` from a [`Source`].
#[derive(Debug)]
pub struct Reporter<S> {
    source: Arc<S>,
}

impl<S> Reporter<S> {
    /// A server for `source`.
    pub fn new(source: Arc<S>) -> Self {
        Reporter { source }
    }
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<v1::CacheUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl<S: Source> v1::cache_reporter_server::CacheReporter for Reporter<S> {
    type WatchCacheStream = UpdateStream;

    async fn watch_cache(
        &self,
        request: Request<v1::WatchCacheRequest>,
    ) -> Result<Response<Self::WatchCacheStream>, Status> {
        tracing::debug!(subscriber = %request.get_ref().subscriber, "WatchCache subscriber");
        let stream =
            ReceiverStream::new(self.source.subscribe()?).map(|m| Ok(Arc::unwrap_or_clone(m)));
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64]) -> Update {
        Update::Stored(v1::BlocksStored {
            block_hashes: hashes.to_vec(),
            ..Default::default()
        })
    }

    #[test]
    fn streams_start_with_a_snapshot_and_number_changes() {
        let mut feed = Feed::new(8);
        feed.change(stored(&[1]));
        let mut rx = feed.subscribe(v1::CacheSnapshot::default());
        feed.change(stored(&[2]));
        feed.load(v1::LoadReport::default());
        let got: Vec<(u64, bool)> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|m| (m.sequence, matches!(m.update, Some(Update::Snapshot(_)))))
            .collect();
        assert_eq!(got, [(1, true), (2, false), (2, false)]);
    }

    #[test]
    fn a_slow_subscriber_is_cut_off_and_a_restart_ends_every_stream() {
        let mut feed = Feed::new(2);
        let mut slow = feed.subscribe(v1::CacheSnapshot::default());
        feed.change(stored(&[1]));
        feed.change(stored(&[2]));
        assert_eq!(feed.subscribers(), 0, "the third message did not fit");
        assert_eq!(std::iter::from_fn(|| slow.try_recv().ok()).count(), 2);
        assert!(slow.try_recv().is_err(), "the stream ended");

        let before = feed.incarnation().to_owned();
        let _rx = feed.subscribe(v1::CacheSnapshot::default());
        feed.restart();
        assert_eq!(feed.subscribers(), 0);
        assert_eq!(feed.sequence(), 0);
        assert_ne!(feed.incarnation(), before);
    }
}
