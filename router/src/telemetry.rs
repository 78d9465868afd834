//! Logs and traces. Logs go to stderr as text or JSON lines (`RUST_LOG`
//! filters them). With `telemetry.otlpEndpoint` set, each request is a span
//! exported over OTLP/gRPC, joined to the client's W3C `traceparent`, and the
//! engine receives the router's span as its parent; without it, a client's
//! `traceparent` is forwarded unchanged.
//!
//! Installing the subscriber and exporter is `kvroute-telemetry`'s job; this
//! module maps the router's config onto it and owns the header adapters the
//! proxy uses to read and write trace context.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
pub use kvroute_telemetry::{Error, TelemetryGuard};
use opentelemetry::propagation::{Extractor, Injector};

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

/// Reads W3C trace context from request headers.
#[derive(Debug)]
pub struct HeaderExtractor<'a>(pub &'a HeaderMap);

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
pub struct HeaderInjector<'a>(pub &'a mut HeaderMap);

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
