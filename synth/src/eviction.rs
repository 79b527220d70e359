//! Learned eviction (`leanstream-synth eviction`): a retention table from an
//! activation trace, and the paper's Table 4, the neuron cache's miss ratio
//! on held-out text under LRU, the sliding window, the static hot set and
//! the learned priorities.
//!
//! Training counts, per neuron and age bucket (tokens since its last use,
//! [`age_bucket`]), how often a neuron of that age is used in the next token.
//! Sparse cells are shrunk toward a prior that combines the neuron's overall
//! frequency with the layer's recency curve: `f_n · r_b / f̄`, with `r_b` the
//! layer's next-token use rate at age bucket `b` and `f̄` its mean frequency.
//!
//! The evaluation replays the held-out split's true active sets, token by
//! token and layer by layer, through the runtime's own [`NeuronCache`] with
//! each policy: a layer's hits are pinned while its misses are inserted, as
//! the engine does. Two bounds frame them: the learned priorities with free
//! reloads (the best their ranking allows) and Belady's offline optimum.

use std::sync::Arc;

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::Array;
use leanstream_runtime::cache::retention::{age_bucket, N_BUCKETS};
use leanstream_runtime::cache::{
    CacheShape, EvictionPolicy, Learned, Lru, NeuronCache, NeuronFreq, RetentionTable, SlidingWindow, StaticHot,
};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::placement::{thresholds, Active};
use crate::{Result, SynthError};

/// Settings of [`learn`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvictionOptions {
    /// Sparsity level whose manifest thresholds decide which neurons are used.
    pub sparsity: f32,
    /// Pseudo-observations of the prior in each cell.
    pub prior_weight: f32,
    /// Train on the first N tokens of the training split.
    pub max_tokens: Option<usize>,
    #[serde(skip)]
    pub progress: bool,
}

impl Default for EvictionOptions {
    fn default() -> Self {
        Self {
            sparsity: 0.5,
            prior_weight: 4.0,
            max_tokens: None,
            progress: false,
        }
    }
}

/// A trained table and the training split's use frequency per neuron,
/// `[layer][neuron]` (the static hot set's ranking).
pub struct Trained {
    pub table: RetentionTable,
    pub frequency: Vec<f32>,
    pub tokens: usize,
}

/// One layer's counts: per neuron and bucket, observations and next-token uses.
fn layer_counts(act: &Active, n_ff: usize, tokens: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let (mut seen, mut used) = (vec![0u32; n_ff * N_BUCKETS], vec![0u32; n_ff * N_BUCKETS]);
    let mut freq = vec![0u32; n_ff];
    let mut last = vec![u64::MAX; n_ff];
    let mut next = vec![false; n_ff];
    for t in 0..tokens {
        for &i in act.token(t) {
            last[i as usize] = t as u64;
            freq[i as usize] += 1;
        }
        if t + 1 == tokens {
            break;
        }
        next.fill(false);
        for &i in act.token(t + 1) {
            next[i as usize] = true;
        }
        for i in 0..n_ff {
            if last[i] == u64::MAX {
                continue;
            }
            let k = i * N_BUCKETS + age_bucket(t as u64 - last[i]);
            seen[k] += 1;
            used[k] += next[i] as u32;
        }
    }
    (seen, used, freq)
}

/// Trains the retention table on the trace's training split.
pub fn learn(trace: &Trace, o: &EvictionOptions) -> Result<Trained> {
    if !(o.prior_weight.is_finite() && o.prior_weight >= 0.0) {
        return Err(SynthError::Settings(format!(
            "prior weight {} must be >= 0",
            o.prior_weight
        )));
    }
    let thr = thresholds(trace, o.sparsity)?;
    let (n_layer, n_ff) = (trace.n_layer(), trace.n_ff());
    let bar = leanstream_runtime::progress::bar(
        n_layer as u64,
        o.progress,
        "eviction {bar:40} {pos}/{len} layers [{elapsed_precise}, eta {eta}]",
    );
    let layers = (0..n_layer)
        .into_par_iter()
        .map(|l| -> Result<(Vec<f32>, Vec<f32>, usize)> {
            let act = Active::new(&trace.layer("train", Array::Act, l)?, thr[l]);
            let tokens = o.max_tokens.map_or(act.tokens(), |m| m.min(act.tokens()));
            if tokens < 2 {
                return Err(SynthError::Trace {
                    path: trace.dir.clone(),
                    reason: format!("the training split has {tokens} tokens; eviction needs at least 2"),
                });
            }
            let (seen, used, freq) = layer_counts(&act, n_ff, tokens);
            let f: Vec<f32> = freq.iter().map(|&c| c as f32 / tokens as f32).collect();
            let mean_f = (f.iter().sum::<f32>() / n_ff as f32).max(1e-9);
            let rate: Vec<f32> = (0..N_BUCKETS)
                .map(|b| {
                    let (s, u) = (0..n_ff).fold((0u64, 0u64), |(s, u), i| {
                        (s + seen[i * N_BUCKETS + b] as u64, u + used[i * N_BUCKETS + b] as u64)
                    });
                    if s == 0 {
                        mean_f
                    } else {
                        u as f32 / s as f32
                    }
                })
                .collect();
            let mut p = vec![0f32; n_ff * N_BUCKETS];
            for (k, pk) in p.iter_mut().enumerate() {
                let prior = (f[k / N_BUCKETS] * rate[k % N_BUCKETS] / mean_f).clamp(0.0, 1.0);
                *pk = (used[k] as f32 + o.prior_weight * prior) / (seen[k] as f32 + o.prior_weight).max(1e-9);
            }
            bar.inc(1);
            Ok((p, f, tokens))
        })
        .collect::<Result<Vec<_>>>()?;
    bar.finish_and_clear();
    let tokens = layers.first().map_or(0, |l| l.2);
    let (mut p, mut frequency) = (Vec::new(), Vec::new());
    for (lp, lf, _) in layers {
        p.extend(lp);
        frequency.extend(lf);
    }
    let provenance = serde_json::json!({
        "kind": "retention",
        "model": trace.manifest.model,
        "trace": trace.dir.display().to_string(),
        "train_texts": trace.split("train").map(|s| s.texts.clone()).unwrap_or_default(),
        "train_tokens": tokens,
        "settings": o,
    })
    .to_string();
    Ok(Trained {
        table: RetentionTable::from_probabilities(provenance, n_layer, n_ff, &p),
        frequency,
        tokens,
    })
}

/// One policy's row of Table 4.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MissRow {
    pub policy: String,
    pub lookups: u64,
    pub misses: u64,
    pub miss_ratio: f64,
    /// Misses the cache refused to admit (learned, hot).
    pub rejections: u64,
}

impl MissRow {
    /// A bound's row (it admits everything it wants, so it rejects nothing).
    fn bound(policy: &str, lookups: u64, misses: u64) -> Self {
        Self {
            policy: policy.into(),
            lookups,
            misses,
            miss_ratio: misses as f64 / lookups.max(1) as f64,
            rejections: 0,
        }
    }
}

/// Table 4 on `split`: the miss ratio of each policy with a cache of
/// `budget_share` of all neurons, at `sparsity`.
pub fn table4(
    trace: &Trace,
    trained: &Trained,
    split: &str,
    sparsity: f32,
    budget_share: f64,
    window: usize,
    max_tokens: Option<usize>,
) -> Result<Vec<MissRow>> {
    if !(budget_share > 0.0 && budget_share <= 1.0) {
        return Err(SynthError::Settings(format!(
            "budget share {budget_share} must be in (0, 1]"
        )));
    }
    let thr = thresholds(trace, sparsity)?;
    let (n_layer, n_ff) = (trace.n_layer(), trace.n_ff());
    let active = (0..n_layer)
        .into_par_iter()
        .map(|l| Ok(Active::new(&trace.layer(split, Array::Act, l)?, thr[l])))
        .collect::<Result<Vec<_>>>()?;
    let tokens = active.iter().map(Active::tokens).min().unwrap_or(0);
    let tokens = max_tokens.map_or(tokens, |m| m.min(tokens));
    let shape = CacheShape::uniform(n_layer, n_ff, 64);
    let slots = (budget_share * (n_layer * n_ff) as f64).round() as u64;
    let ranking: Vec<NeuronFreq> = trained
        .frequency
        .iter()
        .enumerate()
        .map(|(k, &freq)| NeuronFreq {
            layer: (k / n_ff) as u32,
            neuron: (k % n_ff) as u32,
            freq,
        })
        .collect();
    let table = Arc::new(trained.table.clone());
    let policies: Vec<(String, Box<dyn EvictionPolicy>)> = vec![
        ("lru".into(), Box::new(Lru::new())),
        (
            format!("window:{window} (eager release)"),
            Box::new(SlidingWindow::new(window).with_eager_release(true)),
        ),
        ("hot (training frequency)".into(), Box::new(StaticHot::new(ranking))),
        ("learned".into(), Box::new(Learned::new(table))),
    ];
    let mut rows = policies
        .into_par_iter()
        .map(|(name, policy)| {
            let mut cache = NeuronCache::new(&shape, slots * 64, policy)
                .map_err(|e| SynthError::Settings(format!("cache for {name}: {e}")))?;
            for (l, i) in cache.prefill_list() {
                cache.insert(l as usize, i as usize);
            }
            cache.reset_stats();
            let (mut pinned, mut missed) = (Vec::new(), Vec::new());
            for t in 0..tokens {
                for (l, a) in active.iter().enumerate() {
                    pinned.clear();
                    missed.clear();
                    for &i in a.token(t) {
                        let i = i as usize;
                        if cache.lookup(l, i).is_some() {
                            cache.pin(l, i);
                            pinned.push(i);
                        } else {
                            missed.push(i);
                        }
                    }
                    for &i in &missed {
                        cache.insert(l, i);
                    }
                    for &i in &pinned {
                        cache.unpin(l, i);
                    }
                }
                cache.end_token();
            }
            let s = cache.stats();
            Ok(MissRow {
                policy: name,
                lookups: s.hits + s.misses,
                misses: s.misses,
                miss_ratio: 1.0 - s.hit_rate(),
                rejections: s.rejections,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    rows.push(learned_free_choice(
        &active,
        &trained.table,
        n_ff,
        tokens,
        slots as usize,
    ));
    rows.push(belady(&active, n_ff, tokens, slots as usize));
    Ok(rows)
}

/// The learned priorities' own ceiling: before each token the cache holds
/// the `slots` neurons they rank highest, as if it could load any neuron
/// for free between tokens. A cache that admits and evicts by these
/// priorities cannot miss less; the gap from here to Belady's bound is
/// what a neuron's history does not tell about the next token.
fn learned_free_choice(active: &[Active], table: &RetentionTable, n_ff: usize, tokens: usize, slots: usize) -> MissRow {
    let n = active.len() * n_ff;
    let mut last = vec![u64::MAX; n];
    let mut ranked: Vec<(u16, u32)> = Vec::with_capacity(n);
    let mut resident = vec![false; n];
    let (mut lookups, mut misses) = (0u64, 0u64);
    for t in 0..tokens as u64 {
        // Ranked on what is known after token t - 1, as `layer_counts` trained it.
        ranked.clear();
        ranked.extend((0..n).map(|k| {
            let age = match last[k] {
                u64::MAX => u64::MAX,
                seen => t - 1 - seen,
            };
            (u16::MAX - table.priority(k / n_ff, k % n_ff, age), k as u32)
        }));
        resident.fill(false);
        let keep = slots.min(n);
        if keep > 0 {
            if keep < n {
                ranked.select_nth_unstable(keep - 1);
            }
            for &(_, k) in &ranked[..keep] {
                resident[k as usize] = true;
            }
        }
        for (l, a) in active.iter().enumerate() {
            for &i in a.token(t as usize) {
                let k = l * n_ff + i as usize;
                lookups += 1;
                misses += !resident[k] as u64;
                last[k] = t;
            }
        }
    }
    MissRow::bound("learned, free reloads (its ceiling)", lookups, misses)
}

/// Belady's MIN on the same accesses: on a miss with the cache full, the
/// resident (or the newcomer) used again furthest in the future is dropped.
/// It knows the future, so no online policy can miss less: the bound the
/// others are read against.
fn belady(active: &[Active], n_ff: usize, tokens: usize, slots: usize) -> MissRow {
    use std::collections::BTreeSet;
    let n_layer = active.len();
    // Per (layer, neuron), the tokens it is used in, in order.
    let mut uses: Vec<Vec<u32>> = vec![Vec::new(); n_layer * n_ff];
    for (l, a) in active.iter().enumerate() {
        for t in 0..tokens {
            for &i in a.token(t) {
                uses[l * n_ff + i as usize].push(t as u32);
            }
        }
    }
    let mut cursor = vec![0usize; n_layer * n_ff];
    // Resident keys by (next use, key); each resident key's entry.
    let mut by_next: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut entry: Vec<u64> = vec![u64::MAX; n_layer * n_ff];
    let (mut lookups, mut misses) = (0u64, 0u64);
    for t in 0..tokens {
        for (l, a) in active.iter().enumerate() {
            for &i in a.token(t) {
                let k = l * n_ff + i as usize;
                cursor[k] += 1;
                let next = uses[k]
                    .get(cursor[k])
                    .map_or(u64::MAX - k as u64, |&t2| t2 as u64 * n_layer as u64 + l as u64);
                lookups += 1;
                if entry[k] != u64::MAX {
                    by_next.remove(&(entry[k], k as u32));
                } else {
                    misses += 1;
                    if by_next.len() >= slots {
                        let &(far, victim) = by_next.last().expect("a full cache holds entries");
                        if far <= next {
                            continue;
                        }
                        by_next.pop_last();
                        entry[victim as usize] = u64::MAX;
                    }
                }
                if slots > 0 {
                    by_next.insert((next, k as u32));
                    entry[k] = next;
                }
            }
        }
    }
    MissRow::bound("belady (offline bound)", lookups, misses)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tokens` tokens of one layer: neuron 0 used in every one, neuron 1 in every other.
    fn steady_and_alternating(tokens: usize) -> Active {
        let mut offsets = vec![0];
        let mut ids = Vec::new();
        for t in 0..tokens {
            ids.push(0u16);
            if t % 2 == 0 {
                ids.push(1);
            }
            offsets.push(ids.len());
        }
        Active::from_parts(offsets, ids)
    }

    /// Neuron 0 used every token, neuron 1 every other token, neuron 2 never.
    #[test]
    fn counts_follow_ages() {
        let tokens = 6;
        let act = steady_and_alternating(tokens);
        let (seen, used, freq) = layer_counts(&act, 3, tokens);
        assert_eq!(freq, [6, 3, 0]);
        // Neuron 0: always age 0 and always used next (5 transitions).
        assert_eq!((seen[0], used[0]), (5, 5));
        // Neuron 1: age 0 at t = 0, 2, 4 (next unused), age 1 at t = 1, 3 (next used).
        assert_eq!((seen[N_BUCKETS], used[N_BUCKETS]), (3, 0));
        assert_eq!((seen[N_BUCKETS + 1], used[N_BUCKETS + 1]), (2, 2));
        // Neuron 2 is never seen.
        assert!(seen[2 * N_BUCKETS..].iter().all(|&s| s == 0));
    }

    /// One slot; neuron 0 used every token, neuron 1 every other. Priorities
    /// that rank the steady neuron first miss only the other's uses; ranking
    /// it last misses all of its six.
    #[test]
    fn the_free_choice_ceiling_follows_the_priorities() {
        let tokens = 6;
        let active = [steady_and_alternating(tokens)];
        let table = |p0: f32, p1: f32| {
            let mut p = vec![p0; N_BUCKETS];
            p.extend(vec![p1; N_BUCKETS]);
            RetentionTable::from_probabilities(String::new(), 1, 2, &p)
        };
        let row = learned_free_choice(&active, &table(0.9, 0.1), 2, tokens, 1);
        assert_eq!((row.lookups, row.misses), (9, 3));
        let row = learned_free_choice(&active, &table(0.1, 0.9), 2, tokens, 1);
        assert_eq!((row.lookups, row.misses), (9, 6));
    }
}
