//! A tune's folder: the steps of the pipeline and where each one's output
//! lies, named once for the steps, the verification and the report.

/// The pipeline, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Training and held-out prose, split when no held-out text is named.
    Text,
    /// Activation traces of the model on both splits.
    Activations,
    /// Flash order of each layer's neurons from co-activation.
    Placement,
    /// Calibrated sparsity thresholds, then the `.lsflash` file in that order.
    Pack,
    /// Read latency at the request sizes the packed layout implies.
    ProfileIo,
    /// The packed model's own FFN kernels.
    ProfileCompute,
    /// Both profiles' conditions, sampled where the table's decisions are
    /// sensitive (`--profiling adaptive`, in place of the two above).
    ProfileAdaptive,
    /// The hashing predictor and the low-rank baseline.
    Predictor,
    /// `speculate` in the real engine at each queue depth of the codebook:
    /// the read latencies and compute speed the control model is fitted to.
    EngineProbe,
    /// The stochastic-MPC lookup table for this model on this device.
    Controller,
    /// The learned cache's retention table.
    Eviction,
    /// The tuned model against the untuned default in the real engine.
    Verify,
    /// `report.md` with its plots.
    Report,
}

/// Paths relative to the output directory.
pub const TRAIN_TEXT: &str = "work/text/train.txt";
pub const HELDOUT_TEXT: &str = "work/text/heldout.txt";
pub const ACTS: &str = "work/acts";
pub const PLACEMENT: &str = "work/placement.json";
pub const MODEL: &str = "model.lsflash";
pub const TRACES: &str = "work/traces";
pub const IO_TRACES: &str = "work/traces/io";
pub const COMPUTE_TRACES: &str = "work/traces/compute";
/// Apart from `TRACES`, so a directory tuned both ways never fits a table
/// on a mix of the two profiles.
pub const ADAPTIVE_TRACES: &str = "work/adaptive-traces";
pub const IO_SCRATCH: &str = "work/io-scratch";
pub const CONTROLLER: &str = "controller.lstab";
pub const PREDICTOR: &str = "predictor.lspred";
pub const LOW_RANK: &str = "predictor.lowrank.lspred";
pub const EVICTION: &str = "eviction.lsevict";
pub const VERIFY: &str = "work/verify.json";
pub const ENGINE_RUNS: &str = "work/engine";
pub const REPORT: &str = "report.md";
pub const PLOTS: &str = "plots";
