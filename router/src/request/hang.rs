//! When an attempt counts as hung: the deadline for an engine's first
//! response byte, per request and endpoint. Pure: the caller passes the
//! predicted time to first token and enforces the deadline.
//!
//! The rule (`resilience.hungAfterMs`, `hungTtftMultiple`, `hungMsPerToken`):
//! 1. A streamed response's first byte is due within
//!    max(`hungAfterMs`, `hungTtftMultiple` × the predicted time to first
//!    token at the endpoint): a floor no healthy engine misses, and room
//!    for an engine the router itself expects to be slow (a long prefill,
//!    a deep queue).
//! 2. A non-streamed response comes whole, after its last token: its
//!    deadline adds `hungMsPerToken` × the `max_tokens` it asked for. One
//!    that sets no `max_tokens` may legitimately run as long as the
//!    context allows, so it has no hang deadline.
//! 3. `limits.firstByteTimeoutMs` caps every deadline.
//!
//! The proxy cancels an attempt that misses it, counts a `timeout` fault
//! ([`crate::pool::outliers`] rule 5) and retries on the next endpoint, as no byte
//! has reached the client.

use std::time::Duration;

use crate::config::{Limits, Resilience};

/// The settings. See the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct Deadline {
    floor: Duration,
    multiple: f64,
    per_token: Duration,
    cap: Duration,
}

impl Deadline {
    /// From the validated configuration.
    pub fn new(resilience: &Resilience, limits: &Limits) -> Self {
        Deadline {
            floor: Duration::from_millis(resilience.hung_after_ms),
            multiple: resilience.hung_ttft_multiple,
            per_token: Duration::from_millis(resilience.hung_ms_per_token),
            cap: Duration::from_millis(limits.first_byte_timeout_ms),
        }
    }

    /// The deadline for the first byte of a request (streamed or not, with
    /// at most `max_tokens` output tokens) predicted to see its first token
    /// after `ttft`; `None` when it has none but the cap (rule 2).
    pub fn of(&self, stream: bool, max_tokens: Option<u64>, ttft: Duration) -> Option<Duration> {
        let decode = if stream {
            Duration::ZERO
        } else {
            let tokens = u32::try_from(max_tokens?).unwrap_or(u32::MAX);
            self.per_token.saturating_mul(tokens)
        };
        let scaled = Duration::try_from_secs_f64(ttft.as_secs_f64() * self.multiple)
            .unwrap_or(Duration::MAX);
        let due = self.floor.max(scaled).saturating_add(decode);
        (due < self.cap).then_some(due)
    }

    /// The cap: `limits.firstByteTimeoutMs`.
    pub fn cap(&self) -> Duration {
        self.cap
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn deadline() -> Deadline {
        Deadline::new(&Resilience::default(), &Limits::default())
    }

    #[test]
    fn the_floor_holds_for_fast_engines_and_slow_ones_get_a_multiple() {
        let d = deadline();
        assert_eq!(d.of(true, None, S / 10), Some(10 * S));
        assert_eq!(
            d.of(true, Some(4096), 20 * S),
            Some(80 * S),
            "a long prefill predicted at 20 s is not cut at the floor"
        );
    }

    #[test]
    fn whole_responses_get_time_for_their_tokens_or_no_deadline() {
        let d = deadline();
        assert_eq!(d.of(false, Some(16), S), Some(10 * S + 16 * S / 10));
        assert_eq!(d.of(false, None, S), None, "no max_tokens: no bound");
    }

    #[test]
    fn the_first_byte_timeout_caps_it() {
        let d = deadline();
        assert_eq!(d.cap(), 300 * S);
        assert_eq!(d.of(true, None, 100 * S), None);
        assert_eq!(d.of(false, Some(u64::MAX), S), None);
        assert_eq!(d.of(true, None, Duration::MAX), None);
    }
}
