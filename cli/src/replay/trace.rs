//! Mooncake-format traces: JSON lines of `timestamp` (ms), `input_length`,
//! `output_length`, `hash_ids` (one id per block of the prompt, equal ids =
//! equal prefix blocks) and an optional `session_id`. Plain or gzip.
//! Also what the replay may do to a trace before running it: round its
//! arrivals into bursts, prepend a template every request shares.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{Context as _, bail};
use flate2::read::MultiGzDecoder;
use serde::Deserialize;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Arrival, in seconds from the trace's start.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Block ids of the prompt, in order.
    pub hash_ids: Vec<u64>,
    /// The conversation, if the trace names one.
    pub session_id: Option<String>,
}

/// A request arriving at `t` s with `input` prompt and `output` generated
/// tokens over block ids `ids`, for tests.
#[cfg(test)]
pub(super) fn req(t: f64, input: u64, output: u64, ids: &[u64]) -> TraceRequest {
    TraceRequest {
        arrival_s: t,
        input_length: input,
        output_length: output,
        hash_ids: ids.to_vec(),
        session_id: None,
    }
}

/// A request's prompt or output tokens at most: past any model's context,
/// and small enough that the engine model's hashes of a prompt fit memory
/// and no sum of them overflows.
const MAX_TOKENS: u64 = 1 << 24;

#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    session_id: Option<serde_json::Value>,
}

/// A parsed trace, in arrival order.
#[derive(Clone, Debug)]
pub struct Trace {
    /// Requests by arrival (stable for equal timestamps).
    pub requests: Vec<TraceRequest>,
    /// Leading blocks every request shares ([`Trace::share_prefix`]); a
    /// `pK` routing key covers them and K more.
    pub shared_blocks: usize,
}

impl Trace {
    /// Reads a trace file; `.gz` files are decompressed.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let file = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
        let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
            Box::new(MultiGzDecoder::new(file))
        } else {
            Box::new(file)
        };
        Self::parse(BufReader::new(reader))
            .with_context(|| format!("reading trace {}", path.display()))
    }

    /// Parses JSON lines; blank lines are skipped.
    pub fn parse(reader: impl BufRead) -> anyhow::Result<Self> {
        let mut requests = Vec::new();
        for (n, line) in reader.lines().enumerate() {
            let line = line.with_context(|| format!("line {}", n + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let l: Line = serde_json::from_str(&line).with_context(|| format!("line {}", n + 1))?;
            if !l.timestamp.is_finite() || l.timestamp < 0.0 {
                bail!("line {}: timestamp {} is not a time", n + 1, l.timestamp);
            }
            if l.input_length.max(l.output_length) > MAX_TOKENS {
                bail!(
                    "line {}: input_length {} or output_length {} is over {MAX_TOKENS} tokens",
                    n + 1,
                    l.input_length,
                    l.output_length
                );
            }
            let session_id = match l.session_id {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s),
                Some(other) => Some(other.to_string()),
            };
            requests.push(TraceRequest {
                arrival_s: l.timestamp / 1000.0,
                input_length: l.input_length,
                output_length: l.output_length,
                hash_ids: l.hash_ids,
                session_id,
            });
        }
        if requests.is_empty() {
            bail!("the trace has no requests");
        }
        requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        Ok(Trace {
            requests,
            shared_blocks: 0,
        })
    }

    /// Rounds every arrival down to a multiple of `q_ms` milliseconds (0:
    /// unchanged), turning spread-out arrivals into bursts of requests at
    /// the same instant. The order stays the trace's.
    pub fn quantize(&mut self, q_ms: u32) {
        if q_ms == 0 {
            return;
        }
        let q = f64::from(q_ms) / 1000.0;
        for r in &mut self.requests {
            // A little tolerance: 2.0 / 0.001 is 1999.9999999999998.
            r.arrival_s = ((r.arrival_s / q) + 1e-9).floor() * q;
        }
    }

    /// Prepends `k` blocks that every request shares, as a chat template's
    /// header (system prompt, tool list) is shared: each chain starts with
    /// the same `k` ids, one above the trace's largest so they match none of
    /// its own, and each prompt grows by `k × block_tokens` tokens. Ids,
    /// lengths and order of the rest are unchanged.
    pub fn share_prefix(&mut self, k: usize, block_tokens: u64) -> anyhow::Result<()> {
        if k == 0 {
            return Ok(());
        }
        let largest = self
            .requests
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .max()
            .unwrap_or(0);
        let template: Vec<u64> = (1..=k as u64)
            .map(|i| largest.checked_add(i))
            .collect::<Option<_>>()
            .with_context(|| {
                format!("the trace's block id {largest} leaves no room for {k} shared ids")
            })?;
        let longest = self.requests.iter().map(|r| r.input_length).max();
        let extra = (k as u64)
            .checked_mul(block_tokens)
            .filter(|&e| e.checked_add(longest.unwrap_or(0)).is_some())
            .with_context(|| {
                format!(
                    "{k} shared blocks of {block_tokens} tokens overflow a prompt's token count"
                )
            })?;
        for r in &mut self.requests {
            r.hash_ids.splice(0..0, template.iter().copied());
            r.input_length += extra;
        }
        self.shared_blocks += k;
        Ok(())
    }

    /// Distinct arrival times.
    pub fn instants(&self) -> usize {
        let mut n = 0;
        let mut last = None;
        for r in &self.requests {
            if last != Some(r.arrival_s) {
                n += 1;
                last = Some(r.arrival_s);
            }
        }
        n
    }

    /// Distinct block ids (D).
    pub fn distinct_blocks(&self) -> usize {
        self.requests
            .iter()
            .flat_map(|r| r.hash_ids.iter())
            .collect::<HashSet<_>>()
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sorts_stably_and_reads_sessions() {
        let text = r#"{"timestamp": 20, "input_length": 5, "output_length": 1, "hash_ids": [1]}

{"timestamp": 10, "input_length": 7, "output_length": 2, "hash_ids": [1, 2], "session_id": 42}
{"timestamp": 10, "input_length": 9, "output_length": 3, "hash_ids": [3], "session_id": "s"}
"#;
        let t = Trace::parse(text.as_bytes()).unwrap();
        let order: Vec<u64> = t.requests.iter().map(|r| r.input_length).collect();
        assert_eq!(order, vec![7, 9, 5]);
        assert_eq!(t.requests[0].arrival_s, 0.010);
        assert_eq!(t.requests[0].session_id.as_deref(), Some("42"));
        assert_eq!(t.requests[1].session_id.as_deref(), Some("s"));
        assert_eq!(t.distinct_blocks(), 3);
    }

    #[test]
    fn quantizing_rounds_arrivals_down_to_bursts() {
        let text = ["0", "999", "1000", "2001", "2999"]
            .map(|t| format!(r#"{{"timestamp": {t}, "input_length": 1, "output_length": 1, "hash_ids": [1]}}"#))
            .join("\n");
        let mut t = Trace::parse(text.as_bytes()).unwrap();
        t.quantize(0);
        assert_eq!(t.requests[1].arrival_s, 0.999);
        t.quantize(1000);
        let at: Vec<f64> = t.requests.iter().map(|r| r.arrival_s).collect();
        assert_eq!(at, vec![0.0, 0.0, 1.0, 2.0, 2.0]);
        assert_eq!(t.instants(), 3);
    }

    #[test]
    fn a_shared_prefix_is_the_first_k_blocks_of_every_chain_and_nothing_else() {
        let text = [
            (0, 1100, 7, "[3, 9, 4]"),
            (5, 600, 2, "[3, 8]"),
            (9, 100, 1, "[]"),
        ]
        .map(|(t, i, o, ids)| {
            format!(
                r#"{{"timestamp": {t}, "input_length": {i}, "output_length": {o}, "hash_ids": {ids}}}"#
            )
        })
        .join("\n");
        let before = Trace::parse(text.as_bytes()).unwrap();
        let mut after = before.clone();
        after.share_prefix(2, 512).unwrap();
        assert_eq!(after.shared_blocks, 2);
        let (a, b) = (&after.requests[0].hash_ids, &after.requests[1].hash_ids);
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        // Before, the chains shared their first block (3); now that block
        // comes after the two shared ones and still matches.
        assert_eq!(common, 3);
        assert_eq!(a[..2], b[..2]);
        assert!(
            a[..2]
                .iter()
                .all(|id| !before.requests[0].hash_ids.contains(id))
        );
        assert!(
            a[..2]
                .iter()
                .all(|id| !before.requests[1].hash_ids.contains(id))
        );
        assert_ne!(a[0], a[1]);
        for (x, y) in before.requests.iter().zip(&after.requests) {
            assert_eq!(y.hash_ids[..2], a[..2]);
            assert_eq!(y.hash_ids[2..], x.hash_ids[..]);
            assert_eq!(y.input_length, x.input_length + 1024);
            assert_eq!(
                (y.arrival_s, y.output_length, &y.session_id),
                (x.arrival_s, x.output_length, &x.session_id)
            );
        }
        assert_eq!(after.distinct_blocks(), before.distinct_blocks() + 2);

        let mut same = before.clone();
        same.share_prefix(0, 512).unwrap();
        assert_eq!(same.requests, before.requests);
        assert_eq!(same.shared_blocks, 0);

        let mut full = Trace::parse(
            format!(
                r#"{{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [{}]}}"#,
                u64::MAX - 1
            )
            .as_bytes(),
        )
        .unwrap();
        let err = full.share_prefix(2, 512).unwrap_err().to_string();
        assert!(err.contains("no room for 2 shared ids"), "{err}");
        assert_eq!(full.requests[0].hash_ids, vec![u64::MAX - 1]);
        // Tokens that overflow are refused, the trace unchanged.
        let mut huge = before.clone();
        let err = huge.share_prefix(2, u64::MAX / 2).unwrap_err().to_string();
        assert!(err.contains("overflow"), "{err}");
        assert_eq!(huge.requests, before.requests);
    }

    #[test]
    fn errors_name_the_line() {
        let text = "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\n{\"timestamp\": 1}\n";
        let err = format!("{:#}", Trace::parse(text.as_bytes()).unwrap_err());
        assert!(err.starts_with("line 2"), "{err}");
        assert!(Trace::parse("".as_bytes()).is_err());
        let text = format!(
            "{{\"timestamp\": 1, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": []}}",
            u64::MAX
        );
        let err = format!("{:#}", Trace::parse(text.as_bytes()).unwrap_err());
        assert!(err.starts_with("line 1: input_length"), "{err}");
    }

    #[test]
    fn reads_gzip() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            File::create(&path).unwrap(),
            flate2::Compression::fast(),
        );
        writeln!(
            gz,
            r#"{{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [5]}}"#
        )
        .unwrap();
        gz.finish().unwrap();
        let t = Trace::load(&path).unwrap();
        assert_eq!(t.requests[0].hash_ids, vec![5]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
