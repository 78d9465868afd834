//! The router's configuration: one YAML file, every field documented with
//! its default; flags and environment variables override the few fields
//! people change per deployment. Parsed and validated once at start.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use axum::http::HeaderName;
use kvroute_core::hash::HashAlgo;
use kvroute_core::keys::KeyConfig;
use kvroute_core::policy::PolicyConfig;
use serde::{Deserialize, Deserializer, Serialize};

/// The longest any duration setting may be, milliseconds: one day. Longer
/// is a unit slip, and a deadline computed from it could overflow.
pub const MAX_DURATION_MS: u64 = 86_400_000;

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Address of the OpenAI-compatible API. Default: `0.0.0.0:8080`;
    /// with `extProc` set and `listen` unset, no API listener (the router
    /// runs as an endpoint picker alone).
    pub listen: Option<SocketAddr>,
    /// Address of `/metrics`, `/healthz`, `/readyz` and the debug
    /// endpoints. Default: `0.0.0.0:9090`.
    pub admin_listen: SocketAddr,
    /// Serve Envoy's `ext_proc` as a Gateway API InferencePool's endpoint
    /// picker ([`crate::ext_proc`]); unset: not served.
    pub ext_proc: Option<ExtProc>,
    /// Where endpoints come from. Default: a static file `endpoints.yaml`.
    pub discovery: Discovery,
    /// How requests are placed.
    pub routing: Routing,
    /// Tenant isolation.
    pub tenancy: Tenancy,
    /// Limits and timeouts.
    pub limits: Limits,
    /// What is proxied and which headers pass.
    pub proxy: Proxy,
    /// Retries and outlier ejection.
    pub resilience: Resilience,
    /// Logs, traces and headers.
    pub telemetry: Telemetry,
    /// TLS on the API listener; unset: plaintext.
    pub tls: Option<Tls>,
    /// A file holding a bearer token that `/debug/*` on the admin port
    /// requires (`Authorization: Bearer <token>`); `/metrics`, `/healthz`
    /// stay open. Unset: `/debug/*` answers only on a loopback
    /// `adminListen`, or with `debug.open`. A file that cannot be read, or
    /// holds no token, stops the start.
    pub admin_token_file: Option<PathBuf>,
    /// The admin port's `/debug` endpoints.
    pub debug: DebugEndpoints,
    /// TLS for the router's gRPC streams: WatchCache to the engines and
    /// WatchPool to the operator; unset: plaintext.
    pub grpc_tls: Option<GrpcTls>,
}

/// TLS of the router's gRPC clients, from PEM files.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrpcTls {
    /// The CA that signed the engines' and the operator's certificates.
    pub ca_file: PathBuf,
    /// The router's certificate chain, for servers that require one (mTLS);
    /// with `keyFile`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name the servers' certificates are checked against, when not
    /// the address dialled (engines are dialled by pod IP: give the name
    /// their certificates carry).
    #[serde(default)]
    pub server_name: Option<String>,
}

/// TLS for the API listener, from PEM files (a mounted `kubernetes.io/tls`
/// Secret has them as `tls.crt` and `tls.key`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Tls {
    /// The certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// With it, clients must present a certificate this CA signed (mTLS).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: None,
            admin_listen: "0.0.0.0:9090".parse().expect("valid"),
            discovery: Discovery::default(),
            routing: Routing::default(),
            tenancy: Tenancy::default(),
            limits: Limits::default(),
            proxy: Proxy::default(),
            resilience: Resilience::default(),
            telemetry: Telemetry::default(),
            tls: None,
            admin_token_file: None,
            debug: DebugEndpoints::default(),
            grpc_tls: None,
            ext_proc: None,
        }
    }
}

/// The API port when `listen` is unset and no `extProc` is configured.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";

impl Config {
    /// Where the OpenAI-compatible API listens, if anywhere: `listen`, else
    /// [`DEFAULT_LISTEN`] unless the router runs as an endpoint picker.
    pub fn api_listen(&self) -> Option<SocketAddr> {
        match (self.listen, &self.ext_proc) {
            (Some(addr), _) => Some(addr),
            (None, Some(_)) => None,
            (None, None) => Some(DEFAULT_LISTEN.parse().expect("a valid address")),
        }
    }
}

/// The endpoint picker's listener (Envoy `ext_proc` over gRPC).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtProc {
    /// Its address. Default: `0.0.0.0:9002` (the Gateway API Inference
    /// Extension's conventional picker port).
    pub listen: SocketAddr,
    /// TLS (gRPC over HTTP/2 with TLS), with client certificates required
    /// when `clientCaFile` is set; unset: plaintext (h2c).
    pub tls: Option<Tls>,
    /// Gateway connections at most; at the cap a new one closes the oldest
    /// with no stream open, or is closed itself. Lowered at start, with
    /// `limits.maxConnections`, to fit the open-file limit. Default: 1024.
    pub max_connections: usize,
    /// Time from a stream's start to its first message (the request
    /// headers), milliseconds; a stream that sends none is ended. Default:
    /// 10000.
    pub first_message_timeout_ms: u64,
    /// A connection with no stream open is closed after this long,
    /// milliseconds. Default: 60000.
    pub idle_timeout_ms: u64,
    /// Whether only the gateways can reach the picker's port (a
    /// NetworkPolicy, the chart's `router.picker.allowedFrom`). Only a
    /// trusted picker, or one whose gateways present a certificate
    /// (`tls.clientCaFile`), has the statuses it reports feed ejection
    /// and may serve salted tenancy with the tenant from
    /// `tenancy.tenantHeader`. Default: false.
    pub trusted_network: bool,
}

impl ExtProc {
    /// Whether what the gateways say can be trusted: their network is
    /// declared trusted, or they are authenticated by certificate.
    pub fn trusted(&self) -> bool {
        self.trusted_network
            || self
                .tls
                .as_ref()
                .is_some_and(|t| t.client_ca_file.is_some())
    }
}

/// The admin port's `/debug` endpoints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct DebugEndpoints {
    /// Serve them without `adminTokenFile`'s token on a non-loopback admin
    /// address (they show which prompts' blocks are cached). Without a
    /// token they are served only when `adminListen` is a loopback
    /// address, or with this. Default: false.
    pub open: bool,
}

impl Default for ExtProc {
    fn default() -> Self {
        ExtProc {
            listen: "0.0.0.0:9002".parse().expect("a valid address"),
            tls: None,
            max_connections: 1024,
            first_message_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            trusted_network: false,
        }
    }
}

/// Where the endpoint set comes from: one source, written as a map of one
/// key, `static` or `operator`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DiscoveryMap", into = "DiscoveryMap")]
pub enum Discovery {
    /// A YAML file listing endpoints, re-read when it changes.
    Static(StaticDiscovery),
    /// The kvroute operator's `EndpointDiscovery.WatchPool` stream.
    Operator(OperatorDiscovery),
}

/// [`Discovery`] as written.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DiscoveryMap {
    #[serde(rename = "static", skip_serializing_if = "Option::is_none")]
    static_file: Option<StaticDiscovery>,
    #[serde(skip_serializing_if = "Option::is_none")]
    operator: Option<OperatorDiscovery>,
}

impl TryFrom<DiscoveryMap> for Discovery {
    type Error = &'static str;

    fn try_from(map: DiscoveryMap) -> Result<Self, Self::Error> {
        match (map.static_file, map.operator) {
            (Some(s), None) => Ok(Discovery::Static(s)),
            (None, Some(o)) => Ok(Discovery::Operator(o)),
            _ => Err("discovery: set exactly one of static and operator"),
        }
    }
}

impl From<Discovery> for DiscoveryMap {
    fn from(d: Discovery) -> Self {
        match d {
            Discovery::Static(s) => DiscoveryMap {
                static_file: Some(s),
                operator: None,
            },
            Discovery::Operator(o) => DiscoveryMap {
                static_file: None,
                operator: Some(o),
            },
        }
    }
}

impl Default for Discovery {
    fn default() -> Self {
        Discovery::Static(StaticDiscovery::file("endpoints.yaml".into()))
    }
}

impl StaticDiscovery {
    /// Endpoints from `file`, checked at the default interval.
    pub fn file(file: PathBuf) -> Self {
        StaticDiscovery {
            file,
            reload_ms: default_reload_ms(),
        }
    }
}

/// Endpoints from a file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticDiscovery {
    /// The file (see [`crate::discovery::StaticFile`] for its format).
    pub file: PathBuf,
    /// How often the file is checked for changes, milliseconds, 1 to
    /// 86400000 (one day). Default: 2000.
    #[serde(default = "default_reload_ms")]
    pub reload_ms: u64,
}

/// Endpoints and policy from the operator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperatorDiscovery {
    /// The operator's gRPC URL, e.g. `http://kvroute-operator.kvroute:9443`
    /// (a Service over its replicas): `http://` or, with `grpcTls`,
    /// `https://`, and a host. Set this, `urls`, or both.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub url: String,
    /// Operator replicas to fail over between, in order after `url`: when
    /// the stream from one breaks, the router subscribes to the next.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// The InferencePool's namespace.
    pub namespace: String,
    /// The InferencePool's name.
    pub pool: String,
}

impl OperatorDiscovery {
    /// `url`, then `urls`: the replicas to try, in order.
    pub fn all_urls(&self) -> Vec<&str> {
        std::iter::once(self.url.as_str())
            .filter(|u| !u.is_empty())
            .chain(self.urls.iter().map(String::as_str))
            .collect()
    }
}

fn default_reload_ms() -> u64 {
    2000
}

/// A header name, checked when the configuration is read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Header(pub HeaderName);

impl Header {
    /// A header name known to be valid (panics otherwise, like
    /// [`HeaderName::from_static`]).
    pub fn from_static(name: &'static str) -> Self {
        Header(HeaderName::from_static(name))
    }
}

impl TryFrom<String> for Header {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        HeaderName::from_bytes(name.as_bytes())
            .map(Header)
            .map_err(|_| format!("{name:?} is not a valid header name"))
    }
}

impl From<Header> for String {
    fn from(h: Header) -> String {
        h.0.as_str().to_owned()
    }
}

/// A header name that the empty string turns off.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OptionalHeader(pub Option<Header>);

impl TryFrom<String> for OptionalHeader {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        if name.is_empty() {
            return Ok(OptionalHeader(None));
        }
        Header::try_from(name).map(|h| OptionalHeader(Some(h)))
    }
}

impl From<OptionalHeader> for String {
    fn from(h: OptionalHeader) -> String {
        h.0.map(String::from).unwrap_or_default()
    }
}

/// The default `routing.conversationHeader`.
pub const DEFAULT_CONVERSATION_HEADER: &str = "x-conversation-id";

/// Routing settings. With the operator, its policy replaces these.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Routing {
    /// The policy and its parameters. Default: `{name: kvroute}`.
    pub policy: PolicyConfig,
    /// How routing keys are made. Default: conversation, K = 256.
    pub key: KeyConfig,
    /// Header carrying a conversation key, besides the body's
    /// `prompt_cache_key`. Default: `x-conversation-id`.
    pub conversation_header: Header,
    /// The engines' KV block size, tokens, 1 to 4096
    /// ([`kvroute_core::hash::MAX_BLOCK_SIZE`]: vLLM's block sizes are
    /// small, and a larger one is a typing mistake). Default: 16 (vLLM's).
    pub block_size: usize,
    /// The engines' `--prefix-caching-hash-algo`. Default: sha256.
    pub hash_algo: HashAlgo,
    /// The engines' `PYTHONHASHSEED`; unset by default.
    pub hash_seed: Option<String>,
    /// The model's Hugging Face `tokenizer.json` for exact mode; default:
    /// the built-in tokenizer (what kvroute-engine-sim uses).
    pub tokenizer: Option<PathBuf>,
    /// The model's `tokenizer_config.json` (its chat template); default:
    /// the built-in ChatML template.
    pub tokenizer_config: Option<PathBuf>,
    /// LoRA adapters by served name, with their path on the engines (vLLM's
    /// `--lora-modules name=path`); adapters the engines list in
    /// `/v1/models` need no entry. Each path is a YAML string: quote one
    /// that reads as a number or a boolean (`{a: "5"}`). Default: none.
    #[serde(deserialize_with = "lora_paths")]
    pub lora_adapters: BTreeMap<String, String>,
    /// What a block the engine keeps offloaded (vLLM KV offloading to CPU
    /// or disk) is worth in a cached prefix, as a share of a GPU block,
    /// 0 to 1. Default: 0.5.
    pub offload_weight: f32,
}

/// `routing.loraAdapters` as written: every path a YAML string. YAML would
/// read a plain `5` as the path "5" otherwise, which nothing downstream
/// catches: the adapter's blocks would hash apart from the engines'.
fn lora_paths<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    struct Path(String);
    impl<'de> Deserialize<'de> for Path {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Text;
            impl serde::de::Visitor<'_> for Text {
                type Value = Path;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("the adapter's path as a string (quote one that reads as a number)")
                }
                fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Path, E> {
                    Ok(Path(v.to_owned()))
                }
            }
            // `any`, not `str`: a YAML deserializer hands a plain `5` to
            // `deserialize_str` as text, and to `deserialize_any` as a number.
            d.deserialize_any(Text)
        }
    }
    let paths = BTreeMap::<String, Path>::deserialize(d)?;
    Ok(paths.into_iter().map(|(name, Path(p))| (name, p)).collect())
}

impl Default for Routing {
    fn default() -> Self {
        Routing {
            policy: PolicyConfig::default(),
            key: KeyConfig::default(),
            conversation_header: Header::from_static(DEFAULT_CONVERSATION_HEADER),
            block_size: kvroute_core::hash::DEFAULT_BLOCK_SIZE,
            hash_algo: kvroute_core::hash::DEFAULT_HASH_ALGO,
            hash_seed: None,
            tokenizer: None,
            tokenizer_config: None,
            lora_adapters: BTreeMap::new(),
            offload_weight: kvroute_core::index::DEFAULT_OFFLOAD_WEIGHT,
        }
    }
}

/// Whether tenants share the engines' caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenancyMode {
    /// One cache for all (the default).
    #[default]
    Shared,
    /// Each tenant's blocks are salted apart: no sharing, no timing side
    /// channel.
    Salted,
}

/// What to do with a client's own `cache_salt` in salted mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientSalt {
    /// Refuse the request with 400 (the default).
    #[default]
    Reject,
    /// Replace it with the tenant's salt.
    Overwrite,
}

/// Tenant identity and isolation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Tenancy {
    /// `shared` or `salted`. Default: shared.
    pub mode: TenancyMode,
    /// A header naming the tenant. Without `apiKeysFile` it is the sole
    /// source and trusted as is (an authenticating gateway sets it; clients
    /// must not reach the router directly). With `apiKeysFile` it may only
    /// repeat the key's tenant: another tenant is 403.
    pub tenant_header: Option<Header>,
    /// A YAML map of API key → tenant (a mounted Secret); the key comes
    /// from `Authorization: Bearer <key>`. When set, every request needs a
    /// valid key (401 without one) and its tenant is the key's.
    pub api_keys_file: Option<PathBuf>,
    /// The HMAC-SHA256 key salting tenants' caches (a mounted Secret).
    /// Required in salted mode.
    pub secret_file: Option<PathBuf>,
    /// A client-supplied `cache_salt` in salted mode: `reject` or
    /// `overwrite`. Default: reject.
    pub client_salt: ClientSalt,
}

/// Sizes, concurrency and timeouts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Limits {
    /// Largest request body, bytes. Default: 32 MiB.
    pub max_body_bytes: usize,
    /// Request bodies held in memory at once, bytes, counted as they
    /// arrive (a declared `Content-Length` reserves nothing); a request
    /// that would exceed it gets 503 with `Retry-After`. Default: 512 MiB.
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
    /// Requests that may wait when every candidate is full; more get 429.
    /// Default: 1024.
    pub queue_size: usize,
    /// How long a request waits for a free endpoint before 429,
    /// milliseconds. Default: 5000.
    pub queue_timeout_ms: u64,
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
            queue_size: 1024,
            queue_timeout_ms: 5000,
            connect_timeout_ms: 2000,
            first_byte_timeout_ms: 300_000,
            retry_after_s: 1,
            api_threads: 0,
            max_index_blocks_per_endpoint: 1 << 22,
            max_offloaded_blocks_per_endpoint: 1 << 22,
        }
    }
}

/// Retries and ejection of failing endpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Resilience {
    /// Attempts per request, the first included; only before the first
    /// response byte. Default: 3.
    pub attempts: u32,
    /// Consecutive failures that eject an endpoint. Default: 3.
    pub eject_after_failures: u32,
    /// First ejection, milliseconds; each repeat doubles it. Default: 5000.
    pub ejection_base_ms: u64,
    /// Longest ejection, milliseconds. Default: 300000.
    pub ejection_max_ms: u64,
    /// Largest share of endpoints ejected at once, percent; further
    /// ejections are refused (and counted). Default: 50.
    pub max_ejected_percent: u32,
    /// Active health checks; `null` turns them off.
    pub health_check: Option<HealthCheck>,
    /// The hang deadline's floor, milliseconds: an attempt that gets no
    /// first response byte within max(this, `hungTtftMultiple` × the
    /// request's predicted time to first token at the endpoint), plus for
    /// a non-streaming request `hungMsPerToken` × its `max_tokens` (its
    /// answer comes whole), is cancelled, counted as a `timeout` fault and
    /// retried elsewhere. An endpoint ejected for timeouts is not restored
    /// by health checks, only by one trial request at a time. A
    /// non-streaming request without `max_tokens` has no hang deadline,
    /// only `limits.firstByteTimeoutMs`, which also caps it. Default: 10000.
    pub hung_after_ms: u64,
    /// See `hungAfterMs`; at least 1. Default: 4.
    pub hung_ttft_multiple: f64,
    /// See `hungAfterMs`: the time allowed per requested output token of a
    /// non-streaming request, milliseconds. Default: 100.
    pub hung_ms_per_token: u64,
}

impl Default for Resilience {
    fn default() -> Self {
        Resilience {
            attempts: 3,
            eject_after_failures: 3,
            ejection_base_ms: 5000,
            ejection_max_ms: 300_000,
            max_ejected_percent: 50,
            health_check: Some(HealthCheck::default()),
            hung_after_ms: 10_000,
            hung_ttft_multiple: 4.0,
            hung_ms_per_token: 100,
        }
    }
}

/// Active health checks: `GET path` on every endpoint every `intervalMs`.
/// A check fails on a connect error, a non-2xx status or no answer within
/// `timeoutMs`; `unhealthyThreshold` failures in a row eject the endpoint
/// until a check passes, and a passing check restores any ejected endpoint
/// except one ejected as hung (see `Resilience::hung_after_ms`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheck {
    /// The path. Default: `/health` (vLLM's).
    pub path: String,
    /// Milliseconds between checks. Default: 5000.
    pub interval_ms: u64,
    /// Milliseconds a check may take. Default: 2000.
    pub timeout_ms: u64,
    /// Failed checks in a row that eject. Default: 2.
    pub unhealthy_threshold: u32,
}

impl Default for HealthCheck {
    fn default() -> Self {
        HealthCheck {
            path: "/health".into(),
            interval_ms: 5000,
            timeout_ms: 2000,
            unhealthy_threshold: 2,
        }
    }
}

/// What the API port proxies, and which client headers reach the engines.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Proxy {
    /// `POST` paths proxied to the engines; any other is 404. Default: the
    /// OpenAI inference APIs ([`DEFAULT_ALLOWED_PATHS`]). Engine admin
    /// APIs such as vLLM's `/v1/load_lora_adapter` only when listed.
    pub allowed_paths: Vec<String>,
    /// Forward the client's `Authorization` header (the router's own API
    /// key when `tenancy.apiKeysFile` is set). Default: false.
    pub forward_authorization: bool,
    /// Forward `tenancy.tenantHeader`. Default: false.
    pub forward_tenant_header: bool,
}

/// The paths proxied by default: the OpenAI inference APIs vLLM serves.
pub const DEFAULT_ALLOWED_PATHS: [&str; 8] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/rerank",
    "/v1/score",
];

impl Default for Proxy {
    fn default() -> Self {
        Proxy {
            allowed_paths: DEFAULT_ALLOWED_PATHS.map(str::to_owned).to_vec(),
            forward_authorization: false,
            forward_tenant_header: false,
        }
    }
}

/// Log format: `text` (the default) or `json`. Shared with the operator.
pub use kvroute_telemetry::LogFormat;

/// Observability settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Telemetry {
    /// `text` or `json`. Default: text.
    pub log_format: LogFormat,
    /// Response header naming the endpoint that served the request; empty
    /// (`""`) turns it off. Default: `x-kvroute-endpoint`.
    pub endpoint_header: OptionalHeader,
    /// OTLP/gRPC collector for traces, e.g. `http://otel-collector:4317`;
    /// unset: no traces.
    pub otlp_endpoint: Option<String>,
    /// Tenants named in the `tenant` label of metrics, besides those of
    /// `tenancy.apiKeysFile`; any other tenant is `other` (so clients
    /// cannot create series). Default: none.
    pub tenant_labels: Vec<String>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            log_format: LogFormat::Text,
            endpoint_header: OptionalHeader(Some(Header::from_static("x-kvroute-endpoint"))),
            otlp_endpoint: None,
            tenant_labels: Vec::new(),
        }
    }
}

/// A configuration error, naming the field and the value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The routing policy's parameters are unusable.
    #[error("routing.policy: {0}")]
    Policy(String),
    /// A file a field names could not be read.
    #[error("{field}: cannot read {path}: {source}")]
    File {
        /// The field, as written in YAML.
        field: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The configuration file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The YAML is malformed or has an unknown field.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: serde_yaml::Error,
    },
    /// A value is out of range.
    #[error("{field}: {reason} (got {value})")]
    Invalid {
        /// The field, as written in YAML.
        field: &'static str,
        /// The value.
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
}

impl ConfigError {
    /// Reading `path`, which `field` names, failed with `source`.
    pub fn file(field: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        ConfigError::File {
            field,
            path: path.display().to_string(),
            source,
        }
    }
}

impl Config {
    /// Reads and validates a YAML file.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let config: Config = serde_yaml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what types cannot: every duration and count in range, the
    /// URLs, and the fields that depend on each other. The error names the
    /// first bad field, as written in YAML, and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Err(reason) = self.routing.policy.validate() {
            return Err(ConfigError::Policy(reason));
        }
        self.validate_durations()?;
        self.validate_counts()?;
        self.validate_urls()?;
        if let Some(e) = &self.ext_proc
            && self.tenancy.mode == TenancyMode::Salted
            && self.tenancy.api_keys_file.is_none()
            && !e.trusted()
        {
            return Err(invalid(
                "extProc.trustedNetwork",
                &false,
                "salted tenancy with the tenant from tenancy.tenantHeader alone needs a trusted picker: set extProc.tls.clientCaFile (gateways authenticated by certificate) or extProc.trustedNetwork: true (only gateways reach the port), or tenancy.apiKeysFile",
            ));
        }
        let l = &self.limits;
        if l.max_body_bytes_in_flight < l.max_body_bytes {
            return Err(invalid(
                "limits.maxBodyBytesInFlight",
                &l.max_body_bytes_in_flight,
                "must be at least limits.maxBodyBytes",
            ));
        }
        if l.max_body_bytes_per_tenant < l.max_body_bytes {
            return Err(invalid(
                "limits.maxBodyBytesPerTenant",
                &l.max_body_bytes_per_tenant,
                "must be at least limits.maxBodyBytes",
            ));
        }
        let r = &self.resilience;
        if r.ejection_max_ms < r.ejection_base_ms {
            return Err(invalid(
                "resilience.ejectionMaxMs",
                &r.ejection_max_ms,
                "must be at least resilience.ejectionBaseMs",
            ));
        }
        if self.tls.is_some() && self.api_listen().is_none() {
            return Err(invalid(
                "tls",
                &"set",
                "configures the API listener, which does not run without listen when extProc is set",
            ));
        }
        if let Some(h) = &r.health_check
            && !h.path.starts_with('/')
        {
            return Err(invalid(
                "resilience.healthCheck.path",
                &h.path,
                "must start with /",
            ));
        }
        let multiple = self.resilience.hung_ttft_multiple;
        if !(multiple.is_finite() && multiple >= 1.0) {
            return Err(invalid(
                "resilience.hungTtftMultiple",
                &multiple,
                "must be a number of at least 1",
            ));
        }
        for path in &self.proxy.allowed_paths {
            if !path.starts_with("/v1/") || path.parse::<axum::http::Uri>().is_err() {
                return Err(invalid(
                    "proxy.allowedPaths",
                    path,
                    "must be a path under /v1/",
                ));
            }
        }
        if self.tenancy.mode == TenancyMode::Salted && self.tenancy.secret_file.is_none() {
            return Err(invalid(
                "tenancy.secretFile",
                &"none",
                "is required when tenancy.mode is salted",
            ));
        }
        if self.tenancy.mode == TenancyMode::Salted
            && self.tenancy.tenant_header.is_none()
            && self.tenancy.api_keys_file.is_none()
        {
            return Err(invalid(
                "tenancy.tenantHeader",
                &"none",
                "salted tenancy needs a tenant source: tenantHeader or apiKeysFile",
            ));
        }
        if let Some(t) = &self.grpc_tls
            && t.cert_file.is_some() != t.key_file.is_some()
        {
            return Err(invalid(
                "grpcTls.certFile",
                &"one of certFile and keyFile",
                "set both or neither",
            ));
        }
        if let Some((name, _)) = self
            .routing
            .lora_adapters
            .iter()
            .find(|(name, path)| name.is_empty() || path.is_empty())
        {
            return Err(invalid(
                "routing.loraAdapters",
                name,
                "needs a name and a path",
            ));
        }
        let weight = self.routing.offload_weight;
        if !(0.0..=1.0).contains(&weight) {
            return Err(invalid(
                "routing.offloadWeight",
                &weight.to_string(),
                "must be within 0..=1",
            ));
        }
        Ok(())
    }

    /// Every duration: at most [`MAX_DURATION_MS`], and at least 1 ms
    /// except where 0 has a meaning (no queueing; retry at once).
    fn validate_durations(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        let r = &self.resilience;
        let mut at_least_1 = vec![
            ("limits.headerReadTimeoutMs", l.header_read_timeout_ms),
            ("limits.idleTimeoutMs", l.idle_timeout_ms),
            ("limits.bodyReadTimeoutMs", l.body_read_timeout_ms),
            ("limits.connectTimeoutMs", l.connect_timeout_ms),
            ("limits.firstByteTimeoutMs", l.first_byte_timeout_ms),
            ("resilience.ejectionBaseMs", r.ejection_base_ms),
            ("resilience.ejectionMaxMs", r.ejection_max_ms),
            ("resilience.hungAfterMs", r.hung_after_ms),
        ];
        if let Discovery::Static(s) = &self.discovery {
            at_least_1.push(("discovery.static.reloadMs", s.reload_ms));
        }
        if let Some(e) = &self.ext_proc {
            at_least_1.push(("extProc.firstMessageTimeoutMs", e.first_message_timeout_ms));
            at_least_1.push(("extProc.idleTimeoutMs", e.idle_timeout_ms));
        }
        if let Some(h) = &r.health_check {
            at_least_1.push(("resilience.healthCheck.intervalMs", h.interval_ms));
            at_least_1.push(("resilience.healthCheck.timeoutMs", h.timeout_ms));
        }
        for (field, ms) in at_least_1 {
            if !(1..=MAX_DURATION_MS).contains(&ms) {
                return Err(invalid(field, &ms, "must be 1 to 86400000 (one day)"));
            }
        }
        for (field, ms) in [
            ("limits.queueTimeoutMs", l.queue_timeout_ms),
            ("limits.retryAfterS", l.retry_after_s.saturating_mul(1000)),
        ] {
            if ms > MAX_DURATION_MS {
                let value = if field.ends_with('S') {
                    l.retry_after_s
                } else {
                    ms
                };
                return Err(invalid(field, &value, "must be at most one day"));
            }
        }
        Ok(())
    }

    /// Every count and size that 0 would turn into "refuse everything" or
    /// "never": at least 1; and those with a hard ceiling.
    fn validate_counts(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        let r = &self.resilience;
        let mut at_least_1: Vec<(&'static str, u64)> = vec![
            ("limits.maxBodyBytes", l.max_body_bytes as u64),
            (
                "limits.maxBodyBytesInFlight",
                l.max_body_bytes_in_flight as u64,
            ),
            ("limits.bodyMinBytesPerS", l.body_min_bytes_per_s),
            ("limits.tokenizeQueue", l.tokenize_queue as u64),
            ("limits.maxTokenizeBytes", l.max_tokenize_bytes as u64),
            ("limits.maxConnections", l.max_connections as u64),
            (
                "limits.maxIndexBlocksPerEndpoint",
                l.max_index_blocks_per_endpoint as u64,
            ),
            (
                "limits.http2MaxConcurrentStreams",
                u64::from(l.http2_max_concurrent_streams),
            ),
            (
                "limits.endpointConcurrency",
                u64::from(l.endpoint_concurrency),
            ),
            ("resilience.attempts", u64::from(r.attempts)),
            (
                "resilience.ejectAfterFailures",
                u64::from(r.eject_after_failures),
            ),
        ];
        if let Some(e) = &self.ext_proc {
            at_least_1.push(("extProc.maxConnections", e.max_connections as u64));
        }
        if let Some(h) = &r.health_check {
            at_least_1.push((
                "resilience.healthCheck.unhealthyThreshold",
                u64::from(h.unhealthy_threshold),
            ));
        }
        for (field, value) in at_least_1 {
            if value == 0 {
                return Err(invalid(field, &0, "must be at least 1"));
            }
        }
        let block_size = self.routing.block_size;
        if !(1..=kvroute_core::hash::MAX_BLOCK_SIZE).contains(&block_size) {
            return Err(invalid(
                "routing.blockSize",
                &block_size,
                "must be 1 to 4096 (the engines' block size in tokens)",
            ));
        }
        if l.api_threads > 1024 {
            return Err(invalid(
                "limits.apiThreads",
                &l.api_threads,
                "must be at most 1024 (0: one per CPU)",
            ));
        }
        if r.max_ejected_percent > 100 {
            return Err(invalid(
                "resilience.maxEjectedPercent",
                &r.max_ejected_percent,
                "must be between 0 and 100",
            ));
        }
        Ok(())
    }

    /// The operator's URLs and the trace collector's.
    fn validate_urls(&self) -> Result<(), ConfigError> {
        if let Discovery::Operator(o) = &self.discovery {
            let urls = o.all_urls();
            if urls.is_empty() {
                return Err(invalid(
                    "discovery.operator.url",
                    &"",
                    "set url, urls or both",
                ));
            }
            for (i, url) in urls.iter().enumerate() {
                let field = if i == 0 && !o.url.is_empty() {
                    "discovery.operator.url"
                } else {
                    "discovery.operator.urls"
                };
                if kvroute_telemetry::check_http_url(url).is_err() {
                    return Err(invalid(
                        field,
                        &format!("{url:?}"),
                        "is not an http(s) URL with a host",
                    ));
                }
                if url.starts_with("https://") != self.grpc_tls.is_some() {
                    return Err(invalid(
                        field,
                        url,
                        "use https:// exactly when grpcTls is set",
                    ));
                }
            }
            for (field, value) in [
                ("discovery.operator.namespace", &o.namespace),
                ("discovery.operator.pool", &o.pool),
            ] {
                if value.is_empty() {
                    return Err(invalid(field, &"", "must not be empty"));
                }
            }
        }
        if let Some(url) = &self.telemetry.otlp_endpoint
            && kvroute_telemetry::check_http_url(url).is_err()
        {
            return Err(invalid(
                "telemetry.otlpEndpoint",
                &format!("{url:?}"),
                "is not an http(s) URL with a host",
            ));
        }
        Ok(())
    }
}

fn invalid(
    field: &'static str,
    value: &dyn std::fmt::Display,
    reason: &'static str,
) -> ConfigError {
    ConfigError::Invalid {
        field,
        value: value.to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_the_defaults() {
        let c: Config = serde_yaml::from_str("{}").unwrap();
        assert_eq!(c, Config::default());
        c.validate().unwrap();
    }

    #[test]
    fn a_full_file_parses() {
        let yaml = r#"
listen: 127.0.0.1:8080
adminListen: 127.0.0.1:9090
discovery:
  operator: {url: "http://op:9443", namespace: ml, pool: llama}
routing:
  policy: {name: kvroute, latencySlack: 2, engine: {prefillTokensPerSecond: 20000}}
  key: {mode: prefix, prefixTokens: 128}
  blockSize: 32
  hashAlgo: sha256_cbor
  hashSeed: "0"
tenancy:
  mode: salted
  tenantHeader: x-tenant
  secretFile: /secrets/salt
  clientSalt: overwrite
limits: {maxBodyBytes: 1024}
resilience: {attempts: 2}
telemetry: {logFormat: json, endpointHeader: ""}
"#;
        let c: Config = serde_yaml::from_str(yaml).unwrap();
        c.validate().unwrap();
        assert_eq!(c.routing.block_size, 32);
        assert_eq!(c.tenancy.client_salt, ClientSalt::Overwrite);
        assert!(matches!(c.discovery, Discovery::Operator(_)));
    }

    #[test]
    fn operator_urls_fail_over_in_order_and_need_one() {
        let parse = |discovery: &str| {
            let c: Config =
                serde_yaml::from_str(&format!("discovery:\n  operator: {discovery}\n")).unwrap();
            c.validate().map(|()| c)
        };
        let c =
            parse("{url: http://a:9443, urls: [http://b:9443], namespace: ml, pool: p}").unwrap();
        let Discovery::Operator(o) = &c.discovery else {
            panic!("operator discovery")
        };
        assert_eq!(o.all_urls(), ["http://a:9443", "http://b:9443"]);
        assert!(parse("{urls: [http://b:9443], namespace: ml, pool: p}").is_ok());
        let none = parse("{namespace: ml, pool: p}").unwrap_err().to_string();
        assert!(none.contains("discovery.operator.url"), "{none}");
        let tls = parse("{urls: [http://a:9443, https://b:9443], namespace: ml, pool: p}")
            .unwrap_err()
            .to_string();
        assert!(tls.contains("https://b:9443"), "{tls}");
    }

    #[test]
    fn header_names_are_checked_while_parsing() {
        for (yaml, field) in [
            (
                "tenancy: {tenantHeader: 'x tenant'}",
                "tenancy: \"x tenant\"",
            ),
            ("routing: {conversationHeader: 'a:b'}", "routing: \"a:b\""),
        ] {
            let err = serde_yaml::from_str::<Config>(yaml)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(field), "{err}");
            assert!(err.contains("is not a valid header name"), "{err}");
        }
        let c: Config = serde_yaml::from_str("tenancy: {tenantHeader: X-Tenant}").unwrap();
        assert_eq!(
            c.tenancy.tenant_header,
            Some(Header::from_static("x-tenant"))
        );
    }

    #[test]
    fn salted_header_tenancy_needs_a_trusted_picker() {
        let base = "tenancy: {mode: salted, tenantHeader: x-t, secretFile: s}\n";
        let parse = |picker: &str| {
            let c: Config = serde_yaml::from_str(&format!("{base}extProc: {picker}")).unwrap();
            c.validate().map_err(|e| e.to_string())
        };
        let err = parse("{listen: '127.0.0.1:9002'}").unwrap_err();
        assert!(err.starts_with("extProc.trustedNetwork: "), "{err}");
        assert!(err.contains("tenancy.tenantHeader"), "{err}");
        parse("{listen: '127.0.0.1:9002', trustedNetwork: true}").unwrap();
        parse("{listen: '127.0.0.1:9002', tls: {certFile: c, keyFile: k, clientCaFile: ca}}")
            .unwrap();
        // Without a picker, the API port's rule stands (an authenticating
        // gateway sets the header).
        let c: Config = serde_yaml::from_str(base).unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn discovery_is_one_source() {
        let c: Config = serde_yaml::from_str("discovery: {static: {file: e.yaml}}").unwrap();
        assert_eq!(
            c.discovery,
            Discovery::Static(StaticDiscovery::file("e.yaml".into()))
        );
        for two in [
            "discovery: {static: {file: e.yaml}, operator: {url: 'http://o', namespace: n, pool: p}}",
            "discovery: {}",
        ] {
            let err = serde_yaml::from_str::<Config>(two).unwrap_err().to_string();
            assert!(
                err.starts_with("discovery: set exactly one of static and operator"),
                "{two}: {err}"
            );
        }
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let err = serde_yaml::from_str::<Config>("routing: {blockSzie: 16}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("blockSzie"), "{err}");
        let c: Config = serde_yaml::from_str("routing: {blockSize: 0}").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            "routing.blockSize: must be 1 to 4096 (the engines' block size in tokens) (got 0)"
        );
        let c: Config = serde_yaml::from_str("limits: {apiThreads: 5000}").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            "limits.apiThreads: must be at most 1024 (0: one per CPU) (got 5000)"
        );
        let c: Config = serde_yaml::from_str("limits: {apiThreads: 3}").unwrap();
        assert_eq!(c.limits.api_threads(), 3);
        assert!(Config::default().limits.api_threads() >= 1);
        let c: Config = serde_yaml::from_str("tenancy: {mode: salted, tenantHeader: x-t}").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("tenancy.secretFile")
        );
        let c: Config =
            serde_yaml::from_str("routing: {policy: {name: kvroute, latencySlack: -1}}").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            "routing.policy: latencySlack must be 0 or more, got -1"
        );
        let err = serde_yaml::from_str::<Config>("telemetry: {endpointHeader: 'bad header'}")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("telemetry: \"bad header\" is not a valid header name"),
            "{err}"
        );
        let off: Config = serde_yaml::from_str("telemetry: {endpointHeader: ''}").unwrap();
        assert_eq!(off.telemetry.endpoint_header, OptionalHeader(None));
    }

    #[test]
    fn the_hang_deadline_settings_are_checked() {
        for (yaml, err) in [
            (
                "resilience: {hungAfterMs: 0}",
                "resilience.hungAfterMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "resilience: {hungTtftMultiple: 0.5}",
                "resilience.hungTtftMultiple: must be a number of at least 1 (got 0.5)",
            ),
        ] {
            let c: Config = serde_yaml::from_str(yaml).unwrap();
            assert_eq!(c.validate().unwrap_err().to_string(), err);
        }
    }

    /// The error a file gets, whether parsing or validation finds it.
    fn error_of(yaml: &str) -> String {
        match serde_yaml::from_str::<Config>(yaml) {
            Ok(c) => c
                .validate()
                .map_or_else(|e| e.to_string(), |()| "valid".into()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_duration_and_count_is_in_range() {
        let cases = [
            (
                "discovery: {static: {file: e.yaml, reloadMs: 0}}",
                "discovery.static.reloadMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "discovery: {static: {file: e.yaml, reloadMs: 18446744073709551615}}",
                "discovery.static.reloadMs: must be 1 to 86400000 (one day) (got 18446744073709551615)",
            ),
            (
                "limits: {queueTimeoutMs: 86400001}",
                "limits.queueTimeoutMs: must be at most one day (got 86400001)",
            ),
            (
                "limits: {retryAfterS: 18446744073709551615}",
                "limits.retryAfterS: must be at most one day (got 18446744073709551615)",
            ),
            (
                "limits: {connectTimeoutMs: 0}",
                "limits.connectTimeoutMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "limits: {firstByteTimeoutMs: 0}",
                "limits.firstByteTimeoutMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "limits: {tokenizeQueue: 0}",
                "limits.tokenizeQueue: must be at least 1 (got 0)",
            ),
            (
                "limits: {maxTokenizeBytes: 0}",
                "limits.maxTokenizeBytes: must be at least 1 (got 0)",
            ),
            (
                "resilience: {ejectionBaseMs: 0}",
                "resilience.ejectionBaseMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "resilience: {ejectionBaseMs: 10000, ejectionMaxMs: 5000}",
                "resilience.ejectionMaxMs: must be at least resilience.ejectionBaseMs (got 5000)",
            ),
            (
                "resilience: {healthCheck: {intervalMs: 0}}",
                "resilience.healthCheck.intervalMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "resilience: {healthCheck: {timeoutMs: 0}}",
                "resilience.healthCheck.timeoutMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "resilience: {healthCheck: {unhealthyThreshold: 0}}",
                "resilience.healthCheck.unhealthyThreshold: must be at least 1 (got 0)",
            ),
            (
                "extProc: {idleTimeoutMs: 0}",
                "extProc.idleTimeoutMs: must be 1 to 86400000 (one day) (got 0)",
            ),
            (
                "routing: {blockSize: 4294967295}",
                "routing.blockSize: must be 1 to 4096 (the engines' block size in tokens) (got 4294967295)",
            ),
            (
                "routing: {blockSize: 4097}",
                "routing.blockSize: must be 1 to 4096 (the engines' block size in tokens) (got 4097)",
            ),
        ];
        for (yaml, error) in cases {
            assert_eq!(error_of(yaml), error, "{yaml}");
        }
        for fine in [
            "discovery: {static: {file: e.yaml, reloadMs: 1}}",
            "limits: {queueTimeoutMs: 0, retryAfterS: 0, queueSize: 0}",
            "routing: {blockSize: 4096}",
            "resilience: {healthCheck: null, ejectionBaseMs: 86400000, ejectionMaxMs: 86400000}",
        ] {
            assert_eq!(error_of(fine), "valid", "{fine}");
        }
    }

    #[test]
    fn urls_must_be_http_urls_with_a_host() {
        let op = |url: &str| {
            format!("discovery: {{operator: {{url: '{url}', namespace: ml, pool: p}}}}")
        };
        assert_eq!(
            error_of(&op("not a url")),
            "discovery.operator.url: is not an http(s) URL with a host (got \"not a url\")"
        );
        for bad in ["kvroute-operator:9443", "ftp://op:9443", "http://"] {
            let err = error_of(&op(bad));
            assert!(
                err.starts_with("discovery.operator.url: is not an http(s) URL"),
                "{bad}: {err}"
            );
        }
        assert_eq!(
            error_of(
                "discovery: {operator: {url: 'http://a:1', urls: [nope], namespace: ml, pool: p}}"
            ),
            "discovery.operator.urls: is not an http(s) URL with a host (got \"nope\")"
        );
        assert_eq!(
            error_of("discovery: {operator: {url: 'http://a:1', namespace: '', pool: p}}"),
            "discovery.operator.namespace: must not be empty (got )"
        );
        assert_eq!(
            error_of("telemetry: {otlpEndpoint: 'otel:4317'}"),
            "telemetry.otlpEndpoint: is not an http(s) URL with a host (got \"otel:4317\")"
        );
        assert_eq!(error_of(&op("http://op.kvroute:9443")), "valid");
        assert_eq!(
            error_of("telemetry: {otlpEndpoint: 'http://otel:4317'}"),
            "valid"
        );
    }

    #[test]
    fn parameters_a_policy_does_not_have_are_refused() {
        let err = error_of("routing: {policy: {name: round-robin, slack: 2}}");
        assert!(
            err.starts_with("routing.policy: unknown field `slack`"),
            "{err}"
        );
        let err = error_of("routing: {policy: {name: kvroute, slack: 2}}");
        assert!(
            err.starts_with("routing.policy: unknown field `slack`"),
            "{err}"
        );
        assert_eq!(error_of("routing: {policy: {name: round-robin}}"), "valid");
    }

    #[test]
    fn lora_paths_are_strings() {
        for (yaml, shown) in [
            ("routing: {loraAdapters: {a: 5}}", "integer `5`"),
            ("routing: {loraAdapters: {a: true}}", "boolean `true`"),
            ("routing: {loraAdapters: {a: ~}}", "unit value"),
            ("routing: {loraAdapters: {a: [x]}}", "sequence"),
        ] {
            let err = error_of(yaml);
            assert!(
                err.starts_with("routing.loraAdapters.a: invalid type"),
                "{yaml}: {err}"
            );
            assert!(err.contains(shown), "{yaml}: {err}");
            assert!(
                err.contains("the adapter's path as a string"),
                "{yaml}: {err}"
            );
        }
        let c: Config =
            serde_yaml::from_str("routing: {loraAdapters: {a: '5', b: /models/b}}").unwrap();
        c.validate().unwrap();
        assert_eq!(c.routing.lora_adapters["a"], "5");
        assert_eq!(c.routing.lora_adapters["b"], "/models/b");
    }
}
