//! The FFN arithmetic of one layer over neuron bundles, token row by row:
//! stage 1 (activations, a pure function of each bundle, parallel over
//! neurons), the sparsity threshold, then stage 2 (the down sum in ascending
//! neuron id, parallel over output blocks). Neither parallel split changes
//! any floating-point operation or its order, so results do not depend on
//! the thread count, and every policy that keeps the same neurons gets the
//! same bits.

use leanstream_kernels::sparse_ffn::{
    accumulate_down_parallel, activation_with_gate, gate_dot, neuron_activation, BundleFormat, FfnActivation, FfnInput,
    LayerActivations,
};
use leanstream_kernels::ActBuffer;
use rayon::prelude::*;

use super::trace::{bit_is_set, set_bit};
use crate::Result;

/// Neurons per parallel task of stage 1.
const NEURON_CHUNK: usize = 128;

/// Which neurons a row computes.
#[derive(Clone, Copy)]
pub enum Select<'a> {
    /// All, then keep those with |a| at or above the threshold.
    Threshold(f32),
    /// The given per-row bitmaps (`words` each), all kept.
    Rows(&'a [u64]),
    /// Per-row bitmaps with the gate values `g` (n_ff per row) known.
    RowsWithGate(&'a [u64], &'a [f32]),
}

/// Scratch of the FFN arithmetic, allocated once.
pub struct Compute {
    pub act: FfnActivation,
    n_embd: usize,
    n_ff: usize,
    gate_acts: ActBuffer,
    up_acts: ActBuffer,
    layer_acts: LayerActivations,
    ids: Vec<u32>,
    a: Vec<f32>,
    /// Neurons kept / considered (for the achieved sparsity).
    pub kept: u64,
    pub considered: u64,
}

impl Compute {
    pub fn new(act: FfnActivation, n_embd: usize, n_ff: usize) -> Self {
        Self {
            act,
            n_embd,
            n_ff,
            gate_acts: ActBuffer::with_capacity(n_embd, 1),
            up_acts: ActBuffer::with_capacity(n_embd, 1),
            layer_acts: LayerActivations::new(n_ff),
            ids: Vec::with_capacity(n_ff),
            a: vec![0.0; n_ff],
            kept: 0,
            considered: 0,
        }
    }

    /// Words of one row bitmap.
    pub fn words(&self) -> usize {
        self.n_ff.div_ceil(64)
    }

    /// Converts row `x` for the gate and up dot products and returns the
    /// input view of both.
    fn convert<'s>(
        f: &BundleFormat,
        gate_acts: &'s mut ActBuffer,
        up_acts: &'s mut ActBuffer,
        x: &[f32],
    ) -> Result<FfnInput<'s>> {
        let (gate_ty, up_ty) = (f.gate_ty.vec_dot_type(), f.up_ty.vec_dot_type());
        gate_acts.quantize(gate_ty, x, 1, x.len())?;
        if up_ty != gate_ty {
            up_acts.quantize(up_ty, x, 1, x.len())?;
        }
        let (g, u): (&'s ActBuffer, &'s ActBuffer) = (gate_acts, up_acts);
        Ok(FfnInput::new(f, g, if up_ty != gate_ty { u } else { g }, 0)?)
    }

    /// `out[t] = FFN(xb[t])` for `n` rows; `bundles[i]` is neuron i's bundle
    /// (needed only for the neurons a row computes). With `record`, each
    /// row's kept set is written to its bitmap there.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        f: &BundleFormat,
        xb: &[f32],
        n: usize,
        out: &mut [f32],
        bundles: &[&[u8]],
        select: Select,
        mut record: Option<&mut [u64]>,
    ) -> Result<()> {
        let (d, words, act, n_ff) = (self.n_embd, self.words(), self.act, self.n_ff);
        let Self {
            gate_acts,
            up_acts,
            layer_acts,
            ids,
            a,
            kept,
            considered,
            ..
        } = self;
        for t in 0..n {
            let input = Self::convert(f, gate_acts, up_acts, &xb[t * d..(t + 1) * d])?;
            ids.clear();
            match select {
                Select::Threshold(_) => ids.extend(0..n_ff as u32),
                Select::Rows(bits) | Select::RowsWithGate(bits, _) => {
                    let row = &bits[t * words..(t + 1) * words];
                    ids.extend(super::trace::set_bits(row).map(|i| i as u32));
                }
            }
            let a = &mut a[..ids.len()];
            {
                let gates = match select {
                    Select::RowsWithGate(_, g) => Some(&g[t * n_ff..(t + 1) * n_ff]),
                    _ => None,
                };
                a.par_chunks_mut(NEURON_CHUNK)
                    .zip(ids.par_chunks(NEURON_CHUNK))
                    .try_for_each(|(a, ids)| {
                        a.iter_mut().zip(ids).try_for_each(|(ai, &i)| {
                            let b = bundles[i as usize];
                            *ai = match gates {
                                Some(g) => activation_with_gate(f, &input, act, g[i as usize], b)?,
                                None => neuron_activation(f, &input, act, b)?,
                            };
                            Ok::<_, leanstream_kernels::KernelError>(())
                        })
                    })?;
            }
            layer_acts.clear();
            let threshold = match select {
                Select::Threshold(th) => th,
                _ => 0.0,
            };
            let mut rec = record.as_deref_mut().map(|r| &mut r[t * words..(t + 1) * words]);
            for (&i, &ai) in ids.iter().zip(a.iter()) {
                // The dense path's rule (FfnHook::Sparsify): skip |a| < threshold.
                if ai.abs() < threshold {
                    continue;
                }
                layer_acts.set(i as usize, ai)?;
                if let Some(r) = rec.as_deref_mut() {
                    set_bit(r, i as usize);
                }
            }
            *kept += layer_acts.len() as u64;
            *considered += n_ff as u64;
            let y = &mut out[t * d..(t + 1) * d];
            y.fill(0.0);
            accumulate_down_parallel(f, layer_acts, |i| bundles[i], y)?;
        }
        Ok(())
    }

    /// Gate-first's decision: `g = gate · x` for every neuron of each row
    /// from the resident gate rows (`gate_rows`, n_ff rows in id order), and
    /// the rows' candidate sets `|act(g)| >= threshold` into `bits`; `union`
    /// gets their union.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_decide(
        &mut self,
        f: &BundleFormat,
        xb: &[f32],
        n: usize,
        gate_rows: &[u8],
        threshold: f32,
        g: &mut [f32],
        bits: &mut [u64],
        union: &mut [u64],
    ) -> Result<()> {
        let (d, words, act, n_ff) = (self.n_embd, self.words(), self.act, self.n_ff);
        let gb = f.gate_bytes();
        union.fill(0);
        for t in 0..n {
            let input = Self::convert(f, &mut self.gate_acts, &mut self.up_acts, &xb[t * d..(t + 1) * d])?;
            let gt = &mut g[t * n_ff..(t + 1) * n_ff];
            gt.par_chunks_mut(NEURON_CHUNK)
                .zip(gate_rows.par_chunks(NEURON_CHUNK * gb))
                .try_for_each(|(gs, rows)| {
                    gs.iter_mut()
                        .zip(rows.chunks_exact(gb))
                        .try_for_each(|(gi, row)| gate_dot(f, &input, row).map(|v| *gi = v))
                })?;
            let row = &mut bits[t * words..(t + 1) * words];
            row.fill(0);
            for (i, &gi) in gt.iter().enumerate() {
                if act.apply(gi, 1.0).abs() >= threshold {
                    set_bit(row, i);
                }
            }
            for (u, &b) in union.iter_mut().zip(row.iter()) {
                *u |= b;
            }
        }
        debug_assert!((0..n_ff).all(|i| !bit_is_set(union, i) || bits.chunks(words).any(|r| bit_is_set(r, i))));
        Ok(())
    }
}
