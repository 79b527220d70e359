//! Training one layer of the stacked learnable hashing predictor.
//!
//! Forward (the runtime's `HashingLayer`, in f32): `z₀ = P x`; per stage s,
//! `u = H_s z_s + c_s`, code `b = sign(u)` (τ bits), similarity to key j
//! `sim_j = b · sign(k_j)` (XNOR + popcount up to an affine map), selected
//! key `j* = argmax sim`, scores `+= T_s[j*]`, `z_{s+1} = z_s + E_s[j*]`;
//! finally scores `+= bias`.
//!
//! Backward: the signs use the straight-through estimator (gradient passed
//! where |u| ≤ 1, likewise for the key latents), and the discrete key choice
//! is a straight-through Gumbel-softmax: the forward uses the hard choice
//! `argmax(β·sim + g)` (noise `g` shrinking with the temperature), the
//! backward the softmax of the same logits at temperature `temp`. Optional
//! early epochs run the forward on the soft mixture instead, so every table
//! row learns before the choice hardens (measured: no better on SmolLM2, so
//! off by default).

use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::predict::{HashStage, HashingLayer, QuantMatrix};

use super::numeric::{axpy, bce, dot, logit, normal, Adam};

/// Inverse temperature on the bit agreement: τ = 16 bits span ±8 logits.
const BETA: f32 = 0.5;

#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub d_model: usize,
    pub d: usize,
    pub tau: usize,
    pub keys: usize,
    pub stages: usize,
    /// Output groups.
    pub g: usize,
}

/// Offsets of one stage's tensors in the flat parameter vector.
#[derive(Debug, Clone, Copy)]
struct StageAt {
    h: usize,
    c: usize,
    k: usize,
    t: usize,
    e: usize,
}

pub struct HashNet {
    pub shape: Shape,
    pub theta: Vec<f32>,
    stages: Vec<StageAt>,
    bias: usize,
}

/// Per-example activations kept for the backward pass.
pub struct Work {
    z: Vec<f32>,
    u: Vec<f32>,
    b: Vec<f32>,
    kb: Vec<f32>,
    w: Vec<f32>,
    /// The mixture the forward used: one-hot (hard) or the soft weights.
    y: Vec<f32>,
    j: Vec<usize>,
    score: Vec<f32>,
    dscore: Vec<f32>,
    dz: Vec<f32>,
    du: Vec<f32>,
    dw: Vec<f32>,
}

impl HashNet {
    /// Random projection and planes, zero tables, the bias at the logit of
    /// each group's training frequency (so training starts from the static
    /// hot-set ranking and learns what varies per token).
    pub fn new(shape: Shape, freq: &[f32], seed: u64) -> Self {
        let Shape {
            d_model,
            d,
            tau,
            keys,
            stages,
            g,
        } = shape;
        let mut n = d * d_model;
        let mut at = Vec::new();
        for _ in 0..stages {
            let h = n;
            let c = h + tau * d;
            let k = c + tau;
            let t = k + keys * tau;
            let e = t + keys * g;
            n = e + keys * d;
            at.push(StageAt { h, c, k, t, e });
        }
        let bias = n;
        n += g;
        let mut theta = vec![0.0; n];
        let mut rng = Rng::new(seed);
        for v in &mut theta[..d * d_model] {
            *v = normal(&mut rng, 1.0 / (d_model as f32).sqrt());
        }
        for s in &at {
            for v in &mut theta[s.h..s.c] {
                *v = normal(&mut rng, 1.0 / (d as f32).sqrt());
            }
            for v in &mut theta[s.k..s.t] {
                *v = normal(&mut rng, 0.5);
            }
        }
        for (v, &f) in theta[bias..].iter_mut().zip(freq) {
            *v = logit(f);
        }
        Self {
            shape,
            theta,
            stages: at,
            bias,
        }
    }

    pub fn work(&self) -> Work {
        let Shape {
            d,
            tau,
            keys,
            stages,
            g,
            ..
        } = self.shape;
        Work {
            z: vec![0.0; (stages + 1) * d],
            u: vec![0.0; stages * tau],
            b: vec![0.0; stages * tau],
            kb: vec![0.0; keys * tau],
            w: vec![0.0; stages * keys],
            y: vec![0.0; stages * keys],
            j: vec![0; stages],
            score: vec![0.0; g],
            dscore: vec![0.0; g],
            dz: vec![0.0; d],
            du: vec![0.0; tau],
            dw: vec![0.0; keys],
        }
    }

    /// Forward on one input; with `noise` the Gumbel-perturbed choice and
    /// soft weights at `temp` are kept for `backward`.
    pub fn forward(&self, x: &[f32], temp: f32, noise: Option<&mut Rng>, hard: bool, wk: &mut Work) {
        let Shape {
            d_model, d, tau, keys, ..
        } = self.shape;
        let th = &self.theta;
        for (j, zj) in wk.z[..d].iter_mut().enumerate() {
            *zj = dot(&th[j * d_model..(j + 1) * d_model], x);
        }
        wk.score.copy_from_slice(&th[self.bias..self.bias + self.shape.g]);
        let mut noise = noise;
        for (s, at) in self.stages.iter().enumerate() {
            let (zs, znext) = wk.z[s * d..(s + 2) * d].split_at_mut(d);
            let u = &mut wk.u[s * tau..(s + 1) * tau];
            let b = &mut wk.b[s * tau..(s + 1) * tau];
            for t in 0..tau {
                u[t] = th[at.c + t] + dot(&th[at.h + t * d..at.h + (t + 1) * d], zs);
                b[t] = if u[t] > 0.0 { 1.0 } else { -1.0 };
            }
            let w = &mut wk.w[s * keys..(s + 1) * keys];
            let mut best = (f32::NEG_INFINITY, 0);
            for (j, wj) in w.iter_mut().enumerate() {
                let kj = &th[at.k + j * tau..at.k + (j + 1) * tau];
                let sim: f32 = kj
                    .iter()
                    .zip(b.iter())
                    .map(|(&k, &bt)| if k > 0.0 { bt } else { -bt })
                    .sum();
                let g = match noise.as_deref_mut() {
                    // Gumbel noise, scaled down: at full scale it swamps the one-bit
                    // logit steps and every key learns the global mean.
                    Some(rng) => -0.3 * temp * (-(rng.uniform().max(1e-12)).ln()).max(1e-12).ln() as f32,
                    None => 0.0,
                };
                let key_logit = BETA * sim + g;
                *wj = key_logit;
                // Ties go to the first key, as in the runtime.
                if key_logit > best.0 {
                    best = (key_logit, j);
                }
            }
            let j = best.1;
            wk.j[s] = j;
            let m = w.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            let mut sum = 0.0;
            for wj in w.iter_mut() {
                *wj = ((*wj - m) / temp).exp();
                sum += *wj;
            }
            for wj in w.iter_mut() {
                *wj /= sum;
            }
            znext.copy_from_slice(zs);
            let g = self.shape.g;
            let y = &mut wk.y[s * keys..(s + 1) * keys];
            if hard {
                y.fill(0.0);
                y[j] = 1.0;
            } else {
                y.copy_from_slice(w);
            }
            for (jj, &yj) in y.iter().enumerate() {
                if yj != 0.0 {
                    axpy(&mut wk.score, yj, &th[at.t + jj * g..at.t + (jj + 1) * g]);
                    axpy(znext, yj, &th[at.e + jj * d..at.e + (jj + 1) * d]);
                }
            }
        }
    }

    /// Loss on `y` and its gradient accumulated into `grad` (after `forward`).
    pub fn backward(&self, x: &[f32], y: &[f32], w: &[f32], temp: f32, wk: &mut Work, grad: &mut [f32]) -> f32 {
        let Shape {
            d_model,
            d,
            tau,
            keys,
            g,
            ..
        } = self.shape;
        let th = &self.theta;
        let loss = bce(&wk.score, y, w, &mut wk.dscore);
        axpy(&mut grad[self.bias..self.bias + g], 1.0, &wk.dscore);
        wk.dz.fill(0.0);
        for (s, at) in self.stages.iter().enumerate().rev() {
            for (jj, &yj) in wk.y[s * keys..(s + 1) * keys].iter().enumerate() {
                if yj != 0.0 {
                    axpy(&mut grad[at.t + jj * g..at.t + (jj + 1) * g], yj, &wk.dscore);
                    axpy(&mut grad[at.e + jj * d..at.e + (jj + 1) * d], yj, &wk.dz);
                }
            }
            let w = &wk.w[s * keys..(s + 1) * keys];
            for (jj, dw) in wk.dw.iter_mut().enumerate() {
                *dw = dot(&wk.dscore, &th[at.t + jj * g..at.t + (jj + 1) * g])
                    + dot(&wk.dz, &th[at.e + jj * d..at.e + (jj + 1) * d]);
            }
            let mean: f32 = w.iter().zip(&wk.dw).map(|(a, b)| a * b).sum();
            let (u, b) = (&wk.u[s * tau..(s + 1) * tau], &wk.b[s * tau..(s + 1) * tau]);
            for (t, kb) in wk.kb[..keys * tau].iter_mut().enumerate() {
                *kb = if th[at.k + t] > 0.0 { 1.0 } else { -1.0 };
            }
            wk.du.fill(0.0);
            for jj in 0..keys {
                let dsim = BETA * w[jj] * (wk.dw[jj] - mean) / temp;
                if dsim == 0.0 {
                    continue;
                }
                for t in 0..tau {
                    wk.du[t] += dsim * wk.kb[jj * tau + t];
                    let kt = th[at.k + jj * tau + t];
                    if kt.abs() <= 1.0 {
                        grad[at.k + jj * tau + t] += dsim * b[t];
                    }
                }
            }
            let zs = &wk.z[s * d..(s + 1) * d];
            for t in 0..tau {
                let du = if u[t].abs() <= 1.0 { wk.du[t] } else { 0.0 };
                if du == 0.0 {
                    continue;
                }
                grad[at.c + t] += du;
                axpy(&mut grad[at.h + t * d..at.h + (t + 1) * d], du, zs);
                axpy(&mut wk.dz, du, &th[at.h + t * d..at.h + (t + 1) * d]);
            }
        }
        for (j, &dz) in wk.dz.iter().enumerate() {
            if dz != 0.0 {
                axpy(&mut grad[j * d_model..(j + 1) * d_model], dz, x);
            }
        }
        loss
    }

    /// Quantised for the runtime: i8 projection rows, one scale for all the
    /// tables (their sum stays an exact integer), keys as bits, bias in f32.
    pub fn export(&self) -> HashingLayer {
        let Shape {
            d_model,
            d,
            tau,
            keys,
            g,
            ..
        } = self.shape;
        let th = &self.theta;
        let mut amax = 0.0f32;
        for at in &self.stages {
            amax = th[at.t..at.t + keys * g].iter().fold(amax, |m, v| m.max(v.abs()));
        }
        let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        let q = |v: &[f32]| -> Vec<i8> {
            v.iter()
                .map(|x| (x / scale).round().clamp(-127.0, 127.0) as i8)
                .collect()
        };
        let stages = self
            .stages
            .iter()
            .map(|at| HashStage {
                planes: th[at.h..at.c].to_vec(),
                offsets: th[at.c..at.k].to_vec(),
                keys: (0..keys)
                    .map(|j| (0..tau).fold(0u64, |code, t| code | (((th[at.k + j * tau + t] > 0.0) as u64) << t)))
                    .collect(),
                shift: th[at.e..at.e + keys * d].to_vec(),
                lut: q(&th[at.t..at.t + keys * g]),
            })
            .collect();
        HashingLayer {
            proj: QuantMatrix::quantize(d, d_model, &th[..d * d_model]),
            stages,
            bias: th[self.bias..self.bias + g].to_vec(),
            lut_scale: scale,
        }
    }
}

/// Trains on `x` (`[n][d_model]`), targets `y` and loss weights `yw` (`[n][g]`); returns the mean loss of each epoch.
#[allow(clippy::too_many_arguments)]
pub fn train(
    net: &mut HashNet,
    x: &[f32],
    y: &[f32],
    yw: &[f32],
    epochs: usize,
    soft_epochs: usize,
    batch: usize,
    lr: f32,
    seed: u64,
) -> Vec<f32> {
    let (dm, g) = (net.shape.d_model, net.shape.g);
    let n = x.len() / dm;
    let mut adam = Adam::new(net.theta.len(), lr);
    let mut grad = vec![0.0; net.theta.len()];
    let mut wk = net.work();
    let mut rng = Rng::with_stream(seed, 1);
    let mut order: Vec<usize> = (0..n).collect();
    let mut losses = Vec::with_capacity(epochs);
    for epoch in 0..epochs {
        // Temperature (and noise) anneal from 1 to 0.2; the first
        // `soft_epochs` mix the tables softly (every row gets gradient), the
        // rest train the hard choice the runtime makes (straight-through).
        let temp = 1.0 - 0.8 * epoch as f32 / (epochs.max(2) - 1) as f32;
        let hard = epoch >= soft_epochs;
        for i in (1..n).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut total = 0.0f64;
        for chunk in order.chunks(batch) {
            grad.fill(0.0);
            for &i in chunk {
                let xi = &x[i * dm..(i + 1) * dm];
                net.forward(xi, temp, Some(&mut rng), hard, &mut wk);
                total += net.backward(
                    xi,
                    &y[i * g..(i + 1) * g],
                    &yw[i * g..(i + 1) * g],
                    temp,
                    &mut wk,
                    &mut grad,
                ) as f64;
            }
            let inv = 1.0 / chunk.len() as f32;
            grad.iter_mut().for_each(|v| *v *= inv);
            adam.step(&mut net.theta, &grad);
        }
        losses.push((total / n as f64) as f32);
    }
    losses
}

/// Mean loss of the noiseless (inference) forward on `x`, `y`.
pub fn loss(net: &HashNet, x: &[f32], y: &[f32], yw: &[f32]) -> f32 {
    let (dm, g) = (net.shape.d_model, net.shape.g);
    let mut wk = net.work();
    let mut ds = vec![0.0; g];
    let n = x.len() / dm;
    let mut total = 0.0f64;
    for i in 0..n {
        net.forward(&x[i * dm..(i + 1) * dm], 1.0, None, true, &mut wk);
        total += bce(&wk.score, &y[i * g..(i + 1) * g], &yw[i * g..(i + 1) * g], &mut ds) as f64;
    }
    (total / n.max(1) as f64) as f32
}
