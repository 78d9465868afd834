//! What a run found: per-scenario figures and checks as `report.json`,
//! and per-scenario timelines (hit ratio, TTFT p50/p99 and requests per
//! pod over time, with the scenario's moments marked) as PNG.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::Context as _;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use kvroute_plot::{self as plot, FONT};

use super::load::{Outcome, Sample};

/// Width of a timeline window, seconds.
pub const WINDOW_S: f64 = 2.0;

/// The whole report.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Every scenario run, in order.
    pub scenarios: Vec<Scenario>,
}

/// One scenario's result.
#[derive(Debug, Default, Serialize)]
pub struct Scenario {
    /// Its name (`steady_state`, `scale_out`, …).
    pub name: String,
    /// Every check held and nothing failed.
    pub passed: bool,
    /// Measured figures, by name.
    pub figures: BTreeMap<String, f64>,
    /// What was asserted, each with whether it held: `passed` requires
    /// them all.
    pub checks: Vec<Check>,
    /// The product's goals, each with whether this run met it; recorded,
    /// not asserted (the checks hold the same figures to looser bounds a
    /// loaded machine meets every time).
    pub goals: Vec<Check>,
    /// Goals on a figure against the interval of another, judged only
    /// across runs (`--repeat N`, N ≥ 2; see [`super::repeat`]), then
    /// added to `goals`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub interval_goals: Vec<IntervalGoal>,
    /// What was not done, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Lines printed below the figures: a table of them, say.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub text: Vec<String>,
    /// Why it could not finish, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why it was skipped, if it was (then `passed` is true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// Its timeline plot, relative to the report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plot: Option<String>,
    /// With `--repeat N` (N > 1), each run's own result, in order; the
    /// fields above sum them up (see [`super::repeat`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<Scenario>,
}

/// A goal judged across runs: the mean of `figure` is not below the 95 %
/// interval of the mean of `reference` (above it is no loss).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IntervalGoal {
    /// The figure judged, e.g. `cached_ratio_after_kill`.
    pub figure: String,
    /// The figure whose interval it must reach, e.g. the undisturbed
    /// run's ratio in the same window.
    pub reference: String,
    /// What the goal says, without values.
    pub what: String,
}

/// One assertion.
#[derive(Debug, Serialize)]
pub struct Check {
    /// What must hold, with the measured value.
    pub what: String,
    /// Whether it held.
    pub passed: bool,
}

impl Scenario {
    /// A scenario named `name` with nothing measured yet.
    pub fn new(name: &str) -> Scenario {
        Scenario {
            name: name.to_owned(),
            ..Scenario::default()
        }
    }

    /// Records a figure.
    pub fn figure(&mut self, name: &str, value: f64) {
        self.figures.insert(name.to_owned(), value);
    }

    /// Records a check.
    pub fn check(&mut self, passed: bool, what: String) {
        self.checks.push(Check { what, passed });
    }

    /// Records a goal.
    pub fn goal(&mut self, passed: bool, what: String) {
        self.goals.push(Check { what, passed });
    }

    /// Records a goal on `figure` against `reference`'s interval, judged
    /// across runs ([`IntervalGoal`]).
    pub fn interval_goal(&mut self, figure: &str, reference: &str, what: &str) {
        self.interval_goals.push(IntervalGoal {
            figure: figure.to_owned(),
            reference: reference.to_owned(),
            what: what.to_owned(),
        });
    }
}

/// Requests sent in `[from, to)`.
pub fn between(samples: &[Sample], from: f64, to: f64) -> impl Iterator<Item = &Sample> {
    samples.iter().filter(move |s| s.t >= from && s.t < to)
}

/// Cached over prompt tokens of the completed requests among `samples`
/// (0 when none completed).
pub fn hit_ratio<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> f64 {
    let (cached, prompt) = samples
        .into_iter()
        .filter(|s| s.outcome == Outcome::Ok)
        .fold((0, 0), |(c, p), s| {
            (c + s.cached_tokens, p + s.prompt_tokens)
        });
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

/// The `q` quantile (0 to 1) of `values`, nearest rank; 0 when empty.
pub fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// One timeline window.
#[derive(Debug)]
struct Window {
    start: f64,
    hit_ratio: Option<f64>,
    ttft_p50_ms: Option<f64>,
    ttft_p99_ms: Option<f64>,
    per_pod: BTreeMap<String, f64>,
}

fn windows(samples: &[Sample]) -> Vec<Window> {
    let end = samples.iter().map(|s| s.t).fold(0.0, f64::max);
    let count = (end / WINDOW_S).floor() as usize + 1;
    (0..count)
        .map(|w| {
            let start = w as f64 * WINDOW_S;
            let inside: Vec<&Sample> = between(samples, start, start + WINDOW_S).collect();
            let ok: Vec<&Sample> = inside
                .iter()
                .copied()
                .filter(|s| s.outcome == Outcome::Ok)
                .collect();
            let mut ttfts: Vec<f64> = ok.iter().filter_map(|s| s.ttft).map(|t| t * 1e3).collect();
            let mut per_pod = BTreeMap::new();
            for s in &inside {
                if let Some(e) = &s.endpoint {
                    *per_pod.entry(e.clone()).or_insert(0.0) += 1.0 / WINDOW_S;
                }
            }
            Window {
                start,
                hit_ratio: (!ok.is_empty()).then(|| hit_ratio(ok.iter().copied())),
                ttft_p50_ms: (!ttfts.is_empty()).then(|| quantile(&mut ttfts, 0.5)),
                ttft_p99_ms: (!ttfts.is_empty()).then(|| quantile(&mut ttfts, 0.99)),
                per_pod,
            }
        })
        .collect()
}

/// Writes `report.json` into `dir`.
pub fn write_json(dir: &Path, report: &Report) -> anyhow::Result<()> {
    let path = dir.join("report.json");
    let text = serde_json::to_string_pretty(report).context("serializing the report")?;
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// A timeline: one or more runs (label and samples) and the moments to
/// mark.
#[derive(Debug)]
pub struct Timeline<'a> {
    /// The plot's title.
    pub title: String,
    /// Runs drawn over each other, e.g. `kvroute` and `round-robin`.
    pub runs: Vec<(&'a str, &'a [Sample])>,
    /// Seconds and labels of the moments to mark.
    pub marks: &'a [(f64, String)],
}

/// Draws `timeline` into `path` (`.png` or `.svg`).
pub fn write_plot(path: &Path, timeline: &Timeline<'_>) -> anyhow::Result<()> {
    plot::save(
        path,
        (960, 900),
        |area| draw(area, timeline),
        |area| draw(area, timeline),
    )
}

const COLORS: [RGBColor; 8] = [
    RGBColor(200, 30, 30),
    RGBColor(30, 60, 160),
    RGBColor(20, 140, 60),
    RGBColor(200, 120, 0),
    RGBColor(120, 40, 160),
    RGBColor(0, 150, 170),
    RGBColor(120, 120, 120),
    RGBColor(170, 80, 40),
];

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, t: &Timeline<'_>) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(plot::error)?;
    let root = root.titled(&t.title, (FONT, 18)).map_err(plot::error)?;
    let panels = root.split_evenly((3, 1));
    let runs: Vec<(&str, Vec<Window>)> = t.runs.iter().map(|(l, s)| (*l, windows(s))).collect();
    let x_max = runs
        .iter()
        .flat_map(|(_, w)| w.last().map(|w| w.start + WINDOW_S))
        .fold(WINDOW_S, f64::max);
    let multi = runs.len() > 1;

    // Hit ratio.
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|(label, w)| {
            let points = w
                .iter()
                .filter_map(|w| Some((w.start + WINDOW_S / 2.0, w.hit_ratio? * 100.0)))
                .collect();
            (label.to_string(), points)
        })
        .collect();
    panel(
        &panels[0],
        "cached prompt tokens (%)",
        x_max,
        100.0,
        &series,
        t.marks,
    )?;

    // TTFT.
    let mut series = Vec::new();
    for (label, w) in &runs {
        let prefix = if multi {
            format!("{label} ")
        } else {
            String::new()
        };
        let p50: Vec<(f64, f64)> = w
            .iter()
            .filter_map(|w| Some((w.start + WINDOW_S / 2.0, w.ttft_p50_ms?)))
            .collect();
        let p99: Vec<(f64, f64)> = w
            .iter()
            .filter_map(|w| Some((w.start + WINDOW_S / 2.0, w.ttft_p99_ms?)))
            .collect();
        series.push((format!("{prefix}TTFT p50"), p50));
        series.push((format!("{prefix}TTFT p99"), p99));
    }
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(10.0, f64::max);
    panel(&panels[1], "TTFT (ms)", x_max, top * 1.1, &series, t.marks)?;

    // Requests per second per pod, of the last run.
    let last = runs.last().map(|(_, w)| w.as_slice()).unwrap_or_default();
    let pods: BTreeSet<&String> = last.iter().flat_map(|w| w.per_pod.keys()).collect();
    let series: Vec<(String, Vec<(f64, f64)>)> = pods
        .iter()
        .map(|pod| {
            let points = last
                .iter()
                .map(|w| {
                    let rate = w.per_pod.get(*pod).copied().unwrap_or(0.0);
                    (w.start + WINDOW_S / 2.0, rate)
                })
                .collect();
            ((*pod).clone(), points)
        })
        .collect();
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(1.0, f64::max);
    panel(
        &panels[2],
        "requests/s per pod",
        x_max,
        top * 1.15,
        &series,
        t.marks,
    )?;
    root.present().map_err(plot::error)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    y_desc: &str,
    x_max: f64,
    y_max: f64,
    series: &[(String, Vec<(f64, f64)>)],
    marks: &[(f64, String)],
) -> anyhow::Result<()> {
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(plot::error)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc(y_desc)
        .light_line_style(WHITE)
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()
        .map_err(plot::error)?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(plot::error)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    for (t, label) in marks {
        chart
            .draw_series(LineSeries::new(
                [(*t, 0.0), (*t, y_max)],
                BLACK.mix(0.6).stroke_width(1),
            ))
            .map_err(plot::error)?;
        chart
            .draw_series([Text::new(
                label.clone(),
                (*t + x_max * 0.005, y_max * 0.97),
                (FONT, 12),
            )])
            .map_err(plot::error)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot::error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, prompt: u64, cached: u64, outcome: Outcome) -> Sample {
        Sample {
            t,
            endpoint: Some("pod-0".into()),
            id: None,
            outcome,
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft: Some(0.01),
            itl: Vec::new(),
        }
    }

    #[test]
    fn hit_ratio_counts_completed_requests_only() {
        let samples = [
            sample(0.0, 100, 50, Outcome::Ok),
            sample(0.5, 100, 100, Outcome::Ok),
            sample(1.0, 100, 100, Outcome::BrokeWithError),
        ];
        assert_eq!(hit_ratio(&samples), 0.75);
        assert_eq!(hit_ratio(between(&samples, 0.4, 2.0)), 1.0);
        assert_eq!(hit_ratio([]), 0.0);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), 50.0);
        assert_eq!(quantile(&mut v, 0.99), 99.0);
        assert_eq!(quantile(&mut [], 0.5), 0.0);
    }

    #[test]
    fn a_timeline_renders_to_png() {
        let samples: Vec<Sample> = (0..50)
            .map(|i| sample(f64::from(i) * 0.2, 100, 60, Outcome::Ok))
            .collect();
        let dir = std::env::temp_dir().join(format!("kvroute-e2e-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.png");
        let marks = [(5.0, "pod added".to_owned())];
        let timeline = Timeline {
            title: "test".into(),
            runs: vec![("kvroute", &samples)],
            marks: &marks,
        };
        write_plot(&path, &timeline).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
