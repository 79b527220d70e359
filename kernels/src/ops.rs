//! Elementwise and row-wise ops of a transformer layer, with GGML's CPU
//! numerics where they affect results (f64 accumulation in norms and
//! softmax, GELU through an f16 round trip, iterated RoPE angles).
//!
//! Where ggml's CPU code differs by machine, each op follows the llama.cpp
//! build for this machine: AVX-512 on x86_64; on aarch64 GCC's build for
//! ARMv8 with NEON (no FP16 arithmetic, no SVE). There:
//! - `exp` is the NEON `ggml_v_expf` ([`expf_ggml_neon`]): the same range
//!   reduction and coefficients as the AVX-512 one, but the polynomial ends
//!   in `k + k * j` with `j` lacking the constant 1, and large arguments are
//!   scaled in two steps instead of by `vscalefps`;
//! - softmax sums ([`exp_sum`]) go in groups of four lanes, each reduced by
//!   `vaddvq_f32` (`(l0 + l1) + (l2 + l3)`) and added into the f64 total;
//!   the last `len % 4` values take libm's `expf` and are added one by one;
//! - SwiGLU is `ggml_v_silu` (a `vdivq_f32`) times the up value, four lanes
//!   at a time; GEGLU is the same f16 table on both;
//! - RoPE follows GCC's code for `rotate_pairs`: for adjacent pairs
//!   ([`RopeStyle::Interleaved`]) GCC vectorizes four pairs at a time with
//!   `ld2`/`st2` and contracts the products the other way round for the
//!   first output (see [`RopeTable::apply`]); split halves stay scalar, with
//!   the same contractions as on x86.
//!
//! Norms, scaling and the elementwise adds are the same IEEE operations on
//! every machine (the portable loops, compiled for NEON by LLVM, give the bits).

use std::sync::OnceLock;

use half::f16;
use rayon::prelude::*;

/// Elementwise ops over at least this many values split across rayon's
/// threads (a 512-token prompt's FFN activations are 1M values; a decode
/// step's few thousand stay on the calling thread).
const PARALLEL_VALUES: usize = 1 << 15;
/// Values per parallel piece.
const PARALLEL_CHUNK: usize = 1 << 13;

/// `op(x, y)` over matching pieces of `x` and `y`, in parallel when large.
fn pieces(x: &mut [f32], y: &[f32], op: impl Fn(&mut [f32], &[f32]) + Sync) {
    if x.len() >= PARALLEL_VALUES {
        x.par_chunks_mut(PARALLEL_CHUNK)
            .zip(y.par_chunks(PARALLEL_CHUNK))
            .for_each(|(x, y)| op(x, y));
    } else {
        op(x, y);
    }
}

/// `out = x / rms(x) * weight`, the sum of squares accumulated in f64 as GGML does.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(x.len() == weight.len() && x.len() == out.len());
    let [sum] = sums_of_squares([x]);
    scale_row(x, weight, rms_scale(sum, x.len(), eps), out);
}

/// Rows normalized together: their sums of squares are separate chains of
/// f64 adds (each in GGML's order), so running several at once hides the
/// adds' latency, which bounds a lone row.
const NORM_ROWS: usize = 4;

/// Each row's sum of squares, `(v * v) as f64` added in order, the rows'
/// chains interleaved.
#[inline(always)]
fn sums_of_squares<const R: usize>(rows: [&[f32]; R]) -> [f64; R] {
    let len = rows.iter().map(|r| r.len()).min().unwrap_or(0);
    let mut sums = [0.0f64; R];
    for i in 0..len {
        for (sum, row) in sums.iter_mut().zip(&rows) {
            let v = row[i];
            *sum += (v * v) as f64;
        }
    }
    sums
}

/// The mean of `x`'s squares as [`rms_norm`] takes it (the GPU backend's
/// norm is checked against it bit for bit).
pub fn mean_square(x: &[f32]) -> f32 {
    let [sum] = sums_of_squares([x]);
    mean_of(sum, x.len())
}

#[inline(always)]
fn mean_of(sum: f64, len: usize) -> f32 {
    (sum / len as f64) as f32
}

#[inline(always)]
fn rms_scale(sum: f64, len: usize, eps: f32) -> f32 {
    1.0 / (mean_of(sum, len) + eps).sqrt()
}

#[inline(always)]
fn scale_row(x: &[f32], weight: &[f32], scale: f32, out: &mut [f32]) {
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// [`rms_norm`] of consecutive rows of `x` (as long as `weight`), up to
/// [`NORM_ROWS`] at a time, into `out`.
fn rms_norm_chunk(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let rows = x.len().min(out.len()) / d;
    let row = |r: usize| r * d..(r + 1) * d;
    let mut r = 0;
    while r + NORM_ROWS <= rows {
        let xs: [&[f32]; NORM_ROWS] = std::array::from_fn(|i| &x[row(r + i)]);
        for (i, sum) in sums_of_squares(xs).into_iter().enumerate() {
            scale_row(xs[i], weight, rms_scale(sum, d, eps), &mut out[row(r + i)]);
        }
        r += NORM_ROWS;
    }
    for r in r..rows {
        rms_norm(&x[row(r)], weight, eps, &mut out[row(r)]);
    }
}

/// `rms_norm` of each row of `x` (rows as long as `weight`) into `out`.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    if d == 0 {
        return;
    }
    if x.len() >= PARALLEL_VALUES {
        let piece = PARALLEL_CHUNK.div_ceil(d) * d;
        out.par_chunks_mut(piece)
            .zip(x.par_chunks(piece))
            .for_each(|(out, x)| rms_norm_chunk(x, weight, eps, out));
    } else {
        rms_norm_chunk(x, weight, eps, out);
    }
}

/// In-place RMS norm of each `head_dim` chunk of `x` (per-head q/k norms),
/// up to four heads at a time (their f64 sums side by side).
pub fn rms_norm_heads(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    if d == 0 {
        return;
    }
    let mut groups = x.chunks_exact_mut(d * NORM_ROWS);
    for group in &mut groups {
        let sums = {
            let heads: [&[f32]; NORM_ROWS] = std::array::from_fn(|i| &group[i * d..(i + 1) * d]);
            sums_of_squares(heads)
        };
        for (head, sum) in group.chunks_exact_mut(d).zip(sums) {
            scale_in_place(head, weight, rms_scale(sum, d, eps));
        }
    }
    for head in groups.into_remainder().chunks_exact_mut(d) {
        let [sum] = sums_of_squares([&*head]);
        scale_in_place(head, weight, rms_scale(sum, d, eps));
    }
}

#[inline(always)]
fn scale_in_place(x: &mut [f32], weight: &[f32], scale: f32) {
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = (*v * scale) * w;
    }
}

/// `exp(x)` exactly as this machine's llama.cpp build computes it in its
/// vector kernels: [`expf_ggml_neon`] on aarch64, [`expf_ggml_avx512`]
/// elsewhere. Softmax probabilities are later rounded to f16, where a one-ulp
/// difference in exp can flip a rounding, so matching llama.cpp needs its
/// exp, not libm's.
#[inline(always)]
pub fn expf_ggml(x: f32) -> f32 {
    #[cfg(target_arch = "aarch64")]
    {
        expf_ggml_neon(x)
    }
    #[cfg(not(target_arch = "aarch64"))]
    expf_ggml_avx512(x)
}

/// `exp(x)` exactly as GGML's AVX-512 `ggml_v_expf` computes it (a range
/// reduction, a degree-5 polynomial and a power-of-two scale, ~1.5 ulp).
#[inline(always)]
pub fn expf_ggml_avx512(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000); // 0x1.8p23: rounds x/ln2 to an integer in the mantissa
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    scalef(j, n)
}

/// `exp(x)` exactly as GGML's NEON `ggml_v_expf` computes it, lane by lane
/// (`vfmaq_f32(a, b, c)` is `c.mul_add(b, a)`, `vfmsq_f32(a, b, c)` is
/// `(-c).mul_add(b, a)`): the AVX-512 function's reduction and coefficients,
/// with `exp = k + k * j` for `k = 2^n` and, past |n| = 126, a scale in two
/// steps (`s2 + s2 * j`, then times `s1`); past |n| = 192, 0 or infinity.
#[inline(always)]
pub fn expf_ggml_neon(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 || n.is_nan() {
        return k.mul_add(j, k);
    }
    let d: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(d.wrapping_add(0x7f00_0000));
    if n.abs() > 192.0 {
        return s1 * s1;
    }
    let s2 = f32::from_bits(e.wrapping_sub(d));
    s2.mul_add(j, s2) * s1
}

/// `j * 2^n` for integral `n` in [-192, 192], rounding once like `vscalefps`.
#[inline(always)]
fn scalef(j: f32, n: f32) -> f32 {
    let n = n as i32;
    // Two steps keep each factor a normal float; the product rounds once.
    let (a, b) = (n / 2, n - n / 2);
    j * f32::from_bits(((a + 127) as u32) << 23) * f32::from_bits(((b + 127) as u32) << 23)
}

/// Numerically stable softmax in place. Exponentials come from `expf_ggml`
/// and are summed as [`exp_sum`] says (GGML's AVX-512 kernel: sixteen lanes
/// reduced in a fixed tree in f32, each group added into an f64 total; its
/// NEON kernel on aarch64: groups of four). Groups are counted from the start
/// of `x`, so callers align `x` to the cache position 0.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::dot::has_avx2() {
        // SAFETY: avx2 and fma were detected at run time.
        return unsafe { softmax_fma(x) };
    }
    softmax_body(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_fma(x: &mut [f32]) {
    softmax_body(x)
}

#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = exp_sum(x, max);
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x[i] = exp(x[i] - max)` and their sum, as this machine's
/// `ggml_vec_soft_max_f32`: [`exp_sum_neon_order`] on aarch64 (NEON
/// kernels), [`exp_sum_x86_order`] elsewhere.
#[inline(always)]
pub fn exp_sum(x: &mut [f32], max: f32) -> f64 {
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { neon::exp_sum(x, max) }
    }
    #[cfg(not(target_arch = "aarch64"))]
    exp_sum_x86_order(x, max)
}

/// `x[i] = exp(x[i] - max)` and their sum, as `ggml_vec_soft_max_f32` on
/// AVX-512: sixteen lanes reduced in a fixed tree in f32, each group added
/// into an f64 total.
#[inline(always)]
pub fn exp_sum_x86_order(x: &mut [f32], max: f32) -> f64 {
    let mut sum = 0.0f64;
    for group in x.chunks_mut(16) {
        let mut lanes = [0.0f32; 16];
        for (lane, v) in lanes.iter_mut().zip(group.iter_mut()) {
            *v = expf_ggml_avx512(*v - max);
            *lane = *v;
        }
        sum += crate::f16dot::reduce16(&lanes) as f64;
    }
    sum
}

/// `x[i] = exp(x[i] - max)` and their sum, as `ggml_vec_soft_max_f32` on
/// NEON, portably: groups of four [`expf_ggml_neon`] values, each group
/// reduced as `vaddvq_f32` does and added into an f64 total; the last
/// `len % 4` values by libm's `expf` (as ggml's scalar tail), each added on
/// its own.
#[inline(always)]
pub fn exp_sum_neon_order(x: &mut [f32], max: f32) -> f64 {
    let mut sum = 0.0f64;
    let mut groups = x.chunks_exact_mut(4);
    for group in &mut groups {
        let mut lanes = [0.0f32; 4];
        for (lane, v) in lanes.iter_mut().zip(group.iter_mut()) {
            *v = expf_ggml_neon(*v - max);
            *lane = *v;
        }
        sum += crate::f16dot::reduce4(&lanes) as f64;
    }
    for v in groups.into_remainder() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    sum
}

/// SiLU-gated unit: `gate[i] = silu(gate[i]) * up[i]`, with GGML's exp.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    pieces(gate, up, |gate, up| {
        #[cfg(target_arch = "x86_64")]
        if crate::dot::has_avx2() {
            // SAFETY: avx2 and fma were detected at run time.
            return unsafe { swiglu_fma(gate, up) };
        }
        #[cfg(target_arch = "aarch64")]
        {
            // SAFETY: NEON is part of the aarch64 baseline.
            unsafe { neon::swiglu(gate, up) }
        }
        #[cfg(not(target_arch = "aarch64"))]
        swiglu_body(gate, up)
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_fma(gate: &mut [f32], up: &[f32]) {
    swiglu_body(gate, up)
}

#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = swiglu_element(*g, u);
    }
}

/// One element of [`swiglu`]: `silu(g) * u`, the same float operations (so
/// the same bits; callers wanting speed run it where FMA is enabled, since
/// `expf_ggml` uses fused multiply-adds). On aarch64 this is NEON's
/// `ggml_v_silu(g) * u` (ggml computes `0 - g` where this negates; the exp
/// of either zero is 1). ggml takes a row's last `len % 4` (aarch64) or
/// `len % 16` (AVX-512) values through libm's `expf` instead; FFN widths
/// are multiples of 16, so every element of a real row is a vector one.
#[inline(always)]
pub fn swiglu_element(g: f32, u: f32) -> f32 {
    g / (1.0 + expf_ggml(-g)) * u
}

/// Tanh-approximated GELU in f32, with the fused multiply-add GGML's C
/// compiler forms for `1 + a·x·x`.
fn gelu_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// GGML's CPU backend evaluates GELU through a table indexed by the input
/// rounded to f16, whose entries are f16 too. We keep the same table (as f32
/// values of those f16 entries): it is both what makes our outputs match and
/// far cheaper than `tanh` per element. Indexed by every f16 bit pattern, so
/// another device can upload it whole (the GPU backend does).
pub fn gelu_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_f32(f16::from_bits(bits).to_f32())).to_f32())
            .collect()
    })
}

/// GELU of one value, as GGML's CPU backend computes it.
pub fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[f16::from_f32(x).to_bits() as usize]
    }
}

/// GELU-gated unit: `gate[i] = gelu(gate[i]) * up[i]`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    pieces(gate, up, |gate, up| {
        #[cfg(target_arch = "x86_64")]
        if crate::dot::has_avx2() {
            // SAFETY: AVX2, FMA and F16C were detected at run time.
            return unsafe { geglu_avx2(table, gate, up) };
        }
        #[cfg(target_arch = "aarch64")]
        {
            // SAFETY: NEON is part of the aarch64 baseline.
            unsafe { neon::geglu(table, gate, up) }
        }
        #[cfg(not(target_arch = "aarch64"))]
        geglu_scalar(table, gate, up)
    })
}

fn geglu_scalar(table: &[f32], gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = geglu_with(table, *g, u);
    }
}

/// [`geglu_with`] eight at a time: F16C's round to nearest even is the
/// same rounding as `f16::from_f32`, and the table read is a gather.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn geglu_avx2(table: &[f32], gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    debug_assert_eq!(table.len(), 1 << 16);
    let len = gate.len().min(up.len());
    let body = len - len % 8;
    let (low, high) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
    for i in (0..body).step_by(8) {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        let bits = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(g));
        // Every u16 indexes the 65536-entry table.
        let looked_up = _mm256_mul_ps(_mm256_i32gather_ps::<4>(table.as_ptr(), bits), u);
        let above = _mm256_cmp_ps::<_CMP_GE_OQ>(g, high);
        let below = _mm256_cmp_ps::<_CMP_LE_OQ>(g, low);
        let value = _mm256_blendv_ps(looked_up, _mm256_mul_ps(g, u), above);
        _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_andnot_ps(below, value));
    }
    geglu_scalar(table, &mut gate[body..len], &up[body..len]);
}

/// One element of [`geglu`]: `gelu(g) * u`, the same float operations.
#[inline]
pub fn geglu_element(g: f32, u: f32) -> f32 {
    geglu_with(gelu_table(), g, u)
}

#[inline(always)]
fn geglu_with(table: &[f32], g: f32, u: f32) -> f32 {
    if g <= -10.0 {
        0.0
    } else if g >= 10.0 {
        g * u
    } else {
        table[f16::from_f32(g).to_bits() as usize] * u
    }
}

/// How rotary embeddings pair up dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x[2i], x[2i+1]): Llama, Mistral, SmolLM.
    Interleaved,
    /// Split halves (x[i], x[i + n/2]): GPT-NeoX, Qwen2, Gemma.
    Neox,
}

/// Cos/sin table for one position, base and rotary width; filled per token
/// into a buffer allocated once.
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(n_rot: usize) -> Self {
        Self {
            cos: vec![0.0; n_rot / 2],
            sin: vec![0.0; n_rot / 2],
        }
    }

    /// Angles as GGML computes them: theta multiplied by `base^(-2/n_rot)`
    /// once per pair rather than raised afresh, so rounding matches.
    pub fn fill(&mut self, pos: usize, base: f32, freq_scale: f32) {
        let n_rot = self.cos.len() * 2;
        let theta_scale = base.powf(-2.0 / n_rot as f32);
        let mut theta = pos as f32;
        for (c, s) in self.cos.iter_mut().zip(self.sin.iter_mut()) {
            let t = theta * freq_scale;
            *c = t.cos();
            *s = t.sin();
            theta *= theta_scale;
        }
    }

    /// Rotates every `head_dim` chunk of `x` (dims past n_rot pass through).
    ///
    /// Each output is ggml's `x0*cos - x1*sin` / `x0*sin + x1*cos` with one
    /// product rounded and the other fused into the add or subtract, as GCC
    /// contracts them ([`RopeTable::apply_x86_order`]: the `x0` products
    /// fused). On aarch64 GCC vectorizes the adjacent-pair loop four pairs at
    /// a time and fuses `x1 * sin` into the first output there instead
    /// ([`RopeTable::apply_neon_order`]), which the NEON code here follows.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, style: RopeStyle) {
        #[cfg(target_arch = "x86_64")]
        if crate::dot::has_avx2() {
            // SAFETY: FMA was detected at run time. The fused multiply-adds
            // are then instructions instead of libm calls: the same bits.
            return unsafe { self.apply_fma(x, head_dim, style) };
        }
        #[cfg(target_arch = "aarch64")]
        if style == RopeStyle::Interleaved {
            // SAFETY: NEON is part of the aarch64 baseline.
            return unsafe { self.apply_neon(x, head_dim) };
        }
        self.apply_body(x, head_dim, style)
    }

    /// Portable twin of [`RopeTable::apply`] on x86_64 (and of the split-halves
    /// style everywhere): the `x0` products fused.
    pub fn apply_x86_order(&self, x: &mut [f32], head_dim: usize, style: RopeStyle) {
        self.apply_body(x, head_dim, style)
    }

    /// Portable twin of [`RopeTable::apply`] on aarch64: split halves as
    /// [`RopeTable::apply_x86_order`]; adjacent pairs in groups of four from
    /// the start of each head with `x0 * cos` and `x1 * cos` rounded and the
    /// other products fused (GCC's `ld2`/`fmul`/`fmls`/`fmla` loop), the
    /// pairs past the last group as on x86.
    pub fn apply_neon_order(&self, x: &mut [f32], head_dim: usize, style: RopeStyle) {
        if style == RopeStyle::Neox {
            return self.apply_body(x, head_dim, style);
        }
        let half = self.cos.len();
        let groups = half / 4 * 4;
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                let (c, s) = (self.cos[i], self.sin[i]);
                if i < groups {
                    head[2 * i] = (-x1).mul_add(s, x0 * c);
                    head[2 * i + 1] = x0.mul_add(s, x1 * c);
                } else {
                    head[2 * i] = x0.mul_add(c, -(x1 * s));
                    head[2 * i + 1] = x0.mul_add(s, x1 * c);
                }
            }
        }
    }

    #[cfg(target_arch = "aarch64")]
    unsafe fn apply_neon(&self, x: &mut [f32], head_dim: usize) {
        use core::arch::aarch64::*;
        let half = self.cos.len();
        let groups = half / 4 * 4;
        let (cp, sp) = (self.cos.as_ptr(), self.sin.as_ptr());
        for head in x.chunks_exact_mut(head_dim) {
            let h = head.as_mut_ptr();
            for i in (0..groups).step_by(4) {
                // SAFETY: 2 * (i + 4) <= 2 * half <= head_dim; i + 4 <= half.
                let xs = vld2q_f32(h.add(2 * i));
                let (c, s) = (vld1q_f32(cp.add(i)), vld1q_f32(sp.add(i)));
                let (x0, x1) = (xs.0, xs.1);
                let first = vfmsq_f32(vmulq_f32(x0, c), x1, s);
                let second = vfmaq_f32(vmulq_f32(x1, c), x0, s);
                vst2q_f32(h.add(2 * i), float32x4x2_t(first, second));
            }
            for i in groups..half {
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = x0.mul_add(self.cos[i], -(x1 * self.sin[i]));
                head[2 * i + 1] = x0.mul_add(self.sin[i], x1 * self.cos[i]);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn apply_fma(&self, x: &mut [f32], head_dim: usize, style: RopeStyle) {
        self.apply_body(x, head_dim, style)
    }

    #[inline(always)]
    fn apply_body(&self, x: &mut [f32], head_dim: usize, style: RopeStyle) {
        let half = self.cos.len();
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                // GGML's C compiler contracts these into fused multiply-adds;
                // doing the same keeps keys identical before their f16 rounding.
                head[a] = x0.mul_add(self.cos[i], -(x1 * self.sin[i]));
                head[b] = x0.mul_add(self.sin[i], x1 * self.cos[i]);
            }
        }
    }
}

/// `y += x`.
pub fn add_assign(y: &mut [f32], x: &[f32]) {
    for (a, &b) in y.iter_mut().zip(x) {
        *a += b;
    }
}

/// `x *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// NEON kernels of the aarch64 build (baseline on aarch64: no run-time
/// detection), each checked against its portable formula in the tests.
#[cfg(target_arch = "aarch64")]
mod neon {
    use core::arch::aarch64::*;
    use core::arch::asm;

    /// GGML's NEON `ggml_v_expf`, instruction for instruction.
    #[inline(always)]
    pub unsafe fn v_expf(x: float32x4_t) -> float32x4_t {
        let c = |b: u32| vdupq_n_f32(f32::from_bits(b));
        let r = c(0x4b40_0000);
        let z = vfmaq_f32(r, x, c(0x3fb8_aa3b));
        let n = vsubq_f32(z, r);
        let b = vfmsq_f32(vfmsq_f32(x, n, c(0x3f31_7200)), n, c(0x35bf_be8e));
        let e = vshlq_n_u32::<23>(vreinterpretq_u32_f32(z));
        let k = vreinterpretq_f32_u32(vaddq_u32(e, vreinterpretq_u32_f32(vdupq_n_f32(1.0))));
        let big = vcagtq_f32(n, vdupq_n_f32(126.0));
        let u = vmulq_f32(b, b);
        let j = vfmaq_f32(
            vmulq_f32(c(0x3f7f_fff6), b),
            vfmaq_f32(
                vfmaq_f32(c(0x3eff_fedb), c(0x3e2a_af33), b),
                vfmaq_f32(c(0x3d2b_9f17), c(0x3c07_2010), b),
                u,
            ),
            u,
        );
        if vmaxvq_u32(big) == 0 {
            return vfmaq_f32(k, j, k);
        }
        let d = vandq_u32(vclezq_f32(n), vdupq_n_u32(0x8200_0000));
        let s1 = vreinterpretq_f32_u32(vaddq_u32(d, vdupq_n_u32(0x7f00_0000)));
        let s2 = vreinterpretq_f32_u32(vsubq_u32(e, d));
        vbslq_f32(
            vcagtq_f32(n, vdupq_n_f32(192.0)),
            vmulq_f32(s1, s1),
            vbslq_f32(big, vmulq_f32(vfmaq_f32(s2, s2, j), s1), vfmaq_f32(k, k, j)),
        )
    }

    /// `ggml_vec_soft_max_f32` of the NEON build.
    pub unsafe fn exp_sum(x: &mut [f32], max: f32) -> f64 {
        let n = x.len() / 4 * 4;
        let (p, m) = (x.as_mut_ptr(), vdupq_n_f32(max));
        let mut sum = 0.0f64;
        for i in (0..n).step_by(4) {
            // SAFETY: i + 4 <= x.len().
            let v = v_expf(vsubq_f32(vld1q_f32(p.add(i)), m));
            vst1q_f32(p.add(i), v);
            sum += vaddvq_f32(v) as f64;
        }
        for v in &mut x[n..] {
            *v = (*v - max).exp();
            sum += *v as f64;
        }
        sum
    }

    /// `ggml_vec_swiglu_f32` of the NEON build: `ggml_v_silu(g) * u`.
    pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
        let len = gate.len().min(up.len());
        let n = len / 4 * 4;
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let (zero, one) = (vdupq_n_f32(0.0), vdupq_n_f32(1.0));
        for i in (0..n).step_by(4) {
            // SAFETY: i + 4 <= len for both slices.
            let x = vld1q_f32(g.add(i));
            let silu = vdivq_f32(x, vaddq_f32(one, v_expf(vsubq_f32(zero, x))));
            vst1q_f32(g.add(i), vmulq_f32(silu, vld1q_f32(u.add(i))));
        }
        super::swiglu_body(&mut gate[n..len], &up[n..len]);
    }

    /// [`super::geglu_with`] four at a time: `fcvtn` rounds to nearest even
    /// as `f16::from_f32` does, the table read is four loads.
    pub unsafe fn geglu(table: &[f32], gate: &mut [f32], up: &[f32]) {
        debug_assert_eq!(table.len(), 1 << 16);
        let len = gate.len().min(up.len());
        let n = len / 4 * 4;
        let (g, u, t) = (gate.as_mut_ptr(), up.as_ptr(), table.as_ptr());
        let (low, high) = (vdupq_n_f32(-10.0), vdupq_n_f32(10.0));
        for i in (0..n).step_by(4) {
            // SAFETY: i + 4 <= len for both slices.
            let x = vld1q_f32(g.add(i));
            let y = vld1q_f32(u.add(i));
            let h: uint16x4_t;
            asm!("fcvtn {d:v}.4h, {s:v}.4s", d = lateout(vreg) h, s = in(vreg) x, options(pure, nomem, nostack, preserves_flags));
            let mut looked = [0.0f32; 4];
            let mut bits = [0u16; 4];
            vst1_u16(bits.as_mut_ptr(), h);
            for (l, &b) in looked.iter_mut().zip(&bits) {
                // SAFETY: every u16 indexes the 65536-entry table.
                *l = *t.add(b as usize);
            }
            let value = vbslq_f32(
                vcgeq_f32(x, high),
                vmulq_f32(x, y),
                vmulq_f32(vld1q_f32(looked.as_ptr()), y),
            );
            let value = vbslq_f32(vcleq_f32(x, low), vdupq_n_f32(0.0), value);
            vst1q_f32(g.add(i), value);
        }
        super::geglu_scalar(table, &mut gate[n..len], &up[n..len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_ignores_masked() {
        let mut x = [1.0, 2.0, f32::NEG_INFINITY, 3.0];
        softmax(&mut x);
        assert_eq!(x[2], 0.0);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] > x[1] && x[1] > x[0]);
    }

    #[test]
    fn ggml_exp_is_close_to_libm_everywhere() {
        for i in -2000..2000 {
            let x = i as f32 * 0.05;
            let (a, b) = (expf_ggml(x), x.exp());
            // Relative accuracy holds for normal results; subnormals keep fewer bits.
            let tol = if b >= f32::MIN_POSITIVE {
                4.0 * f32::EPSILON * b
            } else {
                1e-44
            };
            assert!(a == b || (a - b).abs() <= tol, "x={x}: {a} vs {b}");
        }
        assert_eq!(expf_ggml(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf_ggml(-200.0), 0.0);
        assert_eq!(expf_ggml(0.0), 1.0);
    }

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
        let mut out = vec![0.0; 64];
        rms_norm(&x, &vec![1.0; 64], 0.0, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 64.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-5);
    }

    #[test]
    fn rope_preserves_norm_and_position_zero_is_identity() {
        let mut t = RopeTable::new(8);
        let orig: Vec<f32> = (0..16).map(|i| (i as f32).sin()).collect();
        t.fill(0, 10000.0, 1.0);
        let mut x = orig.clone();
        t.apply(&mut x, 8, RopeStyle::Neox);
        assert_eq!(x, orig);
        t.fill(17, 10000.0, 1.0);
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let mut x = orig.clone();
            t.apply(&mut x, 8, style);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
            assert_ne!(x, orig);
        }
    }

    #[test]
    fn norms_of_several_rows_equal_one_row_at_a_time() {
        let d = 40;
        let weight: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / 64.0).collect();
        for rows in [1, 3, 4, 7, 9] {
            // Wide dynamic range, so a changed order of f64 adds would show.
            let x: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 7919) % 211) as f32 * 10f32.powi((i % 9) as i32 - 4))
                .collect();
            let mut together = vec![0.0; rows * d];
            rms_norm_rows(&x, &weight, 1e-6, &mut together);
            let mut heads = x.clone();
            rms_norm_heads(&mut heads, &weight, 1e-6);
            for r in 0..rows {
                let mut alone = vec![0.0; d];
                rms_norm(&x[r * d..(r + 1) * d], &weight, 1e-6, &mut alone);
                let sum: f64 = x[r * d..(r + 1) * d].iter().map(|&v| (v * v) as f64).sum();
                let scale = 1.0 / ((sum / d as f64) as f32 + 1e-6).sqrt();
                for i in 0..d {
                    let expected = (x[r * d + i] * scale) * weight[i];
                    assert_eq!(alone[i].to_bits(), expected.to_bits(), "row {r} col {i}");
                    assert_eq!(
                        together[r * d + i].to_bits(),
                        expected.to_bits(),
                        "rows {rows}: row {r} col {i}"
                    );
                    assert_eq!(
                        heads[r * d + i].to_bits(),
                        expected.to_bits(),
                        "heads {rows}: row {r} col {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn gated_units_match_their_elementwise_forms_at_any_size() {
        // Above and below the parallel threshold, with a ragged tail, and
        // across every branch of the GELU table (|g| >= 10, ties to f16).
        for len in [7, 1000, PARALLEL_VALUES + 13] {
            let g: Vec<f32> = (0..len).map(|i| ((i * 7919) % 4001) as f32 / 150.0 - 13.3).collect();
            let u: Vec<f32> = (0..len).map(|i| ((i * 104_729) % 997) as f32 / 300.0 - 1.5).collect();
            let mut geglu_out = g.clone();
            geglu(&mut geglu_out, &u);
            let mut swiglu_out = g.clone();
            swiglu(&mut swiglu_out, &u);
            for i in 0..len {
                assert_eq!(
                    geglu_out[i].to_bits(),
                    geglu_element(g[i], u[i]).to_bits(),
                    "geglu {i}: {}",
                    g[i]
                );
                assert_eq!(
                    swiglu_out[i].to_bits(),
                    swiglu_element(g[i], u[i]).to_bits(),
                    "swiglu {i}"
                );
            }
        }
    }

    #[test]
    fn gelu_matches_tanh_formula_within_f16_precision() {
        for i in -300..300 {
            let x = i as f32 * 0.037;
            let exact = 0.5 * x * (1.0 + (0.797_884_6 * x * (1.0 + 0.044715 * x * x)).tanh());
            assert!((gelu(x) - exact).abs() <= 2e-3 * exact.abs().max(1.0), "x={x}");
        }
        assert_eq!(gelu(-11.0), 0.0);
        assert_eq!(gelu(12.0), 12.0);
    }

    #[test]
    fn neon_exp_is_close_to_libm_and_differs_from_avx512() {
        let mut differ = 0;
        for i in -2100..1800 {
            let x = i as f32 * 0.05 + 0.013;
            let (a, b) = (expf_ggml_neon(x), x.exp());
            let tol = if b >= f32::MIN_POSITIVE {
                4.0 * f32::EPSILON * b
            } else {
                1e-44
            };
            assert!(a == b || (a - b).abs() <= tol, "x={x}: {a} vs {b}");
            differ += (a != expf_ggml_avx512(x)) as usize;
        }
        assert!(differ > 0);
        assert_eq!(expf_ggml_neon(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf_ggml_neon(-200.0), 0.0);
        assert_eq!(expf_ggml_neon(0.0), 1.0);
        assert_eq!(expf_ggml_neon(100.0), f32::INFINITY);
    }

    #[test]
    fn exp_sums_of_both_orders_are_accurate() {
        for n in [1usize, 4, 7, 64, 67, 1000] {
            let x: Vec<f32> = crate::f16dot::golden::wide(n, 9).iter().map(|v| v * 0.05).collect();
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exact: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
            let (mut a, mut b) = (x.clone(), x.clone());
            for sum in [exp_sum_neon_order(&mut a, max), exp_sum_x86_order(&mut b, max)] {
                assert!((sum - exact).abs() <= 1e-6 * exact, "n={n}: {sum} vs {exact}");
            }
            let mut c = x.clone();
            let native = exp_sum(&mut c, max);
            let (want, vals) = if cfg!(target_arch = "aarch64") {
                (exp_sum_neon_order(&mut x.clone(), max), a)
            } else {
                (exp_sum_x86_order(&mut x.clone(), max), b)
            };
            assert_eq!(native.to_bits(), want.to_bits(), "n={n}");
            assert_eq!(c, vals, "n={n}");
        }
    }

    #[test]
    fn rope_orders_agree_with_apply_and_differ_from_each_other() {
        let mut t = RopeTable::new(96);
        t.fill(1234, 10000.0, 1.0);
        let x: Vec<f32> = crate::f16dot::golden::wide(4 * 128, 15);
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let (mut got, mut x86, mut arm) = (x.clone(), x.clone(), x.clone());
            t.apply(&mut got, 128, style);
            t.apply_x86_order(&mut x86, 128, style);
            t.apply_neon_order(&mut arm, 128, style);
            let want = if cfg!(target_arch = "aarch64") { &arm } else { &x86 };
            assert_eq!(&got, want, "{style:?}");
            assert_eq!(got[96..128], x[96..128], "dims past n_rot pass through");
            if style == RopeStyle::Interleaved {
                assert_ne!(x86, arm);
            } else {
                assert_eq!(x86, arm);
            }
        }
    }

    /// Softmax, SwiGLU, GEGLU and RoPE of ggml built for aarch64 (see
    /// `f16dot::golden`).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn matches_ggml_built_for_aarch64() {
        use crate::f16dot::golden::{fnv_f32, wide};
        for (n, hash) in [
            (64usize, 0x0c2c608c34120730u64),
            (67, 0xac0cc8c08521edf6),
            (1000, 0xfd1b6427a2c896e1),
        ] {
            let mut x: Vec<f32> = wide(n, 9).iter().map(|v| v * 0.05).collect();
            softmax(&mut x);
            assert_eq!(fnv_f32(&x), hash, "soft_max {n}");
        }
        let want = [
            (1024usize, 0xe85761771de94ab5u64, 0x3bf5cc4608ac8c9du64),
            (1027, 0xf07def3fa10a19a2, 0xb1f840d18fe6d33e),
        ];
        for (n, swiglu_hash, geglu_hash) in want {
            let g: Vec<f32> = wide(n, 11).iter().map(|v| v * 0.04).collect();
            let u = wide(n, 13);
            let mut s = g.clone();
            swiglu(&mut s, &u);
            // ggml's row tail (past the last four) takes libm's expf.
            for i in n / 4 * 4..n {
                s[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            }
            assert_eq!(fnv_f32(&s), swiglu_hash, "swiglu {n}");
            let mut e = g.clone();
            geglu(&mut e, &u);
            assert_eq!(fnv_f32(&e), geglu_hash, "geglu {n}");
        }
        let (hd, nh) = (128, 4);
        let x = wide(hd * nh * 3, 15);
        for (style, hash) in [
            (RopeStyle::Interleaved, 0x789b4fa5e172b5bfu64),
            (RopeStyle::Neox, 0xda8a9663c6e4b711),
        ] {
            let mut y = x.clone();
            let mut t = RopeTable::new(hd);
            for (tok, pos) in [5usize, 17, 1000].into_iter().enumerate() {
                t.fill(pos, 10000.0, 1.0);
                t.apply(&mut y[tok * nh * hd..(tok + 1) * nh * hd], hd, style);
            }
            assert_eq!(fnv_f32(&y), hash, "rope {style:?}");
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_kernels_equal_their_formulas() {
        use crate::f16dot::golden::wide;
        // The vector exp lane by lane, over every range it branches on.
        let mut xs: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.031).collect();
        xs.extend([f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, 88.7, -103.9, -87.5, 87.9]);
        xs.extend(wide(4096, 3));
        while !xs.len().is_multiple_of(4) {
            xs.push(1.0);
        }
        for q in xs.chunks_exact(4) {
            let mut out = [0.0f32; 4];
            // SAFETY: NEON is baseline; four floats each.
            unsafe {
                core::arch::aarch64::vst1q_f32(
                    out.as_mut_ptr(),
                    neon::v_expf(core::arch::aarch64::vld1q_f32(q.as_ptr())),
                )
            };
            for (o, &x) in out.iter().zip(q) {
                assert_eq!(o.to_bits(), expf_ggml_neon(x).to_bits(), "x={x}");
            }
        }
    }
}
