//! The operator source: subscribes to the kvroute operator's
//! `EndpointDiscovery.WatchPool` for one InferencePool and applies each
//! newer `PoolState` to the router's [`Pool`]: the endpoint set, and the
//! routing settings (policy, key mode, prefix length and block hashing) as
//! one value.
//!
//! States are full, not deltas, and versioned: one whose version is not
//! higher than the last applied (a lagging operator replica) is ignored.
//! When the stream breaks the router keeps routing on the last applied
//! state and subscribes to the next operator URL of its list at once; once
//! every URL has failed without a stream, it waits a jittered backoff
//! ([`Backoff`]) before the next round.
//!
//! Tenancy: the router's own configuration salts (salting needs its
//! secret); a policy that sets `Salted` makes a router that does not salt
//! refuse requests ([`crate::errors::ApiError::SaltingRequired`]) rather
//! than share caches between tenants. The policy's `tenant_header` is not
//! applied: which header to trust is the router's configuration too.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::spec::TenancyMode;
use kvroute_proto::Unusable;
use kvroute_proto::v1::endpoint_discovery_client::EndpointDiscoveryClient;
use kvroute_proto::v1::{self, PoolState, RoutingPolicy, WatchPoolRequest};

use tonic::transport::ClientTlsConfig;

use crate::pool::Watchers;
use crate::pool::{EndpointSpec, Pool, Streams};
use crate::reconnect::{BACKOFF_RESET_AFTER, Backoff, error_chain};
use crate::warmup::ReportTarget;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest PoolState accepted; thousands of endpoints take well under 1 MiB.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Watches pool `namespace/pool_name` at the operator `urls` (e.g.
/// `http://kvroute-operator.kvroute:9443`, or each replica's) and applies
/// its states to `pool`, starting and stopping the pool's WatchCache
/// `watchers` as the states say. Runs until aborted; never gives up on the
/// operator. `urls` is not empty (the configuration checks it).
pub async fn run(
    pool: Arc<Pool>,
    urls: Vec<String>,
    tls: Option<ClientTlsConfig>,
    namespace: String,
    pool_name: String,
    watchers: Watchers,
) {
    let mut backoff = Backoff::new(&urls.join(","));
    let mut watcher = Watcher {
        pool,
        url: urls.first().cloned().unwrap_or_default(),
        tls,
        namespace,
        pool_name,
        version: None,
        watchers,
    };
    let mut next = 0;
    // Whether any URL of the current round gave a stream.
    let mut streamed = false;
    loop {
        watcher.url = urls[next % urls.len()].clone();
        let mut connected_at = None;
        let broken = watcher.watch(&mut connected_at).await;
        // A stream that lived a while is a working replica; one that broke
        // at once counts as a failure, so a round of those backs off.
        let lived = connected_at.is_some_and(|t: Instant| t.elapsed() >= BACKOFF_RESET_AFTER);
        streamed |= lived;
        if lived {
            backoff.reset();
        }
        next += 1;
        let round_over = next % urls.len() == 0;
        let delay = if round_over && !streamed {
            backoff.next_delay()
        } else {
            Duration::ZERO
        };
        if round_over {
            streamed = false;
        }
        let w = &watcher;
        tracing::warn!(
            url = %w.url, namespace = %w.namespace, pool = %w.pool_name, reason = %broken,
            next_url = %urls[next % urls.len()], retry_in = ?delay, last_version = ?w.version,
            "operator stream lost; routing continues on the last pool state"
        );
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
}

/// Why a WatchPool stream ended.
#[derive(Debug, thiserror::Error)]
enum Broken {
    #[error("invalid operator URL: {0}")]
    Url(String),
    #[error("connecting: {0}")]
    Connect(String),
    #[error("WatchPool failed: {0}")]
    Status(#[source] tonic::Status),
    #[error("the operator ended the stream")]
    Ended,
}

/// One pool's subscription, and what its last applied state set.
struct Watcher {
    pool: Arc<Pool>,
    url: String,
    tls: Option<ClientTlsConfig>,
    namespace: String,
    pool_name: String,
    version: Option<u64>,
    watchers: Watchers,
}

impl Watcher {
    /// Subscribes and applies newer states until the stream breaks; sets
    /// `connected_at` once subscribed.
    async fn watch(&mut self, connected_at: &mut Option<Instant>) -> Broken {
        let endpoint = tonic::transport::Endpoint::from_shared(self.url.clone()).and_then(|e| {
            let e = e
                .connect_timeout(CONNECT_TIMEOUT)
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT);
            match &self.tls {
                Some(tls) => e.tls_config(tls.clone()),
                None => Ok(e),
            }
        });
        let endpoint = match endpoint {
            Ok(e) => e,
            Err(e) => return Broken::Url(error_chain(&e)),
        };
        let channel = match endpoint.connect().await {
            Ok(c) => c,
            Err(e) => return Broken::Connect(error_chain(&e)),
        };
        let mut client =
            EndpointDiscoveryClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let request = WatchPoolRequest {
            namespace: self.namespace.clone(),
            pool: self.pool_name.clone(),
            subscriber: crate::warmup::identity(),
        };
        let mut stream = match client.watch_pool(request).await {
            Ok(r) => r.into_inner(),
            Err(s) => return Broken::Status(s),
        };
        *connected_at = Some(Instant::now());
        tracing::info!(url = %self.url, namespace = %self.namespace, pool = %self.pool_name,
            "watching the operator's pool state");
        loop {
            let state = match stream.message().await {
                Ok(Some(s)) => s,
                Ok(None) => return Broken::Ended,
                Err(s) => return Broken::Status(s),
            };
            if state.namespace != self.namespace || state.pool != self.pool_name {
                tracing::warn!(namespace = %state.namespace, pool = %state.pool,
                    "ignoring the state of a pool this router did not ask for");
                continue;
            }
            if self.version.is_some_and(|v| state.version <= v) {
                tracing::debug!(version = state.version, applied = ?self.version,
                    "ignoring a pool state not newer than the applied one");
                continue;
            }
            self.apply(&state);
        }
    }

    /// Where to report warm-ups: the status writer the operator names
    /// (`host:port`), with this stream's scheme and TLS.
    fn report_to(&self, status_writer: &str) -> Option<ReportTarget> {
        if status_writer.is_empty() {
            return None;
        }
        let scheme = if self.url.starts_with("https://") {
            "https"
        } else {
            "http"
        };
        Some(ReportTarget {
            url: format!("{scheme}://{status_writer}"),
            tls: self.tls.clone(),
            namespace: self.namespace.clone(),
            pool: self.pool_name.clone(),
        })
    }

    /// Applies one newer state.
    fn apply(&mut self, state: &PoolState) {
        self.version = Some(state.version);
        let objectives = (state.objectives.iter()).map(|o| (o.name.clone(), o.priority));
        if self.pool.set_objectives(objectives.collect()) {
            tracing::info!(
                version = state.version,
                objectives = state.objectives.len(),
                "the pool's InferenceObjectives from the operator"
            );
        }
        if !state.pool_exists {
            tracing::warn!(
                version = state.version,
                "the InferencePool does not exist; no endpoints"
            );
            let streams = self.pool.set_endpoints(Vec::new());
            self.watchers.apply(&self.pool, streams);
            return;
        }
        let policy = state.policy.clone().unwrap_or_else(|| {
            tracing::warn!(
                version = state.version,
                "pool state without a policy; keeping the current one"
            );
            RoutingPolicy::default()
        });
        let specs = endpoints(state, &policy);
        tracing::info!(
            version = state.version,
            endpoints = specs.len(),
            ready = specs.iter().filter(|s| s.ready && !s.draining).count(),
            "applying the operator's pool state"
        );
        let streams = self.pool.set_endpoints(specs);
        self.watchers.apply(&self.pool, streams);
        if state.policy.is_none() {
            return;
        }
        let streams = update_settings(&self.pool, &policy);
        self.watchers.apply(&self.pool, streams);
        self.pool.warmup.set_routers(&state.routers);
        self.pool
            .warmup
            .set_report_to(self.report_to(&state.status_writer));
        update_warmup(&self.pool, policy.warmup.as_ref());
    }
}

/// The pool's endpoints, skipping (and logging) any the router cannot
/// address.
fn endpoints(state: &PoolState, policy: &RoutingPolicy) -> Vec<EndpointSpec> {
    state
        .endpoints
        .iter()
        .filter_map(|e| match endpoint(e, policy.cache_port) {
            Ok(spec) => Some(spec),
            Err(reason) => {
                tracing::warn!(endpoint = %e.name, address = %e.address, reason,
                    "skipping an endpoint the router cannot address");
                None
            }
        })
        .collect()
}

fn endpoint(e: &v1::Endpoint, default_cache_port: u32) -> Result<EndpointSpec, &'static str> {
    let ip: IpAddr = e
        .address
        .parse()
        .map_err(|_| "the address is not an IP address")?;
    let port = |p: u32| u16::try_from(p).ok().filter(|&p| p != 0);
    let http = port(e.http_port).ok_or("the HTTP port is not 1 to 65535")?;
    let cache = match (e.cache_port, default_cache_port) {
        (0, 0) => None,
        (0, p) | (p, _) => Some(port(p).ok_or("the cache port is not 1 to 65535")?),
    };
    if e.name.is_empty() {
        return Err("the name is empty");
    }
    Ok(EndpointSpec {
        name: e.name.clone(),
        http: SocketAddr::new(ip, http),
        cache: cache.map(|p| SocketAddr::new(ip, p)),
        ready: e.ready,
        draining: e.draining,
        ready_since_ms: e.ready_since_unix_ms,
        role: e.role().into(),
    })
}

/// Replaces the pool's settings when the operator's policy changes what
/// they route by; a part it gets wrong is kept as it was (and logged).
/// Returns the streams to restart.
fn update_settings(pool: &Pool, policy: &RoutingPolicy) -> Streams {
    let current = pool.settings().spec();
    let (spec, unusable) = policy.to_spec(&current);
    for part in unusable {
        warn_unusable(&part);
    }
    if spec == current {
        return Streams::default();
    }
    let hashing = (spec.hash != current.hash).then_some(&spec.hash);
    tracing::info!(policy = ?spec.policy, key = ?spec.key, hashing = ?hashing,
        offload_weight = spec.offload_weight, slow_start_seconds = spec.slow_start_seconds,
        "routing settings from the operator");
    if spec.tenancy == TenancyMode::Salted {
        tracing::info!(
            "the pool's policy sets tenancy Salted: requests are refused unless this router salts (tenancy.mode: salted)"
        );
    }
    pool.update_settings(|cur| {
        cur.with_spec(&spec).unwrap_or_else(|e| {
            // `to_spec` kept the current hashing if the new one was invalid.
            tracing::warn!(error = %e, "invalid block hashing from the operator; keeping the current settings");
            cur.clone()
        })
    })
}

/// Applies the operator's warm-ups (`None` or no prefixes: the router's
/// own); ones the router cannot read or that break a rule are logged and
/// the current ones kept.
fn update_warmup(pool: &Pool, warmup: Option<&v1::Warmup>) {
    let checked = warmup.map(|w| {
        let w = w.to_warmup()?;
        if !w.prefixes.is_empty() {
            w.validate(false, false)
                .map_err(|e| format!("{} {}: {}", e.field, e.value, e.reason))?;
        }
        Ok::<_, String>(w)
    });
    match checked.transpose() {
        Ok(w) => {
            if pool.warmup.set_operator(w) {
                tracing::info!("warm-ups from the operator");
            }
        }
        Err(error) => tracing::warn!(%error,
            "unusable warm-ups from the operator; keeping the current ones"),
    }
}

/// Logs a part of the operator's policy the router cannot use.
fn warn_unusable(part: &Unusable) {
    match part {
        Unusable::Policy { name, reason } => tracing::warn!(policy = %name, reason = %reason,
            "unknown routing policy or unusable parameters from the operator; keeping the current one"),
        Unusable::KeyMode(mode) => tracing::warn!(
            key_mode = mode,
            "unknown key mode from the operator; keeping the current one"
        ),
        Unusable::Hashing {
            block_size,
            hash_algorithm,
            reason,
        } => tracing::warn!(error = %reason, block_size, hash_algorithm,
            "invalid block hashing from the operator; keeping the current hashing"),
        Unusable::OffloadWeight(w) => tracing::warn!(
            offload_weight = w,
            "invalid offload weight from the operator; keeping the current one"
        ),
        Unusable::SlowStartSeconds(s) => tracing::warn!(
            slow_start_seconds = s,
            "slow-start window over 3600 s from the operator; keeping the current one"
        ),
        Unusable::Disaggregation(mode, min) => tracing::warn!(
            mode,
            min_uncached_tokens = min,
            "unknown disaggregation mode or threshold from the operator; keeping the current one"
        ),
    }
}

#[cfg(test)]
mod tests;
