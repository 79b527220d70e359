//! The shared tail of every policy: take the layer's bundles as they become
//! available (all at once when resident, cache hits first and then runs in
//! arrival order when streamed), compute stage 1 over each run with the
//! blocked kernels, keep what the selection says, then stage 2 over the kept
//! neurons in ascending id (down columns), or the source's own down product
//! over the groups used (down tiles: with every group, the GGUF engine's
//! bits). Stage 1's values are pure functions of a bundle and a row, and
//! stage 2's order is fixed, so the output does not depend on arrival order,
//! run boundaries, batch size or thread count: every policy that keeps the
//! same neurons gets the same bits.

use std::time::Instant;

use leanstream_kernels::sparse_ffn::{
    run_activations, run_activations_split, run_down, BundleFormat, DownLayout, DownTiles, FfnActivation, FfnRows,
};
use leanstream_kernels::ActBuffer;
use rayon::prelude::*;

use super::stream::{LandedRun, Streamer};
use super::trace::{bit_is_set, set_bit};
use crate::Result;

/// Stage-1 values per piece of a run (bundles × rows): bounds the scratch
/// while letting one decode row take a whole layer in one parallel call.
const PIECE_VALUES: usize = 1 << 15;
/// Bundles per parallel task of stage 1.
const TASK: usize = 32;

/// Which neurons a row keeps.
#[derive(Clone, Copy)]
pub enum Select<'a> {
    /// Those with |a| at or above the threshold (all are computed).
    Threshold(f32),
    /// The given per-row bitmaps (`words` each).
    Rows(&'a [u64]),
}

/// Where a layer's bundles are.
pub enum Source {
    Resident(Resident),
    Stream(Box<Streamer>),
}

/// Every bundle in memory.
pub struct Resident {
    /// Per layer, all bundles in neuron order; where the down matrix is
    /// held whole, the gate rows and then the up rows instead (the source's
    /// two matrices: each stage-1 pass streams one of them).
    pub bundles: Vec<Vec<u8>>,
    /// Per layer with down tiles in the file, its down matrix gathered once
    /// (the source's row-major bytes, u64-backed for block alignment; its
    /// format is [`DownLayout::Matrix`]); empty for down columns.
    pub down: Vec<Vec<u64>>,
    /// Bytes of each `down` matrix.
    pub down_len: Vec<usize>,
}

impl Resident {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bundles
            .iter()
            .map(|b| b.len())
            .chain(self.down_len.iter().copied())
            .sum::<usize>() as u64
    }

    fn down(&self, l: usize) -> Option<&[u8]> {
        let m = self.down.get(l).filter(|m| !m.is_empty())?;
        Some(&bytemuck::cast_slice::<u64, u8>(m)[..self.down_len[l]])
    }
}

/// Stage-1 input: whole bundles back to back, or the same neurons' gate
/// rows and up rows held apart.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Bundles(&'a [u8]),
    Split { gate: &'a [u8], up: &'a [u8] },
}

impl<'a> Rows<'a> {
    fn count(&self, f: &BundleFormat) -> usize {
        match self {
            Self::Bundles(b) => b.len() / f.bundle_bytes().max(1),
            Self::Split { gate, .. } => gate.len() / f.gate_bytes().max(1),
        }
    }

    /// Neurons `i..j` of the run.
    fn slice(&self, f: &BundleFormat, i: usize, j: usize) -> Rows<'a> {
        match *self {
            Self::Bundles(b) => Self::Bundles(&b[i * f.bundle_bytes()..j * f.bundle_bytes()]),
            Self::Split { gate, up } => {
                let (gb, ub) = (f.gate_bytes(), f.up_bytes());
                Self::Split {
                    gate: &gate[i * gb..j * gb],
                    up: &up[i * ub..j * ub],
                }
            }
        }
    }

    fn activations(
        &self,
        f: &BundleFormat,
        rows: &FfnRows,
        act: FfnActivation,
        out: &mut [f32],
        scratch: &mut [f32],
    ) -> std::result::Result<(), leanstream_kernels::KernelError> {
        match *self {
            Self::Bundles(b) => run_activations(f, rows, act, b, out, scratch),
            Self::Split { gate, up } => run_activations_split(f, rows, act, gate, up, out, scratch),
        }
    }
}

/// Scratch and counters of the FFN arithmetic, allocated once.
pub struct Tail {
    pub act: FfnActivation,
    n_embd: usize,
    n_ff: usize,
    gate_acts: ActBuffer,
    up_acts: ActBuffer,
    /// `[rows][n_ff]` kept activations (0: not kept).
    a: Vec<f32>,
    /// Stage-1 values of a piece, `[bundle][row]`, and the up dots.
    piece: Vec<f32>,
    scratch: Vec<f32>,
    /// Neurons stage 2 visits, ascending (down columns), or the groups (tiles).
    ids: Vec<u32>,
    down_tiles: DownTiles,
    /// Rows the buffers are sized for (grown on a larger call, then kept).
    rows: usize,
    pub kept: u64,
    pub considered: u64,
    /// Wall time inside FFN calls (waits for bundles included).
    pub seconds: f64,
}

impl Tail {
    pub fn new(act: FfnActivation, n_embd: usize, n_ff: usize) -> Self {
        let mut t = Self {
            act,
            n_embd,
            n_ff,
            gate_acts: ActBuffer::with_capacity(n_embd, 1),
            up_acts: ActBuffer::with_capacity(n_embd, 1),
            a: Vec::new(),
            piece: Vec::new(),
            scratch: Vec::new(),
            ids: Vec::with_capacity(n_ff),
            down_tiles: DownTiles::new(),
            rows: 0,
            kept: 0,
            considered: 0,
            seconds: 0.0,
        };
        t.reserve(1);
        t
    }

    /// Words of one row bitmap.
    pub fn words(&self) -> usize {
        self.n_ff.div_ceil(64)
    }

    /// Bytes of scratch held.
    pub fn bytes(&self) -> u64 {
        Self::base_bytes(self.n_embd, self.n_ff, self.rows) + self.down_tiles.bytes()
    }

    /// Bytes of scratch for calls of up to `rows` rows over layers of
    /// `formats` (known before construction).
    pub fn bytes_for(formats: &[BundleFormat], n_ff: usize, rows: usize) -> u64 {
        let n_embd = formats.first().map_or(0, |f| f.n_embd);
        let tiles = formats
            .iter()
            .filter(|f| f.down_layout == DownLayout::Tiles)
            .map(|f| DownTiles::bytes_for(f.down_ty, n_embd, n_ff, rows))
            .max()
            .unwrap_or(0);
        Self::base_bytes(n_embd, n_ff, rows) + tiles
    }

    fn base_bytes(n_embd: usize, n_ff: usize, rows: usize) -> u64 {
        let rows = rows.max(1);
        // Two converted input buffers (f32 is the widest), the activation rows,
        // a piece's two value arrays, the id list.
        (2 * n_embd * rows * 4 + rows * n_ff * 4 + 2 * Self::piece(rows) * rows * 4 + n_ff * 4) as u64
    }

    /// Bundles per piece for calls of `rows` rows.
    fn piece(rows: usize) -> usize {
        (PIECE_VALUES / rows.max(1)).max(TASK)
    }

    fn reserve(&mut self, n: usize) {
        if n <= self.rows {
            return;
        }
        self.rows = n;
        self.gate_acts = ActBuffer::with_capacity(self.n_embd, n);
        self.up_acts = ActBuffer::with_capacity(self.n_embd, n);
        self.a = vec![0.0; n * self.n_ff];
        self.piece = vec![0.0; Self::piece(n) * n];
        self.scratch = vec![0.0; Self::piece(n) * n];
    }

    /// Converts the rows for the gate and up dot products.
    pub fn prepare(&mut self, f: &BundleFormat, xb: &[f32], n: usize) -> Result<()> {
        self.reserve(n);
        let (gate_ty, up_ty) = (f.gate_ty.vec_dot_type(), f.up_ty.vec_dot_type());
        self.gate_acts.quantize(gate_ty, xb, n, self.n_embd)?;
        if up_ty != gate_ty {
            self.up_acts.quantize(up_ty, xb, n, self.n_embd)?;
        }
        self.a[..n * self.n_ff].fill(0.0);
        Ok(())
    }

    /// `out[t] = FFN(xb[t])` for the `n` rows of layer `l` from `source`,
    /// keeping what `select` says; with `record`, each row's kept set is
    /// written to its bitmap there. `want` is the union of what any row may
    /// keep (`None`: every neuron).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        f: &BundleFormat,
        l: usize,
        xb: &[f32],
        n: usize,
        out: &mut [f32],
        source: &mut Source,
        select: Select,
        want: Option<&[u64]>,
        mut record: Option<&mut [u64]>,
    ) -> Result<()> {
        let start = Instant::now();
        self.prepare(f, xb, n)?;
        let bb = f.bundle_bytes();
        let wanted = |i: usize| want.is_none_or(|w| bit_is_set(w, i));
        match source {
            Source::Resident(resident) => {
                let all = &resident.bundles[l];
                let split = f.down_layout == DownLayout::Matrix;
                let (gb, ub, n_ff) = (f.gate_bytes(), f.up_bytes(), self.n_ff);
                let rows = |i: usize, j: usize| {
                    if split {
                        let up = n_ff * gb;
                        Rows::Split {
                            gate: &all[i * gb..j * gb],
                            up: &all[up + i * ub..up + j * ub],
                        }
                    } else {
                        Rows::Bundles(&all[i * bb..j * bb])
                    }
                };
                // Maximal runs of wanted neurons (in id order, as stored).
                let mut i = 0;
                while i < self.n_ff {
                    if !wanted(i) {
                        i += 1;
                        continue;
                    }
                    let j = (i..self.n_ff).find(|&j| !wanted(j)).unwrap_or(self.n_ff);
                    self.stage1(f, rows(i, j), |k| (i + k) as u32, n, select, record.as_deref_mut())?;
                    i = j;
                }
                // Split layers take their down from the matrix, not from bundles.
                let bundle = |i: usize| if split { &[][..] } else { &all[i * bb..(i + 1) * bb] };
                self.finish(f, n, out, want, bundle, resident.down(l))?;
            }
            Source::Stream(s) => {
                for &i in s.hits(l)? {
                    self.stage1(
                        f,
                        Rows::Bundles(s.cached(l, i)),
                        |_| i as u32,
                        n,
                        select,
                        record.as_deref_mut(),
                    )?;
                }
                while let Some(LandedRun {
                    bytes,
                    neurons,
                    requested,
                }) = s.next_run(l)?
                {
                    // Sub-runs of the neurons asked for (a merged read carries others).
                    let mut p = 0;
                    while p < neurons.len() {
                        if !requested[neurons[p] as usize] {
                            p += 1;
                            continue;
                        }
                        let q = (p..neurons.len())
                            .find(|&q| !requested[neurons[q] as usize])
                            .unwrap_or(neurons.len());
                        let ids = &neurons[p..q];
                        let run = Rows::Bundles(&bytes[p * bb..q * bb]);
                        self.stage1(f, run, |k| ids[k], n, select, record.as_deref_mut())?;
                        p = q;
                    }
                }
                let view = s.view(l)?;
                self.finish(f, n, out, want, |i| view.bundle(i), None)?;
            }
        }
        self.considered += (n * self.n_ff) as u64;
        self.seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Stage 1 over `run` (whole bundles back to back; bundle k is neuron
    /// `id(k)`), keeping by `select` into the activation rows.
    fn stage1(
        &mut self,
        f: &BundleFormat,
        run: Rows,
        id: impl Fn(usize) -> u32,
        n: usize,
        select: Select,
        mut record: Option<&mut [u64]>,
    ) -> Result<()> {
        let (act, words, n_ff) = (self.act, self.words(), self.n_ff);
        let up_acts = if f.up_ty.vec_dot_type() == f.gate_ty.vec_dot_type() {
            &self.gate_acts
        } else {
            &self.up_acts
        };
        let rows = FfnRows::new(f, &self.gate_acts, up_acts)?.as_matrix_of(n_ff);
        let piece = Self::piece(self.rows);
        let total = run.count(f);
        for (c, start) in (0..total).step_by(piece).enumerate() {
            let count = piece.min(total - start);
            let chunk = run.slice(f, start, start + count);
            let vals = &mut self.piece[..count * n];
            let scratch = &mut self.scratch[..count * n];
            if count > TASK {
                vals.par_chunks_mut(TASK * n)
                    .zip(scratch.par_chunks_mut(TASK * n))
                    .enumerate()
                    .try_for_each(|(t, (v, s))| {
                        let k = t * TASK;
                        chunk
                            .slice(f, k, (k + TASK).min(count))
                            .activations(f, &rows, act, v, s)
                    })?;
            } else {
                chunk.activations(f, &rows, act, vals, scratch)?;
            }
            for k in 0..count {
                let i = id(c * piece + k) as usize;
                for t in 0..n {
                    let a = vals[k * n + t];
                    let keep = match select {
                        // The dense path's rule (Sparsifier): skip |a| < threshold.
                        Select::Threshold(th) => a.abs().partial_cmp(&th) != Some(std::cmp::Ordering::Less),
                        Select::Rows(bits) => bit_is_set(&bits[t * words..(t + 1) * words], i),
                    };
                    if keep {
                        self.a[t * n_ff + i] = a;
                        self.kept += 1;
                        if let Some(r) = record.as_deref_mut() {
                            set_bit(&mut r[t * words..(t + 1) * words], i);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Stage 2: the kept neurons' down columns in ascending id, or the
    /// source's down product over the groups of the wanted neurons (tiles),
    /// or over `matrix`, the layer's down held whole.
    fn finish<'b>(
        &mut self,
        f: &BundleFormat,
        n: usize,
        out: &mut [f32],
        want: Option<&[u64]>,
        bundle: impl Fn(usize) -> &'b [u8] + Sync,
        matrix: Option<&[u8]>,
    ) -> Result<()> {
        let (a, y) = (&self.a[..n * self.n_ff], &mut out[..n * self.n_embd]);
        self.ids.clear();
        match f.down_layout {
            DownLayout::Columns => {
                match want {
                    None => self.ids.extend(0..self.n_ff as u32),
                    Some(w) => self.ids.extend(super::trace::set_bits(w).map(|i| i as u32)),
                }
                y.fill(0.0);
                run_down(f, &self.ids, a, self.n_ff, bundle, y)?;
            }
            DownLayout::Tiles => {
                let g = f.group();
                let n_groups = self.n_ff / g;
                match want {
                    None => self.ids.extend(0..n_groups as u32),
                    Some(w) => self
                        .ids
                        .extend(super::trace::groups_touched(w, self.n_ff, g).map(|grp| grp as u32)),
                }
                self.down_tiles.run(f, &self.ids, a, self.n_ff, bundle, y)?;
            }
            DownLayout::Matrix => {
                let m = matrix.ok_or_else(|| {
                    crate::RuntimeError::Invalid("a layer whose down matrix is held whole was given none".into())
                })?;
                self.down_tiles.run_matrix(f.down_ty, m, f.n_embd, a, self.n_ff, y)?;
            }
        }
        Ok(())
    }
}
