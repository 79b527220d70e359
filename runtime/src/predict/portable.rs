//! The portable bodies of the predictor's kernels that the SIMD forms share
//! (`avx2.rs` compiles some of them with AVX2 enabled, `neon.rs` and
//! `avx2.rs` finish their integer sums with [`projected`]): one copy of each
//! float step, so every path gives the same bits.

use super::{PredictError, INPUT_SCALE};

/// The body of [`super::quantize_input`], inlined into the AVX2 copy too: the same
/// IEEE operations in the same order, so both give the same bytes.
#[inline(always)]
pub(super) fn quantize_body(x: &[f32], xq: &mut [i8]) -> Result<(), PredictError> {
    // f64 so that huge (but finite) activations do not overflow the mean
    // square; eight partial sums so the loop is not one latency-bound chain.
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| (v as f64) * (v as f64)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += (v as f64) * (v as f64);
        }
    }
    let ss = acc.iter().sum::<f64>() + tail;
    if !ss.is_finite() {
        return Err(PredictError::Argument {
            field: "x",
            reason: "non-finite value".into(),
        });
    }
    let k = (INPUT_SCALE as f64 / (ss / x.len() as f64 + 1e-6).sqrt()) as f32;
    for (q, &v) in xq.iter_mut().zip(x) {
        // Round half away from zero by hand: `f32::round` is a libm call
        // on baseline x86_64, this vectorises.
        let r = (v * k).clamp(-127.0, 127.0);
        // SAFETY: `r + ±0.5` is finite (every `v` is: the sum of squares
        // is) and within ±127.5, so the truncation fits; the checked cast
        // would keep the loop from vectorising.
        *q = unsafe { (r + 0.5f32.copysign(r)).to_int_unchecked::<i32>() } as i8;
    }
    Ok(())
}

/// One projected value from its exact integer dot (shared by both paths).
#[inline(always)]
pub(super) fn projected(scale: f32, dot: i32) -> f32 {
    scale * (dot as f32 / INPUT_SCALE)
}

#[inline(always)]
pub(super) fn best_key_scalar(keys: &[u64], code: u64, mask: u64) -> usize {
    let mut best = 0;
    let mut best_sim = 0u32;
    for (j, &k) in keys.iter().enumerate() {
        let sim = (!(code ^ k) & mask).count_ones();
        if j == 0 || sim > best_sim {
            best = j;
            best_sim = sim;
        }
    }
    best
}

/// `out = scale · acc + bias` (inlined into the AVX2 copy: same operations, same results).
#[inline(always)]
pub(super) fn scale_body(out: &mut [f32], acc: &[i16], scale: f32, bias: &[f32]) {
    for ((o, &a), &b) in out.iter_mut().zip(acc).zip(bias) {
        *o = scale * a as f32 + b;
    }
}
