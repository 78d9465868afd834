//! Starting the router: settings, tenancy, the pool and its discovery, the
//! API listener and the admin listener, and a graceful shutdown that lets
//! in-flight streams finish. The background tasks run under
//! [`crate::tasks`]' rule: the death of any is fatal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::Lora;
use kvroute_core::tokenize::{ChatTemplate, Tokenizer};
use tokio::sync::watch;

use crate::config::{Config, ConfigError, Discovery};
use crate::discovery;
use crate::http::Forwarder;
use crate::listener::{self, ConnLimits};
use crate::metrics::Metrics;
use crate::pool::Pool;
use crate::pool::Watchers;
use crate::request::Service;
use crate::response_cache::ResponseCache;
use crate::response_cache::metrics::CacheMetrics;
use crate::settings::Settings;
use crate::tasks::{Stop, TaskDied, Tasks};
use crate::tenancy::Tenancy;

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The tokenizer or chat template file (the field) is invalid.
    #[error("{0}: {1}")]
    Tokenize(
        &'static str,
        #[source] kvroute_core::tokenize::TokenizeError,
    ),
    /// The hashing settings are invalid.
    #[error("routing: {0}")]
    Hash(#[from] kvroute_core::hash::HashError),
    /// A `tls` file is unreadable or invalid.
    #[error("tls: {0}")]
    Tls(#[source] kvroute_proto::tls::TlsError),
    /// An `extProc.tls` file is unreadable or invalid.
    #[error("extProc.tls: {0}")]
    ExtProcTls(#[source] kvroute_proto::tls::TlsError),
    /// A `grpcTls` file is unreadable or invalid.
    #[error("grpcTls: {0}")]
    GrpcTls(#[from] kvroute_proto::tls::TlsError),
    /// The static endpoints file is unreadable or invalid.
    #[error("discovery.static.file: {0}")]
    Discovery(#[from] discovery::DiscoveryError),
    /// A listener could not be bound.
    #[error("{0}")]
    Listen(#[from] kvroute_telemetry::ListenError),
}

impl StartError {
    /// Whether the configuration is at fault (a value, or a file it names),
    /// rather than the machine (a port taken).
    pub fn is_config(&self) -> bool {
        !matches!(self, StartError::Listen(_))
    }
}

/// A running router.
#[derive(Debug)]
pub struct Running {
    /// Where the API listens, unless the router runs as a picker alone.
    pub api_addr: Option<SocketAddr>,
    /// Where the endpoint picker (`ext_proc`) listens, when configured.
    pub ext_proc_addr: Option<SocketAddr>,
    /// Where `/metrics` and the debug endpoints listen.
    pub admin_addr: SocketAddr,
    /// The pool, for tests and the demo.
    pub pool: Arc<Pool>,
    stop: watch::Sender<bool>,
    tasks: Tasks,
}

impl Running {
    /// Where the API listens.
    ///
    /// # Panics
    /// When the router runs without an API listener (`extProc` set and
    /// `listen` unset); see [`api_addr`](Self::api_addr).
    pub fn addr(&self) -> SocketAddr {
        self.api_addr
            .expect("the router runs without an API listener (picker alone)")
    }

    /// Resolves when a background task (discovery, the health checks, a
    /// listener) ended before shutdown, naming it; never while all run.
    /// The router is then degraded for good: stop it (the binary exits
    /// with status 1). See [`crate::tasks`].
    pub async fn died(&mut self) -> TaskDied {
        self.tasks.died().await
    }

    /// Kills the background task `name` (`discovery`, `health-checks`,
    /// `api`, `picker`, `admin`), as a bug would: for tests of
    /// [`died`](Self::died). False when there is no such task.
    #[doc(hidden)]
    pub fn kill_task_for_tests(&self, name: &str) -> bool {
        self.tasks.abort(name)
    }

    /// Stops accepting requests and waits for in-flight ones (streams
    /// included) to finish.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        // The listeners drain; discovery (with the cache watchers it owns)
        // and the health checks are aborted.
        self.tasks.shutdown().await;
    }
}

/// The file at `path`, which the configuration's `field` names.
fn read(field: &'static str, path: &std::path::Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|source| ConfigError::file(field, path, source))
}

/// Starts the router.
pub async fn start(config: Config) -> Result<Running, StartError> {
    config.validate()?;
    let r = &config.routing;
    let tokenizer = match &r.tokenizer {
        Some(path) => Tokenizer::from_tokenizer_json(&read("routing.tokenizer", path)?)
            .map_err(|e| StartError::Tokenize("routing.tokenizer", e))?,
        None => Tokenizer::builtin(),
    };
    let template = match &r.tokenizer_config {
        Some(path) => ChatTemplate::from_tokenizer_config(&read("routing.tokenizerConfig", path)?)
            .map_err(|e| StartError::Tokenize("routing.tokenizerConfig", e))?,
        None => ChatTemplate::builtin(),
    };
    let settings = Settings::new(
        &config.routing_spec(),
        tokenizer,
        template,
        r.conversation_header.0.clone(),
        r.lora_adapters
            .iter()
            .map(|(name, path)| (name.clone(), Lora::new(name, path)))
            .collect(),
    )?;
    let tenancy = Tenancy::load(&config.tenancy)?;
    let cache_metrics = Arc::new(CacheMetrics::default());
    let response_cache = (config.response_cache.as_ref())
        .map(|c| {
            let cache = ResponseCache::new(c, &tenancy, &config.limits, cache_metrics.clone());
            cache.map(|c| c.keyed_on_credentials(config.proxy.forward_authorization))
        })
        .transpose()?;
    let tls = config
        .tls
        .as_ref()
        .map(|t| {
            kvroute_proto::tls::https_server(&t.cert_file, &t.key_file, t.client_ca_file.as_deref())
        })
        .transpose()
        .map_err(StartError::Tls)?;
    let grpc_tls = config
        .grpc_tls
        .as_ref()
        .map(|t| {
            let identity = t.cert_file.as_deref().zip(t.key_file.as_deref());
            kvroute_proto::tls::client(&t.ca_file, identity, t.server_name.as_deref())
        })
        .transpose()?;
    let picker_tls = config
        .ext_proc
        .as_ref()
        .and_then(|e| e.tls.as_ref())
        .map(crate::ext_proc::tls)
        .transpose()
        .map_err(StartError::ExtProcTls)?;
    let admin_token = match &config.admin_token_file {
        Some(path) => {
            let token = String::from_utf8_lossy(&read("adminTokenFile", path)?)
                .trim()
                .to_owned();
            if token.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "adminTokenFile",
                    value: path.display().to_string(),
                    reason: "the token must not be empty",
                }
                .into());
            }
            Some(Arc::new(token))
        }
        None => None,
    };
    // Bind first: a taken port must fail before any task starts.
    let api = match config.api_listen() {
        Some(addr) => Some(kvroute_telemetry::listen(addr).await?),
        None => None,
    };
    let ext_proc = match &config.ext_proc {
        Some(e) => Some(kvroute_telemetry::listen(e.listen).await?),
        None => None,
    };
    let (admin, admin_addr) = kvroute_telemetry::listen(config.admin_listen).await?;
    let metrics = Arc::new(Metrics::new(cache_metrics));
    if let Some(p) = &config.telemetry.pricing {
        let currency = crate::metrics::Currency {
            currency: p.currency.clone(),
        };
        (metrics.engine_hour_cost.get_or_create(&currency)).set(p.engine_hour_cost());
    }
    let pool = Pool::new(
        settings,
        &config.resilience,
        config.limits.endpoint_concurrency,
    );
    pool.set_index_bounds(config.limits.index_bounds());
    pool.set_evicted_capacity(config.limits.max_evicted_blocks);
    pool.warmup.set_own(config.routing.warmup.clone());
    let mut tasks = Tasks::default();
    // Discovery owns the WatchCache watchers; aborting it stops them.
    let mut watchers = Watchers::new(grpc_tls.clone());
    match &config.discovery {
        Discovery::Static(s) => {
            let streams = pool.set_endpoints(discovery::static_file::load(&s.file)?);
            watchers.apply(&pool, streams);
            tasks.spawn(
                "discovery",
                Stop::Aborted,
                discovery::static_file::run(
                    pool.clone(),
                    s.file.clone(),
                    Duration::from_millis(s.reload_ms),
                    watchers,
                ),
            );
        }
        Discovery::Operator(o) => tasks.spawn(
            "discovery",
            Stop::Aborted,
            discovery::operator::run(
                pool.clone(),
                o.all_urls().into_iter().map(str::to_owned).collect(),
                grpc_tls,
                o.namespace.clone(),
                o.pool.clone(),
                watchers,
            ),
        ),
    }
    tasks.spawn(
        "health-checks",
        Stop::Aborted,
        crate::pool::health_checks::run(pool.clone(), config.resilience.health_check.clone(), {
            let metrics = metrics.clone();
            move |events| metrics.health(events)
        }),
    );
    let mut service = Service::new(pool.clone(), metrics.clone(), tenancy, &config);
    if let Some(cache) = response_cache {
        cache.start();
        service = service.with_response_cache(cache);
    }
    let service = Arc::new(service);
    let (stop, stopped) = watch::channel(false);
    tasks.spawn(
        "flow",
        Stop::Aborted,
        service.flow.clone().run(pool.clone(), stopped.clone()),
    );
    let warmups = crate::warmup::Warmups::new(service.clone(), &config);
    tasks.spawn("warmup", Stop::Aborted, warmups.run());
    if let Some(semantic) = (service.response_cache.as_ref()).and_then(|c| c.semantic.clone()) {
        tasks.spawn("semantic-check", Stop::Aborted, semantic.run_checks());
    }

    let caps = listener::fit_to_open_files(
        api.as_ref().map_or(0, |_| config.limits.max_connections),
        config.ext_proc.as_ref().map_or(0, |e| e.max_connections),
    );
    let api_addr = api.as_ref().map(|(_, addr)| *addr);
    if let Some((api, _)) = api {
        tasks.spawn(
            "api",
            Stop::Drains,
            listener::serve_on_threads(
                api,
                crate::http::routes(Arc::new(Forwarder::new(service.clone(), &config))),
                ConnLimits {
                    tls,
                    ..ConnLimits::api(&config.limits, caps.api)
                },
                stopped.clone(),
                metrics.clone(),
                "api",
                crate::http::on_api_thread,
            ),
        );
    }
    let ext_proc_addr = ext_proc.as_ref().map(|(_, addr)| *addr);
    if let (Some((ext_proc, _)), Some(picker)) = (ext_proc, config.ext_proc.clone()) {
        let conn = ConnLimits {
            tls: picker_tls,
            ..ConnLimits::picker(&config.limits, &picker, caps.picker)
        };
        let (service, limits, stopped) = (service.clone(), config.limits.clone(), stopped.clone());
        let metrics = metrics.clone();
        tasks.spawn("picker", Stop::Drains, async move {
            crate::ext_proc::serve(ext_proc, conn, &picker, service, &limits, stopped, metrics)
                .await;
        });
    }
    tasks.spawn(
        "admin",
        Stop::Drains,
        listener::serve(
            admin,
            crate::admin::routes(service, &config, admin_token),
            ConnLimits::admin(&config.limits),
            stopped,
            metrics,
            "admin",
        ),
    );
    tracing::info!(api = ?api_addr, ext_proc = ?ext_proc_addr, %admin_addr, "kvroute-router listening");
    Ok(Running {
        api_addr,
        ext_proc_addr,
        admin_addr,
        pool,
        stop,
        tasks,
    })
}
