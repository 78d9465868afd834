//! Snapshots of the pool for metrics and `/debug/pool`: every endpoint's
//! state and load, and the occupancy index's size per tier. Read-only.

use kvroute_core::contract::Mismatch;
use kvroute_core::index::Tier;

use super::{Pool, now};

/// One tier of the occupancy index, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierStats {
    /// The tier.
    pub tier: Tier,
    /// (block, endpoint) entries in it.
    pub entries: usize,
    /// Blocks dropped from it to stay within the per-endpoint bound, ever.
    pub dropped: u64,
}

/// A snapshot of one endpoint, for metrics and `/debug/pool`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EndpointStatus {
    /// Name.
    pub name: String,
    /// HTTP address.
    pub http: String,
    /// Ready per discovery.
    pub ready: bool,
    /// Draining per discovery.
    pub draining: bool,
    /// Ejected for failures right now.
    pub ejected: bool,
    /// WatchCache stream state.
    pub stream: &'static str,
    /// Requests in flight.
    pub in_flight: u32,
    /// Outstanding prefill tokens (this router's requests).
    pub prefill_tokens: u64,
    /// Predicted prefill queue, seconds: how long a new request would wait
    /// before its prefill starts, fleet-wide when the engine reports load.
    pub queue_seconds: f64,
    /// Age of the engine's last load report, seconds; `None` before one.
    pub load_report_age_seconds: Option<f64>,
    /// Blocks the index holds for it.
    pub cached_blocks: usize,
    /// Its slow-start weight now: its share of new keys, 0.01 to 1 (1 when
    /// not ramping up).
    pub weight: f64,
    /// When its slow-start ramp started (it became ready), RFC 3339; `None`
    /// when it is not ramping (see `docs/routing.md`, slow start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ramp_started: Option<String>,
    /// Its engine contract: `unknown`, `match` or `mismatch`.
    pub contract: &'static str,
    /// The fields on which its engine differs from the routing settings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub contract_mismatches: Vec<Mismatch>,
    /// Its share of this router's last [`RECENT_DECISIONS`](super::RECENT_DECISIONS) decisions (a
    /// request's first attempt), 0 to 1.
    pub decision_share: f64,
    /// Its share of the cold ones among them (no endpoint held any of the
    /// prefix: rendezvous placed the key), 0 to 1; 0 when none was cold.
    pub cold_share: f64,
}

/// Unix milliseconds as RFC 3339 UTC, to the millisecond.
fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

impl Pool {
    /// Every endpoint's status.
    pub fn status(&self) -> Vec<EndpointStatus> {
        let shares = (self.decisions.lock())
            .unwrap_or_else(|e| e.into_inner())
            .shares();
        let inner = self.lock();
        let now = now();
        let model = inner.settings.policy.prefill_model();
        let now_ms = super::wall_ms();
        inner
            .members
            .values()
            .map(|m| {
                let load = inner.load.load(m.slot);
                let share = shares
                    .get(m.spec.name.as_str())
                    .copied()
                    .unwrap_or_default();
                EndpointStatus {
                    name: m.spec.name.clone(),
                    http: m.spec.http.to_string(),
                    ready: m.spec.ready,
                    draining: m.spec.draining,
                    ejected: inner.outlier.is_ejected(&m.spec.name, now),
                    stream: m.stream.as_str(),
                    in_flight: load.in_flight,
                    prefill_tokens: load.prefill_tokens,
                    queue_seconds: model.queued_s(&load, now),
                    load_report_age_seconds: load.engine.map(|e| e.age(now).as_secs_f64()),
                    cached_blocks: inner.index.usage(m.slot).map_or(0, |(used, _)| used),
                    weight: inner.weight(m, now_ms),
                    ramp_started: (m.ramp_from_ms)
                        .filter(|_| inner.weight(m, now_ms) < 1.0)
                        .map(rfc3339),
                    contract: m.contract.as_str(),
                    contract_mismatches: m.contract.mismatches().to_vec(),
                    decision_share: share.decisions,
                    cold_share: share.cold,
                }
            })
            .collect()
    }

    /// (block, endpoint) entries in the index, GPU tier.
    pub fn index_entries(&self) -> usize {
        self.lock().index.entries()
    }

    /// Evicted blocks forgotten to make room for newer ones, ever.
    pub fn evicted_overflow(&self) -> u64 {
        self.lock().index.evicted_overflow()
    }

    /// Each tier's entries and drops.
    pub fn index_stats(&self) -> [TierStats; 2] {
        let inner = self.lock();
        Tier::ALL.map(|tier| TierStats {
            tier,
            entries: inner.index.tier_entries(tier),
            dropped: inner.index.dropped(tier),
        })
    }
}
