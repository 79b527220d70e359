//! The verifier's rule: which drafted tokens a verification pass accepts.

use crate::generate::{Decoder, Sampler};
use crate::Result;

/// Checks `draft` against the rows of the verification pass `dec` just
/// ran: [`Decoder::row_logits`] of row `i`, computed after the last
/// accepted token and `draft[..i]`, is asked for in order, only while the
/// draft holds.
/// Appends to `out` the accepted prefix and then the model's own token:
/// where a draft token is refused, the one the sampler gives in its place;
/// after a fully accepted draft, one sampled from the last row. So a pass
/// yields 1 to `draft.len() + 1` tokens, each distributed as without
/// drafting (greedy: the same tokens). Returns how many draft tokens were
/// accepted.
pub fn accept(sampler: &mut Sampler, dec: &mut dyn Decoder, draft: &[u32], out: &mut Vec<u32>) -> Result<usize> {
    for (i, &d) in draft.iter().enumerate() {
        let t = sampler.check(dec.row_logits(i)?, d);
        out.push(t);
        if t != d {
            return Ok(i);
        }
    }
    out.push(sampler.sample(dec.row_logits(draft.len())?));
    Ok(draft.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::SamplerConfig;

    /// A pass's rows, given; counts the rows asked for.
    struct Rows {
        rows: Vec<f32>,
        n_vocab: usize,
        asked: usize,
    }

    impl Decoder for Rows {
        fn ctx(&self) -> usize {
            usize::MAX
        }
        fn ingest(&mut self, _: &[u32], _: usize) -> crate::Result<()> {
            Ok(())
        }
        fn logits(&mut self) -> crate::Result<&[f32]> {
            self.row_logits(0)
        }
        fn row_logits(&mut self, i: usize) -> crate::Result<&[f32]> {
            self.asked = self.asked.max(i + 1);
            Ok(&self.rows[i * self.n_vocab..(i + 1) * self.n_vocab])
        }
    }

    fn rows_of(rows: Vec<f32>, n_vocab: usize) -> Rows {
        Rows {
            rows,
            n_vocab,
            asked: 0,
        }
    }

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
        assert_eq!(
            accept(&mut s, &mut rows_of(rows.clone(), 8), &[3, 4, 5], &mut out).unwrap(),
            3
        );
        assert_eq!(out, vec![3, 4, 5, 6], "all accepted, plus the bonus token");
        out.clear();
        let mut counted = rows_of(rows.clone(), 8);
        assert_eq!(accept(&mut s, &mut counted, &[3, 1, 5], &mut out).unwrap(), 1);
        assert_eq!(counted.asked, 2, "rows after the refused token are never asked for");
        assert_eq!(out, vec![3, 4], "refused at the second: the model's token instead");
        out.clear();
        assert_eq!(
            accept(&mut s, &mut rows_of(rows[..8].to_vec(), 8), &[], &mut out).unwrap(),
            0
        );
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
