//! `discovery`: where the endpoint set comes from, a static file or the
//! kvroute operator.
//!
//! Not here: watching either source ([`crate::discovery`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where the endpoint set comes from: one source, written as a map of one
/// key, `static` or `operator`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DiscoveryMap", into = "DiscoveryMap")]
pub enum Discovery {
    /// A YAML file listing endpoints, re-read when it changes.
    Static(StaticDiscovery),
    /// The kvroute operator's `EndpointDiscovery.WatchPool` stream.
    Operator(OperatorDiscovery),
}

/// [`Discovery`] as written.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DiscoveryMap {
    #[serde(rename = "static", skip_serializing_if = "Option::is_none")]
    static_file: Option<StaticDiscovery>,
    #[serde(skip_serializing_if = "Option::is_none")]
    operator: Option<OperatorDiscovery>,
}

impl TryFrom<DiscoveryMap> for Discovery {
    type Error = &'static str;

    fn try_from(map: DiscoveryMap) -> Result<Self, Self::Error> {
        match (map.static_file, map.operator) {
            (Some(s), None) => Ok(Discovery::Static(s)),
            (None, Some(o)) => Ok(Discovery::Operator(o)),
            _ => Err("discovery: set exactly one of static and operator"),
        }
    }
}

impl From<Discovery> for DiscoveryMap {
    fn from(d: Discovery) -> Self {
        match d {
            Discovery::Static(s) => DiscoveryMap {
                static_file: Some(s),
                operator: None,
            },
            Discovery::Operator(o) => DiscoveryMap {
                static_file: None,
                operator: Some(o),
            },
        }
    }
}

impl Default for Discovery {
    fn default() -> Self {
        Discovery::Static(StaticDiscovery::file("endpoints.yaml".into()))
    }
}

impl StaticDiscovery {
    /// Endpoints from `file`, checked at the default interval.
    pub fn file(file: PathBuf) -> Self {
        StaticDiscovery {
            file,
            reload_ms: default_reload_ms(),
        }
    }
}

/// Endpoints from a file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticDiscovery {
    /// The file (see [`crate::discovery::StaticFile`] for its format).
    pub file: PathBuf,
    /// How often the file is checked for changes, milliseconds, 1 to
    /// 86400000 (one day). Default: 2000.
    #[serde(default = "default_reload_ms")]
    pub reload_ms: u64,
}

/// Endpoints and policy from the operator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperatorDiscovery {
    /// The operator's gRPC URL, e.g. `http://kvroute-operator.kvroute:9443`
    /// (a Service over its replicas): `http://` or, with `grpcTls`,
    /// `https://`, and a host. Set this, `urls`, or both.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub url: String,
    /// Operator replicas to fail over between, in order after `url`: when
    /// the stream from one breaks, the router subscribes to the next.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// The InferencePool's namespace.
    pub namespace: String,
    /// The InferencePool's name.
    pub pool: String,
}

impl OperatorDiscovery {
    /// `url`, then `urls`: the replicas to try, in order.
    pub fn all_urls(&self) -> Vec<&str> {
        std::iter::once(self.url.as_str())
            .filter(|u| !u.is_empty())
            .chain(self.urls.iter().map(String::as_str))
            .collect()
    }
}

fn default_reload_ms() -> u64 {
    2000
}
