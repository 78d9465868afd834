//! Logs and traces. Logs go to stderr as text or JSON lines (`RUST_LOG`
//! filters them). With `telemetry.otlpEndpoint` set, each request is a span
//! exported over OTLP/gRPC, joined to the client's W3C `traceparent`, and the
//! engine receives the router's span as its parent; without it, a client's
//! `traceparent` is forwarded unchanged.
//!
//! Installing the subscriber and exporter is `kvroute-telemetry`'s job; this
//! module maps the router's config onto it and owns the header adapters the
//! proxy reads and writes trace context with.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
pub use kvroute_telemetry::{Error, TelemetryGuard};
use opentelemetry::propagation::{Extractor, Injector};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::config::Telemetry;

/// Installs the global log subscriber and, if configured, the OTLP trace
/// exporter, as service `kvroute-router`. Call once, from a binary.
pub fn init(config: &Telemetry) -> Result<TelemetryGuard, Error> {
    kvroute_telemetry::init(
        "kvroute-router",
        config.log_format,
        config.otlp_endpoint.as_deref(),
    )
}

/// A proxied request's span, when traces are exported: joined to the
/// client's trace context in `headers`.
pub fn request_span(path: &str, headers: &HeaderMap) -> tracing::Span {
    if !kvroute_telemetry::exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("proxy", path = %path);
    let parent =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    if let Err(e) = span.set_parent(parent) {
        tracing::debug!(error = %e, "no trace parent");
    }
    span
}

/// When traces are exported, writes the current span into an upstream
/// request's `headers` as its parent.
pub fn inject(headers: &mut HeaderMap) {
    if kvroute_telemetry::exporting() {
        let context = tracing::Span::current().context();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&context, &mut HeaderInjector(headers))
        });
    }
}

/// Reads W3C trace context from request headers.
#[derive(Debug)]
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes W3C trace context into request headers.
#[derive(Debug)]
struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}
