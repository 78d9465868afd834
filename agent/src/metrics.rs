//! The agent's Prometheus metrics. Every label is bounded: `rank` by
//! `--data-parallel-size`, `medium` by [`MAX_MEDIA`](crate::resident::MAX_MEDIA),
//! the rest by fixed sets named here.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::events::Event;
use crate::verify::Checked;
use kvroute_telemetry::throttle::Throttle;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Rank {
    rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankKind {
    rank: u32,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankMedium {
    rank: u32,
    medium: String,
}

/// The agent's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    registry: Registry,
    events: Family<RankKind, Counter>,
    batches: Family<Rank, Counter>,
    gaps: Family<Rank, Counter>,
    missed: Family<Rank, Counter>,
    replays: Family<RankKind, Counter>,
    malformed: Family<RankKind, Counter>,
    restarts: Family<RankKind, Counter>,
    verified: Family<RankKind, Counter>,
    scrapes: Family<RankKind, Counter>,
    throttle: std::sync::Mutex<Throttle<(u32, &'static str)>>,
}

impl Metrics {
    /// Registered, zero.
    pub fn new() -> Self {
        let m = Metrics::default();
        let mut registry = Registry::default();
        registry.register(
            "kvroute_agent_events",
            "KV cache events applied, by type (stored, removed, cleared; unknown: a type this build skips)",
            m.events.clone(),
        );
        registry.register(
            "kvroute_agent_batches",
            "KV event batches applied",
            m.batches.clone(),
        );
        registry.register(
            "kvroute_agent_gaps",
            "Gaps in the batch sequence",
            m.gaps.clone(),
        );
        registry.register(
            "kvroute_agent_missed_batches",
            "Batches missing from the live stream (filled by replay or not)",
            m.missed.clone(),
        );
        registry.register(
            "kvroute_agent_replays",
            "Replays asked for, by result (filled, unfillable)",
            m.replays.clone(),
        );
        registry.register(
            "kvroute_agent_malformed",
            "Messages or events skipped, by reason (frames: a wrong count or over the limit, sequence, payload, oversized: over the size limit, read past unkept, too_many_media, block_size: a BlockStored of another block size)",
            m.malformed.clone(),
        );
        registry.register(
            "kvroute_agent_restarts",
            "New incarnations (the resident set cleared), by reason",
            m.restarts.clone(),
        );
        registry.register(
            "kvroute_agent_hash_verification_blocks",
            "Blocks whose hash was recomputed from their tokens, by result (match, mismatch, unverifiable)",
            m.verified.clone(),
        );
        registry.register(
            "kvroute_agent_engine_scrapes",
            "Scrapes of the engine's /metrics and /health, by result (ok, error)",
            m.scrapes.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Whether a line of `kind` for `rank` may be logged now (see
    /// [`Throttle`]), and if so how many like it were left out since the
    /// last one; lines about what a peer controls ask first.
    pub fn log_allowed(&self, rank: u32, kind: &'static str) -> Option<u64> {
        let mut throttle = self.throttle.lock().unwrap_or_else(|e| e.into_inner());
        let n = throttle.admit((rank, kind), std::time::Instant::now())?;
        Some(n - 1)
    }

    /// The counters' registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// A batch of `events` applied.
    pub fn batch(&self, rank: u32, events: &[Event]) {
        self.batches.get_or_create(&Rank { rank }).inc();
        for e in events {
            let kind = match e {
                Event::Stored(_) => "stored",
                Event::Removed { .. } => "removed",
                Event::Cleared { .. } => "cleared",
                Event::Unknown(_) => "unknown",
            };
            self.events.get_or_create(&RankKind { rank, kind }).inc();
        }
    }

    /// A gap of `missed` batches.
    pub fn gap(&self, rank: u32, missed: u64) {
        self.gaps.get_or_create(&Rank { rank }).inc();
        self.missed.get_or_create(&Rank { rank }).inc_by(missed);
    }

    /// A replay's result.
    pub fn replay(&self, rank: u32, filled: bool) {
        let kind = if filled { "filled" } else { "unfillable" };
        self.replays.get_or_create(&RankKind { rank, kind }).inc();
    }

    /// Something skipped, and why.
    pub fn malformed(&self, rank: u32, kind: &'static str) {
        self.malformed.get_or_create(&RankKind { rank, kind }).inc();
    }

    /// A new incarnation, and why.
    pub fn restart(&self, rank: u32, kind: &'static str) {
        self.restarts.get_or_create(&RankKind { rank, kind }).inc();
    }

    /// What verifying one event found.
    pub fn verified(&self, rank: u32, c: &Checked) {
        let counts = [
            ("match", c.matched),
            ("mismatch", usize::from(c.mismatched.is_some())),
            ("unverifiable", c.unverifiable),
        ];
        for (kind, n) in counts {
            if n > 0 {
                self.verified
                    .get_or_create(&RankKind { rank, kind })
                    .inc_by(n as u64);
            }
        }
    }

    /// A scrape of the engine, and whether it worked.
    pub fn scrape(&self, rank: u32, ok: bool) {
        let kind = if ok { "ok" } else { "error" };
        self.scrapes.get_or_create(&RankKind { rank, kind }).inc();
    }
}

/// Scrape-time gauges: resident blocks per rank and medium, subscribers
/// per rank.
pub fn gauges(ranks: &[std::sync::Arc<crate::rank::Rank>]) -> Registry {
    let mut registry = Registry::default();
    let resident = Family::<RankMedium, Gauge>::default();
    let subscribers = Family::<Rank, Gauge>::default();
    for r in ranks {
        let (counts, subs) = r.stats();
        for (medium, n) in counts {
            resident
                .get_or_create(&RankMedium {
                    rank: r.rank,
                    medium,
                })
                .set(n as i64);
        }
        subscribers
            .get_or_create(&Rank { rank: r.rank })
            .set(subs as i64);
    }
    registry.register(
        "kvroute_agent_resident_blocks",
        "Blocks resident in the engine's cache, by medium",
        resident,
    );
    registry.register(
        "kvroute_agent_subscribers",
        "WatchCache subscribers connected",
        subscribers,
    );
    registry
}
