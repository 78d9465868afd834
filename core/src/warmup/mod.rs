//! Warm-ups: each named prefix sent as a one-token request to its owners
//! once a period, so that other traffic does not evict it. The rules, pure,
//! with the clock passed in as wall-clock milliseconds: the routers of a
//! pool agree on periods by the wall clock, not by when each started.
//!
//! 1. **Periods.** A prefix's warm-up is due once per period of `every`, at
//!    its own offset into the period ([`offset_ms`]: its name's hash), so
//!    the prefixes spread over the period and every router agrees on when
//!    each falls due, without talking to the others.
//! 2. **Skips**, per owner, in this order ([`Schedule::decide`]):
//!    `skipped_busy` (the owner's queue is above the policy's slack: a
//!    warm-up would delay requests), `skipped_resident` (the owner holds
//!    the prefix by its engine's reports and a request with it went there
//!    within the last half period, which touched it: the prefix then goes
//!    at most 1.5 periods unused before the next warm-up, where a touch
//!    any time in the period would let it go two), `skipped_budget` (with this
//!    one's expected cost, warm-ups' prefill over the last
//!    [`BUDGET_WINDOW`] would be above `maxShareOfPrefill` of all prefill
//!    in it). A prefix's first warm-up is always sent and not counted
//!    against the budget: it is the cost of adding the prefix, and would
//!    otherwise starve the cheap warm-ups of a resident prefix (one block
//!    each) until other traffic had prefilled twenty times as much.
//! 3. **Outcome** of one sent ([`outcome`]): `sent` when the engine found
//!    the prefix cached, `repaired` when it did not (evicted within the
//!    period: `every` is longer than the time other traffic takes to cycle
//!    the owner's free blocks), `failed` on an error.
//! 4. **One sender.** When the routers of a pool are known (the operator
//!    sends their names), the warm-ups of a prefix to one owner are sent by
//!    one of them only: the first in the rendezvous order of (prefix,
//!    owner) over the routers' names ([`sender`]). Every router computes the
//!    same from the same names, so the pool sends one warm-up per prefix,
//!    owner and period whatever the number of routers; a router that is not
//!    among the names sends none, and with no names each sends its own.

use std::collections::VecDeque;
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use crate::rendezvous;

mod config;

pub use config::{ConfigMapRef, Invalid, MAX_NAME_BYTES, MAX_PREFIXES, Prefix, Warmup};

/// How far back the budget looks.
pub const BUDGET_WINDOW: Duration = Duration::from_secs(600);
/// Its buckets.
const BUDGET_BUCKETS: u64 = 10;

/// Where in each period of `every_ms` the prefix `name` falls due.
pub fn offset_ms(name: &str, every_ms: u64) -> u64 {
    xxh3_64(name.as_bytes()) % every_ms.max(1)
}

/// The period of `every_ms` that `now_ms` falls in for the prefix `name`:
/// each begins at its offset ([`offset_ms`]).
pub fn period(name: &str, every_ms: u64, now_ms: u64) -> u64 {
    let every = every_ms.max(1);
    (now_ms + every - offset_ms(name, every)) / every
}

/// When the period after the one `now_ms` falls in begins, for the prefix
/// `name`.
pub fn next_due_ms(name: &str, every_ms: u64, now_ms: u64) -> u64 {
    let every = every_ms.max(1);
    period(name, every, now_ms) * every + offset_ms(name, every)
}

/// Which of a pool's `routers` sends the warm-ups of the prefix `name` to
/// `owner` (rule 4): `None` when no router is named.
pub fn sender<'a>(routers: &'a [String], name: &str, owner: &str) -> Option<&'a str> {
    let key = xxh3_64(format!("{name}\0{owner}").as_bytes());
    let score = |r: &&String| rendezvous::score(key, rendezvous::endpoint_id(r));
    routers.iter().max_by_key(score).map(String::as_str)
}

/// What the router knows of an owner when a warm-up falls due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    /// Its queue is above the policy's slack.
    pub busy: bool,
    /// Its engine reports the prefix's blocks.
    pub holds: bool,
    /// When a request starting with the prefix last went there.
    pub touched_ms: Option<u64>,
}

/// Whether to send a warm-up to an owner, or why not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Send,
    SkippedBusy,
    SkippedResident,
    SkippedBudget,
}

/// What a sent warm-up found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The prefix was cached: it was kept warm.
    Sent,
    /// It was not: it had been evicted and is cached again.
    Repaired,
    /// The engine refused it, or it did not answer.
    Failed,
}

impl Verdict {
    /// A skip as `kvroute_warmups_total`'s `result`; `None` to send.
    pub fn skipped(self) -> Option<&'static str> {
        match self {
            Verdict::Send => None,
            Verdict::SkippedBusy => Some("skipped_busy"),
            Verdict::SkippedResident => Some("skipped_resident"),
            Verdict::SkippedBudget => Some("skipped_budget"),
        }
    }
}

impl Outcome {
    /// The outcome as `kvroute_warmups_total`'s `result`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Sent => "sent",
            Outcome::Repaired => "repaired",
            Outcome::Failed => "failed",
        }
    }
}

/// What a warm-up of a `prompt_tokens` prompt with `cached_tokens` cached
/// found, with blocks of `block_tokens`: the prefix was resident when the
/// engine found every full block it caches of such a prompt (all but the
/// last token's block: vLLM always computes the last token).
pub fn outcome(prompt_tokens: u64, cached_tokens: u64, block_tokens: u64) -> Outcome {
    let bs = block_tokens.max(1);
    let cacheable = prompt_tokens.saturating_sub(1) / bs * bs;
    if cached_tokens >= cacheable {
        Outcome::Sent
    } else {
        Outcome::Repaired
    }
}

#[derive(Debug)]
struct Due {
    name: String,
    /// The last period its warm-ups were handled in.
    handled: Option<u64>,
    /// Whether a warm-up of it was ever sent.
    sent: bool,
}

/// The warm-ups of a set of named prefixes: when each falls due, whether
/// each owner gets one, and the budget. See the module docs.
#[derive(Debug)]
pub struct Schedule {
    every_ms: u64,
    max_share: f64,
    prefixes: Vec<Due>,
    /// (bucket start, warm-up prefill tokens, all prefill tokens), oldest
    /// first.
    budget: VecDeque<(u64, u64, u64)>,
}

impl Schedule {
    /// The prefixes `names`, each warmed once per `every`, warm-ups taking
    /// at most `max_share` of the prefill.
    pub fn new(names: impl IntoIterator<Item = String>, every: Duration, max_share: f64) -> Self {
        Schedule {
            every_ms: (every.as_millis() as u64).max(1),
            max_share,
            prefixes: (names.into_iter())
                .map(|name| Due {
                    name,
                    handled: None,
                    sent: false,
                })
                .collect(),
            budget: VecDeque::new(),
        }
    }

    /// The prefix at `i`'s name.
    pub fn name(&self, i: usize) -> &str {
        &self.prefixes[i].name
    }

    /// The prefixes whose warm-ups fall due at `now_ms`: those not yet
    /// handled in the period it falls in, now marked handled. A prefix
    /// falls due at once when the schedule starts.
    pub fn due(&mut self, now_ms: u64) -> Vec<usize> {
        let every = self.every_ms;
        let mut due = Vec::new();
        for (i, p) in self.prefixes.iter_mut().enumerate() {
            let now = period(&p.name, every, now_ms);
            if p.handled.is_none_or(|h| h < now) {
                p.handled = Some(now);
                due.push(i);
            }
        }
        due
    }

    /// When the next warm-up falls due after `now_ms`.
    pub fn next_due_ms(&self, now_ms: u64) -> Option<u64> {
        (self.prefixes.iter())
            .map(|p| next_due_ms(&p.name, self.every_ms, now_ms))
            .min()
    }

    /// Whether the prefix at `i` is warmed on `owner` at `now_ms`, at an
    /// expected `cost` in prefilled tokens (rule 2).
    pub fn decide(&mut self, i: usize, owner: Owner, now_ms: u64, cost: u64) -> Verdict {
        if owner.busy {
            return Verdict::SkippedBusy;
        }
        let touched = |t: u64| now_ms.saturating_sub(t) < self.every_ms / 2;
        if owner.holds && owner.touched_ms.is_some_and(touched) {
            return Verdict::SkippedResident;
        }
        if self.prefixes[i].sent && !self.within_budget(now_ms, cost) {
            return Verdict::SkippedBudget;
        }
        Verdict::Send
    }

    /// Whether warm-ups' prefill over the window, with `cost` more, is
    /// within its share.
    fn within_budget(&mut self, now_ms: u64, cost: u64) -> bool {
        self.expire(now_ms);
        let (warm, all) = (self.budget.iter()).fold((0, 0), |(w, a), b| (w + b.1, a + b.2));
        (warm + cost) as f64 <= self.max_share * (all + cost) as f64
    }

    /// Requests prefilled `tokens` uncached prompt tokens at `now_ms`.
    pub fn prefilled(&mut self, now_ms: u64, tokens: u64) {
        self.record(now_ms, 0, tokens);
    }

    /// A warm-up of the prefix at `i` was sent at `now_ms` and prefilled
    /// `tokens`: counted in all prefill, and against the budget but the
    /// prefix's first.
    pub fn warmed(&mut self, i: usize, now_ms: u64, tokens: u64) {
        let first = !std::mem::replace(&mut self.prefixes[i].sent, true);
        self.record(now_ms, if first { 0 } else { tokens }, tokens);
    }

    fn record(&mut self, now_ms: u64, warm: u64, all: u64) {
        self.expire(now_ms);
        let bucket = BUDGET_WINDOW.as_millis() as u64 / BUDGET_BUCKETS;
        match self.budget.back_mut() {
            Some((start, w, a)) if now_ms < *start + bucket => {
                *w += warm;
                *a += all;
            }
            _ => self.budget.push_back((now_ms, warm, all)),
        }
    }

    fn expire(&mut self, now_ms: u64) {
        let window = BUDGET_WINDOW.as_millis() as u64;
        while (self.budget.front()).is_some_and(|b| now_ms.saturating_sub(b.0) >= window) {
            self.budget.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: u64 = 240_000;

    #[test]
    fn one_router_sends_each_prefix_to_each_owner_whatever_their_order() {
        let routers: Vec<String> = (0..3).map(|i| format!("router-{i}")).collect();
        let mut reversed = routers.clone();
        reversed.reverse();
        let mut by = std::collections::BTreeMap::new();
        for owner in 0..40 {
            let owner = format!("engine-{owner}:8000");
            let one = sender(&routers, "support-v3", &owner).unwrap();
            assert_eq!(Some(one), sender(&reversed, "support-v3", &owner));
            *by.entry(one).or_insert(0) += 1;
        }
        assert_eq!(by.len(), 3, "owners spread over the routers: {by:?}");
        assert_eq!(sender(&[], "support-v3", "engine-0:8000"), None);
    }

    #[test]
    fn a_prefix_falls_due_once_a_period_at_its_own_offset() {
        let offset = offset_ms("support-v3", EVERY);
        assert!(offset < EVERY);
        assert_ne!(offset, offset_ms("support-v4", EVERY), "prefixes spread");
        let start = 10 * EVERY + offset;
        assert_eq!(
            period("support-v3", EVERY, start - 1) + 1,
            period("support-v3", EVERY, start)
        );
        assert_eq!(next_due_ms("support-v3", EVERY, start - 1), start);
        assert_eq!(next_due_ms("support-v3", EVERY, start), start + EVERY);

        let mut s = Schedule::new(
            ["support-v3".to_owned()],
            Duration::from_millis(EVERY),
            0.02,
        );
        let t0 = start + 1000;
        assert_eq!(s.due(t0), [0], "due at once when the schedule starts");
        assert!(s.due(t0 + 1).is_empty());
        assert_eq!(s.next_due_ms(t0), Some(start + EVERY));
        assert!(s.due(start + EVERY - 1).is_empty());
        assert_eq!(s.due(start + EVERY), [0]);
        // A router that was down for three periods sends once, not three
        // times.
        assert_eq!(s.due(start + 4 * EVERY + 5), [0]);
        assert!(s.due(start + 4 * EVERY + 6).is_empty());
    }

    #[test]
    fn skips_busy_then_resident_then_over_budget() {
        let mut s = Schedule::new(["p".to_owned()], Duration::from_millis(EVERY), 0.1);
        let t = 1_000_000;
        let busy = Owner {
            busy: true,
            holds: true,
            touched_ms: Some(t),
        };
        assert_eq!(s.decide(0, busy, t, 16), Verdict::SkippedBusy);
        let resident = Owner {
            holds: true,
            touched_ms: Some(t - EVERY / 2 + 1),
            ..Owner::default()
        };
        assert_eq!(s.decide(0, resident, t, 16), Verdict::SkippedResident);
        let untouched = Owner {
            touched_ms: Some(t - EVERY / 2),
            ..resident
        };
        // The first warm-up goes whatever the budget, and is not counted
        // against it.
        s.prefilled(t, 100);
        assert_eq!(s.decide(0, untouched, t, 1500), Verdict::Send);
        s.warmed(0, t, 1500);
        // A resident prefix's warm-up costs a block: 16 of 1,616.
        assert_eq!(s.decide(0, untouched, t, 16), Verdict::Send);
        s.warmed(0, t, 16);
        // An evicted one's would cost it whole: 1,516 of 3,116.
        assert_eq!(
            s.decide(0, Owner::default(), t, 1500),
            Verdict::SkippedBudget
        );
        s.prefilled(t + 1000, 13_400);
        assert_eq!(s.decide(0, Owner::default(), t + 1000, 1500), Verdict::Send);
        s.warmed(0, t + 1000, 1500);
        // The window forgets: only the later traffic is left.
        s.prefilled(t + 60_000, 1000);
        s.warmed(0, t + 60_000, 1500);
        assert_eq!(
            s.decide(0, Owner::default(), t + 600_000, 16),
            Verdict::SkippedBudget
        );
        assert_eq!(s.decide(0, Owner::default(), t + 660_000, 0), Verdict::Send);
    }

    #[test]
    fn a_warm_up_that_found_its_prefix_evicted_repaired_it() {
        // 1,500 tokens in blocks of 16: 93 full blocks, the last token's
        // block computed anyway.
        assert_eq!(outcome(1500, 1488, 16), Outcome::Sent);
        assert_eq!(outcome(1504, 1488, 16), Outcome::Sent);
        assert_eq!(outcome(1500, 1472, 16), Outcome::Repaired);
        assert_eq!(outcome(1500, 0, 16), Outcome::Repaired);
        assert_eq!(outcome(1, 0, 16), Outcome::Sent, "nothing to cache");
    }
}
