//! The verifier's rule: which drafted tokens a verification pass accepts.

use crate::generate::Sampler;

/// Checks `draft` against the rows of one verification pass: `rows` holds
/// `draft.len() + 1` rows of `n_vocab` logits, row `i` computed after the
/// last accepted token and `draft[..i]`. Appends to `out` the accepted
/// prefix and then the model's own token: where the first draft token is
/// refused, the one the sampler gives in its place; after a fully accepted
/// draft, one sampled from the last row. So a pass yields 1 to
/// `draft.len() + 1` tokens, each distributed as without drafting (greedy:
/// the same tokens). Returns how many draft tokens were accepted.
pub fn accept(sampler: &mut Sampler, rows: &[f32], n_vocab: usize, draft: &[u32], out: &mut Vec<u32>) -> usize {
    debug_assert_eq!(rows.len(), (draft.len() + 1) * n_vocab);
    let row = |i: usize| &rows[i * n_vocab..(i + 1) * n_vocab];
    for (i, &d) in draft.iter().enumerate() {
        let t = sampler.check(row(i), d);
        out.push(t);
        if t != d {
            return i;
        }
    }
    out.push(sampler.sample(row(draft.len())));
    draft.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::SamplerConfig;

    fn one_hot(n_vocab: usize, hot: &[u32]) -> Vec<f32> {
        let mut rows = vec![0.0; hot.len() * n_vocab];
        for (i, &h) in hot.iter().enumerate() {
            rows[i * n_vocab + h as usize] = 10.0;
        }
        rows
    }

    #[test]
    fn greedy_keeps_the_agreeing_prefix_and_the_models_token() {
        let greedy = SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        };
        let mut s = Sampler::new(greedy, 8);
        let rows = one_hot(8, &[3, 4, 5, 6]);
        let mut out = Vec::new();
        assert_eq!(accept(&mut s, &rows, 8, &[3, 4, 5], &mut out), 3);
        assert_eq!(out, vec![3, 4, 5, 6], "all accepted, plus the bonus token");
        out.clear();
        assert_eq!(accept(&mut s, &rows, 8, &[3, 1, 5], &mut out), 1);
        assert_eq!(out, vec![3, 4], "refused at the second: the model's token instead");
        out.clear();
        assert_eq!(accept(&mut s, &rows[..8], 8, &[], &mut out), 0);
        assert_eq!(out, vec![3], "no draft: one token, as plain decoding");
    }

    /// Speculative sampling keeps the sampler's distribution: over many
    /// seeds, a draft that is often wrong gives tokens whose frequencies
    /// match the sampler's own, by a chi-square test at a false-alarm rate
    /// of 1e-4 (a fixed seed list, so the outcome is reproducible).
    #[test]
    fn sampling_with_a_draft_keeps_the_distribution() {
        let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, -1.0];
        let cfg = |seed| SamplerConfig {
            temperature: 0.9,
            top_k: 5,
            top_p: 0.97,
            seed,
        };
        let n = 60_000;
        let (mut plain, mut drafted) = ([0usize; 6], [0usize; 6]);
        let mut plain_s = Sampler::new(cfg(11), 6);
        let mut draft_s = Sampler::new(cfg(12), 6);
        for i in 0..n {
            plain[plain_s.sample(&logits) as usize] += 1;
            let draft = (i % 6) as u32; // right sometimes, often outside top-k/top-p
            drafted[draft_s.check(&logits, draft) as usize] += 1;
        }
        // Expected frequencies from the plain sampler's large sample; a
        // two-sample chi-square over the categories either one produced.
        let mut chi2 = 0.0;
        let mut dof = 0;
        for k in 0..6 {
            let (a, b) = (plain[k] as f64, drafted[k] as f64);
            if a + b == 0.0 {
                continue;
            }
            chi2 += (a - b).powi(2) / (a + b);
            dof += 1;
        }
        assert_eq!(
            plain[5] + drafted[5],
            0,
            "outside top-k never comes out: {plain:?} {drafted:?}"
        );
        // 1e-4 upper quantile of chi-square with dof - 1 = 4 degrees of freedom.
        assert!(
            dof == 5 && chi2 < 23.51,
            "chi2 {chi2:.2} over {dof} categories: {plain:?} vs {drafted:?}"
        );
    }
}
