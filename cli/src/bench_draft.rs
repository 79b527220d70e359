//! `leanstream bench-draft`: drafting against plain decoding on real text,
//! in one run. Each prompt is generated greedily once plain and once per
//! draft, in turn (the order rotating by prompt, so each sees the same
//! machine and a cache warmed alike); reported per draft: whether every
//! token matched the plain run's, acceptance, tokens per pass, decode
//! speed and the paired median of its ratio to plain, and bytes read per
//! token.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use leanstream_runtime::engine::{FlashModel, Policy};
use leanstream_runtime::generate::draft::{self, DraftKind, DraftLen, Drafting, Proposer};
use leanstream_runtime::generate::{CpuDecoder, Sampler, SamplerConfig};
use leanstream_runtime::model::{LayerAt, LayerHook, Model, RunState};
use leanstream_runtime::session::Session;
use leanstream_runtime::RuntimeError;
use serde_json::{json, Value};

#[derive(Args)]
pub struct BenchDraftArgs {
    #[arg(long)]
    model: String,
    /// Real prose to take prompts from (windows spread over the file);
    /// without it, the built-in chat questions in the model's template.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Prompts (at most the chat questions without --text).
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// Tokens of each prose prompt.
    #[arg(long, default_value_t = 96)]
    prompt_tokens: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 64)]
    gen: usize,
    /// Drafts compared with plain decoding.
    #[arg(long, value_delimiter = ',', default_value = "lookup")]
    drafts: Vec<DraftKind>,
    /// Also measure drafts by the model itself with its FFN restricted to
    /// each layer's hottest SHARE of neurons (by the calibrated scores in
    /// --hot-scores): the neurons a `hot` cache of that share holds, so the
    /// acceptance a draft from the cache alone would have. For acceptance
    /// only: it runs the GGUF's own matrices masked, a whole dense pass a
    /// token, so its speed says nothing. Needs a GGUF --model.
    #[arg(long, value_delimiter = ',', requires = "hot_scores")]
    hot_shares: Vec<f32>,
    /// A calibrated `.lsflash` packed from --model, for its neuron scores.
    #[arg(long)]
    hot_scores: Option<PathBuf>,
    /// Draft lengths: each draft runs with each.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    draft_len: Vec<DraftLen>,
    #[command(flatten)]
    flash: crate::FlashArgs,
}

/// Chat questions a user might ask a small model.
const QUESTIONS: [&str; 12] = [
    "Name three rivers in Europe and the countries they flow through.",
    "Write a short poem about the sea.",
    "Explain how a bicycle works in a few sentences.",
    "What is the difference between weather and climate?",
    "Give me a recipe for pancakes.",
    "List the planets of the solar system in order from the sun.",
    "Write a Python function that returns the factorial of a number.",
    "Why is the sky blue?",
    "Summarise the story of Little Red Riding Hood.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Describe the water cycle step by step.",
];

/// One generation's figures.
#[derive(Default, Clone)]
struct Figures {
    tokens: Vec<u32>,
    seconds: f64,
    bytes_read: u64,
    draft: draft::DraftReport,
}

pub fn run(a: BenchDraftArgs) -> Result<()> {
    if a.gen == 0 || a.prompts == 0 {
        bail!("nothing to measure: --gen and --prompts must be at least 1");
    }
    if a.drafts.is_empty() || a.drafts.contains(&DraftKind::None) {
        bail!("--drafts: name the drafts to compare (lookup, model:PATH); plain decoding always runs");
    }
    let settings = a.flash.settings()?;
    if settings.policy() == Policy::Oracle {
        bail!("bench-draft runs each prompt several times; the oracle replays one recorded run");
    }
    let path = leanstream_runtime::fetch::resolve_model(&a.model)?;
    let configs: Vec<(Draft, DraftLen)> = std::iter::once(Draft::Kind(DraftKind::None))
        .chain(a.drafts.iter().map(|d| Draft::Kind(d.clone())))
        .chain(a.hot_shares.iter().map(|&s| Draft::Hot(s)))
        .flat_map(|d| {
            let lens: Vec<DraftLen> = match d {
                Draft::Kind(DraftKind::None) => vec![DraftLen::Fixed(0)],
                _ => a.draft_len.clone(),
            };
            lens.into_iter().map(move |l| (d.clone(), l))
        })
        .collect();
    let hot = match &a.hot_scores {
        Some(p) if !a.hot_shares.is_empty() => Some(hot_masks(p, &path, &a.hot_shares)?),
        _ => None,
    };
    let rows = configs.iter().map(|(d, l)| d.rows(*l)).max().unwrap_or(1);
    // The run state for the longest prompt, run in batches of up to 16
    // tokens (llama.cpp's -ub under a tight budget): the smallest state
    // that takes a verification pass, so a memory budget leaves the cache
    // what a user who sizes it so gets.
    let mut prompts = Vec::new();
    let (mut loaded, mut st) = Session::open(&path, &settings, |m| {
        prompts = crate::bench_draft::prompts(&a, m).map_err(|e| RuntimeError::Invalid(format!("{e:#}")))?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
        Ok(m.new_state(longest + a.gen + 1, longest.min(16).max(rows), 1))
    })?;
    let n_vocab = loaded.model().config.n_vocab;
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); configs.len()];
    for (i, prompt) in prompts.iter().enumerate() {
        for j in 0..configs.len() {
            let c = (i + j) % configs.len();
            let (draft, len) = &configs[c];
            let mut d = match draft {
                Draft::Kind(kind) => Drafting::new(kind, *len, st.ctx, n_vocab)?,
                Draft::Hot(share) => {
                    let (model, masks) = hot.as_ref().expect("hot drafts need their masks");
                    let masks = &masks[a
                        .hot_shares
                        .iter()
                        .position(|s| *s == *share)
                        .expect("a share asked for")];
                    Drafting {
                        proposer: Some(Box::new(HotDraft::new(model, masks, st.ctx))),
                        policy: draft::DraftPolicy::new(*len),
                    }
                }
            };
            let before = loaded.flash().map_or(0, |(_, e)| e.stats().bytes_read);
            let (model, hook) = loaded.parts()?;
            let mut dec = CpuDecoder {
                model,
                st: &mut st,
                hook,
            };
            let mut sampler = Sampler::new(
                SamplerConfig {
                    temperature: 0.0,
                    ..SamplerConfig::default()
                },
                n_vocab,
            );
            let mut tokens = Vec::new();
            let stats = draft::decode(
                &mut dec,
                &model.tokenizer,
                prompt,
                0,
                a.gen,
                &mut sampler,
                &mut d,
                |tok| {
                    tokens.push(tok);
                    Ok(ControlFlow::Continue(()))
                },
            )?;
            let after = loaded.flash().map_or(0, |(_, e)| e.stats().bytes_read);
            runs[c].push(Figures {
                tokens,
                seconds: stats.decode_time.as_secs_f64(),
                bytes_read: after - before,
                draft: stats.draft,
            });
        }
        eprint!("\rprompt {}/{}", i + 1, prompts.len());
    }
    eprintln!();
    let plain = &runs[0];
    let report: Vec<Value> = configs
        .iter()
        .zip(&runs)
        .map(|((draft, len), figs)| summary(&draft.to_string(), *len, figs, plain))
        .collect();
    let out = json!({
        "model": path.display().to_string(),
        "policy": loaded.flash().map(|(_, e)| e.policy().to_string()),
        "mem_budget": a.flash.mem_budget,
        "ffn_budget": a.flash.ffn_budget,
        "sparsity": a.flash.sparsity,
        "prompts": prompts.len(),
        "prompt_set": a.text.as_ref().map_or("chat".to_string(), |p| p.display().to_string()),
        "gen": a.gen,
        "cpu_features": leanstream_kernels::Device::cpu_features(),
        "runs": report,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Prose windows spread over `--text`, or the chat questions in the
/// model's template.
fn prompts(a: &BenchDraftArgs, model: &leanstream_runtime::model::Model) -> Result<Vec<Vec<u32>>> {
    let Some(file) = &a.text else {
        if a.prompts > QUESTIONS.len() {
            bail!(
                "--prompts {}: there are {} chat questions (give --text for more)",
                a.prompts,
                QUESTIONS.len()
            );
        }
        return QUESTIONS[..a.prompts]
            .iter()
            .map(|q| crate::prompt_ids(model, q, true))
            .collect();
    };
    let text = std::fs::read_to_string(file).with_context(|| format!("{}: reading the prompt text", file.display()))?;
    let ids = model.tokenizer.encode(&text, false, false);
    if ids.len() < a.prompt_tokens * a.prompts {
        bail!(
            "{}: {} tokens, too few for {} prompts of {}",
            file.display(),
            ids.len(),
            a.prompts,
            a.prompt_tokens
        );
    }
    let stride = (ids.len() - a.prompt_tokens) / a.prompts;
    let bos = model.tokenizer.encode("", true, false);
    Ok((0..a.prompts)
        .map(|i| {
            let mut p = bos.clone();
            p.extend_from_slice(&ids[i * stride..i * stride + a.prompt_tokens]);
            p
        })
        .collect())
}

fn summary(name: &str, len: DraftLen, figs: &[Figures], plain: &[Figures]) -> Value {
    let tokens: usize = figs.iter().map(|f| f.tokens.len()).sum();
    let seconds: f64 = figs.iter().map(|f| f.seconds).sum();
    let bytes: u64 = figs.iter().map(|f| f.bytes_read).sum();
    let mut d = draft::DraftReport::default();
    figs.iter().for_each(|f| d += f.draft);
    // Mean pass time by rows, against a pass of one row (of this draft's own run).
    let one = d.mean_pass_seconds(1);
    let pass_cost: serde_json::Map<String, Value> = (1..=draft::ROWS_REPORTED)
        .filter_map(|r| Some((r, d.mean_pass_seconds(r)?)))
        .map(|(r, t)| {
            let v = json!({"passes": d.rows_passes[r - 1], "ms": 1e3 * t, "vs_one_row": one.map(|o| t / o)});
            (r.to_string(), v)
        })
        .collect();
    let speed = |f: &Figures| f.tokens.len() as f64 / f.seconds.max(1e-9);
    let ours: Vec<f64> = figs.iter().map(speed).collect();
    let theirs: Vec<f64> = plain.iter().map(speed).collect();
    let identical = figs.iter().zip(plain).filter(|(f, p)| f.tokens == p.tokens).count();
    json!({
        "draft": name,
        "draft_len": match len { DraftLen::Fixed(k) => k.to_string(), DraftLen::Auto { max } => format!("auto:{max}") },
        "identical_to_plain": format!("{identical}/{}", figs.len()),
        "tokens": tokens,
        "decode_tok_s": tokens as f64 / seconds.max(1e-9),
        "ratio_to_plain_paired_median": crate::bench::paired_median_ratio(&ours, &theirs),
        // The first token comes from the prompt's pass.
        "tokens_per_pass": (tokens - figs.len()) as f64 / d.passes.max(1) as f64,
        "acceptance": d.acceptance(),
        "drafted": d.drafted,
        "drafted_passes": d.drafted_passes,
        "propose_seconds": d.propose_seconds,
        "mib_read_per_token": bytes as f64 / tokens.max(1) as f64 / (1 << 20) as f64,
        "pass_by_rows": pass_cost,
    })
}

/// A draft of a bench run: a user's kind, or the hot-set measurement.
#[derive(Clone)]
enum Draft {
    Kind(DraftKind),
    /// The model with its FFN restricted to each layer's hottest share.
    Hot(f32),
}

impl Draft {
    fn rows(&self, len: DraftLen) -> usize {
        match self {
            Self::Kind(k) => Drafting::rows(k, len),
            Self::Hot(_) => Drafting::rows(&DraftKind::Lookup, len),
        }
    }
}

impl std::fmt::Display for Draft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Kind(k) => k.fmt(f),
            Self::Hot(s) => write!(f, "hot:{}%", s * 100.0),
        }
    }
}

/// Per share, per layer, 1 for the neurons of the hottest `share` by the
/// scores in `scores_file` (packed from `gguf`), else 0; and the GGUF model
/// the masked drafts run.
fn hot_masks(scores_file: &Path, gguf: &Path, shares: &[f32]) -> Result<(Model, Vec<Vec<Vec<f32>>>)> {
    let fm = FlashModel::open(scores_file)?;
    let scores = &fm.flash.header().neuron_scores;
    if scores.is_empty() {
        bail!("{}: no neuron scores (pack it with --calibrate)", scores_file.display());
    }
    let model = Model::load(gguf).with_context(|| format!("{}: the hot drafts need a GGUF --model", gguf.display()))?;
    if scores.len() != model.config.n_layer || scores[0].len() != model.config.n_ff {
        bail!(
            "{}: scores for another shape than {}",
            scores_file.display(),
            gguf.display()
        );
    }
    // Each layer's neurons hottest first, as the packer ranks them.
    let order = leanstream_runtime::flash::pack::order_by_score(scores);
    let masks = shares
        .iter()
        .map(|&share| {
            if !(share > 0.0 && share <= 1.0) {
                bail!("--hot-shares {share}: a share of the FFN, above 0 and at most 1");
            }
            Ok(order
                .iter()
                .map(|ids| {
                    let keep = ((ids.len() as f32 * share).round() as usize).min(ids.len());
                    let mut m = vec![0.0; ids.len()];
                    ids[..keep].iter().for_each(|&i| m[i as usize] = 1.0);
                    m
                })
                .collect())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((model, masks))
}

/// Skips every neuron outside a layer's mask.
struct HotMask<'m>(&'m [Vec<f32>]);

impl LayerHook for HotMask<'_> {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let mask = &self.0[at.layer];
        for row in acts.chunks_exact_mut(mask.len()) {
            row.iter_mut().zip(mask).for_each(|(a, m)| *a *= m);
        }
    }
}

/// The model drafting for itself with its FFN masked to a hot set.
struct HotDraft<'m> {
    model: &'m Model,
    masks: &'m [Vec<f32>],
    st: RunState,
    seen: Vec<u32>,
}

impl<'m> HotDraft<'m> {
    fn new(model: &'m Model, masks: &'m [Vec<f32>], ctx: usize) -> Self {
        Self {
            model,
            masks,
            st: model.new_state(ctx, 512.min(ctx), 1),
            seen: Vec::new(),
        }
    }
}

impl Proposer for HotDraft<'_> {
    fn name(&self) -> &str {
        "hot"
    }
    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>) -> leanstream_runtime::Result<()> {
        let mut hook = HotMask(self.masks);
        let mut dec = CpuDecoder {
            model: self.model,
            st: &mut self.st,
            hook: &mut hook,
        };
        draft::greedy_draft(&mut dec, &mut self.seen, context, max, out)
    }
}
