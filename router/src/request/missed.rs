//! Where a request's missed prompt tokens went. The engine says how many
//! prompt tokens it found cached (`usage.prompt_tokens_details.cached_tokens`);
//! the rest were computed, and each of them is attributed to the first
//! cause that applies, in this order, from what the router knew when it
//! sent the request ([`Known`]):
//!
//! 1. `contract`: the chosen engine hashes differently (block size,
//!    algorithm, seed), so nothing it holds could be credited: all of them.
//! 2. `partial_block`: the prompt's tail past its last full block, and the
//!    last prompt token, which vLLM always computes (so a prompt of whole
//!    blocks has its last block computed).
//! 3. The full blocks of the rest, by position:
//!    - `engine_shortfall` up to what the chosen endpoint was known to hold
//!      (its engine's reports, or the policy's memory of a prefix in
//!      flight): it held them and reported fewer cached, evicted between
//!      decision and prefill, or hashing the router cannot see;
//!    - `routed_elsewhere` up to the longest prefix another endpoint held,
//!      with the reason it lost ([`Lost`]);
//!    - `evicted` up to the last leading block an engine held or evicted
//!      recently (the index's recently evicted set): capacity pressure;
//!    - then `cold`, first sight, except from the block where the prompt
//!      left a recent prompt of its tenant whose later contents recur
//!      ([`crate::prompt::prefixes`]): `diverged`.
//! 4. `unknown`, all full blocks, when the router did not read the prompt
//!    as the engine does: a policy that reads none, a body over
//!    `limits.maxTokenizeBytes`, approximate mode (no engine reports, and
//!    its own chunks are not the engine's tokens), or an engine that
//!    counted another number of prompt tokens than the router (a template
//!    or tokenizer it does not share).
//!
//! Per request the causes sum to the engine's `prompt_tokens −
//! cached_tokens`. Pure: [`attribute`] is arithmetic on a few positions,
//! and [`Pressure`] takes the clock as a parameter.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use crate::pool::Lost;

/// A cause of missed prompt tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    Contract,
    PartialBlock,
    RoutedElsewhere,
    EngineShortfall,
    Evicted,
    Diverged,
    Cold,
    Unknown,
}

impl Cause {
    /// Every cause, in the order they are tried.
    pub const ALL: [Cause; 8] = [
        Cause::Contract,
        Cause::PartialBlock,
        Cause::RoutedElsewhere,
        Cause::EngineShortfall,
        Cause::Evicted,
        Cause::Diverged,
        Cause::Cold,
        Cause::Unknown,
    ];

    /// The cause as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Contract => "contract",
            Cause::PartialBlock => "partial_block",
            Cause::RoutedElsewhere => "routed_elsewhere",
            Cause::EngineShortfall => "engine_shortfall",
            Cause::Evicted => "evicted",
            Cause::Diverged => "diverged",
            Cause::Cold => "cold",
            Cause::Unknown => "unknown",
        }
    }
}

/// What the router knew of a request at the endpoint it was sent to,
/// positions in prompt tokens from its start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Known {
    /// Tokens per block.
    pub block_tokens: u64,
    /// Prompt tokens as the router counted them like the engine; `None`
    /// when it did not.
    pub prompt_tokens: Option<u64>,
    /// The chosen engine hashes differently.
    pub contract: bool,
    /// The prefix the chosen endpoint was known to hold.
    pub held: u64,
    /// The longest prefix another endpoint held, and why it lost.
    pub elsewhere: Option<(u64, Lost)>,
    /// The leading tokens whose blocks an engine held or evicted recently.
    pub recent: u64,
    /// Where the prompt left a recent prompt whose later contents recur.
    pub diverged: Option<u64>,
}

/// Missed tokens by [`Cause`] (in [`Cause::ALL`] order), and why the
/// `routed_elsewhere` ones went elsewhere.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub tokens: [u64; 8],
    pub lost: Option<Lost>,
}

impl Split {
    /// Tokens of `cause`.
    pub fn of(&self, cause: Cause) -> u64 {
        self.tokens[cause as usize]
    }

    /// All missed tokens.
    pub fn total(&self) -> u64 {
        self.tokens.iter().sum()
    }

    /// The causes with tokens, largest first.
    pub fn causes(&self) -> Vec<(Cause, u64)> {
        let mut v: Vec<_> = (Cause::ALL.iter().copied())
            .map(|c| (c, self.of(c)))
            .filter(|&(_, n)| n > 0)
            .collect();
        v.sort_by_key(|c| std::cmp::Reverse(c.1));
        v
    }

    fn add(&mut self, cause: Cause, tokens: u64) {
        self.tokens[cause as usize] += tokens;
    }
}

/// Attributes the `prompt_tokens − cached_tokens` missed tokens of a
/// request the engine counted `prompt_tokens` with `cached_tokens` cached
/// (see the module docs).
pub fn attribute(k: &Known, prompt_tokens: u64, cached_tokens: u64) -> Split {
    let mut split = Split::default();
    let (p, c) = (prompt_tokens, cached_tokens.min(prompt_tokens));
    if p == c {
        return split;
    }
    if k.contract {
        split.add(Cause::Contract, p - c);
        return split;
    }
    let bs = k.block_tokens.max(1);
    let full = (p - 1) / bs * bs;
    split.add(Cause::PartialBlock, p - c.max(full));
    if c >= full {
        return split;
    }
    if k.prompt_tokens != Some(p) {
        split.add(Cause::Unknown, full - c);
        return split;
    }
    // Consecutive ranges, each up to its end (clipped to [c, full]).
    let mut at = c;
    for (cause, end) in [
        (Cause::EngineShortfall, k.held),
        (Cause::RoutedElsewhere, k.elsewhere.map_or(0, |e| e.0)),
        (Cause::Evicted, k.recent),
        (Cause::Cold, k.diverged.unwrap_or(full)),
        (Cause::Diverged, full),
    ] {
        let end = end.clamp(at, full);
        if cause == Cause::RoutedElsewhere && end > at {
            split.lost = k.elsewhere.map(|e| e.1);
        }
        split.add(cause, end - at);
        at = end;
    }
    split
}

/// How long [`Pressure`] looks back.
pub const PRESSURE_WINDOW: Duration = Duration::from_secs(60);
/// Its buckets.
const PRESSURE_BUCKETS: u32 = 6;

/// The `evicted` share of prompt tokens over the last
/// [`PRESSURE_WINDOW`]: the pool's cache-capacity pressure. Buckets of a
/// sixth of the window; the current one counts whole.
#[derive(Debug, Default)]
pub struct Pressure {
    /// (bucket start, evicted tokens, prompt tokens), oldest first.
    buckets: VecDeque<(Instant, u64, u64)>,
}

impl Pressure {
    /// A request of `prompt_tokens` with `evicted` of them missed as
    /// evicted, at `now`.
    pub fn record(&mut self, now: Instant, evicted: u64, prompt_tokens: u64) {
        self.expire(now);
        match self.buckets.back_mut() {
            Some((start, e, p)) if now < *start + PRESSURE_WINDOW / PRESSURE_BUCKETS => {
                *e += evicted;
                *p += prompt_tokens;
            }
            _ => self.buckets.push_back((now, evicted, prompt_tokens)),
        }
    }

    /// The share at `now`: 0 without traffic.
    pub fn share(&mut self, now: Instant) -> f64 {
        self.expire(now);
        let (e, p) = (self.buckets.iter()).fold((0, 0), |(e, p), b| (e + b.1, p + b.2));
        if p == 0 { 0.0 } else { e as f64 / p as f64 }
    }

    fn expire(&mut self, now: Instant) {
        while self
            .buckets
            .front()
            .is_some_and(|b| now.saturating_duration_since(b.0) >= PRESSURE_WINDOW)
        {
            self.buckets.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 16-token blocks, a 160-token prompt the router read as the engine.
    fn known() -> Known {
        Known {
            block_tokens: 16,
            prompt_tokens: Some(160),
            ..Known::default()
        }
    }

    fn split(k: &Known, p: u64, c: u64) -> Vec<(&'static str, u64)> {
        let s = attribute(k, p, c);
        assert_eq!(
            s.total(),
            p - c.min(p),
            "the causes sum to the missed tokens"
        );
        Cause::ALL
            .iter()
            .filter(|&&c| s.of(c) > 0)
            .map(|&c| (c.as_str(), s.of(c)))
            .collect()
    }

    #[test]
    fn a_prompt_never_seen_is_cold_but_its_last_block() {
        // 160 tokens: blocks 0..9 are full, but the last token is always
        // computed, so block 9 is the partial one.
        assert_eq!(
            split(&known(), 160, 0),
            [("partial_block", 16), ("cold", 144)]
        );
        assert_eq!(
            split(&known(), 150, 0)[..1],
            [("partial_block", 6)],
            "150 tokens: 9 full blocks, 6 past them"
        );
    }

    #[test]
    fn every_cause_in_its_range_in_order() {
        let k = Known {
            held: 32,
            elsewhere: Some((64, Lost::Load)),
            recent: 96,
            diverged: Some(128),
            ..known()
        };
        // The engine found 16 cached where 32 were held.
        assert_eq!(
            split(&k, 160, 16),
            [
                ("partial_block", 16),
                ("routed_elsewhere", 32),
                ("engine_shortfall", 16),
                ("evicted", 32),
                ("diverged", 16),
                ("cold", 32),
            ]
        );
        assert_eq!(attribute(&k, 160, 16).lost, Some(Lost::Load));
    }

    #[test]
    fn more_cached_than_expected_starts_the_ranges_later() {
        let k = Known {
            elsewhere: Some((64, Lost::Queue)),
            recent: 96,
            ..known()
        };
        assert_eq!(
            split(&k, 160, 80),
            [("partial_block", 16), ("evicted", 16), ("cold", 48)]
        );
        assert_eq!(attribute(&k, 160, 80).lost, None);
    }

    #[test]
    fn a_foreign_contract_takes_everything() {
        let k = Known {
            contract: true,
            ..known()
        };
        assert_eq!(split(&k, 160, 32), [("contract", 128)]);
    }

    #[test]
    fn unknown_when_the_router_counted_otherwise_or_did_not_read() {
        assert_eq!(
            split(&known(), 170, 0),
            [("partial_block", 10), ("unknown", 160)]
        );
        let unread = Known {
            prompt_tokens: None,
            ..known()
        };
        assert_eq!(
            split(&unread, 160, 0),
            [("partial_block", 16), ("unknown", 144)]
        );
    }

    #[test]
    fn nothing_missed_nothing_attributed() {
        assert_eq!(split(&known(), 160, 160), []);
        assert_eq!(split(&known(), 0, 0), []);
        assert_eq!(split(&known(), 10, 50), [], "more cached than prompt");
        assert_eq!(split(&known(), 160, 144), [("partial_block", 16)]);
    }

    #[test]
    fn pressure_is_the_evicted_share_over_the_window() {
        let t0 = Instant::now();
        let mut p = Pressure::default();
        assert_eq!(p.share(t0), 0.0);
        p.record(t0, 50, 100);
        p.record(t0 + Duration::from_secs(30), 0, 100);
        assert_eq!(p.share(t0 + Duration::from_secs(30)), 0.25);
        // The first bucket leaves the window.
        assert_eq!(p.share(t0 + Duration::from_secs(61)), 0.0);
        assert_eq!(p.share(t0 + Duration::from_secs(100)), 0.0);
    }
}
