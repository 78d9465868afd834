//! The simulator's configuration: flags with environment fallbacks, each
//! with a documented default (`kvroute-engine-sim --help` prints them).

use std::net::SocketAddr;
use std::path::PathBuf;

use kvroute_core::hash::{HashAlgo, Lora};
use kvroute_proto::tls::{TlsArgs, TlsEnv};

/// How one simulated engine behaves.
#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// HTTP address of the OpenAI-compatible API, /health and /metrics
    /// (port 0 picks a free port).
    #[arg(long, env = "SIM_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,

    /// gRPC address of the WatchCache stream (port 0 picks a free port).
    #[arg(long, env = "SIM_CACHE_LISTEN", default_value = "127.0.0.1:50051")]
    pub cache_listen: SocketAddr,

    /// Model name served by /v1/models and accepted in requests.
    #[arg(long, env = "SIM_MODEL", default_value = "kvroute-sim")]
    pub model: String,

    /// LoRA adapters served besides the model, as `name=path` (vLLM
    /// --lora-modules): listed in /v1/models with `root` and `parent`, and
    /// requests naming one hash their blocks with it. No weights are read.
    #[arg(long, env = "SIM_LORA_MODULES", value_delimiter = ',', num_args = 1.., value_parser = parse_lora)]
    pub lora_modules: Vec<Lora>,

    /// Tokens per KV block (vLLM --block-size).
    #[arg(long, env = "SIM_BLOCK_SIZE", default_value_t = kvroute_core::hash::DEFAULT_BLOCK_SIZE as u32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub block_size: u32,

    /// Prefix-cache hash algorithm (vLLM --prefix-caching-hash-algo).
    #[arg(long, env = "SIM_HASH_ALGO", default_value = "sha256")]
    pub hash_algo: HashAlgo,

    /// The hash seed (vLLM's PYTHONHASHSEED); unset means "vllm-none-hash".
    #[arg(long, env = "SIM_HASH_SEED")]
    pub hash_seed: Option<String>,

    /// KV cache capacity in blocks (vLLM num_gpu_blocks).
    #[arg(long, env = "SIM_NUM_GPU_BLOCKS", default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=(1 << 26)))]
    pub num_gpu_blocks: u64,

    /// Longest prompt plus output, in tokens (vLLM --max-model-len).
    #[arg(long, env = "SIM_MAX_MODEL_LEN", default_value_t = 32768)]
    pub max_model_len: u64,

    /// Prefill throughput over uncached prompt tokens, tokens per second;
    /// 0 makes prefill instant.
    #[arg(long, env = "SIM_PREFILL_TOKENS_PER_S", default_value_t = 10_000.0)]
    pub prefill_tokens_per_s: f64,

    /// Fixed cost of each scheduler step that prefills (a chunked prompt
    /// pays it per chunk), milliseconds.
    #[arg(long, env = "SIM_PREFILL_OVERHEAD_MS", default_value_t = 20.0)]
    pub prefill_overhead_ms: f64,

    /// Time of a scheduler step that only decodes, and the least any step
    /// takes (the inter-token latency), milliseconds; 0 generates
    /// instantly.
    #[arg(long, env = "SIM_ITL_MS", default_value_t = 30.0)]
    pub itl_ms: f64,

    /// Requests running at once; the rest wait in a FIFO queue (vLLM
    /// --max-num-seqs).
    #[arg(long, env = "SIM_MAX_NUM_SEQS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_seqs: u32,

    /// Tokens scheduled per step: decodes first, then prefill chunks up to
    /// this budget (vLLM --max-num-batched-tokens, chunked prefill).
    #[arg(long, env = "SIM_MAX_NUM_BATCHED_TOKENS", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_batched_tokens: u32,

    /// Output tokens when a request sets no max_tokens.
    #[arg(long, env = "SIM_DEFAULT_MAX_TOKENS", default_value_t = 16)]
    pub default_max_tokens: u64,

    /// Runs this many times faster than real time (2 halves every delay).
    #[arg(long, env = "SIM_TIME_SCALE", default_value_t = 1.0)]
    pub time_scale: f64,

    /// Longest interval between load reports on WatchCache streams,
    /// milliseconds; a report also goes out 10 ms after requests arrive.
    #[arg(long, env = "SIM_LOAD_INTERVAL_MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub load_interval_ms: u64,

    /// Messages buffered per WatchCache subscriber; a subscriber that falls
    /// this far behind has its stream ended (it resubscribes for a snapshot).
    #[arg(long, env = "SIM_SUBSCRIBER_BUFFER", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    pub subscriber_buffer: u64,

    /// A Hugging Face tokenizer.json; default: the built-in tokenizer.
    #[arg(long, env = "SIM_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,

    /// A tokenizer_config.json whose chat_template renders chat requests;
    /// default: the built-in ChatML template.
    #[arg(long, env = "SIM_TOKENIZER_CONFIG")]
    pub tokenizer_config: Option<PathBuf>,

    /// Fault: share of requests (0 to 1) answered with a 500, at random.
    #[arg(long, env = "SIM_FAIL_RATE", default_value_t = 0.0)]
    pub fail_rate: f64,

    /// Fault: after this many requests, stop answering (requests hang).
    #[arg(long, env = "SIM_STOP_AFTER")]
    pub stop_after: Option<u64>,

    /// Fault: extra delay before every response's first byte, milliseconds.
    #[arg(long, env = "SIM_EXTRA_LATENCY_MS", default_value_t = 0)]
    pub extra_latency_ms: u64,

    /// Also publish vLLM's KV cache events (ZMQ PUB) on this address, as
    /// vLLM's `--kv-events-config` `endpoint` does (`tcp://*:5557`), for
    /// `kvroute-agent`.
    #[arg(long, env = "SIM_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,

    /// Serve vLLM's KV events replay (ZMQ ROUTER) on this address, as
    /// vLLM's `replay_endpoint` (`tcp://*:5558`).
    #[arg(
        long,
        env = "SIM_KV_EVENTS_REPLAY_ENDPOINT",
        requires = "kv_events_endpoint"
    )]
    pub kv_events_replay_endpoint: Option<String>,

    /// The KV events topic frame (vLLM's `topic`).
    #[arg(long, env = "SIM_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,

    /// KV event batches kept for replay (vLLM's `buffer_steps`).
    #[arg(long, env = "SIM_KV_EVENTS_BUFFER_STEPS", default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,

    /// Disaggregated prefill (vLLM's `kv_role`): `producer` prefills
    /// requests with `do_remote_decode` and holds their blocks for a
    /// consumer to read; `consumer` reads the blocks a
    /// `do_remote_prefill` request names before decoding; `both` does both.
    /// Ordinary requests run on every role.
    #[arg(long, env = "SIM_KV_ROLE", value_enum, default_value = "both")]
    pub kv_role: crate::transfer::Role,

    /// Address of the KV transfer server consumers read held blocks from;
    /// default: the `--listen` host on a free port.
    #[arg(long, env = "SIM_KV_TRANSFER_LISTEN")]
    pub kv_transfer_listen: Option<SocketAddr>,

    /// The host a producer names in `remote_host` (vLLM's
    /// VLLM_NIXL_SIDE_CHANNEL_HOST); default: the transfer server's bound
    /// IP. Set it (to the pod IP) when that is 0.0.0.0.
    #[arg(long, env = "SIM_KV_TRANSFER_HOST")]
    pub kv_transfer_host: Option<String>,

    /// Connections the KV transfer server holds open at most, 1 to
    /// 65,536; one past it is closed at once, counted
    /// `kvroute_sim_kv_transfers_total{result="refused"}`.
    #[arg(long, env = "SIM_KV_TRANSFER_MAX_CONNECTIONS", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub kv_transfer_max_connections: u32,

    /// Time to read one block from a producer, milliseconds.
    #[arg(long, env = "SIM_KV_TRANSFER_MS_PER_BLOCK", default_value_t = 0.05)]
    pub kv_transfer_ms_per_block: f64,

    /// How long a producer holds a finished request's blocks for a
    /// consumer (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT), and how long a
    /// consumer waits for a read, seconds.
    #[arg(long, env = "SIM_KV_TRANSFER_TIMEOUT_S", default_value_t = 30.0)]
    pub kv_transfer_timeout_s: f64,

    /// TLS of the WatchCache server (`--tls-cert-file`, `--tls-key-file`,
    /// `--tls-client-ca-file`).
    #[command(flatten)]
    pub tls: TlsArgs<SimTlsEnv>,
}

/// engine-sim's TLS flags read `SIM_TLS_*`.
#[derive(Clone, Debug)]
pub struct SimTlsEnv;

impl TlsEnv for SimTlsEnv {
    const CERT_FILE: &'static str = "SIM_TLS_CERT_FILE";
    const KEY_FILE: &'static str = "SIM_TLS_KEY_FILE";
    const CLIENT_CA_FILE: &'static str = "SIM_TLS_CLIENT_CA_FILE";
}

/// `name=path`, as vLLM's `--lora-modules` takes it.
fn parse_lora(s: &str) -> Result<Lora, String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(Lora::new(name, path)),
        _ => Err(format!("expected name=path, got {s:?}")),
    }
}

impl Config {
    /// The LoRA adapter a request's `model` names; `None` for the base
    /// model.
    pub fn lora(&self, model: &str) -> Option<&Lora> {
        self.lora_modules.iter().find(|l| l.name == model)
    }

    /// Checks values clap cannot; the error names the flag and the value.
    pub fn validate(&self) -> Result<(), String> {
        let non_negative = [
            ("--prefill-tokens-per-s", self.prefill_tokens_per_s),
            ("--prefill-overhead-ms", self.prefill_overhead_ms),
            ("--itl-ms", self.itl_ms),
            ("--kv-transfer-ms-per-block", self.kv_transfer_ms_per_block),
        ];
        for (flag, v) in non_negative {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{flag} must be a number ≥ 0, got {v}"));
            }
        }
        if !self.kv_transfer_timeout_s.is_finite()
            || self.kv_transfer_timeout_s <= 0.0
            || self.kv_transfer_timeout_s > 86_400.0
        {
            return Err(format!(
                "--kv-transfer-timeout-s must be within (0, 86400], got {}",
                self.kv_transfer_timeout_s
            ));
        }
        if !self.time_scale.is_finite() || self.time_scale <= 0.0 {
            return Err(format!("--time-scale must be > 0, got {}", self.time_scale));
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(format!(
                "--fail-rate must be within 0..=1, got {}",
                self.fail_rate
            ));
        }
        let tls = &self.tls;
        if tls.tls_cert_file.is_some() != tls.tls_key_file.is_some()
            || (tls.tls_client_ca_file.is_some() && tls.tls_cert_file.is_none())
        {
            return Err(
                "--tls-cert-file and --tls-key-file go together, and --tls-client-ca-file needs them"
                    .to_owned(),
            );
        }
        if self.kv_events_replay_endpoint.is_some() && self.kv_events_endpoint.is_none() {
            return Err("--kv-events-replay-endpoint needs --kv-events-endpoint".to_owned());
        }
        if self.kv_events_buffer_steps == 0 {
            return Err("--kv-events-buffer-steps must be ≥ 1, got 0".to_owned());
        }
        if self.max_model_len == 0 {
            return Err("--max-model-len must be ≥ 1, got 0".to_owned());
        }
        Ok(())
    }

    /// A configuration for tests: loopback on free ports, instant timing.
    pub fn test() -> Self {
        Config {
            listen: "127.0.0.1:0".parse().expect("valid"),
            cache_listen: "127.0.0.1:0".parse().expect("valid"),
            model: "kvroute-sim".to_owned(),
            lora_modules: Vec::new(),
            block_size: kvroute_core::hash::DEFAULT_BLOCK_SIZE as u32,
            hash_algo: kvroute_core::hash::DEFAULT_HASH_ALGO,
            hash_seed: None,
            num_gpu_blocks: 1024,
            max_model_len: 32768,
            prefill_tokens_per_s: 0.0,
            prefill_overhead_ms: 0.0,
            itl_ms: 0.0,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            default_max_tokens: 16,
            time_scale: 1.0,
            load_interval_ms: 100,
            subscriber_buffer: 4096,
            tokenizer: None,
            tokenizer_config: None,
            fail_rate: 0.0,
            stop_after: None,
            extra_latency_ms: 0,
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            kv_events_topic: String::new(),
            kv_events_buffer_steps: 10_000,
            kv_role: crate::transfer::Role::Both,
            kv_transfer_listen: None,
            kv_transfer_host: None,
            kv_transfer_max_connections: 512,
            kv_transfer_ms_per_block: 0.0,
            kv_transfer_timeout_s: 30.0,
            tls: TlsArgs::default(),
        }
    }
}
