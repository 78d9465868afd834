//! A hostile WatchCache server, for the index-bound test and the
//! `index_flood` example: it announces a huge capacity, then, when told,
//! floods fresh block hashes (`BlocksStored` on the GPU or another medium)
//! or sends one huge snapshot. Its messages keep the sequence rules, so a
//! router has no reason to resync: only its own bounds stop it.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_core::rng::SplitMix64;
use kvroute_proto::feed::{Message, Reporter, Source, new_incarnation};
use kvroute_proto::v1::cache_reporter_server::CacheReporterServer;
use kvroute_proto::v1::{
    BlocksStored, CacheConfig, CacheSnapshot, CacheUpdate, cache_update::Update,
};
use tokio::sync::{mpsc, watch};
use tonic::Status;

/// What the server sends after its first (empty) snapshot.
#[derive(Clone, Debug)]
pub enum Attack {
    /// `messages` × `per_message` fresh hashes stored on `medium` (empty:
    /// the GPU cache), as fast as the subscriber reads them.
    Flood {
        medium: String,
        per_message: usize,
        messages: usize,
    },
    /// One snapshot of `blocks` fresh hashes.
    Snapshot { blocks: usize },
}

/// The server's handle.
pub struct FakeCache {
    /// Where it serves WatchCache.
    pub addr: SocketAddr,
    attack: watch::Sender<Option<Attack>>,
    /// Blocks sent so far (in floods and snapshots).
    pub sent: Arc<AtomicU64>,
    /// Attack messages sent so far.
    pub messages: Arc<AtomicU64>,
}

struct Hostile {
    config: CacheConfig,
    attack: watch::Receiver<Option<Attack>>,
    sent: Arc<AtomicU64>,
    messages: Arc<AtomicU64>,
}

/// Fresh, well-spread hashes.
fn hashes(rng: &mut SplitMix64, n: usize) -> Vec<u64> {
    (0..n).map(|_| rng.next_u64()).collect()
}

impl Source for Hostile {
    fn subscribe(&self) -> Result<mpsc::Receiver<Message>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let (config, mut attack) = (self.config.clone(), self.attack.clone());
        let (sent, messages) = (self.sent.clone(), self.messages.clone());
        tokio::spawn(async move {
            let incarnation = new_incarnation();
            let message = |sequence, update| {
                Arc::new(CacheUpdate {
                    incarnation: incarnation.clone(),
                    sequence,
                    update: Some(update),
                })
            };
            let snapshot = |blocks| {
                Update::Snapshot(CacheSnapshot {
                    config: Some(config.clone()),
                    block_hashes: blocks,
                    ..Default::default()
                })
            };
            if tx.send(message(0, snapshot(Vec::new()))).await.is_err() {
                return;
            }
            let mut rng = SplitMix64::new(0x5eed);
            let mut sequence = 0u64;
            // Each attack once, as it is set; the stream stays open between.
            while attack.changed().await.is_ok() {
                let Some(plan) = attack.borrow_and_update().clone() else {
                    continue;
                };
                match plan {
                    Attack::Flood {
                        medium,
                        per_message,
                        messages: n,
                    } => {
                        for _ in 0..n {
                            sequence += 1;
                            let stored = Update::Stored(BlocksStored {
                                block_hashes: hashes(&mut rng, per_message),
                                medium: medium.clone(),
                                ..Default::default()
                            });
                            if tx.send(message(sequence, stored)).await.is_err() {
                                return;
                            }
                            sent.fetch_add(per_message as u64, Ordering::Relaxed);
                            messages.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Attack::Snapshot { blocks } => {
                        let update = snapshot(hashes(&mut rng, blocks));
                        if tx.send(message(sequence, update)).await.is_err() {
                            return;
                        }
                        sent.fetch_add(blocks as u64, Ordering::Relaxed);
                        messages.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        Ok(rx)
    }
}

impl FakeCache {
    /// Serves on a free loopback port, announcing `config` with a capacity
    /// of 2^62 blocks.
    pub async fn start(mut config: CacheConfig) -> FakeCache {
        config.capacity_blocks = 1 << 62;
        let (attack, attack_rx) = watch::channel(None);
        let sent = Arc::new(AtomicU64::new(0));
        let messages = Arc::new(AtomicU64::new(0));
        let source = Arc::new(Hostile {
            config,
            attack: attack_rx,
            sent: sent.clone(),
            messages: messages.clone(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service =
            CacheReporterServer::new(Reporter::new(source)).max_encoding_message_size(usize::MAX);
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        FakeCache {
            addr,
            attack,
            sent,
            messages,
        }
    }

    /// Starts `attack` on every stream (current and later ones).
    pub fn attack(&self, attack: Attack) {
        self.attack.send_replace(Some(attack));
    }
}
