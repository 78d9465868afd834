//! `kvroute-agent`: runs beside a vLLM container and serves its KV cache
//! events as kvroute's WatchCache stream. `--help` explains every flag.

use clap::Parser;

/// Bridges an unmodified vLLM's KV cache events (ZMQ) to kvroute routers
/// (WatchCache gRPC). Every flag can also be set from the environment
/// variable shown.
#[derive(Debug, Parser)]
#[command(name = "kvroute-agent", version, about)]
struct Cli {
    #[command(flatten)]
    config: kvroute_agent::Config,

    /// Log line format.
    #[arg(
        long,
        env = "KVROUTE_AGENT_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    log_format: kvroute_telemetry::LogFormat,
}

/// How often free heap memory goes back to the system.
const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvroute_telemetry::memory::trim_arenas_periodically(TRIM_INTERVAL, "kvroute-agent");
    let cli = Cli::parse();
    if let Err(e) = cli.config.validate() {
        // One line naming the flag, as clap's own errors; before anything
        // is bound or logged.
        eprintln!("error: {}", kvroute_agent::StartError::Config(e));
        std::process::exit(2);
    }
    let _telemetry = kvroute_telemetry::init("kvroute-agent", cli.log_format, None)?;
    let agent = kvroute_agent::start(cli.config).await?;
    let stop = kvroute_telemetry::shutdown_signal();
    for (rank, addr) in agent.cache_addrs.iter().enumerate() {
        tracing::info!(rank, %addr, "serving WatchCache");
    }
    tracing::info!(addr = %agent.admin_addr, "serving /healthz, /readyz, /metrics");
    stop.await;
    agent.shutdown().await;
    Ok(())
}
