//! A gated FFN (SwiGLU or GeGLU) over any subset of its neurons, each given
//! as a neuron *bundle*: gate row i + up row i + neuron i's share of the
//! down matrix, back to back, exactly as a layer's bundles sit in a
//! `.lsflash` file (see the runtime's `flash::format`: `gate_bytes` of the
//! gate row in `gate_ty`, `up_bytes` of the up row in `up_ty`, then
//! `down_bytes` of down, as [`DownLayout`] says: column i in Q8_0 or F16, or
//! a part of its group's tile in the source type, [`tiles`]). Stage 2 below
//! is the column form; tiles go through [`DownTiles`], the dense path's own
//! down product.
//!
//! Two stages, slices in and slices out, nothing allocated after setup:
//!
//! 1. [`activations`] (per bundle, in whatever order bundles arrive):
//!    `a_i = act(gate_i · x) * (up_i · x)`. Each dot is one [`vec_dot`] of the
//!    weight row with the FFN input already converted to the row type's
//!    vec-dot type ([`FfnInput`]), and the activation is [`ops::swiglu_element`]
//!    / [`ops::geglu_element`], the element functions of the dense path's
//!    [`ops::swiglu`] / [`ops::geglu`]. So `a_i` is bit for bit the value the
//!    dense decode path (one activation row, [`crate::matmul`]) gives neuron
//!    i, for every weight type whose single-row product *is* one vec-dot:
//!    all of them except, on x86_64, Q4_K with a multiple of 8 rows, which
//!    llama.cpp (and `matmul`) repacks and multiplies with the repack gemv,
//!    rounded differently (there the two agree to rounding only). With 8+
//!    activation rows (x86_64 again), K-quant products use the tiled kernels
//!    instead; this module is about one token and always uses the vec-dot.
//!    `a_i` lands in slot i of a dense per-layer [`LayerActivations`].
//! 2. [`accumulate_down`] (once per layer, after the last bundle):
//!    `y += Σ a_i * down_i` over the recorded neurons in **ascending neuron
//!    id**, skipping `a_i == 0`, one fused multiply-add per element and
//!    neuron ([`axpy_down`]), the down column dequantized on the fly exactly
//!    as [`crate::dequant`] does (Q8_0: `q as f32 * d`; F16: exact widening).
//!
//! # Determinism
//!
//! `a_i` is a pure function of bundle i and the input. Stage 1 only writes
//! slot i of the layer vector, so after all bundles arrived the vector is the
//! same whatever their order (a neuron fed twice overwrites its slot with the
//! same value). Stage 2 reads the vector in a fixed order (ascending id,
//! independent of arrival order and of the file's placement), and its SIMD
//! and scalar forms perform the same operations in the same order per
//! element (`y[j] = fma(a_i, w_ij, y[j])`, `w_ij` rounded once), so the final
//! `y` for a given set of neurons is bit-identical regardless of the order in
//! which bundles were fed or which kernel ran.

mod blocked;
pub mod tiles;

pub use blocked::{
    run_activations, run_activations_scalar, run_activations_split, run_activations_strided, run_down,
    run_down_columns, run_down_scalar, FfnRows,
};
pub use tiles::DownTiles;

/// A type the dot kernels take as weights (the activation-only types are not).
pub(crate) fn check_weight_type(ty: GgmlType) -> Result<(), KernelError> {
    if matches!(ty, GgmlType::Q8_1 | GgmlType::Q8K) {
        return Err(KernelError::UnsupportedType(format!("{ty} as a weight type")));
    }
    Ok(())
}

use half::f16;

#[cfg(target_arch = "x86_64")]
use crate::dot::has_avx2;
use crate::dot::vec_dot;
use crate::matmul::ActBuffer;
use crate::ops;
use crate::{GgmlType, KernelError};

/// The gate/up activation of a gated FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnActivation {
    /// SwiGLU: `silu(g) * u` (Llama, Mistral, Qwen2, SmolLM).
    Silu,
    /// GeGLU with tanh-approximated GELU: `gelu(g) * u` (Gemma).
    GeluTanh,
}

impl FfnActivation {
    /// `act(g) * u`, the dense path's element function.
    #[inline(always)]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Self::Silu => ops::swiglu_element(g, u),
            Self::GeluTanh => ops::geglu_element(g, u),
        }
    }

    /// [`apply`](Self::apply) over slices (`gate[i] = act(gate[i]) * up[i]`),
    /// through the dense path's own slice functions: the same bits, with the
    /// fused multiply-adds inlined where the CPU has FMA (the per-element
    /// form outside such a function calls libm's `fmaf`).
    pub fn apply_slice(self, gate: &mut [f32], up: &[f32]) {
        match self {
            Self::Silu => ops::swiglu(gate, up),
            Self::GeluTanh => ops::geglu(gate, up),
        }
    }
}

/// A bundle's (gate row, up row, down column).
pub type BundleParts<'a> = (&'a [u8], &'a [u8], &'a [u8]);

/// How a bundle carries its neuron's share of the down matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DownLayout {
    /// Column i of `ffn_down`, re-quantized to Q8_0 or F16: each neuron's
    /// down weights stand alone, so any subset of neurons can be read, but
    /// the arithmetic is not the source model's.
    #[default]
    Columns,
    /// The source matrix in its own type ([`tiles`]): a group of
    /// `down_ty.block_size()` neurons shares one block per output row (the
    /// group's tile), split evenly over the group's bundles. A group is
    /// read whole, and the down product is the dense path's matmul, bit
    /// for bit.
    Tiles,
    /// No down part: the layer's down matrix is held apart, whole, in the
    /// source's type (a resident layer whose tiles were gathered once), and
    /// bundles are the gate and up rows alone.
    Matrix,
}

/// The shape of one layer's bundles (the runtime's `BundleLayout`, from types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundleFormat {
    pub gate_ty: GgmlType,
    pub up_ty: GgmlType,
    /// Q8_0 or F16 as [`DownLayout::Columns`]; the source type as [`DownLayout::Tiles`].
    pub down_ty: GgmlType,
    pub down_layout: DownLayout,
    pub n_embd: usize,
}

impl BundleFormat {
    /// Checks the types and that `n_embd` fills whole blocks of each.
    pub fn new(
        gate_ty: GgmlType,
        up_ty: GgmlType,
        down_ty: GgmlType,
        down_layout: DownLayout,
        n_embd: usize,
    ) -> Result<Self, KernelError> {
        let format = Self {
            gate_ty,
            up_ty,
            down_ty,
            down_layout,
            n_embd,
        };
        format.validate()?;
        Ok(format)
    }

    /// The fields are public, so every stage re-checks them.
    fn validate(&self) -> Result<(), KernelError> {
        match self.down_layout {
            DownLayout::Columns => {
                if !matches!(self.down_ty, GgmlType::Q8_0 | GgmlType::F16) {
                    return Err(KernelError::UnsupportedType(format!(
                        "{} as a down column type (expected Q8_0 or F16)",
                        self.down_ty
                    )));
                }
                self.down_ty.row_bytes(self.n_embd)?;
            }
            DownLayout::Tiles | DownLayout::Matrix => {
                tiles::part_bytes(self.down_ty, self.n_embd)?;
            }
        }
        for ty in [self.gate_ty, self.up_ty] {
            check_weight_type(ty)?;
            ty.row_bytes(self.n_embd)?;
        }
        Ok(())
    }

    /// [`validate`](Self::validate), and down columns: the per-neuron
    /// stage-2 kernels read columns; tiles go through [`DownTiles`].
    pub(crate) fn validate_columns(&self) -> Result<(), KernelError> {
        self.validate()?;
        if self.down_layout != DownLayout::Columns {
            return Err(KernelError::UnsupportedType(format!(
                "{} down tiles in a per-neuron down kernel (tiles go through DownTiles)",
                self.down_ty
            )));
        }
        Ok(())
    }

    /// Bytes of the gate row (0 if `n_embd` splits a block; `new` rejects that).
    pub fn gate_bytes(&self) -> usize {
        self.gate_ty.row_bytes(self.n_embd).unwrap_or(0)
    }

    /// Bytes of the up row.
    pub fn up_bytes(&self) -> usize {
        self.up_ty.row_bytes(self.n_embd).unwrap_or(0)
    }

    /// Bytes of the down column, or of the tile part ([`DownLayout::Tiles`]).
    pub fn down_bytes(&self) -> usize {
        match self.down_layout {
            DownLayout::Columns => self.down_ty.row_bytes(self.n_embd).unwrap_or(0),
            DownLayout::Tiles => tiles::part_bytes(self.down_ty, self.n_embd).unwrap_or(0),
            DownLayout::Matrix => 0,
        }
    }

    /// Neurons that share down blocks: 1 for columns, the down type's block
    /// size for tiles (whole groups are read and computed together).
    pub fn group(&self) -> usize {
        match self.down_layout {
            DownLayout::Columns | DownLayout::Matrix => 1,
            DownLayout::Tiles => self.down_ty.block_size(),
        }
    }

    /// The format of the same layer held resident: tiles gathered into the
    /// down matrix ([`DownLayout::Matrix`]), bundles of gate and up rows.
    pub fn resident(&self) -> Self {
        match self.down_layout {
            DownLayout::Tiles => Self {
                down_layout: DownLayout::Matrix,
                ..*self
            },
            _ => *self,
        }
    }

    /// Bytes of a whole bundle.
    pub fn bundle_bytes(&self) -> usize {
        self.gate_bytes() + self.up_bytes() + self.down_bytes()
    }

    /// The down part (column or tile part) of one whole `bundle`; an error
    /// when `bundle` is not exactly one bundle long.
    pub fn down_part<'a>(&self, bundle: &'a [u8]) -> Result<&'a [u8], KernelError> {
        if bundle.len() != self.bundle_bytes() {
            return Err(KernelError::ByteLength {
                what: "neuron bundle",
                expected: self.bundle_bytes(),
                got: bundle.len(),
            });
        }
        Ok(&bundle[self.gate_bytes() + self.up_bytes()..])
    }

    /// Splits one bundle into (gate row, up row, down column); an error when
    /// the format is invalid or `bundle` is not exactly one bundle long.
    pub fn split<'a>(&self, bundle: &'a [u8]) -> Result<BundleParts<'a>, KernelError> {
        self.validate()?;
        if bundle.len() != self.bundle_bytes() {
            return Err(KernelError::ByteLength {
                what: "neuron bundle",
                expected: self.bundle_bytes(),
                got: bundle.len(),
            });
        }
        let (gate, rest) = bundle.split_at(self.gate_bytes());
        let (up, down) = rest.split_at(self.up_bytes());
        Ok((gate, up, down))
    }
}

/// The FFN input of one token, converted for the gate and up rows' dot types.
#[derive(Debug, Clone, Copy)]
pub struct FfnInput<'a> {
    gate: &'a [u8],
    up: &'a [u8],
}

impl<'a> FfnInput<'a> {
    /// Row `token` of `gate_acts` (converted to `format.gate_ty.vec_dot_type()`)
    /// and of `up_acts` (to `format.up_ty.vec_dot_type()`); pass the same
    /// buffer twice when the two types share a dot type.
    pub fn new(
        format: &BundleFormat,
        gate_acts: &'a ActBuffer,
        up_acts: &'a ActBuffer,
        token: usize,
    ) -> Result<Self, KernelError> {
        format.validate()?;
        let row = |ty: GgmlType, acts: &'a ActBuffer, what: &'static str| -> Result<&'a [u8], KernelError> {
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
            if token >= acts.n() {
                return Err(KernelError::Length {
                    what: "FFN input rows",
                    expected: token + 1,
                    got: acts.n(),
                });
            }
            Ok(acts.row(token))
        };
        Ok(Self {
            gate: row(format.gate_ty, gate_acts, "FFN gate input")?,
            up: row(format.up_ty, up_acts, "FFN up input")?,
        })
    }
}

/// One layer's activations `a_i`, dense over its `n_ff` neurons, with a
/// record of which were computed. Allocated once; [`Self::clear`] per token.
#[derive(Debug, Clone)]
pub struct LayerActivations {
    a: Vec<f32>,
    present: Vec<u64>,
    count: usize,
}

impl LayerActivations {
    pub fn new(n_ff: usize) -> Self {
        Self {
            a: vec![0.0; n_ff],
            present: vec![0; n_ff.div_ceil(64)],
            count: 0,
        }
    }

    pub fn n_ff(&self) -> usize {
        self.a.len()
    }

    /// Forgets every recorded neuron.
    pub fn clear(&mut self) {
        self.present.iter_mut().for_each(|w| *w = 0);
        self.count = 0;
    }

    /// Neurons recorded since the last clear.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Records `a` for neuron `id` (overwriting an earlier value).
    pub fn set(&mut self, id: usize, a: f32) -> Result<(), KernelError> {
        if id >= self.a.len() {
            return Err(KernelError::Length {
                what: "neuron id (n_ff)",
                expected: self.a.len(),
                got: id,
            });
        }
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        if self.present[word] & bit == 0 {
            self.present[word] |= bit;
            self.count += 1;
        }
        self.a[id] = a;
        Ok(())
    }

    /// `a_id` if recorded.
    pub fn get(&self, id: usize) -> Option<f32> {
        let word = *self.present.get(id / 64)?;
        (word & (1u64 << (id % 64)) != 0).then(|| self.a[id])
    }

    /// Recorded `(id, a_id)` in ascending id order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, f32)> + '_ {
        self.present.iter().enumerate().flat_map(move |(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let id = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                Some((id, self.a[id]))
            })
        })
    }
}

/// Stage 1 for one bundle: `act(gate · x) * (up · x)`.
pub fn neuron_activation(
    format: &BundleFormat,
    input: &FfnInput,
    act: FfnActivation,
    bundle: &[u8],
) -> Result<f32, KernelError> {
    let (gate, up, _) = format.split(bundle)?;
    let g = vec_dot(format.gate_ty, gate, input.gate, format.n_embd)?;
    let u = vec_dot(format.up_ty, up, input.up, format.n_embd)?;
    Ok(act.apply(g, u))
}

/// The gate pre-activation `gate · x` of one gate row (a policy holding gate
/// rows apart from their bundles decides from it before loading them).
pub fn gate_dot(format: &BundleFormat, input: &FfnInput, gate_row: &[u8]) -> Result<f32, KernelError> {
    vec_dot(format.gate_ty, gate_row, input.gate, format.n_embd)
}

/// [`neuron_activation`] when `g = gate · x` is already known: the same
/// value, bit for bit, from the bundle's up row.
pub fn activation_with_gate(
    format: &BundleFormat,
    input: &FfnInput,
    act: FfnActivation,
    g: f32,
    bundle: &[u8],
) -> Result<f32, KernelError> {
    let (_, up, _) = format.split(bundle)?;
    let u = vec_dot(format.up_ty, up, input.up, format.n_embd)?;
    Ok(act.apply(g, u))
}

/// Stage 1: for each `(neuron id, bundle)`, computes `a_i`
/// ([`neuron_activation`]), records it in `layer` and writes `|a_i|` to
/// `abs_out` (one per bundle, same order; for predictors and thresholds).
/// Every bundle's size and id is checked before anything is recorded.
pub fn activations(
    format: &BundleFormat,
    input: &FfnInput,
    act: FfnActivation,
    bundles: &[(usize, &[u8])],
    layer: &mut LayerActivations,
    abs_out: &mut [f32],
) -> Result<(), KernelError> {
    format.validate()?;
    if abs_out.len() != bundles.len() {
        return Err(KernelError::Length {
            what: "|a| output",
            expected: bundles.len(),
            got: abs_out.len(),
        });
    }
    for &(id, bundle) in bundles {
        format.split(bundle)?;
        if id >= layer.n_ff() {
            return Err(KernelError::Length {
                what: "neuron id (n_ff)",
                expected: layer.n_ff(),
                got: id,
            });
        }
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: avx2 and fma were detected at run time.
        return unsafe { activations_fma(format, input, act, bundles, layer, abs_out) };
    }
    activations_body(format, input, act, bundles, layer, abs_out)
}

/// The element functions use fused multiply-adds (in `expf_ggml`); this
/// makes them instructions rather than calls. Same bits either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn activations_fma(
    format: &BundleFormat,
    input: &FfnInput,
    act: FfnActivation,
    bundles: &[(usize, &[u8])],
    layer: &mut LayerActivations,
    abs_out: &mut [f32],
) -> Result<(), KernelError> {
    activations_body(format, input, act, bundles, layer, abs_out)
}

#[inline(always)]
fn activations_body(
    format: &BundleFormat,
    input: &FfnInput,
    act: FfnActivation,
    bundles: &[(usize, &[u8])],
    layer: &mut LayerActivations,
    abs_out: &mut [f32],
) -> Result<(), KernelError> {
    for (&(id, bundle), abs) in bundles.iter().zip(abs_out.iter_mut()) {
        let a = neuron_activation(format, input, act, bundle)?;
        layer.set(id, a)?;
        *abs = a.abs();
    }
    Ok(())
}

/// Stage 2 kernel: `y[j] = fma(a, w[j], y[j])` with `w` the `y.len()`
/// values of `down_col` (Q8_0 or F16) dequantized as [`crate::dequant`]
/// does. AVX2+FMA when the CPU has it, NEON on aarch64; bit-identical to
/// [`axpy_down_scalar`] (the same operations per element).
pub fn axpy_down(down_ty: GgmlType, a: f32, down_col: &[u8], y: &mut [f32]) -> Result<(), KernelError> {
    check_down(down_ty, down_col, y.len())?;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: avx2, fma and f16c were detected at run time; lengths checked.
        unsafe {
            match down_ty {
                GgmlType::Q8_0 => avx2::axpy_q8_0(a, down_col, y),
                _ => avx2::axpy_f16(a, down_col, y),
            }
        }
        return Ok(());
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is part of aarch64; lengths checked.
    unsafe {
        match down_ty {
            GgmlType::Q8_0 => neon::axpy_q8_0(a, down_col, y),
            _ => neon::axpy_f16(a, down_col, y),
        }
    }
    #[cfg(not(target_arch = "aarch64"))]
    axpy_scalar_unchecked(down_ty, a, down_col, y);
    Ok(())
}

/// The portable twin of [`axpy_down`] (same operations, same bits).
pub fn axpy_down_scalar(down_ty: GgmlType, a: f32, down_col: &[u8], y: &mut [f32]) -> Result<(), KernelError> {
    check_down(down_ty, down_col, y.len())?;
    axpy_scalar_unchecked(down_ty, a, down_col, y);
    Ok(())
}

fn check_down(down_ty: GgmlType, down_col: &[u8], n: usize) -> Result<(), KernelError> {
    if !matches!(down_ty, GgmlType::Q8_0 | GgmlType::F16) {
        return Err(KernelError::UnsupportedType(format!(
            "{down_ty} as a down column type (expected Q8_0 or F16)"
        )));
    }
    let expected = down_ty.row_bytes(n)?;
    if down_col.len() != expected {
        return Err(KernelError::ByteLength {
            what: "down column",
            expected,
            got: down_col.len(),
        });
    }
    Ok(())
}

/// Bytes of one Q8_0 block: f16 scale + 32 signed quants.
const Q8_0_BYTES: usize = 34;

fn axpy_scalar_unchecked(down_ty: GgmlType, a: f32, down_col: &[u8], y: &mut [f32]) {
    match down_ty {
        GgmlType::Q8_0 => {
            for (block, ys) in down_col.chunks_exact(Q8_0_BYTES).zip(y.chunks_exact_mut(32)) {
                let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                for (yj, &q) in ys.iter_mut().zip(&block[2..]) {
                    let w = q as i8 as f32 * d;
                    *yj = a.mul_add(w, *yj);
                }
            }
        }
        _ => {
            for (yj, h) in y.iter_mut().zip(down_col.chunks_exact(2)) {
                let w = f16::from_le_bytes([h[0], h[1]]).to_f32();
                *yj = a.mul_add(w, *yj);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::Q8_0_BYTES;

    /// `down_col` holds `y.len() / 32` Q8_0 blocks (checked by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_q8_0(a: f32, down_col: &[u8], y: &mut [f32]) {
        let va = _mm256_set1_ps(a);
        for (block, ys) in down_col.chunks_exact(Q8_0_BYTES).zip(y.chunks_exact_mut(32)) {
            let d = _mm256_set1_ps(f16::from_le_bytes([block[0], block[1]]).to_f32());
            let qs = block[2..].as_ptr();
            let yp = ys.as_mut_ptr();
            for k in 0..4 {
                // SAFETY: 8 of the block's 32 quants and 8 of its 32 outputs.
                let q = _mm_loadl_epi64(qs.add(8 * k) as *const __m128i);
                let w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
                let out = _mm256_fmadd_ps(va, w, _mm256_loadu_ps(yp.add(8 * k)));
                _mm256_storeu_ps(yp.add(8 * k), out);
            }
        }
    }

    /// Four neurons of [`axpy_q8_0`] per pass over `y`, in the group's order.
    /// (No closures here: they would not inherit the target features, and
    /// each intrinsic would become a call.)
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy4_q8_0(group: &[(f32, &[u8]); 4], y: &mut [f32]) {
        let va = [
            _mm256_set1_ps(group[0].0),
            _mm256_set1_ps(group[1].0),
            _mm256_set1_ps(group[2].0),
            _mm256_set1_ps(group[3].0),
        ];
        let cols = [
            group[0].1.as_ptr(),
            group[1].1.as_ptr(),
            group[2].1.as_ptr(),
            group[3].1.as_ptr(),
        ];
        let yp = y.as_mut_ptr();
        for b in 0..y.len() / 32 {
            let mut d = [_mm256_setzero_ps(); 4];
            let mut qs = [std::ptr::null::<u8>(); 4];
            for j in 0..4 {
                // SAFETY: every column holds y.len() / 32 blocks (checked by the caller).
                let blk = cols[j].add(b * Q8_0_BYTES);
                d[j] = _mm256_set1_ps(f16::from_bits(u16::from_le_bytes([*blk, *blk.add(1)])).to_f32());
                qs[j] = blk.add(2);
            }
            for k in 0..4 {
                // SAFETY: 8 of each block's 32 quants and 8 of its 32 outputs.
                let out = yp.add(32 * b + 8 * k);
                let mut acc = _mm256_loadu_ps(out);
                for j in 0..4 {
                    let q = _mm_loadl_epi64(qs[j].add(8 * k) as *const __m128i);
                    let w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d[j]);
                    acc = _mm256_fmadd_ps(va[j], w, acc);
                }
                _mm256_storeu_ps(out, acc);
            }
        }
    }

    /// Four neurons of [`axpy_f16`] per pass over `y`, in the group's order.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy4_f16(group: &[(f32, &[u8]); 4], y: &mut [f32]) {
        let va = [
            _mm256_set1_ps(group[0].0),
            _mm256_set1_ps(group[1].0),
            _mm256_set1_ps(group[2].0),
            _mm256_set1_ps(group[3].0),
        ];
        let n = y.len();
        let main = n - n % 8;
        let yp = y.as_mut_ptr();
        let mut j = 0;
        while j < main {
            // SAFETY: values j..j + 8 exist in y and in every column.
            let mut acc = _mm256_loadu_ps(yp.add(j));
            for (k, (_, col)) in group.iter().enumerate() {
                let w = _mm256_cvtph_ps(_mm_loadu_si128(col.as_ptr().add(2 * j) as *const __m128i));
                acc = _mm256_fmadd_ps(va[k], w, acc);
            }
            _mm256_storeu_ps(yp.add(j), acc);
            j += 8;
        }
        for (e, yj) in y.iter_mut().enumerate().skip(main) {
            for &(a, col) in group {
                let w = f16::from_le_bytes([col[2 * e], col[2 * e + 1]]).to_f32();
                *yj = a.mul_add(w, *yj);
            }
        }
    }

    /// `down_col` holds `y.len()` f16 values (checked by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_f16(a: f32, down_col: &[u8], y: &mut [f32]) {
        let va = _mm256_set1_ps(a);
        let n = y.len();
        let main = n - n % 8;
        let (src, yp) = (down_col.as_ptr(), y.as_mut_ptr());
        let mut j = 0;
        while j < main {
            // SAFETY: values j..j + 8 exist in both slices.
            let w = _mm256_cvtph_ps(_mm_loadu_si128(src.add(2 * j) as *const __m128i));
            let out = _mm256_fmadd_ps(va, w, _mm256_loadu_ps(yp.add(j)));
            _mm256_storeu_ps(yp.add(j), out);
            j += 8;
        }
        for (yj, h) in y[main..].iter_mut().zip(down_col[2 * main..].chunks_exact(2)) {
            let w = f16::from_le_bytes([h[0], h[1]]).to_f32();
            *yj = a.mul_add(w, *yj);
        }
    }
}

/// The NEON twins of `avx2`: per element `fma(a, w, y)` with `w` the
/// dequantized value (Q8_0: `q as f32 * d`, rounded; F16: exact), as the
/// scalar body, so the bits are the same.
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use half::f16;

    use super::Q8_0_BYTES;
    use crate::dot::neon::{fp16, widen_f16x4};

    /// The 32 quants at `qs` as eight f32x4, each times `d` (rounded).
    #[inline(always)]
    unsafe fn q8_0_values(qs: *const u8, d: float32x4_t) -> [float32x4_t; 8] {
        let mut w = [vdupq_n_f32(0.0); 8];
        for h in 0..2 {
            let q = vld1q_s8(qs.add(16 * h) as *const i8);
            let (lo, hi) = (vmovl_s8(vget_low_s8(q)), vmovl_high_s8(q));
            let parts = [
                vmovl_s16(vget_low_s16(lo)),
                vmovl_high_s16(lo),
                vmovl_s16(vget_low_s16(hi)),
                vmovl_high_s16(hi),
            ];
            for (k, p) in parts.into_iter().enumerate() {
                w[4 * h + k] = vmulq_f32(vcvtq_f32_s32(p), d);
            }
        }
        w
    }

    /// The f16 at byte `p` (any alignment) as f32x4.
    #[inline(always)]
    unsafe fn f16_values(p: *const u8) -> float32x4_t {
        widen_f16x4(vreinterpret_u16_u8(vld1_u8(p)))
    }

    #[inline(always)]
    fn scale(block: *const u8) -> f32 {
        // SAFETY (callers): `block` starts a Q8_0 block.
        fp16(f16::from_bits(u16::from_le_bytes(unsafe { [*block, *block.add(1)] })))
    }

    /// `down_col` holds `y.len() / 32` Q8_0 blocks (checked by the caller).
    pub(super) unsafe fn axpy_q8_0(a: f32, down_col: &[u8], y: &mut [f32]) {
        let va = vdupq_n_f32(a);
        for (block, ys) in down_col.chunks_exact(Q8_0_BYTES).zip(y.chunks_exact_mut(32)) {
            let w = q8_0_values(block.as_ptr().add(2), vdupq_n_f32(scale(block.as_ptr())));
            let yp = ys.as_mut_ptr();
            for (k, w) in w.into_iter().enumerate() {
                // SAFETY: 4 of the block's 32 outputs.
                vst1q_f32(yp.add(4 * k), vfmaq_f32(vld1q_f32(yp.add(4 * k)), va, w));
            }
        }
    }

    /// Four neurons of [`axpy_q8_0`] per pass over `y`, in the group's order.
    pub(super) unsafe fn axpy4_q8_0(group: &[(f32, &[u8]); 4], y: &mut [f32]) {
        let va = group.map(|(a, _)| vdupq_n_f32(a));
        let yp = y.as_mut_ptr();
        for b in 0..y.len() / 32 {
            let mut acc = [vdupq_n_f32(0.0); 8];
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = vld1q_f32(yp.add(32 * b + 4 * k));
            }
            for (j, (_, col)) in group.iter().enumerate() {
                // SAFETY: every column holds y.len() / 32 blocks (checked by the caller).
                let blk = col.as_ptr().add(b * Q8_0_BYTES);
                let w = q8_0_values(blk.add(2), vdupq_n_f32(scale(blk)));
                for (acc, w) in acc.iter_mut().zip(w) {
                    *acc = vfmaq_f32(*acc, va[j], w);
                }
            }
            for (k, acc) in acc.into_iter().enumerate() {
                vst1q_f32(yp.add(32 * b + 4 * k), acc);
            }
        }
    }

    /// `down_col` holds `y.len()` f16 values (checked by the caller).
    pub(super) unsafe fn axpy_f16(a: f32, down_col: &[u8], y: &mut [f32]) {
        let va = vdupq_n_f32(a);
        let n = y.len();
        let main = n - n % 4;
        let (src, yp) = (down_col.as_ptr(), y.as_mut_ptr());
        for j in (0..main).step_by(4) {
            // SAFETY: values j..j + 4 exist in both slices.
            vst1q_f32(
                yp.add(j),
                vfmaq_f32(vld1q_f32(yp.add(j)), va, f16_values(src.add(2 * j))),
            );
        }
        for (yj, h) in y[main..].iter_mut().zip(down_col[2 * main..].chunks_exact(2)) {
            *yj = a.mul_add(fp16(f16::from_le_bytes([h[0], h[1]])), *yj);
        }
    }

    /// Four neurons of [`axpy_f16`] per pass over `y`, in the group's order.
    pub(super) unsafe fn axpy4_f16(group: &[(f32, &[u8]); 4], y: &mut [f32]) {
        let va = group.map(|(a, _)| vdupq_n_f32(a));
        let n = y.len();
        let main = n - n % 4;
        let yp = y.as_mut_ptr();
        for j in (0..main).step_by(4) {
            // SAFETY: values j..j + 4 exist in y and in every column.
            let mut acc = vld1q_f32(yp.add(j));
            for (k, (_, col)) in group.iter().enumerate() {
                acc = vfmaq_f32(acc, va[k], f16_values(col.as_ptr().add(2 * j)));
            }
            vst1q_f32(yp.add(j), acc);
        }
        for (e, yj) in y.iter_mut().enumerate().skip(main) {
            for &(a, col) in group {
                *yj = a.mul_add(fp16(f16::from_le_bytes([col[2 * e], col[2 * e + 1]])), *yj);
            }
        }
    }
}

/// Stage 2, once per layer: `y += Σ a_i * down_i` over the neurons recorded
/// in `layer`, in ascending id order, skipping `a_i == 0`. `bundle(i)` gives
/// neuron i's whole bundle (only its down column is read); `y` has n_embd
/// values. See the module doc for why the result cannot depend on the order
/// in which stage 1 saw the bundles.
pub fn accumulate_down<'b>(
    format: &BundleFormat,
    layer: &LayerActivations,
    bundle: impl FnMut(usize) -> &'b [u8],
    y: &mut [f32],
) -> Result<(), KernelError> {
    accumulate(format, layer, bundle, y, axpy_down)
}

/// [`accumulate_down`] split over `y` across rayon's threads: each task owns
/// a run of whole down blocks of `y` and adds every neuron's share to it in
/// the same ascending id order, so every `y[j]` sees the same operations in
/// the same order as in [`accumulate_down`] (the results are bit-identical).
pub fn accumulate_down_parallel<'b>(
    format: &BundleFormat,
    layer: &LayerActivations,
    bundle: impl Fn(usize) -> &'b [u8] + Sync,
    y: &mut [f32],
) -> Result<(), KernelError> {
    use rayon::prelude::*;
    check_output(format, y)?;
    let blk = format.down_ty.block_size();
    let blk_bytes = format.down_ty.row_bytes(blk)?;
    let n_blocks = y.len() / blk;
    // Below ~8 blocks per task the split costs more than it saves.
    let tasks = rayon::current_num_threads().min(n_blocks / 8).max(1);
    let per_task = n_blocks.div_ceil(tasks) * blk;
    y.par_chunks_mut(per_task).enumerate().try_for_each(|(t, ys)| {
        let b0 = t * per_task / blk;
        let cols = b0 * blk_bytes..(b0 + ys.len() / blk) * blk_bytes;
        for (id, a) in layer.iter() {
            if a == 0.0 {
                continue;
            }
            let (_, _, down) = format.split(bundle(id))?;
            axpy_down(format.down_ty, a, &down[cols.clone()], ys)?;
        }
        Ok(())
    })
}

/// [`accumulate_down`] with the scalar kernel (bit-identical to it).
pub fn accumulate_down_scalar<'b>(
    format: &BundleFormat,
    layer: &LayerActivations,
    bundle: impl FnMut(usize) -> &'b [u8],
    y: &mut [f32],
) -> Result<(), KernelError> {
    accumulate(format, layer, bundle, y, axpy_down_scalar)
}

type Axpy = fn(GgmlType, f32, &[u8], &mut [f32]) -> Result<(), KernelError>;

/// A valid format and an output of `n_embd` values.
fn check_output(format: &BundleFormat, y: &[f32]) -> Result<(), KernelError> {
    format.validate_columns()?;
    if y.len() != format.n_embd {
        return Err(KernelError::Length {
            what: "FFN output",
            expected: format.n_embd,
            got: y.len(),
        });
    }
    Ok(())
}

fn accumulate<'b>(
    format: &BundleFormat,
    layer: &LayerActivations,
    mut bundle: impl FnMut(usize) -> &'b [u8],
    y: &mut [f32],
    axpy: Axpy,
) -> Result<(), KernelError> {
    check_output(format, y)?;
    for (id, a) in layer.iter() {
        if a == 0.0 {
            continue;
        }
        let (_, _, down) = format.split(bundle(id))?;
        axpy(format.down_ty, a, down, y)?;
    }
    Ok(())
}
