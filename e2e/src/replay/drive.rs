//! Sends a slice of a trace through the routers, open loop: request `i`
//! leaves at `(timestamp_i − timestamp_0) / time_scale` after the start,
//! whatever is still in flight, to the routers in turn (as behind a
//! Service), as a streamed `/v1/completions` with its token-id prompt.
//!
//! Not here: the system (`crate::suite::system`) or the figures
//! ([`super::figures`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use super::trace::{self, Request};
use crate::suite::load::{self, Outcome, Rotation, Sample};

/// Longest a request may take, end to end: an overloaded pool queues
/// prefills for minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1800);

/// When request `i` leaves, after the start.
pub fn offset(requests: &[Request], i: usize, time_scale: f64) -> Duration {
    let ms = requests[i].timestamp - requests[0].timestamp;
    Duration::from_secs_f64((ms / 1000.0 / time_scale).max(0.0))
}

/// Sends every request from `start`, measuring from `t0`; the samples in
/// request order.
pub async fn send(
    requests: Arc<[Request]>,
    block_tokens: u64,
    time_scale: f64,
    rotation: Arc<Rotation>,
    start: tokio::time::Instant,
    t0: Instant,
) -> Vec<Sample> {
    let client = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("an HTTP client without TLS builds");
    let mut in_flight = JoinSet::new();
    for i in 0..requests.len() {
        tokio::time::sleep_until(start + offset(&requests, i, time_scale)).await;
        let (requests, client, rotation) = (requests.clone(), client.clone(), rotation.clone());
        in_flight.spawn(async move {
            let body = trace::body(&requests[i], block_tokens);
            let addr = rotation.pick();
            let (sample, _) = load::stream(&client, addr, "/v1/completions", &body, &[], t0).await;
            (i, sample)
        });
    }
    let mut samples: Vec<Option<Sample>> = vec![None; requests.len()];
    while let Some(done) = in_flight.join_next().await {
        match done {
            Ok((i, sample)) => samples[i] = Some(sample),
            Err(e) => eprintln!("kvroute-e2e: a request's task failed: {e}"),
        }
    }
    samples
        .into_iter()
        .map(|s| {
            s.unwrap_or(Sample {
                t: 0.0,
                endpoint: None,
                id: None,
                outcome: Outcome::Failed("its task failed".into()),
                prompt_tokens: 0,
                cached_tokens: 0,
                ttft: None,
                itl: Vec::new(),
            })
        })
        .collect()
}
