//! `kvroute-router`: the data-plane proxy. `--help` lists the flags; the
//! configuration file is documented in the README.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use kvroute_router::config::{Config, LogFormat};

/// kvroute's cache-aware router for vLLM-style engines.
#[derive(Debug, Parser)]
#[command(name = "kvroute-router", version, about)]
struct Cli {
    /// The YAML configuration file; without one, the defaults.
    #[arg(long, short, env = "KVROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `listen`.
    #[arg(long, env = "KVROUTE_LISTEN")]
    listen: Option<SocketAddr>,
    /// Serves the endpoint picker (Envoy ext_proc) here: overrides
    /// `extProc.listen`. Without `--listen` or `listen`, the router then
    /// runs as a picker alone.
    #[arg(long, env = "KVROUTE_EXT_PROC_LISTEN")]
    ext_proc_listen: Option<SocketAddr>,
    /// Overrides `adminListen`.
    #[arg(long, env = "KVROUTE_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Overrides the static discovery file (`discovery.static.file`).
    #[arg(long, env = "KVROUTE_ENDPOINTS")]
    endpoints: Option<PathBuf>,
    /// Overrides `telemetry.logFormat` (text or json).
    #[arg(long, env = "KVROUTE_LOG_FORMAT")]
    log_format: Option<LogFormat>,
}

/// Every 10 s, hands the free memory inside glibc's heap arenas back to
/// the system. Requests on the API threads and prompts on the tokenizer
/// pool allocate from different arenas, and long-lived conversation
/// snapshots sit between short-lived prompt buffers: the freed pages
/// around them stay resident otherwise (bench-soak, approximate mode:
/// +13.5 % without, +7.0 % with). A trim takes a few milliseconds on a
/// thread of its own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim_arenas_periodically() {
    let trim = || {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(10));
            // SAFETY: malloc_trim only releases the allocator's own free
            // memory (under its locks); it reads and writes none of ours.
            let _ = unsafe { libc::malloc_trim(0) };
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kvroute-trim".into())
        .spawn(trim)
    {
        eprintln!("kvroute-router: could not start the arena trimmer: {e}");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_arenas_periodically() {}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    trim_arenas_periodically();
    kvroute_router::listener::raise_open_file_limit();
    let cli = Cli::parse();
    let mut config = match &cli.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(listen) = cli.listen {
        config.listen = Some(listen);
    }
    if let Some(listen) = cli.ext_proc_listen {
        let picker = config.ext_proc.get_or_insert_with(Default::default);
        picker.listen = listen;
    }
    if let Some(admin) = cli.admin_listen {
        config.admin_listen = admin;
    }
    if let Some(file) = cli.endpoints {
        config.discovery = kvroute_router::config::Discovery::Static(
            kvroute_router::config::StaticDiscovery::file(file),
        );
    }
    if let Some(format) = cli.log_format {
        config.telemetry.log_format = format;
    }
    // Held to the end of main: dropping it flushes the last spans.
    let _telemetry = kvroute_router::telemetry::init(&config.telemetry)?;
    let running = kvroute_router::start(config).await?;
    let stop = kvroute_telemetry::shutdown_signal();
    if let Some(api) = running.api_addr {
        println!("kvroute-router: API on http://{api}");
    }
    if let Some(picker) = running.ext_proc_addr {
        println!("kvroute-router: endpoint picker (ext_proc gRPC) on {picker}");
    }
    println!("kvroute-router: admin on http://{}", running.admin_addr);
    stop.await;
    tracing::info!("shutting down; in-flight requests finish first");
    running.shutdown().await;
    Ok(())
}
