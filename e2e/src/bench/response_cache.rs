//! What the `kvroute-response-cache` target measures besides wrk's runs:
//! a streamed hit's time to first byte (wrk sees only whole responses),
//! and the share of its requests the cache answered, from the router's
//! metrics, so a run whose requests were not hits is never reported as
//! the cost of a hit.
//!
//! Not here: the router's configuration and the storable upstream
//! ([`super::targets`]).

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use serde::Serialize;

use super::targets;

/// The timed streamed requests, one after another on one connection.
pub const TIMED: usize = 1000;

/// The lowest share of hits a run may have.
const MIN_HIT_SHARE: f64 = 0.99;

/// One repetition's figures.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CacheRun {
    /// Hits among the requests the cache saw (every one of the run's).
    pub hits: u64,
    /// Requests the cache saw: hit, miss, bypass or error.
    pub requests: u64,
    /// A streamed hit's time to first byte: median, ms.
    pub ttfb_p50_ms: f64,
    /// 99th percentile, ms.
    pub ttfb_p99_ms: f64,
}

impl CacheRun {
    /// The share of hits.
    pub fn hit_share(&self) -> f64 {
        self.hits as f64 / self.requests.max(1) as f64
    }
}

/// Times [`TIMED`] streamed requests of `body` (temperature 0, `stream:
/// true`) to `url` after one untimed one, which stores the answer: `body`
/// is one the wrk runs do not send, so it is a streamed miss, and every
/// timed request a hit only if the streamed answer was stored. Time to
/// first byte: from sending the request to its first body bytes (the
/// first event). Any timed request that is not a hit is an error.
pub fn time_to_first_byte(url: &str, body: &str) -> anyhow::Result<(f64, f64)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = reqwest::Client::builder().no_proxy().build()?;
    runtime.block_on(async {
        let mut times = Vec::with_capacity(TIMED);
        for i in 0..=TIMED {
            let start = Instant::now();
            let mut response = client
                .post(url)
                .header("content-type", "application/json")
                .header("x-bench-stream", "1")
                .body(body.to_owned())
                .send()
                .await?
                .error_for_status()?;
            let first = response.chunk().await?;
            let ttfb = start.elapsed();
            let result = response
                .headers()
                .get("x-kvroute-response-cache")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_owned();
            let mut last = first.unwrap_or_default();
            while let Some(chunk) = response.chunk().await? {
                last = chunk;
            }
            if i == 0 {
                continue;
            }
            ensure!(
                result == "hit",
                "streamed request {i} of {TIMED} with the same body was a {result}, not a hit: the first streamed answer was not stored"
            );
            ensure!(
                last.ends_with(b"data: [DONE]\n\n"),
                "a streamed hit did not end with data: [DONE]"
            );
            times.push(ttfb);
        }
        Ok((
            percentile(&mut times, 0.50),
            percentile(&mut times, 0.99),
        ))
    })
}

/// Reads `kvroute_response_cache_requests_total` from the router's admin
/// API at `admin`: (hits, requests). Fails, loudly, below 99 % hits.
pub fn hits(admin: &str) -> anyhow::Result<(u64, u64)> {
    let metrics = targets::get_text(&format!("{admin}/metrics"))?;
    let (mut hits, mut requests) = (0u64, 0u64);
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_response_cache_requests_total{"))
    {
        let n = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("reading {line:?}"))? as u64;
        requests += n;
        if line.contains("result=\"hit\"") {
            hits += n;
        }
    }
    let share = hits as f64 / requests.max(1) as f64;
    if share < MIN_HIT_SHARE {
        bail!(
            "kvroute-response-cache: {hits} hits of {requests} requests ({:.2} %), below {} %: its figures would not be a hit's",
            share * 100.0,
            MIN_HIT_SHARE * 100.0
        );
    }
    Ok((hits, requests))
}

/// The `p` quantile of `times` (nearest rank), ms.
fn percentile(times: &mut [Duration], p: f64) -> f64 {
    times.sort_unstable();
    let Some(last) = times.len().checked_sub(1) else {
        return f64::NAN;
    };
    let rank = ((p * times.len() as f64).ceil() as usize).saturating_sub(1);
    times[rank.min(last)].as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut times: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(percentile(&mut times, 0.50), 50.0);
        assert_eq!(percentile(&mut times, 0.99), 99.0);
        assert!(percentile(&mut [], 0.5).is_nan());
    }
}
