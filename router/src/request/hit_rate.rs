//! Observed versus expected hit rate. The router expects a share of each
//! request's prompt to be cached where it sends it; the engine says how
//! much was (`usage.prompt_tokens_details.cached_tokens`, in a
//! non-streaming body or the final usage chunk of a stream). A sustained
//! gap between the two is silent loss: a template, tokenizer or hashing the
//! engine does not share.
//!
//! [`UsageScan`] reads the usage from a response body as it passes, keeping
//! only its last [`TAIL_BYTES`] (the usage comes last in vLLM's bodies and
//! streams), so nothing is buffered. [`Gap`] keeps a sliding window of
//! requests per model and says when the gap is sustained; it is pure and
//! takes the clock as a parameter.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Bytes of a body's end kept to find its usage in.
pub const TAIL_BYTES: usize = 8 << 10;
/// Requests per model in the window.
pub const WINDOW: usize = 500;
/// Requests in the window before a gap can be reported.
pub const MIN_REQUESTS: usize = 50;
/// A gap (expected share − observed share) at least this large is reported.
pub const ALERT_GAP: f64 = 0.2;
/// At most one report per model this often.
pub const ALERT_EVERY: Duration = Duration::from_secs(300);

/// What the engine reported of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

/// The end of a response body, scanned for its usage when it ends.
#[derive(Debug, Default)]
pub struct UsageScan {
    tail: VecDeque<u8>,
}

impl UsageScan {
    /// Adds the next bytes of the body.
    pub fn push(&mut self, bytes: &[u8]) {
        let keep = bytes.len().min(TAIL_BYTES);
        let overflow = (self.tail.len() + keep).saturating_sub(TAIL_BYTES);
        self.tail.drain(..overflow);
        self.tail.extend(&bytes[bytes.len() - keep..]);
    }

    /// The last usage in the body that reports cached tokens, and the `id`
    /// of the object it is in; `None` when there is none (an engine without
    /// `--enable-prompt-tokens-details`, a stream without
    /// `stream_options.include_usage`, or a usage beyond the tail).
    pub fn usage(&mut self) -> Option<(Usage, Option<String>)> {
        let tail = self.tail.make_contiguous();
        let at = find_last(tail, b"\"usage\"")?;
        let object = &tail[at + b"\"usage\"".len()..];
        let start = object.iter().position(|&b| b == b'{')?;
        // Typed, so reading it allocates nothing (a `Value` cost a few
        // allocations on every response).
        #[derive(serde::Deserialize)]
        struct Fields {
            prompt_tokens: u64,
            prompt_tokens_details: Option<Details>,
        }
        #[derive(serde::Deserialize)]
        struct Details {
            cached_tokens: Option<u64>,
        }
        let fields: Fields = serde_json::Deserializer::from_slice(&object[start..])
            .into_iter()
            .next()?
            .ok()?;
        let usage = Usage {
            prompt_tokens: fields.prompt_tokens,
            cached_tokens: fields.prompt_tokens_details?.cached_tokens?,
        };
        // The id of the object the usage is in: the last one before it.
        let id = find_last(&tail[..at], b"\"id\"").and_then(|i| {
            let rest = &tail[i + b"\"id\"".len()..];
            let open = rest.iter().position(|&b| b == b'"')?;
            let value = &rest[open + 1..];
            let close = value.iter().position(|&b| b == b'"')?;
            std::str::from_utf8(&value[..close]).ok().map(str::to_owned)
        });
        Some((usage, id))
    }
}

fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// One request in the window: what the router expected, what the engine
/// reported.
#[derive(Clone, Copy, Debug)]
struct Seen {
    expected_cached: u64,
    prompt_tokens: u64,
    usage: Usage,
}

impl Seen {
    /// Expected cached, prompt, observed cached, observed prompt.
    fn counts(&self) -> [u64; 4] {
        [
            self.expected_cached,
            self.prompt_tokens,
            self.usage.cached_tokens,
            self.usage.prompt_tokens,
        ]
    }
}

#[derive(Debug, Default)]
struct Window {
    seen: VecDeque<Seen>,
    /// [`Seen::counts`] summed over `seen`.
    sums: [u64; 4],
    /// An example of a request that saw less than expected.
    example: Option<String>,
    alerted: Option<Instant>,
}

impl Window {
    /// Adds `s`, dropping the oldest when the window is full.
    fn push(&mut self, s: Seen) {
        if self.seen.len() == WINDOW
            && let Some(old) = self.seen.pop_front()
        {
            for (sum, c) in self.sums.iter_mut().zip(old.counts()) {
                *sum -= c;
            }
        }
        for (sum, c) in self.sums.iter_mut().zip(s.counts()) {
            *sum += c;
        }
        self.seen.push_back(s);
    }

    /// Expected share minus observed share.
    fn gap(&self) -> f64 {
        let share = |cached: u64, total: u64| {
            if total == 0 {
                0.0
            } else {
                cached as f64 / total as f64
            }
        };
        let [expected, prompt, cached, observed_prompt] = self.sums;
        share(expected, prompt) - share(cached, observed_prompt)
    }
}

/// A sustained gap, to be logged.
#[derive(Clone, Debug, PartialEq)]
pub struct Alert {
    /// The model.
    pub model: String,
    /// Expected share − observed share over the window.
    pub gap: f64,
    /// Requests in the window.
    pub requests: usize,
    /// The response id of a request that saw less than expected.
    pub example: Option<String>,
}

/// Sliding windows per model (model labels are bounded, so are these).
#[derive(Debug, Default)]
pub struct Gap {
    windows: BTreeMap<String, Window>,
}

impl Gap {
    /// Records a request to `model` the router expected `expected_cached`
    /// of `prompt_tokens` cached for, and the engine's `usage`; `id` names
    /// the response. Returns the model's gap now, and an alert when it is
    /// sustained: a full enough window, at least [`ALERT_GAP`], not reported
    /// for `model` in the last [`ALERT_EVERY`].
    pub fn record(
        &mut self,
        model: &str,
        expected_cached: u64,
        prompt_tokens: u64,
        usage: Usage,
        id: Option<String>,
        now: Instant,
    ) -> (f64, Option<Alert>) {
        let w = self.windows.entry(model.to_owned()).or_default();
        w.push(Seen {
            expected_cached,
            prompt_tokens,
            usage,
        });
        if expected_cached > usage.cached_tokens && id.is_some() {
            w.example = id;
        }
        let gap = w.gap();
        let quiet = w
            .alerted
            .is_none_or(|t| now.duration_since(t) >= ALERT_EVERY);
        if w.seen.len() >= MIN_REQUESTS && gap >= ALERT_GAP && quiet {
            w.alerted = Some(now);
            let alert = Alert {
                model: model.to_owned(),
                gap,
                requests: w.seen.len(),
                example: w.example.clone(),
            };
            return (gap, Some(alert));
        }
        (gap, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&str]) -> Option<(Usage, Option<String>)> {
        let mut s = UsageScan::default();
        for c in chunks {
            s.push(c.as_bytes());
        }
        s.usage()
    }

    #[test]
    fn usage_is_read_from_bodies_and_streams_split_anywhere() {
        let body = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"text":"a \"usage\" word"}],"usage":{"prompt_tokens":40,"total_tokens":42,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}},"kv_transfer_params":null}"#;
        let want = Some((
            Usage {
                prompt_tokens: 40,
                cached_tokens: 32,
            },
            Some("cmpl-1".to_owned()),
        ));
        assert_eq!(scan(&[body]), want);
        for split in [1, 7, 100, body.len() - 3] {
            assert_eq!(
                scan(&[&body[..split], &body[split..]]),
                want,
                "split at {split}"
            );
        }
        let stream = "data: {\"id\":\"chatcmpl-9\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
             data: {\"id\":\"chatcmpl-9\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
             data: [DONE]\n\n";
        assert_eq!(
            scan(&[stream]),
            Some((
                Usage {
                    prompt_tokens: 20,
                    cached_tokens: 16
                },
                Some("chatcmpl-9".to_owned())
            ))
        );
    }

    #[test]
    fn no_usage_or_no_details_is_none_and_the_tail_is_bounded() {
        assert_eq!(scan(&["data: {\"usage\":null}\n\ndata: [DONE]\n\n"]), None);
        assert_eq!(
            scan(&[r#"{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}"#]),
            None
        );
        assert_eq!(scan(&["not json at all"]), None);
        let mut s = UsageScan::default();
        for _ in 0..1000 {
            s.push(&[b'x'; 100]);
        }
        assert_eq!(s.tail.len(), TAIL_BYTES);
        s.push(br#"{"id":"x","usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}"#);
        assert_eq!(s.usage().unwrap().0.prompt_tokens, 1);
    }

    #[test]
    fn a_sustained_gap_alerts_once_per_period() {
        let mut g = Gap::default();
        let t0 = Instant::now();
        let cold = Usage {
            prompt_tokens: 100,
            cached_tokens: 0,
        };
        let warm = Usage {
            prompt_tokens: 100,
            cached_tokens: 80,
        };
        // As expected: no gap, no alert, however long it runs.
        for i in 0..200 {
            let (gap, alert) = g.record("m", 80, 100, warm, None, t0);
            assert!(gap.abs() < 1e-9 && alert.is_none(), "{i}");
        }
        // Expected 80 %, observed 0: the window turns.
        let mut alerts = Vec::new();
        let mut last = 0.0;
        for i in 0..WINDOW {
            let id = Some(format!("r{i}"));
            let (gap, alert) = g.record("m", 80, 100, cold, id, t0);
            alerts.extend(alert);
            last = gap;
        }
        assert_eq!(alerts.len(), 1);
        let a = &alerts[0];
        assert!(a.gap >= ALERT_GAP && a.requests >= MIN_REQUESTS, "{a:?}");
        assert!(a.example.as_deref().unwrap().starts_with('r'));
        assert!((last - 0.8).abs() < 1e-9, "{last}");
        // Quiet until the period has passed.
        let half = t0 + ALERT_EVERY / 2;
        assert!(g.record("m", 80, 100, cold, None, half).1.is_none());
        let full = t0 + ALERT_EVERY;
        assert!(g.record("m", 80, 100, cold, None, full).1.is_some());
        // Another model has its own window.
        assert!(g.record("other", 80, 100, cold, None, t0).1.is_none());
    }
}
