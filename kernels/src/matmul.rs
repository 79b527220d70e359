//! Quantized matrix × activations: `out[t * rows + r] = dot(w row r, act row t)`.
//!
//! Activations are converted once per layer input into the weights' vec-dot
//! type ([`ActBuffer`]); each output is then exactly one GGML vec-dot, so the
//! result for a given (row, token) does not depend on `n`, the tiling or the
//! thread count. The exception is Q4_K with a multiple of 8 rows, which
//! llama.cpp repacks and multiplies with other kernels: those products follow
//! [`crate::repack`], where an output depends on whether its activation row
//! is among the first `n - n % 4` (gemm) or the rest (gemv), as in llama.cpp.
//! The other exception is K-quant weights (Q6_K, Q5_K, non-repacked Q4_K) against 8 or
//! more activation rows, which llama.cpp computes with its tiled K-quant
//! matmul ([`uses_tiled_kquant`]): still one value per (row, token) that
//! depends on nothing else, but rounded differently from the vec-dot (the
//! `*_tiled` kernels of [`crate::dot`], [`crate::dot::tiled_dot`]).
//! Both exceptions are x86_64's: on aarch64 every output is one vec-dot (the
//! NEON kernels, see [`crate::dot`]), and so are the AVX-512 panel kernels
//! and the AVX2 repack kernels below; the portable code covers the rest.
//!
//! Work is split over row chunks across rayon threads. Inside a chunk, rows
//! are taken in cache-sized groups, and each group is swept by tiles of
//! activation rows, so a weight row's blocks are unpacked once per tile and
//! stay in cache while several tokens use them.
//!
//! Callers issuing many small products (decode: a few hundred per token)
//! should run inside the rayon pool (`ThreadPool::install`): called from
//! outside, each product is handed to the pool while the caller sleeps, which
//! costs several microseconds per call.

use bytemuck::Pod;
use rayon::prelude::*;

use crate::blocks::cast_blocks;
use crate::blocks::{BlockQ4K, BlockQ8K};
#[cfg(target_arch = "x86_64")]
use crate::blocks::{BlockQ5_0, BlockQ6K, BlockQ8_0};
#[cfg(target_arch = "x86_64")]
use crate::dot::avx512::{self, Q8KPanels, Q8_0Panels};
use crate::dot::{has_avx2, with_kernel, with_tiled_kernel, Kernel, KernelUser, Path};
use crate::quantize::quantize_row;
use crate::repack::{self, Mode};
use crate::{GgmlType, KernelError};

/// A row-major quantized matrix view: `rows` rows of `cols` values (GGML ne0 = cols).
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` values of `ty`,
    /// aligned for its block type.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, KernelError> {
        let matrix = Self { ty, rows, cols, data };
        matrix.validate()?;
        Ok(matrix)
    }

    /// Bytes of row `r`; empty when `r` is out of range.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let row_bytes = self.row_bytes();
        let start = r.saturating_mul(row_bytes);
        self.data.get(start..start.saturating_add(row_bytes)).unwrap_or(&[])
    }

    /// Bytes per row (0 if `cols` does not fill whole blocks; `new` rejects that).
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).unwrap_or(0)
    }

    /// The fields are public, so products re-check them before trusting them.
    fn validate(&self) -> Result<(), KernelError> {
        let row_bytes = self.ty.row_bytes(self.cols)?;
        let expected = row_bytes.checked_mul(self.rows).ok_or(KernelError::ByteLength {
            what: "matrix data",
            expected: usize::MAX,
            got: self.data.len(),
        })?;
        if self.data.len() != expected {
            return Err(KernelError::ByteLength {
                what: "matrix data",
                expected,
                got: self.data.len(),
            });
        }
        let align = element_align(self.ty);
        if !(self.data.as_ptr() as usize).is_multiple_of(align) {
            return Err(KernelError::Misaligned {
                what: "matrix data",
                align,
            });
        }
        Ok(())
    }
}

/// Alignment of the block (or element) type GGML stores `ty` as.
fn element_align(ty: GgmlType) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::Q8K => 4,
        _ => 2,
    }
}

/// Activations converted once to a vec-dot type and reused by every matrix that
/// shares that type. Capacity fixed at construction (no allocation afterwards).
#[derive(Debug, Clone)]
pub struct ActBuffer {
    /// u64 backing keeps every block type's alignment for in-place views.
    storage: Vec<u64>,
    dot_ty: GgmlType,
    n: usize,
    cols: usize,
    row_bytes: usize,
    /// Where the prompt panels of the AVX-512 kernels start, when
    /// [`Self::quantize`] made them (Q8_0 or Q8_K rows, enough of them, a CPU
    /// that runs those kernels): the rows laid out again, see
    /// [`crate::dot::avx512`].
    panels_at: Option<usize>,
    /// Every row is computed with the arithmetic of a product of one row
    /// ([`set_rows_alone`](Self::set_rows_alone)).
    rows_alone: bool,
}

impl ActBuffer {
    /// Room for `max_n` rows of `max_cols` values in any dot type (F32, the
    /// widest, sets the size, or Q8_0/Q8_K rows with their prompt panels).
    pub fn with_capacity(max_cols: usize, max_n: usize) -> Self {
        let f32_bytes = max_cols.saturating_mul(max_n).saturating_mul(4);
        let with_panels =
            [GgmlType::Q8_0, GgmlType::Q8K].map(|ty| Self::panel_layout(ty, max_n, max_cols).map_or(0, |(_, end)| end));
        let bytes = with_panels.into_iter().fold(f32_bytes, usize::max);
        Self {
            storage: vec![0u64; bytes.div_ceil(8)],
            dot_ty: GgmlType::F32,
            n: 0,
            cols: 0,
            row_bytes: 0,
            panels_at: None,
            rows_alone: false,
        }
    }

    /// Where `n` rows of `cols` values of `dot_ty` get prompt panels: their
    /// start (after the rows, at a 64-byte boundary) and end. Q8_0 for two
    /// or more rows (Q5_0 weights), Q8_K for four or more (the repacked
    /// Q4_K gemm's rows).
    fn panel_layout(dot_ty: GgmlType, n: usize, cols: usize) -> Option<(usize, usize)> {
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            let blocks = cols / dot_ty.block_size();
            let panels = match dot_ty {
                GgmlType::Q8_0 if n > 1 => Q8_0Panels::bytes_for(n, blocks),
                GgmlType::Q8K if repack::gemm_rows(n) > 0 => Q8KPanels::bytes_for(n, blocks),
                _ => return None,
            };
            let start = dot_ty
                .row_bytes(cols)
                .ok()?
                .checked_mul(n)?
                .checked_next_multiple_of(64)?;
            return Some((start, start.checked_add(panels)?));
        }
        let _ = (dot_ty, n, cols);
        None
    }

    /// Converts `n` rows of `cols` values (`x`, row-major) to `dot_ty`.
    pub fn quantize(&mut self, dot_ty: GgmlType, x: &[f32], n: usize, cols: usize) -> Result<(), KernelError> {
        let row_bytes = dot_ty.row_bytes(cols)?;
        let values = n.checked_mul(cols).ok_or(KernelError::Length {
            what: "activations",
            expected: usize::MAX,
            got: x.len(),
        })?;
        if x.len() != values {
            return Err(KernelError::Length {
                what: "activations",
                expected: values,
                got: x.len(),
            });
        }
        let needed = row_bytes.saturating_mul(n);
        // Rows alone get no panels: those feed the batched kernels only.
        #[cfg(target_arch = "x86_64")]
        let panel_rows = self.arith_rows_of(n);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.storage);
        if needed > bytes.len() {
            return Err(KernelError::ActBufferCapacity {
                needed,
                capacity: bytes.len(),
            });
        }
        // Forget the previous contents first so a failed conversion leaves an
        // empty buffer rather than a half-updated one.
        self.n = 0;
        self.panels_at = None;
        if n > 0 && row_bytes > 0 {
            let dst = &mut bytes[..needed];
            if values >= PARALLEL_QUANTIZE_VALUES && n > 1 {
                dst.par_chunks_mut(row_bytes)
                    .zip(x.par_chunks(cols))
                    .try_for_each(|(row, xs)| quantize_row(dot_ty, xs, row))?;
            } else {
                for (row, xs) in dst.chunks_mut(row_bytes).zip(x.chunks(cols)) {
                    quantize_row(dot_ty, xs, row)?;
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if let Some((start, end)) = Self::panel_layout(dot_ty, panel_rows, cols).filter(|&(_, end)| end <= bytes.len())
        {
            let (rows, panels) = bytes[..end].split_at_mut(start);
            let rows = &rows[..needed];
            let blocks = cols / dot_ty.block_size();
            let built = match dot_ty {
                GgmlType::Q8_0 => Q8_0Panels::build(cast_blocks(rows, "activations")?, n, blocks, panels).is_some(),
                _ => Q8KPanels::build(cast_blocks(rows, "activations")?, n, blocks, panels).is_some(),
            };
            self.panels_at = built.then_some(start);
        }
        self.dot_ty = dot_ty;
        self.n = n;
        self.cols = cols;
        self.row_bytes = row_bytes;
        Ok(())
    }

    /// The bytes of the prompt panels, if [`Self::quantize`] made them.
    #[cfg(target_arch = "x86_64")]
    fn panel_bytes(&self, dot_ty: GgmlType) -> Option<&[u8]> {
        let start = self.panels_at.filter(|_| self.dot_ty == dot_ty)?;
        let bytes: &[u8] = bytemuck::cast_slice(&self.storage);
        Some(&bytes[start..])
    }

    /// The AVX-512 prompt panels of these Q8_0 rows, if made.
    #[cfg(target_arch = "x86_64")]
    fn q8_0_panels(&self) -> Option<Q8_0Panels<'_>> {
        let blocks = self.cols / GgmlType::Q8_0.block_size();
        Q8_0Panels::from_bytes(self.panel_bytes(GgmlType::Q8_0)?, self.n, blocks)
    }

    /// The AVX-512 prompt panels of these Q8_K rows, if made.
    #[cfg(target_arch = "x86_64")]
    fn q8k_panels(&self) -> Option<Q8KPanels<'_>> {
        let blocks = self.cols / GgmlType::Q8K.block_size();
        Q8KPanels::from_bytes(self.panel_bytes(GgmlType::Q8K)?, self.n, blocks)
    }

    pub fn dot_type(&self) -> GgmlType {
        self.dot_ty
    }

    /// From the next [`quantize`](Self::quantize) on, every product with
    /// these rows gives each row the bits a product of that row alone gives:
    /// no gemm or tiled K-quant arithmetic, which llama.cpp (and so
    /// `matmul`) takes for several rows and which rounds otherwise. For a
    /// verification pass, whose rows must equal tokens decoded one by one.
    pub fn set_rows_alone(&mut self, on: bool) {
        self.rows_alone = on;
    }

    /// Whether [`set_rows_alone`](Self::set_rows_alone) is on.
    pub fn rows_alone(&self) -> bool {
        self.rows_alone
    }

    /// The row count products choose their arithmetic by: `n()`, or at most
    /// 1 with rows alone.
    pub(crate) fn arith_rows(&self) -> usize {
        self.arith_rows_of(self.n)
    }

    fn arith_rows_of(&self, n: usize) -> usize {
        if self.rows_alone {
            n.min(1)
        } else {
            n
        }
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of converted row `i`; empty when `i >= n()`.
    pub fn row(&self, i: usize) -> &[u8] {
        if i >= self.n {
            return &[];
        }
        &self.bytes()[i * self.row_bytes..(i + 1) * self.row_bytes]
    }

    /// All `n()` converted rows, back to back.
    pub fn bytes(&self) -> &[u8] {
        let bytes: &[u8] = bytemuck::cast_slice(&self.storage);
        &bytes[..self.n * self.row_bytes]
    }
}

/// Below this many values, converting activations on one thread is cheaper
/// than waking others.
const PARALLEL_QUANTIZE_VALUES: usize = 1 << 16;
/// Below this many multiply-adds, a product runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 17;
/// Row chunks per rayon thread: enough to balance uneven progress.
const CHUNKS_PER_THREAD: usize = 4;
/// Activation rows handed to a kernel together (its tiles reuse weight blocks).
const TOKEN_TILE: usize = 8;
/// Weight rows handed to a kernel together (its tiles reuse activation blocks).
const ROW_TILE: usize = 4;
/// Most weight rows handed to a kernel together for one activation row.
const DECODE_ROW_TILE: usize = 8;
/// Weight bytes per row group: small enough to stay in L1 while the token
/// tiles of a block pass over the group.
const ROW_GROUP_BYTES: usize = 32 * 1024;
/// Activation bytes (as the weights' dot type; up to twice that with the
/// AVX-512 panels) per token block: well inside a 512 KiB-1 MiB L2.
const TOKEN_BLOCK_BYTES: usize = 128 * 1024;

/// `out[t * w.rows + r] = dot(w row r, activation row t)`, on all rayon
/// threads. Errors if the activations' dot type is not `w.ty.vec_dot_type()`
/// or shapes disagree.
pub fn matmul(w: &QMatrix, acts: &ActBuffer, out: &mut [f32]) -> Result<(), KernelError> {
    run_matmul(w, acts, out, Path::Fastest, true)
}

/// Single-threaded scalar twin of [`matmul`] (GGML's generic dot formulas;
/// for repacked Q4_K, [`crate::repack::dot`], bit-identical to `matmul`).
pub fn matmul_scalar(w: &QMatrix, acts: &ActBuffer, out: &mut [f32]) -> Result<(), KernelError> {
    run_matmul(w, acts, out, Path::Scalar, false)
}

fn run_matmul(w: &QMatrix, acts: &ActBuffer, out: &mut [f32], path: Path, parallel: bool) -> Result<(), KernelError> {
    w.validate()?;
    let expected_ty = w.ty.vec_dot_type();
    if acts.dot_type() != expected_ty {
        return Err(KernelError::TypeMismatch {
            what: "matmul activations",
            expected: expected_ty,
            got: acts.dot_type(),
        });
    }
    if acts.cols() != w.cols && acts.n() > 0 {
        return Err(KernelError::Length {
            what: "matmul activation columns",
            expected: w.cols,
            got: acts.cols(),
        });
    }
    let outputs = acts.n() * w.rows;
    if out.len() != outputs {
        return Err(KernelError::Length {
            what: "matmul output",
            expected: outputs,
            got: out.len(),
        });
    }
    if outputs == 0 {
        return Ok(());
    }
    let job = Product { w, acts, out, parallel };
    if w.ty == GgmlType::Q4K && repack::q4k_is_repacked(w.rows) {
        return job.run_tiles::<BlockQ4K, BlockQ8K, _>(Q4kRepacked::new(path, acts));
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = PanelKernel::q6_k(w.ty, w.rows, path, acts) {
        return job.run_tiles::<BlockQ6K, BlockQ8K, _>(kernel);
    }
    if uses_tiled_kquant(w.ty, w.rows, acts.arith_rows()) {
        return with_tiled_kernel(w.ty, path, job)?;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = PanelKernel::q5_0(w.ty, path, acts) {
        return job.run_tiles::<BlockQ5_0, BlockQ8_0, _>(kernel);
    }
    with_kernel(w.ty, path, job)?
}

/// Fewest activation rows for which llama.cpp's CPU backend computes a
/// K-quant product with its tiled matmul (`ggml_tiled_min_batch`).
pub const TILED_KQUANT_MIN_ROWS: usize = 8;

/// Whether llama.cpp computes `rows` weight rows of `ty` against `n`
/// activation rows with its tiled K-quant matmul (`ggml-cpu/tiled/`) rather
/// than one vec-dot per output: Q6_K and Q5_K weights, and Q4_K weights it
/// does not repack, in a plain buffer, with at least
/// [`TILED_KQUANT_MIN_ROWS`] activation rows. Its outputs differ from the
/// vec-dot's in rounding (see [`crate::dot`]'s `*_tiled` kernels) but, like
/// them, depend on nothing but the two rows, not on `n`, tiling or threads.
///
/// Always false off x86_64: llama.cpp builds that matmul for x86 only
/// (`ggml_tiled_supported` is false without AVX), and on aarch64 without
/// i8mm its K-quant products are one vec-dot per output.
pub fn uses_tiled_kquant(ty: GgmlType, rows: usize, n: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && n >= TILED_KQUANT_MIN_ROWS
        && match ty {
            GgmlType::Q6K | GgmlType::Q5K => true,
            GgmlType::Q4K => !repack::q4k_is_repacked(rows),
            _ => false,
        }
}

/// What the row loops need from a kernel.
pub(crate) trait Tiles<W, A>: Copy + Send + Sync {
    /// Weight rows worth handing over together for one activation row.
    fn decode_rows(&self) -> usize;
    /// Activation rows `[0, split)` and `[split, n)` never share a call.
    fn token_split(&self) -> usize;
    /// `out[r * a_rows.len() + t] = dot(w_rows[r], a_rows[t])`, where
    /// `a_rows` are activation rows `first_token..`.
    fn dot(&self, w_rows: &[&[W]], a_rows: &[&[A]], first_token: usize, out: &mut [f32]);
}

impl<W: Sync, A: Sync> Tiles<W, A> for Kernel<W, A> {
    fn decode_rows(&self) -> usize {
        Kernel::decode_rows(self)
    }

    fn token_split(&self) -> usize {
        0
    }

    #[inline]
    fn dot(&self, w_rows: &[&[W]], a_rows: &[&[A]], _first_token: usize, out: &mut [f32]) {
        Kernel::dot(self, w_rows, a_rows, out)
    }
}

/// Q4_K in llama.cpp's repacked arithmetic ([`crate::repack`]).
#[derive(Clone, Copy)]
pub(crate) struct Q4kRepacked<'a> {
    /// The AVX2 kernels (only set after `has_avx2()` said yes), else scalar.
    simd: bool,
    /// Activation rows before this go through the gemm, the rest the gemv.
    gemm_rows: usize,
    /// The gemm rows laid out for the AVX-512 gemm, when made.
    #[cfg(target_arch = "x86_64")]
    panels: Option<Q8KPanels<'a>>,
    #[cfg(not(target_arch = "x86_64"))]
    panels: std::marker::PhantomData<&'a ()>,
}

impl<'a> Q4kRepacked<'a> {
    /// The kernel `matmul` takes on `path` for `acts`.
    pub(crate) fn new(path: Path, acts: &'a ActBuffer) -> Self {
        let simd = path == Path::Fastest && has_avx2();
        Self {
            simd,
            gemm_rows: repack::gemm_rows(acts.arith_rows()),
            #[cfg(target_arch = "x86_64")]
            panels: acts.q8k_panels().filter(|_| simd),
            #[cfg(not(target_arch = "x86_64"))]
            panels: std::marker::PhantomData,
        }
    }
}

// The panels hold tiles of TOKEN_TILE tokens from 0, as `prompt_rows` (and
// the sparse FFN's strided products) cut the gemm rows and every prompt.
#[cfg(target_arch = "x86_64")]
const _: () = assert!(TOKEN_TILE == avx512::PANEL_TOKENS);

impl Tiles<BlockQ4K, BlockQ8K> for Q4kRepacked<'_> {
    fn decode_rows(&self) -> usize {
        if self.simd {
            DECODE_ROW_TILE
        } else {
            1
        }
    }

    fn token_split(&self) -> usize {
        self.gemm_rows
    }

    #[inline]
    fn dot(&self, w_rows: &[&[BlockQ4K]], a_rows: &[&[BlockQ8K]], first_token: usize, out: &mut [f32]) {
        let mode = if first_token < self.gemm_rows {
            Mode::Gemm
        } else {
            Mode::Gemv
        };
        #[cfg(target_arch = "x86_64")]
        if let (Mode::Gemm, Some(panels)) = (mode, self.panels) {
            // SAFETY: panels are only made where `avx512::available()` said yes.
            unsafe { avx512::q4_k_gemm(w_rows, panels, first_token, a_rows.len(), out) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            // SAFETY: `simd` is only set when `has_avx2()` holds.
            unsafe { repack::avx2::tiles(w_rows, a_rows, mode, out) };
            return;
        }
        repack::scalar_tiles(w_rows, a_rows, mode, out);
    }
}

/// An AVX-512 prompt kernel reading panels ([`crate::dot::avx512`]; the same
/// results as the AVX2 kernels). The panels replace the activation rows, so
/// tiles must start at panel boundaries: `prompt_rows` (and the sparse FFN's
/// strided products) cut tokens in tiles of `TOKEN_TILE` from 0.
#[cfg(target_arch = "x86_64")]
pub(crate) struct PanelKernel<P, W> {
    panels: P,
    // Invariant: only set where `avx512::available()` said yes (panels are
    // only made there).
    run: PanelFn<P, W>,
}

/// `(weight rows, panels, first token, tokens, out)`, as the kernels of
/// [`crate::dot::avx512`] take them.
#[cfg(target_arch = "x86_64")]
type PanelFn<P, W> = unsafe fn(&[&[W]], P, usize, usize, &mut [f32]);

#[cfg(target_arch = "x86_64")]
impl<P: Copy, W> Clone for PanelKernel<P, W> {
    fn clone(&self) -> Self {
        *self
    }
}

#[cfg(target_arch = "x86_64")]
impl<P: Copy, W> Copy for PanelKernel<P, W> {}

#[cfg(target_arch = "x86_64")]
impl<'a> PanelKernel<Q8_0Panels<'a>, BlockQ5_0> {
    /// The kernel for weights of type `ty` on `path` against `acts`, when
    /// they are Q5_0 and the activations have panels.
    pub(crate) fn q5_0(ty: GgmlType, path: Path, acts: &'a ActBuffer) -> Option<Self> {
        let panels = acts
            .q8_0_panels()
            .filter(|_| ty == GgmlType::Q5_0 && path == Path::Fastest)?;
        Some(Self {
            panels,
            run: avx512::q5_0_q8_0,
        })
    }
}

#[cfg(target_arch = "x86_64")]
impl<'a> PanelKernel<Q8KPanels<'a>, BlockQ6K> {
    /// The kernel for `rows` weight rows of type `ty` on `path` against
    /// `acts`, when they are Q6_K in llama.cpp's tiled matmul and the
    /// activations have panels.
    pub(crate) fn q6_k(ty: GgmlType, rows: usize, path: Path, acts: &'a ActBuffer) -> Option<Self> {
        let wanted = ty == GgmlType::Q6K && path == Path::Fastest && uses_tiled_kquant(ty, rows, acts.arith_rows());
        let panels = acts.q8k_panels().filter(|_| wanted)?;
        Some(Self {
            panels,
            run: avx512::q6_k_tiled,
        })
    }
}

#[cfg(target_arch = "x86_64")]
impl<P: Copy + Send + Sync, W: Sync, A> Tiles<W, A> for PanelKernel<P, W> {
    fn decode_rows(&self) -> usize {
        1
    }

    fn token_split(&self) -> usize {
        0
    }

    #[inline]
    fn dot(&self, w_rows: &[&[W]], a_rows: &[&[A]], first_token: usize, out: &mut [f32]) {
        // SAFETY: see the invariant on `run`.
        unsafe { (self.run)(w_rows, self.panels, first_token, a_rows.len(), out) }
    }
}

/// One matrix product waiting for its kernel.
struct Product<'a, 'b> {
    w: &'b QMatrix<'a>,
    acts: &'b ActBuffer,
    out: &'b mut [f32],
    parallel: bool,
}

impl KernelUser for Product<'_, '_> {
    type Output = Result<(), KernelError>;

    fn run<W: Pod + Sync, A: Pod + Sync>(self, kernel: Kernel<W, A>) -> Self::Output {
        self.run_tiles(kernel)
    }
}

impl Product<'_, '_> {
    fn run_tiles<W: Pod + Sync, A: Pod + Sync, K: Tiles<W, A>>(self, kernel: K) -> Result<(), KernelError> {
        let rows = self.w.rows;
        let n = self.acts.n();
        let blocks_per_row = self.w.cols / self.w.ty.block_size();
        let weights = cast_blocks::<W>(self.w.data, "matrix data")?;
        let acts = cast_blocks::<A>(self.acts.bytes(), "activations")?;
        let shape = Shape {
            rows,
            n,
            blocks_per_row,
            row_bytes: self.w.row_bytes(),
        };

        let threads = rayon::current_num_threads();
        let macs = rows.saturating_mul(n).saturating_mul(self.w.cols);
        if !self.parallel || threads == 1 || macs < PARALLEL_MIN_MACS || rows < 2 {
            let mut out = Scatter::new(self.out);
            compute_rows(kernel, weights, acts, shape, 0..rows, &mut out);
            return Ok(());
        }

        let chunks = (threads * CHUNKS_PER_THREAD).min(rows);
        let chunk_rows = rows.div_ceil(chunks);
        let out = Scatter::new(self.out);
        (0..rows.div_ceil(chunk_rows)).into_par_iter().for_each(|c| {
            let start = c * chunk_rows;
            let end = (start + chunk_rows).min(rows);
            let mut out = out.clone();
            compute_rows(kernel, weights, acts, shape, start..end, &mut out);
        });
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct Shape {
    rows: usize,
    n: usize,
    blocks_per_row: usize,
    row_bytes: usize,
}

/// All outputs of weight rows `row_range`, for every activation row.
fn compute_rows<W, A, K: Tiles<W, A>>(
    kernel: K,
    weights: &[W],
    acts: &[A],
    shape: Shape,
    row_range: std::ops::Range<usize>,
    out: &mut Scatter,
) {
    if shape.n == 1 {
        decode_rows(kernel, weights, acts, shape, row_range, out);
    } else {
        prompt_rows(kernel, weights, acts, shape, row_range, out);
    }
}

/// One activation row: the weights stream through once. Kernels that gain
/// from several rows per call get them from separate stretches of the range,
/// so memory sees a few long sequential streams, which hardware prefetchers
/// follow; adjacent rows side by side would be short interleaved streams that
/// they do not (3x slower once the matrix is out of cache).
fn decode_rows<W, A, K: Tiles<W, A>>(
    kernel: K,
    weights: &[W],
    acts: &[A],
    shape: Shape,
    row_range: std::ops::Range<usize>,
    out: &mut Scatter,
) {
    let bpr = shape.blocks_per_row;
    let w_row = |r: usize| &weights[r * bpr..(r + 1) * bpr];
    let a = [&acts[..bpr]];
    let lanes = kernel.decode_rows().clamp(1, DECODE_ROW_TILE);
    let lane_len = row_range.len() / lanes;
    let lane_start = |lane: usize| row_range.start + lane * lane_len;
    let mut w_tile: [&[W]; DECODE_ROW_TILE] = [&[]; DECODE_ROW_TILE];
    let mut results = [0.0f32; DECODE_ROW_TILE];
    for k in 0..lane_len {
        for (lane, slot) in w_tile[..lanes].iter_mut().enumerate() {
            *slot = w_row(lane_start(lane) + k);
        }
        kernel.dot(&w_tile[..lanes], &a, 0, &mut results[..lanes]);
        for (lane, &v) in results[..lanes].iter().enumerate() {
            out.write(lane_start(lane) + k, v);
        }
    }
    for r in lane_start(lanes)..row_range.end {
        kernel.dot(&[w_row(r)], &a, 0, &mut results[..1]);
        out.write(r, results[0]);
    }
}

/// Several activation rows: the tokens are taken in blocks whose
/// activations fit in L2; within a block, each L1-sized group of weight rows
/// is swept by every tile of activation rows before moving on. So weights
/// come from memory once per token block and activations from L2 once per
/// row group (a 512-token prompt's activations, laid out for the AVX-512
/// kernels, are several MB: swept whole per row group they would come from
/// L3 every time). Tiles do not straddle the kernel's `token_split`.
fn prompt_rows<W, A, K: Tiles<W, A>>(
    kernel: K,
    weights: &[W],
    acts: &[A],
    shape: Shape,
    row_range: std::ops::Range<usize>,
    out: &mut Scatter,
) {
    let bpr = shape.blocks_per_row;
    let w_row = |r: usize| &weights[r * bpr..(r + 1) * bpr];
    let a_row = |t: usize| &acts[t * bpr..(t + 1) * bpr];
    let mut w_tile: [&[W]; ROW_TILE] = [&[]; ROW_TILE];
    let mut a_tile: [&[A]; TOKEN_TILE] = [&[]; TOKEN_TILE];
    let mut results = [0.0f32; ROW_TILE * TOKEN_TILE];
    let group_rows = (ROW_GROUP_BYTES / shape.row_bytes.max(1)).max(ROW_TILE);
    let split = kernel.token_split().min(shape.n);
    let tiles_per_block = (TOKEN_BLOCK_BYTES / (shape.row_bytes.max(1) * TOKEN_TILE)).max(1);
    let token_tiles = || {
        (0..split)
            .step_by(TOKEN_TILE)
            .map(move |t0| (t0, TOKEN_TILE.min(split - t0)))
            .chain(
                (split..shape.n)
                    .step_by(TOKEN_TILE)
                    .map(move |t0| (t0, TOKEN_TILE.min(shape.n - t0))),
            )
    };
    let tile_count = token_tiles().count();
    for first_tile in (0..tile_count).step_by(tiles_per_block) {
        let mut group_start = row_range.start;
        while group_start < row_range.end {
            let group_end = (group_start + group_rows).min(row_range.end);
            for (t0, tokens) in token_tiles().skip(first_tile).take(tiles_per_block) {
                for (i, slot) in a_tile[..tokens].iter_mut().enumerate() {
                    *slot = a_row(t0 + i);
                }
                for r0 in (group_start..group_end).step_by(ROW_TILE) {
                    let rows = ROW_TILE.min(group_end - r0);
                    for (i, slot) in w_tile[..rows].iter_mut().enumerate() {
                        *slot = w_row(r0 + i);
                    }
                    kernel.dot(&w_tile[..rows], &a_tile[..tokens], t0, &mut results[..rows * tokens]);
                    for r in 0..rows {
                        for t in 0..tokens {
                            out.write((t0 + t) * shape.rows + r0 + r, results[r * tokens + t]);
                        }
                    }
                }
            }
            group_start = group_end;
        }
    }
}

/// Shared write access to the output for tasks that own disjoint sets of
/// indices (each task owns whole weight rows `r`, so every `t * rows + r`).
#[derive(Clone)]
struct Scatter {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint indices (see above), and the `&mut [f32]` the
// pointer came from is borrowed for the whole parallel section.
unsafe impl Send for Scatter {}
unsafe impl Sync for Scatter {}

impl Scatter {
    fn new(out: &mut [f32]) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    #[inline]
    fn write(&mut self, index: usize, value: f32) {
        if index < self.len {
            // SAFETY: in bounds, and no other task writes this index.
            unsafe { *self.ptr.add(index) = value }
        }
    }
}
