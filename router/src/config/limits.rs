//! `limits`: sizes, concurrency and timeouts.

use serde::{Deserialize, Serialize};

/// Sizes, concurrency and timeouts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Limits {
    /// Largest request body, bytes. Default: 32 MiB.
    pub max_body_bytes: usize,
    /// Request bodies held in memory at once, bytes, counted as they
    /// arrive (a declared `Content-Length` reserves nothing); a request
    /// that would exceed it gets 503 with `Retry-After`. A body the
    /// prompt reader parses whole (a completion's prompt, a rendered chat:
    /// at most `maxTokenizeBytes`) holds 16 times its size more while it
    /// is parsed, what its tree may cost. Default: 512 MiB.
    pub max_body_bytes_in_flight: usize,
    /// Of those, what one tenant's requests may hold (when the request's
    /// credentials name a tenant); more gets 429 with `Retry-After`. At
    /// least `maxBodyBytes`. Default: 128 MiB.
    pub max_body_bytes_per_tenant: usize,
    /// The slowest a body may arrive, bytes per second on average since
    /// its headers, checked after its first 2 s; slower senders get 408,
    /// so that trickling clients cannot hold the body budget. Default:
    /// 16384.
    pub body_min_bytes_per_s: u64,
    /// Prompts waiting for a tokenizer worker; more get 503 with
    /// `Retry-After`. Default: 1024.
    pub tokenize_queue: usize,
    /// Bodies larger than this are not tokenized: they are routed as
    /// unreadable (to the least loaded endpoint) and counted. A Hugging
    /// Face tokenizer holds about 600 bytes per token (~100× the text)
    /// while it encodes, so this bounds each tokenizer worker's memory.
    /// Default: 2 MiB (~500,000 tokens, beyond most context windows).
    pub max_tokenize_bytes: usize,
    /// Client connections to the API port; more are closed at once (the
    /// admin port is separate and unaffected). Lowered at start to fit the
    /// process's file-descriptor limit. Default: 10000.
    pub max_connections: usize,
    /// Time to receive a request's headers, milliseconds; on HTTP/1 also
    /// how long a keep-alive connection may wait for its next request.
    /// Default: 30000.
    pub header_read_timeout_ms: u64,
    /// A connection with no request in progress is closed after this long,
    /// milliseconds. Default: 60000.
    pub idle_timeout_ms: u64,
    /// Time to receive a request's whole body once its headers arrived,
    /// milliseconds; 408 after it. Default: 60000.
    pub body_read_timeout_ms: u64,
    /// Concurrent HTTP/2 streams per connection. Default: 256.
    pub http2_max_concurrent_streams: u32,
    /// HTTP/2 streams a client may reset before the server accepts them
    /// ("rapid reset"); more close the connection. Default: 20.
    pub http2_max_pending_accept_reset_streams: usize,
    /// HTTP/2 streams the server may reset because of client errors;
    /// more close the connection. Default: 1024.
    pub http2_max_local_error_reset_streams: usize,
    /// Requests in flight per endpoint before it counts as full. Default:
    /// 256.
    pub endpoint_concurrency: u32,
    /// Replaced by `flowControl.maxQueued`: refused at start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<serde_json::Value>,
    /// Replaced by `flowControl.maxWaitMs`: refused at start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_timeout_ms: Option<serde_json::Value>,
    /// Connecting to an engine, milliseconds. Default: 2000.
    pub connect_timeout_ms: u64,
    /// From sending a request to the engine's response headers,
    /// milliseconds. Default: 300000 (long prefills of long prompts).
    pub first_byte_timeout_ms: u64,
    /// Retry-After on 429 and 503, seconds. Default: 1.
    pub retry_after_s: u64,
    /// Threads serving the API port, each with its own event loop and
    /// upstream connections; a connection stays on the thread it was
    /// dealt to. 0: one per CPU the process may use (its cgroup quota
    /// included). Default: 0.
    pub api_threads: usize,
    /// GPU-cache blocks the occupancy index holds per endpoint, copies
    /// included, whatever capacity the engine reports (the smaller of the
    /// two applies). Blocks an engine stores beyond it are dropped (misses,
    /// never false hits) and counted in
    /// `kvroute_index_dropped_blocks_total{medium="gpu"}`. An entry costs at
    /// most about 55 bytes: the default is at most ~230 MiB per endpoint.
    /// Default: 4194304 (2^22).
    pub max_index_blocks_per_endpoint: usize,
    /// Offloaded blocks (every medium but the GPU cache, together) the
    /// index holds per endpoint, at the same cost; beyond it they are
    /// dropped and counted (`medium="offloaded"`). 0 indexes none.
    /// Default: 4194304 (2^22).
    pub max_offloaded_blocks_per_endpoint: usize,
    /// Blocks of the recently evicted set, for the whole pool: blocks an
    /// engine removed that no engine holds since, so that a missed block
    /// can be told `evicted` from `cold` (docs/missed-tokens.md). 8 bytes
    /// each; the oldest go first, counted in
    /// `kvroute_evicted_set_overflow_total`. 0 keeps none (every such miss
    /// is then `cold`). Default: 1048576 (2^20, 8 MiB).
    pub max_evicted_blocks: usize,
}

impl Limits {
    /// The occupancy index's per-endpoint bounds.
    pub fn index_bounds(&self) -> kvroute_core::index::Bounds {
        kvroute_core::index::Bounds {
            gpu: self.max_index_blocks_per_endpoint,
            offloaded: self.max_offloaded_blocks_per_endpoint,
        }
    }

    /// `apiThreads` resolved: 0 becomes the CPUs the process may use.
    pub fn api_threads(&self) -> usize {
        match self.api_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 << 20,
            max_body_bytes_in_flight: 512 << 20,
            max_body_bytes_per_tenant: 128 << 20,
            body_min_bytes_per_s: 16 << 10,
            tokenize_queue: 1024,
            max_tokenize_bytes: 2 << 20,
            max_connections: 10_000,
            header_read_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            body_read_timeout_ms: 60_000,
            http2_max_concurrent_streams: 256,
            http2_max_pending_accept_reset_streams: 20,
            http2_max_local_error_reset_streams: 1024,
            endpoint_concurrency: 256,
            queue_size: None,
            queue_timeout_ms: None,
            connect_timeout_ms: 2000,
            first_byte_timeout_ms: 300_000,
            retry_after_s: 1,
            api_threads: 0,
            max_index_blocks_per_endpoint: 1 << 22,
            max_offloaded_blocks_per_endpoint: 1 << 22,
            max_evicted_blocks: 1 << 20,
        }
    }
}
