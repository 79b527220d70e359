//! Policies: what a layer's FFN keeps and what is read for it (and for the
//! layers after it). Each is a type in its own file behind [`FfnPolicy`];
//! the engine then runs the shared tail ([`super::tail`]: wait, gather,
//! compute, finish) on the [`Plan`] the policy returns, so a new policy is a
//! new file, not a new branch in the engine.

mod current_layer;
mod dejavu;
mod dense;
mod dense_stream;
mod gate_first;
mod oracle;
mod ranking;
mod speculate;

pub(crate) use current_layer::CurrentLayer;
pub(crate) use dejavu::DejaVu;
pub(crate) use dense::Dense;
pub(crate) use dense_stream::DenseStream;
pub(crate) use gate_first::GateFirst;
pub(crate) use oracle::Oracle;
pub(crate) use ranking::Ranking;
pub(crate) use speculate::Speculate;

pub(crate) use super::plan::Plan;
use super::plan::Select;
use super::source::Source;
use super::tail::Tail;
use crate::Result;

/// How the FFN bundles reach compute (the name a user picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Every bundle read once at open into memory (the reference).
    Dense,
    /// Every bundle each token through the I/O engine, layer l+1 read while l computes.
    DenseStream,
    /// The true active sets, known in advance from a recorded run, read a layer ahead.
    Oracle,
    /// Gate rows resident; after attention `|act(g)|` decides what to read.
    GateFirst,
    /// Speculate-and-refine: a predictor ranks each layer's neurons ahead of
    /// time and again as better inputs arrive; a controller sets stages,
    /// breadth, deadline and queue depth per layer.
    Speculate,
    /// DejaVu: layer l+1 predicted from layer l's residual, read while l
    /// computes, waited for in full.
    DejaVu,
    /// LLM in a Flash: each layer predicted from its input and read; a
    /// sliding-window cache.
    LlmInAFlash,
    /// PowerInfer-2: a static hot set in memory, the predictor for the cold
    /// neurons of each layer, compute overlapped with their reads.
    PowerInfer2,
}

impl Policy {
    pub const ALL: [Policy; 8] = [
        Self::Dense,
        Self::DenseStream,
        Self::Oracle,
        Self::GateFirst,
        Self::Speculate,
        Self::DejaVu,
        Self::LlmInAFlash,
        Self::PowerInfer2,
    ];

    /// Whether bundles come from flash while the model runs.
    pub fn streams(self) -> bool {
        self != Self::Dense
    }

    /// Whether it reads what a predictor (`.lspred`) selects.
    pub fn predicts(self) -> bool {
        matches!(
            self,
            Self::Speculate | Self::DejaVu | Self::LlmInAFlash | Self::PowerInfer2
        )
    }

    /// Whether this is one of the prior systems' policies.
    pub fn is_prior_system(self) -> bool {
        matches!(self, Self::DejaVu | Self::LlmInAFlash | Self::PowerInfer2)
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "dense" => Ok(Self::Dense),
            "dense-stream" => Ok(Self::DenseStream),
            "oracle" => Ok(Self::Oracle),
            "gate-first" => Ok(Self::GateFirst),
            "speculate" => Ok(Self::Speculate),
            "dejavu" => Ok(Self::DejaVu),
            "llm-in-a-flash" => Ok(Self::LlmInAFlash),
            "powerinfer2" => Ok(Self::PowerInfer2),
            other => Err(format!(
                "unknown policy '{other}' (expected dense, dense-stream, oracle, gate-first, speculate, dejavu, \
                 llm-in-a-flash or powerinfer2)"
            )),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dense => "dense",
            Self::DenseStream => "dense-stream",
            Self::Oracle => "oracle",
            Self::GateFirst => "gate-first",
            Self::Speculate => "speculate",
            Self::DejaVu => "dejavu",
            Self::LlmInAFlash => "llm-in-a-flash",
            Self::PowerInfer2 => "powerinfer2",
        })
    }
}

/// The model shape the policy needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    /// The FFN output passes a norm before the residual (Gemma 3): a
    /// partial output then says little about the next input.
    pub post_ffn_norm: bool,
}

/// One FFN call as a policy sees it.
pub(crate) struct LayerCall<'a> {
    pub layer: usize,
    pub n_layer: usize,
    /// The `n` normed FFN input rows, `[n][n_embd]`.
    pub xb: &'a [f32],
    /// The residual after the layer's attention, `[n][n_embd]` (what a
    /// look-ahead predictor for the next layer reads).
    pub resid: &'a [f32],
    pub n: usize,
    /// The layer's thresholds on `|act(g)·u|` and on `|act(g)|` (0: keep all).
    pub threshold: f32,
    pub gate_threshold: f32,
}

impl LayerCall<'_> {
    /// The layer `d` after this one in run order (the next token's layers
    /// follow the last).
    pub fn layer_ahead(&self, d: usize) -> usize {
        (self.layer + d) % self.n_layer
    }
}

impl<'p> Plan<'p> {
    /// Keep what `select` says of `want`, waiting for every read, in one stage.
    pub fn new(select: Select<'p>, want: Option<&'p [u64]>) -> Self {
        Self {
            select,
            want,
            deadline: None,
            stages: None,
        }
    }
}

pub(crate) trait FfnPolicy: Send {
    fn kind(&self) -> Policy;

    /// Before the tail runs layer `call.layer`: decide what it keeps, ask
    /// `source` for those bundles, and queue reads for what comes next.
    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, tail: &Tail) -> Result<Plan<'p>>;

    /// Before layer `layer`'s attention: its input rows `x`, `[n][n_embd]`
    /// (the earliest moment they are known).
    fn layer_input(&mut self, _layer: usize, _x: &[f32], _n: usize, _source: &mut Source) -> Result<()> {
        Ok(())
    }

    /// After the tail ran layer `layer` (its cost is `tail.last`).
    fn finished(&mut self, _layer: usize, _tail: &Tail) {}

    /// Counters of the policy's decisions, for reports (`None`: it makes none).
    fn decisions(&self) -> Option<crate::engine::controller::Decisions> {
        None
    }

    /// Bytes the policy knows beyond the cache (resident gate rows, a trace).
    fn held_bytes(&self) -> u64 {
        0
    }

    /// Bytes of per-call scratch.
    fn scratch_bytes(&self) -> u64 {
        0
    }

    /// FFN calls replayed so far (an oracle).
    fn replayed_calls(&self) -> Option<usize> {
        None
    }

    /// The predictor it reads (for reports).
    fn predictor_name(&self) -> Option<&str> {
        None
    }
}

/// The streamer of a streaming policy's source.
pub(crate) fn streamer(source: &mut Source) -> Result<&mut super::Streamer> {
    match source {
        Source::Stream(s) => Ok(s),
        Source::Resident(_) => Err(crate::RuntimeError::Invalid(
            "a streaming policy was given resident bundles".into(),
        )),
    }
}
