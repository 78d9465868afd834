//! What one policy's run amounted to, and the comparison table. Figures
//! are the engines' own (prompt and cached tokens from their usage chunks)
//! and the client's (TTFT as measured through the router).
//!
//! The table is meant to be read by people and parsed by scripts: one row
//! per policy, the policy name first, then plain numbers.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use super::workload::Sample;

/// One policy's run, summarized.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// The policy's name.
    pub policy: String,
    /// Requests completed.
    pub requests: usize,
    /// Σ prompt tokens.
    pub prompt_tokens: u64,
    /// Σ cached prompt tokens.
    pub cached_tokens: u64,
    /// Σ cached / Σ prompt tokens of follow-up turns (second turn and
    /// later), where a conversation's own history can be cached.
    pub followup_ratio: f64,
    /// Mean TTFT, milliseconds.
    pub ttft_mean_ms: f64,
    /// 99th percentile TTFT (nearest rank), milliseconds.
    pub ttft_p99_ms: f64,
    /// Requests served per endpoint, by name.
    pub per_endpoint: BTreeMap<String, usize>,
    /// Blocks the engines evicted from their prefix caches.
    pub evicted_blocks: u64,
    /// Wall time of the run.
    pub wall: Duration,
}

impl Summary {
    /// Summarizes `samples` of `policy`'s run.
    pub fn new(policy: &str, samples: &[Sample], wall: Duration, evicted_blocks: u64) -> Self {
        let ratio = |filter: &dyn Fn(&Sample) -> bool| {
            let (cached, prompt) = samples
                .iter()
                .filter(|s| filter(s))
                .fold((0, 0), |(c, p), s| {
                    (c + s.cached_tokens, p + s.prompt_tokens)
                });
            (cached, prompt)
        };
        let (cached_tokens, prompt_tokens) = ratio(&|_| true);
        let (followup_cached, followup_prompt) = ratio(&|s| s.turn > 0);
        let mut ttfts: Vec<f64> = samples
            .iter()
            .map(|s| s.ttft.as_secs_f64() * 1000.0)
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let mut per_endpoint = BTreeMap::new();
        for s in samples {
            *per_endpoint.entry(s.endpoint.clone()).or_insert(0) += 1;
        }
        Summary {
            policy: policy.to_owned(),
            requests: samples.len(),
            prompt_tokens,
            cached_tokens,
            followup_ratio: div(followup_cached as f64, followup_prompt as f64),
            ttft_mean_ms: div(ttfts.iter().sum(), ttfts.len() as f64),
            ttft_p99_ms: percentile(&ttfts, 0.99),
            per_endpoint,
            evicted_blocks,
            wall,
        }
    }

    /// Σ cached / Σ prompt tokens, as the engines reported them.
    pub fn cached_ratio(&self) -> f64 {
        div(self.cached_tokens as f64, self.prompt_tokens as f64)
    }

    /// The busiest endpoint's requests over the mean over `endpoints`
    /// (1 is perfectly even).
    pub fn endpoint_max_over_mean(&self, endpoints: usize) -> f64 {
        let max = self.per_endpoint.values().copied().max().unwrap_or(0);
        div(max as f64 * endpoints as f64, self.requests as f64)
    }
}

fn div(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

/// The nearest-rank percentile `q` of `sorted`; 0 when empty.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Prints the comparison table, one row per policy, over `endpoints`
/// engines named `sim-0`, `sim-1`, ….
pub fn print_table(
    out: &mut impl Write,
    rows: &[Summary],
    endpoints: usize,
) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<12} {:>8} {:>12} {:>10} {:>12} {:>11} {:>8} {:>7}  {:<14} {:>8}",
        "policy",
        "requests",
        "cached_ratio",
        "followups",
        "ttft_mean_ms",
        "ttft_p99_ms",
        "evicted",
        "wall_s",
        "per_endpoint",
        "max/mean"
    )?;
    for r in rows {
        let per: Vec<String> = (0..endpoints)
            .map(|i| {
                let n = r.per_endpoint.get(&format!("sim-{i}")).copied();
                n.unwrap_or(0).to_string()
            })
            .collect();
        writeln!(
            out,
            "{:<12} {:>8} {:>12.3} {:>10.3} {:>12.1} {:>11.1} {:>8} {:>7.1}  {:<14} {:>8.2}",
            r.policy,
            r.requests,
            r.cached_ratio(),
            r.followup_ratio,
            r.ttft_mean_ms,
            r.ttft_p99_ms,
            r.evicted_blocks,
            r.wall.as_secs_f64(),
            per.join("/"),
            r.endpoint_max_over_mean(endpoints)
        )?;
    }
    writeln!(
        out,
        "(cached_ratio: cached / prompt tokens as the engines reported; followups: the same over \
         second and later turns; evicted: KV blocks evicted)"
    )
}

/// One line: how `better` compares with `base`.
pub fn improvement(base: &Summary, better: &Summary) -> String {
    let times = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
    format!(
        "{} vs {}: cached tokens {:.1}% -> {:.1}% of prompt tokens, prefill computed {:.1}x less; \
         TTFT mean {:.1} -> {:.1} ms ({:.1}x lower), p99 {:.1} -> {:.1} ms ({:.1}x lower)",
        better.policy,
        base.policy,
        100.0 * base.cached_ratio(),
        100.0 * better.cached_ratio(),
        times(
            (base.prompt_tokens - base.cached_tokens) as f64,
            (better.prompt_tokens - better.cached_tokens) as f64
        ),
        base.ttft_mean_ms,
        better.ttft_mean_ms,
        times(base.ttft_mean_ms, better.ttft_mean_ms),
        base.ttft_p99_ms,
        better.ttft_p99_ms,
        times(base.ttft_p99_ms, better.ttft_p99_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(turn: usize, endpoint: &str, prompt: u64, cached: u64, ms: u64) -> Sample {
        Sample {
            turn,
            endpoint: endpoint.to_owned(),
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft: Duration::from_millis(ms),
        }
    }

    #[test]
    fn figures_of_a_hand_worked_run() {
        let samples = [
            sample(0, "sim-0", 100, 0, 10),
            sample(1, "sim-0", 200, 160, 20),
            sample(0, "sim-1", 100, 50, 30),
            sample(1, "sim-0", 200, 200, 40),
        ];
        let s = Summary::new("kvroute", &samples, Duration::from_secs(2), 5);
        assert_eq!(s.requests, 4);
        assert!((s.cached_ratio() - 410.0 / 600.0).abs() < 1e-9);
        assert!((s.followup_ratio - 360.0 / 400.0).abs() < 1e-9);
        assert!((s.ttft_mean_ms - 25.0).abs() < 1e-9);
        assert!((s.ttft_p99_ms - 40.0).abs() < 1e-9);
        // 3 of 4 requests on one of 2 endpoints: 3 / (4 / 2).
        assert!((s.endpoint_max_over_mean(2) - 1.5).abs() < 1e-9);

        let mut out = Vec::new();
        print_table(&mut out, &[s], 2).unwrap();
        let text = String::from_utf8(out).unwrap();
        let row: Vec<&str> = text.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(row[..4], ["kvroute", "4", "0.683", "0.900"]);
        assert_eq!(row[6..], ["5", "2.0", "3/1", "1.50"]);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 198.0);
        assert_eq!(percentile(&v[..10], 0.99), 10.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
    }
}
