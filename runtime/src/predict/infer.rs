//! Running a predictor: input quantisation and the scalar kernels, with
//! dispatch to the SIMD ones (AVX2 on x86_64, NEON on aarch64). The SIMD
//! kernels vectorise only integer work, exactly, and everything they do not
//! vectorise runs the same code in both paths, so they agree bit for bit. On
//! aarch64 the float steps (the input's f64 mean square and rounding, the
//! hashing planes, the low-rank layer, the final scaling) are the portable
//! code, which LLVM compiles for NEON as it stands: there is no wider
//! instruction set to enable for them, as AVX2 is on x86.

use super::portable::{best_key_scalar, projected, quantize_body, scale_body};
use super::{validate_layer, HashingLayer, LowRankLayer, PredictError, Predictor, PredictorLayer, QuantMatrix};

/// Which kernels to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputePath {
    /// Plain loops, the reference.
    Scalar,
    /// AVX2 (plus AVX-512 VPOPCNTDQ when present) on x86_64, falling back
    /// to scalar on CPUs without AVX2; NEON (plus `sdot` when present) on
    /// aarch64.
    Simd,
}

impl ComputePath {
    /// [`ComputePath::Simd`] when this CPU has AVX2 (x86_64) or always on
    /// aarch64 (NEON is baseline), else scalar.
    pub fn best() -> Self {
        if simd_available() {
            Self::Simd
        } else {
            Self::Scalar
        }
    }
}

/// Whether this CPU runs the SIMD path (AVX2 on x86_64; NEON, always, on aarch64).
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
    }
    #[cfg(target_arch = "aarch64")]
    {
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Working memory of one predictor, allocated once so that
/// [`Predictor::scores`] never allocates.
#[derive(Clone, Debug)]
pub struct Scratch {
    /// Quantised input, `d_model`.
    xq: Vec<i8>,
    /// `z` (hashing, `d`) or `h` (low-rank, `rank`).
    z: Vec<f32>,
    /// LUT accumulator, `n_groups`.
    acc: Vec<i16>,
}

impl Predictor {
    /// Working memory for [`Predictor::scores`].
    pub fn scratch(&self) -> Scratch {
        let c = &self.config;
        Scratch {
            xq: vec![0; c.d_model],
            z: vec![0.0; c.d.max(c.rank)],
            acc: vec![0; c.n_groups()],
        }
    }

    /// Bytes of [`Predictor::scratch`].
    pub fn scratch_bytes(&self) -> usize {
        let c = &self.config;
        c.d_model + 4 * c.d.max(c.rank) + 2 * c.n_groups()
    }

    /// Scores every group of layer `layer` for use `use_` from the hidden
    /// state `x` (`d_model`), into `out` (`n_groups`). Wrong lengths, indices
    /// or a non-finite `x` are errors; nothing is allocated.
    pub fn scores(
        &self,
        use_: usize,
        layer: usize,
        x: &[f32],
        path: ComputePath,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) -> Result<(), PredictError> {
        let c = &self.config;
        let arg = |field: &'static str, reason: String| PredictError::Argument { field, reason };
        let l = self
            .layers
            .get(use_)
            .ok_or_else(|| arg("use", format!("{use_} out of range ({} uses)", self.layers.len())))?
            .get(layer)
            .ok_or_else(|| arg("layer", format!("{layer} out of range ({} layers)", c.n_layer)))?;
        if x.len() != c.d_model {
            return Err(arg("x", format!("{} values, d_model is {}", x.len(), c.d_model)));
        }
        if out.len() != c.n_groups() {
            return Err(arg(
                "out",
                format!("{} values, n_groups is {}", out.len(), c.n_groups()),
            ));
        }
        let ok =
            scratch.xq.len() == c.d_model && scratch.z.len() == c.d.max(c.rank) && scratch.acc.len() == c.n_groups();
        if !ok {
            return Err(arg("scratch", "not made by this predictor's `scratch()`".into()));
        }
        // The configuration and the layer's lengths (cheap, no allocation unless
        // they fail): a hand-built predictor must not make a kernel divide by a
        // zero width or, on the unsafe SIMD loads, read out of bounds.
        c.validate(std::path::Path::new("<in-memory predictor>"))?;
        // Lengths only (cheap); they keep every kernel, the unsafe ones included, in bounds.
        validate_layer(c, l, false)
            .map_err(|(field, why)| arg("predictor", format!("use {use_} layer {layer}: `{field}`: {why}")))?;
        let simd = path == ComputePath::Simd && simd_available();
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: AVX2 checked just above.
            unsafe { super::avx2::quantize_avx2(x, &mut scratch.xq)? };
        } else {
            quantize_input(x, &mut scratch.xq)?;
        }
        #[cfg(not(target_arch = "x86_64"))]
        quantize_input(x, &mut scratch.xq)?;
        match l {
            PredictorLayer::Hashing(h) => hashing(h, c.tau_mask(), scratch, out, simd),
            PredictorLayer::LowRank(lr) => low_rank(lr, scratch, out, simd),
        }
        Ok(())
    }
}

/// RMS-normalises `x` and quantises it at the fixed scale [`INPUT_SCALE`]
/// (clamped to ±127: the AVX2 sign trick cannot take -128).
pub fn quantize_input(x: &[f32], xq: &mut [i8]) -> Result<(), PredictError> {
    quantize_body(x, xq)
}

/// `y_j = scale_j · (Σ_i q_i w_ji) / INPUT_SCALE`, the sum an exact i32.
fn project(m: &QuantMatrix, xq: &[i8], y: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the caller checked AVX2 and the shapes (m is rows × xq.len(),
        // xq.len() a multiple of 32, y.len() == rows).
        unsafe { super::avx2::project_avx2(m, xq, y) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if simd {
        // SAFETY: the caller checked the shapes (m is rows × xq.len(),
        // xq.len() a multiple of 32, y.len() == rows); NEON is baseline.
        unsafe { super::neon::project(m, xq, y) };
        return;
    }
    let _ = simd;
    for ((yj, row), &scale) in y.iter_mut().zip(m.q.chunks_exact(m.cols)).zip(&m.scales) {
        let dot: i32 = row.iter().zip(xq).map(|(&w, &q)| w as i32 * q as i32).sum();
        *yj = projected(scale, dot);
    }
}

/// The first key with the most bits equal to `code` (XNOR + popcount).
fn best_key(keys: &[u64], code: u64, mask: u64, simd: bool) -> usize {
    #[cfg(target_arch = "x86_64")]
    if simd {
        return super::avx2::best_key(keys, code, mask);
    }
    let _ = simd;
    best_key_scalar(keys, code, mask)
}

/// `acc[g] += row[g]` in i16 (cannot overflow: at most 128 rows of i8).
fn add_row(acc: &mut [i16], row: &[i8], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: AVX2 checked by the caller; the kernel bounds itself by both lengths.
        unsafe { super::avx2::add_row_avx2(acc, row) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if simd {
        // SAFETY: NEON is baseline; the kernel bounds itself by both lengths.
        unsafe { super::neon::add_row(acc, row) };
        return;
    }
    let _ = simd;
    for (a, &r) in acc.iter_mut().zip(row) {
        *a = a.wrapping_add(r as i16);
    }
}

fn hashing(l: &HashingLayer, mask: u64, s: &mut Scratch, out: &mut [f32], simd: bool) {
    let d = l.proj.rows;
    let ng = out.len();
    let z = &mut s.z[..d];
    project(&l.proj, &s.xq, z, simd);
    s.acc.fill(0);
    for st in &l.stages {
        let mut code = 0u64;
        for (t, (plane, &off)) in st.planes.chunks_exact(d).zip(&st.offsets).enumerate() {
            let mut u = off;
            for (&p, &zk) in plane.iter().zip(z.iter()) {
                u += p * zk;
            }
            code |= ((u > 0.0) as u64) << t;
        }
        let j = best_key(&st.keys, code, mask, simd);
        add_row(&mut s.acc, &st.lut[j * ng..(j + 1) * ng], simd);
        for (zk, &sh) in z.iter_mut().zip(&st.shift[j * d..(j + 1) * d]) {
            *zk += sh;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: AVX2 checked by the caller.
        unsafe { super::avx2::scale_avx2(out, &s.acc, l.lut_scale, &l.bias) };
        return;
    }
    scale_body(out, &s.acc, l.lut_scale, &l.bias);
}

fn low_rank(l: &LowRankLayer, s: &mut Scratch, out: &mut [f32], simd: bool) {
    let r = l.w1.rows;
    let h = &mut s.z[..r];
    project(&l.w1, &s.xq, h, simd);
    for (hk, &b) in h.iter_mut().zip(&l.b1) {
        *hk = (*hk + b).max(0.0);
    }
    // Eight groups at a time: eight independent sums, each still in k order
    // (so the result is the plain loop's), instead of one latency-bound chain.
    const G: usize = 8;
    let full = out.len() / G * G;
    for ((o, rows), (sc, b)) in out[..full]
        .chunks_exact_mut(G)
        .zip(l.w2.chunks_exact(G * r))
        .zip(l.w2_scale.chunks_exact(G).zip(l.b2.chunks_exact(G)))
    {
        let rw: [&[i8]; G] = std::array::from_fn(|i| &rows[i * r..(i + 1) * r]);
        let mut sum = [0.0f32; G];
        for (k, &hk) in h.iter().enumerate() {
            for i in 0..G {
                sum[i] += rw[i][k] as f32 * hk;
            }
        }
        for i in 0..G {
            o[i] = b[i] + sc[i] * sum[i];
        }
    }
    for (g, o) in out.iter_mut().enumerate().skip(full) {
        let mut sum = 0.0f32;
        for (&w, &hk) in l.w2[g * r..(g + 1) * r].iter().zip(h.iter()) {
            sum += w as f32 * hk;
        }
        *o = l.b2[g] + l.w2_scale[g] * sum;
    }
}
