//! `kvroute-operator`: `crdgen` writes the CRDs; `run` watches the cluster
//! and serves `EndpointDiscovery.WatchPool` to routers.
//!
//! Not yet in `run`: the status writer and leader election.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use kvroute_operator::grpc::Discovery;
use kvroute_operator::index::Index;
use kvroute_operator::watch::{Scope, run_watchers};

/// kvroute's control plane.
#[derive(Debug, Parser)]
#[command(name = "kvroute-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the CustomResourceDefinitions as YAML to a directory.
    Crdgen {
        /// Output directory.
        #[arg(long, default_value = "crds")]
        out: std::path::PathBuf,
    },
    /// Watch the cluster (from `KUBECONFIG` or the in-cluster config) and
    /// serve WatchPool to routers until Ctrl-C or SIGTERM.
    Run(RunConfig),
}

/// Configuration of `run`.
#[derive(Debug, Args)]
struct RunConfig {
    /// Address the WatchPool gRPC server listens on; port 0 picks a free
    /// port (printed on stdout).
    #[arg(long, env = "KVROUTE_GRPC_LISTEN", default_value = "0.0.0.0:9443")]
    grpc_listen: SocketAddr,

    /// A namespace to watch; repeat for several. None watches every
    /// namespace. From the environment: comma-separated.
    #[arg(long = "namespace", env = "KVROUTE_NAMESPACES", value_delimiter = ',')]
    namespaces: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crdgen { out } => kvroute_operator::api::write_crds(&out),
        Command::Run(config) => tokio::runtime::Runtime::new()
            .context("start the tokio runtime")?
            .block_on(run(config)),
    }
}

async fn run(config: RunConfig) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let client = kube::Client::try_default()
        .await
        .context("build a Kubernetes client (KUBECONFIG or in-cluster config)")?;
    let index = Arc::new(Mutex::new(Index::new()));
    let scope = Scope::from_namespaces(config.namespaces);
    let watchers = tokio::spawn(run_watchers(client, scope, index.clone()));

    let listener = tokio::net::TcpListener::bind(config.grpc_listen)
        .await
        .with_context(|| format!("listen on --grpc-listen {}", config.grpc_listen))?;
    let addr = listener.local_addr().context("the WatchPool address")?;
    // Tests read the port from this line, so it goes to stdout, whole.
    println!("kvroute-operator: WatchPool on {addr}");
    let served = Discovery::new(index).serve(listener, shutdown()).await;
    watchers.abort();
    served.context("serve WatchPool")
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot wait for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot wait for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down");
}
