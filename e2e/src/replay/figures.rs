//! What one live run measured, in trace seconds: the token hit rate as the
//! engines reported it, TTFT as clients saw it, and the requests that
//! failed or were refused.

use std::ops::Range;

use serde::Serialize;

use crate::suite::load::{Outcome, Sample};

/// The figures of one policy's live run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Live {
    /// Cached over prompt tokens, as the engines reported them, of the
    /// requests that completed.
    pub hit: f64,
    /// TTFT of the requests that completed, times the time scale.
    pub ttft_mean_s: f64,
    /// Its median (nearest rank).
    pub ttft_p50_s: f64,
    /// Its 99th percentile (nearest rank).
    pub ttft_p99_s: f64,
    /// Requests with no answer, or whose stream broke.
    pub failed: usize,
    /// Requests answered with an error status (an engine's 400 for a
    /// prompt it cannot hold, a router's 429 or 503).
    pub refused: usize,
}

impl Live {
    /// The figures of `samples`, TTFT scaled by `time_scale`.
    pub fn of(samples: &[Sample], time_scale: f64) -> Live {
        let mut ttfts: Vec<f64> = samples
            .iter()
            .filter(|s| s.outcome == Outcome::Ok)
            .filter_map(|s| s.ttft)
            .map(|t| t * time_scale)
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let mean = if ttfts.is_empty() {
            0.0
        } else {
            ttfts.iter().sum::<f64>() / ttfts.len() as f64
        };
        Live {
            hit: hit(samples),
            ttft_mean_s: mean,
            ttft_p50_s: percentile(&ttfts, 50.0),
            ttft_p99_s: percentile(&ttfts, 99.0),
            failed: samples
                .iter()
                .filter(|s| !matches!(s.outcome, Outcome::Ok | Outcome::Refused(_)))
                .count(),
            refused: samples
                .iter()
                .filter(|s| matches!(s.outcome, Outcome::Refused(_)))
                .count(),
        }
    }
}

/// Cached over prompt tokens of the requests that completed.
pub fn hit(samples: &[Sample]) -> f64 {
    let ok = samples.iter().filter(|s| s.outcome == Outcome::Ok);
    let (cached, prompt) = ok.fold((0u64, 0u64), |(c, p), s| {
        (c + s.cached_tokens, p + s.prompt_tokens)
    });
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

/// The window of a scale-out: from the middle request, the next tenth of
/// the slice (as `kvroute replay` forks its runs).
pub fn scale_out_window(requests: usize) -> Range<usize> {
    let mid = requests / 2;
    mid..(mid + requests.div_ceil(10)).min(requests)
}

/// The nearest-rank percentile `p` of sorted `values` (0 when empty).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(outcome: Outcome, prompt: u64, cached: u64, ttft: Option<f64>) -> Sample {
        Sample {
            t: 0.0,
            endpoint: None,
            id: None,
            outcome,
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft,
            itl: Vec::new(),
        }
    }

    #[test]
    fn figures_count_completed_requests_in_trace_seconds() {
        let samples = [
            sample(Outcome::Ok, 100, 50, Some(0.1)),
            sample(Outcome::Ok, 300, 0, Some(0.3)),
            sample(Outcome::Refused(400), 0, 0, None),
            sample(Outcome::BrokeWithError, 0, 0, Some(0.2)),
        ];
        let live = Live::of(&samples, 2.0);
        assert_eq!(live.hit, 0.125);
        assert!((live.ttft_mean_s - 0.4).abs() < 1e-12, "{live:?}");
        assert_eq!((live.ttft_p50_s, live.ttft_p99_s), (0.2, 0.6));
        assert_eq!((live.failed, live.refused), (1, 1));
    }

    #[test]
    fn the_scale_out_window_is_a_tenth_from_the_middle() {
        assert_eq!(scale_out_window(2000), 1000..1200);
        assert_eq!(scale_out_window(5), 2..3);
    }
}
