//! `telemetry`: logs, traces and the headers and labels that describe a
//! request.

use serde::{Deserialize, Serialize};

use super::{Header, OptionalHeader};

/// Log format: `text` (the default) or `json`. Shared with the operator.
pub use kvroute_telemetry::LogFormat;

/// Observability settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Telemetry {
    /// `text` or `json`. Default: text.
    pub log_format: LogFormat,
    /// Response header naming the endpoint that served the request; empty
    /// (`""`) turns it off. Default: `x-kvroute-endpoint`.
    pub endpoint_header: OptionalHeader,
    /// OTLP/gRPC collector for traces, e.g. `http://otel-collector:4317`;
    /// unset: no traces.
    pub otlp_endpoint: Option<String>,
    /// Tenants named in the `tenant` label of metrics, besides those of
    /// `tenancy.apiKeysFile`; any other tenant is `other` (so clients
    /// cannot create series). Default: none.
    pub tenant_labels: Vec<String>,
    /// Adds `x-kvroute-cache` to responses: the endpoint, the prompt
    /// tokens expected cached there, and the expected cause of the rest
    /// (`endpoint=pod-a; expected-cached=512; expected-missed=cold:96,partial_block:7`).
    /// It tells a client whether another tenant's prompt was cached only
    /// as the engine's own `cached_tokens` does. Default: false.
    pub cache_header: bool,
    /// What GPUs cost, to show the prefill caching saved in money
    /// (`kvroute_pricing_engine_hour_cost`). Default: none.
    pub pricing: Option<Pricing>,
}

/// `telemetry.pricing`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Pricing {
    /// What one GPU costs an hour.
    pub gpu_hour_cost: f64,
    /// Its currency, as the metric's `currency` label: 1 to 16 ASCII
    /// letters or digits (`USD`, `EUR`, `credits`).
    pub currency: String,
    /// GPUs one engine replica runs on (its tensor- and pipeline-parallel
    /// size). Default: 1.
    #[serde(default = "one")]
    pub gpus_per_engine: u32,
}

fn one() -> u32 {
    1
}

impl Pricing {
    /// What one engine costs an hour.
    pub fn engine_hour_cost(&self) -> f64 {
        self.gpu_hour_cost * f64::from(self.gpus_per_engine)
    }
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            log_format: LogFormat::Text,
            endpoint_header: OptionalHeader(Some(Header::from_static("x-kvroute-endpoint"))),
            otlp_endpoint: None,
            tenant_labels: Vec::new(),
            cache_header: false,
            pricing: None,
        }
    }
}
