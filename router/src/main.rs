//! `kvroute-router`: the data-plane proxy. `--help` lists the flags; the
//! configuration file is documented in `docs/configuration.md`.
//!
//! How it ends: a configuration mistake (a value, or a file it names)
//! prints one line naming the field and exits with status 2, as clap's flag
//! errors do; any other failure to start (a port taken) prints one line and
//! exits with status 1; a background task that
//! dies ([`kvroute_router::tasks`]) logs one line naming it and exits with
//! status 1; SIGTERM or Ctrl-C drains and exits with status 0.

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

/// Prints `error` in one line and exits with `status`.
fn fail(status: i32, error: &dyn std::fmt::Display) -> ! {
    eprintln!("error: {error}");
    std::process::exit(status)
}

/// The exit status of a configuration mistake, as clap's.
const BAD_CONFIG: i32 = 2;

#[tokio::main]
async fn main() {
    kvroute_telemetry::memory::trim_arenas_periodically(
        std::time::Duration::from_secs(10),
        "kvroute-router",
    );
    kvroute_router::listener::raise_open_file_limit();
    let cli = Cli::parse();
    let mut config = match &cli.config {
        Some(path) => Config::load(path).unwrap_or_else(|e| fail(BAD_CONFIG, &e)),
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
    // Overrides included, before logging starts.
    if let Err(e) = config.validate() {
        fail(BAD_CONFIG, &e);
    }
    // Held to the end of main: dropping it flushes the last spans.
    let telemetry =
        kvroute_router::telemetry::init(&config.telemetry).unwrap_or_else(|e| fail(1, &e));
    let mut running = match kvroute_router::start(config).await {
        Ok(running) => running,
        Err(e) if e.is_config() => fail(BAD_CONFIG, &e),
        Err(e) => fail(1, &e),
    };
    let stop = kvroute_telemetry::shutdown_signal();
    if let Some(api) = running.api_addr {
        println!("kvroute-router: API on http://{api}");
    }
    if let Some(picker) = running.ext_proc_addr {
        println!("kvroute-router: endpoint picker (ext_proc gRPC) on {picker}");
    }
    println!("kvroute-router: admin on http://{}", running.admin_addr);
    #[cfg(debug_assertions)]
    kill_task_for_tests(&running);
    tokio::select! {
        () = stop => {}
        died = running.died() => {
            tracing::error!(task = died.task, why = %died.why,
                "a background task died; exiting so that the router is restarted whole");
            drop(telemetry);
            std::process::exit(1);
        }
    }
    tracing::info!("shutting down; in-flight requests finish first");
    running.shutdown().await;
    drop(telemetry);
}

/// Test hook, in debug builds only: `KVROUTE_TEST_KILL_TASK=<task>` kills
/// that background task once the router runs, as a bug would, so that a
/// test can see the process exit (`router/tests/it/cli.rs`).
#[cfg(debug_assertions)]
fn kill_task_for_tests(running: &kvroute_router::Running) {
    if let Ok(task) = std::env::var("KVROUTE_TEST_KILL_TASK") {
        assert!(running.kill_task_for_tests(&task), "no task {task:?}");
    }
}
