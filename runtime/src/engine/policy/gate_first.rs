//! `gate-first`: the gate rows stay resident; after attention the exact
//! `|act(g)|` of every neuron decides which bundles to read, then compute
//! takes them as they land. Reads skip the gate rows it holds (the streamer
//! fills them in, [`Streamer::hold_prefix`](crate::engine::Streamer::hold_prefix)). No
//! cross-layer overlap: the cost of precise decisions.

use leanstream_kernels::sparse_ffn::{gate_dot, BundleFormat, FfnInput};
use leanstream_kernels::ActBuffer;
use rayon::prelude::*;
use std::sync::Arc;

use super::{streamer, FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::plan::Select;
use crate::engine::source::Source;
use crate::engine::stream::Want;
use crate::engine::tail::Tail;
use crate::engine::trace::set_bit;
use crate::Result;

/// Gate rows per parallel task of the decision.
const TASK: usize = 128;

pub(crate) struct GateFirst {
    /// Per layer, the gate rows in neuron order.
    gate_rows: Arc<Vec<Vec<u8>>>,
    formats: Vec<BundleFormat>,
    /// The rows converted for the gate and up dot types (`FfnInput` wants both).
    gate_acts: ActBuffer,
    up_acts: ActBuffer,
    /// Rows the scratch is sized for.
    rows: usize,
    /// The gate pre-activations of a call's rows, `[rows][n_ff]`.
    gate_values: Vec<f32>,
    /// Candidate bitmaps of a call's rows, and their union.
    row_bits: Vec<u64>,
    union: Vec<u64>,
}

impl GateFirst {
    pub(crate) fn new(gate_rows: Arc<Vec<Vec<u8>>>, formats: Vec<BundleFormat>, n_embd: usize) -> Self {
        Self {
            gate_rows,
            formats,
            gate_acts: ActBuffer::with_capacity(n_embd, 1),
            up_acts: ActBuffer::with_capacity(n_embd, 1),
            rows: 1,
            gate_values: Vec::new(),
            row_bits: Vec::new(),
            union: Vec::new(),
        }
    }

    /// Scratch for a call of `n` rows (kept for the next calls).
    fn reserve(&mut self, n: usize, n_embd: usize, n_ff: usize, words: usize) {
        if n > self.rows {
            self.rows = n;
            self.gate_acts = ActBuffer::with_capacity(n_embd, n);
            self.up_acts = ActBuffer::with_capacity(n_embd, n);
        }
        self.gate_values.resize(self.gate_values.len().max(n * n_ff), 0.0);
        self.row_bits.resize(self.row_bits.len().max(n * words), 0);
        self.union.resize(words, 0);
    }
}

impl FfnPolicy for GateFirst {
    fn kind(&self) -> Policy {
        Policy::GateFirst
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, tail: &Tail) -> Result<Plan<'p>> {
        let f = self.formats[call.layer];
        let (n, d, words) = (call.n, f.n_embd, tail.words());
        let gb = f.gate_bytes();
        let n_ff = self.gate_rows[call.layer].len() / gb.max(1);
        self.reserve(n, d, n_ff, words);
        let (gate_ty, up_ty) = (f.gate_ty.vec_dot_type(), f.up_ty.vec_dot_type());
        self.gate_acts.quantize(gate_ty, &call.xb[..n * d], n, d)?;
        if up_ty != gate_ty {
            self.up_acts.quantize(up_ty, &call.xb[..n * d], n, d)?;
        }
        let up_acts = if up_ty != gate_ty {
            &self.up_acts
        } else {
            &self.gate_acts
        };
        self.union.fill(0);
        let act = tail.act;
        for t in 0..n {
            let input = FfnInput::new(&f, &self.gate_acts, up_acts, t)?;
            let g = &mut self.gate_values[t * n_ff..(t + 1) * n_ff];
            g.par_chunks_mut(TASK)
                .zip(self.gate_rows[call.layer].par_chunks(TASK * gb))
                .try_for_each(|(gs, rows)| {
                    gs.iter_mut()
                        .zip(rows.chunks_exact(gb))
                        .try_for_each(|(gi, row)| gate_dot(&f, &input, row).map(|v| *gi = v))
                })?;
            let row = &mut self.row_bits[t * words..(t + 1) * words];
            row.fill(0);
            for (i, &gi) in g.iter().enumerate() {
                if act.apply(gi, 1.0).abs() >= call.gate_threshold {
                    set_bit(row, i);
                }
            }
            for (u, &b) in self.union.iter_mut().zip(row.iter()) {
                *u |= b;
            }
        }
        let s = streamer(source)?;
        s.ensure(call.layer, Want::Set(&self.union))?;
        Ok(Plan::new(Select::Rows(&self.row_bits[..n * words]), Some(&self.union)))
    }

    fn held_bytes(&self) -> u64 {
        self.gate_rows.iter().map(|r| r.len() as u64).sum()
    }

    fn scratch_bytes(&self) -> u64 {
        (self.gate_values.capacity() * 4 + self.row_bits.capacity() * 8 + self.union.capacity() * 8) as u64
    }
}
