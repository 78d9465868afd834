//! `kvroute-telemetry`: logs and traces for kvroute's binaries. [`init`]
//! installs the process-wide log subscriber (stderr, text or JSON lines,
//! filtered by `RUST_LOG`, `info` by default) and, given an OTLP endpoint, a
//! span exporter over OTLP/gRPC with the W3C trace-context propagator.
//!
//! [`shutdown_signal`] is every binary's signal to stop: Ctrl-C, or SIGTERM
//! as Kubernetes sends a pod it stops.
//!
//! [`metrics`] is what every binary's `/metrics` shares: the OpenMetrics
//! encoding of `prometheus-client` registries. [`listen`] binds every
//! binary's listeners, with one error that names the address.
//! [`memory::trim_arenas_periodically`] gives freed heap memory back;
//! [`throttle`] keeps repeated log lines to one per key and interval.
//!
//! Not here: reading or writing trace context on requests (each server owns
//! its header adapters), each binary's metrics, and configuration files;
//! callers pass the three settings they parsed.

pub mod memory;
pub mod metrics;
pub mod throttle;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde::{Deserialize, Serialize};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Why [`init`] failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The OTLP exporter could not be built, e.g. the endpoint is not a URI.
    #[error("OTLP trace exporter: {0}")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// A global log subscriber is already installed.
    #[error("installing the log subscriber: {0}")]
    Subscriber(#[source] tracing_subscriber::util::TryInitError),
}

/// Keeps the trace exporter alive; dropping it flushes pending spans. Hold it
/// until the process is about to exit.
#[derive(Debug)]
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard(Option<SdkTracerProvider>);

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take()
            && let Err(e) = provider.shutdown()
        {
            // The subscriber may already be gone at exit; stderr is not.
            eprintln!("flushing traces: {e}");
        }
    }
}

/// Checks that `url` is an `http://` or `https://` URL with a host, as
/// every URL setting of kvroute's binaries must be (the operator's, a trace
/// collector's); the error says what is wrong, without the value.
pub fn check_http_url(url: &str) -> Result<(), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(host)) if !host.is_empty() => Ok(()),
        (Some("http" | "https"), _) => Err("it has no host".to_owned()),
        (Some(scheme), _) => Err(format!("the scheme is {scheme}, not http or https")),
        (None, _) => Err("it has no scheme (http:// or https://)".to_owned()),
    }
}

/// Installs the global log subscriber and, with `otlp_endpoint` (e.g.
/// `http://otel-collector:4317`), exports spans there as `service_name`.
/// Call once per process, from a binary; with an endpoint, call it inside a
/// tokio runtime, which the gRPC channel runs on.
pub fn init(
    service_name: &'static str,
    log_format: LogFormat,
    otlp_endpoint: Option<&str>,
) -> Result<TelemetryGuard, Error> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match log_format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    let provider = otlp_endpoint
        .map(|endpoint| tracer_provider(service_name, endpoint))
        .transpose()?;
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer(service_name)));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()
        .map_err(Error::Subscriber)?;
    // Only once the subscriber is ours: a failed init leaves globals alone.
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    if let Some(provider) = &provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
        EXPORTING.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(TelemetryGuard(provider))
}

static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`init`] installed a span exporter in this process. A server
/// makes a span per request only then: without an exporter, a request
/// span would only prefix log lines, at a cost a proxy feels (about a
/// tenth of kvroute-router's CPU per small request, formatting and
/// entering it).
pub fn exporting() -> bool {
    EXPORTING.load(std::sync::atomic::Ordering::Relaxed)
}

fn tracer_provider(service_name: &'static str, endpoint: &str) -> Result<SdkTracerProvider, Error> {
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(Error::Exporter)?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service_name)
                .build(),
        )
        .build())
}

/// A listener that could not be bound, or whose address cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct ListenError {
    /// The address asked for.
    pub addr: std::net::SocketAddr,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// Binds `addr` (port 0 picks a free port) and returns the listener with
/// the address it got.
pub async fn listen(
    addr: std::net::SocketAddr,
) -> Result<(tokio::net::TcpListener, std::net::SocketAddr), ListenError> {
    let error = |source| ListenError { addr, source };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(error)?;
    let local = listener.local_addr().map_err(error)?;
    Ok((listener, local))
}

/// Waits for each of a server's `tasks` to end, up to `grace` each, and
/// aborts one that does not (a peer that stopped reading cannot hold a
/// shutdown).
pub async fn join_or_abort(tasks: Vec<tokio::task::JoinHandle<()>>, grace: std::time::Duration) {
    for mut task in tasks {
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            task.abort();
        }
    }
}

/// Completes on Ctrl-C or, on Unix, SIGTERM (what Kubernetes sends a pod it
/// stops). The handlers are installed when this is called, not when the
/// future is first polled, so a signal that arrives in between is not
/// missed: call it before announcing readiness. A handler that cannot be
/// installed is logged and its signal ignored, so the process still stops
/// on the other. Needs a Tokio runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    let (interrupt, term) = {
        use tokio::signal::unix::{SignalKind, signal};
        let install = |kind: SignalKind, name: &str| {
            signal(kind)
                .inspect_err(|error| tracing::error!(%error, "cannot wait for {name}"))
                .ok()
        };
        (
            install(SignalKind::interrupt(), "Ctrl-C"),
            install(SignalKind::terminate(), "SIGTERM"),
        )
    };
    async move {
        #[cfg(unix)]
        {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => drop(s.recv().await),
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(interrupt) => {}
                () = wait(term) => {}
            }
        }
        #[cfg(not(unix))]
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot wait for Ctrl-C");
            std::future::pending::<()>().await;
        }
        tracing::info!("shutting down");
    }
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    #[test]
    fn log_format_reads_lowercase_names_from_config_and_flags() {
        let json: LogFormat = serde_json::from_str("\"json\"").unwrap();
        assert_eq!(json, LogFormat::Json);
        assert!(serde_json::from_str::<LogFormat>("\"Json\"").is_err());
        assert_eq!(LogFormat::from_str("text", false), Ok(LogFormat::Text));
        assert_eq!(LogFormat::default(), LogFormat::Text);
    }

    #[test]
    fn only_http_urls_with_a_host_pass() {
        for good in [
            "http://kvroute-operator.kvroute:9443",
            "https://10.0.0.1:4317",
            "http://[::1]:9443/",
        ] {
            assert_eq!(check_http_url(good), Ok(()), "{good}");
        }
        for bad in [
            "not a url",
            "",
            "kvroute-operator:9443",
            "/path",
            "ftp://host:21",
            "http://",
            "tcp://host:5557",
        ] {
            assert!(check_http_url(bad).is_err(), "{bad}");
        }
    }
}
