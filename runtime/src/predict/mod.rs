//! Activation predictors at run time: given the hidden state `x` entering a
//! layer, score every neuron group of that layer's FFN so the engine can load
//! the likely-active rows first. The predictors are trained elsewhere
//! (`leanstream-synth`), stored in a `.lspred` file and only run here.
//!
//! Two kinds:
//!
//! * **Stacked learnable hashing** ([`HashingLayer`]): `z = proj(x)`, then
//!   for each stage hash `z` with τ hyperplanes into a τ-bit code, pick the
//!   key with the most agreeing bits (XNOR + popcount, first maximum wins),
//!   add that key's LUT row to an integer accumulator and its shift row to
//!   `z`, so the next stage hashes a refined `z`. The score of group `g` is
//!   `lut_scale · Σ_stages lut[j*][g] + bias[g]` (the bias in f32: it spans
//!   the static ranking of all neurons, far wider than the tables' range).
//! * **Low-rank MLP** ([`LowRankLayer`], the DejaVu / LLM-in-a-Flash
//!   baseline): `h = relu(W1 x + b1)`, `score_g = b2_g + w2_scale_g · Σ_k
//!   w2[g][k] h_k`.
//!
//! Both start the same way: `x` is RMS-normalised (no weight) and quantised
//! to i8 at a fixed scale, `q_i = clamp(round(16 · x_i / rms), ±127)` (so
//! values beyond ±7.9 rms are clipped: those are the few massive-activation
//! channels, nearly constant across tokens), and the first projection is an
//! i8 matrix with one f32 scale per row: `y_j = row_scale_j · (Σ_i q_i w_ji)
//! / 16`. The sum is an exact i32, so the SIMD path (which vectorises only
//! integer work: that dot, the popcounts and the i16 LUT sums) is
//! bit-identical to the scalar one. A fixed scale also lets the trainer see
//! exactly the input the runtime sees ([`quantize_input`]).
//!
//! File layout (`.lspred`):
//!
//! ```text
//! offset  field
//! 0       magic  b"LSPRED\0\n"            (8 bytes)
//! 8       version u32 = 1
//! 12      provenance: u32 length + UTF-8 (free-form JSON from the trainer)
//!         kind u8 (0 hashing, 1 low-rank)
//!         d_model u32 (multiple of 32), n_ff u32, group u32 (divides n_ff),
//!         n_layer u32
//!         hashing: d u32, tau u32 (1..=64), keys u32, stages u32 (1..=127)
//!         low-rank: rank u32
//!         uses: u32 count (1..=4), each { u32 length + UTF-8 name }
//!         for each use, for each of n_layer layers (G = n_ff / group):
//!           hashing: proj i8[d × d_model], proj scales f32[d],
//!                    stages × { planes f32[tau × d], offsets f32[tau],
//!                               keys u64[keys] (no bits at or above tau),
//!                               shift f32[keys × d], lut i8[keys × G] },
//!                    bias f32[G], lut_scale f32
//!           low-rank: w1 i8[rank × d_model], w1 scales f32[rank], b1 f32[rank],
//!                     w2 i8[G × rank], w2_scale f32[G], b2 f32[G]
//! end-32  SHA-256 of every byte before it
//! ```
//!
//! All integers and floats are little-endian, matrices row-major. Quantised
//! projection weights lie in [-127, 127] (the AVX2 sign trick cannot take
//! -128), and every float is finite. The reader treats the file as hostile:
//! the checksum is verified first, the whole payload size implied by the
//! dimensions is checked against the bytes present before anything is
//! allocated, and every failure names the file and the field.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod format;
mod infer;
#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;

use std::path::{Path, PathBuf};

use crate::generate::sampler::Rng;

pub use format::{MAGIC, VERSION};
pub use infer::{quantize_input, ComputePath, Scratch};

/// `d_model` must be a multiple of this (the SIMD dot's width).
pub const BLOCK: usize = 32;
/// Input quantisation steps per RMS unit.
pub const INPUT_SCALE: f32 = 16.0;
const MAX_D_MODEL: usize = 1 << 16;
const MAX_N_FF: usize = 1 << 20;
const MAX_LAYERS: usize = 1024;
const MAX_D: usize = 4096;
const MAX_KEYS: usize = 1 << 16;
/// S + 1 LUT rows of at most 128 in magnitude stay inside i16.
const MAX_STAGES: usize = 127;
const MAX_RANK: usize = 1 << 14;
const MAX_USES: usize = 4;
const MAX_STRING: usize = 1 << 20;
const MAX_USE_NAME: usize = 256;

/// Errors of loading, validating or running a predictor.
#[derive(Debug, thiserror::Error)]
pub enum PredictError {
    #[error("{path}: cannot read or write predictor file: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a predictor file (bad magic)")]
    Magic { path: PathBuf },
    #[error("{path}: unsupported predictor file version {found} (this build reads version {expected})")]
    Version { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: checksum mismatch: the file is corrupt")]
    Checksum { path: PathBuf },
    #[error("{path}: truncated predictor file: field `{field}` needs {needed} bytes, {left} left")]
    Truncated {
        path: PathBuf,
        field: &'static str,
        needed: u64,
        left: u64,
    },
    #[error("{path}: invalid field `{field}`: {reason}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
    /// A bad argument of a call (wrong length, index out of range, non-finite input).
    #[error("bad argument `{field}`: {reason}")]
    Argument { field: &'static str, reason: String },
}

/// Which predictor architecture a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PredictorKind {
    Hashing = 0,
    LowRank = 1,
}

impl PredictorKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Hashing),
            1 => Some(Self::LowRank),
            _ => None,
        }
    }
}

/// Shape of a predictor. Hyper-parameters of the other kind are 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PredictorConfig {
    pub kind: PredictorKind,
    pub d_model: usize,
    pub n_ff: usize,
    /// FFN neurons per scored group.
    pub group: usize,
    pub n_layer: usize,
    /// Hashing: width of the projected `z`.
    pub d: usize,
    /// Hashing: bits per code (hyperplanes per stage).
    pub tau: usize,
    /// Hashing: keys per stage.
    pub keys: usize,
    /// Hashing: number of stacked stages.
    pub stages: usize,
    /// Low-rank: width of the hidden layer.
    pub rank: usize,
}

impl PredictorConfig {
    /// A hashing configuration.
    #[allow(clippy::too_many_arguments)]
    pub fn hashing(
        d_model: usize,
        n_ff: usize,
        group: usize,
        n_layer: usize,
        d: usize,
        tau: usize,
        keys: usize,
        stages: usize,
    ) -> Self {
        Self {
            kind: PredictorKind::Hashing,
            d_model,
            n_ff,
            group,
            n_layer,
            d,
            tau,
            keys,
            stages,
            rank: 0,
        }
    }

    /// A low-rank configuration.
    pub fn low_rank(d_model: usize, n_ff: usize, group: usize, n_layer: usize, rank: usize) -> Self {
        Self {
            kind: PredictorKind::LowRank,
            d_model,
            n_ff,
            group,
            n_layer,
            d: 0,
            tau: 0,
            keys: 0,
            stages: 0,
            rank,
        }
    }

    /// Scored groups per layer, `n_ff / group` (0 for an invalid group).
    pub fn n_groups(&self) -> usize {
        self.n_ff.checked_div(self.group).unwrap_or(0)
    }

    /// Mask of the `tau` low bits of a code.
    pub fn tau_mask(&self) -> u64 {
        tau_mask(self.tau)
    }

    /// Bytes of one layer's parameters as stored.
    pub fn layer_bytes(&self) -> u64 {
        let (dm, g) = (self.d_model as u64, self.n_groups() as u64);
        match self.kind {
            PredictorKind::Hashing => {
                let (d, t, k, s) = (self.d as u64, self.tau as u64, self.keys as u64, self.stages as u64);
                let stage = 4 * t * d + 4 * t + 8 * k + 4 * k * d + k * g;
                d * dm + 4 * d + s * stage + 4 * g + 4
            }
            PredictorKind::LowRank => {
                let r = self.rank as u64;
                r * dm + 4 * r + 4 * r + g * r + 4 * g + 4 * g
            }
        }
    }

    /// Checks the limits of the format; `path` names the file in the error.
    pub fn validate(&self, path: &Path) -> Result<(), PredictError> {
        let inv = |field: &'static str, reason: String| PredictError::Invalid {
            path: path.to_path_buf(),
            field,
            reason,
        };
        let range = |field: &'static str, v: usize, lo: usize, hi: usize| {
            if v < lo || v > hi {
                Err(inv(field, format!("{v} (allowed {lo}..={hi})")))
            } else {
                Ok(())
            }
        };
        range("d_model", self.d_model, BLOCK, MAX_D_MODEL)?;
        if !self.d_model.is_multiple_of(BLOCK) {
            return Err(inv(
                "d_model",
                format!("{} is not a multiple of the quantisation block {BLOCK}", self.d_model),
            ));
        }
        range("n_ff", self.n_ff, 1, MAX_N_FF)?;
        range("group", self.group, 1, self.n_ff)?;
        if !self.n_ff.is_multiple_of(self.group) {
            return Err(inv(
                "group",
                format!("{} does not divide n_ff {}", self.group, self.n_ff),
            ));
        }
        range("n_layer", self.n_layer, 1, MAX_LAYERS)?;
        match self.kind {
            PredictorKind::Hashing => {
                range("d", self.d, 1, MAX_D)?;
                range("tau", self.tau, 1, 64)?;
                range("keys", self.keys, 1, MAX_KEYS)?;
                range("stages", self.stages, 1, MAX_STAGES)?;
                range("rank", self.rank, 0, 0)?;
            }
            PredictorKind::LowRank => {
                range("rank", self.rank, 1, MAX_RANK)?;
                for (field, v) in [
                    ("d", self.d),
                    ("tau", self.tau),
                    ("keys", self.keys),
                    ("stages", self.stages),
                ] {
                    range(field, v, 0, 0)?;
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn tau_mask(tau: usize) -> u64 {
    if tau >= 64 {
        u64::MAX
    } else {
        (1u64 << tau) - 1
    }
}

/// An i8 matrix with one f32 scale per row (`rows × cols`, row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantMatrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` weights in [-127, 127].
    pub q: Vec<i8>,
    pub scales: Vec<f32>,
}

impl QuantMatrix {
    /// Quantises an f32 matrix row by row (absmax / 127), as a trainer would.
    pub fn quantize(rows: usize, cols: usize, w: &[f32]) -> Self {
        let mut q = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows);
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = amax / 127.0;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            q.extend(row.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8));
            scales.push(s);
        }
        Self { rows, cols, q, scales }
    }

    fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }
}

/// One stage of a stacked hashing predictor.
#[derive(Clone, Debug, PartialEq)]
pub struct HashStage {
    /// `tau × d` hyperplane normals.
    pub planes: Vec<f32>,
    /// `tau` offsets.
    pub offsets: Vec<f32>,
    /// `keys` codes of `tau` bits.
    pub keys: Vec<u64>,
    /// `keys × d` residual update of `z` per selected key.
    pub shift: Vec<f32>,
    /// `keys × n_groups` score contributions per selected key.
    pub lut: Vec<i8>,
}

/// One layer of a stacked hashing predictor.
#[derive(Clone, Debug, PartialEq)]
pub struct HashingLayer {
    /// `d × d_model` projection of the normalised input.
    pub proj: QuantMatrix,
    pub stages: Vec<HashStage>,
    /// `n_groups` constant contributions (added after scaling).
    pub bias: Vec<f32>,
    pub lut_scale: f32,
}

/// One layer of a low-rank MLP predictor.
#[derive(Clone, Debug, PartialEq)]
pub struct LowRankLayer {
    /// `rank × d_model`.
    pub w1: QuantMatrix,
    /// `rank`.
    pub b1: Vec<f32>,
    /// `n_groups × rank`, row-major.
    pub w2: Vec<i8>,
    /// `n_groups`.
    pub w2_scale: Vec<f32>,
    /// `n_groups`.
    pub b2: Vec<f32>,
}

/// The parameters of one layer for one use.
#[derive(Clone, Debug, PartialEq)]
pub enum PredictorLayer {
    Hashing(HashingLayer),
    LowRank(LowRankLayer),
}

impl PredictorLayer {
    /// Bytes of the parameters as stored.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Hashing(l) => {
                l.proj.bytes()
                    + l.stages
                        .iter()
                        .map(|s| {
                            4 * s.planes.len()
                                + 4 * s.offsets.len()
                                + 8 * s.keys.len()
                                + 4 * s.shift.len()
                                + s.lut.len()
                        })
                        .sum::<usize>()
                    + 4 * l.bias.len()
                    + 4
            }
            Self::LowRank(l) => l.w1.bytes() + 4 * l.b1.len() + l.w2.len() + 4 * l.w2_scale.len() + 4 * l.b2.len(),
        }
    }
}

/// A set of predictors of one configuration: one per use (e.g. `speculate`
/// for the layer ahead, `refine` for the current one) and layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Predictor {
    pub config: PredictorConfig,
    /// Free-form JSON from the trainer (model, trace hashes, settings, recall).
    pub provenance: String,
    pub uses: Vec<String>,
    /// `layers[use][layer]`.
    pub layers: Vec<Vec<PredictorLayer>>,
}

impl Predictor {
    /// Index of the use called `name`.
    pub fn use_index(&self, name: &str) -> Option<usize> {
        self.uses.iter().position(|u| u == name)
    }

    /// Scored groups per layer.
    pub fn n_groups(&self) -> usize {
        self.config.n_groups()
    }

    /// Bytes of all parameters as stored (i8 = 1, f32 = 4, u64 = 8).
    pub fn weight_bytes(&self) -> usize {
        self.layers.iter().flatten().map(PredictorLayer::weight_bytes).sum()
    }

    /// Checks every limit and shape the format requires; `path` names the
    /// file in the error.
    pub fn validate(&self, path: &Path) -> Result<(), PredictError> {
        let c = &self.config;
        c.validate(path)?;
        let inv = |field: &'static str, reason: String| PredictError::Invalid {
            path: path.to_path_buf(),
            field,
            reason,
        };
        if self.provenance.len() > MAX_STRING {
            return Err(inv(
                "provenance",
                format!("{} bytes (at most {MAX_STRING})", self.provenance.len()),
            ));
        }
        if self.uses.is_empty() || self.uses.len() > MAX_USES {
            return Err(inv(
                "uses",
                format!("{} uses (1..={MAX_USES} allowed)", self.uses.len()),
            ));
        }
        for (i, u) in self.uses.iter().enumerate() {
            if u.is_empty() || u.len() > MAX_USE_NAME {
                return Err(inv(
                    "use.name",
                    format!("use {i}: name of {} bytes (1..={MAX_USE_NAME})", u.len()),
                ));
            }
            if self.uses[..i].contains(u) {
                return Err(inv("use.name", format!("use `{u}` appears twice")));
            }
        }
        if self.layers.len() != self.uses.len() {
            return Err(inv(
                "layers",
                format!("{} layer sets for {} uses", self.layers.len(), self.uses.len()),
            ));
        }
        for (u, set) in self.layers.iter().enumerate() {
            if set.len() != c.n_layer {
                return Err(inv(
                    "layers",
                    format!("use {u}: {} layers, n_layer is {}", set.len(), c.n_layer),
                ));
            }
            for (l, layer) in set.iter().enumerate() {
                validate_layer(c, layer, true)
                    .map_err(|(field, why)| inv(field, format!("use {u} layer {l}: {why}")))?;
            }
        }
        Ok(())
    }

    /// A randomly initialised predictor of `config` (deterministic from
    /// `seed`), for measuring size and latency at a model's shape.
    pub fn random(config: PredictorConfig, uses: &[&str], seed: u64) -> Result<Self, PredictError> {
        let path = Path::new("<random>");
        config.validate(path)?;
        let mut rng = Rng::new(seed);
        let c = config;
        let g = c.n_groups();
        let mut sym = |n: usize, amp: f32| -> Vec<f32> { (0..n).map(|_| (rng.next_f32() * 2.0 - 1.0) * amp).collect() };
        let mut layers = Vec::with_capacity(uses.len());
        for _ in uses {
            let mut set = Vec::with_capacity(c.n_layer);
            for _ in 0..c.n_layer {
                let layer = match c.kind {
                    PredictorKind::Hashing => {
                        let proj = QuantMatrix::quantize(c.d, c.d_model, &sym(c.d * c.d_model, 1.0));
                        let stages = (0..c.stages)
                            .map(|_| {
                                // Random codes: the float draws' mantissa bits, spread by a multiply.
                                let keys = sym(c.keys, 1.0)
                                    .iter()
                                    .map(|v| {
                                        (v.to_bits() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 7 & c.tau_mask()
                                    })
                                    .collect();
                                HashStage {
                                    planes: sym(c.tau * c.d, 1.0),
                                    offsets: sym(c.tau, 0.1),
                                    keys,
                                    shift: sym(c.keys * c.d, 0.5),
                                    lut: to_i8(&sym(c.keys * g, 127.0)),
                                }
                            })
                            .collect();
                        PredictorLayer::Hashing(HashingLayer {
                            proj,
                            stages,
                            bias: sym(g, 1.0),
                            lut_scale: 1.0 / 127.0,
                        })
                    }
                    PredictorKind::LowRank => PredictorLayer::LowRank(LowRankLayer {
                        w1: QuantMatrix::quantize(c.rank, c.d_model, &sym(c.rank * c.d_model, 1.0)),
                        b1: sym(c.rank, 0.1),
                        w2: to_i8(&sym(g * c.rank, 127.0)),
                        w2_scale: sym(g, 0.01).iter().map(|v| v.abs()).collect(),
                        b2: sym(g, 0.1),
                    }),
                };
                set.push(layer);
            }
            layers.push(set);
        }
        let p = Self {
            config,
            provenance: format!("{{\"random_seed\":{seed}}}"),
            uses: uses.iter().map(|s| s.to_string()).collect(),
            layers,
        };
        p.validate(path)?;
        Ok(p)
    }
}

fn to_i8(v: &[f32]) -> Vec<i8> {
    v.iter().map(|x| x.round().clamp(-127.0, 127.0) as i8).collect()
}

type LayerFault = (&'static str, String);

fn check_len(field: &'static str, len: usize, want: usize) -> Result<(), LayerFault> {
    if len != want {
        Err((field, format!("{len} values, expected {want}")))
    } else {
        Ok(())
    }
}

fn check_quant(field: &'static str, m: &QuantMatrix, rows: usize, cols: usize, values: bool) -> Result<(), LayerFault> {
    if m.rows != rows || m.cols != cols {
        return Err((field, format!("{}×{} matrix, expected {rows}×{cols}", m.rows, m.cols)));
    }
    check_len(field, m.q.len(), rows * cols)?;
    check_len(field, m.scales.len(), rows)?;
    if values {
        if m.q.contains(&i8::MIN) {
            return Err((field, "weight -128 (must lie in [-127, 127])".into()));
        }
        check_finite(field, &m.scales)?;
    }
    Ok(())
}

fn check_finite(field: &'static str, v: &[f32]) -> Result<(), LayerFault> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err((field, format!("non-finite value at {i}"))),
        None => Ok(()),
    }
}

/// Checks a layer against `c`. With `values` false only the lengths the
/// kernels index by are checked (cheap enough for every call, and what keeps
/// the unsafe SIMD loads in bounds for hand-built predictors).
pub(crate) fn validate_layer(c: &PredictorConfig, layer: &PredictorLayer, values: bool) -> Result<(), LayerFault> {
    let g = c.n_groups();
    match (c.kind, layer) {
        (PredictorKind::Hashing, PredictorLayer::Hashing(l)) => {
            check_quant("proj", &l.proj, c.d, c.d_model, values)?;
            check_len("stages", l.stages.len(), c.stages)?;
            let mask = c.tau_mask();
            for (s, st) in l.stages.iter().enumerate() {
                let at = |(f, why): LayerFault| (f, format!("stage {s}: {why}"));
                check_len("planes", st.planes.len(), c.tau * c.d).map_err(at)?;
                check_len("offsets", st.offsets.len(), c.tau).map_err(at)?;
                check_len("keys", st.keys.len(), c.keys).map_err(at)?;
                check_len("shift", st.shift.len(), c.keys * c.d).map_err(at)?;
                check_len("lut", st.lut.len(), c.keys * g).map_err(at)?;
                if values {
                    check_finite("planes", &st.planes).map_err(at)?;
                    check_finite("offsets", &st.offsets).map_err(at)?;
                    check_finite("shift", &st.shift).map_err(at)?;
                    if let Some((j, k)) = st.keys.iter().enumerate().find(|(_, &k)| k & !mask != 0) {
                        return Err(at((
                            "keys",
                            format!("key {j} = {k:#x} has bits at or above tau {}", c.tau),
                        )));
                    }
                }
            }
            check_len("bias", l.bias.len(), g)?;
            if values {
                check_finite("bias", &l.bias)?;
            }
            if values && !l.lut_scale.is_finite() {
                return Err(("lut_scale", format!("non-finite value {}", l.lut_scale)));
            }
        }
        (PredictorKind::LowRank, PredictorLayer::LowRank(l)) => {
            check_quant("w1", &l.w1, c.rank, c.d_model, values)?;
            check_len("b1", l.b1.len(), c.rank)?;
            check_len("w2", l.w2.len(), g * c.rank)?;
            check_len("w2_scale", l.w2_scale.len(), g)?;
            check_len("b2", l.b2.len(), g)?;
            if values {
                check_finite("b1", &l.b1)?;
                check_finite("w2_scale", &l.w2_scale)?;
                check_finite("b2", &l.b2)?;
            }
        }
        _ => return Err(("kind", "layer kind differs from the configuration's".into())),
    }
    Ok(())
}

/// The `k` highest-scoring groups, best first (ties by lower index; NaN
/// sorts by `f32::total_cmp`). Reuses `idx_scratch`: no allocation once it
/// has capacity for `scores.len()` entries.
///
/// ```
/// use leanstream_runtime::predict::top_groups;
/// let mut idx = Vec::with_capacity(5);
/// let top = top_groups(&[0.5, 2.0, -1.0, 2.0, 1.0], 3, &mut idx);
/// assert_eq!(top, &[1, 3, 4]);
/// ```
pub fn top_groups<'a>(scores: &[f32], k: usize, idx_scratch: &'a mut Vec<u32>) -> &'a [u32] {
    idx_scratch.clear();
    idx_scratch.extend(0..scores.len() as u32);
    let k = k.min(scores.len());
    if k == 0 {
        return &idx_scratch[..0];
    }
    let cmp = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
    if k < idx_scratch.len() {
        idx_scratch.select_nth_unstable_by(k - 1, cmp);
    }
    let top = &mut idx_scratch[..k];
    top.sort_unstable_by(cmp);
    top
}
