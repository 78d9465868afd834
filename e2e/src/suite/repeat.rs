//! `report --repeat N`: one scenario run N times, summed up as one.
//!
//! 1. **Figures.** Each keeps its name and holds the median of the runs'
//!    values (robust to one odd run; with one run, that run's value).
//!    With two runs or more, `<figure>_mean` is their mean and
//!    `<figure>_ci95` the half-width of its 95 % confidence interval by
//!    Student's t (`mean ± ci95`), which stays honest for a handful of
//!    runs where the normal 1.96 would be too narrow. A run that did not
//!    measure a figure (NaN, or an error before it) does not count.
//! 2. **Checks and goals** are matched by position: one passes only when
//!    it held in every run that reached it, and says in how many it held.
//!    Its text is the first failing run's (with that run's values), else
//!    the first run's.
//! 3. **Interval goals** ([`IntervalGoal`]) are judged here, after the
//!    figures: met when the mean of the figure over the runs is not below
//!    the lower end of the reference figure's 95 % interval
//!    (`mean − ci95`); added to the goals with both values. One run has no
//!    interval: it says so in a note, with its two values.
//! 4. **The scenario** passes when every run passed; errors and notes
//!    are kept, each error with its run's number; the plot is the first
//!    run's. Every run's own result stays in `runs`.
//!
//! Not here: running anything (the caller runs the scenarios).

use std::collections::BTreeMap;

use super::report::{Check, IntervalGoal, Scenario};

/// Median, mean and 95 % interval of some runs' values of one figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// The middle value (of an even count, the mean of the middle two).
    pub median: f64,
    /// The mean.
    pub mean: f64,
    /// Half-width of the 95 % confidence interval of the mean, by
    /// Student's t with n − 1 degrees of freedom; NaN for one value.
    pub ci95: f64,
}

/// The [`Summary`] of `values`' finite values; `None` when there is none.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    let mean = v.iter().sum::<f64>() / n as f64;
    let ci95 = if n < 2 {
        f64::NAN
    } else {
        let variance = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        t975(n - 1) * (variance / n as f64).sqrt()
    };
    Some(Summary { median, mean, ci95 })
}

/// The 0.975 quantile of Student's t with `df` (≥ 1) degrees of freedom:
/// tabulated to 30, then by its expansion around the normal's 1.960
/// (within 0.001 of the exact value beyond 30).
fn t975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::NAN,
        1..=30 => TABLE[df - 1],
        _ => {
            let (z, d): (f64, f64) = (1.959_964, df as f64);
            z + (z.powi(3) + z) / (4.0 * d)
                + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * d * d)
        }
    }
}

/// One scenario from its `runs` (at least one), by the rules in the
/// module docs. One run is returned as it is.
pub fn combine(mut runs: Vec<Scenario>) -> Scenario {
    assert!(!runs.is_empty(), "a scenario runs at least once");
    if runs.len() == 1 {
        let mut run = runs.pop().expect("one run");
        for g in run.interval_goals.clone() {
            let value = |name: &str| run.figures.get(name).copied().unwrap_or(f64::NAN);
            let note = format!(
                "goal {}: judged under --repeat 2 or more (one run has no interval); {} {:.3}, {} {:.3}",
                g.what,
                g.figure,
                value(&g.figure),
                g.reference,
                value(&g.reference)
            );
            run.notes.push(note);
        }
        return run;
    }
    let first = &runs[0];
    let mut names: Vec<&String> = runs.iter().flat_map(|r| r.figures.keys()).collect();
    names.sort();
    names.dedup();
    let mut figures = BTreeMap::new();
    for name in names {
        let values: Vec<f64> = runs
            .iter()
            .map(|r| r.figures.get(name).copied().unwrap_or(f64::NAN))
            .collect();
        let Some(s) = summarize(&values) else {
            figures.insert(name.clone(), f64::NAN);
            continue;
        };
        figures.insert(name.clone(), s.median);
        figures.insert(format!("{name}_mean"), s.mean);
        figures.insert(format!("{name}_ci95"), s.ci95);
    }
    let numbered = |text: &dyn Fn(&Scenario) -> Vec<String>| -> Vec<String> {
        runs.iter()
            .enumerate()
            .flat_map(|(k, r)| {
                text(r)
                    .into_iter()
                    .map(move |t| format!("run {}: {t}", k + 1))
            })
            .collect()
    };
    let errors = numbered(&|r| r.error.iter().cloned().collect());
    let mut notes = first.notes.clone();
    for n in runs.iter().skip(1).flat_map(|r| &r.notes) {
        if !notes.contains(n) {
            notes.push(n.clone());
        }
    }
    let skipped = runs.iter().all(|r| r.skipped.is_some());
    let mut goals = merge_checks(&runs, |r| &r.goals);
    goals.extend(
        first
            .interval_goals
            .iter()
            .map(|g| judge(g, &figures, runs.len())),
    );
    Scenario {
        name: first.name.clone(),
        passed: runs.iter().all(|r| r.passed),
        figures,
        checks: merge_checks(&runs, |r| &r.checks),
        goals,
        interval_goals: first.interval_goals.clone(),
        notes,
        text: first.text.clone(),
        error: (!errors.is_empty()).then(|| errors.join("; ")),
        skipped: if skipped { first.skipped.clone() } else { None },
        plot: first.plot.clone(),
        runs,
    }
}

/// Interval goal `g` on the combined `figures` of `n` runs (rule 3).
fn judge(g: &IntervalGoal, figures: &BTreeMap<String, f64>, n: usize) -> Check {
    let get = |name: &str| figures.get(name).copied().unwrap_or(f64::NAN);
    let mean = get(&format!("{}_mean", g.figure));
    let (reference, ci95) = (
        get(&format!("{}_mean", g.reference)),
        get(&format!("{}_ci95", g.reference)),
    );
    Check {
        what: format!(
            "{}: {} {mean:.3} vs {} {reference:.3} ± {ci95:.3} (means of {n} runs)",
            g.what, g.figure, g.reference
        ),
        passed: mean >= reference - ci95,
    }
}

/// Checks (or goals) matched by position across `runs`.
fn merge_checks(runs: &[Scenario], of: impl Fn(&Scenario) -> &Vec<Check>) -> Vec<Check> {
    let most = runs.iter().map(|r| of(r).len()).max().unwrap_or(0);
    (0..most)
        .map(|i| {
            let these: Vec<&Check> = runs.iter().filter_map(|r| of(r).get(i)).collect();
            let held = these.iter().filter(|c| c.passed).count();
            let shown = these.iter().find(|c| !c.passed).unwrap_or(&these[0]);
            Check {
                what: format!("{} [held in {held} of {} runs]", shown.what, these.len()),
                passed: held == these.len(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-3
    }

    #[test]
    fn a_summary_is_the_median_the_mean_and_a_students_t_interval() {
        // 3 values: mean 0.2, sample sd 0.02, t(2) = 4.303:
        // 4.303 × 0.02 / √3 = 0.0497.
        let s = summarize(&[0.18, 0.22, 0.20]).unwrap();
        assert_eq!(s.median, 0.20);
        assert!(close(s.mean, 0.20));
        assert!(close(s.ci95, 0.0497), "{s:?}");
        // An even count: the middle two's mean; NaN is not a value.
        let s = summarize(&[4.0, f64::NAN, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.median, s.mean), (2.5, 2.5));
        // sd 1.291, t(3) = 3.182: 3.182 × 1.291 / 2 = 2.054.
        assert!(close(s.ci95, 2.054), "{s:?}");
        // Equal runs: no spread.
        assert_eq!(summarize(&[7.0, 7.0]).unwrap().ci95, 0.0);
        // One value: no interval; none at all: no summary.
        let one = summarize(&[5.0]).unwrap();
        assert_eq!((one.median, one.mean), (5.0, 5.0));
        assert!(one.ci95.is_nan());
        assert_eq!(summarize(&[f64::NAN]), None);
        assert_eq!(summarize(&[]), None);
    }

    #[test]
    fn t_quantiles_meet_the_normal_from_above() {
        assert_eq!(t975(1), 12.706);
        assert_eq!(t975(30), 2.042);
        // Beyond the table: the expansion (exact: 2.021 at 40, 1.984 at 100).
        assert!(close(t975(40), 2.021), "{}", t975(40));
        assert!(close(t975(100), 1.984), "{}", t975(100));
        assert!((2..200).all(|df| t975(df) < t975(df - 1)));
        assert!(t975(100_000) > 1.959 && t975(100_000) < 1.961);
    }

    fn run(passed: bool, share: f64, first: bool, error: Option<&str>) -> Scenario {
        let mut s = Scenario::new("scale_out");
        s.figure("new_pod_cold_key_share", share);
        s.check(first, format!("the new pod serves: {first}"));
        s.goal(share >= 0.15, format!("share ≥ 15 %: {share}"));
        s.passed = passed;
        s.error = error.map(str::to_owned);
        s.plot = Some("scale_out.png".into());
        s
    }

    #[test]
    fn runs_combine_into_medians_intervals_and_checks_held_in_every_run() {
        let s = combine(vec![
            run(true, 0.20, true, None),
            run(false, 0.10, false, Some("timed out")),
            run(true, 0.18, true, None),
        ]);
        assert!(!s.passed);
        assert_eq!(s.figures["new_pod_cold_key_share"], 0.18);
        assert!(close(s.figures["new_pod_cold_key_share_mean"], 0.16));
        // sd 0.0529, t(2) 4.303: 0.1315.
        assert!(close(s.figures["new_pod_cold_key_share_ci95"], 0.1315));
        assert_eq!(s.checks.len(), 1);
        assert!(!s.checks[0].passed);
        assert_eq!(
            s.checks[0].what,
            "the new pod serves: false [held in 2 of 3 runs]"
        );
        assert_eq!(s.goals[0].what, "share ≥ 15 %: 0.1 [held in 2 of 3 runs]");
        assert_eq!(s.error.as_deref(), Some("run 2: timed out"));
        assert_eq!(s.runs.len(), 3);
        assert_eq!(s.plot.as_deref(), Some("scale_out.png"));

        let s = combine(vec![run(true, 0.2, true, None), run(true, 0.2, true, None)]);
        assert!(s.passed && s.checks[0].passed && s.goals[0].passed);
        assert_eq!(
            s.checks[0].what,
            "the new pod serves: true [held in 2 of 2 runs]"
        );
    }

    fn killed(after: f64, undisturbed: f64) -> Scenario {
        let mut s = Scenario::new("router_killed");
        s.figure("after", after);
        s.figure("undisturbed", undisturbed);
        s.interval_goal("after", "undisturbed", "the ratio after the kill");
        s.passed = true;
        s
    }

    #[test]
    fn interval_goals_hold_a_figures_mean_to_a_references_interval() {
        // Undisturbed 0.60, 0.64, 0.62: mean 0.62, sd 0.02, ci95 0.0497.
        let s = combine(vec![
            killed(0.58, 0.60),
            killed(0.57, 0.64),
            killed(0.59, 0.62),
        ]);
        assert_eq!(s.goals.len(), 1);
        assert!(
            s.goals[0].passed,
            "0.58 ≥ 0.62 − 0.0497: {}",
            s.goals[0].what
        );
        assert_eq!(
            s.goals[0].what,
            "the ratio after the kill: after 0.580 vs undisturbed 0.620 ± 0.050 (means of 3 runs)"
        );
        let s = combine(vec![
            killed(0.50, 0.60),
            killed(0.55, 0.64),
            killed(0.54, 0.62),
        ]);
        assert!(!s.goals[0].passed, "{}", s.goals[0].what);
        // Above the interval is no loss.
        let s = combine(vec![killed(0.9, 0.60), killed(0.9, 0.64)]);
        assert!(s.goals[0].passed);
        // A figure no run measured misses it.
        let mut unmeasured = killed(0.0, 0.6);
        unmeasured.figures.remove("after");
        assert!(!combine(vec![unmeasured, killed(f64::NAN, 0.6)]).goals[0].passed);
    }

    #[test]
    fn one_run_notes_an_interval_goal_it_cannot_judge() {
        let s = combine(vec![killed(0.58, 0.60)]);
        assert!(s.goals.is_empty());
        assert_eq!(
            s.notes,
            vec![
                "goal the ratio after the kill: judged under --repeat 2 or more (one run has no interval); after 0.580, undisturbed 0.600"
            ]
        );
    }

    #[test]
    fn one_run_is_its_own_result() {
        let s = combine(vec![run(true, 0.2, true, None)]);
        assert_eq!(s.figures.len(), 1);
        assert_eq!(s.checks[0].what, "the new pod serves: true");
        assert!(s.runs.is_empty());
    }
}
