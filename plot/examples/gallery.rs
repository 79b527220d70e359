//! Writes one chart of each kind, with made-up data, to look at:
//! `cargo run -p leanstream-plot --example gallery -- OUT_DIR`.

use leanstream_plot::{heatmaps_svg, Heatmap, LineChart, Series};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    std::fs::create_dir_all(&out)?;
    let sweep = [
        Series {
            name: "dense-stream".into(),
            points: vec![(120.0, 18.0), (160.0, 21.0), (240.0, 24.0), (400.0, 26.0)],
        },
        Series {
            name: "speculate".into(),
            points: vec![(125.0, 22.0), (165.0, 27.0), (245.0, 30.0), (405.0, 31.0)],
        },
    ];
    let chart = LineChart {
        title: "decode tokens/s against memory",
        x_label: "accounted memory (MiB)",
        y_label: "decode (tokens/s)",
        x_log: false,
        y_min: None,
        y_max: None,
        series: &sweep,
    };
    std::fs::write(out.join("line.svg"), chart.to_svg()?)?;
    let cdf: Vec<Series> = [4.0, 64.0, 512.0]
        .iter()
        .map(|&kib: &f64| Series {
            name: format!("{kib} KiB"),
            points: (1..=100)
                .map(|i| (kib.sqrt() * 20.0 * (1.0 + i as f64 / 25.0).powi(2), i as f64 / 100.0))
                .collect(),
        })
        .collect();
    let chart = LineChart {
        title: "Read latency CDF by request size",
        x_label: "read latency (µs, log scale)",
        y_label: "fraction of reads at or below",
        x_log: true,
        y_min: None,
        y_max: Some(1.0),
        series: &cdf,
    };
    std::fs::write(out.join("cdf.svg"), chart.to_svg()?)?;
    let panel = Heatmap {
        title: "stages K".into(),
        x_label: "missing bytes (KiB)".into(),
        y_label: "read bandwidth (MB/s)".into(),
        x_ticks: ["64", "256", "1024"].map(String::from).to_vec(),
        y_ticks: ["200", "800"].map(String::from).to_vec(),
        values: vec![vec![1.0, 2.0, 4.0], vec![1.0, 1.0, 2.0]],
        value_label: "stages K (stages)".into(),
    };
    std::fs::write(
        out.join("heatmap.svg"),
        heatmaps_svg("chosen action by state", &[panel], 1)?,
    )?;
    Ok(())
}
