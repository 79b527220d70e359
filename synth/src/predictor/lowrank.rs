//! Training one layer of the low-rank MLP baseline (the DejaVu /
//! LLM-in-a-Flash kind): `scores = W2 relu(W1 x + b1) + b2`.

use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::predict::{LowRankLayer, QuantMatrix};

use super::numeric::{axpy, bce, dot, logit, normal, Adam};

pub struct LowRankNet {
    pub d_model: usize,
    pub rank: usize,
    pub g: usize,
    /// `W1 [rank][d_model] | b1 [rank] | W2 [g][rank] | b2 [g]`.
    pub theta: Vec<f32>,
}

pub struct Work {
    h: Vec<f32>,
    pre: Vec<f32>,
    score: Vec<f32>,
    dscore: Vec<f32>,
    dh: Vec<f32>,
}

impl LowRankNet {
    /// Random `W1`, small random `W2`, `b2` at the logit of each group's
    /// training frequency (the same start as the hashing predictor).
    pub fn new(d_model: usize, rank: usize, g: usize, freq: &[f32], seed: u64) -> Self {
        let n = rank * d_model + rank + g * rank + g;
        let mut theta = vec![0.0; n];
        let mut rng = Rng::new(seed);
        for v in &mut theta[..rank * d_model] {
            *v = normal(&mut rng, 1.0 / (d_model as f32).sqrt());
        }
        let w2 = rank * d_model + rank;
        for v in &mut theta[w2..w2 + g * rank] {
            *v = normal(&mut rng, 0.01);
        }
        for (v, &f) in theta[w2 + g * rank..].iter_mut().zip(freq) {
            *v = logit(f);
        }
        Self {
            d_model,
            rank,
            g,
            theta,
        }
    }

    fn at(&self) -> (usize, usize, usize) {
        let b1 = self.rank * self.d_model;
        let w2 = b1 + self.rank;
        (b1, w2, w2 + self.g * self.rank)
    }

    pub fn work(&self) -> Work {
        Work {
            h: vec![0.0; self.rank],
            pre: vec![0.0; self.rank],
            score: vec![0.0; self.g],
            dscore: vec![0.0; self.g],
            dh: vec![0.0; self.rank],
        }
    }

    pub fn forward(&self, x: &[f32], wk: &mut Work) {
        let (b1, w2, b2) = self.at();
        let (dm, r) = (self.d_model, self.rank);
        let th = &self.theta;
        for k in 0..r {
            wk.pre[k] = dot(&th[k * dm..(k + 1) * dm], x) + th[b1 + k];
            wk.h[k] = wk.pre[k].max(0.0);
        }
        for (gi, s) in wk.score.iter_mut().enumerate() {
            *s = th[b2 + gi] + dot(&th[w2 + gi * r..w2 + (gi + 1) * r], &wk.h);
        }
    }

    pub fn backward(&self, x: &[f32], y: &[f32], w: &[f32], wk: &mut Work, grad: &mut [f32]) -> f32 {
        let (b1, w2, b2) = self.at();
        let (dm, r) = (self.d_model, self.rank);
        let th = &self.theta;
        let loss = bce(&wk.score, y, w, &mut wk.dscore);
        axpy(&mut grad[b2..b2 + self.g], 1.0, &wk.dscore);
        wk.dh.fill(0.0);
        for (gi, &ds) in wk.dscore.iter().enumerate() {
            axpy(&mut grad[w2 + gi * r..w2 + (gi + 1) * r], ds, &wk.h);
            axpy(&mut wk.dh, ds, &th[w2 + gi * r..w2 + (gi + 1) * r]);
        }
        for k in 0..r {
            if wk.pre[k] <= 0.0 {
                continue;
            }
            let dp = wk.dh[k];
            grad[b1 + k] += dp;
            axpy(&mut grad[k * dm..(k + 1) * dm], dp, x);
        }
        loss
    }

    /// Quantised for the runtime: i8 rows with per-row scales.
    pub fn export(&self) -> LowRankLayer {
        let (b1, w2, b2) = self.at();
        let th = &self.theta;
        let second = QuantMatrix::quantize(self.g, self.rank, &th[w2..b2]);
        LowRankLayer {
            w1: QuantMatrix::quantize(self.rank, self.d_model, &th[..b1]),
            b1: th[b1..w2].to_vec(),
            w2: second.q,
            w2_scale: second.scales,
            b2: th[b2..].to_vec(),
        }
    }
}

/// Trains on `x` (`[n][d_model]`), targets `y` and loss weights `yw` (`[n][g]`); returns the mean loss of each epoch.
#[allow(clippy::too_many_arguments)]
pub fn train(
    net: &mut LowRankNet,
    x: &[f32],
    y: &[f32],
    yw: &[f32],
    epochs: usize,
    batch: usize,
    lr: f32,
    seed: u64,
) -> Vec<f32> {
    let (dm, g) = (net.d_model, net.g);
    let n = x.len() / dm;
    let mut adam = Adam::new(net.theta.len(), lr);
    let mut grad = vec![0.0; net.theta.len()];
    let mut wk = net.work();
    let mut rng = Rng::with_stream(seed, 2);
    let mut order: Vec<usize> = (0..n).collect();
    let mut losses = Vec::with_capacity(epochs);
    for _ in 0..epochs {
        for i in (1..n).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut total = 0.0f64;
        for chunk in order.chunks(batch) {
            grad.fill(0.0);
            for &i in chunk {
                let xi = &x[i * dm..(i + 1) * dm];
                net.forward(xi, &mut wk);
                total += net.backward(xi, &y[i * g..(i + 1) * g], &yw[i * g..(i + 1) * g], &mut wk, &mut grad) as f64;
            }
            let inv = 1.0 / chunk.len() as f32;
            grad.iter_mut().for_each(|v| *v *= inv);
            adam.step(&mut net.theta, &grad);
        }
        losses.push((total / n as f64) as f32);
    }
    losses
}
