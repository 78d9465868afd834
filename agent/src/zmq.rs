//! The subscriber: a SUB connection to vLLM's KV events endpoint, and a
//! DEALER one to its replay endpoint when a gap shows up.
//!
//! ZMQ is spoken by [`crate::zmtp`], the agent's own reader of ZMTP 3
//! frames, not by the `zeromq` crate: that crate buffers a whole message,
//! however large, before a size can be checked (see `zmtp`'s docs for
//! why and what it costs). Here every message is held to
//! [`MAX_MESSAGE_BYTES`] and [`MAX_FRAMES`] while it is read; one over
//! them is read past, counted (`kvroute_agent_malformed_total`, `oversized`
//! or `frames`) and skipped, a gap like any other.
//!
//! Memory held at once, per rank: one message (at most
//! [`MAX_MESSAGE_BYTES`]) and its decoded batch. Replayed batches are
//! applied one by one as they arrive, never gathered, so a replay of any
//! length holds no more. While the replay runs, the live connection is not
//! read: its bytes wait in the kernel's socket buffers and then in vLLM's
//! publisher, whose high-water mark drops what does not fit (a gap the
//! next replay fills).
//!
//! The SUB connection reconnects, with a backoff from 100 ms doubling to
//! [`MAX_RECONNECT_DELAY`], whenever it fails or the peer breaks the
//! protocol; vLLM restarting looks the same.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, timeout_at};

use crate::events::{self, DecodeError};
use crate::metrics::Metrics;
use crate::rank::{Rank, Step};
use crate::zmtp::{self, Connection, Limits, Over, Received, Refusal, SocketType, ZmtpError};

/// The largest message accepted, over all its frames; larger ones are
/// read past unkept, counted and skipped.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The most frames a message may have: vLLM sends 3 live (topic,
/// sequence, payload) and 4 or 5 in a replay reply.
pub const MAX_FRAMES: usize = 8;

/// How long a replay may take, from connecting to the end marker.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest wait between two attempts to connect to vLLM's events.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);

const LIMITS: Limits = Limits {
    max_message_bytes: MAX_MESSAGE_BYTES,
    max_frames: MAX_FRAMES,
};

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
        DecodeError::TooManyValues => "values",
    }
}

/// Counts a refused message and logs it, throttled.
fn refused(metrics: &Metrics, rank: u32, r: Refusal, from: &'static str) {
    let kind = match r.over {
        Over::Bytes => "oversized",
        Over::Frames => "frames",
    };
    metrics.malformed(rank, kind);
    if let Some(left_out) = metrics.log_allowed(rank, kind) {
        tracing::warn!(
            rank,
            from,
            bytes = r.bytes,
            frames = r.frames,
            max_bytes = MAX_MESSAGE_BYTES,
            max_frames = MAX_FRAMES,
            left_out,
            "refused a KV events message over the limits: read past, not kept"
        );
    }
}

/// Counts a malformed message and logs it, throttled.
fn malformed(metrics: &Metrics, rank: u32, e: &DecodeError) {
    let kind = malformed_kind(e);
    metrics.malformed(rank, kind);
    if let Some(left_out) = metrics.log_allowed(rank, kind) {
        tracing::warn!(rank, error = %e, left_out, "skipping a malformed KV events message");
    }
}

/// Connects the SUB side, retrying with a backoff; `None` on `stop`.
async fn subscribe(
    rank: u32,
    endpoints: &Endpoints,
    metrics: &Metrics,
    stop: &mut watch::Receiver<bool>,
) -> Option<Connection> {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = zmtp::connect(
            &endpoints.events,
            SocketType::Sub,
            endpoints.topic.as_bytes(),
            LIMITS,
        );
        let error = tokio::select! {
            c = attempt => match c {
                Ok(c) => return Some(c),
                Err(e) => e,
            },
            _ = stop.wait_for(|s| *s) => return None,
        };
        if let Some(left_out) = metrics.log_allowed(rank, "connect") {
            tracing::warn!(rank, endpoint = %endpoints.events, error = %error, left_out, "cannot subscribe to vLLM's KV events yet");
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => return None,
        }
        delay = (delay * 2).min(MAX_RECONNECT_DELAY);
    }
}

/// Follows one rank's events until `stop`; `quiet` after first subscribing
/// with no batch, the rank counts as in sync (vLLM publishes nothing while
/// idle).
pub async fn follow(
    rank: Arc<Rank>,
    endpoints: Endpoints,
    metrics: Arc<Metrics>,
    quiet: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let r = rank.rank;
    let mut quiet_started = false;
    loop {
        let Some(mut sub) = subscribe(r, &endpoints, &metrics, &mut stop).await else {
            return;
        };
        tracing::info!(rank = r, endpoint = %endpoints.events, "subscribed to vLLM's KV events");
        if !std::mem::replace(&mut quiet_started, true) {
            // Apart from the reads: a read cut off half-way would leave
            // the connection out of step.
            let (rank, mut stop) = (rank.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(quiet) => rank.quiet(),
                    _ = stop.wait_for(|s| *s) => {}
                }
            });
        }
        let error = loop {
            let received = tokio::select! {
                m = sub.recv() => m,
                _ = stop.wait_for(|s| *s) => return,
            };
            let frames = match received {
                Ok(Received::Message(frames)) => frames,
                Ok(Received::Refused(refusal)) => {
                    refused(&metrics, r, refusal, "live");
                    continue;
                }
                Err(e) => break e,
            };
            let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
            let message = match events::decode_message(&refs) {
                Ok(m) => m,
                Err(e) => {
                    malformed(&metrics, r, &e);
                    continue;
                }
            };
            drop(frames);
            if let Step::Replay { from, pending } = rank.live(message) {
                if let Some(left_out) = metrics.log_allowed(r, "gap") {
                    tracing::info!(
                        rank = r,
                        from,
                        to = pending.seq - 1,
                        left_out,
                        "gap in KV events: asking for a replay"
                    );
                }
                if let Some(endpoint) = &endpoints.replay {
                    match replay(endpoint, from, &rank, &metrics).await {
                        Ok(applied) => tracing::debug!(rank = r, applied, "replayed"),
                        Err(e) => {
                            if let Some(left_out) = metrics.log_allowed(r, "replay") {
                                tracing::warn!(rank = r, error = %e, left_out, "KV events replay failed");
                            }
                        }
                    }
                }
                rank.after_replay(pending);
            }
        };
        if let Some(left_out) = metrics.log_allowed(r, "connection") {
            tracing::warn!(rank = r, error = %error, left_out, "lost vLLM's KV events: reconnecting");
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The connection failed.
    #[error("replay socket {endpoint}: {source}")]
    Socket {
        /// The replay endpoint.
        endpoint: String,
        /// Why.
        source: ZmtpError,
    },
    /// No end marker within [`REPLAY_TIMEOUT`].
    #[error("no end of replay from {0} within {REPLAY_TIMEOUT:?}")]
    Timeout(String),
}

/// Asks vLLM's replay socket for every batch from `from` on and applies
/// each to `rank` as it arrives ([`Rank::replayed`]); returns how many
/// came. Request `["", from]`; replies `["", topic, seq, payload]` (vLLM
/// ≥ 0.31) or `["", seq, payload]` (older), then an end marker with
/// sequence -1.
pub async fn replay(
    endpoint: &str,
    from: u64,
    rank: &Rank,
    metrics: &Metrics,
) -> Result<u64, ReplayError> {
    let r = rank.rank;
    let deadline = Instant::now() + REPLAY_TIMEOUT;
    let socket_error = |source| ReplayError::Socket {
        endpoint: endpoint.to_owned(),
        source,
    };
    let timed_out = |_| ReplayError::Timeout(endpoint.to_owned());
    let mut dealer = timeout_at(
        deadline,
        zmtp::connect(endpoint, SocketType::Dealer, b"", LIMITS),
    )
    .await
    .map_err(timed_out)?
    .map_err(socket_error)?;
    timeout_at(deadline, dealer.send(&[b"", &from.to_be_bytes()]))
        .await
        .map_err(timed_out)?
        .map_err(socket_error)?;
    let mut applied = 0;
    loop {
        let reply = match timeout_at(deadline, dealer.recv())
            .await
            .map_err(timed_out)?
            .map_err(socket_error)?
        {
            Received::Message(frames) => frames,
            Received::Refused(refusal) => {
                refused(metrics, r, refusal, "replay");
                continue;
            }
        };
        let frames = match reply.split_first() {
            Some((empty, rest)) if empty.is_empty() => rest,
            _ => reply.as_slice(),
        };
        let (seq, payload) = match frames {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => {
                malformed(metrics, r, &DecodeError::Frames(frames.len()));
                continue;
            }
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()) else {
            malformed(metrics, r, &DecodeError::Sequence(seq.len()));
            continue;
        };
        if seq == END_SEQ {
            return Ok(applied);
        }
        match events::decode_batch(payload) {
            Ok(batch) => {
                drop(reply);
                rank.replayed(u64::from_be_bytes(seq), &batch);
                applied += 1;
            }
            Err(e) => malformed(metrics, r, &e),
        }
    }
}
