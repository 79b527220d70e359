//! `--device cuda[:N]`: generation (`run`) and speed (`bench`) with the dense
//! engine on a CUDA device (`leanstream-cuda`), sampling on the host from its
//! logits in the runtime's generation loop (`serve` and `chat` run it in
//! `leanstream-server`). `run` and `bench` also take a packed `.lsflash`
//! model, its bundles all resident in device memory, or with `--policy
//! dense-stream` streamed from flash each token through the neuron cache.

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

/// Refuses the CPU streaming engine's options the device engine does not
/// have. A packed model (`packed`) may stream with `--policy dense-stream`
/// and its neuron cache's `--ffn-budget`, or run `--policy dense`.
fn refuse_streaming_options(flash: &FlashArgs, packed: bool) -> Result<()> {
    let streams = packed && flash.policy == Some(Policy::DenseStream);
    let device_policy = |p: Policy| packed && matches!(p, Policy::Dense | Policy::DenseStream);
    let given = [
        (flash.policy.is_some_and(|p| !device_policy(p)), "--policy"),
        (flash.predictor.is_some(), "--predictor"),
        (flash.controller.is_some(), "--controller"),
        (flash.ffn_budget.is_some() && !streams, "--ffn-budget"),
        (flash.mem_budget.is_some(), "--mem-budget"),
        (flash.sparsity != 0.0, "--sparsity"),
    ]
    .into_iter()
    .find(|(set, _)| *set)
    .map(|(_, name)| name);
    match given {
        Some(flag) => bail!(
            "{flag} is an option of the CPU streaming engine; --device cuda runs the dense engine, or a packed \
             model's --policy dense-stream with its --ffn-budget"
        ),
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
        "streamed FFN ({} cache, {}, mirrored in {} of device memory): {} bundles read in place on the device, {} \
         landed from the host's cache, {} read, {} skipped late | {:.1} MiB read in {} reads",
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
/// bundles all resident on the device, or streamed under these settings).
// One per command: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DeviceModel {
    Gguf(Model),
    Flash(FlashModel, Option<StreamSettings>),
}

impl DeviceModel {
    /// Loads `path`, refusing the CPU streaming engine's options.
    pub(crate) fn load(path: &Path, flash: &FlashArgs) -> Result<Self> {
        let packed = is_lsflash(path)?;
        refuse_streaming_options(flash, packed)?;
        if packed {
            let fm = FlashModel::open(path).with_context(|| format!("{}: opening the packed model", path.display()))?;
            let stream = match flash.policy {
                Some(Policy::DenseStream) => Some(flash.settings()?),
                _ => None,
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
    /// to `prompt` rows (at most 512), and the device's description.
    pub(crate) fn open(&self, ordinal: usize, ctx: usize, prompt: usize) -> Result<(GpuModel, String)> {
        let gpu = Gpu::open(ordinal)?;
        let device = format!(
            "{} (compute {}.{})",
            gpu.name, gpu.compute_capability.0, gpu.compute_capability.1
        );
        let batch = prompt.clamp(1, 512);
        let g = match self {
            Self::Gguf(m) => GpuModel::new(gpu, m, ctx, batch)?,
            Self::Flash(fm, None) => GpuModel::from_flash(gpu, fm, ctx, batch)?,
            Self::Flash(fm, Some(settings)) => {
                let streamer = settings.streamer(fm, Policy::DenseStream)?;
                if streamer.holds_whole() {
                    // The cache would hold every bundle: resident on the device instead.
                    GpuModel::from_flash(gpu, fm, ctx, batch)?
                } else {
                    GpuModel::from_flash_streamed(gpu, fm, streamer, ctx, batch)?
                }
            }
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
