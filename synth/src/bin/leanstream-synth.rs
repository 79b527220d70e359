//! `leanstream-synth`: controller tables from profiled traces.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use leanstream_runtime::control::{AxisKind, ControlState, ControlTable};
use leanstream_synth::fit::fit_traces;
use leanstream_synth::inspect::{describe, heatmap_svg};
use leanstream_synth::model::{GridSpec, ModelParams};
use leanstream_synth::sim::{compare, SimConfig};
use leanstream_synth::solve::SolverSettings;
use leanstream_synth::synth::{synthesize, SynthConfig};

#[derive(Parser)]
#[command(
    version,
    about = "Offline synthesis from profiled traces: the controller table (.lstab)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct ModelArgs {
    /// Layers in the stack.
    #[arg(long, default_value_t = 30)]
    layers: usize,
    /// FFN neurons per layer.
    #[arg(long, default_value_t = 1536)]
    n_ff: usize,
    /// Bytes per neuron bundle.
    #[arg(long, default_value_t = 1856.0)]
    bundle_bytes: f64,
    /// Request size of the engine's reads (must be profiled), bytes.
    #[arg(long, default_value_t = 65536)]
    block: u64,
    /// Predictor recall at prefetch breadth 1.
    #[arg(long, default_value_t = 0.85)]
    recall: f64,
    /// Cost of skipping the whole active mass of a layer, µs.
    #[arg(long, default_value_t = 2000.0)]
    w_skip_us: f64,
    /// Cost of one wasted MiB, µs.
    #[arg(long, default_value_t = 100.0)]
    w_waste_us_per_mib: f64,
    /// MPC horizon in layers.
    #[arg(long, default_value_t = 3)]
    horizon: usize,
    /// Scenarios of the sample average.
    #[arg(long, default_value_t = 24)]
    scenarios: usize,
    /// Bins of the queued-bytes axis.
    #[arg(long, default_value_t = 4)]
    queued_bins: usize,
    /// Bins of the missing-bytes axis.
    #[arg(long, default_value_t = 12)]
    missing_bins: usize,
    /// Bins of the read-bandwidth axis.
    #[arg(long, default_value_t = 4)]
    bw_bins: usize,
    /// Bins of the compute-time axis.
    #[arg(long, default_value_t = 3)]
    compute_bins: usize,
    /// Bins of the layer-position axis.
    #[arg(long, default_value_t = 3)]
    position_bins: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl ModelArgs {
    fn config(&self) -> SynthConfig {
        SynthConfig {
            params: ModelParams {
                n_layers: self.layers,
                n_ff: self.n_ff,
                bundle_bytes: self.bundle_bytes,
                block: self.block,
                recall_at_1: self.recall,
                w_skip_us: self.w_skip_us,
                w_waste_us_per_mib: self.w_waste_us_per_mib,
                ..ModelParams::default()
            },
            solver: SolverSettings {
                horizon: self.horizon,
                scenarios: self.scenarios,
                ..SolverSettings::default()
            },
            grid: GridSpec {
                queued: self.queued_bins,
                missing: self.missing_bins,
                bandwidth: self.bw_bins,
                compute: self.compute_bins,
                position: self.position_bins,
            },
            seed: self.seed,
            ..SynthConfig::default()
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Fit the traces, solve the stochastic MPC for every grid state, write the table.
    Controller {
        #[arg(long)]
        traces: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        quiet: bool,
    },
    /// Print a table and write SVG heatmaps of its actions (FILE.svg unless --svg).
    Inspect {
        file: PathBuf,
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// Replay held-out trace samples: table vs best fixed action vs greedy vs online MPC.
    Simulate {
        #[arg(long)]
        table: PathBuf,
        #[arg(long)]
        traces: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        /// Simulated tokens (each one pass over the layers).
        #[arg(long, default_value_t = 40)]
        tokens: usize,
        /// Skip online MPC (slow).
        #[arg(long)]
        no_mpc: bool,
        #[arg(long)]
        json: bool,
    },
    /// Time the runtime's table lookup; prints JSON.
    Bench {
        file: PathBuf,
        #[arg(long, default_value_t = 2_000_000)]
        lookups: usize,
    },
}

/// Writes to stdout; a closed pipe (`| head`) ends the output quietly.
fn out(s: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(s.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn load(path: &Path) -> Result<(ControlTable, usize)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok((ControlTable::from_bytes(&bytes, path)?, bytes.len()))
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Controller {
            traces,
            out,
            model,
            quiet,
        } => {
            let cfg = model.config();
            let t0 = Instant::now();
            let fitted = fit_traces(&traces)?;
            let t_fit = t0.elapsed().as_secs_f64();
            let table = synthesize(&cfg, &fitted, !quiet)?;
            let t_all = t0.elapsed().as_secs_f64();
            table.save(&out)?;
            let size = std::fs::metadata(&out)
                .with_context(|| out.display().to_string())?
                .len();
            eprintln!(
                "wrote {}: {} bytes, {} states, {} actions; fit {:.1}s, synthesis total {:.1}s ({} threads)",
                out.display(),
                size,
                table.n_states(),
                table.codebook.len(),
                t_fit,
                t_all,
                rayon::current_num_threads()
            );
        }
        Cmd::Inspect { file, svg } => {
            let (t, n) = load(&file)?;
            out(&describe(&t, n))?;
            let svg = svg.unwrap_or_else(|| file.with_extension("svg"));
            std::fs::write(&svg, heatmap_svg(&t)).with_context(|| format!("writing {}", svg.display()))?;
            out(&format!("heatmaps: {}\n", svg.display()))?;
        }
        Cmd::Simulate {
            table,
            traces,
            model,
            tokens,
            no_mpc,
            json,
        } => {
            let (t, _) = load(&table)?;
            let cfg = model.config();
            let fitted = fit_traces(&traces)?;
            let sim = SimConfig { tokens, seed: cfg.seed };
            let rows = compare(&t, &cfg, &fitted, &sim, !no_mpc)?;
            if json {
                out(&format!("{}\n", serde_json::to_string_pretty(&rows)?))?;
            } else {
                let mut s = format!(
                    "{:<60} {:>10} {:>10} {:>10} {:>8} {:>12} {:>10}\n",
                    "policy", "mean_cost", "layer_us", "p99_us", "skipped", "wasted_B", "decide_us"
                );
                for r in &rows {
                    s += &format!(
                        "{:<60} {:>10.1} {:>10.1} {:>10.1} {:>8.4} {:>12.0} {:>10.2}\n",
                        r.policy,
                        r.mean_cost,
                        r.mean_layer_us,
                        r.p99_layer_us,
                        r.skipped_mass,
                        r.wasted_bytes,
                        r.decide_us
                    );
                }
                out(&s)?;
            }
        }
        Cmd::Bench { file, lookups } => {
            let (t, _) = load(&file)?;
            // Pre-generated states spread over (and beyond) the grid.
            let mut states = Vec::with_capacity(1024);
            let mut z = 0x1234_5678_u64;
            let mut u = || {
                z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (z >> 11) as f64 / (1u64 << 53) as f64
            };
            // Each axis spans from half its first center to 1.5x its last.
            let span = |k: AxisKind, u: f64| {
                t.axes.iter().find(|a| a.kind == k).map_or(u, |a| {
                    let c = &a.centers;
                    c[0] * 0.5 + u * (c[c.len() - 1] * 1.5 - c[0] * 0.5)
                })
            };
            for _ in 0..1024 {
                states.push(ControlState {
                    queued_bytes: span(AxisKind::QueuedBytes, u()),
                    missing_bytes: span(AxisKind::MissingBytes, u()),
                    read_bw_bytes_s: span(AxisKind::ReadBandwidth, u()),
                    compute_ns_per_neuron: span(AxisKind::ComputeNsPerNeuron, u()),
                    layer_position: u(),
                });
            }
            let mut acc = 0u64;
            let t0 = Instant::now();
            for i in 0..lookups {
                let a = t.lookup(std::hint::black_box(&states[i & 1023]));
                acc = acc.wrapping_add(a.queue_depth as u64);
            }
            let ns = t0.elapsed().as_nanos() as f64 / lookups as f64;
            std::hint::black_box(acc);
            out(&format!(
                "{}\n",
                serde_json::json!({"file": file.display().to_string(), "lookups": lookups, "ns_per_lookup": ns})
            ))?;
        }
    }
    Ok(())
}
