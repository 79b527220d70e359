//! Human-readable view of a table and SVG heatmaps of its chosen actions.

use std::fmt::Write;

use leanstream_runtime::control::{Action, AxisKind, ControlTable};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A text description: provenance, axes, codebook usage.
pub fn describe(t: &ControlTable, file_bytes: usize) -> String {
    let mut s = String::new();
    let p = &t.provenance;
    let _ = writeln!(
        s,
        "controller table: {} bytes, {} states, {} actions",
        file_bytes,
        t.n_states(),
        t.codebook.len()
    );
    let _ = writeln!(s, "device: {}", p.device_fingerprint);
    let _ = writeln!(s, "seed: {}", p.seed);
    let _ = writeln!(s, "solver settings: {}", p.solver_settings);
    let _ = writeln!(s, "traces ({}):", p.traces.len());
    for tr in &p.traces {
        let _ = writeln!(s, "  {}  {}", hex(&tr.sha256), tr.name);
    }
    let _ = writeln!(s, "axes:");
    for a in &t.axes {
        let _ = writeln!(
            s,
            "  {:<22} centers {:?} thresholds {:?}",
            a.kind.name(),
            a.centers,
            a.thresholds
        );
    }
    let mut used = vec![0usize; t.codebook.len()];
    for &c in &t.codes {
        used[c as usize] += 1;
    }
    let _ = writeln!(s, "actions used:");
    for (i, a) in t.codebook.iter().enumerate() {
        if used[i] > 0 {
            let _ = writeln!(s, "  #{i:<3} {a}  ({} states)", used[i]);
        }
    }
    s
}

/// SVG heatmaps: one panel per action component, missing bytes (x) against
/// read bandwidth (y), the other axes at their middle bins.
pub fn heatmap_svg(t: &ControlTable) -> String {
    let find = |k: AxisKind| t.axes.iter().position(|a| a.kind == k);
    let (Some(xi), Some(yi)) = (find(AxisKind::MissingBytes), find(AxisKind::ReadBandwidth)) else {
        return "<svg xmlns=\"http://www.w3.org/2000/svg\"/>".into();
    };
    let nx = t.axes[xi].bins();
    let ny = t.axes[yi].bins();
    let cell = 40.0;
    let pw = nx as f64 * cell + 120.0;
    let ph = ny as f64 * cell + 80.0;
    type Component = (&'static str, fn(&Action) -> f64);
    let comps: [Component; 4] = [
        ("stages K", |a| a.stages as f64),
        ("queue depth", |a| a.queue_depth as f64),
        ("prefetch breadth", |a| a.prefetch_breadth as f64),
        ("deadline factor", |a| a.deadline_factor as f64),
    ];
    let mut s = String::new();
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">",
        pw * 4.0,
        ph
    );
    for (pi, (name, f)) in comps.iter().enumerate() {
        let vals: Vec<f64> = t.codebook.iter().map(f).collect();
        let lo = vals.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = vals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let ox = pi as f64 * pw + 80.0;
        let _ = write!(s, "<text x=\"{ox}\" y=\"15\">{name} (others at middle bins)</text>");
        for y in 0..ny {
            for x in 0..nx {
                let mut idx = 0;
                for (ai, a) in t.axes.iter().enumerate() {
                    let b = if ai == xi {
                        x
                    } else if ai == yi {
                        y
                    } else {
                        a.bins() / 2
                    };
                    idx = idx * a.bins() + b;
                }
                let v = f(&t.codebook[t.codes[idx] as usize]);
                let u = if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };
                let (r, g, b) = (
                    (40.0 + 215.0 * u) as u8,
                    (80.0 + 100.0 * (1.0 - u)) as u8,
                    (200.0 * (1.0 - u)) as u8,
                );
                let px = ox + x as f64 * cell;
                let py = 25.0 + (ny - 1 - y) as f64 * cell;
                let _ = write!(
                    s,
                    "<rect x=\"{px}\" y=\"{py}\" width=\"{cell}\" height=\"{cell}\" fill=\"rgb({r},{g},{b})\"/>\
                     <text x=\"{}\" y=\"{}\" fill=\"white\">{v}</text>",
                    px + 8.0,
                    py + 24.0
                );
            }
        }
        let _ = write!(
            s,
            "<text x=\"{ox}\" y=\"{}\">missing bytes → ({:?})</text><text x=\"{}\" y=\"{}\" transform=\"rotate(-90 {} {})\">read bw →</text>",
            ph - 30.0,
            t.axes[xi].centers.iter().map(|c| format!("{:.0}K", c / 1024.0)).collect::<Vec<_>>(),
            ox - 10.0,
            25.0 + ny as f64 * cell,
            ox - 10.0,
            25.0 + ny as f64 * cell
        );
    }
    s.push_str("</svg>\n");
    s
}
