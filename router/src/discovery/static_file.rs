//! The static endpoints file: a YAML list of engines, for deployments
//! without the operator (local runs, demos, VMs).
//!
//! ```yaml
//! endpoints:
//!   - address: 127.0.0.1:8001   # the engine's HTTP API, host:port (required)
//!     name: sim-0               # default: the address as written
//!     cachePort: 50051          # WatchCache port on the same host; default: none
//!     ready: true               # default: true
//!     draining: false           # default: false
//!     readySince: 2026-01-02T03:04:05Z  # RFC 3339; default: none
//!     role: both                # prefill, decode or both; default: both
//! ```
//!
//! `readySince` starts the endpoint's slow-start ramp (`routing.slowStartSeconds`)
//! at one wall-clock time for every router that reads the file. Without
//! it, an endpoint listed ready when the router starts does not ramp, and
//! one added (or turned ready) later ramps from when this router read the
//! change: routers that read it at different moments ramp it apart.
//!
//! [`load`] parses and validates the file; [`run`] applies it to a pool and
//! re-applies it whenever its content changes, keeping the last good set
//! when an edit breaks it. Hostnames are resolved (IPv4 first) when the
//! file is loaded, not again until its content changes.
//!
//! Not here: watching for DNS changes, health checks.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::role::Role;
use serde::Deserialize;

use super::DiscoveryError;
use crate::pool::Watchers;
use crate::pool::{EndpointSpec, Pool};

/// The whole file.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticFile {
    /// Every endpoint. Required (an empty list is allowed), so that an
    /// empty or half-written file is an error rather than an empty pool.
    pub endpoints: Vec<StaticEndpoint>,
}

/// One entry of the file.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticEndpoint {
    /// The engine's HTTP API, `ip:port` or `host:port`. Required.
    pub address: String,
    /// Stable identity for rendezvous hashing. Default: `address` as
    /// written.
    #[serde(default)]
    pub name: Option<String>,
    /// The engine's WatchCache port on the same host. Default: none (the
    /// engine reports no cache).
    #[serde(default)]
    pub cache_port: Option<u16>,
    /// Whether it may serve. Default: true.
    #[serde(default = "yes")]
    pub ready: bool,
    /// Whether it is shutting down (no new requests). Default: false.
    #[serde(default)]
    pub draining: bool,
    /// When it became ready, RFC 3339 (`2026-01-02T03:04:05Z`): the start
    /// of its slow-start ramp. Default: none (see the module docs).
    #[serde(default)]
    pub ready_since: Option<String>,
    /// `prefill`, `decode` or `both` (the default): what it does in a
    /// disaggregated pool.
    #[serde(default)]
    pub role: Option<String>,
}

fn yes() -> bool {
    true
}

/// Reads, parses and validates the file at `path`, resolving hostnames
/// (this blocks on DNS).
pub fn load(path: &Path) -> Result<Vec<EndpointSpec>, DiscoveryError> {
    let text = std::fs::read(path).map_err(|source| DiscoveryError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse(path, &text)
}

/// Parses and validates the file's content; `path` only names it in
/// errors.
fn parse(path: &Path, text: &[u8]) -> Result<Vec<EndpointSpec>, DiscoveryError> {
    let path = path.display().to_string();
    let file: StaticFile =
        serde_yaml::from_slice(text).map_err(|source| DiscoveryError::Parse {
            path: path.clone(),
            source,
        })?;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut specs = Vec::with_capacity(file.endpoints.len());
    for (index, e) in file.endpoints.into_iter().enumerate() {
        let invalid = |field, value: &dyn ToString, reason: String| DiscoveryError::Invalid {
            path: path.clone(),
            index,
            field,
            value: value.to_string(),
            reason,
        };
        let http = resolve(&e.address).map_err(|r| invalid("address", &e.address, r))?;
        let cache = match e.cache_port {
            Some(0) => {
                return Err(invalid(
                    "cachePort",
                    &0,
                    "is not a port (1 to 65535)".into(),
                ));
            }
            Some(port) => Some(SocketAddr::new(http.ip(), port)),
            None => None,
        };
        let name = e.name.unwrap_or(e.address);
        if name.is_empty() {
            return Err(invalid("name", &name, "must not be empty".into()));
        }
        if let Some(&first) = seen.get(&name) {
            return Err(DiscoveryError::DuplicateName {
                path,
                name,
                first,
                second: index,
            });
        }
        let ready_since_ms = match &e.ready_since {
            Some(text) => Some(
                text.parse::<jiff::Timestamp>()
                    .map_err(|err| {
                        invalid(
                            "readySince",
                            text,
                            format!("is not an RFC 3339 time ({err})"),
                        )
                    })?
                    .as_millisecond(),
            ),
            None => None,
        };
        let role = match &e.role {
            Some(text) => text.parse().map_err(|()| {
                let reason = format!("(endpoint {name}) is not prefill, decode or both");
                invalid("role", text, reason)
            })?,
            None => Role::Both,
        };
        seen.insert(name.clone(), index);
        specs.push(EndpointSpec {
            name,
            http,
            cache,
            ready: e.ready,
            draining: e.draining,
            ready_since_ms,
            role,
        });
    }
    Ok(specs)
}

/// `ip:port`, or `host:port` resolved, preferring an IPv4 address.
fn resolve(address: &str) -> Result<SocketAddr, String> {
    let addr = match address.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => {
            let all: Vec<SocketAddr> = address
                .to_socket_addrs()
                .map_err(|e| format!("is not ip:port or a resolvable host:port ({e})"))?
                .collect();
            *all.iter()
                .find(|a| a.is_ipv4())
                .or(all.first())
                .ok_or("resolves to no address")?
        }
    };
    if addr.port() == 0 {
        return Err("has port 0".into());
    }
    Ok(addr)
}

/// Applies the file at `path` to `pool` now, then checks it every `reload`
/// and applies it again when its content changed. A file that cannot be
/// read or is invalid is logged as an error and the last good set stays.
/// Runs until aborted.
pub async fn run(pool: Arc<Pool>, path: PathBuf, reload: Duration, mut watchers: Watchers) {
    let mut tick = tokio::time::interval(reload);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The content last seen (applied or refused), or the last read error,
    // so each change is acted on and logged once.
    let mut last: Option<Result<Vec<u8>, String>> = None;
    loop {
        tick.tick().await;
        let file = path.clone();
        let read = tokio::task::spawn_blocking(move || std::fs::read(file))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            .map_err(|e| e.to_string());
        if last.as_ref() == Some(&read) {
            continue;
        }
        last = Some(read.clone());
        let text = match read {
            Ok(text) => text,
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e,
                    "cannot read the endpoints file; keeping the last good endpoints");
                continue;
            }
        };
        let named = path.clone();
        // Resolving hostnames blocks.
        let parsed = tokio::task::spawn_blocking(move || parse(&named, &text)).await;
        match parsed {
            Ok(Ok(specs)) => {
                tracing::info!(file = %path.display(), endpoints = specs.len(),
                    "applying the endpoints file");
                watchers.apply(&pool, pool.set_endpoints(specs));
            }
            Ok(Err(e)) => tracing::error!(error = %e,
                "invalid endpoints file; keeping the last good endpoints"),
            Err(e) => tracing::error!(error = %e, "loading the endpoints file failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(yaml: &str) -> Result<Vec<EndpointSpec>, DiscoveryError> {
        parse(Path::new("endpoints.yaml"), yaml.as_bytes())
    }

    #[test]
    fn defaults_fill_in() {
        let specs = parse_str("endpoints:\n  - address: 127.0.0.1:8001\n").unwrap();
        assert_eq!(
            specs,
            vec![EndpointSpec {
                name: "127.0.0.1:8001".into(),
                http: "127.0.0.1:8001".parse().unwrap(),
                cache: None,
                ready: true,
                draining: false,
                ready_since_ms: None,
                role: Default::default(),
            }]
        );
    }

    #[test]
    fn ready_since_is_an_rfc_3339_time() {
        let specs = parse_str(
            "endpoints:\n  - {address: 127.0.0.1:8001, readySince: '2026-01-02T03:04:05.5Z'}\n",
        )
        .unwrap();
        assert_eq!(specs[0].ready_since_ms, Some(1_767_323_045_500));
        let e = parse_str("endpoints:\n  - {address: 127.0.0.1:8001, readySince: yesterday}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("endpoints[0].readySince") && e.contains("yesterday"),
            "{e}"
        );
    }

    #[test]
    fn a_role_is_prefill_decode_or_both() {
        let specs = parse_str(
            "endpoints:\n  - {address: 127.0.0.1:8001, role: prefill}\n  - {address: 127.0.0.1:8002, role: decode}\n",
        )
        .unwrap();
        assert_eq!(
            (specs[0].role, specs[1].role),
            (Role::Prefill, Role::Decode)
        );
        let e = parse_str("endpoints:\n  - {address: 127.0.0.1:8001, name: p0, role: prefiller}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("endpoints[0].role") && e.contains("p0") && e.contains("prefiller"),
            "{e}"
        );
    }

    #[test]
    fn cache_port_is_on_the_same_host() {
        let specs = parse_str(
            "endpoints:\n  - {address: '[::1]:8001', name: a, cachePort: 50051, ready: false, draining: true}\n",
        )
        .unwrap();
        assert_eq!(specs[0].cache, Some("[::1]:50051".parse().unwrap()));
        assert!(!specs[0].ready && specs[0].draining);
    }

    #[test]
    fn hostnames_resolve() {
        let specs = parse_str("endpoints:\n  - address: localhost:8001\n").unwrap();
        assert!(specs[0].http.ip().is_loopback());
        assert_eq!(specs[0].name, "localhost:8001");
    }

    #[test]
    fn an_empty_file_is_an_error() {
        assert!(parse_str("").is_err());
        assert!(parse_str("endpoints: []\n").unwrap().is_empty());
    }

    #[test]
    fn port_zero_is_an_error() {
        let e = parse_str("endpoints:\n  - {address: 127.0.0.1:0}\n").unwrap_err();
        assert!(e.to_string().contains("endpoints[0].address"), "{e}");
        let e = parse_str("endpoints:\n  - {address: 127.0.0.1:1, cachePort: 0}\n").unwrap_err();
        assert!(e.to_string().contains("endpoints[0].cachePort"), "{e}");
    }
}
