//! Token sampling: greedy, or seeded temperature with top-k and top-p, the
//! way llama.cpp's default chain orders them (top-k, top-p, temperature).

/// A small, seedable generator (SplitMix64): results are reproducible across
/// platforms and crate versions, which a seed promises users.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Stream `stream` of `seed`: independent draws per unit of parallel work
    /// (e.g. one stream per grid state), so results do not depend on which
    /// thread ran what.
    pub fn with_stream(seed: u64, stream: u64) -> Self {
        let mut r = Self(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }

    /// Uniform in [0, 1), with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SamplerConfig {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
        }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// (logit, id) candidates, allocated once at vocabulary size.
    candidates: Vec<(f32, u32)>,
    /// Ids never sampled, see [`Sampler::banning`].
    banned: Vec<u32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig, n_vocab: usize) -> Self {
        Self {
            cfg,
            rng: Rng::new(cfg.seed),
            candidates: Vec::with_capacity(n_vocab),
            banned: Vec::new(),
        }
    }

    /// Never samples `ids` (as if their logits were -inf): e.g. the
    /// end-of-generation tokens, for a run that must reach its length
    /// (llama.cpp's `--ignore-eos`).
    pub fn banning(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.banned.extend(ids);
        self
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return self.greedy(logits);
        }
        let total = self.distribution(logits);
        let mut r = self.rng.next_f32() * total;
        for &(w, id) in self.candidates.iter() {
            r -= w;
            if r <= 0.0 {
                return id;
            }
        }
        self.candidates.last().map_or(0, |&(_, id)| id)
    }

    /// Checks a drafted token against `logits` (the verifier's row for its
    /// position): `draft` when it is accepted, else the token to take in its
    /// place. Greedy: the token `sample` would give, so drafting changes no
    /// greedy token. Sampling: standard speculative sampling for a draft
    /// made deterministically (all of ours are): accepted with the
    /// probability the sampler gives it, else a token drawn from the rest of
    /// that distribution, renormalised; the token so chosen follows the
    /// sampler's distribution exactly, though the random stream is used
    /// differently than by `sample`, so a seed gives other tokens.
    pub fn check(&mut self, logits: &[f32], draft: u32) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return self.greedy(logits);
        }
        let total = self.distribution(logits);
        let p = self
            .candidates
            .iter()
            .find(|&&(_, id)| id == draft)
            .map_or(0.0, |&(w, _)| w / total);
        if p > 0.0 && self.rng.next_f32() < p {
            return draft;
        }
        let rest = total * (1.0 - p);
        let mut r = self.rng.next_f32() * rest;
        let mut last = None;
        for &(w, id) in self.candidates.iter().filter(|&&(_, id)| id != draft) {
            r -= w;
            last = Some(id);
            if r <= 0.0 {
                return id;
            }
        }
        // Rounding left a sliver, or the draft held all the mass (then p
        // was 1 and it was accepted above unless the draw hit 1.0 exactly).
        last.unwrap_or(draft)
    }

    /// The best allowed token (lowest id on ties).
    fn greedy(&self, logits: &[f32]) -> u32 {
        if self.banned.is_empty() {
            return argmax(logits);
        }
        let mut best = (f32::NEG_INFINITY, 0u32);
        for (i, &l) in logits.iter().enumerate() {
            let l = if self.banned.contains(&(i as u32)) {
                f32::NEG_INFINITY
            } else {
                l
            };
            if l > best.0 {
                best = (l, i as u32);
            }
        }
        best.1
    }

    /// Fills `candidates` with (weight, id) of the tokens the chain keeps
    /// (top-k, top-p, then temperature), best first; returns their sum.
    fn distribution(&mut self, logits: &[f32]) -> f32 {
        let banned = &self.banned;
        let logit = |i: usize, l: f32| {
            if banned.contains(&(i as u32)) {
                f32::NEG_INFINITY
            } else {
                l
            }
        };
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (logit(i, l), i as u32)));
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if self.cfg.top_k > 0 && self.cfg.top_k < c.len() {
            c.select_nth_unstable_by(self.cfg.top_k - 1, by_logit);
            c.truncate(self.cfg.top_k);
        }
        c.sort_unstable_by(by_logit);
        // Probabilities at temperature 1 decide the top-p cut, as in llama.cpp's chain.
        let max = c[0].0;
        let total: f32 = c.iter().map(|&(l, _)| (l - max).exp()).sum();
        if self.cfg.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = c.len();
            for (i, &(l, _)) in c.iter().enumerate() {
                cum += (l - max).exp() / total;
                if cum >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        let t = self.cfg.temperature;
        let mut sum = 0.0;
        for e in c.iter_mut() {
            e.0 = ((e.0 - max) / t).exp();
            sum += e.0;
        }
        sum
    }
}

/// Index of the largest logit; the lowest index wins ties, as llama.cpp's greedy sampler.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_max_and_first_of_ties() {
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 0.0,
                ..Default::default()
            },
            4,
        );
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn banned_tokens_are_never_sampled() {
        // Token 2 has almost all the mass; banned, it never comes out.
        let logits = [0.0f32, 0.5, 30.0, 0.2];
        for temperature in [0.0, 1.0] {
            let cfg = SamplerConfig {
                temperature,
                top_k: 0,
                top_p: 1.0,
                seed: 3,
            };
            let mut free = Sampler::new(cfg, 4);
            assert_eq!(free.sample(&logits), 2);
            let mut s = Sampler::new(cfg, 4).banning([2]);
            let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits)).collect();
            assert!(picks.iter().all(|&t| t != 2), "{temperature}: {picks:?}");
            if temperature == 0.0 {
                assert!(picks.iter().all(|&t| t == 1), "greedy takes the best allowed");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 20,
            top_p: 0.9,
            seed: 7,
        };
        let run = |cfg| {
            let mut s = Sampler::new(cfg, 100);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(cfg), run(cfg));
        assert_ne!(run(cfg), run(SamplerConfig { seed: 8, ..cfg }));
        let greedy = argmax(&logits);
        assert!(run(SamplerConfig { top_k: 1, ..cfg }).iter().all(|&t| t == greedy));
    }

    #[test]
    fn top_p_excludes_tail() {
        // One dominant token holds > 99% of the mass: top-p 0.5 keeps only it.
        let mut logits = vec![0.0f32; 50];
        logits[13] = 20.0;
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 5.0,
                top_k: 0,
                top_p: 0.5,
                seed: 1,
            },
            50,
        );
        assert!((0..200).all(|_| s.sample(&logits) == 13));
    }
}
