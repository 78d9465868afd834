//! `kvroute replay --plot`: hit rate against TTFT mean, one panel per
//! replica count: a point per policy, and kvroute's latency slack swept as
//! a curve (the trade-off its one knob makes). The TTFT axis spans 3× the
//! fastest point, where the policies compete; slower points are drawn on
//! its edge with their TTFT written out.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::run::PolicyResult;
use kvroute_plot::{self as plot, FONT};

/// The slack values the curve runs through (the default, 1, among them).
pub const SWEEP: [f64; 8] = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0];

/// One panel's data.
#[derive(Debug)]
pub struct Panel {
    pub replicas: usize,
    /// Every policy's row at this replica count.
    pub rows: Vec<PolicyResult>,
    /// kvroute at each slack of [`SWEEP`].
    pub sweep: Vec<(f64, PolicyResult)>,
}

/// Writes the figure to `path` (`.svg` or `.png`).
pub fn write(path: &Path, title: &str, panels: &[Panel]) -> anyhow::Result<()> {
    let size = (560 * panels.len().max(1) as u32, 560);
    plot::save(
        path,
        size,
        |area| draw(area, title, panels),
        |area| draw(area, title, panels),
    )
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    panels: &[Panel],
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(plot::error)?;
    let root = root.titled(title, (FONT, 18)).map_err(plot::error)?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel)?;
    }
    root.present().map_err(plot::error)
}

/// How far right of the fastest point the TTFT axis reaches (times its
/// TTFT); slower points sit on the right edge, their TTFT in their label.
const X_SPAN: f64 = 3.0;

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
) -> anyhow::Result<()> {
    let points = || panel.rows.iter().chain(panel.sweep.iter().map(|(_, r)| r));
    let lo = points()
        .map(|r| r.ttft_mean_s)
        .filter(|t| *t > 0.0)
        .fold(f64::INFINITY, f64::min);
    let lo = if lo.is_finite() { lo } else { 0.01 };
    let top = points().map(|r| r.token_hit_rate).fold(0.0, f64::max);
    let x_max = lo * X_SPAN;
    // A point, clamped to the axis, and the note its label gets if clamped.
    let at = |r: &PolicyResult| {
        let note = (r.ttft_mean_s > x_max).then(|| format!(" {:.1} s", r.ttft_mean_s));
        ((r.ttft_mean_s.min(x_max), r.token_hit_rate), note)
    };
    // Labels of clamped points go left of them, inside the panel.
    let label = |text: String, note: Option<String>, color: RGBColor| match note {
        None => Text::new(text, (6, -12), (FONT, 11).into_font().color(&color)),
        Some(note) => Text::new(
            text + &note,
            (-8, -12),
            (FONT, 11)
                .into_font()
                .color(&color)
                .pos(Pos::new(HPos::Right, VPos::Top)),
        ),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(format!("N = {} replicas", panel.replicas), (FONT, 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo / 1.1)..(x_max * 1.02), 0.0..(top * 1.15).max(0.1))
        .map_err(plot::error)?;
    chart
        .configure_mesh()
        .x_desc("time to first token, mean (s)")
        .y_desc("token hit rate")
        .light_line_style(WHITE)
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()
        .map_err(plot::error)?;

    let curve = RGBColor(200, 30, 30);
    chart
        .draw_series(LineSeries::new(
            panel.sweep.iter().map(|(_, r)| at(r).0),
            curve.stroke_width(2),
        ))
        .map_err(plot::error)?
        .label("kvroute, latencySlack swept")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], curve.stroke_width(2)));
    chart
        .draw_series(panel.sweep.iter().map(|(slack, r)| {
            let (point, note) = at(r);
            EmptyElement::at(point)
                + Circle::new((0, 0), 3, curve.filled())
                + label(format!("{slack}"), note, curve)
        }))
        .map_err(plot::error)?;

    let others = RGBColor(30, 60, 160);
    chart
        .draw_series(
            panel
                .rows
                .iter()
                .filter(|r| r.policy != "kvroute")
                .map(|r| {
                    let (point, note) = at(r);
                    EmptyElement::at(point)
                        + TriangleMarker::new((0, 0), 5, others.filled())
                        + label(r.policy.clone(), note, BLACK)
                }),
        )
        .map_err(plot::error)?
        .label("other policies")
        .legend(move |(x, y)| TriangleMarker::new((x + 9, y), 5, others.filled()));
    chart
        .draw_series(
            panel
                .rows
                .iter()
                .filter(|r| r.policy == "kvroute")
                .map(|r| EmptyElement::at(at(r).0) + Cross::new((0, 0), 7, curve.stroke_width(3))),
        )
        .map_err(plot::error)?
        .label("kvroute (default)")
        .legend(move |(x, y)| Cross::new((x + 9, y), 6, curve.stroke_width(3)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot::error)
}
