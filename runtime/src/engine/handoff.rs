//! The CPU twin of the paper's Table 3: what it costs to hand a layer's FFN
//! from I/O to compute in K stages, through per-stage ready flags (the
//! engine's way: compute polls a flag and starts on a stage the moment it
//! has landed, while the next one lands) against a barrier per stage (the
//! host synchronizing with the device between stages: land, wait, compute,
//! wait, land the next).
//!
//! One layer of Mistral-7B shape (4096 × 14,336, Q4_0 gate and up rows,
//! Q8_0 down columns: 8,960-byte bundles) lives in a "flash" buffer; the
//! landing thread copies each stage's bundles into the staging buffer (a
//! memory-speed stand-in for a read, so that the hand-off, not the disk,
//! is measured) and the compute thread runs stage 1 (the blocked kernels)
//! over each stage as it is handed over, then stage 2.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use leanstream_kernels::quantize::{quantize_row_q4_0, quantize_row_q8_0};
use leanstream_kernels::sparse_ffn::{run_activations, run_down, BundleFormat, DownLayout, FfnActivation, FfnRows};
use leanstream_kernels::{ActBuffer, GgmlType};
use rayon::prelude::*;

use crate::generate::sampler::Rng;
use crate::{Result, RuntimeError};

/// The layer shape of the measurement.
#[derive(Debug, Clone, Copy)]
pub struct HandoffShape {
    pub n_embd: usize,
    pub n_ff: usize,
}

impl HandoffShape {
    /// Mistral-7B's FFN.
    pub const MISTRAL_7B: Self = Self {
        n_embd: 4096,
        n_ff: 14336,
    };
}

/// Per-layer time of one K, in microseconds (medians over repetitions).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct HandoffRow {
    pub stages: usize,
    /// Ready flags: landing of stage k+1 overlaps compute of stage k.
    pub flags_us: f64,
    /// A barrier after each landing and each compute.
    pub barrier_us: f64,
    /// Landing alone and compute alone (the same work without hand-offs).
    pub land_only_us: f64,
    pub compute_only_us: f64,
}

impl HandoffRow {
    /// Time beyond the longer of landing and compute: what the hand-off
    /// costs (and what overlap could not hide).
    pub fn flags_overhead_us(&self) -> f64 {
        self.flags_us - self.land_only_us.max(self.compute_only_us)
    }

    pub fn barrier_overhead_us(&self) -> f64 {
        self.barrier_us - self.land_only_us.max(self.compute_only_us)
    }
}

/// One layer's bundles, the input rows and the scratch of its compute.
struct Layer {
    format: BundleFormat,
    n_ff: usize,
    flash: Vec<u8>,
    staging: Vec<u8>,
    gate_acts: ActBuffer,
    a: Vec<f32>,
    scratch: Vec<f32>,
    y: Vec<f32>,
}

impl Layer {
    fn new(shape: HandoffShape, seed: u64) -> Result<Self> {
        let format = BundleFormat::new(
            GgmlType::Q4_0,
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            DownLayout::Columns,
            shape.n_embd,
        )?;
        let (d, bb) = (shape.n_embd, format.bundle_bytes());
        let mut rng = Rng::new(seed);
        let mut row = vec![0f32; d];
        let mut flash = vec![0u8; shape.n_ff * bb];
        let (gb, ub) = (format.gate_bytes(), format.up_bytes());
        for b in flash.chunks_exact_mut(bb) {
            for (lo, hi) in [(0, gb), (gb, gb + ub)] {
                row.iter_mut().for_each(|v| *v = rng.next_f32() - 0.5);
                quantize_row_q4_0(&row, &mut b[lo..hi])?;
            }
            row.iter_mut().for_each(|v| *v = rng.next_f32() - 0.5);
            quantize_row_q8_0(&row, &mut b[gb + ub..bb])?;
        }
        let x: Vec<f32> = (0..d).map(|_| rng.next_f32() - 0.5).collect();
        let mut gate_acts = ActBuffer::with_capacity(d, 1);
        gate_acts.quantize(GgmlType::Q4_0.vec_dot_type(), &x, 1, d)?;
        Ok(Self {
            format,
            n_ff: shape.n_ff,
            staging: vec![0u8; flash.len()],
            flash,
            gate_acts,
            a: vec![0.0; shape.n_ff],
            scratch: vec![0.0; shape.n_ff],
            y: vec![0.0; d],
        })
    }

    /// Neurons `lo..hi` of the stages of `k`.
    fn stage(&self, k: usize, stages: usize) -> std::ops::Range<usize> {
        self.n_ff * k / stages..self.n_ff * (k + 1) / stages
    }

    /// Stage 1 over neurons `r` of `staging` (in parallel chunks, as the tail).
    fn compute(
        staging: &[u8],
        f: &BundleFormat,
        acts: &ActBuffer,
        r: std::ops::Range<usize>,
        a: &mut [f32],
        scratch: &mut [f32],
    ) -> Result<()> {
        const TASK: usize = 64;
        let bb = f.bundle_bytes();
        let rows = FfnRows::new(f, acts, acts)?;
        let bundles = &staging[r.start * bb..r.end * bb];
        a[r.clone()]
            .par_chunks_mut(TASK)
            .zip(scratch[r].par_chunks_mut(TASK))
            .zip(bundles.par_chunks(TASK * bb))
            .try_for_each(|((a, s), b)| run_activations(f, &rows, FfnActivation::Silu, b, a, s))?;
        Ok(())
    }

    fn down(&mut self) -> Result<()> {
        let ids: Vec<u32> = (0..self.n_ff as u32).collect();
        let bb = self.format.bundle_bytes();
        let staging = &self.staging;
        self.y.fill(0.0);
        run_down(
            &self.format,
            &ids,
            &self.a,
            self.n_ff,
            |i| &staging[i * bb..(i + 1) * bb],
            &mut self.y,
        )?;
        Ok(())
    }
}

/// How the landing thread hands a stage to compute.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Flags,
    Barrier,
}

/// Runs one layer in `stages` stages under `mode`; the elapsed seconds.
fn run_layer(layer: &mut Layer, stages: usize, mode: Mode) -> Result<f64> {
    let bb = layer.format.bundle_bytes();
    let landed = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(2));
    let start = Instant::now();
    let ranges: Vec<_> = (0..stages).map(|k| layer.stage(k, stages)).collect();
    let Layer {
        flash,
        staging,
        format,
        gate_acts,
        a,
        scratch,
        ..
    } = layer;
    // The landing side writes stage k's bytes and only then publishes k+1
    // in `landed` (Release); compute reads a stage only after seeing it
    // published (Acquire), so the two never touch the same bytes at once.
    let staging_ptr = staging.as_mut_ptr() as usize;
    let result = std::thread::scope(|sc| -> Result<()> {
        let (landed_w, barrier_w, ranges_w) = (Arc::clone(&landed), Arc::clone(&barrier), ranges.clone());
        let flash: &[u8] = flash;
        sc.spawn(move || {
            for r in ranges_w {
                let (lo, hi) = (r.start * bb, r.end * bb);
                // SAFETY: [lo, hi) is not yet published, so compute does not read it.
                unsafe {
                    std::ptr::copy_nonoverlapping(flash[lo..hi].as_ptr(), (staging_ptr as *mut u8).add(lo), hi - lo)
                };
                landed_w.fetch_add(1, Ordering::Release);
                if mode == Mode::Barrier {
                    barrier_w.wait(); // landed: the host synchronizes
                    barrier_w.wait(); // computed: the next stage may land
                }
            }
        });
        for (k, r) in ranges.iter().enumerate() {
            match mode {
                Mode::Flags => {
                    while landed.load(Ordering::Acquire) <= k {
                        std::hint::spin_loop();
                    }
                }
                Mode::Barrier => {
                    barrier.wait();
                }
            }
            // SAFETY: stage k is published (flag or barrier); the landing
            // thread writes only later stages while this reads it.
            let view = unsafe { std::slice::from_raw_parts(staging_ptr as *const u8, r.end * bb) };
            Layer::compute(view, format, gate_acts, r.clone(), a, scratch)?;
            if mode == Mode::Barrier {
                barrier.wait();
            }
        }
        Ok(())
    });
    result?;
    layer.down()?;
    Ok(start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The Table 3 measurement for each K of `stages`, `reps` repetitions each
/// (after one warm-up), interleaving the modes so they see the same machine.
pub fn measure(shape: HandoffShape, stages: &[usize], reps: usize) -> Result<Vec<HandoffRow>> {
    if stages.iter().any(|&k| k == 0 || k > shape.n_ff) {
        return Err(RuntimeError::Invalid(format!(
            "stage counts {stages:?}: each must be 1..={}",
            shape.n_ff
        )));
    }
    let mut layer = Layer::new(shape, 1)?;
    let reps = reps.max(1);
    let mut rows = Vec::new();
    for &k in stages {
        let (mut flags, mut barrier, mut land, mut compute) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..=reps {
            let f = run_layer(&mut layer, k, Mode::Flags)?;
            let b = run_layer(&mut layer, k, Mode::Barrier)?;
            let t = Instant::now();
            layer.staging.copy_from_slice(&layer.flash);
            let l = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let n = layer.n_ff;
            Layer::compute(
                &layer.staging,
                &layer.format,
                &layer.gate_acts,
                0..n,
                &mut layer.a,
                &mut layer.scratch,
            )?;
            layer.down()?;
            let c = t.elapsed().as_secs_f64();
            if rep > 0 {
                flags.push(f * 1e6);
                barrier.push(b * 1e6);
                land.push(l * 1e6);
                compute.push(c * 1e6);
            }
        }
        rows.push(HandoffRow {
            stages: k,
            flags_us: median(flags),
            barrier_us: median(barrier),
            land_only_us: median(land),
            compute_only_us: median(compute),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_hand_offs_compute_the_same_layer() {
        let shape = HandoffShape { n_embd: 256, n_ff: 512 };
        let mut layer = Layer::new(shape, 3).unwrap();
        run_layer(&mut layer, 1, Mode::Barrier).unwrap();
        let reference = layer.y.clone();
        assert!(reference.iter().any(|&v| v != 0.0));
        for k in [2, 4, 16] {
            for mode in [Mode::Flags, Mode::Barrier] {
                layer.staging.fill(0);
                run_layer(&mut layer, k, mode).unwrap();
                assert_eq!(layer.y, reference, "K={k}");
            }
        }
        let rows = measure(shape, &[1, 4], 1).unwrap();
        assert_eq!(rows.iter().map(|r| r.stages).collect::<Vec<_>>(), vec![1, 4]);
        assert!(rows
            .iter()
            .all(|r| r.flags_us > 0.0 && r.barrier_us > 0.0 && r.compute_only_us > 0.0));
        assert!(measure(shape, &[0], 1).is_err());
    }
}
