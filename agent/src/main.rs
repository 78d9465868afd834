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

/// Every [`TRIM_INTERVAL`], hands the free memory inside glibc's heap
/// arenas back to the system, as the router does (router/src/main.rs).
/// A burst of large messages or a long replay is freed when handled, but
/// glibc keeps what the tokio worker threads' arenas freed: a replay flood
/// left 692 MB resident for good without it. With it, resident memory is
/// back near its level before a burst within seconds. A trim takes a few
/// milliseconds on a thread of its own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim_arenas_periodically() {
    let trim = || {
        loop {
            std::thread::sleep(TRIM_INTERVAL);
            // SAFETY: malloc_trim only releases the allocator's own free
            // memory (under its locks); it reads and writes none of ours.
            let _ = unsafe { libc::malloc_trim(0) };
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kvroute-trim".into())
        .spawn(trim)
    {
        eprintln!("kvroute-agent: could not start the arena trimmer: {e}");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_arenas_periodically() {}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    trim_arenas_periodically();
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
