//! A model as the device engine opens it: a GGUF's matrices, or a packed
//! `.lsflash` model's bundles, resident in device memory (`dense`, or a
//! cache that would hold them all) or streamed from flash under one of the
//! CPU engine's policies ([`crate::streamed`]). The CLI's `run` and `bench`
//! and the server's `--device cuda` open their models through it.

use std::path::Path;

use leanstream_runtime::engine::{is_lsflash, FlashModel, Policy};
use leanstream_runtime::model::Model;
use leanstream_runtime::session::StreamSettings;

use crate::device::Gpu;
use crate::engine::GpuModel;
use crate::{CudaError, Result};

// One per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum DeviceModel {
    Gguf(Model),
    /// With the policy and settings it streams under (`None`: resident).
    Flash(FlashModel, Option<(Policy, StreamSettings)>),
}

impl DeviceModel {
    /// Loads `path`: a packed model runs under `settings`' policy (the
    /// CPU's default: `speculate` where its artifacts are at hand, else
    /// `dense`), less what a device does not take
    /// ([`StreamSettings::refuse_on_device`]); a GGUF takes no streaming
    /// settings.
    pub fn load(path: &Path, settings: &StreamSettings) -> Result<Self> {
        if !is_lsflash(path) {
            if settings.is_set() {
                return Err(CudaError::Invalid(format!(
                    "{}: streaming settings (policy, budgets, sparsity, artifacts) apply to packed .lsflash models",
                    path.display()
                )));
            }
            return Ok(Self::Gguf(Model::load(path)?));
        }
        let policy = settings.policy_for(path);
        settings.refuse_on_device(policy)?;
        let fm = FlashModel::open(path)?;
        let stream = match policy {
            Policy::Dense => None,
            policy => Some((policy, settings.clone())),
        };
        Ok(Self::Flash(fm, stream))
    }

    pub fn model(&self) -> &Model {
        match self {
            Self::Gguf(m) => m,
            Self::Flash(fm, _) => &fm.model,
        }
    }

    /// Bytes of weights a token reads: the matrices, and a packed model's bundles.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Gguf(m) => m.weights.matrix_bytes(),
            Self::Flash(fm, _) => fm.model.weights.matrix_bytes() + fm.ffn_bytes() as usize,
        }
    }

    /// The device engine on device `ordinal` with a context of `ctx` and
    /// prompt batches of up to `prompt` rows (at most 512), and the
    /// device's description. A streaming policy's engine (its artifacts,
    /// thresholds, cache) is made before the device is opened, so what is
    /// wrong with it is said first.
    pub fn open(&self, ordinal: usize, ctx: usize, prompt: usize) -> Result<(GpuModel, String)> {
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
