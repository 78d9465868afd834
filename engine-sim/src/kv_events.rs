//! vLLM's KV cache events, published as vLLM's `ZmqEventPublisher` does:
//! a PUB socket sending `[topic, 8-byte big-endian sequence, msgpack
//! KVEventBatch]` per batch, numbered from 0, and a ROUTER replay socket
//! that answers `["", start_seq]` with every buffered batch from
//! `start_seq` on (`["", topic, seq, payload]` each), then the end marker
//! `["", "", ff×8, ""]`. Batches use vLLM ≥ 0.31's tagged form; the
//! captured vLLM samples in `kvroute-agent`'s tests are the specification.
//!
//! With it, the simulator stands in for vLLM in front of `kvroute-agent`.
//! Tests can make the publisher skip batches (see [`Fault`]) to create the
//! gaps a lossy PUB socket creates.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::{mpsc, watch};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A change to the set of cached blocks, with what vLLM's events say of
/// stored blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolEvent {
    /// Blocks cached, in chain order; `parent` is the hash before the first.
    Stored {
        /// The blocks.
        hashes: Vec<u64>,
        /// The hash of the block before the first, if any.
        parent: Option<u64>,
        /// Their tokens, block after block.
        token_ids: Vec<u32>,
        /// Each block's extra keys as vLLM's events list them: the LoRA
        /// adapter's name, then the cache salt on block 0.
        extra_keys: Vec<Vec<String>>,
        /// The LoRA adapter (vLLM's `lora_id` and `lora_name`), if any.
        lora: Option<(u64, String)>,
    },
    /// Blocks evicted.
    Removed(Vec<u64>),
    /// Every cached block dropped.
    Cleared,
}

/// vLLM's replay end marker: sequence -1 as 8 bytes.
const END_SEQ: [u8; 8] = [0xff; 8];

/// Batches queued for the publisher before new ones are dropped (vLLM's
/// `max_queue_size` default).
const QUEUE: usize = 100_000;

/// Where and how to publish.
#[derive(Clone, Debug)]
pub struct Endpoints {
    /// The PUB socket's bind address (`tcp://host:port`; `*` is any
    /// address).
    pub endpoint: String,
    /// The ROUTER replay socket's bind address, if any.
    pub replay_endpoint: Option<String>,
    /// The topic frame.
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
}

/// A fault to inject into the published stream, for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Do not send the next `n` batches live; replay still has them (a
    /// subscriber's gap that replay fills).
    SkipLive(u32),
    /// Send the next `n` batches neither live nor to replay (a gap replay
    /// cannot fill).
    Lose(u32),
}

enum Command {
    Batch(Vec<u8>),
    Fault(Fault),
    /// The engine restarted: numbering starts over and the buffer empties.
    Restart,
}

/// The publisher's handle. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Command>,
    /// The bound addresses (PUB, replay), as `tcp://ip:port`.
    pub bound: (String, Option<String>),
}

/// Why the sockets could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("binding the KV events socket {endpoint}: {source}")]
pub struct BindError {
    endpoint: String,
    source: zeromq::ZmqError,
}

async fn bind<S: Socket>(socket: &mut S, endpoint: &str) -> Result<String, BindError> {
    // vLLM's `tcp://*:port` means every address; the ZMQ crate wants one.
    let spelled = endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1);
    socket
        .bind(&spelled)
        .await
        .map(|e| e.to_string())
        .map_err(|source| BindError {
            endpoint: endpoint.to_owned(),
            source,
        })
}

impl Publisher {
    /// Binds the sockets and starts publishing.
    pub async fn start(endpoints: Endpoints) -> Result<Publisher, BindError> {
        let mut live = zeromq::PubSocket::new();
        let pub_addr = bind(&mut live, &endpoints.endpoint).await?;
        let buffer = Arc::new(Mutex::new(VecDeque::<(u64, Bytes)>::new()));
        let topic = Bytes::from(endpoints.topic.clone().into_bytes());
        // Dropped when publishing ends (every handle gone): replay ends too.
        let (publishing, published) = watch::channel(());
        let replay_addr = match &endpoints.replay_endpoint {
            Some(endpoint) => {
                let mut replay = zeromq::RouterSocket::new();
                let addr = bind(&mut replay, endpoint).await?;
                tokio::spawn(serve_replay(
                    replay,
                    buffer.clone(),
                    topic.clone(),
                    published,
                ));
                Some(addr)
            }
            None => None,
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(async move {
            publish(live, rx, buffer, topic, endpoints.buffer_steps).await;
            drop(publishing);
        });
        Ok(Publisher {
            tx,
            bound: (pub_addr, replay_addr),
        })
    }

    /// Queues one batch; dropped (a gap subscribers see) if the queue is
    /// full.
    pub fn send(&self, batch: Vec<u8>) {
        if self.tx.try_send(Command::Batch(batch)).is_err() {
            tracing::warn!("KV events queue full: a batch is dropped");
        }
    }

    /// Injects a fault into what follows.
    pub fn inject(&self, fault: Fault) {
        let _ = self.tx.try_send(Command::Fault(fault));
    }

    /// Starts numbering over with an empty replay buffer, as a restarted
    /// vLLM does.
    pub fn restart(&self) {
        let _ = self.tx.try_send(Command::Restart);
    }
}

async fn publish(
    mut live: zeromq::PubSocket,
    mut rx: mpsc::Receiver<Command>,
    buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    topic: Bytes,
    buffer_steps: usize,
) {
    let mut seq = 0u64;
    let (mut skip, mut lose) = (0u32, 0u32);
    while let Some(command) = rx.recv().await {
        let payload = match command {
            Command::Batch(payload) => Bytes::from(payload),
            Command::Fault(Fault::SkipLive(n)) => {
                skip += n;
                continue;
            }
            Command::Fault(Fault::Lose(n)) => {
                lose += n;
                continue;
            }
            Command::Restart => {
                seq = 0;
                lock(&buffer).clear();
                continue;
            }
        };
        let this = seq;
        seq += 1;
        if lose > 0 {
            lose -= 1;
            continue;
        }
        {
            let mut buffer = lock(&buffer);
            buffer.push_back((this, payload.clone()));
            while buffer.len() > buffer_steps {
                buffer.pop_front();
            }
        }
        if skip > 0 {
            skip -= 1;
            continue;
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&this.to_be_bytes()),
            payload,
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames");
        if let Err(e) = live.send(message).await {
            tracing::warn!(error = %e, "publishing KV events failed");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn serve_replay(
    mut replay: zeromq::RouterSocket,
    buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    topic: Bytes,
    mut published: watch::Receiver<()>,
) {
    loop {
        let request = tokio::select! {
            r = replay.recv() => r,
            _ = published.changed() => return,
        };
        let request = match request {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay socket");
                continue;
            }
        };
        // [client id, "", start_seq] (the ROUTER adds the id).
        let [client, _, start] = request.as_slice() else {
            tracing::warn!(frames = request.len(), "invalid KV events replay request");
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::warn!("invalid KV events replay request: the sequence is not 8 bytes");
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = lock(&buffer)
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let empty = Bytes::new();
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| {
                let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
                vec![client.clone(), empty.clone(), topic.clone(), seq, payload]
            })
            .chain(std::iter::once(vec![
                client.clone(),
                empty.clone(),
                empty.clone(),
                Bytes::from_static(&END_SEQ),
                empty.clone(),
            ]));
        for frames in replies {
            let message = ZmqMessage::try_from(frames).expect("five frames");
            if let Err(e) = replay.send(message).await {
                tracing::debug!(error = %e, "replay reply");
                break;
            }
        }
    }
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn hashes(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|&h| Value::from(h)).collect())
}

/// Encodes one `KVEventBatch` of `events` as vLLM does (tagged events,
/// GPU medium, group 0).
pub fn encode_batch(ts: f64, events: &[PoolEvent], block_size: u32, dp_rank: u32) -> Vec<u8> {
    let gpu = || Value::from("GPU");
    let events = events
        .iter()
        .map(|event| match event {
            PoolEvent::Stored {
                hashes: blocks,
                parent,
                token_ids,
                extra_keys,
                lora,
            } => {
                let extra = if extra_keys.iter().all(Vec::is_empty) {
                    Value::Nil
                } else {
                    Value::Array(
                        extra_keys
                            .iter()
                            .map(|keys| match keys.as_slice() {
                                [] => Value::Nil,
                                keys => Value::Array(
                                    keys.iter().map(|k| Value::from(k.as_str())).collect(),
                                ),
                            })
                            .collect(),
                    )
                };
                map(vec![
                    ("type", Value::from("BlockStored")),
                    ("block_hashes", hashes(blocks)),
                    ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                    (
                        "token_ids",
                        Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    ("block_size", Value::from(block_size)),
                    (
                        "lora_id",
                        lora.as_ref().map_or(Value::Nil, |l| Value::from(l.0)),
                    ),
                    ("medium", gpu()),
                    (
                        "lora_name",
                        lora.as_ref()
                            .map_or(Value::Nil, |l| Value::from(l.1.as_str())),
                    ),
                    ("extra_keys", extra),
                    ("group_idx", Value::from(0)),
                ])
            }
            PoolEvent::Removed(blocks) => map(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", hashes(blocks)),
                ("medium", gpu()),
                ("group_idx", Value::from(0)),
            ]),
            PoolEvent::Cleared => map(vec![("type", Value::from("AllBlocksCleared"))]),
        })
        .collect();
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events),
        Value::from(dp_rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}
