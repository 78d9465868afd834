//! `kvroute-operator`: `crdgen` writes the CRDs; `run` watches the cluster,
//! serves `EndpointDiscovery.WatchPool` to routers, writes status and Events
//! while it holds the leader Lease, and serves `/metrics`, `/healthz` and
//! `/readyz`.
//!
//! Errors are one line on stderr: a flag's bad value names the flag and
//! exits with status 2 before anything starts (as clap's own errors do);
//! any other failure exits with status 1.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use kvroute_operator::admin::Admin;
use kvroute_operator::grpc::Discovery;
use kvroute_operator::index::Index;
use kvroute_operator::lease::{self, LeaseConfig};
use kvroute_operator::metrics::{Gauges, Metrics, PoolGauge};
use kvroute_operator::status::StatusWriter;
use kvroute_operator::watch::{Scope, run_watchers};
use kvroute_proto::tls::{TlsArgs, TlsEnv};
use kvroute_telemetry::LogFormat;
use tokio::sync::watch;

/// kvroute's control plane.
#[derive(Debug, Parser)]
#[command(name = "kvroute-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the CustomResourceDefinitions as YAML to directories.
    Crdgen {
        /// Output directory; repeat for several. Default: `crds` and the
        /// Helm chart's `charts/kvroute/crds`.
        #[arg(long, default_values = ["crds", "charts/kvroute/crds"])]
        out: Vec<std::path::PathBuf>,
    },
    /// Watch the cluster (from `KUBECONFIG` or the in-cluster config), serve
    /// WatchPool to routers and write status until Ctrl-C or SIGTERM.
    Run(Box<RunConfig>),
}

/// Configuration of `run`.
#[derive(Debug, Args)]
struct RunConfig {
    /// Address the WatchPool gRPC server listens on; port 0 picks a free
    /// port (printed on stdout).
    #[arg(long, env = "KVROUTE_GRPC_LISTEN", default_value = "0.0.0.0:9443")]
    grpc_listen: SocketAddr,

    /// Address of the admin HTTP server (`/metrics`, `/healthz`, `/readyz`);
    /// port 0 picks a free port (printed on stdout).
    #[arg(long, env = "KVROUTE_ADMIN_LISTEN", default_value = "0.0.0.0:9090")]
    admin_listen: SocketAddr,

    /// A namespace to watch; repeat for several. None watches every
    /// namespace. From the environment: comma-separated.
    #[arg(long = "namespace", env = "KVROUTE_NAMESPACES", value_delimiter = ',')]
    namespaces: Vec<String>,

    /// Namespace of the leader-election Lease: the operator's own (set
    /// `POD_NAMESPACE` from the downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,

    /// Name of the leader-election Lease; replicas sharing it elect one
    /// status writer.
    #[arg(long, env = "KVROUTE_LEASE_NAME", default_value = "kvroute-operator")]
    lease_name: String,

    /// Seconds a Lease record must stay unrenewed before another replica
    /// takes it over (default 15, client-go's). Shorter fails over faster
    /// and writes the Lease more often.
    #[arg(long, env = "KVROUTE_LEASE_DURATION", value_name = "SECONDS")]
    lease_duration: Option<f64>,

    /// Seconds between the leader's renewals (default 5); under two thirds
    /// of `--lease-duration`.
    #[arg(long, env = "KVROUTE_LEASE_RENEW_PERIOD", value_name = "SECONDS")]
    lease_renew_period: Option<f64>,

    /// Seconds between a follower's reads of the Lease (default 2).
    #[arg(long, env = "KVROUTE_LEASE_RETRY_PERIOD", value_name = "SECONDS")]
    lease_retry_period: Option<f64>,

    /// This replica's identity in the Lease and in Events; default
    /// `POD_NAME`, else `<hostname>-<pid>`.
    #[arg(long, env = "KVROUTE_IDENTITY")]
    identity: Option<String>,

    /// `host:port` at which routers reach this replica's WatchPool server
    /// directly, to report warm-ups to the status writer. Default
    /// `POD_IP` (from the downward API) and the `--grpc-listen` port, else
    /// the listen address when it names one host.
    #[arg(long, env = "KVROUTE_ADVERTISE_ADDRESS")]
    advertise_address: Option<String>,

    /// Log lines as `text` or `json`.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,

    /// OTLP/gRPC endpoint to export traces to (e.g. `http://otel:4317`);
    /// none exports nothing.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,

    /// TLS of the WatchPool server (`--tls-cert-file`, `--tls-key-file`,
    /// `--tls-client-ca-file`).
    #[command(flatten)]
    tls: TlsArgs<OperatorTlsEnv>,

    /// PEM CA of the engines' WatchCache servers: the engine probes dial
    /// them over TLS. Unset: plaintext.
    #[arg(long, env = "KVROUTE_ENGINE_TLS_CA_FILE")]
    engine_tls_ca_file: Option<PathBuf>,

    /// PEM client certificate for engines that require one (mTLS).
    #[arg(
        long,
        env = "KVROUTE_ENGINE_TLS_CERT_FILE",
        requires_all = ["engine_tls_key_file", "engine_tls_ca_file"]
    )]
    engine_tls_cert_file: Option<PathBuf>,

    /// PEM private key of `--engine-tls-cert-file`.
    #[arg(
        long,
        env = "KVROUTE_ENGINE_TLS_KEY_FILE",
        requires = "engine_tls_cert_file"
    )]
    engine_tls_key_file: Option<PathBuf>,

    /// The name in the engines' certificates (they are dialled by pod IP).
    #[arg(
        long,
        env = "KVROUTE_ENGINE_TLS_SERVER_NAME",
        requires = "engine_tls_ca_file"
    )]
    engine_tls_server_name: Option<String>,
}

/// The operator's TLS flags read `KVROUTE_TLS_*`.
#[derive(Debug)]
struct OperatorTlsEnv;

impl TlsEnv for OperatorTlsEnv {
    const CERT_FILE: &'static str = "KVROUTE_TLS_CERT_FILE";
    const KEY_FILE: &'static str = "KVROUTE_TLS_KEY_FILE";
    const CLIENT_CA_FILE: &'static str = "KVROUTE_TLS_CLIENT_CA_FILE";
}

impl RunConfig {
    /// Checks what clap's parsers cannot; the message names the flag and
    /// the bad value.
    fn validate(&self) -> Result<(), String> {
        if let Some(url) = &self.otlp_endpoint
            && let Err(why) = kvroute_telemetry::check_http_url(url)
        {
            return Err(format!(
                "--otlp-endpoint {url:?} is not an http(s) URL with a host: {why}"
            ));
        }
        Ok(())
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Command::Run(config) = &cli.command
        && let Err(e) = config.validate()
    {
        eprintln!("error: {e}");
        return std::process::ExitCode::from(2);
    }
    let done = match cli.command {
        Command::Crdgen { out } => out
            .iter()
            .try_for_each(|dir| kvroute_operator::api::write_crds(dir)),
        Command::Run(config) => tokio::runtime::Runtime::new()
            .context("start the tokio runtime")
            .and_then(|runtime| runtime.block_on(run(*config))),
    };
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line: the contexts name the flag, then the causes.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(config: RunConfig) -> anyhow::Result<()> {
    let _telemetry = kvroute_telemetry::init(
        "kvroute-operator",
        config.log_format,
        config.otlp_endpoint.as_deref(),
    )
    .context("set up logs and traces")?;
    let client = kube::Client::try_default()
        .await
        .context("build a Kubernetes client (KUBECONFIG or in-cluster config)")?;
    let identity = config.identity.unwrap_or_else(lease::default_identity);
    let tls = config
        .tls
        .server()
        .context("--tls-cert-file / --tls-key-file / --tls-client-ca-file")?;
    let engine_tls = config
        .engine_tls_ca_file
        .as_deref()
        .map(|ca| {
            let identity = config
                .engine_tls_cert_file
                .as_deref()
                .zip(config.engine_tls_key_file.as_deref());
            kvroute_proto::tls::client(ca, identity, config.engine_tls_server_name.as_deref())
        })
        .transpose()
        .context("--engine-tls-ca-file / --engine-tls-cert-file / --engine-tls-key-file")?;
    let (grpc, grpc_addr) = kvroute_telemetry::listen(config.grpc_listen)
        .await
        .context("--grpc-listen")?;
    let (admin_listener, admin_addr) = kvroute_telemetry::listen(config.admin_listen)
        .await
        .context("--admin-listen")?;
    // Tests read the ports from these lines, so they go to stdout, whole.
    println!("kvroute-operator: WatchPool on {grpc_addr}");
    println!("kvroute-operator: admin on {admin_addr}");
    tracing::info!(%identity, "starting");

    let index = Arc::new(Mutex::new(Index::new()));
    let metrics = Arc::new(Metrics::default());
    let (ready_tx, ready) = watch::channel(false);
    let (leader_tx, leader) = watch::channel(false);
    let (stop_tx, stop) = watch::channel(false);
    let stopped = move || {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|s| *s).await;
        }
    };

    let scope = Scope::from_namespaces(config.namespaces);
    let watchers = tokio::spawn(run_watchers(
        client.clone(),
        scope,
        index.clone(),
        metrics.clone(),
        ready_tx,
    ));
    let mut lease_config =
        LeaseConfig::new(config.lease_namespace, config.lease_name, identity.clone());
    lease_config.advertise = config
        .advertise_address
        .or_else(|| advertise_default(std::env::var("POD_IP").ok(), grpc_addr));
    tracing::info!(advertise = ?lease_config.advertise, "routers report warm-ups here while this replica leads");
    for (flag, given, field) in [
        (
            "--lease-duration",
            config.lease_duration,
            &mut lease_config.lease_duration,
        ),
        (
            "--lease-renew-period",
            config.lease_renew_period,
            &mut lease_config.renew_period,
        ),
        (
            "--lease-retry-period",
            config.lease_retry_period,
            &mut lease_config.retry_period,
        ),
    ] {
        if let Some(seconds) = given {
            *field = std::time::Duration::try_from_secs_f64(seconds)
                .with_context(|| format!("{flag} {seconds}: not a number of seconds"))?;
        }
    }
    lease_config.validate().context("leader election")?;
    let (writer_tx, writer_address) = watch::channel(None);
    let lease = tokio::spawn(lease::run(
        client.clone(),
        lease_config,
        leader_tx,
        writer_tx,
        metrics.clone(),
        stopped(),
    ));
    let advertised = tokio::spawn(publish_writer(writer_address, index.clone()));
    let engines = tokio::spawn(kvroute_operator::engines::run(index.clone(), engine_tls));
    let writer = StatusWriter::new(client, index.clone(), metrics.clone(), identity);
    let writer = tokio::spawn(writer.run(leader.clone(), ready.clone()));

    let discovery = Discovery::new(index.clone())
        .with_ready(ready.clone())
        .with_metrics(metrics.clone());
    let gauges = {
        let (discovery, ready, leader) = (discovery.clone(), ready.clone(), leader.clone());
        move || Gauges {
            pools: index
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pool_statuses()
                .into_iter()
                .map(|s| PoolGauge {
                    namespace: s.namespace,
                    name: s.name,
                    ready_endpoints: s.ready_endpoints,
                })
                .collect(),
            subscribers: discovery.subscribers(),
            leader: *leader.borrow(),
            ready: *ready.borrow(),
        }
    };
    let admin = Admin {
        metrics,
        gauges: Arc::new(gauges),
        ready,
    };
    let admin = tokio::spawn(kvroute_operator::admin::serve(
        admin_listener,
        admin,
        stopped(),
    ));

    let served = discovery
        .serve(grpc, tls, kvroute_telemetry::shutdown_signal())
        .await;
    // Release the lease first, so a standby or restarted replica writes
    // status at once.
    stop_tx.send_replace(true);
    if let Err(error) = lease.await {
        tracing::error!(%error, "the lease task failed");
    }
    writer.abort();
    advertised.abort();
    watchers.abort();
    engines.abort();
    match admin.await {
        Ok(Err(error)) => tracing::error!(%error, "the admin server failed"),
        Err(error) => tracing::error!(%error, "the admin server task failed"),
        Ok(Ok(())) => {}
    }
    served.context("serve WatchPool")
}

/// The address to advertise by default: `pod_ip` with `listen`'s port, else
/// `listen` itself unless it is a wildcard (`0.0.0.0`, `::`).
fn advertise_default(pod_ip: Option<String>, listen: SocketAddr) -> Option<String> {
    let ip = match pod_ip.and_then(|ip| ip.parse().ok()) {
        Some(ip) => ip,
        None if listen.ip().is_unspecified() => return None,
        None => listen.ip(),
    };
    Some(SocketAddr::new(ip, listen.port()).to_string())
}

/// Tells the index, for the routers, where the status writer is, on every
/// change the lease task publishes.
async fn publish_writer(mut address: watch::Receiver<Option<String>>, index: Arc<Mutex<Index>>) {
    loop {
        let current = address.borrow_and_update().clone();
        index
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_status_writer(current);
        if address.changed().await.is_err() {
            return;
        }
    }
}
