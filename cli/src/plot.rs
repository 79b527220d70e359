//! A small SVG line chart: one polyline with markers per series, linear axes
//! with round ticks, a legend. Enough for `bench --sweep`; no dependency.

use std::fmt::Write;

pub struct Series {
    pub name: String,
    /// (x, y) points; drawn in ascending x.
    pub points: Vec<(f64, f64)>,
}

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// Round tick positions covering `lo..=hi` (from a multiple of the step at
/// or below `lo` to the first at or above `hi`).
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = if hi > lo { hi - lo } else { hi.abs().max(1.0) };
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step + 1e-9).floor();
    let last = (hi / step - 1e-9).ceil().max(first + 1.0);
    (first as i64..=last as i64).map(|i| i as f64 * step).collect()
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn label(v: f64) -> String {
    if v >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let x_min = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let x_max = all().map(|p| p.0).fold(0f64, f64::max);
    let y_max = all().map(|p| p.1).fold(0f64, f64::max);
    // Memory starts where the resident parts end; speed starts at zero.
    let xt = ticks(if x_min.is_finite() { x_min } else { 0.0 }, x_max);
    let yt = ticks(0.0, y_max);
    let (x_lo, x_hi) = (xt[0], *xt.last().expect("two ticks at least"));
    let y_hi = *yt.last().expect("two ticks at least");
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |x: f64| LEFT + (x - x_lo) / (x_hi - x_lo) * pw;
    let py = |y: f64| TOP + ph - y / y_hi * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + pw / 2.0,
        esc(title)
    );
    for &t in &xt {
        let x = px(t);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 16.0,
            label(t)
        );
    }
    for &t in &yt {
        let y = py(t);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            label(t)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 18.0,
        esc(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + ph / 2.0,
        esc(y_label)
    );
    for (k, ser) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let mut pts = ser.points.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = pts.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        if pts.len() > 1 {
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                path.join(" ")
            );
        }
        for &(x, y) in &pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{color}"><title>{}: {:.1} MiB, {:.2} tok/s</title></circle>"#,
                px(x),
                py(y),
                esc(&ser.name),
                x,
                y
            );
        }
        let ly = TOP + 10.0 + 20.0 * k as f64;
        let lx = LEFT + pw + 16.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><circle cx="{}" cy="{ly}" r="4" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
            lx + 24.0,
            lx + 12.0,
            lx + 30.0,
            ly + 4.0,
            esc(&ser.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.0, 73.0);
        assert!(*t.last().unwrap() >= 73.0 && t[1] == 20.0, "{t:?}");
        let t = ticks(96.8, 171.0);
        assert_eq!((t[0], *t.last().unwrap()), (80.0, 180.0), "{t:?}");
        assert!(ticks(5.0, 5.0).len() >= 2);
    }

    #[test]
    fn chart_has_one_line_per_multi_point_series_and_a_legend() {
        let series = vec![
            Series {
                name: "dense".into(),
                points: vec![(100.0, 10.0)],
            },
            Series {
                name: "oracle <a>".into(),
                points: vec![(50.0, 5.0), (20.0, 2.0)],
            },
        ];
        let svg = line_chart("t", "x", "y", &series);
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(svg.matches("<circle").count(), 3 + 2);
        assert!(svg.contains("oracle &lt;a&gt;") && svg.ends_with("</svg>\n"));
    }
}
