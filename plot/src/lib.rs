//! Charts for LeanStream's reports, as SVG: line charts (the profiler's
//! latency CDFs and throughput curves, `bench --sweep`'s tokens/s against
//! memory) and heatmaps (a controller table's actions over its state
//! space). Drawn with plotters, so every chart has titled axes with units,
//! round ticks and a legend (a colour scale for heatmaps).

use std::ops::Range;

use plotters::coord::ranged1d::{AsRangedCoord, SegmentValue, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("drawing the chart \"{chart}\": {message}")]
    Draw { chart: String, message: String },
    #[error("chart \"{chart}\": {message}")]
    Data { chart: String, message: String },
}

/// One named line.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    /// (x, y) points, drawn in ascending x.
    pub points: Vec<(f64, f64)>,
}

/// A line chart: one line with markers per series.
#[derive(Debug, Clone)]
pub struct LineChart<'a> {
    pub title: &'a str,
    /// Axis titles, with their units ("read size (KiB)").
    pub x_label: &'a str,
    pub y_label: &'a str,
    /// A log10 x axis (every x must then be > 0).
    pub x_log: bool,
    /// The bottom of the y axis: zero (speeds, counts) unless set.
    pub y_min: Option<f64>,
    /// The top of the y axis (1 for a CDF); the data's largest y (plus a
    /// twentieth) unless set.
    pub y_max: Option<f64>,
    pub series: &'a [Series],
}

/// Ten distinguishable line colours (matplotlib's tab10).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

const WIDTH: u32 = 960;
const HEIGHT: u32 = 560;

fn draw_error(chart: &str) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError::Draw {
        chart: chart.to_string(),
        message,
    }
}

impl LineChart<'_> {
    /// The chart as an SVG document.
    pub fn to_svg(&self) -> Result<String, PlotError> {
        let points = || self.series.iter().flat_map(|s| s.points.iter().copied());
        if points().any(|(x, y)| !x.is_finite() || !y.is_finite() || (self.x_log && x <= 0.0)) {
            return Err(PlotError::Data {
                chart: self.title.to_string(),
                message: if self.x_log {
                    "a point is not finite, or not positive on the log x axis".into()
                } else {
                    "a point is not finite".into()
                },
            });
        }
        let (mut x_lo, mut x_hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (x, _)| {
            (lo.min(x), hi.max(x))
        });
        if !x_lo.is_finite() {
            (x_lo, x_hi) = if self.x_log { (1.0, 10.0) } else { (0.0, 1.0) };
        }
        if x_hi <= x_lo {
            (x_lo, x_hi) = if self.x_log {
                (x_lo / 2.0, x_hi * 2.0)
            } else {
                (x_lo - 0.5, x_hi + 0.5)
            };
        }
        // A little room beyond the outermost points, so their markers show.
        (x_lo, x_hi) = if self.x_log {
            (x_lo / 1.05, x_hi * 1.05)
        } else {
            let pad = (x_hi - x_lo) / 40.0;
            (x_lo - pad, x_hi + pad)
        };
        let data_max = points().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
        let y_lo = self.y_min.unwrap_or(0.0);
        let mut y_hi = self.y_max.unwrap_or(if data_max.is_finite() {
            data_max + (data_max - y_lo).abs() / 20.0
        } else {
            1.0
        });
        if y_hi <= y_lo {
            y_hi = y_lo + 1.0;
        }
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
            let result = if self.x_log {
                self.draw(&root, (x_lo..x_hi).log_scale(), y_lo..y_hi)
            } else {
                self.draw(&root, x_lo..x_hi, y_lo..y_hi)
            };
            result.map_err(draw_error(self.title))?;
            root.present().map_err(|e| draw_error(self.title)(e.to_string()))?;
        }
        Ok(svg)
    }

    fn draw<X>(&self, root: &DrawingArea<SVGBackend, Shift>, x: X, y: Range<f64>) -> Result<(), String>
    where
        X: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64> + Ranged<ValueType = f64>,
    {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(root)
            .caption(self.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x, y)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc(self.x_label)
            .y_desc(self.y_label)
            .x_label_formatter(&|v| tick_text(*v))
            .y_label_formatter(&|v| tick_text(*v))
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 13))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, series) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let mut points = series.points.clone();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(series.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            // Markers only where a line is sparse enough to read them.
            if points.len() <= 40 {
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
        }
        if !self.series.is_empty() {
            chart
                .configure_series_labels()
                // Report curves rise to the right (CDFs, speed against
                // memory or queue depth): the lower right is the free corner.
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .draw()
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// An axis tick: as short as its value allows (`5`, `0.25`, `1e6`).
fn tick_text(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if v.abs() >= 1e6 || v.abs() < 1e-3 {
        return format!("{v:.0e}");
    }
    let text = format!("{v:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// One heatmap panel: `values[row][column]`, rows from the bottom.
#[derive(Debug, Clone)]
pub struct Heatmap {
    pub title: String,
    /// Axis titles, with units.
    pub x_label: String,
    pub y_label: String,
    /// One label per column and per row (bottom row first).
    pub x_ticks: Vec<String>,
    pub y_ticks: Vec<String>,
    pub values: Vec<Vec<f64>>,
    /// What the colour means, with its unit (the colour scale's title).
    pub value_label: String,
}

/// Viridis at five stops, interpolated: dark (low) to yellow (high), legible
/// in grey and to most colour-blind readers.
fn viridis(u: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    // An infinite value (a deadline factor of inf) takes the top colour.
    let u = if u.is_nan() { 0.0 } else { u.clamp(0.0, 1.0) };
    let at = u * (STOPS.len() - 1) as f64;
    let i = (at.floor() as usize).min(STOPS.len() - 2);
    let f = at - i as f64;
    let mix = |a: f64, b: f64| (a + (b - a) * f).round() as u8;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// A value as a cell or scale label: integers plainly, others to 3 digits.
fn value_text(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    tick_text(v)
}

const PANEL_WIDTH: u32 = 520;
const PANEL_HEIGHT: u32 = 440;
/// Width of each panel's colour scale.
const SCALE_WIDTH: u32 = 124;

/// Heatmap panels side by side (`columns` per row), under one title, each
/// with its own colour scale and the value written in each cell.
pub fn heatmaps_svg(title: &str, panels: &[Heatmap], columns: usize) -> Result<String, PlotError> {
    for p in panels {
        let well_formed = p.values.len() == p.y_ticks.len() && p.values.iter().all(|row| row.len() == p.x_ticks.len());
        if !well_formed || p.values.is_empty() || p.x_ticks.is_empty() {
            return Err(PlotError::Data {
                chart: format!("{title}: {}", p.title),
                message: format!(
                    "{} rows by {} tick labels and {} columns expected, got {} rows of {:?}",
                    p.y_ticks.len(),
                    p.x_ticks.len(),
                    p.x_ticks.len(),
                    p.values.len(),
                    p.values.iter().map(Vec::len).collect::<Vec<_>>()
                ),
            });
        }
    }
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let mut svg = String::new();
    {
        let size = (PANEL_WIDTH * columns as u32, PANEL_HEIGHT * rows as u32 + 40);
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let draw = || -> Result<(), String> {
            root.fill(&WHITE).map_err(|e| e.to_string())?;
            // Long titles shrink to fit the width (about 0.55 em per character).
            let fit = (size.0 as f64 / (0.55 * title.chars().count().max(1) as f64)).min(22.0);
            let body = root.titled(title, ("sans-serif", fit)).map_err(|e| e.to_string())?;
            let areas = body.split_evenly((rows, columns));
            for (panel, area) in panels.iter().zip(&areas) {
                draw_heatmap(panel, area)?;
            }
            Ok(())
        };
        draw().map_err(draw_error(title))?;
        root.present().map_err(|e| draw_error(title)(e.to_string()))?;
    }
    Ok(svg)
}

fn draw_heatmap(p: &Heatmap, area: &DrawingArea<SVGBackend, Shift>) -> Result<(), String> {
    let (nx, ny) = (p.x_ticks.len(), p.y_ticks.len());
    let finite = || p.values.iter().flatten().copied().filter(|v| v.is_finite());
    let lo = finite().fold(f64::INFINITY, f64::min);
    let hi = finite().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi > lo {
        (lo, hi)
    } else {
        (lo - 0.5, hi + 0.5)
    };
    let unit = |v: f64| (v - lo) / (hi - lo);
    let (cells, scale) = area.split_horizontally(PANEL_WIDTH - SCALE_WIDTH);

    // Segments 0..=n-1 (plotters' integer ranges include their end): one
    // per cell, labelled at its centre.
    let mut chart = ChartBuilder::on(&cells)
        .caption(&p.title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((0..nx - 1).into_segmented(), (0..ny - 1).into_segmented())
        .map_err(|e| e.to_string())?;
    let tick = |labels: &[String], v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
        SegmentValue::Exact(_) | SegmentValue::Last => String::new(),
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(&p.x_label)
        .y_desc(&p.y_label)
        .x_labels(nx)
        .y_labels(ny)
        .x_label_formatter(&|v| tick(&p.x_ticks, v))
        .y_label_formatter(&|v| tick(&p.y_ticks, v))
        .axis_desc_style(("sans-serif", 14))
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(|e| e.to_string())?;
    for (y, row) in p.values.iter().enumerate() {
        for (x, &v) in row.iter().enumerate() {
            let corners = [
                (SegmentValue::Exact(x), SegmentValue::Exact(y)),
                (SegmentValue::Exact(x + 1), SegmentValue::Exact(y + 1)),
            ];
            chart
                .draw_series(std::iter::once(Rectangle::new(corners, viridis(unit(v)).filled())))
                .map_err(|e| e.to_string())?;
            // Dark text on the light end of the scale, white on the dark end.
            let ink = if unit(v) > 0.6 { BLACK } else { WHITE };
            let style = TextStyle::from(("sans-serif", 11).into_font())
                .color(&ink)
                .pos(Pos::new(HPos::Center, VPos::Center));
            let centre = (SegmentValue::CenterOf(x), SegmentValue::CenterOf(y));
            chart
                .draw_series(std::iter::once(Text::new(value_text(v), centre, style)))
                .map_err(|e| e.to_string())?;
        }
    }

    // The colour scale: a column of thin bands from lo to hi.
    let mut bar = ChartBuilder::on(&scale)
        .margin_top(40)
        .margin_bottom(52)
        .margin_right(8)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..1.0, lo..hi)
        .map_err(|e| e.to_string())?;
    bar.configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_desc(&p.value_label)
        .y_labels(6)
        .y_label_formatter(&|v| tick_text(*v))
        .axis_desc_style(("sans-serif", 12))
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(|e| e.to_string())?;
    const BANDS: usize = 64;
    bar.draw_series((0..BANDS).map(|i| {
        let (a, b) = (i as f64 / BANDS as f64, (i + 1) as f64 / BANDS as f64);
        let (va, vb) = (lo + a * (hi - lo), lo + b * (hi - lo));
        Rectangle::new([(0.0, va), (1.0, vb)], viridis((a + b) / 2.0).filled())
    }))
    .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| t.split_once('>').and_then(|(_, rest)| rest.split_once("</text>")))
            .map(|(s, _)| s.trim().to_string())
            .collect()
    }

    #[test]
    fn line_chart_has_titles_axis_names_and_a_legend_entry_per_series() {
        let series = [
            Series {
                name: "dense-stream".into(),
                points: vec![(100.0, 10.0), (200.0, 20.0), (300.0, 25.0)],
            },
            Series {
                name: "speculate".into(),
                points: vec![(300.0, 30.0), (100.0, 12.0)],
            },
        ];
        let chart = LineChart {
            title: "decode speed against memory",
            x_label: "peak RSS (MiB)",
            y_label: "decode (tokens/s)",
            x_log: false,
            y_min: None,
            y_max: None,
            series: &series,
        };
        let svg = chart.to_svg().unwrap();
        let t = texts(&svg);
        for want in [
            "decode speed against memory",
            "peak RSS (MiB)",
            "decode (tokens/s)",
            "dense-stream",
            "speculate",
        ] {
            assert!(t.iter().any(|s| s == want), "{want} missing from {t:?}");
        }
        // Per series a 2-pixel line and its legend sample, in its own colour;
        // one marker per point.
        for color in ["#1F77B4", "#D62728"] {
            let lines = svg
                .lines()
                .filter(|l| l.starts_with("<polyline") && l.contains(color) && l.contains("stroke-width=\"2\""));
            assert_eq!(lines.count(), 2, "{color}");
        }
        assert_eq!(svg.matches("<circle").count(), 5);
    }

    #[test]
    fn log_axis_refuses_non_positive_x_and_accepts_positive() {
        let bad = [Series {
            name: "x".into(),
            points: vec![(0.0, 1.0)],
        }];
        let mut chart = LineChart {
            title: "latency CDF",
            x_label: "latency (µs)",
            y_label: "fraction of reads",
            x_log: true,
            y_min: None,
            y_max: Some(1.0),
            series: &bad,
        };
        assert!(matches!(chart.to_svg(), Err(PlotError::Data { .. })));
        let good = [Series {
            name: "4 KiB".into(),
            points: vec![(10.0, 0.1), (100.0, 0.5), (10000.0, 1.0)],
        }];
        chart.series = &good;
        let svg = chart.to_svg().unwrap();
        let t = texts(&svg);
        assert!(t.iter().any(|s| s.contains("latency (")), "{t:?}");
    }

    #[test]
    fn heatmap_writes_each_cell_its_ticks_and_a_scale() {
        let panel = Heatmap {
            title: "stages K".into(),
            x_label: "missing bytes (KiB)".into(),
            y_label: "read bandwidth (MB/s)".into(),
            x_ticks: vec!["0".into(), "64".into(), "512".into()],
            y_ticks: vec!["100".into(), "900".into()],
            values: vec![vec![1.0, 2.0, 4.0], vec![1.0, 1.0, 2.0]],
            value_label: "stages".into(),
        };
        let svg = heatmaps_svg("controller actions", &[panel.clone(), panel.clone()], 2).unwrap();
        let t = texts(&svg);
        for want in [
            "controller actions",
            "stages K",
            "missing bytes (KiB)",
            "read bandwidth (MB/s)",
            "512",
            "900",
            "stages",
        ] {
            assert!(t.iter().any(|s| s == want), "{want} missing from {t:?}");
        }
        // Each panel writes its cells' values (the 4 once per panel, besides
        // any colour-scale label).
        assert!(t.iter().filter(|s| *s == "4").count() >= 2, "{t:?}");
        let single = Heatmap {
            x_ticks: vec!["7".into()],
            y_ticks: vec!["9".into()],
            values: vec![vec![f64::INFINITY]],
            ..panel.clone()
        };
        let t = texts(&heatmaps_svg("one state", &[single], 1).unwrap());
        assert!(t.iter().any(|s| s == "inf") && t.iter().any(|s| s == "7"), "{t:?}");
        let ragged = Heatmap {
            values: vec![vec![1.0]],
            ..panel
        };
        assert!(matches!(heatmaps_svg("x", &[ragged], 1), Err(PlotError::Data { .. })));
    }
}
