//! Load reports: an engine's as WatchCache sends it, and the same message
//! in the header of an engine's admission refusal
//! ([`kvroute_core::admission::LOAD_HEADER`]), read into the core's
//! [`EngineLoad`].

use std::time::Instant;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use kvroute_core::load::{EngineLoad, Memory};
use prost::Message;

use crate::v1;

/// The longest refusal header read, in bytes: a whole `LoadReport` is
/// under 150 in base64.
const MAX_HEADER_LEN: usize = 512;

/// `report` as a refusal header's value.
pub fn to_header(report: &v1::LoadReport) -> String {
    STANDARD.encode(report.encode_to_vec())
}

/// The report in a refusal header's value; `None` when it is not one
/// (too long, not base64, not a `LoadReport`).
pub fn from_header(value: &[u8]) -> Option<v1::LoadReport> {
    if value.len() > MAX_HEADER_LEN {
        return None;
    }
    let bytes = STANDARD.decode(value).ok()?;
    v1::LoadReport::decode(bytes.as_slice()).ok()
}

/// What `load`, received at `reported_at`, says as the core reads it: a
/// rate only when positive and finite, memory only when the engine says
/// all a wait for it needs.
pub fn engine_load(load: &v1::LoadReport, reported_at: Instant) -> EngineLoad {
    EngineLoad {
        waiting: load.waiting,
        running: load.running,
        kv_usage: load.kv_usage,
        queued_prefill_tokens: load.queued_prefill_tokens,
        // A rate must be positive and finite to divide by.
        prefill_tokens_per_s: load
            .prefill_tokens_per_s
            .filter(|r| r.is_finite() && *r > 0.0),
        // Memory predicts a wait only when the engine says all of it.
        memory: match (
            load.free_blocks,
            load.waiting_blocks,
            load.remaining_decode_s,
        ) {
            (Some(free_blocks), Some(waiting_blocks), Some(remaining))
                if remaining.is_finite() && remaining >= 0.0 =>
            {
                Some(Memory {
                    free_blocks,
                    used_blocks: load.used_blocks,
                    waiting_blocks,
                    growth_blocks: load.growth_blocks.unwrap_or(0),
                    remaining_decode_s: remaining,
                    waiting_decode_s: load
                        .waiting_decode_s
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .unwrap_or(2.0 * remaining),
                    running: u64::from(load.running),
                    waiting: u64::from(load.waiting),
                    max_num_seqs: load.max_num_seqs.map(u64::from),
                })
            }
            _ => None,
        },
        reported_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_survives_the_header() {
        let report = v1::LoadReport {
            waiting: 2,
            running: 7,
            kv_usage: 0.75,
            used_blocks: 192,
            queued_prefill_tokens: Some(4096),
            prefill_tokens_per_s: Some(20_000.0),
            free_blocks: Some(64),
            cached_free_blocks: Some(10),
            waiting_blocks: Some(90),
            remaining_decode_s: Some(0.4),
            preemptions: Some(3),
            max_num_seqs: Some(256),
            growth_blocks: Some(12),
            waiting_decode_s: Some(0.5),
        };
        let header = to_header(&report);
        assert!(header.len() < MAX_HEADER_LEN, "{header}");
        assert_eq!(from_header(header.as_bytes()), Some(report));
    }

    #[test]
    fn what_is_not_a_report_is_none() {
        assert_eq!(from_header(b"not base64!"), None);
        // Base64, but field 1 with a wire type a LoadReport never has.
        assert_eq!(from_header(STANDARD.encode([0x0b, 0x01]).as_bytes()), None);
        assert_eq!(from_header(&[b'A'; MAX_HEADER_LEN + 4]), None);
    }

    #[test]
    fn memory_needs_every_figure_a_wait_needs() {
        let now = Instant::now();
        let mut report = v1::LoadReport {
            free_blocks: Some(64),
            waiting_blocks: Some(0),
            remaining_decode_s: Some(f64::NAN),
            prefill_tokens_per_s: Some(0.0),
            ..v1::LoadReport::default()
        };
        let load = engine_load(&report, now);
        assert_eq!((load.memory, load.prefill_tokens_per_s), (None, None));
        report.remaining_decode_s = Some(0.5);
        let memory = engine_load(&report, now).memory.unwrap();
        assert_eq!(memory.waiting_decode_s, 1.0);
    }
}
