//! `leanstream-profile activations`: runs the dense model over real text and
//! writes the trace directory described in the module above.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use half::f16;
use leanstream_runtime::fetch::sha256_file;
use leanstream_runtime::model::{FfnBy, LayerAt, LayerHook, Model};
use leanstream_runtime::sparsity::calibrate_windows;
use leanstream_runtime::Result as RtResult;

use super::npy;
use super::{Array, Level, Manifest, ModelInfo, ShardInfo, Split, TextInfo, FORMAT, VERSION};
use crate::runner::STOP;
use crate::shard::write_atomic;
use crate::{ProfileError, Result};

/// Sparsity levels whose thresholds the manifest carries.
pub const LEVELS: [f32; 3] = [0.5, 0.7, 0.8];

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub model: PathBuf,
    pub train: Vec<PathBuf>,
    pub heldout: Vec<PathBuf>,
    pub out: PathBuf,
    pub ctx: usize,
    pub shard_tokens: usize,
    /// Cap on the tokens of each split.
    pub max_tokens: Option<usize>,
    pub hot_fraction: f32,
    pub progress: bool,
}

/// One split's token windows, each recorded from position 0.
struct Planned {
    name: &'static str,
    texts: Vec<TextInfo>,
    windows: Vec<Vec<u32>>,
}

impl Planned {
    /// Window ranges of each shard: whole windows up to `shard_tokens` tokens.
    fn shards(&self, shard_tokens: usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let (mut start, mut tokens) = (0, 0);
        for (i, w) in self.windows.iter().enumerate() {
            if tokens > 0 && tokens + w.len() > shard_tokens {
                out.push(start..i);
                start = i;
                tokens = 0;
            }
            tokens += w.len();
        }
        if tokens > 0 {
            out.push(start..self.windows.len());
        }
        out
    }
}

fn plan_split(model: &Model, name: &'static str, files: &[PathBuf], ctx: usize, cap: Option<usize>) -> Result<Planned> {
    let mut texts = Vec::new();
    let mut windows = Vec::new();
    let mut left = cap.unwrap_or(usize::MAX);
    for path in files {
        let text = fs::read_to_string(path).map_err(|e| ProfileError::io(path, e))?;
        let mut tokens = model.tokenizer.encode(&text, true, false);
        tokens.truncate(left);
        if tokens.len() < 2 {
            continue;
        }
        left -= tokens.len();
        texts.push(TextInfo {
            path: path.display().to_string(),
            sha256: sha256_file(path)?,
            tokens: tokens.len(),
        });
        windows.extend(tokens.chunks(ctx).filter(|w| w.len() >= 2).map(<[u32]>::to_vec));
    }
    if windows.is_empty() {
        return Err(ProfileError::Invalid(format!("the {name} texts hold no tokens")));
    }
    Ok(Planned { name, texts, windows })
}

/// The probe: copies each layer's signals of the current window into the shard buffers.
struct Recorder<'h> {
    d: usize,
    f: usize,
    /// Tokens of the shard (the `T` of its arrays) and where the current window starts.
    t_len: usize,
    t0: usize,
    hot: &'h [f32],
    bufs: [Vec<f16>; 5],
}

fn put(buf: &mut [f16], t_len: usize, width: usize, layer: usize, t0: usize, rows: Range<usize>, src: &[f32]) {
    let start = (layer * t_len + t0 + rows.start) * width;
    for (dst, &v) in buf[start..start + rows.len() * width].iter_mut().zip(src) {
        *dst = f16::from_f32(v.clamp(-65504.0, 65504.0));
    }
}

impl<'h> Recorder<'h> {
    fn new(n_layer: usize, d: usize, f: usize, t_len: usize, hot: &'h [f32]) -> Self {
        let bufs = Array::ALL.map(|a| {
            let width = if a == Array::Act { f } else { d };
            vec![f16::ZERO; n_layer * t_len * width]
        });
        Self {
            d,
            f,
            t_len,
            t0: 0,
            hot,
            bufs,
        }
    }

    fn store(&mut self, a: Array, layer: usize, rows: Range<usize>, src: &[f32]) {
        let width = if a == Array::Act { self.f } else { self.d };
        put(&mut self.bufs[a as usize], self.t_len, width, layer, self.t0, rows, src);
    }
}

impl LayerHook for Recorder<'_> {
    fn layer_input(&mut self, at: &LayerAt, x: &[f32]) {
        self.store(Array::LayerIn, at.layer, at.rows.clone(), x);
    }
    fn ffn(&mut self, at: &LayerAt, resid: &[f32], xb: &[f32], _out: &mut [f32]) -> RtResult<FfnBy> {
        self.store(Array::Resid, at.layer, at.rows.clone(), resid);
        self.store(Array::FfnIn, at.layer, at.rows.clone(), xb);
        Ok(FfnBy::Model)
    }
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        self.store(Array::Act, at.layer, at.rows.clone(), acts);
    }
    fn partial_mask(&self, layer: usize) -> Option<&[f32]> {
        Some(&self.hot[layer * self.f..(layer + 1) * self.f])
    }
    fn partial_output(&mut self, at: &LayerAt, y: &[f32]) {
        self.store(Array::Partial, at.layer, at.rows.clone(), y);
    }
}

/// Per layer, 1.0 for the `fraction` of neurons with the highest score.
pub fn hot_mask(scores: &[Vec<f32>], fraction: f32) -> Vec<f32> {
    let mut mask = Vec::new();
    for layer in scores {
        let k = ((layer.len() as f32 * fraction).round() as usize).min(layer.len());
        let mut ids: Vec<usize> = (0..layer.len()).collect();
        ids.sort_by(|&a, &b| layer[b].total_cmp(&layer[a]).then(a.cmp(&b)));
        let mut m = vec![0.0; layer.len()];
        for &i in &ids[..k] {
            m[i] = 1.0;
        }
        mask.extend(m);
    }
    mask
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    let json = serde_json::to_vec_pretty(m).map_err(|e| ProfileError::Invalid(e.to_string()))?;
    write_atomic(&dir.join("manifest.json"), &json)
}

/// Records (or continues recording) a trace directory; returns its manifest.
pub fn record(opts: &RecordOptions) -> Result<Manifest> {
    if opts.ctx < 2 || opts.shard_tokens == 0 || !(0.0..=1.0).contains(&opts.hot_fraction) {
        return Err(ProfileError::Invalid(format!(
            "ctx {} (≥ 2), shard tokens {} (≥ 1), hot fraction {} (0..=1)",
            opts.ctx, opts.shard_tokens, opts.hot_fraction
        )));
    }
    let model = Model::load(&opts.model)?;
    let c = &model.config;
    let (n_layer, d, f) = (c.n_layer, c.n_embd, c.n_ff);
    let train = plan_split(&model, "train", &opts.train, opts.ctx, opts.max_tokens)?;
    let heldout = plan_split(&model, "heldout", &opts.heldout, opts.ctx, opts.max_tokens)?;
    if let Some(t) = train
        .texts
        .iter()
        .find(|t| heldout.texts.iter().any(|h| h.sha256 == t.sha256))
    {
        return Err(ProfileError::Invalid(format!(
            "{} is both a training and a held-out text",
            t.path
        )));
    }
    let model_info = ModelInfo {
        path: opts.model.display().to_string(),
        sha256: sha256_file(&opts.model)?,
        arch: format!("{:?}", c.arch),
        n_layer,
        n_embd: d,
        n_ff: f,
    };
    fs::create_dir_all(&opts.out).map_err(|e| ProfileError::io(&opts.out, e))?;
    let manifest_path = opts.out.join("manifest.json");
    let scores_path = opts.out.join("scores.npy");
    let hot_path = opts.out.join("hot.npy");
    let fresh = |levels| Manifest {
        format: FORMAT.into(),
        version: VERSION,
        model: model_info.clone(),
        ctx: opts.ctx,
        shard_tokens: opts.shard_tokens,
        hot_fraction: opts.hot_fraction,
        levels,
        splits: [&train, &heldout]
            .iter()
            .map(|p| Split {
                name: p.name.into(),
                texts: p.texts.clone(),
                planned_tokens: p.windows.iter().map(Vec::len).sum(),
                shards: Vec::new(),
            })
            .collect(),
    };
    let (mut manifest, hot) = if manifest_path.exists() {
        let m: Manifest =
            serde_json::from_slice(&fs::read(&manifest_path).map_err(|e| ProfileError::io(&manifest_path, e))?)
                .map_err(|e| ProfileError::Json {
                    path: manifest_path.clone(),
                    source: e,
                })?;
        let want = fresh(m.levels.clone());
        let same = m.format == want.format
            && m.model.sha256 == want.model.sha256
            && (m.ctx, m.shard_tokens, m.hot_fraction) == (want.ctx, want.shard_tokens, want.hot_fraction)
            && m.splits.iter().zip(&want.splits).all(|(a, b)| a.texts == b.texts);
        if !same {
            return Err(ProfileError::Invalid(format!(
                "{} holds a trace of other settings, model or texts; choose another directory",
                opts.out.display()
            )));
        }
        let (shape, hot) = npy::read_u8(&hot_path)?;
        if shape != [n_layer, f] {
            return Err(ProfileError::Invalid(format!(
                "{}: shape {shape:?}",
                hot_path.display()
            )));
        }
        let hot: Vec<f32> = hot.into_iter().map(f32::from).collect();
        eprintln!(
            "continuing {}: {} of {} tokens recorded",
            opts.out.display(),
            m.splits.iter().map(Split::recorded_tokens).sum::<usize>(),
            m.splits.iter().map(|s| s.planned_tokens).sum::<usize>()
        );
        (m, hot)
    } else {
        if fs::read_dir(&opts.out)
            .map_err(|e| ProfileError::io(&opts.out, e))?
            .next()
            .is_some()
        {
            return Err(ProfileError::Invalid(format!(
                "{} is not empty and holds no trace manifest",
                opts.out.display()
            )));
        }
        // Hot set and thresholds come from the training split alone.
        let windows: Vec<&[u32]> = train.windows.iter().map(Vec::as_slice).collect();
        eprintln!(
            "calibrating on {} training tokens ...",
            windows.iter().map(|w| w.len()).sum::<usize>()
        );
        let cal = calibrate_windows(&model, &windows, &LEVELS, opts.progress)?;
        let scores: Vec<f32> = cal.neuron_scores.concat();
        npy::write_f32(&scores_path, &[n_layer, f], &scores)?;
        let hot = hot_mask(&cal.neuron_scores, opts.hot_fraction);
        let hot_u8: Vec<u8> = hot.iter().map(|&h| h as u8).collect();
        npy::write_bytes(&hot_path, npy::Dtype::U8, &[n_layer, f], &hot_u8)?;
        let levels = cal
            .levels
            .iter()
            .map(|l| Level {
                sparsity: l.sparsity,
                per_layer: l.full.clone(),
            })
            .collect();
        let m = fresh(levels);
        write_manifest(&opts.out, &m)?;
        (m, hot)
    };

    let total: usize = manifest.splits.iter().map(|s| s.planned_tokens).sum();
    let done: usize = manifest.splits.iter().map(Split::recorded_tokens).sum();
    let bar = leanstream_runtime::progress::bar(
        total as u64,
        opts.progress,
        "activations {bar:30} {pos}/{len} tokens, {per_sec}, ETA {eta} {msg}",
    );
    bar.set_position(done as u64);
    let mut st = model.new_state(opts.ctx, opts.ctx, 1);
    for (si, planned) in [&train, &heldout].into_iter().enumerate() {
        let shards = planned.shards(opts.shard_tokens);
        let committed = manifest.splits[si].shards.len();
        for (k, windows) in shards.iter().enumerate().skip(committed) {
            bar.set_message(format!("{} shard {}/{}", planned.name, k + 1, shards.len()));
            let t_len: usize = planned.windows[windows.clone()].iter().map(Vec::len).sum();
            let mut rec = Recorder::new(n_layer, d, f, t_len, &hot);
            let mut tokens = Vec::with_capacity(t_len);
            for w in &planned.windows[windows.clone()] {
                if STOP.load(Ordering::SeqCst) {
                    bar.abandon();
                    return Err(ProfileError::Invalid(format!(
                        "interrupted: {} holds every shard committed so far; the same command continues",
                        opts.out.display()
                    )));
                }
                model.forward_with(&mut st, w, 0, 0..w.len(), &mut rec)?;
                rec.t0 += w.len();
                tokens.extend_from_slice(w);
                bar.inc(w.len() as u64);
            }
            let rel = format!("{}/shard-{k:06}", planned.name);
            let final_dir = opts.out.join(&rel);
            let tmp = opts.out.join(format!("{rel}.tmp"));
            let _ = fs::remove_dir_all(&tmp);
            fs::create_dir_all(&tmp).map_err(|e| ProfileError::io(&tmp, e))?;
            npy::write_u32(&tmp.join("tokens.npy"), &[t_len], &tokens)?;
            for a in Array::ALL {
                let width = if a == Array::Act { f } else { d };
                npy::write_f16(
                    &tmp.join(a.file_name()),
                    &[n_layer, t_len, width],
                    &rec.bufs[a as usize],
                )?;
            }
            let _ = fs::remove_dir_all(&final_dir);
            fs::rename(&tmp, &final_dir).map_err(|e| ProfileError::io(&final_dir, e))?;
            manifest.splits[si].shards.push(ShardInfo {
                dir: rel,
                tokens: t_len,
            });
            write_manifest(&opts.out, &manifest)?;
        }
    }
    bar.finish_and_clear();
    Ok(manifest)
}
