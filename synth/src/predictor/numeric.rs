//! The numerics both trainers share: Adam over a flat parameter vector,
//! weighted binary cross-entropy, dot and axpy, Gaussian and logit inits.

use leanstream_runtime::generate::sampler::Rng;

pub struct Adam {
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
    pub lr: f32,
}

impl Adam {
    pub fn new(n: usize, lr: f32) -> Self {
        Self {
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
            lr,
        }
    }

    /// One step on `theta` with gradient `g` (already averaged over the batch).
    pub fn step(&mut self, theta: &mut [f32], g: &[f32]) {
        const B1: f32 = 0.9;
        const B2: f32 = 0.999;
        self.t += 1;
        let c1 = 1.0 - B1.powi(self.t);
        let c2 = 1.0 - B2.powi(self.t);
        let lr = self.lr * c2.sqrt() / c1;
        for (((w, &gi), m), v) in theta.iter_mut().zip(g).zip(&mut self.m).zip(&mut self.v) {
            *m = B1 * *m + (1.0 - B1) * gi;
            *v = B2 * *v + (1.0 - B2) * gi * gi;
            *w -= lr * *m / (v.sqrt() + 1e-8);
        }
    }
}

/// Binary cross-entropy of logits `s` against targets `y`, weighted by `w`
/// and normalised by the weight sum, and its gradient into `ds`.
pub fn bce(s: &[f32], y: &[f32], w: &[f32], ds: &mut [f32]) -> f32 {
    let total: f32 = w.iter().sum::<f32>().max(1e-12);
    let mut loss = 0.0;
    for (((&si, &yi), &wi), d) in s.iter().zip(y).zip(w).zip(ds.iter_mut()) {
        // log(1 + e^s) - y·s, computed stably.
        loss += wi * (si.max(0.0) + (-si.abs()).exp().ln_1p() - yi * si);
        *d = wi * (1.0 / (1.0 + (-si).exp()) - yi) / total;
    }
    loss / total
}

/// Dot product in eight lanes (vectorises; training does not need the exact order).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a · x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// A normal sample of standard deviation `scale` (Box-Muller).
pub fn normal(rng: &mut Rng, scale: f32) -> f32 {
    let (a, b) = (rng.uniform().max(1e-12), rng.uniform());
    scale * ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
}

/// The logit of a frequency, kept finite.
pub fn logit(f: f32) -> f32 {
    let f = f.clamp(1e-3, 1.0 - 1e-3);
    (f / (1.0 - f)).ln()
}
