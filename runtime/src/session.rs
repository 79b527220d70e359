//! A model opened for running: a GGUF model (the dense engine), or a
//! `.lsflash` model with its FFN engine sized to a memory budget. The CLI,
//! the benchmarks, the tests and a server open models through this one type.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::{fmt_bytes, FfnBudget, RetentionTable};
use crate::engine::{
    is_lsflash, ActiveTrace, CachePolicy, EngineOptions, FlashEngine, FlashModel, Policy, DEFAULT_MERGE_GAP,
};
use crate::model::{DenseFfn, FlashAttn, LayerHook, Model, RunState};
use crate::{Result, RuntimeError};

/// How a `.lsflash` model streams its FFN; the defaults suit a first run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamSettings {
    /// Default: `speculate` where a predictor is named or sits beside the
    /// model (a tuned directory's artifacts), else `dense`.
    pub policy: Option<Policy>,
    /// The neuron cache's budget (default 25% of the FFN); exclusive with `mem_budget`.
    pub ffn_budget: Option<FfnBudget>,
    /// Bytes for the whole process: the cache gets what the resident parts leave.
    pub mem_budget: Option<u64>,
    /// A calibrated sparsity level (0: none).
    pub sparsity: f32,
    /// Default: the prior systems' own (see [`eviction`](Self::eviction)),
    /// else `hot`.
    pub cache_policy: Option<CachePolicy>,
    /// The learned cache policy's retention table (default: the one beside the model).
    pub eviction: Option<PathBuf>,
    /// Default [`DEFAULT_MERGE_GAP`].
    pub merge_gap: Option<usize>,
    /// Bytes of I/O staging (default: about four layers, 2 to 16 MiB).
    pub staging: Option<u64>,
    /// `speculate`'s predictor (default: the one beside the model).
    pub predictor: Option<PathBuf>,
    /// `speculate`'s controller: a table file or `fixed:K=..,b=..,d=..,q=..`
    /// (default: the table beside the model, else the built-in one).
    pub controller: Option<String>,
    /// The attention path, for any model (llama.cpp's `--flash-attn`).
    pub flash_attn: FlashAttn,
    /// The prior systems' predicted set, as a multiple of the level's need
    /// (default [`Speculation::PRIOR_BREADTH`](crate::engine::Speculation::PRIOR_BREADTH)).
    pub prior_breadth: Option<f32>,
}

impl StreamSettings {
    /// Whether any streaming setting differs from its default (they apply
    /// to `.lsflash` models only).
    pub fn is_set(&self) -> bool {
        *self
            != Self {
                flash_attn: self.flash_attn,
                ..Self::default()
            }
    }

    /// The policy set, else `dense` (see [`policy_for`](Self::policy_for)).
    pub fn policy(&self) -> Policy {
        self.policy.unwrap_or(Policy::Dense)
    }

    /// The policy to run the `.lsflash` model at `model` with: the one set;
    /// else `speculate` where its artifacts are at hand (a predictor named,
    /// or one beside the model, as a tune leaves it), else `dense`.
    pub fn policy_for(&self, model: &Path) -> Policy {
        self.policy.unwrap_or_else(|| {
            if self.predictor.is_some() || crate::artifacts::predictor_beside(model).is_some() {
                Policy::Speculate
            } else {
                Policy::Dense
            }
        })
    }

    /// Bytes of the neuron cache for `policy` on `fm` with run state `st`
    /// (and, for the oracle, a trace of `trace_bytes`): the FFN budget, or
    /// what the memory budget leaves after everything else (an error naming
    /// each part when nothing is left).
    pub fn cache_bytes(&self, fm: &FlashModel, policy: Policy, st: &RunState, trace_bytes: u64) -> Result<u64> {
        let Some(total) = self.mem_budget else {
            return Ok(fm.cache_budget_bytes(self.ffn_budget()));
        };
        let weights = fm.flash.resident_range().1 + fm.model.tokenizer.heap_bytes();
        let state = st.bytes() as u64;
        let staging = self.staging_bytes(fm, policy, st, trace_bytes);
        let engine = fm.engine_overhead_bytes(policy, st.max_batch, staging) + trace_bytes;
        let fixed = weights + state + engine;
        if fixed > total {
            return Err(RuntimeError::Invalid(format!(
                "memory budget (--mem-budget) {}: the resident parts alone need {} (weights and tokenizer {}, run state {}, \
                 {policy} buffers {}); nothing would be left for the neuron cache: raise --mem-budget, or lower \
                 --ctx (the run state keeps keys and values for {} positions)",
                fmt_bytes(total),
                fmt_bytes(fixed),
                fmt_bytes(weights),
                fmt_bytes(state),
                fmt_bytes(engine),
                st.ctx
            )));
        }
        Ok(total - fixed)
    }

    /// The I/O staging to stream with: the one set; else the default, where
    /// the memory budget has room for it; else what the budget leaves of it
    /// (the engine keeps at least two reads), so a tight budget streams with
    /// fewer reads ahead rather than not at all. `None`: the default.
    pub fn staging_bytes(&self, fm: &FlashModel, policy: Policy, st: &RunState, trace_bytes: u64) -> Option<u64> {
        let (None, Some(total)) = (self.staging, self.mem_budget) else {
            return self.staging;
        };
        let resident = fm.flash.resident_range().1 + fm.model.tokenizer.heap_bytes() + st.bytes() as u64 + trace_bytes;
        let default = fm.engine_overhead_bytes(policy, st.max_batch, None);
        let excess = (resident + default).checked_sub(total).filter(|&e| e > 0)?;
        let least = fm.engine_overhead_bytes(policy, st.max_batch, Some(0));
        // The default pool less what the budget lacks (0: the engine's least).
        Some((default - least).saturating_sub(excess))
    }

    /// What a `policy` engine over `fm` needs of the speculation artifacts
    /// (`None` unless `speculate`).
    pub fn speculation(&self, fm: &FlashModel, policy: Policy) -> Result<Option<crate::engine::Speculation>> {
        if !policy.predicts() {
            return Ok(None);
        }
        let (p, c) = (self.predictor.as_deref(), self.controller.as_deref());
        let mut sp = crate::artifacts::speculation(fm, fm.flash.path(), policy, p, c)?;
        if let (Some(b), true) = (self.prior_breadth, policy.is_prior_system()) {
            sp.prior_breadth = positive_breadth(b)?;
        }
        Ok(Some(sp))
    }

    /// `prior_breadth` checked against the policy a model is run with: only
    /// the prior systems take one. (Engines made beside it, such as a
    /// quality run's dense reference, ignore it.)
    pub fn check_prior_breadth(&self, policy: Policy) -> Result<()> {
        let Some(b) = self.prior_breadth else {
            return Ok(());
        };
        if !policy.is_prior_system() {
            return Err(RuntimeError::Invalid(format!(
                "--prior-breadth sizes the predicted set of dejavu, llm-in-a-flash and powerinfer2, not {policy} \
                 (speculate's breadth is its controller's)"
            )));
        }
        positive_breadth(b).map(|_| ())
    }

    /// The engine for `fm` under these settings with `policy`; `record`
    /// keeps the kept sets for an oracle replay.
    pub fn engine(
        &self,
        fm: &FlashModel,
        policy: Policy,
        st: &RunState,
        trace: Option<ActiveTrace>,
        record: bool,
    ) -> Result<FlashEngine> {
        let speculation = self.speculation(fm, policy)?;
        let (cache_policy, retention) = self.eviction(fm, policy)?;
        // The predictor's weights and the retention table are memory like the cache's.
        let predictor_bytes = speculation.as_ref().map_or(0, |s| s.predictor.weight_bytes() as u64);
        let retention_bytes = retention.as_ref().map_or(0, |t| t.bytes());
        let trace_bytes = trace.as_ref().map_or(0, |t| t.bytes()) + predictor_bytes + retention_bytes;
        fm.engine_with(EngineOptions {
            policy,
            cache_bytes: self.cache_bytes(fm, policy, st, trace_bytes)?,
            cache_policy,
            merge_gap_bytes: self.merge_gap.unwrap_or(DEFAULT_MERGE_GAP),
            staging_bytes: self.staging_bytes(fm, policy, st, trace_bytes),
            level: fm.sparsity_level(self.sparsity)?,
            record,
            trace,
            speculation,
            retention: retention.map(Arc::new),
        })
    }

    /// The neuron cache's budget as a share or size of the FFN (default 25%).
    fn ffn_budget(&self) -> FfnBudget {
        self.ffn_budget.unwrap_or(FfnBudget::Percent(25.0))
    }

    /// The engine of `policy` over `fm` under these settings, for a device
    /// that computes the FFN itself (the GPU backend; see
    /// [`FlashEngine::plan_device_call`]): the cache by the FFN budget
    /// (default 25%), its policy, the artifacts, sparsity and I/O settings
    /// as the CPU engine takes them, less what [`refuse_on_device`](Self::refuse_on_device) refuses.
    pub fn device_engine(&self, fm: &FlashModel, policy: Policy) -> Result<FlashEngine> {
        self.refuse_on_device(policy)?;
        self.check_prior_breadth(policy)?;
        let (cache_policy, retention) = self.eviction(fm, policy)?;
        fm.engine_with(EngineOptions {
            policy,
            cache_bytes: fm.cache_budget_bytes(self.ffn_budget()),
            cache_policy,
            merge_gap_bytes: self.merge_gap.unwrap_or(DEFAULT_MERGE_GAP),
            staging_bytes: self.staging,
            level: fm.sparsity_level(self.sparsity)?,
            record: false,
            trace: None,
            speculation: self.speculation(fm, policy)?,
            retention: retention.map(Arc::new),
        })
    }

    /// What a packed model running `policy` on a device (resident or
    /// streamed) does not take: a memory budget (it counts the CPU engine's
    /// own buffers) and the oracle (it replays a CPU run).
    pub fn refuse_on_device(&self, policy: Policy) -> Result<()> {
        if self.mem_budget.is_some() {
            return Err(RuntimeError::Invalid(
                "--mem-budget counts the CPU engine's memory; on a device give the neuron cache's --ffn-budget".into(),
            ));
        }
        if policy == Policy::Oracle {
            return Err(RuntimeError::Invalid(
                "--policy oracle replays the CPU engine's recorded run; it does not run on a device".into(),
            ));
        }
        Ok(())
    }

    /// The cache policy of a `policy` engine over `fm` and, for `learned`,
    /// its retention table (the one named, else the one beside the model).
    /// The prior systems' policies default to their own: a sliding window
    /// for `llm-in-a-flash`, the hot set for `powerinfer2`, LRU for `dejavu`;
    /// the others to the hot set (by calibrated score, or each layer's
    /// leading bundles in a file without scores; LRU keeps nothing under the
    /// dense scan of `dense-stream`). (`learned` is not the default: on a
    /// hot-first file its scattered hits sit inside merged reads and save
    /// fewer bytes than the hot prefix.)
    pub fn eviction(&self, fm: &FlashModel, policy: Policy) -> Result<(CachePolicy, Option<RetentionTable>)> {
        let policy = match (self.cache_policy, &self.eviction) {
            (Some(c), Some(table)) if c != CachePolicy::Learned => {
                return Err(RuntimeError::Invalid(format!(
                    "--eviction {}: a retention table is for --cache-policy learned, not {c}",
                    table.display()
                )))
            }
            (Some(c), _) => c,
            // Naming a table asks for the policy that reads it.
            (None, Some(_)) => CachePolicy::Learned,
            (None, None) => match policy {
                Policy::LlmInAFlash => CachePolicy::Window(5),
                Policy::DejaVu => CachePolicy::Lru,
                _ => CachePolicy::Hot,
            },
        };
        if policy != CachePolicy::Learned {
            return Ok((policy, None));
        }
        let path = self
            .eviction
            .clone()
            .or_else(|| crate::artifacts::retention_beside(fm.flash.path()));
        let path = path.ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "{}: the learned cache policy needs a retention table: pass --eviction FILE or put {} beside the \
                 model (leanstream-synth eviction makes one)",
                fm.flash.path().display(),
                fm.flash.path().with_extension("lsevict").display()
            ))
        })?;
        Ok((policy, Some(crate::artifacts::load_retention(&path, fm)?)))
    }
}

/// `b` if it is a breadth: a positive multiple of the neurons the level keeps.
fn positive_breadth(b: f32) -> Result<f32> {
    if b.is_finite() && b > 0.0 {
        Ok(b)
    } else {
        Err(RuntimeError::Invalid(format!(
            "--prior-breadth {b}: a positive multiple of the neurons the level keeps"
        )))
    }
}

/// A GGUF model, or a `.lsflash` model with its FFN engine.
pub enum Session {
    Gguf(Box<Model>, DenseFfn),
    /// The engine is `None` only while an oracle's replaces its recorder.
    Flash(Box<FlashModel>, Option<Box<FlashEngine>>),
}

impl Session {
    /// Opens the model at `path`, its run state from `state`, and (for a
    /// `.lsflash` model) the FFN engine sized for that state. An oracle
    /// engine starts without a trace: see [`Session::record_oracle`].
    pub fn open(
        path: &Path,
        settings: &StreamSettings,
        state: impl FnOnce(&Model) -> Result<RunState>,
    ) -> Result<(Self, RunState)> {
        if !path.exists() {
            return Err(RuntimeError::Invalid(format!(
                "{}: no such model file (known model names: smollm2, gemma3)",
                path.display()
            )));
        }
        if is_lsflash(path) {
            let mut fm = FlashModel::open(path)?;
            fm.model.flash_attn = settings.flash_attn;
            let st = state(&fm.model)?;
            settings.check_prior_breadth(settings.policy_for(path))?;
            // The oracle's engine is made once its trace is recorded; until
            // then a dense-stream engine of the same budget stands in.
            let policy = match settings.policy_for(path) {
                Policy::Oracle => Policy::DenseStream,
                p => p,
            };
            let engine = settings.engine(&fm, policy, &st, None, settings.policy() == Policy::Oracle)?;
            return Ok((Self::Flash(Box::new(fm), Some(Box::new(engine))), st));
        }
        if settings.is_set() {
            return Err(RuntimeError::Invalid(format!(
                "--policy, --ffn-budget, --mem-budget, --sparsity, --cache-policy, --eviction, --merge-gap, \
                 --predictor, --controller and --prior-breadth apply to .lsflash models; {} is not one",
                path.display()
            )));
        }
        let mut m = Model::load(path)?;
        m.flash_attn = settings.flash_attn;
        let st = state(&m)?;
        Ok((Self::Gguf(Box::new(m), DenseFfn), st))
    }

    /// For the oracle policy: runs `job` once with the recording engine,
    /// then swaps in the oracle engine replaying what it recorded. `job`
    /// must do exactly what the measured run will do. Other policies: nothing.
    pub fn record_oracle<E: From<RuntimeError>>(
        &mut self,
        settings: &StreamSettings,
        st: &mut RunState,
        job: impl FnOnce(&mut Self, &mut RunState) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if settings.policy() != Policy::Oracle || !matches!(self, Self::Flash(..)) {
            return Ok(());
        }
        job(self, st)?;
        let Self::Flash(fm, engine) = self else {
            unreachable!("checked above")
        };
        let trace = engine
            .take()
            .and_then(|mut e| e.take_trace())
            .ok_or_else(|| RuntimeError::Invalid("the recording engine kept no trace".into()))?;
        // The recorder (and its cache) is gone before the oracle's is allocated.
        *engine = Some(Box::new(settings.engine(fm, Policy::Oracle, st, Some(trace), false)?));
        Ok(())
    }

    /// The flash model and its engine, for reports.
    pub fn flash(&self) -> Option<(&FlashModel, &FlashEngine)> {
        match self {
            Self::Flash(fm, Some(e)) => Some((fm, e)),
            _ => None,
        }
    }

    pub fn model(&self) -> &Model {
        match self {
            Self::Gguf(m, _) => m,
            Self::Flash(fm, _) => &fm.model,
        }
    }

    /// The model and the hook its forward passes take (the flash engine, or
    /// the dense path).
    pub fn parts(&mut self) -> Result<(&Model, &mut dyn LayerHook)> {
        match self {
            Self::Gguf(m, dense) => Ok((m, dense)),
            Self::Flash(fm, Some(e)) => Ok((&fm.model, &mut **e)),
            Self::Flash(..) => Err(RuntimeError::Invalid("the flash engine is being replaced".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tune's output runs `speculate` without flags; a bare file `dense`;
    /// a policy set is kept.
    #[test]
    fn the_default_policy_follows_the_artifacts_beside_the_model() {
        let dir = std::env::temp_dir().join(format!("leanstream-policy-default-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model.lsflash");
        let settings = StreamSettings::default();
        assert_eq!(settings.policy_for(&model), Policy::Dense);
        let named = StreamSettings {
            predictor: Some(dir.join("elsewhere.lspred")),
            ..StreamSettings::default()
        };
        assert_eq!(named.policy_for(&model), Policy::Speculate);
        std::fs::write(dir.join("predictor.lspred"), b"").unwrap();
        assert_eq!(settings.policy_for(&model), Policy::Speculate);
        let set = StreamSettings {
            policy: Some(Policy::DenseStream),
            ..StreamSettings::default()
        };
        assert_eq!(set.policy_for(&model), Policy::DenseStream);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
