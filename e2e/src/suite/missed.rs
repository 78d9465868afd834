//! Missed prompt tokens as the routers attribute them: read from each
//! router's `/metrics`, summed over the routers, subtracted from a read at
//! a phase's start, and turned into shares.
//!
//! A missed token is one the engine reported as not cached
//! (`usage.prompt_tokens − cached_tokens`). The routers count them by cause
//! in `kvroute_missed_prompt_tokens_total{model,tenant,cause}`, those of
//! [`CAUSES`]; the `routed_elsewhere` ones again by why the router went
//! elsewhere in `kvroute_routed_elsewhere_tokens_total{model,reason}`; and
//! the prompt tokens of responses that reported no usage in
//! `kvroute_unreported_prompt_tokens_total{model}`.
//!
//! Not here: what a scenario sends, or the goals it sets on the shares
//! (see [`super::missed_causes`] and [`super::scenarios`]).

use std::collections::BTreeMap;

use kvroute_telemetry::metrics::{Sample, parse_line};

use super::system::System;

/// The causes a router attributes missed tokens to.
pub const CAUSES: [&str; 8] = [
    "contract",
    "partial_block",
    "routed_elsewhere",
    "engine_shortfall",
    "evicted",
    "diverged",
    "cold",
    "unknown",
];

/// Why a router sent a request away from the endpoint holding the longest
/// prefix.
pub const REASONS: [&str; 6] = ["load", "queue", "health", "ejection", "subset", "retry"];

const MISSED: &str = "kvroute_missed_prompt_tokens_total";
const ELSEWHERE: &str = "kvroute_routed_elsewhere_tokens_total";
const UNREPORTED: &str = "kvroute_unreported_prompt_tokens_total";

/// The samples of metric `name` (its full name, `_total` included) in
/// Prometheus or OpenMetrics text. Lines that do not parse are skipped: a
/// scrape is read, not validated.
pub fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = Sample<'a>> {
    (text.lines().filter_map(parse_line)).filter(move |s| s.name == name)
}

/// The sum of metric `name`'s samples by the value of label `by`
/// (samples without it are left out).
fn sum_by(text: &str, name: &str, by: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for s in samples(text, name) {
        if let Some(key) = s.label(by) {
            *out.entry(key.to_owned()).or_insert(0.0) += s.value;
        }
    }
    out
}

/// The sum of every sample of metric `name`.
pub fn sum(text: &str, name: &str) -> f64 {
    samples(text, name).map(|s| s.value).sum()
}

/// Missed prompt tokens by cause, over every model and tenant: one
/// router's, or several routers' summed, or the difference of two reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Missed {
    /// Tokens by cause (a cause not named in [`CAUSES`] is kept too).
    pub by_cause: BTreeMap<String, f64>,
    /// `routed_elsewhere` tokens by reason.
    pub elsewhere_by_reason: BTreeMap<String, f64>,
    /// Prompt tokens of responses without usage: not attributed.
    pub unreported: f64,
    /// Attempts an engine refused for the router's admission bound (each
    /// decided again): how often the routers' view of a queue was wrong.
    pub refusals: f64,
}

impl Missed {
    /// What one router's `/metrics` text says.
    pub fn parse(text: &str) -> Missed {
        Missed {
            by_cause: sum_by(text, MISSED, "cause"),
            elsewhere_by_reason: sum_by(text, ELSEWHERE, "reason"),
            unreported: sum(text, UNREPORTED),
            refusals: sum(text, "kvroute_admission_refusals_total"),
        }
    }

    /// Every live router's, summed.
    pub async fn read(system: &System) -> anyhow::Result<Missed> {
        let mut total = Missed::default();
        for i in 0..system.router_addrs().len() {
            total = total.plus(&Missed::parse(&system.router_metrics(i).await?));
        }
        Ok(total)
    }

    /// `self` and `other` summed.
    pub fn plus(&self, other: &Missed) -> Missed {
        self.combine(other, 1.0)
    }

    /// What was counted since `start` (an earlier read of the same
    /// routers).
    pub fn since(&self, start: &Missed) -> Missed {
        self.combine(start, -1.0)
    }

    fn combine(&self, other: &Missed, sign: f64) -> Missed {
        let merge = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            let mut out = a.clone();
            for (k, v) in b {
                *out.entry(k.clone()).or_insert(0.0) += sign * v;
            }
            out
        };
        Missed {
            by_cause: merge(&self.by_cause, &other.by_cause),
            elsewhere_by_reason: merge(&self.elsewhere_by_reason, &other.elsewhere_by_reason),
            unreported: self.unreported + sign * other.unreported,
            refusals: self.refusals + sign * other.refusals,
        }
    }

    /// Missed tokens, every cause.
    pub fn total(&self) -> f64 {
        self.by_cause.values().sum()
    }

    /// Tokens attributed to `cause`.
    pub fn tokens(&self, cause: &str) -> f64 {
        self.by_cause.get(cause).copied().unwrap_or(0.0)
    }

    /// `cause`'s share of the missed tokens; 0 when none were missed.
    pub fn share(&self, cause: &str) -> f64 {
        ratio(self.tokens(cause), self.total())
    }

    /// `cause`'s share of the missed tokens other than `partial_block`
    /// (the tail below a full block, missed whatever the routing): the
    /// share a scenario that injects `cause` aims to get to 1. 0 when
    /// nothing else was missed.
    pub fn attributed(&self, cause: &str) -> f64 {
        ratio(
            self.tokens(cause),
            self.total() - self.tokens("partial_block"),
        )
    }

    /// Records `<prefix>missed_<cause>_share` for every cause,
    /// `<prefix>missed_tokens`, `<prefix>unreported_tokens`,
    /// `<prefix>admission_refusals` and
    /// `<prefix>routed_elsewhere_<reason>_tokens` for every reason.
    pub fn figures(&self, s: &mut super::report::Scenario, prefix: &str) {
        for cause in CAUSES {
            s.figure(&format!("{prefix}missed_{cause}_share"), self.share(cause));
        }
        s.figure(&format!("{prefix}missed_tokens"), self.total());
        s.figure(&format!("{prefix}unreported_tokens"), self.unreported);
        s.figure(&format!("{prefix}admission_refusals"), self.refusals);
        for reason in REASONS {
            let tokens = self.elsewhere_by_reason.get(reason).copied();
            s.figure(
                &format!("{prefix}routed_elsewhere_{reason}_tokens"),
                tokens.unwrap_or(0.0),
            );
        }
    }
}

fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 { part / whole } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# HELP kvroute_missed_prompt_tokens Missed prompt tokens, by cause.
# TYPE kvroute_missed_prompt_tokens counter
kvroute_missed_prompt_tokens_total{model="kvroute-sim",tenant="none",cause="cold"} 120
kvroute_missed_prompt_tokens_total{model="kvroute-sim",tenant="acme",cause="cold"} 30
kvroute_missed_prompt_tokens_total{model="kvroute-sim",tenant="none",cause="partial_block"} 50
kvroute_missed_prompt_tokens_total{model="kvroute-sim",tenant="none",cause="routed_elsewhere"} 100 # {trace_id="x"} 1
kvroute_missed_prompt_tokens_total_created{model="kvroute-sim",tenant="none",cause="cold"} 1.7e9
kvroute_routed_elsewhere_tokens_total{model="kvroute-sim",reason="load"} 80
kvroute_routed_elsewhere_tokens_total{model="kvroute-sim",reason="queue"} 20
kvroute_unreported_prompt_tokens_total{model="kvroute-sim"} 7
kvroute_routed_total 12
# EOF
"#;

    #[test]
    fn samples_read_labels_values_and_nothing_else() {
        let s: Vec<_> = samples(SCRAPE, "kvroute_missed_prompt_tokens_total").collect();
        assert_eq!(s.len(), 4, "the _created line is another metric");
        assert_eq!(s[0].label("cause"), Some("cold"));
        assert_eq!(s[1].label("tenant"), Some("acme"));
        assert_eq!(s[3].value, 100.0, "an exemplar after the value is ignored");
        assert_eq!(sum(SCRAPE, "kvroute_routed_total"), 12.0);
        assert_eq!(sum(SCRAPE, "kvroute_routed"), 0.0, "names match whole");
    }

    #[test]
    fn missed_tokens_sum_over_tenants_and_routers_and_subtract() {
        let one = Missed::parse(SCRAPE);
        assert_eq!(one.tokens("cold"), 150.0);
        assert_eq!(one.total(), 300.0);
        assert_eq!(one.elsewhere_by_reason["load"], 80.0);
        assert_eq!(one.unreported, 7.0);
        let two = one.plus(&one);
        assert_eq!((two.total(), two.unreported), (600.0, 14.0));
        let delta = two.since(&one);
        assert_eq!(delta, one);
        assert_eq!(Missed::parse("").total(), 0.0);
    }

    #[test]
    fn shares_and_the_attributed_share_leave_out_partial_blocks() {
        let m = Missed::parse(SCRAPE);
        assert_eq!(m.share("cold"), 0.5);
        assert_eq!(m.share("partial_block"), 50.0 / 300.0);
        assert_eq!(m.share("evicted"), 0.0);
        // 150 of the 250 not in partial blocks.
        assert_eq!(m.attributed("cold"), 0.6);
        assert_eq!(m.attributed("routed_elsewhere"), 0.4);
        let shares: f64 = CAUSES.iter().map(|c| m.share(c)).sum();
        assert!((shares - 1.0).abs() < 1e-12);
        // Nothing missed, or only partial blocks: no share, not NaN.
        assert_eq!(Missed::default().share("cold"), 0.0);
        let partial =
            Missed::parse("kvroute_missed_prompt_tokens_total{cause=\"partial_block\"} 9\n");
        assert_eq!(partial.attributed("cold"), 0.0);
    }
}
