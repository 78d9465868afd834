//! `resilience`: retries, outlier ejection, health checks and the hang
//! deadline.

use serde::{Deserialize, Serialize};

/// Retries and ejection of failing endpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Resilience {
    /// Attempts per request, the first included; only before the first
    /// response byte. Default: 3.
    pub attempts: u32,
    /// Consecutive failures that eject an endpoint. Default: 3.
    pub eject_after_failures: u32,
    /// First ejection, milliseconds; each repeat doubles it. Default: 5000.
    pub ejection_base_ms: u64,
    /// Longest ejection, milliseconds. Default: 300000.
    pub ejection_max_ms: u64,
    /// Largest share of endpoints ejected at once, percent; further
    /// ejections are refused (and counted). Default: 50.
    pub max_ejected_percent: u32,
    /// Active health checks; `null` turns them off.
    pub health_check: Option<HealthCheck>,
    /// The hang deadline's floor, milliseconds: an attempt that gets no
    /// first response byte within max(this, `hungTtftMultiple` × the
    /// request's predicted time to first token at the endpoint), plus for
    /// a non-streaming request `hungMsPerToken` × its `max_tokens` (its
    /// answer comes whole), is cancelled, counted as a `timeout` fault and
    /// retried elsewhere. An endpoint ejected for timeouts is not restored
    /// by health checks, only by one trial request at a time. A
    /// non-streaming request without `max_tokens` has no hang deadline,
    /// only `limits.firstByteTimeoutMs`, which also caps it. Default: 10000.
    pub hung_after_ms: u64,
    /// See `hungAfterMs`; at least 1. Default: 4.
    pub hung_ttft_multiple: f64,
    /// See `hungAfterMs`: the time allowed per requested output token of a
    /// non-streaming request, milliseconds. Default: 100.
    pub hung_ms_per_token: u64,
    /// How long a starting router waits for the first WatchCache snapshot
    /// of every ready engine before `/readyz` says ready anyway (logged
    /// and counted), milliseconds from when it first knows its endpoints;
    /// 0: no wait. Until then a Service sends it nothing it would route
    /// cold. Default: 15000.
    pub snapshot_wait_ms: u64,
}

impl Default for Resilience {
    fn default() -> Self {
        Resilience {
            attempts: 3,
            eject_after_failures: 3,
            ejection_base_ms: 5000,
            ejection_max_ms: 300_000,
            max_ejected_percent: 50,
            health_check: Some(HealthCheck::default()),
            hung_after_ms: 10_000,
            hung_ttft_multiple: 4.0,
            hung_ms_per_token: 100,
            snapshot_wait_ms: 15_000,
        }
    }
}

/// Active health checks: `GET path` on every endpoint every `intervalMs`.
/// A check fails on a connect error, a non-2xx status or no answer within
/// `timeoutMs`; `unhealthyThreshold` failures in a row eject the endpoint
/// until a check passes, and a passing check restores any ejected endpoint
/// except one ejected as hung (see `Resilience::hung_after_ms`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheck {
    /// The path. Default: `/health` (vLLM's).
    pub path: String,
    /// Milliseconds between checks. Default: 5000.
    pub interval_ms: u64,
    /// Milliseconds a check may take. Default: 2000.
    pub timeout_ms: u64,
    /// Failed checks in a row that eject. Default: 2.
    pub unhealthy_threshold: u32,
}

impl Default for HealthCheck {
    fn default() -> Self {
        HealthCheck {
            path: "/health".into(),
            interval_ms: 5000,
            timeout_ms: 2000,
            unhealthy_threshold: 2,
        }
    }
}
