//! `kvroute-engine-sim`: a vLLM-style engine for kvroute's tests, demo and
//! benchmarks. `--help` explains every flag.

use clap::Parser;

/// A simulated vLLM engine with a real prefix block cache and a WatchCache
/// occupancy stream. Every flag can also be set from the environment
/// variable shown.
#[derive(Debug, Parser)]
#[command(name = "kvroute-engine-sim", version, about)]
struct Cli {
    #[command(flatten)]
    config: kvroute_engine_sim::Config,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let sim = kvroute_engine_sim::start(cli.config).await?;
    let stop = kvroute_telemetry::shutdown_signal();
    println!(
        "kvroute-engine-sim: HTTP on http://{}, WatchCache on {}",
        sim.http_addr, sim.cache_addr
    );
    stop.await;
    sim.shutdown().await;
    Ok(())
}
