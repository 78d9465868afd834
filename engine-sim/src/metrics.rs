//! vLLM's Prometheus metrics, by vLLM's names, in the text exposition
//! format: what a router or a dashboard reads from a real pod.

use std::fmt::Write;

use crate::config::Config;
use crate::engine::LoadReport;

/// vLLM's time-to-first-token histogram buckets, seconds.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// Counters the engine keeps.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Prompt tokens processed.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Requests that generated all their tokens.
    pub requests_finished: u64,
    ttft_counts: [u64; TTFT_BUCKETS.len()],
    ttft_sum: f64,
    ttft_count: u64,
}

impl Metrics {
    /// Records one time to first token.
    pub fn observe_ttft(&mut self, seconds: f64) {
        for (bucket, count) in TTFT_BUCKETS.iter().zip(&mut self.ttft_counts) {
            if seconds <= *bucket {
                *count += 1;
            }
        }
        self.ttft_sum += seconds;
        self.ttft_count += 1;
    }

    /// The exposition text; `prefix` is (queries, hits) in tokens.
    pub fn render(
        &self,
        config: &Config,
        load: &LoadReport,
        prefix: (u64, u64),
        cached_blocks: usize,
    ) -> String {
        let model = escape(&config.model);
        let l = format!("model_name=\"{model}\"");
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{value}");
        };
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            format!("vllm:num_requests_running{{{l}}} {}", load.running),
        );
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            format!("vllm:num_requests_waiting{{{l}}} {}", load.waiting),
        );
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            format!("vllm:kv_cache_usage_perc{{{l}}} {}", load.kv_usage),
        );
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            format!("vllm:prefix_cache_queries_total{{{l}}} {}", prefix.0),
        );
        metric(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            format!("vllm:prefix_cache_hits_total{{{l}}} {}", prefix.1),
        );
        metric(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            format!("vllm:prompt_tokens_total{{{l}}} {}", self.prompt_tokens),
        );
        metric(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            format!(
                "vllm:generation_tokens_total{{{l}}} {}",
                self.generation_tokens
            ),
        );
        metric(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            format!(
                "vllm:request_success_total{{{l},finished_reason=\"length\"}} {}",
                self.requests_finished
            ),
        );
        let mut histogram = String::new();
        for (bucket, count) in TTFT_BUCKETS.iter().zip(&self.ttft_counts) {
            let _ = writeln!(
                histogram,
                "vllm:time_to_first_token_seconds_bucket{{{l},le=\"{bucket}\"}} {count}"
            );
        }
        let _ = write!(
            histogram,
            "vllm:time_to_first_token_seconds_bucket{{{l},le=\"+Inf\"}} {n}\n\
             vllm:time_to_first_token_seconds_sum{{{l}}} {sum}\n\
             vllm:time_to_first_token_seconds_count{{{l}}} {n}",
            n = self.ttft_count,
            sum = self.ttft_sum
        );
        metric(
            "vllm:time_to_first_token_seconds",
            "histogram",
            "Histogram of time to first token in seconds.",
            histogram,
        );
        metric(
            "kvroute_sim_cached_blocks",
            "gauge",
            "Blocks in the prefix cache (the simulator's own metric).",
            format!("kvroute_sim_cached_blocks{{{l}}} {cached_blocks}"),
        );
        metric(
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine CacheConfig",
            format!(
                "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\"}} 1.0",
                config.block_size, config.num_gpu_blocks, config.hash_algo
            ),
        );
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_and_a_cumulative_histogram() {
        let mut m = Metrics::default();
        m.observe_ttft(0.03);
        m.observe_ttft(3.0);
        let load = LoadReport {
            waiting: 2,
            running: 5,
            kv_usage: 0.25,
            used_blocks: 10,
            queued_prefill_tokens: 0,
            prefill_tokens_per_s: None,
        };
        let text = m.render(&Config::test(), &load, (100, 48), 7);
        for line in [
            "vllm:num_requests_running{model_name=\"kvroute-sim\"} 5",
            "vllm:num_requests_waiting{model_name=\"kvroute-sim\"} 2",
            "vllm:kv_cache_usage_perc{model_name=\"kvroute-sim\"} 0.25",
            "vllm:prefix_cache_queries_total{model_name=\"kvroute-sim\"} 100",
            "vllm:prefix_cache_hits_total{model_name=\"kvroute-sim\"} 48",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"kvroute-sim\",le=\"0.04\"} 1",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"kvroute-sim\",le=\"5\"} 2",
            "vllm:time_to_first_token_seconds_count{model_name=\"kvroute-sim\"} 2",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            "kvroute_sim_cached_blocks{model_name=\"kvroute-sim\"} 7",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text.contains("vllm:cache_config_info{block_size=\"16\""));
    }
}
