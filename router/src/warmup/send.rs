//! Sending one warm-up: its deadline, the bounds on warm-ups in flight,
//! and the request to its owner. Not when or whether one is sent (the
//! core's rules, [`kvroute_core::warmup`]) nor what its answer counts as
//! ([`super`]).
//!
//! Each warm-up runs in its own task, so that an owner that never answers
//! delays no other owner's warm-ups:
//! 1. **Deadline** ([`deadline`]): [`FLOOR`] plus [`MULTIPLE`] × the
//!    policy's predicted time to first token of the warm-up at its owner,
//!    at most [`CAP`]. An owner that misses it has failed the warm-up.
//! 2. **Bounds** ([`Seats`]): at most [`PER_OWNER`] warm-ups in flight to
//!    one owner and [`IN_ALL`] in all. A warm-up due beyond either is not
//!    sent (`skipped_in_flight`): an owner that answers nothing costs at
//!    most [`PER_OWNER`] connections, whatever the period.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use serde_json::Value;

use crate::request::hit_rate::Usage;
use crate::upstream::Upstream;

/// Warm-ups in flight to one owner, at most.
pub(super) const PER_OWNER: usize = 4;
/// Warm-ups in flight in all, at most.
pub(super) const IN_ALL: usize = 32;
/// The deadline's floor: connecting, the engine's scheduling step, and a
/// prefill rate the router has not measured yet.
pub(super) const FLOOR: Duration = Duration::from_secs(2);
/// The deadline's room for a prediction that is off.
pub(super) const MULTIPLE: f64 = 4.0;
/// The deadline's cap, whatever the prediction.
pub(super) const CAP: Duration = Duration::from_secs(30);
/// The most of a warm-up's answer read.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// How long a warm-up predicted to see its first token after `ttft` may
/// take (rule 1). A warm-up asks for one token, so its answer comes when
/// its prefill is done: a healthy owner answers within a small multiple of
/// the prediction, which counts the owner's queue (and warm-ups go only to
/// owners whose queue is short, `skipped_busy`). A fixed timeout long
/// enough for the longest prefix would let a hung owner hold each warm-up
/// that long.
pub(super) fn deadline(ttft: Duration) -> Duration {
    let scaled = Duration::try_from_secs_f64(ttft.as_secs_f64() * MULTIPLE).unwrap_or(CAP);
    FLOOR.saturating_add(scaled).min(CAP)
}

/// The warm-ups in flight, per owner and in all (rule 2).
#[derive(Clone, Debug, Default)]
pub(super) struct Seats(Arc<Mutex<Taken>>);

#[derive(Debug, Default)]
struct Taken {
    all: usize,
    /// Owners with a warm-up in flight only.
    by_owner: HashMap<Arc<str>, usize>,
}

/// A warm-up in flight to `owner`; dropping it ends it.
#[must_use]
#[derive(Debug)]
pub(super) struct Seat {
    seats: Seats,
    owner: Arc<str>,
}

impl Seats {
    /// A seat for a warm-up to `owner`, unless [`PER_OWNER`] are in flight
    /// there or [`IN_ALL`] in all.
    pub(super) fn take(&self, owner: &Arc<str>) -> Option<Seat> {
        let mut taken = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let there = taken.by_owner.get(owner).copied().unwrap_or(0);
        if there >= PER_OWNER || taken.all >= IN_ALL {
            return None;
        }
        taken.all += 1;
        taken.by_owner.insert(owner.clone(), there + 1);
        Some(Seat {
            seats: self.clone(),
            owner: owner.clone(),
        })
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut taken = (self.seats.0.lock()).unwrap_or_else(|e| e.into_inner());
        taken.all = taken.all.saturating_sub(1);
        if let Some(n) = taken.by_owner.get_mut(&self.owner) {
            *n -= 1;
            if *n == 0 {
                taken.by_owner.remove(&self.owner);
            }
        }
    }
}

/// Sends a warm-up `body` to `path` at `owner` (`x-request-id`
/// `warmup-<prefix>`): the engine's usage, or why there is none, within
/// `deadline`.
pub(super) async fn send(
    client: Upstream,
    (owner, path): (SocketAddr, &str),
    body: Bytes,
    prefix: &str,
    deadline: Duration,
) -> Result<Usage, String> {
    let request = Request::post(format!("http://{owner}{path}"))
        .header("content-type", "application/json")
        .header("x-request-id", format!("warmup-{prefix}"))
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let answer = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await;
        let body = body.map_err(|e| e.to_string())?.to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            return Err(format!("answered {status}: {text}"));
        }
        let answer: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        let usage = &answer["usage"];
        Ok(Usage {
            prompt_tokens: (usage["prompt_tokens"].as_u64()).ok_or("its answer has no usage")?,
            cached_tokens: (usage["prompt_tokens_details"]["cached_tokens"].as_u64()).unwrap_or(0),
        })
    };
    tokio::time::timeout(deadline, answer)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {deadline:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_scales_with_the_predicted_prefill_within_its_floor_and_cap() {
        assert_eq!(deadline(Duration::ZERO), FLOOR);
        assert_eq!(deadline(Duration::from_millis(500)), Duration::from_secs(4));
        assert_eq!(deadline(Duration::from_secs(60)), CAP);
        assert_eq!(deadline(Duration::MAX), CAP);
    }

    #[test]
    fn seats_are_bounded_per_owner_and_in_all_and_come_back_when_dropped() {
        let seats = Seats::default();
        let hung: Arc<str> = Arc::from("hung");
        let held: Vec<Seat> = (0..PER_OWNER).map(|_| seats.take(&hung).unwrap()).collect();
        assert!(seats.take(&hung).is_none(), "the owner's bound");
        let others: Vec<Seat> = (0..IN_ALL - PER_OWNER)
            .map(|i| seats.take(&Arc::from(format!("other-{}", i % 7))).unwrap())
            .collect();
        assert!(
            seats.take(&Arc::from("fresh")).is_none(),
            "the bound in all"
        );
        drop(held);
        assert!(seats.take(&hung).is_some());
        drop(others);
        let taken = seats.0.lock().unwrap();
        assert_eq!((taken.all, taken.by_owner.len()), (0, 0), "nothing left");
    }
}
