//! The router's configuration: one YAML file, every field documented with
//! its default; flags and environment variables override the few fields
//! people change per deployment. Parsed and validated once at start.
//!
//! One file per section: [`routing`](Routing), [`tenancy`](Tenancy),
//! [`limits`](Limits), [`flowControl`](FlowControl) and `objectives`,
//! [`resilience`](Resilience), [`proxy`](Proxy),
//! [`telemetry`](Telemetry), [`discovery`](Discovery), the listeners and
//! their TLS; checking a parsed file is `validate.rs`.
//!
//! Not here: starting anything from it ([`crate::server`]).

mod discovery;
mod flow;
mod headers;
mod limits;
mod listeners;
mod proxy;
mod resilience;
mod response_cache;
mod routing;
mod telemetry;
mod tenancy;
mod validate;
mod warmup;

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use self::discovery::{Discovery, OperatorDiscovery, StaticDiscovery};
pub use self::flow::{Band, FlowControl, Objective};
pub use self::headers::{Header, OptionalHeader};
pub use self::limits::Limits;
pub use self::listeners::{DebugEndpoints, ExtProc, GrpcTls, Tls};
pub use self::proxy::{DEFAULT_ALLOWED_PATHS, Proxy};
pub use self::resilience::{HealthCheck, Resilience};
pub use self::response_cache::{Backend, DEFAULT_THRESHOLD, Embeddings, ResponseCache, Semantic};
pub use self::routing::{DEFAULT_CONVERSATION_HEADER, Routing};
pub use self::telemetry::{LogFormat, Pricing, Telemetry};
pub use self::tenancy::{ClientSalt, Tenancy, TenancyMode};
pub use self::warmup::{Prefix, Warmup};

/// The longest any duration setting may be, milliseconds: one day. Longer
/// is a unit slip, and a deadline computed from it could overflow.
pub const MAX_DURATION_MS: u64 = 86_400_000;

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Address of the OpenAI-compatible API. Default: `0.0.0.0:8080`;
    /// with `extProc` set and `listen` unset, no API listener (the router
    /// runs as an endpoint picker alone).
    pub listen: Option<SocketAddr>,
    /// Address of `/metrics`, `/healthz`, `/readyz` and the debug
    /// endpoints. Default: `0.0.0.0:9090`.
    pub admin_listen: SocketAddr,
    /// Serve Envoy's `ext_proc` as a Gateway API InferencePool's endpoint
    /// picker ([`crate::ext_proc`]); unset: not served.
    pub ext_proc: Option<ExtProc>,
    /// Where endpoints come from. Default: a static file `endpoints.yaml`.
    pub discovery: Discovery,
    /// How requests are placed.
    pub routing: Routing,
    /// Tenant isolation.
    pub tenancy: Tenancy,
    /// Requests held at the router until an endpoint can start them.
    pub flow_control: FlowControl,
    /// Priorities requests may name (`x-gateway-inference-objective`).
    pub objectives: Vec<Objective>,
    /// Limits and timeouts.
    pub limits: Limits,
    /// What is proxied and which headers pass.
    pub proxy: Proxy,
    /// Retries and outlier ejection.
    pub resilience: Resilience,
    /// Logs, traces and headers.
    pub telemetry: Telemetry,
    /// The exact response cache ([`crate::response_cache`]); unset: off.
    pub response_cache: Option<ResponseCache>,
    /// TLS on the API listener; unset: plaintext.
    pub tls: Option<Tls>,
    /// A file holding a bearer token that `/debug/*` on the admin port
    /// requires (`Authorization: Bearer <token>`); `/metrics`, `/healthz`
    /// stay open. Unset: `/debug/*` answers only on a loopback
    /// `adminListen`, or with `debug.open`. A file that cannot be read, or
    /// holds no token, stops the start.
    pub admin_token_file: Option<PathBuf>,
    /// The admin port's `/debug` endpoints.
    pub debug: DebugEndpoints,
    /// TLS for the router's gRPC streams: WatchCache to the engines and
    /// WatchPool to the operator; unset: plaintext.
    pub grpc_tls: Option<GrpcTls>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: None,
            admin_listen: "0.0.0.0:9090".parse().expect("valid"),
            discovery: Discovery::default(),
            routing: Routing::default(),
            tenancy: Tenancy::default(),
            flow_control: FlowControl::default(),
            objectives: Vec::new(),
            limits: Limits::default(),
            proxy: Proxy::default(),
            resilience: Resilience::default(),
            telemetry: Telemetry::default(),
            response_cache: None,
            tls: None,
            admin_token_file: None,
            debug: DebugEndpoints::default(),
            grpc_tls: None,
            ext_proc: None,
        }
    }
}

/// The API port when `listen` is unset and no `extProc` is configured.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";

impl Config {
    /// Where the OpenAI-compatible API listens, if anywhere: `listen`, else
    /// [`DEFAULT_LISTEN`] unless the router runs as an endpoint picker.
    pub fn api_listen(&self) -> Option<SocketAddr> {
        match (self.listen, &self.ext_proc) {
            (Some(addr), _) => Some(addr),
            (None, Some(_)) => None,
            (None, None) => Some(DEFAULT_LISTEN.parse().expect("a valid address")),
        }
    }
}

/// A configuration error, naming the field and the value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The routing policy's parameters are unusable.
    #[error("routing.policy: {0}")]
    Policy(String),
    /// A file a field names could not be read.
    #[error("{field}: cannot read {path}: {source}")]
    File {
        /// The field, as written in YAML.
        field: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The configuration file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The YAML is malformed or has an unknown field.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: serde_yaml::Error,
    },
    /// A value is out of range.
    #[error("{field}: {reason} (got {value})")]
    Invalid {
        /// The field, as written in YAML.
        field: &'static str,
        /// The value.
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A field of an earlier version, replaced.
    #[error("{field} was replaced by {instead}: see docs/configuration.md, flow control")]
    Replaced {
        /// The old field, as written in YAML.
        field: &'static str,
        /// The field that replaced it.
        instead: &'static str,
    },
    /// An entry of a list is bad.
    #[error("{field}: {reason} (got {value})")]
    InvalidEntry {
        /// The field, as written in YAML, with the entry's index.
        field: String,
        /// The value.
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
}

impl ConfigError {
    /// Reading `path`, which `field` names, failed with `source`.
    pub fn file(field: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        ConfigError::File {
            field,
            path: path.display().to_string(),
            source,
        }
    }
}

impl Config {
    /// Reads and validates a YAML file.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let config: Config = serde_yaml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
