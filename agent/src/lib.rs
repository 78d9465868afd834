//! `kvroute-agent`: the sidecar that runs beside an unmodified vLLM
//! container, subscribes to its KV cache events over ZMQ and serves them as
//! kvroute's WatchCache stream, so routers route exactly by what vLLM holds.
//!
//! - [`events`]: decoding vLLM's event messages (msgpack, both forms);
//! - [`resident`]: the resident set per medium and the batch sequence;
//! - [`verify`]: recomputing hashes from the engine's tokens, to catch a
//!   wrong algorithm or seed;
//! - [`rank`]: one data-parallel rank: batches in, WatchCache out;
//! - [`zmq`]: following the SUB and replay sockets, under size limits;
//! - [`zmtp`]: the ZMTP 3 client those sockets speak (see there for why
//!   it is not a crate's);
//! - [`load`]: load and capacity from vLLM's `/metrics`, restarts from
//!   `/health`;
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`.
//!
//! [`start`] runs it all; the binary is a thin wrapper.
//!
//! Crates: ZMQ is the agent's own ZMTP 3 client ([`zmtp`]), because the
//! pure-Rust `zeromq` crate cannot refuse a message before buffering it
//! whole; the image carries no libzmq either way (checked against libzmq by
//! pyzmq in CI); msgpack is `rmpv`, the `rmp` family's dynamic values,
//! because vLLM's events are a union of shapes across versions.

pub mod admin;
pub mod events;
pub mod load;
pub mod metrics;
pub mod rank;
pub mod resident;
pub mod verify;
pub mod zmq;
pub mod zmtp;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::{BlockHasher, HashAlgo, HashConfig};
use kvroute_proto::feed::Reporter;
use kvroute_proto::tls::{TlsArgs, TlsEnv};
use kvroute_proto::v1;
use kvroute_proto::v1::cache_reporter_server::CacheReporterServer;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::rank::Rank;

/// The agent's settings. Flags are vLLM's names where vLLM has one.
#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// vLLM's KV events PUB endpoint, as its `--kv-events-config` `endpoint`
    /// seen from the agent: `tcp://host:port` (rank r's is this port + r).
    #[arg(
        long,
        env = "KVROUTE_AGENT_KV_EVENTS_ENDPOINT",
        default_value = "tcp://127.0.0.1:5557"
    )]
    pub kv_events_endpoint: String,

    /// vLLM's KV events replay endpoint (`replay_endpoint`), used to fill
    /// gaps; without it a gap clears the set (rank r's is this port + r).
    #[arg(long, env = "KVROUTE_AGENT_KV_EVENTS_REPLAY_ENDPOINT")]
    pub kv_events_replay_endpoint: Option<String>,

    /// The topic to subscribe to (vLLM's `topic`; empty: every topic).
    #[arg(long, env = "KVROUTE_AGENT_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,

    /// Where WatchCache is served (rank r's on this port + r).
    #[arg(long, env = "KVROUTE_AGENT_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,

    /// Where `/healthz`, `/readyz` and `/metrics` are served.
    #[arg(
        long,
        env = "KVROUTE_AGENT_ADMIN_LISTEN",
        default_value = "0.0.0.0:9091"
    )]
    pub admin_listen: SocketAddr,

    /// vLLM's HTTP base URL (http or https, with a host), for `/metrics`
    /// and `/health`.
    #[arg(
        long,
        env = "KVROUTE_AGENT_ENGINE_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub engine_url: String,

    /// How often vLLM's `/metrics` and `/health` are read, milliseconds.
    #[arg(long, env = "KVROUTE_AGENT_LOAD_INTERVAL_MS", default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..))]
    pub load_interval_ms: u64,

    /// vLLM's `--block-size`.
    #[arg(long, env = "KVROUTE_AGENT_BLOCK_SIZE", default_value_t = kvroute_core::hash::DEFAULT_BLOCK_SIZE as u32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub block_size: u32,

    /// vLLM's `--prefix-caching-hash-algo` (sha256, sha256_cbor,
    /// xxhash_cbor).
    #[arg(
        long,
        env = "KVROUTE_AGENT_PREFIX_CACHING_HASH_ALGO",
        default_value = "sha256"
    )]
    pub prefix_caching_hash_algo: HashAlgo,

    /// vLLM's `PYTHONHASHSEED` (read from that variable by default: give
    /// the agent the same value as the vLLM container).
    #[arg(long, env = "PYTHONHASHSEED")]
    pub python_hash_seed: Option<String>,

    /// The model name clients send (vLLM's `--served-model-name`), reported
    /// to routers.
    #[arg(long, env = "KVROUTE_AGENT_SERVED_MODEL_NAME", default_value = "")]
    pub served_model_name: String,

    /// vLLM's `--data-parallel-size`: ranks followed and served.
    #[arg(long, env = "KVROUTE_AGENT_DATA_PARALLEL_SIZE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub data_parallel_size: u32,

    /// Messages a WatchCache subscriber may fall behind before its stream
    /// is ended (it resubscribes).
    #[arg(long, env = "KVROUTE_AGENT_SUBSCRIBER_BUFFER", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    pub subscriber_buffer: u64,

    /// With no batch this long after subscribing, the set (empty) counts as
    /// in sync: an idle vLLM publishes nothing. Milliseconds.
    #[arg(long, env = "KVROUTE_AGENT_QUIET_PERIOD_MS", default_value_t = 2000)]
    pub quiet_period_ms: u64,

    /// TLS of the WatchCache server (`--tls-cert-file`, `--tls-key-file`,
    /// `--tls-client-ca-file`).
    #[command(flatten)]
    pub tls: TlsArgs<AgentTlsEnv>,
}

/// The agent's TLS flags read `KVROUTE_AGENT_TLS_*`.
#[derive(Clone, Debug)]
pub struct AgentTlsEnv;

impl TlsEnv for AgentTlsEnv {
    const CERT_FILE: &'static str = "KVROUTE_AGENT_TLS_CERT_FILE";
    const KEY_FILE: &'static str = "KVROUTE_AGENT_TLS_KEY_FILE";
    const CLIENT_CA_FILE: &'static str = "KVROUTE_AGENT_TLS_CLIENT_CA_FILE";
}

impl Config {
    /// Loopback on free ports, fast polling: for tests and agents run
    /// in-process (the demo).
    pub fn loopback(kv_events_endpoint: String, engine_url: String) -> Self {
        Config {
            kv_events_endpoint,
            kv_events_replay_endpoint: None,
            kv_events_topic: String::new(),
            listen: "127.0.0.1:0".parse().expect("valid"),
            admin_listen: "127.0.0.1:0".parse().expect("valid"),
            engine_url,
            load_interval_ms: 20,
            block_size: kvroute_core::hash::DEFAULT_BLOCK_SIZE as u32,
            prefix_caching_hash_algo: HashAlgo::default(),
            python_hash_seed: None,
            served_model_name: String::new(),
            data_parallel_size: 1,
            subscriber_buffer: 4096,
            quiet_period_ms: 200,
            tls: TlsArgs::default(),
        }
    }
}

impl Config {
    /// Checks what clap's parsers cannot: the URLs and endpoints, with the
    /// ranks' port offsets. The message names the flag and the bad value.
    pub fn validate(&self) -> Result<(), String> {
        let url = reqwest::Url::parse(&self.engine_url)
            .map_err(|e| e.to_string())
            .and_then(|u| match (u.scheme(), u.host_str()) {
                ("http" | "https", Some(h)) if !h.is_empty() => Ok(()),
                ("http" | "https", _) => Err("it has no host".to_owned()),
                (scheme, _) => Err(format!("the scheme is {scheme}, not http or https")),
            });
        if let Err(why) = url {
            return Err(format!(
                "--engine-url {:?} is not an http(s) URL: {why}",
                self.engine_url
            ));
        }
        let last_rank = self.data_parallel_size.saturating_sub(1);
        let endpoints = [
            ("--kv-events-endpoint", Some(&self.kv_events_endpoint)),
            (
                "--kv-events-replay-endpoint",
                self.kv_events_replay_endpoint.as_ref(),
            ),
        ];
        for (flag, endpoint) in endpoints {
            if let Some(endpoint) = endpoint {
                offset_port(endpoint, last_rank).map_err(|why| format!("{flag} {why}"))?;
            }
        }
        Ok(())
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A setting is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An address could not be bound.
    #[error(transparent)]
    Listen(#[from] kvroute_telemetry::ListenError),
    /// The TLS files are unusable.
    #[error("WatchCache TLS: {0}")]
    Tls(#[from] kvroute_proto::tls::TlsError),
}

/// `tcp://host:port` with the port moved up by `by` (vLLM's rule for
/// data-parallel ranks).
pub fn offset_port(endpoint: &str, by: u32) -> Result<String, String> {
    let bad = || format!("{endpoint:?} is not a tcp://host:port endpoint");
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || host == "*" || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    let port = port
        .checked_add(u16::try_from(by).map_err(|_| bad())?)
        .ok_or_else(|| format!("{endpoint:?}: port + rank {by} is over 65535"))?;
    Ok(format!("tcp://{host}:{port}"))
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    /// Where each rank's WatchCache is served, by rank.
    pub cache_addrs: Vec<SocketAddr>,
    /// Where the admin endpoints are served.
    pub admin_addr: SocketAddr,
    /// Each rank's state, for tests and debugging.
    pub ranks: Vec<Arc<Rank>>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Agent {
    /// Stops: streams end, servers close.
    pub async fn shutdown(self) {
        for r in &self.ranks {
            r.end_streams();
        }
        let _ = self.stop.send(true);
        kvroute_telemetry::join_or_abort(self.tasks, Duration::from_secs(5)).await;
    }
}

/// Starts following every rank and serving them.
pub async fn start(config: Config) -> Result<Agent, StartError> {
    config.validate().map_err(StartError::Config)?;
    let hasher = BlockHasher::new(HashConfig {
        algo: config.prefix_caching_hash_algo,
        block_size: config.block_size as usize,
        seed: config.python_hash_seed.clone(),
        ..HashConfig::default()
    })
    .map_err(|e| StartError::Config(e.to_string()))?;
    if config.python_hash_seed.is_none() && config.prefix_caching_hash_algo == HashAlgo::XxhashCbor
    {
        tracing::warn!(
            "xxhash_cbor without PYTHONHASHSEED: vLLM seeds its hashes randomly per process, \
             so no router can match them; set PYTHONHASHSEED on vLLM, the agent and the routers"
        );
    }
    let metrics = Arc::new(Metrics::new());
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut ranks = Vec::new();
    let mut cache_addrs = Vec::new();
    let tls = config.tls.server()?;
    for r in 0..config.data_parallel_size {
        let endpoints = zmq::Endpoints {
            events: offset_port(&config.kv_events_endpoint, r).map_err(StartError::Config)?,
            replay: config
                .kv_events_replay_endpoint
                .as_deref()
                .map(|e| offset_port(e, r))
                .transpose()
                .map_err(StartError::Config)?,
            topic: config.kv_events_topic.clone(),
        };
        let mut addr = config.listen;
        if addr.port() != 0 {
            let port = u16::try_from(u32::from(addr.port()) + r).map_err(|_| {
                StartError::Config(format!("--listen port + rank {r} is over 65535"))
            })?;
            addr.set_port(port);
        }
        let (listener, bound) = kvroute_telemetry::listen(addr).await?;
        let rank = Arc::new(Rank::new(
            r,
            hasher.clone(),
            v1::CacheConfig {
                block_size: config.block_size,
                hash_algorithm: v1::HashAlgorithm::from(config.prefix_caching_hash_algo).into(),
                hash_seed_set: config.python_hash_seed.is_some(),
                capacity_blocks: 0,
                model: config.served_model_name.clone(),
                none_hash: Some(hasher.none_hash().to_u64()),
                hash_verification_failed: false,
            },
            config.subscriber_buffer as usize,
            metrics.clone(),
        ));
        let mut grpc = tonic::transport::Server::builder();
        if let Some(tls) = &tls {
            grpc = grpc
                .tls_config(tls.clone())
                .map_err(|e| kvroute_proto::tls::TlsError::Invalid(e.to_string()))?;
        }
        let service = CacheReporterServer::new(Reporter::new(rank.clone()))
            .max_encoding_message_size(usize::MAX);
        let mut until_stop = stopped.clone();
        tasks.push(tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let server =
                grpc.add_service(service)
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = until_stop.wait_for(|s| *s).await;
                    });
            if let Err(e) = server.await {
                tracing::error!(rank = r, error = %e, "WatchCache server failed");
            }
        }));
        tasks.push(tokio::spawn(zmq::follow(
            rank.clone(),
            endpoints,
            metrics.clone(),
            Duration::from_millis(config.quiet_period_ms),
            stopped.clone(),
        )));
        ranks.push(rank);
        cache_addrs.push(bound);
    }
    tasks.push(tokio::spawn(load::poll(
        config.engine_url.clone(),
        ranks.clone(),
        metrics.clone(),
        Duration::from_millis(config.load_interval_ms),
        stopped.clone(),
    )));
    let (admin, admin_addr) = kvroute_telemetry::listen(config.admin_listen).await?;
    tasks.push(tokio::spawn(admin::serve(
        admin,
        ranks.clone(),
        metrics,
        stopped,
    )));
    Ok(Agent {
        cache_addrs,
        admin_addr,
        ranks,
        stop,
        tasks,
    })
}
