//! `--device cuda[:N]`: generation (`run`) and speed (`bench`) with the dense
//! engine on a CUDA device (`leanstream-cuda`), sampling on the host from its
//! logits in the runtime's generation loop (`serve` and `chat` run it in
//! `leanstream-server`). `run` and `bench` also take a packed `.lsflash`
//! model: with `--policy dense` its bundles all resident in device memory;
//! under a streaming policy (the CPU engine's: `dense-stream`, `speculate`,
//! the prior systems, `gate-first`), streamed from flash each token through
//! the neuron cache, the policy deciding on the host and the device keeping
//! what it keeps. A tuned model's default is `speculate`, as on the CPU.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_cuda::device::Gpu;
use leanstream_cuda::engine::GpuModel;
use leanstream_runtime::engine::{FlashModel, Policy};
use leanstream_runtime::fetch::resolve_model;
use leanstream_runtime::generate::decode_until;
use leanstream_runtime::model::Model;
use leanstream_runtime::session::StreamSettings;
use leanstream_runtime::tokenizer::StreamDecoder;
use leanstream_runtime::RuntimeError;

use crate::{load_path, prompt_ids, FlashArgs, Generation};

/// `cpu` is `None`; `cuda` and `cuda:N` name a device ordinal.
pub(crate) fn ordinal(device: &str) -> Result<Option<usize>> {
    match device {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        other => match other.strip_prefix("cuda:").map(str::parse) {
            Some(Ok(n)) => Ok(Some(n)),
            _ => bail!("--device {other:?}: expected cpu, cuda or cuda:N"),
        },
    }
}

/// Refuses what the device engine does not run: any streaming option for
/// a GGUF model (`packed` false); for a packed model, `--mem-budget` (it
/// counts the CPU engine's memory) and the oracle (it replays a CPU run).
fn refuse_streaming_options(flash: &FlashArgs, packed: bool) -> Result<()> {
    if packed {
        if flash.mem_budget.is_some() {
            bail!("--mem-budget counts the CPU engine's memory; on --device cuda give the neuron cache's --ffn-budget");
        }
        if flash.policy == Some(Policy::Oracle) {
            bail!("--policy oracle replays the CPU engine's recorded run; it does not run on --device cuda");
        }
        return Ok(());
    }
    let given = [
        (flash.policy.is_some(), "--policy"),
        (flash.predictor.is_some(), "--predictor"),
        (flash.controller.is_some(), "--controller"),
        (flash.ffn_budget.is_some(), "--ffn-budget"),
        (flash.mem_budget.is_some(), "--mem-budget"),
        (flash.sparsity != 0.0, "--sparsity"),
    ]
    .into_iter()
    .find(|(set, _)| *set)
    .map(|(_, name)| name);
    match given {
        Some(flag) => {
            bail!("{flag} is an option of a packed .lsflash model; --device cuda runs a GGUF model's dense engine")
        }
        None => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    model_arg: &str,
    prompt: &str,
    gen: &Generation,
    chat: bool,
    ctx: Option<usize>,
    ordinal: usize,
    flash: &FlashArgs,
) -> Result<()> {
    let path = resolve_model(model_arg)?;
    let t0 = Instant::now();
    let loaded = DeviceModel::load(&path, flash)?;
    let model = loaded.model();
    let ids = prompt_ids(model, prompt, chat)?;
    let ctx = ctx.unwrap_or(ids.len() + gen.n + 1).min(model.config.context_length);
    if ids.len() >= ctx {
        bail!("the prompt's {} tokens fill the context of {ctx}", ids.len());
    }
    let (mut g, device) = loaded.open(ordinal, ctx, ids.len())?;
    let load_s = t0.elapsed().as_secs_f64();

    let mut sampler = gen.sampler(model);
    let mut decoder = StreamDecoder::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let stats = decode_until(&mut g, &model.tokenizer, &ids, 0, gen.n, &mut sampler, |tok| {
        out.write_all(decoder.push(&model.tokenizer, tok).as_bytes())
            .and_then(|_| out.flush())
            .map_err(|source| RuntimeError::Io {
                path: "stdout".into(),
                source,
            })?;
        Ok(ControlFlow::Continue(()))
    })?;
    out.write_all(decoder.finish().as_bytes())?;
    out.flush()?;
    eprintln!(
        "\n{device} | load {load_s:.2} s | prompt {} tokens, {:.1} tok/s | decode {} tokens, {:.1} tok/s",
        stats.prompt_tokens,
        stats.prompt_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s(),
    );
    if let Some(s) = stream_summary(&g) {
        eprintln!("{s}");
    }
    Ok(())
}

/// What the streamed FFN landed and read, for a run's last line.
pub(crate) fn stream_summary(g: &GpuModel) -> Option<String> {
    let s = g.streamed()?;
    let (fed, io) = (s.fed, s.streamer().stats());
    Some(format!(
        "streamed FFN ({}, {} cache, {}, mirrored in {} of device memory): {} bundles read in place on the \
         device, {} landed from the host's cache, {} read, {} skipped late | {:.1} MiB read in {} reads",
        s.engine().policy(),
        s.streamer().cache_policy_name(),
        leanstream_runtime::cache::fmt_bytes(s.streamer().budget_bytes()),
        leanstream_runtime::cache::fmt_bytes(s.device_cache_bytes()),
        fed.in_place,
        fed.hits,
        fed.read,
        fed.missing,
        io.bytes_read as f64 / (1 << 20) as f64,
        io.reads
    ))
}

/// A model the device engine runs: a GGUF's, or a packed model's (its
/// bundles all resident on the device, or streamed under a policy with
/// these settings).
// One per command: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DeviceModel {
    Gguf(Model),
    Flash(FlashModel, Option<(Policy, StreamSettings)>),
}

impl DeviceModel {
    /// Loads `path`, refusing the CPU streaming engine's options.
    pub(crate) fn load(path: &Path, flash: &FlashArgs) -> Result<Self> {
        let packed = is_lsflash(path)?;
        refuse_streaming_options(flash, packed)?;
        if packed {
            let fm = FlashModel::open(path).with_context(|| format!("{}: opening the packed model", path.display()))?;
            let settings = flash.settings()?;
            let stream = match settings.policy_for(path) {
                Policy::Dense => None,
                policy => Some((policy, settings)),
            };
            return Ok(Self::Flash(fm, stream));
        }
        Ok(Self::Gguf(load_path(path)?))
    }

    pub(crate) fn model(&self) -> &Model {
        match self {
            Self::Gguf(m) => m,
            Self::Flash(fm, _) => &fm.model,
        }
    }

    /// Bytes of weights a token reads: the matrices, and a packed model's bundles.
    pub(crate) fn weight_bytes(&self) -> usize {
        match self {
            Self::Gguf(m) => m.weights.matrix_bytes(),
            Self::Flash(fm, _) => fm.model.weights.matrix_bytes() + fm.ffn_bytes() as usize,
        }
    }

    /// The device engine with a context of `ctx` and prompt batches of up
    /// to `prompt` rows (at most 512), and the device's description. A
    /// streaming policy's engine (its artifacts, thresholds, cache) is made
    /// before the device is opened, so what is wrong with it is said first.
    pub(crate) fn open(&self, ordinal: usize, ctx: usize, prompt: usize) -> Result<(GpuModel, String)> {
        let engine = match self {
            Self::Flash(fm, Some((policy, settings))) => Some(settings.device_engine(fm, *policy)?),
            _ => None,
        };
        let gpu = Gpu::open(ordinal)?;
        let device = format!(
            "{} (compute {}.{})",
            gpu.name, gpu.compute_capability.0, gpu.compute_capability.1
        );
        let batch = prompt.clamp(1, 512);
        let g = match (self, engine) {
            (Self::Gguf(m), _) => GpuModel::new(gpu, m, ctx, batch)?,
            (Self::Flash(fm, _), Some(engine)) if !engine.streamer().is_some_and(|s| s.holds_whole()) => {
                GpuModel::from_flash_streamed(gpu, fm, engine, ctx, batch)?
            }
            // Resident: `dense`, or a cache that would hold every bundle.
            (Self::Flash(fm, _), _) => GpuModel::from_flash(gpu, fm, ctx, batch)?,
        };
        Ok((g, device))
    }
}

/// Refuses what the server's device engine does not run: the CPU streaming
/// engine's options and packed `.lsflash` models.
pub(crate) fn check_dense_gguf(path: &Path, flash: &FlashArgs) -> Result<()> {
    refuse_streaming_options(flash, false)?;
    if is_lsflash(path)? {
        bail!(
            "{}: a packed .lsflash model streams on the CPU engine; the server's --device cuda runs a GGUF \
             model's dense engine",
            path.display()
        );
    }
    Ok(())
}

/// Whether `path` starts with the `.lsflash` magic.
fn is_lsflash(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 8];
    let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let n = f
        .read(&mut magic)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    Ok(n == 8 && &magic == leanstream_runtime::flash::format::MAGIC)
}
