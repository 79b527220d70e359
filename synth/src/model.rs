//! The per-layer dynamics and cost of the control model (see the crate docs).

use leanstream_runtime::control::{Action, Axis, AxisKind, ControlState};
use serde::{Deserialize, Serialize};

use crate::fit::{Dists, Empirical, Needs};
use leanstream_runtime::generate::sampler::Rng;

/// Parameters of the model that are not measured by the profiler.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelParams {
    /// Layers in the stack.
    pub n_layers: usize,
    /// FFN neurons per layer.
    pub n_ff: usize,
    /// Bytes of one neuron bundle on flash.
    pub bundle_bytes: f64,
    /// Request size of the engine's (coalesced) reads; must be profiled.
    pub block: u64,
    /// Reference queue depth of the bandwidth state axis; must be profiled.
    pub ref_qd: u32,
    /// Predictor recall (activation mass covered) at prefetch breadth 1.
    pub recall_at_1: f64,
    /// Measured mass recall at each breadth, `(breadth, recall)` ascending
    /// (`eval::breadth_recall`); when present it replaces the
    /// `recall_at_1` curve.
    #[serde(default)]
    pub recall_by_breadth: Vec<(f64, f64)>,
    /// Bytes the engine read per token at each breadth over what it read at
    /// the widest, `(breadth, share)` ascending, the widest last (the engine
    /// probe's); when present, a layer reads at least that share of the
    /// widest breadth's load (see [`load`](Self::load)).
    #[serde(default)]
    pub read_share_by_breadth: Vec<(f64, f64)>,
    /// Neuron rows per layer the engine computes from its cache besides
    /// those it reads (they add compute, not reads; `engine_fit`).
    #[serde(default)]
    pub resident_rows: f64,
    /// Cost weight of one unit of skipped activation mass (the whole
    /// predicted-active mass of a layer), in µs.
    pub w_skip_us: f64,
    /// Cost weight of one MiB of wasted reads, in µs.
    pub w_waste_us_per_mib: f64,
}

impl Default for ModelParams {
    /// SmolLM2-135M: 30 layers, n_ff 1536, Q8_0 gate/up/down bundles of a
    /// 576-wide model (3 × 576 × 34/32 ≈ 1836 bytes, rounded to 1856 with padding).
    fn default() -> Self {
        Self {
            n_layers: 30,
            n_ff: 1536,
            bundle_bytes: 1856.0,
            block: 64 * 1024,
            ref_qd: 4,
            recall_at_1: 0.85,
            recall_by_breadth: Vec::new(),
            read_share_by_breadth: Vec::new(),
            resident_rows: 0.0,
            w_skip_us: 2000.0,
            w_waste_us_per_mib: 100.0,
        }
    }
}

/// The action codebook's axes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ActionSpace {
    pub stages: Vec<u8>,
    pub queue_depths: Vec<u16>,
    pub prefetch_breadths: Vec<f32>,
    pub deadline_factors: Vec<f32>,
}

impl Default for ActionSpace {
    fn default() -> Self {
        Self {
            stages: vec![1, 2, 4],
            queue_depths: vec![1, 4, 16],
            prefetch_breadths: vec![1.0, 1.5, 2.5],
            deadline_factors: vec![2.0, 8.0, 32.0],
        }
    }
}

impl ActionSpace {
    pub fn codebook(&self) -> Vec<Action> {
        let mut out = Vec::new();
        for &stages in &self.stages {
            for &queue_depth in &self.queue_depths {
                for &prefetch_breadth in &self.prefetch_breadths {
                    for &deadline_factor in &self.deadline_factors {
                        out.push(Action {
                            stages,
                            queue_depth,
                            prefetch_breadth,
                            deadline_factor,
                        });
                    }
                }
            }
        }
        out
    }
    pub fn needs(&self, p: &ModelParams) -> Needs {
        let mut queue_depths: Vec<u32> = self.queue_depths.iter().map(|&q| q as u32).collect();
        queue_depths.push(p.ref_qd);
        queue_depths.sort_unstable();
        queue_depths.dedup();
        let mut stages: Vec<u32> = self.stages.iter().map(|&k| k as u32).collect();
        stages.push(1);
        stages.sort_unstable();
        stages.dedup();
        Needs {
            block: p.block,
            queue_depths,
            stages,
        }
    }
}

/// Bins with thresholds at the midpoints of the centers.
pub fn axis(kind: AxisKind, centers: Vec<f64>) -> Axis {
    let thresholds = centers.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    Axis {
        kind,
        thresholds,
        centers,
    }
}

/// Bins per axis of the grid.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GridSpec {
    pub queued: usize,
    pub missing: usize,
    pub bandwidth: usize,
    pub compute: usize,
    pub position: usize,
}

impl Default for GridSpec {
    fn default() -> Self {
        Self {
            queued: 4,
            missing: 12,
            bandwidth: 4,
            compute: 3,
            position: 3,
        }
    }
}

fn linspace(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if n <= 1 {
        return vec![0.5 * (lo + hi)];
    }
    (0..n).map(|i| lo + (hi - lo) * i as f64 / (n - 1) as f64).collect()
}

/// Centers at the (i + 0.5)/n quantiles of `e`, or a ×0.5..×2 spread around
/// its median where the quantiles are not distinct.
fn quantile_centers(e: &Empirical, n: usize) -> Vec<f64> {
    let c: Vec<f64> = (0..n).map(|i| e.quantile((i as f64 + 0.5) / n as f64)).collect();
    if c.windows(2).all(|w| w[1] > w[0] * (1.0 + 1e-6)) {
        c
    } else {
        let m = e.median();
        linspace(0.5 * m, 2.0 * m, n)
    }
}

/// The grid: bytes axes spread over the layer's FFN bytes, bandwidth and
/// compute at quantiles of the fitted distributions, the layer stack in
/// equal parts.
pub fn grid(p: &ModelParams, g: &GridSpec, d: &Dists) -> Vec<Axis> {
    let layer = p.n_ff as f64 * p.bundle_bytes;
    let bw = &d.read_bw[&(p.block, p.ref_qd)];
    let scale = |v: Vec<f64>| v.into_iter().map(|x| x * layer).collect::<Vec<_>>();
    vec![
        axis(AxisKind::QueuedBytes, scale(linspace(0.0, 0.6, g.queued))),
        axis(AxisKind::MissingBytes, scale(linspace(0.05, 0.5, g.missing))),
        axis(AxisKind::ReadBandwidth, quantile_centers(bw, g.bandwidth)),
        axis(
            AxisKind::ComputeNsPerNeuron,
            quantile_centers(&d.ns_per_neuron, g.compute),
        ),
        axis(
            AxisKind::LayerPosition,
            (0..g.position).map(|i| (i as f64 + 0.5) / g.position as f64).collect(),
        ),
    ]
}

/// Everything the dynamics need, resolved for one action space: the
/// distributions indexed by action component.
#[derive(Clone, Debug)]
pub struct Env {
    pub params: ModelParams,
    pub codebook: Vec<Action>,
    /// Latency distribution per codebook queue depth (index parallel to `qds`).
    pub qds: Vec<u16>,
    pub lat: Vec<Empirical>,
    /// Latency distribution of one read with `m` reads in flight, at index
    /// `m - 1` for m up to the deepest profiled depth (see [`lat_in_flight`]).
    pub lat_in_flight: Vec<Empirical>,
    pub ks: Vec<u8>,
    pub split: Vec<Empirical>,
    pub ns_per_neuron: Empirical,
    /// Median bandwidth at the reference queue depth (B₅₀).
    pub bw_median: f64,
    /// Levels of queued bytes the MPC's recourse moves between (as many as
    /// the table's queued-bytes axis has bins; see `solve::prefetch_levels`).
    pub q_levels: usize,
}

impl Env {
    pub fn new(params: ModelParams, space: &ActionSpace, d: &Dists, q_levels: usize) -> Self {
        let qds = space.queue_depths.clone();
        let lat: Vec<Empirical> = qds
            .iter()
            .map(|&q| d.read_lat_us[&(params.block, q as u32)].clone())
            .collect();
        let lat_in_flight = lat_in_flight(&qds, &lat);
        let ks = space.stages.clone();
        let split = ks.iter().map(|&k| d.split_ratio[&(k as u32)].clone()).collect();
        let bw_median = d.read_bw[&(params.block, params.ref_qd)].median();
        Self {
            codebook: space.codebook(),
            qds,
            lat,
            lat_in_flight,
            ks,
            split,
            ns_per_neuron: d.ns_per_neuron.clone(),
            bw_median,
            q_levels,
            params,
        }
    }

    /// One layer's random draws: per queue depth the mean of 4 latency draws,
    /// per K a split ratio, and the compute noise (relative to the median).
    pub fn draw(&self, rng: &mut Rng) -> Draw {
        let lat_us = self
            .lat
            .iter()
            .map(|e| (0..4).map(|_| e.quantile(rng.uniform())).sum::<f64>() / 4.0)
            .collect();
        let split = self.split.iter().map(|e| e.quantile(rng.uniform())).collect();
        let m = self.ns_per_neuron.median();
        let compute_noise = self.ns_per_neuron.quantile(rng.uniform()) / m;
        Draw {
            lat_us,
            split,
            compute_noise,
        }
    }
}

/// The randomness of one layer.
#[derive(Clone, Debug)]
pub struct Draw {
    pub lat_us: Vec<f64>,
    pub split: Vec<f64>,
    pub compute_noise: f64,
}

/// What a layer cost and where it leaves the engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    pub cost: f64,
    pub layer_us: f64,
    pub skipped_mass: f64,
    pub wasted_bytes: f64,
    /// Bytes of the next layer prefetched during this layer's idle I/O time.
    pub next_queued: f64,
    /// Bytes this layer still had to read, and of those the ones that
    /// missed the deadline.
    pub read_wanted_bytes: f64,
    pub late_bytes: f64,
}

impl ModelParams {
    /// Activation mass covered by the top `b` × need of the predictor's
    /// ranking: the measured points interpolated linearly (from 0 at
    /// breadth 0, flat past the last), else `1 − (1 − r₁)^b`.
    pub fn recall(&self, b: f64) -> f64 {
        if self.recall_by_breadth.is_empty() {
            return 1.0 - (1.0 - self.recall_at_1).powf(b);
        }
        interpolate(&self.recall_by_breadth, b)
    }

    /// Bytes a layer missing `d` bytes asks for at breadth `b`: `b·d`, at
    /// most the whole layer; where the engine's read shares are measured,
    /// at least the share at `b` of what the widest breadth asks for. The
    /// engine re-ranks at each stage and reads the union of its picks, so
    /// a narrow breadth reads more than `b·d` (Gemma 3 and SmolLM2:
    /// breadth 1.5 read 0.99 and 1.00 of breadth 2.5's bytes), and a model
    /// charging `b·d` saw time saved that the engine never saves.
    pub fn load(&self, b: f64, d: f64) -> f64 {
        let whole = self.n_ff as f64 * self.bundle_bytes;
        let asked = (b * d).min(whole);
        match self.read_share_by_breadth.last() {
            Some(&(widest, _)) => {
                let share = interpolate(&self.read_share_by_breadth, b);
                asked.max(share * (widest * d).min(whole)).min(whole)
            }
            None => asked,
        }
    }
}

/// `points` (ascending x) interpolated linearly at `x`, from 0 at 0 and
/// flat past the last point, clamped to [0, 1].
fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    let mut prev = (0.0, 0.0);
    for &(px, py) in points {
        if x <= px {
            let f = if px > prev.0 { (x - prev.0) / (px - prev.0) } else { 1.0 };
            return (prev.1 + f * (py - prev.1)).clamp(0.0, 1.0);
        }
        prev = (px, py);
    }
    prev.1.clamp(0.0, 1.0)
}

/// One layer of the dynamics.
pub fn step(env: &Env, s: &ControlState, a: &Action, d: &Draw) -> Outcome {
    let p = &env.params;
    let qi = env.qds.iter().position(|&q| q == a.queue_depth).unwrap_or(0);
    let ki = env.ks.iter().position(|&k| k == a.stages).unwrap_or(0);
    let big_d = s.missing_bytes.max(0.0);
    let b = a.prefetch_breadth as f64;
    let load = p.load(b, big_d);
    let rec = p.recall(b);
    let useful_frac = if load > 0.0 { (rec * big_d / load).min(1.0) } else { 0.0 };
    // Reads: regime-scaled waves of requests.
    let regime = (s.read_bw_bytes_s / env.bw_median).max(1e-3);
    let remaining = (load - s.queued_bytes.max(0.0)).max(0.0);
    let n_req = (remaining / p.block as f64).ceil();
    // A queue fills only as far as there are reads: a few reads at depth 16
    // wait as long as a few reads in flight, not as long as sixteen. Between
    // the profiled depths the latency is interpolated linearly in the reads
    // in flight (a bandwidth-bound queue's latency grows with its depth):
    // the wave's draw, and quantile by quantile each read's distribution;
    // rounding down to the shallower depth made 15 reads in flight cost one
    // wave at depth 4, so queued bytes changed nothing below 16 reads.
    let in_flight = (a.queue_depth as f64).min(n_req.max(1.0));
    let (lo, hi, w) = depth_bracket(&env.qds, in_flight, qi);
    let waves = (n_req / in_flight).ceil();
    let lat = d.lat_us[qi] / regime;
    let wave_us = ((1.0 - w) * d.lat_us[lo] + w * d.lat_us[hi]) / regime;
    let t_read = waves * wave_us;
    // The engine computes every bundle it holds for the layer (the
    // thresholds select after the gate and up products), and its deadline
    // is d × the expected compute of the rows it asked for.
    let rows_wanted = load / p.bundle_bytes;
    let tc_expected = rows_wanted * s.compute_ns_per_neuron * 1e-3;
    let deadline = a.deadline_factor as f64 * tc_expected.max(1.0);
    // Reads not landed by the deadline are skipped: each read's own
    // latency counts, not the wave's mean, so the tail of the latency
    // distribution makes reads late even when the mean fits.
    let lat_one = &env.lat_in_flight[(in_flight as usize).clamp(1, env.lat_in_flight.len()) - 1];
    let frac_loaded = landed_fraction(lat_one, regime, n_req, in_flight, wave_us, deadline);
    let t_read_eff = t_read.min(deadline);
    let loaded_from_queue = s.queued_bytes.min(load);
    let read_bytes = remaining * frac_loaded;
    let loaded_total = loaded_from_queue + read_bytes;
    let loaded_frac_of_load = if load > 0.0 { loaded_total / load } else { 1.0 };
    let tc = (loaded_total / p.bundle_bytes + p.resident_rows)
        * s.compute_ns_per_neuron
        * 1e-3
        * d.compute_noise
        * d.split[ki].max(1.0);
    let k = a.stages as f64;
    let layer_us = t_read_eff.max(tc) + t_read_eff.min(tc) / k;
    let skipped_mass = 1.0 - rec * loaded_frac_of_load;
    let wasted_bytes = loaded_total * (1.0 - useful_frac);
    // Idle I/O time prefetches the next layer (nothing after the last layer).
    let last = s.layer_position * p.n_layers as f64 >= (p.n_layers - 1) as f64 - 1e-9;
    let bw_eff = p.block as f64 * a.queue_depth as f64 / lat.max(1e-3); // bytes per µs
    let next_queued = if last {
        0.0
    } else {
        ((layer_us - t_read_eff).max(0.0) * bw_eff).min(load)
    };
    let cost = layer_us + p.w_skip_us * skipped_mass + p.w_waste_us_per_mib * wasted_bytes / (1u64 << 20) as f64;
    Outcome {
        cost,
        layer_us,
        skipped_mass,
        wasted_bytes,
        next_queued,
        late_bytes: remaining - read_bytes,
        read_wanted_bytes: remaining,
    }
}

/// The profiled depths around `n` reads in flight, as indices into `qds`,
/// and the weight of the deeper one (0 at or below the shallowest depth, and
/// where `n` is a profiled depth); `fallback` where nothing is profiled at
/// or below `n`.
fn depth_bracket(qds: &[u16], n: f64, fallback: usize) -> (usize, usize, f64) {
    let lo = qds
        .iter()
        .enumerate()
        .filter(|(_, &q)| q as f64 <= n)
        .max_by_key(|(_, &q)| q)
        .map(|(i, _)| i);
    let hi = qds
        .iter()
        .enumerate()
        .filter(|(_, &q)| q as f64 >= n)
        .min_by_key(|(_, &q)| q)
        .map(|(i, _)| i);
    match (lo, hi) {
        (Some(l), Some(h)) if qds[h] > qds[l] => (l, h, (n - qds[l] as f64) / (qds[h] as f64 - qds[l] as f64)),
        (Some(l), _) => (l, l, 0.0),
        (None, Some(h)) => (h, h, 0.0),
        (None, None) => (fallback, fallback, 0.0),
    }
}

/// Per number of reads in flight m = 1..=the deepest of `qds`, the latency
/// distribution of one read: the profiled one at a profiled depth, between
/// two the quantile-wise linear interpolation of the two (each quantile
/// moves from the shallower depth's toward the deeper's), below the
/// shallowest the shallowest's. Interpolating the landed fractions instead
/// would let part of a deep wave land at the shallow depth's latency.
fn lat_in_flight(qds: &[u16], lat: &[Empirical]) -> Vec<Empirical> {
    let deepest = qds.iter().copied().max().unwrap_or(1).max(1) as usize;
    (1..=deepest)
        .map(|m| {
            let (lo, hi, w) = depth_bracket(qds, m as f64, 0);
            if w == 0.0 {
                return lat[lo].clone();
            }
            let n = lat[lo].len().max(lat[hi].len()).max(2);
            Empirical::new(
                (0..n)
                    .map(|i| {
                        let u = i as f64 / (n - 1) as f64;
                        (1.0 - w) * lat[lo].quantile(u) + w * lat[hi].quantile(u)
                    })
                    .collect(),
            )
        })
        .collect()
}

/// Expected fraction of `n` reads, issued `m` at a time every `wave_us`,
/// that land by `deadline_us`: a read of wave w lands at `w × wave_us` plus
/// its own latency, drawn from `lat` scaled by `regime`.
fn landed_fraction(lat: &Empirical, regime: f64, n: f64, m: f64, wave_us: f64, deadline_us: f64) -> f64 {
    if n <= 0.0 || !deadline_us.is_finite() {
        return 1.0;
    }
    let wave_us = wave_us.max(1e-9);
    let waves = (n / m).ceil() as usize;
    let slowest = lat.sorted.last().copied().unwrap_or(0.0) / regime;
    // Waves that start at least one slowest read before the deadline land
    // whole; only the few after them need the distribution.
    let whole = if deadline_us >= slowest {
        (((deadline_us - slowest) / wave_us).floor() as usize)
            .saturating_add(1)
            .min(waves)
    } else {
        0
    };
    let mut landed = (whole as f64 * m).min(n);
    for w in whole..waves {
        let start = w as f64 * wave_us;
        if start >= deadline_us {
            break;
        }
        let reads = (n - w as f64 * m).min(m);
        landed += reads * lat.cdf((deadline_us - start) * regime);
    }
    landed / n
}

/// Layers left after the one at `position` (inclusive of it).
pub fn layers_left(p: &ModelParams, position: f64) -> usize {
    let l = (position * p.n_layers as f64).round() as usize;
    p.n_layers.saturating_sub(l).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_in_the_latency_tail_miss_a_deadline_the_mean_meets() {
        // 90% of reads take 100 µs, 10% take 1000 µs: mean 190 µs.
        let mut v = vec![100.0; 90];
        v.extend([1000.0; 10]);
        let lat = Empirical::new(v);
        // One wave of 16 reads, deadline 500 µs: the tail's reads are late.
        let f = landed_fraction(&lat, 1.0, 16.0, 16.0, 190.0, 500.0);
        assert!(f > 0.85 && f < 0.95, "{f}");
        // No deadline, or one past the slowest read: all land.
        assert_eq!(landed_fraction(&lat, 1.0, 16.0, 16.0, 190.0, f64::INFINITY), 1.0);
        assert_eq!(landed_fraction(&lat, 1.0, 16.0, 16.0, 190.0, 1000.0), 1.0);
        // Before the fastest read: none land.
        assert_eq!(landed_fraction(&lat, 1.0, 16.0, 16.0, 190.0, 50.0), 0.0);
        // Three waves of 4: the third starts at 380 µs, so its reads need
        // at most 120 µs (90% do); the first two's fast reads are in.
        let f = landed_fraction(&lat, 1.0, 12.0, 4.0, 190.0, 500.0);
        assert!((f - 0.9).abs() < 0.02, "{f}");
        // A regime twice as fast halves every latency: all land.
        assert_eq!(landed_fraction(&lat, 2.0, 16.0, 16.0, 95.0, 500.0), 1.0);
    }

    #[test]
    fn a_measured_read_share_floors_a_narrow_breadths_load() {
        let mut p = ModelParams::default();
        let whole = p.n_ff as f64 * p.bundle_bytes;
        let d = 0.5 * whole;
        assert!((p.load(1.5, d) - 1.5 * d).abs() < 1e-6);
        assert!((p.load(2.5, d) - whole).abs() < 1e-6, "at most the layer");
        p.read_share_by_breadth = vec![(1.0, 0.8), (1.5, 0.99), (2.5, 1.0)];
        // The widest breadth asks for the whole layer; breadth 1.5 reads 99% of it.
        assert!((p.load(2.5, d) - whole).abs() < 1e-6);
        assert!((p.load(1.5, d) - 0.99 * whole).abs() < 1e-6);
        assert!((p.load(1.0, d) - 0.8 * whole).abs() < 1e-6);
        // Never less than asked for.
        p.read_share_by_breadth = vec![(1.0, 0.1), (2.5, 1.0)];
        assert!((p.load(1.0, d) - d).abs() < 1e-6);
    }

    #[test]
    fn measured_recall_is_interpolated_and_flat_past_the_last_breadth() {
        let mut p = ModelParams::default();
        assert!((p.recall(1.0) - 0.85).abs() < 1e-12);
        p.recall_by_breadth = vec![(1.0, 0.9), (2.0, 0.98)];
        assert!((p.recall(0.5) - 0.45).abs() < 1e-12);
        assert!((p.recall(1.0) - 0.9).abs() < 1e-12);
        assert!((p.recall(1.5) - 0.94).abs() < 1e-12);
        assert!((p.recall(3.0) - 0.98).abs() < 1e-12);
    }
}
