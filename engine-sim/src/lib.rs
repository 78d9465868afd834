//! `kvroute-engine-sim`: an engine that behaves like vLLM where routing is
//! concerned. vLLM's scheduler and prefix block cache, as
//! [`kvroute_core::engine`] models them, run in real time with vLLM's
//! hashing ([`engine`]), vLLM's OpenAI-compatible API, metrics and errors
//! ([`http`]), a live WatchCache occupancy stream (served with
//! [`kvroute_proto::feed`]), and optionally vLLM's own ZMQ KV events
//! ([`kv_events`]) for `kvroute-agent` to bridge, and disaggregated
//! prefill with vLLM's `kv_transfer_params` ([`transfer`]). Besides vLLM, a
//! deterministic test double of an embedding model ([`embeddings`], served
//! as `/v1/embeddings`) for the semantic response cache's tests.
//!
//! Run it as a binary, or in-process from tests with [`start`]:
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvroute_engine_sim::StartError> {
//! let sim = kvroute_engine_sim::start(kvroute_engine_sim::Config::test()).await?;
//! println!("HTTP on {}, WatchCache on {}", sim.http_addr, sim.cache_addr);
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

pub mod config;
pub mod embeddings;
pub mod engine;
pub mod http;
pub mod kv_events;
pub mod metrics;
pub mod transfer;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::tokenize::{ChatTemplate, Tokenizer};
use kvroute_proto::feed::Reporter;
use kvroute_proto::v1::cache_reporter_server::CacheReporterServer;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::Config;
pub use engine::Engine;

/// How long after a request arrives its load report goes out: arrivals
/// within it share one report (at most 100 reports a second per
/// subscriber beyond the interval's).
pub const LOAD_REPORT_DEBOUNCE: Duration = Duration::from_millis(10);

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag has a bad value.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The tokenizer or chat template is invalid.
    #[error("{0}")]
    Tokenize(#[from] kvroute_core::tokenize::TokenizeError),
    /// The hashing configuration is invalid.
    #[error("{0}")]
    Hash(#[from] kvroute_core::hash::HashError),
    /// The WatchCache TLS files are unusable.
    #[error("WatchCache TLS: {0}")]
    Tls(#[from] kvroute_proto::tls::TlsError),
    /// An address could not be bound.
    #[error(transparent)]
    Listen(#[from] kvroute_telemetry::ListenError),
    /// A KV events socket could not be bound.
    #[error(transparent)]
    KvEvents(#[from] kv_events::BindError),
}

/// A running simulator.
#[derive(Debug)]
pub struct Sim {
    /// Where the HTTP API listens.
    pub http_addr: SocketAddr,
    /// Where WatchCache listens.
    pub cache_addr: SocketAddr,
    /// Where the KV transfer server listens ([`transfer`]).
    pub transfer_addr: SocketAddr,
    /// The engine, for tests that look inside or inject faults.
    pub engine: Arc<Engine>,
    /// vLLM's KV events publisher, when enabled: its bound addresses, and
    /// fault injection for tests.
    pub kv_events: Option<kv_events::Publisher>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Sim {
    /// Stops serving. WatchCache streams end at once; HTTP requests in
    /// flight get up to 5 seconds to finish, then the servers are dropped
    /// (a subscriber that stopped reading cannot hold the shutdown).
    pub async fn shutdown(self) {
        self.engine.end_streams();
        let _ = self.stop.send(true);
        kvroute_telemetry::join_or_abort(self.tasks, Duration::from_secs(5)).await;
    }
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, StartError> {
    std::fs::read(path).map_err(|source| StartError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// Starts an engine with its HTTP and WatchCache servers.
pub async fn start(config: Config) -> Result<Sim, StartError> {
    config.validate().map_err(StartError::Config)?;
    let tokenizer = match &config.tokenizer {
        Some(path) => Tokenizer::from_tokenizer_json(&read(path)?)?,
        None => Tokenizer::builtin(),
    };
    let template = match &config.tokenizer_config {
        Some(path) => ChatTemplate::from_tokenizer_config(&read(path)?)?,
        None => ChatTemplate::builtin(),
    };
    let mut grpc = tonic::transport::Server::builder();
    if let Some(tls) = config.tls.server()? {
        grpc = grpc
            .tls_config(tls)
            .map_err(|e| kvroute_proto::tls::TlsError::Invalid(e.to_string()))?;
    }
    let (http, http_addr) = kvroute_telemetry::listen(config.listen).await?;
    let (cache, cache_addr) = kvroute_telemetry::listen(config.cache_listen).await?;
    let transfer_listen =
        (config.kv_transfer_listen).unwrap_or_else(|| SocketAddr::new(config.listen.ip(), 0));
    let (transfer, transfer_addr) = kvroute_telemetry::listen(transfer_listen).await?;
    let transfer_host =
        (config.kv_transfer_host.clone()).unwrap_or_else(|| transfer_addr.ip().to_string());
    let load_interval = Duration::from_millis(config.load_interval_ms);
    let kv_events = match &config.kv_events_endpoint {
        Some(endpoint) => Some(
            kv_events::Publisher::start(kv_events::Endpoints {
                endpoint: endpoint.clone(),
                replay_endpoint: config.kv_events_replay_endpoint.clone(),
                topic: config.kv_events_topic.clone(),
                buffer_steps: config.kv_events_buffer_steps,
            })
            .await?,
        ),
        None => None,
    };
    let engine = Engine::new(config)?;
    if let Some(publisher) = &kv_events {
        engine.publish_kv_events(publisher.clone());
    }
    let (stop, stopped) = watch::channel(false);

    let app = http::App::new(
        engine.clone(),
        tokenizer,
        template,
        (transfer_host, transfer_addr.port()),
    );
    let mut until_stop = stopped.clone();
    let http_task = tokio::spawn(async move {
        // Small SSE chunks must not wait for delayed ACKs.
        let http = axum::serve::ListenerExt::tap_io(http, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = axum::serve(http, http::router(app)).with_graceful_shutdown(async move {
            let _ = until_stop.wait_for(|s| *s).await;
        });
        if let Err(e) = server.await {
            tracing::error!(error = %e, "HTTP server failed");
        }
    });

    let transfer_task = tokio::spawn(transfer::serve(transfer, engine.clone(), stopped.clone()));

    let reporter = CacheReporterServer::new(Reporter::new(engine.clone()))
        .max_encoding_message_size(usize::MAX);
    let mut until_stop = stopped.clone();
    let grpc_task = tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(cache);
        let server =
            grpc.add_service(reporter)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = until_stop.wait_for(|s| *s).await;
                });
        if let Err(e) = server.await {
            tracing::error!(error = %e, "WatchCache server failed");
        }
    });

    let reporting = engine.clone();
    let mut until_stop = stopped;
    let load_task = tokio::spawn(async move {
        // Every interval, and soon after requests arrive: routers then learn
        // of new queued work (other routers' especially) within
        // milliseconds, not an interval.
        let mut tick = tokio::time::interval(load_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let arrived = tokio::select! {
                _ = tick.tick() => false,
                _ = reporting.arrival() => true,
                _ = until_stop.wait_for(|s| *s) => break,
            };
            if arrived {
                // Arrivals this close together make one report.
                tokio::time::sleep(LOAD_REPORT_DEBOUNCE.min(load_interval)).await;
                tick.reset();
            }
            reporting.report_load();
        }
    });

    Ok(Sim {
        http_addr,
        cache_addr,
        transfer_addr,
        engine,
        kv_events,
        stop,
        tasks: vec![http_task, grpc_task, transfer_task, load_task],
    })
}
