//! vLLM's Prometheus metrics, by vLLM's names (on `prometheus-client`, in
//! the OpenMetrics text format): what a router or a dashboard reads from a
//! real pod. The engine keeps the counts; each scrape encodes them.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::config::Config;
use crate::engine::LoadReport;

/// vLLM's time-to-first-token histogram buckets, seconds.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelName {
    model_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Finished {
    model_name: String,
    finished_reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheConfigInfo {
    block_size: String,
    cache_dtype: &'static str,
    enable_prefix_caching: &'static str,
    num_gpu_blocks: String,
    prefix_caching_hash_algo: String,
}

/// How a KV transfer ended ([`crate::transfer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferResult {
    /// A consumer read a producer's blocks.
    Ok,
    /// A consumer could not read them and prefilled itself.
    Failed,
    /// A producer freed held blocks no consumer read in time.
    Expired,
    /// A producer closed a connection to its transfer port at once: it
    /// held `--kv-transfer-max-connections` already.
    Refused,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Transfer {
    result: &'static str,
}

impl From<TransferResult> for Transfer {
    fn from(result: TransferResult) -> Self {
        let result = match result {
            TransferResult::Ok => "ok",
            TransferResult::Failed => "failed",
            TransferResult::Expired => "expired",
            TransferResult::Refused => "refused",
        };
        Transfer { result }
    }
}

/// vLLM's inter-token latency buckets, seconds.
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's request latency buckets (prefill time), seconds.
const LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's prompt length buckets: 1, 2, 5, 10, 20, 50, … up to the model
/// length.
fn prompt_buckets(max_model_len: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut decade = 1u64;
    'outer: loop {
        for m in [1, 2, 5] {
            let b = m * decade;
            if b > max_model_len {
                break 'outer;
            }
            out.push(b as f64);
        }
        decade *= 10;
    }
    out
}

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS.iter().copied())
}

/// Counters the engine keeps.
#[derive(Debug)]
pub struct Metrics {
    /// Prompt tokens processed.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Requests that generated all their tokens.
    pub requests_finished: u64,
    /// Requests preempted (vLLM's `num_preemptions`).
    pub preemptions: u64,
    /// Prompt tokens prefilled here: neither cached nor loaded from a
    /// producer (counted at admission; a preempted request's recompute is
    /// not).
    pub computed_prompt_tokens: u64,
    model: ModelName,
    ttft: Family<ModelName, Histogram, fn() -> Histogram>,
    prompt_lengths: Family<ModelName, Histogram, Buckets>,
    output_lengths: Family<ModelName, Histogram, Buckets>,
    prefill_time: Family<ModelName, Histogram, Buckets>,
    itl: Family<ModelName, Histogram, Buckets>,
    transfers: Family<Transfer, Counter>,
}

/// Makes histograms with fixed buckets.
#[derive(Clone, Debug)]
struct Buckets(Arc<[f64]>);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

impl Metrics {
    /// No counts yet, for an engine serving `model` up to `max_model_len`
    /// tokens.
    pub fn new(model: &str, max_model_len: u64) -> Self {
        Metrics {
            prompt_tokens: 0,
            generation_tokens: 0,
            requests_finished: 0,
            preemptions: 0,
            computed_prompt_tokens: 0,
            model: ModelName {
                model_name: model.to_owned(),
            },
            ttft: Family::new_with_constructor(ttft_histogram),
            prompt_lengths: Family::new_with_constructor(Buckets(
                prompt_buckets(max_model_len).into(),
            )),
            output_lengths: Family::new_with_constructor(Buckets(
                prompt_buckets(max_model_len).into(),
            )),
            prefill_time: Family::new_with_constructor(Buckets(LATENCY_BUCKETS.into())),
            itl: Family::new_with_constructor(Buckets(ITL_BUCKETS.into())),
            transfers: Family::default(),
        }
    }

    /// Records one request's prefill: its prompt length and the seconds
    /// its prefill took (as vLLM's `request_prompt_tokens` and
    /// `request_prefill_time_seconds`).
    pub fn observe_prefill(&mut self, prompt_tokens: u64, seconds: f64) {
        self.prompt_tokens += prompt_tokens;
        self.prompt_lengths
            .get_or_create(&self.model)
            .observe(prompt_tokens as f64);
        self.prefill_time
            .get_or_create(&self.model)
            .observe(seconds);
    }

    /// Records one finished request's output length (vLLM's
    /// `request_generation_tokens`).
    pub fn observe_output(&mut self, tokens: u64) {
        self.output_lengths
            .get_or_create(&self.model)
            .observe(tokens as f64);
    }

    /// Records the seconds between two tokens of a request (vLLM's
    /// `inter_token_latency_seconds`).
    pub fn observe_itl(&mut self, seconds: f64) {
        self.itl.get_or_create(&self.model).observe(seconds);
    }

    /// Counts a KV transfer's outcome.
    pub fn count_transfer(&mut self, result: TransferResult) {
        self.transfers.get_or_create(&result.into()).inc();
    }

    /// Records one time to first token.
    pub fn observe_ttft(&mut self, seconds: f64) {
        self.ttft.get_or_create(&self.model).observe(seconds);
    }

    /// The exposition text; `prefix` is (queries, hits) in tokens.
    pub fn render(
        &self,
        config: &Config,
        load: &LoadReport,
        prefix: (u64, u64),
        cached_blocks: usize,
    ) -> String {
        let model = &self.model;
        let mut r = Registry::default();
        let gauge = |v: f64| {
            let family = Family::<ModelName, Gauge<f64, AtomicU64>>::default();
            family.get_or_create(model).set(v);
            family
        };
        let counter = |v: u64| {
            let family = Family::<ModelName, Counter>::default();
            family.get_or_create(model).inc_by(v);
            family
        };
        r.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            gauge(f64::from(load.running)),
        );
        r.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            gauge(f64::from(load.waiting)),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            gauge(f64::from(load.kv_usage)),
        );
        // Counters are registered without `_total`, which the encoder adds.
        r.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            counter(prefix.0),
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            counter(prefix.1),
        );
        r.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed",
            counter(self.prompt_tokens),
        );
        r.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            counter(self.generation_tokens),
        );
        r.register(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine",
            counter(self.preemptions),
        );
        let success = Family::<Finished, Counter>::default();
        success
            .get_or_create(&Finished {
                model_name: config.model.clone(),
                finished_reason: "length",
            })
            .inc_by(self.requests_finished);
        r.register(
            "vllm:request_success",
            "Count of successfully processed requests",
            success,
        );
        // Present from the start, as vLLM's.
        drop(self.ttft.get_or_create(model));
        r.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            self.ttft.clone(),
        );
        // Present from the start, as vLLM's.
        drop(self.prompt_lengths.get_or_create(model));
        r.register(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed",
            self.prompt_lengths.clone(),
        );
        drop(self.prefill_time.get_or_create(model));
        r.register(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request",
            self.prefill_time.clone(),
        );
        drop(self.output_lengths.get_or_create(model));
        r.register(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed",
            self.output_lengths.clone(),
        );
        drop(self.itl.get_or_create(model));
        r.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            self.itl.clone(),
        );
        r.register(
            "kvroute_sim_computed_prompt_tokens",
            "Prompt tokens prefilled here, neither cached nor loaded from a producer (the simulator's own metric)",
            counter(self.computed_prompt_tokens),
        );
        r.register(
            "kvroute_sim_cached_blocks",
            "Blocks in the prefix cache (the simulator's own metric)",
            gauge(cached_blocks as f64),
        );
        // Every result present from the start.
        for result in [
            TransferResult::Ok,
            TransferResult::Failed,
            TransferResult::Expired,
            TransferResult::Refused,
        ] {
            drop(self.transfers.get_or_create(&result.into()));
        }
        r.register(
            "kvroute_sim_kv_transfers",
            "KV transfers for disaggregated prefill, by result: ok and failed counted by the consumer, expired and refused (a connection past the transfer port's cap) by the producer",
            self.transfers.clone(),
        );
        let info = Family::<CacheConfigInfo, Gauge<f64, AtomicU64>>::default();
        info.get_or_create(&CacheConfigInfo {
            block_size: config.block_size.to_string(),
            cache_dtype: "auto",
            enable_prefix_caching: "True",
            num_gpu_blocks: config.num_gpu_blocks.to_string(),
            prefix_caching_hash_algo: config.hash_algo.to_string(),
        })
        .set(1.0);
        r.register(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            info,
        );
        kvroute_telemetry::metrics::encode(&[&r])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_and_a_cumulative_histogram() {
        let mut m = Metrics::new("kvroute-sim", 32768);
        m.observe_prefill(100, 0.4);
        m.observe_ttft(0.03);
        m.observe_ttft(3.0);
        m.observe_output(16);
        m.observe_itl(0.03);
        m.count_transfer(TransferResult::Failed);
        let load = LoadReport {
            waiting: 2,
            running: 5,
            kv_usage: 0.25,
            used_blocks: 10,
            queued_prefill_tokens: 0,
            prefill_tokens_per_s: None,
            ..LoadReport::default()
        };
        let text = m.render(&Config::test(), &load, (100, 48), 7);
        for line in [
            "vllm:num_requests_running{model_name=\"kvroute-sim\"} 5.0",
            "vllm:num_requests_waiting{model_name=\"kvroute-sim\"} 2.0",
            "vllm:kv_cache_usage_perc{model_name=\"kvroute-sim\"} 0.25",
            "vllm:prefix_cache_queries_total{model_name=\"kvroute-sim\"} 100",
            "vllm:prefix_cache_hits_total{model_name=\"kvroute-sim\"} 48",
            "vllm:time_to_first_token_seconds_bucket{le=\"0.04\",model_name=\"kvroute-sim\"} 1",
            "vllm:time_to_first_token_seconds_bucket{le=\"5.0\",model_name=\"kvroute-sim\"} 2",
            "vllm:time_to_first_token_seconds_count{model_name=\"kvroute-sim\"} 2",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            "kvroute_sim_cached_blocks{model_name=\"kvroute-sim\"} 7.0",
            "vllm:request_prompt_tokens_sum{model_name=\"kvroute-sim\"} 100.0",
            "vllm:request_prompt_tokens_bucket{le=\"100.0\",model_name=\"kvroute-sim\"} 1",
            "vllm:request_prefill_time_seconds_bucket{le=\"0.5\",model_name=\"kvroute-sim\"} 1",
            "vllm:prompt_tokens_total{model_name=\"kvroute-sim\"} 100",
            "vllm:request_generation_tokens_sum{model_name=\"kvroute-sim\"} 16.0",
            "vllm:inter_token_latency_seconds_count{model_name=\"kvroute-sim\"} 1",
            "kvroute_sim_kv_transfers_total{result=\"failed\"} 1",
            "kvroute_sim_kv_transfers_total{result=\"ok\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text.contains("vllm:cache_config_info{block_size=\"16\""));
    }
}
