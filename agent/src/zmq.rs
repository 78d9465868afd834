//! The subscriber: a ZMQ SUB socket on vLLM's KV events endpoint, and a
//! DEALER on its replay endpoint when a gap shows up.
//!
//! ZMQ is spoken with `zeromq` (zmq.rs), a pure-Rust implementation of
//! ZMTP 3 on tokio: no libzmq, so the agent's image needs no C library, and
//! the socket types vLLM uses (PUB/SUB, ROUTER/DEALER over TCP) are the
//! ones it implements and tests against libzmq. Its SUB socket reconnects
//! by itself when vLLM restarts.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, timeout_at};
use zeromq::{Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::events::{self, Batch, DecodeError};
use crate::metrics::Metrics;
use crate::rank::{Rank, Step};

/// The largest message accepted; larger ones are counted and skipped.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// How long a replay may take, from connecting to the end marker.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// vLLM's replay end marker: sequence -1.
const END_SEQ: [u8; 8] = [0xff; 8];

/// Where one rank's events come from.
#[derive(Clone, Debug)]
pub struct Endpoints {
    /// The PUB endpoint (`tcp://host:port`).
    pub events: String,
    /// The replay ROUTER endpoint, if vLLM serves one.
    pub replay: Option<String>,
    /// The topic prefix to subscribe to (empty: every topic).
    pub topic: String,
}

fn malformed_kind(e: &DecodeError) -> &'static str {
    match e {
        DecodeError::Frames(_) => "frames",
        DecodeError::Sequence(_) => "sequence",
        DecodeError::Msgpack(_) | DecodeError::Shape(_) => "payload",
    }
}

fn size(frames: &[bytes::Bytes]) -> usize {
    frames.iter().map(|f| f.len()).sum()
}

/// Follows one rank's events until `stop`; `quiet` after subscribing with
/// no batch, the rank counts as in sync (vLLM publishes nothing while
/// idle).
pub async fn follow(
    rank: Arc<Rank>,
    endpoints: Endpoints,
    metrics: Arc<Metrics>,
    quiet: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let r = rank.rank;
    let mut options = SocketOptions::default();
    options.no_connect_timeout();
    let mut sub = zeromq::SubSocket::with_options(options);
    tokio::select! {
        connected = sub.connect(&endpoints.events) => if let Err(e) = connected {
            tracing::error!(rank = r, endpoint = %endpoints.events, error = %e, "cannot connect to vLLM's KV events");
            return;
        },
        _ = stop.wait_for(|s| *s) => return,
    }
    if let Err(e) = sub.subscribe(&endpoints.topic).await {
        tracing::error!(rank = r, error = %e, "cannot subscribe to vLLM's KV events");
        return;
    }
    tracing::info!(rank = r, endpoint = %endpoints.events, "subscribed to vLLM's KV events");
    let quiet_at = tokio::time::sleep(quiet);
    tokio::pin!(quiet_at);
    let mut quieted = false;
    loop {
        let message = tokio::select! {
            m = sub.recv() => m,
            _ = &mut quiet_at, if !quieted => {
                quieted = true;
                rank.quiet();
                continue;
            }
            _ = stop.wait_for(|s| *s) => return,
        };
        let frames = match message {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(rank = r, error = %e, "KV events socket");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if size(&frames) > MAX_MESSAGE_BYTES {
            metrics.malformed(r, "oversized");
            continue;
        }
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let message = match events::decode_message(&refs) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(rank = r, error = %e, "skipping a malformed KV events message");
                metrics.malformed(r, malformed_kind(&e));
                continue;
            }
        };
        if let Step::Replay { from, pending } = rank.live(message) {
            tracing::info!(
                rank = r,
                from,
                to = pending.seq - 1,
                "gap in KV events: asking for a replay"
            );
            if let Some(endpoint) = &endpoints.replay {
                match replay(endpoint, from, &metrics, r).await {
                    Ok(batches) => {
                        for (seq, batch) in &batches {
                            rank.replayed(*seq, batch);
                        }
                    }
                    Err(e) => tracing::warn!(rank = r, error = %e, "KV events replay failed"),
                }
            }
            rank.after_replay(pending);
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The socket failed.
    #[error("replay socket {endpoint}: {source}")]
    Socket {
        /// The replay endpoint.
        endpoint: String,
        /// Why.
        source: zeromq::ZmqError,
    },
    /// No end marker within [`REPLAY_TIMEOUT`].
    #[error("no end of replay from {0} within {REPLAY_TIMEOUT:?}")]
    Timeout(String),
}

/// Asks vLLM's replay socket for every batch from `from` on: request
/// `["", from]`; replies `["", topic, seq, payload]` (vLLM ≥ 0.31) or
/// `["", seq, payload]` (older), then an end marker with sequence -1.
pub async fn replay(
    endpoint: &str,
    from: u64,
    metrics: &Metrics,
    rank: u32,
) -> Result<Vec<(u64, Batch)>, ReplayError> {
    let deadline = Instant::now() + REPLAY_TIMEOUT;
    let socket_error = |source| ReplayError::Socket {
        endpoint: endpoint.to_owned(),
        source,
    };
    let timed_out = |_| ReplayError::Timeout(endpoint.to_owned());
    let mut dealer = zeromq::DealerSocket::new();
    timeout_at(deadline, dealer.connect(endpoint))
        .await
        .map_err(timed_out)?
        .map_err(socket_error)?;
    let request = ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .expect("two frames");
    dealer.send(request).await.map_err(socket_error)?;
    let mut batches = Vec::new();
    loop {
        let reply = timeout_at(deadline, dealer.recv())
            .await
            .map_err(timed_out)?
            .map_err(socket_error)?
            .into_vec();
        let frames = match reply.split_first() {
            Some((empty, rest)) if empty.is_empty() => rest,
            _ => reply.as_slice(),
        };
        let (seq, payload) = match frames {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => {
                metrics.malformed(rank, "frames");
                continue;
            }
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()) else {
            metrics.malformed(rank, "sequence");
            continue;
        };
        if seq == END_SEQ {
            return Ok(batches);
        }
        if payload.len() > MAX_MESSAGE_BYTES {
            metrics.malformed(rank, "oversized");
            continue;
        }
        match events::decode_batch(payload) {
            Ok(batch) => batches.push((u64::from_be_bytes(seq), batch)),
            Err(e) => metrics.malformed(rank, malformed_kind(&e)),
        }
    }
}
