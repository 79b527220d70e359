//! Blocked forms of the two stages, for runs of bundles that sit back to back
//! in memory (a layer held in neuron order, a staged read from flash) and for
//! several token rows at once (prefill).
//!
//! Everything is checked once per call, not once per neuron: the format, the
//! input rows, the run's length. The gate and up dots of a run go through the
//! same tile kernels as [`crate::matmul`] (weight rows × activation rows per
//! call), and every output is exactly one vec-dot of one weight row with one
//! activation row, so [`run_activations`] gives, bit for bit, what
//! [`super::neuron_activation`] gives bundle by bundle and row by row; or,
//! with [`FfnRows::as_matrix_of`], what `matmul` gives over the layer's
//! matrices (repacked Q4_K, tiled K-quants), which is the GGUF engine's.
//! [`run_down`] adds each row's neurons in ascending id order with one fused
//! multiply-add per element and neuron, as [`super::accumulate_down`] does, so
//! each output row is bit-identical to it whatever the row count, the split
//! across threads or the order in which stage 1 saw the bundles.

use bytemuck::Pod;
use rayon::prelude::*;

use super::{axpy_scalar_unchecked, BundleFormat, FfnActivation};
use crate::blocks::{cast_blocks, BlockQ4K, BlockQ8K};
#[cfg(target_arch = "x86_64")]
use crate::blocks::{BlockQ5_0, BlockQ6K, BlockQ8_0};
use crate::dot::{has_simd_kernels, with_kernel, with_tiled_kernel, Kernel, KernelUser, Path};
#[cfg(target_arch = "x86_64")]
use crate::matmul::PanelKernel;
use crate::matmul::{uses_tiled_kquant, ActBuffer, Q4kRepacked, Tiles};
use crate::repack;
use crate::{GgmlType, KernelError};

/// Weight rows (bundles) handed to a tile kernel together.
const ROW_TILE: usize = 4;
/// Activation rows handed to a tile kernel together.
const TOKEN_TILE: usize = 8;
/// Most weight rows handed to a kernel together for one activation row.
const DECODE_ROW_TILE: usize = 8;
/// Fewest: bundle rows are strided, and two streams hide more latency.
const STRIDED_DECODE_LANES: usize = 2;

/// The FFN inputs of `n` token rows, converted for the gate and up rows' dot
/// types (checked once against the format).
#[derive(Debug, Clone, Copy)]
pub struct FfnRows<'a> {
    gate: &'a ActBuffer,
    up: &'a ActBuffer,
    /// Rows of the gate and up matrices the dots stand for (0: none).
    matrix_rows: usize,
}

impl<'a> FfnRows<'a> {
    /// Pass the same buffer twice when gate and up share a dot type.
    pub fn new(format: &BundleFormat, gate: &'a ActBuffer, up: &'a ActBuffer) -> Result<Self, KernelError> {
        format.validate()?;
        for (acts, ty, what) in [
            (gate, format.gate_ty, "FFN gate input"),
            (up, format.up_ty, "FFN up input"),
        ] {
            let expected = ty.vec_dot_type();
            if acts.dot_type() != expected {
                return Err(KernelError::TypeMismatch {
                    what,
                    expected,
                    got: acts.dot_type(),
                });
            }
            if acts.cols() != format.n_embd {
                return Err(KernelError::Length {
                    what,
                    expected: format.n_embd,
                    got: acts.cols(),
                });
            }
        }
        if gate.n() != up.n() {
            return Err(KernelError::Length {
                what: "FFN up input rows",
                expected: gate.n(),
                got: up.n(),
            });
        }
        Ok(Self {
            gate,
            up,
            matrix_rows: 0,
        })
    }

    /// Computes as the dense path's `matmul` over gate and up matrices of
    /// `n_ff` rows does (repacked Q4_K where `n_ff` is a multiple of 8, the
    /// tiled K-quant products for 8+ rows): the same bits as the GGUF
    /// engine. Without it every output is one vec-dot, as
    /// [`super::neuron_activation`] computes it.
    pub fn as_matrix_of(self, n_ff: usize) -> Self {
        Self {
            matrix_rows: n_ff,
            ..self
        }
    }

    /// Token rows.
    pub fn n(&self) -> usize {
        self.gate.n()
    }
}

/// Stage 1 over a run of whole bundles back to back: for bundle j of `run`
/// and token row t, `out[j * rows.n() + t] = act(gate_j · x_t) * (up_j · x_t)`.
/// `scratch` holds at least as many values as `out` (the up dots).
pub fn run_activations(
    format: &BundleFormat,
    rows: &FfnRows,
    act: FfnActivation,
    run: &[u8],
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    activations_on(format, rows, act, run, out, scratch, Path::Fastest)
}

/// The portable twin of [`run_activations`] (GGML's generic dots).
pub fn run_activations_scalar(
    format: &BundleFormat,
    rows: &FfnRows,
    act: FfnActivation,
    run: &[u8],
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    activations_on(format, rows, act, run, out, scratch, Path::Scalar)
}

/// Stage 1 over `count` bundles that start `stride` bytes apart (slots of
/// the neuron cache, whose stride rounds a bundle up): the same values as
/// [`run_activations`] over the same bundles back to back, without copying
/// them together first.
#[allow(clippy::too_many_arguments)]
pub fn run_activations_strided(
    format: &BundleFormat,
    rows: &FfnRows,
    act: FfnActivation,
    bundles: &[u8],
    stride: usize,
    count: usize,
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    let bb = format.bundle_bytes();
    let needed = count.checked_sub(1).map_or(0, |c| c * stride + bb);
    if bb == 0 || stride < bb || bundles.len() < needed {
        return Err(KernelError::ByteLength {
            what: "strided run of neuron bundles",
            expected: needed.max(bb),
            got: bundles.len(),
        });
    }
    let (gate, up) = ((bundles, 0, stride), (bundles, format.gate_bytes(), stride));
    stage1_on(format, rows, act, gate, up, count, out, scratch, Path::Fastest)
}

/// Stage 1 over the same neurons' gate rows and up rows held apart, each
/// back to back (a resident layer laid out as the source's two matrices):
/// the same values as [`run_activations`] over their bundles.
pub fn run_activations_split(
    format: &BundleFormat,
    rows: &FfnRows,
    act: FfnActivation,
    gate_rows: &[u8],
    up_rows: &[u8],
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    let (gb, ub) = (format.gate_bytes(), format.up_bytes());
    let count = gate_rows.len() / gb.max(1);
    if gb == 0 || ub == 0 || gate_rows.len() != count * gb || up_rows.len() != count * ub {
        return Err(KernelError::ByteLength {
            what: "gate and up rows of a split run",
            expected: count * (gb + ub),
            got: gate_rows.len() + up_rows.len(),
        });
    }
    let gate = (gate_rows, 0, gb);
    let up = (up_rows, 0, ub);
    stage1_on(format, rows, act, gate, up, count, out, scratch, Path::Fastest)
}

fn activations_on(
    format: &BundleFormat,
    rows: &FfnRows,
    act: FfnActivation,
    run: &[u8],
    out: &mut [f32],
    scratch: &mut [f32],
    path: Path,
) -> Result<(), KernelError> {
    let bb = format.bundle_bytes();
    if bb == 0 || !run.len().is_multiple_of(bb) {
        return Err(KernelError::ByteLength {
            what: "run of neuron bundles",
            expected: run.len() / bb.max(1) * bb,
            got: run.len(),
        });
    }
    let count = run.len() / bb;
    let (gate, up) = ((run, 0, bb), (run, format.gate_bytes(), bb));
    stage1_on(format, rows, act, gate, up, count, out, scratch, path)
}

/// Gate rows at `gate.1 + j * gate.2` in `gate.0`, up rows likewise.
#[allow(clippy::too_many_arguments)]
fn stage1_on(
    format: &BundleFormat,
    rows: &FfnRows,
    act: FfnActivation,
    gate: (&[u8], usize, usize),
    up: (&[u8], usize, usize),
    count: usize,
    out: &mut [f32],
    scratch: &mut [f32],
    path: Path,
) -> Result<(), KernelError> {
    let n = rows.n();
    let values = count * n;
    if out.len() < values || scratch.len() < values {
        return Err(KernelError::Length {
            what: "stage-1 output",
            expected: values,
            got: out.len().min(scratch.len()),
        });
    }
    let gate = StridedDots {
        run: gate.0,
        offset: gate.1,
        row_bytes: format.gate_bytes(),
        stride: gate.2,
        count,
        acts: rows.gate,
        out: &mut out[..values],
    };
    like_matmul(format.gate_ty, rows.matrix_rows, path, gate)?;
    let up = StridedDots {
        run: up.0,
        offset: up.1,
        row_bytes: format.up_bytes(),
        stride: up.2,
        count,
        acts: rows.up,
        out: &mut scratch[..values],
    };
    like_matmul(format.up_ty, rows.matrix_rows, path, up)?;
    act.apply_slice(&mut out[..values], &scratch[..values]);
    Ok(())
}

/// The dots of `job` in the arithmetic `matmul` uses for a matrix of
/// `matrix_rows` rows of `ty` (0: one vec-dot per output, always).
fn like_matmul(ty: GgmlType, matrix_rows: usize, path: Path, job: StridedDots) -> Result<(), KernelError> {
    let n = job.acts.arith_rows();
    if matrix_rows > 0 && ty == GgmlType::Q4K && repack::q4k_is_repacked(matrix_rows) {
        let kernel = Q4kRepacked::new(path, job.acts);
        return job.strided::<BlockQ4K, BlockQ8K, _>(kernel);
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = PanelKernel::q5_0(ty, path, job.acts) {
        return job.strided::<BlockQ5_0, BlockQ8_0, _>(kernel);
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = PanelKernel::q6_k(ty, matrix_rows, path, job.acts).filter(|_| matrix_rows > 0) {
        return job.strided::<BlockQ6K, BlockQ8K, _>(kernel);
    }
    if matrix_rows > 0 && uses_tiled_kquant(ty, matrix_rows, n) {
        return with_tiled_kernel(ty, path, job)?;
    }
    with_kernel(ty, path, job)?
}

/// `out[j * n + t] = dot(row j, activation row t)` for `count` weight rows of
/// `row_bytes` at `offset + j * stride` in `run`.
struct StridedDots<'a> {
    run: &'a [u8],
    offset: usize,
    row_bytes: usize,
    stride: usize,
    count: usize,
    acts: &'a ActBuffer,
    out: &'a mut [f32],
}

impl KernelUser for StridedDots<'_> {
    type Output = Result<(), KernelError>;

    fn run<W: Pod + Sync, A: Pod + Sync>(self, kernel: Kernel<W, A>) -> Self::Output {
        self.strided(kernel)
    }
}

impl StridedDots<'_> {
    fn strided<W: Pod + Sync, A: Pod + Sync, K: Tiles<W, A>>(self, kernel: K) -> Result<(), KernelError> {
        let n = self.acts.n();
        let row = |j: usize| -> Result<&[W], KernelError> {
            let start = self.offset + j * self.stride;
            cast_blocks::<W>(&self.run[start..start + self.row_bytes], "bundle weight row")
        };
        if n == 1 {
            // One row: the kernel's rows come from separate stretches of the
            // run, so memory sees a few long streams (as `matmul` decodes).
            let a = [cast_blocks::<A>(self.acts.row(0), "FFN input row")?];
            // Rows strided by the bundle size take at least two streams even
            // where a contiguous matrix prefers one: they gain from the
            // overlap (Q5_0 gate/up of Gemma 3: 1.1x per token). Rows back
            // to back (a layer held whole in the source's matrices) stream
            // as `matmul` streams them.
            let fewest = if self.stride == self.row_bytes {
                1
            } else {
                STRIDED_DECODE_LANES
            };
            let lanes = kernel.decode_rows().clamp(fewest, DECODE_ROW_TILE);
            let lane_len = self.count / lanes;
            let mut w_refs: [&[W]; DECODE_ROW_TILE] = [&[]; DECODE_ROW_TILE];
            let mut tmp = [0f32; DECODE_ROW_TILE];
            for k in 0..lane_len {
                for (lane, w) in w_refs[..lanes].iter_mut().enumerate() {
                    *w = row(lane * lane_len + k)?;
                }
                kernel.dot(&w_refs[..lanes], &a, 0, &mut tmp[..lanes]);
                for (lane, &v) in tmp[..lanes].iter().enumerate() {
                    self.out[lane * lane_len + k] = v;
                }
            }
            for j in lanes * lane_len..self.count {
                kernel.dot(&[row(j)?], &a, 0, &mut tmp[..1]);
                self.out[j] = tmp[0];
            }
            return Ok(());
        }
        let mut tmp = [0f32; ROW_TILE * TOKEN_TILE];
        // Token tiles never straddle the kernel's split (repacked Q4_K's gemm rows).
        let split = kernel.token_split().min(n);
        let tiles = (0..split)
            .step_by(TOKEN_TILE)
            .map(|t0| (t0, TOKEN_TILE.min(split - t0)))
            .chain((split..n).step_by(TOKEN_TILE).map(|t0| (t0, TOKEN_TILE.min(n - t0))));
        for (t0, tn) in tiles {
            let mut a_refs: [&[A]; TOKEN_TILE] = [&[]; TOKEN_TILE];
            for (t, r) in a_refs[..tn].iter_mut().enumerate() {
                *r = cast_blocks::<A>(self.acts.row(t0 + t), "FFN input row")?;
            }
            for j0 in (0..self.count).step_by(ROW_TILE) {
                let rn = ROW_TILE.min(self.count - j0);
                let mut w_refs: [&[W]; ROW_TILE] = [&[]; ROW_TILE];
                for (k, w) in w_refs[..rn].iter_mut().enumerate() {
                    *w = row(j0 + k)?;
                }
                kernel.dot(&w_refs[..rn], &a_refs[..tn], t0, &mut tmp[..rn * tn]);
                for k in 0..rn {
                    let dst = (j0 + k) * n + t0;
                    self.out[dst..dst + tn].copy_from_slice(&tmp[k * tn..(k + 1) * tn]);
                }
            }
        }
        Ok(())
    }
}

/// Stage 2 for `n` token rows: `ys[t] += Σ_i a[t][i] · down_i` over the
/// neurons `ids` (strictly ascending), skipping `a[t][i] == 0`; `a` is
/// `[n][n_ff]`, `ys` is `[n][n_embd]`, `bundle(i)` neuron i's whole bundle.
/// Parallel over output columns (one row) or rows (several), never changing
/// any element's sequence of operations.
pub fn run_down<'b>(
    format: &BundleFormat,
    ids: &[u32],
    a: &[f32],
    n_ff: usize,
    bundle: impl Fn(usize) -> &'b [u8] + Sync,
    ys: &mut [f32],
) -> Result<(), KernelError> {
    down_on(
        format,
        ids,
        a,
        n_ff,
        bundle_columns(format, bundle),
        ys,
        has_simd_kernels(),
        true,
    )
}

/// Single-threaded scalar twin of [`run_down`] (same bits).
pub fn run_down_scalar<'b>(
    format: &BundleFormat,
    ids: &[u32],
    a: &[f32],
    n_ff: usize,
    bundle: impl Fn(usize) -> &'b [u8] + Sync,
    ys: &mut [f32],
) -> Result<(), KernelError> {
    down_on(format, ids, a, n_ff, bundle_columns(format, bundle), ys, false, false)
}

/// [`run_down`] with each neuron's down column given alone (`column(i)`:
/// [`BundleFormat::down_bytes`] bytes), for a caller that keeps the columns
/// apart from their bundles (a streamed layer, whose bundles are released
/// as soon as stage 1 has seen them). Same bits as [`run_down`].
pub fn run_down_columns<'b>(
    format: &BundleFormat,
    ids: &[u32],
    a: &[f32],
    n_ff: usize,
    column: impl Fn(usize) -> &'b [u8] + Sync,
    ys: &mut [f32],
) -> Result<(), KernelError> {
    let down_bytes = format.down_bytes();
    let column = move |i: usize| -> Result<&'b [u8], KernelError> {
        let c = column(i);
        if c.len() != down_bytes {
            return Err(KernelError::ByteLength {
                what: "down column",
                expected: down_bytes,
                got: c.len(),
            });
        }
        Ok(c)
    };
    down_on(format, ids, a, n_ff, column, ys, has_simd_kernels(), true)
}

/// Neuron i's down column out of its whole bundle (`bundle(i)`), checked.
/// (The sizes are worked out once here, not per neuron as
/// [`BundleFormat::down_part`] would: this runs per neuron and task.)
fn bundle_columns<'b>(
    format: &BundleFormat,
    bundle: impl Fn(usize) -> &'b [u8] + Sync,
) -> impl Fn(usize) -> Result<&'b [u8], KernelError> + Sync {
    let down_at = format.gate_bytes() + format.up_bytes();
    let bb = format.bundle_bytes();
    move |i: usize| {
        let b = bundle(i);
        if b.len() != bb {
            return Err(KernelError::ByteLength {
                what: "neuron bundle",
                expected: bb,
                got: b.len(),
            });
        }
        Ok(&b[down_at..])
    }
}

#[allow(clippy::too_many_arguments)]
fn down_on<'b>(
    format: &BundleFormat,
    ids: &[u32],
    a: &[f32],
    n_ff: usize,
    column: impl Fn(usize) -> Result<&'b [u8], KernelError> + Sync,
    ys: &mut [f32],
    simd: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    format.validate_columns()?;
    let d = format.n_embd;
    if d == 0 || !ys.len().is_multiple_of(d) || a.len() != ys.len() / d * n_ff {
        return Err(KernelError::Length {
            what: "stage-2 rows (activations per output row)",
            expected: ys.len() / d.max(1) * n_ff,
            got: a.len(),
        });
    }
    if ids.windows(2).any(|w| w[0] >= w[1]) || ids.last().is_some_and(|&i| i as usize >= n_ff) {
        return Err(KernelError::Length {
            what: "stage-2 neuron ids (ascending, below n_ff)",
            expected: n_ff,
            got: ids.last().map_or(0, |&i| i as usize),
        });
    }
    let n = ys.len() / d;
    let (down_ty, down_bytes) = (format.down_ty, format.down_bytes());
    let blk = down_ty.block_size();
    let blk_bytes = down_ty.row_bytes(blk)?;
    // One output row over every neuron, columns `cols` of each down column.
    // A group of four is computed once the next one is gathered and its
    // columns asked of memory: the columns are scattered (a task reads its
    // part of each), and waiting for each group's first touch of them was a
    // third of the products' time. The order of the adds is unchanged.
    let row = |a: &[f32], cols: std::ops::Range<usize>, y: &mut [f32]| -> Result<(), KernelError> {
        let mut group: [(f32, &[u8]); 4] = [(0.0, &[]); 4];
        let mut pending: Option<[(f32, &[u8]); 4]> = None;
        let mut g = 0;
        for &i in ids {
            let ai = a[i as usize];
            if ai == 0.0 {
                continue;
            }
            let col = &column(i as usize)?[cols.clone()];
            prefetch(col);
            group[g] = (ai, col);
            g += 1;
            if g == 4 {
                if let Some(ready) = pending.replace(group) {
                    axpy4_unchecked(down_ty, &ready, y, simd);
                }
                g = 0;
            }
        }
        if let Some(ready) = pending {
            axpy4_unchecked(down_ty, &ready, y, simd);
        }
        for &(ai, col) in &group[..g] {
            axpy_unchecked(down_ty, ai, col, y, simd);
        }
        Ok(())
    };
    if n == 1 {
        // One row: split its columns into runs of whole blocks.
        let n_blocks = d / blk;
        let tasks = if parallel {
            rayon::current_num_threads().min(n_blocks / 8).max(1)
        } else {
            1
        };
        let per_task = n_blocks.div_ceil(tasks) * blk;
        return ys.par_chunks_mut(per_task).enumerate().try_for_each(|(t, y)| {
            let cols = t * per_task / blk * blk_bytes..(t * per_task + y.len()) / blk * blk_bytes;
            row(a, cols, y)
        });
    }
    // Several rows: each task owns whole rows.
    let tasks = if parallel {
        rayon::current_num_threads().min(n)
    } else {
        1
    };
    let rows_per_task = n.div_ceil(tasks);
    ys.par_chunks_mut(rows_per_task * d)
        .zip(a.par_chunks(rows_per_task * n_ff))
        .try_for_each(|(ys, a)| {
            for (y, a) in ys.chunks_exact_mut(d).zip(a.chunks_exact(n_ff)) {
                row(a, 0..down_bytes, y)?;
            }
            Ok(())
        })
}

/// Asks the cache for every 64-byte line `bytes` touches (a hint: no
/// fault, no effect on results).
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        // From the line the slice starts in, so that an unaligned slice's
        // last line is asked for too.
        let lead = bytes.as_ptr() as usize % 64;
        for off in (0..lead + bytes.len()).step_by(64) {
            let line = bytes.as_ptr().wrapping_sub(lead).wrapping_add(off);
            // SAFETY: a prefetch reads nothing architecturally and cannot
            // fault, whatever the address.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Four neurons' [`axpy_unchecked`] in their order, each output loaded and
/// stored once: every element sees the same four fused multiply-adds in the
/// same order as four separate calls, so the bits are the same.
#[inline]
fn axpy4_unchecked(down_ty: GgmlType, group: &[(f32, &[u8]); 4], y: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: as in `axpy_unchecked`; every column holds y.len() values.
        unsafe {
            match down_ty {
                GgmlType::Q8_0 => super::avx2::axpy4_q8_0(group, y),
                _ => super::avx2::axpy4_f16(group, y),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if simd {
        // SAFETY: NEON is part of aarch64; every column holds y.len() values.
        unsafe {
            match down_ty {
                GgmlType::Q8_0 => super::neon::axpy4_q8_0(group, y),
                _ => super::neon::axpy4_f16(group, y),
            }
        }
        return;
    }
    for &(a, col) in group {
        axpy_unchecked(down_ty, a, col, y, simd);
    }
}

/// `y[j] = fma(a, w[j], y[j])`; lengths are the caller's to check.
#[inline]
fn axpy_unchecked(down_ty: GgmlType, a: f32, col: &[u8], y: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only set after has_avx2() said yes; the caller
        // passes a column of exactly y.len() values.
        unsafe {
            match down_ty {
                GgmlType::Q8_0 => super::avx2::axpy_q8_0(a, col, y),
                _ => super::avx2::axpy_f16(a, col, y),
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if simd {
        // SAFETY: NEON is part of aarch64; the caller passes a column of
        // exactly y.len() values.
        unsafe {
            match down_ty {
                GgmlType::Q8_0 => super::neon::axpy_q8_0(a, col, y),
                _ => super::neon::axpy_f16(a, col, y),
            }
        }
        return;
    }
    let _ = simd;
    axpy_scalar_unchecked(down_ty, a, col, y);
}
