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

use anyhow::{bail, Result};
use leanstream_cuda::engine::GpuModel;
use leanstream_cuda::model::DeviceModel;
use leanstream_runtime::fetch::resolve_model;
use leanstream_runtime::generate::decode_until;
use leanstream_runtime::tokenizer::StreamDecoder;
use leanstream_runtime::RuntimeError;

use crate::{prompt_ids, FlashArgs, Generation};

/// `cpu` is `None`; `cuda` and `cuda:N` name a device ordinal.
pub(crate) fn ordinal(device: &str) -> Result<Option<usize>> {
    let device: leanstream_kernels::Device = device.parse().map_err(|e| anyhow::anyhow!("--device {e}"))?;
    Ok(device.cuda_ordinal())
}

/// Refuses the streaming options, which a GGUF model does not take.
fn refuse_streaming_options(flash: &FlashArgs) -> Result<()> {
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
    let loaded = load(&path, flash)?;
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
         device, {} landed from the host's cache, {} read, {} skipped late, {} cancelled | {:.1} MiB read in {} reads",
        s.engine().policy(),
        s.streamer().cache_policy_name(),
        leanstream_runtime::cache::fmt_bytes(s.streamer().budget_bytes()),
        leanstream_runtime::cache::fmt_bytes(s.device_cache_bytes()),
        fed.in_place,
        fed.hits,
        fed.read,
        fed.missing,
        fed.cancelled,
        io.bytes_read as f64 / (1 << 20) as f64,
        io.reads
    ))
}

/// Loads `path` for the device engine, refusing the options it does not run.
pub(crate) fn load(path: &Path, flash: &FlashArgs) -> Result<DeviceModel> {
    crate::model_exists(path)?;
    check_device_options(path, flash)?;
    Ok(DeviceModel::load(path, &flash.settings()?)?)
}

/// Refuses what the device engine does not run (`run`, `bench`, `serve`):
/// a GGUF's streaming options. What a packed model's policy cannot run on
/// a device is refused where its engine is made
/// (`StreamSettings::device_engine`).
pub(crate) fn check_device_options(path: &Path, flash: &FlashArgs) -> Result<()> {
    if leanstream_runtime::engine::is_lsflash(path) {
        return Ok(());
    }
    refuse_streaming_options(flash)
}
