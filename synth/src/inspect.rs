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

/// A value of `kind` in the unit its axis title names.
fn axis_value(kind: AxisKind, v: f64) -> String {
    match kind {
        AxisKind::QueuedBytes | AxisKind::MissingBytes => format!("{:.0}", v / 1024.0),
        AxisKind::ReadBandwidth => format!("{:.0}", v / 1e6),
        AxisKind::ComputeNsPerNeuron => format!("{v:.1}"),
        AxisKind::LayerPosition => format!("{v:.2}"),
    }
}

/// An axis title with its unit.
fn axis_title(kind: AxisKind) -> &'static str {
    match kind {
        AxisKind::QueuedBytes => "queued bytes (KiB)",
        AxisKind::MissingBytes => "missing bytes (KiB)",
        AxisKind::ReadBandwidth => "read bandwidth (MB/s)",
        AxisKind::ComputeNsPerNeuron => "compute per neuron (ns)",
        AxisKind::LayerPosition => "layer position (0..1)",
    }
}

/// SVG heatmaps of the table's chosen action, one panel per action
/// component, over missing bytes (x) and read bandwidth (y), with each other
/// axis held at its middle bin (named in the title). Each cell shows the
/// component's value; each panel has its colour scale.
pub fn heatmap_svg(t: &ControlTable) -> crate::Result<String> {
    let find = |k: AxisKind| t.axes.iter().position(|a| a.kind == k);
    let (Some(xi), Some(yi)) = (find(AxisKind::MissingBytes), find(AxisKind::ReadBandwidth)) else {
        return Err(crate::SynthError::Settings(
            "the table has no missing-bytes or read-bandwidth axis to plot".into(),
        ));
    };
    let (x_axis, y_axis) = (&t.axes[xi], &t.axes[yi]);
    let held: Vec<String> = t
        .axes
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != xi && i != yi)
        .map(|(_, a)| format!("{} {}", axis_title(a.kind), axis_value(a.kind, a.centers[a.bins() / 2])))
        .collect();
    type Component = (&'static str, &'static str, fn(&Action) -> f64);
    let components: [Component; 4] = [
        ("stages K", "stages", |a| a.stages as f64),
        ("queue depth q", "reads in flight", |a| a.queue_depth as f64),
        ("prefetch breadth b", "x predicted need", |a| a.prefetch_breadth as f64),
        ("deadline factor d", "x expected compute", |a| a.deadline_factor as f64),
    ];
    let panels: Vec<leanstream_plot::Heatmap> = components
        .iter()
        .map(|&(name, unit, component)| {
            let values = (0..y_axis.bins())
                .map(|y| {
                    (0..x_axis.bins())
                        .map(|x| {
                            let idx = t.axes.iter().enumerate().fold(0, |idx, (ai, a)| {
                                let bin = if ai == xi {
                                    x
                                } else if ai == yi {
                                    y
                                } else {
                                    a.bins() / 2
                                };
                                idx * a.bins() + bin
                            });
                            component(&t.codebook[t.codes[idx] as usize])
                        })
                        .collect()
                })
                .collect();
            leanstream_plot::Heatmap {
                title: name.to_string(),
                x_label: axis_title(x_axis.kind).to_string(),
                y_label: axis_title(y_axis.kind).to_string(),
                x_ticks: x_axis.centers.iter().map(|&c| axis_value(x_axis.kind, c)).collect(),
                y_ticks: y_axis.centers.iter().map(|&c| axis_value(y_axis.kind, c)).collect(),
                values,
                value_label: format!("{name} ({unit})"),
            }
        })
        .collect();
    let title = if held.is_empty() {
        "controller table: chosen action by state".to_string()
    } else {
        format!("controller table: chosen action by state ({})", held.join(", "))
    };
    Ok(leanstream_plot::heatmaps_svg(&title, &panels, 2)?)
}
