//! `flowControl` (requests held at the router until an endpoint can start
//! them) and `objectives` (the priorities requests name).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, MAX_DURATION_MS};

fn invalid(field: &str, value: &dyn std::fmt::Display, reason: &'static str) -> ConfigError {
    ConfigError::InvalidEntry {
        field: field.to_owned(),
        value: value.to_string(),
        reason,
    }
}

/// How requests wait at the router ([`crate::flow`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct FlowControl {
    /// Hold requests at the router. Off: every request goes to an engine on
    /// arrival, and gets 429 when every endpoint is at
    /// `limits.endpointConcurrency`. Default: true.
    pub enabled: bool,
    /// A request waits at the router while the endpoint the policy chose
    /// would make it wait longer than this before its prefill starts
    /// (queued prefill, KV memory), milliseconds. Default: the policy's
    /// `admissionToleranceMs`, 50 when that is null.
    pub hold_above_ms: Option<f64>,
    /// Requests held at most; more shed the lowest band first (429,
    /// `flow_queue_full`). Default: 1024.
    pub max_queued: usize,
    /// Body bytes held at most (they stay counted in
    /// `limits.maxBodyBytesInFlight` too). Default: 256 MiB.
    pub max_queued_bytes: usize,
    /// How long a request waits at most, milliseconds (429,
    /// `flow_wait_limit`). Default: 30000.
    pub max_wait_ms: u64,
    /// Per priority, another `maxWaitMs`.
    pub bands: Vec<Band>,
    /// While a priority has had requests in this many milliseconds, lower
    /// ones leave room at each endpoint for the largest of them (its KV
    /// blocks and a seat); 0: no room kept. Default: 10000.
    pub reserve_window_ms: u64,
}

/// A priority band's own settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Band {
    /// The priority it applies to.
    pub priority: i32,
    /// How long its requests wait at most, milliseconds.
    pub max_wait_ms: u64,
}

impl Default for FlowControl {
    fn default() -> Self {
        FlowControl {
            enabled: true,
            hold_above_ms: None,
            max_queued: 1024,
            max_queued_bytes: 256 << 20,
            max_wait_ms: 30_000,
            bands: Vec::new(),
            reserve_window_ms: 10_000,
        }
    }
}

impl FlowControl {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(ms) = self.hold_above_ms
            && !(ms.is_finite() && (0.0..=MAX_DURATION_MS as f64).contains(&ms))
        {
            return Err(invalid(
                "flowControl.holdAboveMs",
                &ms,
                "must be 0 to 86400000 (one day)",
            ));
        }
        let mut waits = vec![("flowControl.maxWaitMs".to_owned(), self.max_wait_ms)];
        let mut seen = HashSet::new();
        for (i, b) in self.bands.iter().enumerate() {
            if !seen.insert(b.priority) {
                return Err(invalid(
                    &format!("flowControl.bands[{i}].priority"),
                    &b.priority,
                    "is named by an earlier band",
                ));
            }
            waits.push((format!("flowControl.bands[{i}].maxWaitMs"), b.max_wait_ms));
        }
        for (field, ms) in waits {
            if !(1..=MAX_DURATION_MS).contains(&ms) {
                return Err(invalid(&field, &ms, "must be 1 to 86400000 (one day)"));
            }
        }
        if self.reserve_window_ms > MAX_DURATION_MS {
            return Err(invalid(
                "flowControl.reserveWindowMs",
                &self.reserve_window_ms,
                "must be 0 to 86400000 (one day)",
            ));
        }
        Ok(())
    }

    /// The wait limit per priority, beside `maxWaitMs`.
    pub fn band_waits(&self) -> BTreeMap<i32, Duration> {
        (self.bands.iter())
            .map(|b| (b.priority, Duration::from_millis(b.max_wait_ms)))
            .collect()
    }
}

/// A priority requests may name with `x-gateway-inference-objective`, as
/// an `InferenceObjective` does in a cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Objective {
    /// Its name.
    pub name: String,
    /// Its priority: higher first; negative is sheddable.
    pub priority: i32,
    /// The tenants that may name it; unset: any. Others get priority 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<String>>,
}

/// Checks `objectives`: names unique and not empty.
pub(super) fn validate_objectives(objectives: &[Objective]) -> Result<(), ConfigError> {
    let mut seen = HashSet::new();
    for (i, o) in objectives.iter().enumerate() {
        let field = format!("objectives[{i}].name");
        if o.name.is_empty() {
            return Err(invalid(&field, &o.name, "must not be empty"));
        }
        if !seen.insert(o.name.as_str()) {
            return Err(invalid(&field, &o.name, "is named by an earlier objective"));
        }
    }
    Ok(())
}
