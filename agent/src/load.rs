//! The engine's load and cache size, from vLLM's `/metrics`, and its
//! restarts, from `/health`.
//!
//! Read per scrape (per rank: samples with an `engine` label are that
//! rank's when vLLM runs data-parallel):
//! - `vllm:num_requests_waiting`, `vllm:num_requests_running`;
//! - `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before vLLM
//!   0.10), times the capacity for the blocks in use;
//! - `vllm:cache_config_info`'s `num_gpu_blocks` (the capacity) and
//!   `block_size` (checked against `--block-size`);
//! - queued prefill work: the requests not past their first token times
//!   the mean uncached prompt (the mean of `vllm:request_prompt_tokens`
//!   less the prefix cache's hit share), when vLLM exports them. With
//!   chunked prefill vLLM schedules requests at once and prefills them over
//!   several steps, so most requests still in prefill count as running:
//!   those are the running requests less the ones decoding, which are the
//!   requests that got a first token
//!   (`vllm:time_to_first_token_seconds_count`) and have not finished
//!   (`vllm:request_success_total`) — fewer when requests were aborted
//!   after their first token, an estimate;
//! - the prefill rate: computed prompt tokens per second of prefill time,
//!   from the growth of `vllm:prompt_tokens_total` less
//!   `vllm:prefix_cache_hits_total` (tokens served from the cache) and of
//!   `vllm:request_prefill_time_seconds`' sum between scrapes. An estimate:
//!   prefill time includes each prefill's fixed overhead, and concurrent
//!   prefills overlap, so it is a lower bound of the engine's rate. Absent
//!   until both have grown;
//! - memory, for the router's prediction of a wait for KV blocks: the free
//!   blocks (capacity less those in use; `kv_cache_usage_perc` counts a
//!   cached block no request holds as free, as engine-sim does), the
//!   waiting queue's demand (the waiting requests times the mean prompt,
//!   in blocks: a waiting request takes its cached blocks from the free
//!   pool too unless a running request holds them, which vLLM's metrics do
//!   not say), the blocks outputs will still take (half the mean output
//!   per running request, all of it per waiting one), the
//!   running requests' mean remaining decode (half the mean output of
//!   `vllm:request_generation_tokens` at the mean time per output token of
//!   `vllm:inter_token_latency_seconds`, `vllm:time_per_output_token_seconds`
//!   before vLLM 0.11), and `vllm:num_preemptions_total`. What of the free
//!   blocks holds cached prefixes is not in vLLM's metrics: not reported.
//!
//! The text format's sample lines are read by
//! [`kvroute_telemetry::metrics::parse_line`].

use std::sync::Arc;
use std::time::Duration;

use kvroute_proto::v1;
use tokio::sync::watch;

use kvroute_telemetry::metrics::parse_line;

use crate::metrics::Metrics;
use crate::rank::Rank;

/// What one scrape says of one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scraped {
    /// Requests waiting.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// The share of the cache in use.
    pub kv_usage: f64,
    /// `num_gpu_blocks`, if reported.
    pub capacity: Option<u64>,
    /// `block_size`, if reported.
    pub block_size: Option<u32>,
    /// Prompt tokens processed so far.
    pub prompt_tokens: Option<f64>,
    /// Prompt tokens served from the prefix cache so far.
    pub prefix_hits: Option<f64>,
    /// Seconds spent in prefill so far.
    pub prefill_seconds: Option<f64>,
    /// Mean prompt length, if known.
    pub mean_prompt: Option<f64>,
    /// Mean output length, if known.
    pub mean_output: Option<f64>,
    /// Mean seconds per output token, if known.
    pub mean_tpot: Option<f64>,
    /// Preemptions so far, if reported.
    pub preemptions: Option<f64>,
    /// Prompt tokens looked up in the prefix cache so far.
    pub prefix_queries: Option<f64>,
    /// Requests that produced a first token so far.
    pub first_tokens: Option<f64>,
    /// Requests finished so far.
    pub finished: Option<f64>,
}

impl Scraped {
    /// Requests waiting or running but not yet past their first token.
    fn in_prefill(&self) -> f64 {
        let decoding = match (self.first_tokens, self.finished) {
            (Some(first), Some(finished)) => (first - finished).max(0.0),
            _ => 0.0,
        };
        self.waiting.max(0.0) + (self.running - decoding).max(0.0)
    }

    /// The share of prompt tokens the prefix cache did not serve.
    fn uncached_share(&self) -> f64 {
        match (self.prefix_hits, self.prefix_queries) {
            (Some(hits), Some(queries)) if queries > 0.0 => (1.0 - hits / queries).clamp(0.0, 1.0),
            _ => 1.0,
        }
    }
}

/// Reads rank `rank`'s values from an exposition (`dp` ranks in all).
pub fn scrape(text: &str, rank: u32, dp: u32) -> Scraped {
    let mut s = Scraped::default();
    let (mut prompt_sum, mut prompt_count) = (None, None);
    let (mut output_sum, mut output_count) = (None, None);
    let (mut tpot_sum, mut tpot_count) = (None, None);
    let engine = rank.to_string();
    for sample in text.lines().filter_map(parse_line) {
        if dp > 1 && sample.label("engine").is_some_and(|e| e != engine) {
            continue;
        }
        let v = sample.value;
        match sample.name {
            "vllm:num_requests_waiting" => s.waiting += v,
            "vllm:num_requests_running" => s.running += v,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => s.kv_usage = v,
            "vllm:cache_config_info" => {
                s.capacity = sample.label("num_gpu_blocks").and_then(|n| n.parse().ok());
                s.block_size = sample.label("block_size").and_then(|n| n.parse().ok());
            }
            "vllm:prompt_tokens_total" => *s.prompt_tokens.get_or_insert(0.0) += v,
            "vllm:prefix_cache_hits_total" => *s.prefix_hits.get_or_insert(0.0) += v,
            "vllm:request_prefill_time_seconds_sum" => *s.prefill_seconds.get_or_insert(0.0) += v,
            "vllm:request_prompt_tokens_sum" => *prompt_sum.get_or_insert(0.0) += v,
            "vllm:request_prompt_tokens_count" => *prompt_count.get_or_insert(0.0) += v,
            "vllm:request_generation_tokens_sum" => *output_sum.get_or_insert(0.0) += v,
            "vllm:request_generation_tokens_count" => *output_count.get_or_insert(0.0) += v,
            "vllm:inter_token_latency_seconds_sum" | "vllm:time_per_output_token_seconds_sum" => {
                *tpot_sum.get_or_insert(0.0) += v;
            }
            "vllm:inter_token_latency_seconds_count"
            | "vllm:time_per_output_token_seconds_count" => *tpot_count.get_or_insert(0.0) += v,
            "vllm:num_preemptions_total" => *s.preemptions.get_or_insert(0.0) += v,
            "vllm:prefix_cache_queries_total" => *s.prefix_queries.get_or_insert(0.0) += v,
            "vllm:time_to_first_token_seconds_count" => *s.first_tokens.get_or_insert(0.0) += v,
            "vllm:request_success_total" => *s.finished.get_or_insert(0.0) += v,
            _ => {}
        }
    }
    let mean = |sum: Option<f64>, count: Option<f64>| match (sum, count) {
        (Some(sum), Some(count)) if count > 0.0 && sum.is_finite() && sum >= 0.0 => {
            Some(sum / count)
        }
        _ => None,
    };
    s.mean_prompt = mean(prompt_sum, prompt_count);
    s.mean_output = mean(output_sum, output_count);
    s.mean_tpot = mean(tpot_sum, tpot_count);
    s
}

/// The prefill rate between two scrapes, if both counters grew.
fn prefill_rate(before: &Scraped, now: &Scraped) -> Option<f64> {
    let hits = now.prefix_hits.unwrap_or(0.0) - before.prefix_hits.unwrap_or(0.0);
    let tokens = now.prompt_tokens? - before.prompt_tokens? - hits;
    let seconds = now.prefill_seconds? - before.prefill_seconds?;
    (tokens > 0.0 && seconds > 0.0).then(|| tokens / seconds)
}

/// The load report of a scrape.
pub fn report(now: &Scraped, capacity: u64, rate: Option<f64>) -> v1::LoadReport {
    let count = |v: f64| v.max(0.0).min(f64::from(u32::MAX)) as u32;
    let kv_usage = now.kv_usage.clamp(0.0, 1.0);
    let used_blocks = (kv_usage * capacity as f64).round() as u64;
    let block_size = now.block_size.filter(|&b| b > 0).map(f64::from);
    v1::LoadReport {
        waiting: count(now.waiting),
        running: count(now.running),
        kv_usage: kv_usage as f32,
        used_blocks,
        queued_prefill_tokens: now
            .mean_prompt
            .map(|mean| (mean * now.uncached_share() * now.in_prefill()).round() as u64),
        prefill_tokens_per_s: rate,
        free_blocks: (capacity > 0).then(|| capacity - used_blocks.min(capacity)),
        cached_free_blocks: None,
        waiting_blocks: now
            .mean_prompt
            .zip(block_size)
            .map(|(mean, bs)| (mean * now.waiting.max(0.0) / bs).ceil() as u64),
        growth_blocks: now.mean_output.zip(block_size).map(|(mean, bs)| {
            (mean * (now.running.max(0.0) / 2.0 + now.waiting.max(0.0)) / bs).ceil() as u64
        }),
        remaining_decode_s: now
            .mean_output
            .zip(now.mean_tpot)
            .map(|(output, tpot)| output / 2.0 * tpot),
        waiting_decode_s: now
            .mean_output
            .zip(now.mean_tpot)
            .map(|(output, tpot)| output * tpot),
        preemptions: now.preemptions.map(|p| p.max(0.0) as u64),
        // Not in vLLM's metrics.
        max_num_seqs: None,
    }
}

/// Scrapes `engine_url` every `interval` until `stop`, feeding every rank;
/// a `/health` that fails and then recovers is a restart.
pub async fn poll(
    engine_url: String,
    ranks: Vec<Arc<Rank>>,
    metrics: Arc<Metrics>,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let client = reqwest::Client::builder()
        .timeout(interval.max(Duration::from_secs(1)))
        .build()
        .expect("a client without TLS always builds");
    let base = engine_url.trim_end_matches('/').to_owned();
    let dp = ranks.len() as u32;
    let mut previous: Vec<Option<Scraped>> = vec![None; ranks.len()];
    let mut rates: Vec<Option<f64>> = vec![None; ranks.len()];
    let mut was_down = false;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let healthy = matches!(
            client.get(format!("{base}/health")).send().await,
            Ok(r) if r.status().is_success()
        );
        if !healthy {
            if !was_down {
                tracing::warn!(url = %base, "the engine's /health fails");
            }
            was_down = true;
            for r in &ranks {
                metrics.scrape(r.rank, false);
            }
            continue;
        }
        if was_down {
            tracing::warn!(url = %base, "the engine's /health recovered: treating it as a restart");
            for r in &ranks {
                r.restart("health recovered");
            }
            previous.fill(None);
            was_down = false;
        }
        let text = match client.get(format!("{base}/metrics")).send().await {
            Ok(r) if r.status().is_success() => r.text().await.ok(),
            _ => None,
        };
        for (i, r) in ranks.iter().enumerate() {
            metrics.scrape(r.rank, text.is_some());
            let Some(text) = &text else { continue };
            let now = scrape(text, r.rank, dp);
            if let Some(capacity) = now.capacity {
                r.engine_config(capacity, now.block_size);
            }
            if let Some(before) = &previous[i]
                && let Some(rate) = prefill_rate(before, &now)
            {
                rates[i] = Some(rate);
            }
            r.report_load(report(&now, now.capacity.unwrap_or(0), rates[i]));
            previous[i] = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vllm_exposition_becomes_a_load_report() {
        let text = r#"
# HELP vllm:num_requests_waiting Number of requests waiting.
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 9.0
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 5000.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.0
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 5000.0
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 10.0
vllm:request_generation_tokens_sum{engine="0",model_name="m"} 1000.0
vllm:request_generation_tokens_count{engine="0",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 30.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 1000.0
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 12.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 9.0
"#;
        let now = scrape(text, 0, 2);
        assert_eq!((now.waiting, now.running), (3.0, 5.0));
        assert_eq!((now.capacity, now.block_size), (Some(1000), Some(16)));
        let before = Scraped {
            prompt_tokens: Some(1000.0),
            prefill_seconds: Some(1.0),
            ..now.clone()
        };
        let rate = prefill_rate(&before, &now);
        assert_eq!(rate, Some(4000.0));
        let hit = Scraped {
            prefix_hits: Some(1000.0),
            ..now.clone()
        };
        let before_hits = Scraped {
            prefix_hits: Some(0.0),
            ..before.clone()
        };
        assert_eq!(
            prefill_rate(&before_hits, &hit),
            Some(3000.0),
            "cached tokens took no prefill time"
        );
        let r = report(&now, 1000, rate);
        assert_eq!((r.waiting, r.running, r.used_blocks), (3, 5, 250));
        // 3 waiting and 2 of the 5 running (12 first tokens, 9 finished: 3
        // decode) in prefill, 500 tokens each.
        assert_eq!(r.queued_prefill_tokens, Some(2500));
        // Memory: 750 of 1,000 blocks free; 3 waiting prompts of 500
        // tokens take 94 blocks of 16; a running request has half of 100
        // tokens left at 30 ms each: 5 × 50 + 3 × 100 = 550 tokens of
        // output to come, 35 blocks.
        assert_eq!(r.free_blocks, Some(750));
        assert_eq!(r.waiting_blocks, Some(94));
        assert_eq!(r.growth_blocks, Some(35));
        assert!((r.remaining_decode_s.unwrap() - 1.5).abs() < 1e-9);
        // A waiting request decodes all of its 100 tokens once it runs.
        assert!((r.waiting_decode_s.unwrap() - 3.0).abs() < 1e-9);
        assert_eq!((r.preemptions, r.cached_free_blocks), (Some(7), None));
        // The prefix cache served 30 % of prompt tokens: 70 % is queued.
        let warm = Scraped {
            prefix_hits: Some(300.0),
            prefix_queries: Some(1000.0),
            ..now.clone()
        };
        assert_eq!(report(&warm, 1000, rate).queued_prefill_tokens, Some(1750));
        assert_eq!(scrape(text, 1, 2).waiting, 9.0, "rank 1's own samples");
    }
}
