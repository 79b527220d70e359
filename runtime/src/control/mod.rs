//! The streaming controller at run time: a precomputed lookup table
//! (`.lstab`, written by `leanstream-synth controller`) that maps the engine's
//! measured state to an action in well under a microsecond.
//!
//! The control model itself (what the state axes and actions mean, how the
//! table was solved) is documented in the `leanstream-synth` crate. This
//! module only knows the file format and the lookup:
//!
//! ```text
//! offset  field
//! 0       magic  b"LSTAB\0\r\n"            (8 bytes)
//! 8       version u32 = 1
//! 12      device fingerprint: u32 length + UTF-8
//!         seed u64
//!         solver settings: u32 length + UTF-8 (JSON)
//!         traces: u32 count, each { u32 length + UTF-8 name, 32-byte SHA-256 }
//!         axes: u32 count (1..=8), each {
//!             u8 kind (0 queued bytes, 1 missing bytes, 2 read bandwidth B/s,
//!                      3 compute ns per neuron, 4 layer position in [0,1]),
//!             u32 bins (1..=64), (bins-1) f64 thresholds (strictly increasing),
//!             bins f64 representative values }
//!         codebook: u32 count (1..=255), each { u8 stages K, u16 queue depth,
//!             f32 prefetch breadth, f32 deadline factor }
//!         states: u64 count (= product of the axes' bins), one u8 code per state
//!             (row-major, first axis slowest)
//! end-32  SHA-256 of every byte before it
//! ```
//!
//! All integers and floats are little-endian. The reader treats the file as
//! hostile: the checksum is verified first, every length is checked against
//! the bytes left before anything is allocated, and every failure names the
//! file and the field.

use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::binread;

/// File magic of a controller table.
pub const MAGIC: [u8; 8] = *b"LSTAB\0\r\n";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
const MAX_AXES: usize = 8;
const MAX_BINS: usize = 64;
const MAX_ACTIONS: usize = 255;
const MAX_STRING: usize = 1 << 20;
const MAX_TRACES: usize = 1 << 16;

/// Errors of loading or decoding a controller table.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{path}: cannot read controller table: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a controller table (bad magic)")]
    Magic { path: PathBuf },
    #[error("{path}: unsupported controller table version {found} (this build reads version {expected})")]
    Version { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: checksum mismatch: the file is corrupt")]
    Checksum { path: PathBuf },
    #[error("{path}: truncated controller table: field `{field}` needs {needed} bytes, {left} left")]
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
}

/// What a grid axis measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AxisKind {
    /// Bytes already queued (in flight or submitted) for the coming layer.
    QueuedBytes = 0,
    /// Bytes the predictor says are still missing for the next layers.
    MissingBytes = 1,
    /// Recently measured read bandwidth, bytes/s.
    ReadBandwidth = 2,
    /// Recently measured compute time per neuron, ns.
    ComputeNsPerNeuron = 3,
    /// Position in the layer stack, layer / n_layers in [0, 1].
    LayerPosition = 4,
}

impl AxisKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::QueuedBytes,
            1 => Self::MissingBytes,
            2 => Self::ReadBandwidth,
            3 => Self::ComputeNsPerNeuron,
            4 => Self::LayerPosition,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::QueuedBytes => "queued_bytes",
            Self::MissingBytes => "missing_bytes",
            Self::ReadBandwidth => "read_bw_bytes_s",
            Self::ComputeNsPerNeuron => "compute_ns_per_neuron",
            Self::LayerPosition => "layer_position",
        }
    }
}

/// One discretized state axis: a value `v` falls in bin `i` where `i` is the
/// number of thresholds `<= v`.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub kind: AxisKind,
    /// `bins - 1` strictly increasing bin boundaries.
    pub thresholds: Vec<f64>,
    /// One representative value per bin (what synthesis solved for).
    pub centers: Vec<f64>,
}

impl Axis {
    pub fn bins(&self) -> usize {
        self.centers.len()
    }
    /// The bin of `v` (NaN goes to bin 0). No allocation.
    #[inline]
    pub fn bin(&self, v: f64) -> usize {
        let mut i = 0;
        for &t in &self.thresholds {
            if v >= t {
                i += 1;
            } else {
                break;
            }
        }
        i
    }
}

/// One entry of the action codebook.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Action {
    /// Number of refinement stages K of the layer's FFN.
    pub stages: u8,
    /// Reads kept in flight by the I/O engine.
    pub queue_depth: u16,
    /// Speculative prefetch breadth: how far down the predicted priority list
    /// to load before refinement, as a multiple of the predicted-missing bytes.
    pub prefetch_breadth: f32,
    /// Wait deadline before unloaded neurons are skipped, as a multiple of the
    /// layer's expected compute time.
    pub deadline_factor: f32,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "K={} qd={} prefetch={:.2} deadline={:.2}",
            self.stages, self.queue_depth, self.prefetch_breadth, self.deadline_factor
        )
    }
}

/// A trace the table was synthesized from.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceHash {
    pub name: String,
    pub sha256: [u8; 32],
}

/// Where a table came from.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Provenance {
    pub device_fingerprint: String,
    pub seed: u64,
    /// JSON of the solver settings.
    pub solver_settings: String,
    pub traces: Vec<TraceHash>,
}

/// The model a table was solved for, as its solver settings record it
/// (`model.*` of the JSON; every field absent in tables that predate it).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TableModel {
    /// SHA-256 (lowercase hex) of the GGUF the packed model came from.
    pub sha256: Option<String>,
    pub n_layers: Option<usize>,
    pub n_ff: Option<usize>,
    pub bundle_bytes: Option<f64>,
}

impl Provenance {
    /// What [`solver_settings`](Self::solver_settings) says of the model;
    /// settings that are not JSON name nothing.
    pub fn model(&self) -> TableModel {
        let v: serde_json::Value = serde_json::from_str(&self.solver_settings).unwrap_or_default();
        let m = &v["model"];
        TableModel {
            sha256: binread::model_sha256(&v),
            n_layers: m["n_layers"].as_u64().map(|x| x as usize),
            n_ff: m["n_ff"].as_u64().map(|x| x as usize),
            bundle_bytes: m["bundle_bytes"].as_f64(),
        }
    }
}

/// The engine's measured state, in the units of the axes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ControlState {
    /// Bytes of the layer's bundles already landed by the previous layer's
    /// speculative prefetch (the axis keeps its file name, `queued_bytes`).
    pub queued_bytes: f64,
    pub missing_bytes: f64,
    pub read_bw_bytes_s: f64,
    pub compute_ns_per_neuron: f64,
    pub layer_position: f64,
}

impl ControlState {
    #[inline]
    pub fn get(&self, kind: AxisKind) -> f64 {
        match kind {
            AxisKind::QueuedBytes => self.queued_bytes,
            AxisKind::MissingBytes => self.missing_bytes,
            AxisKind::ReadBandwidth => self.read_bw_bytes_s,
            AxisKind::ComputeNsPerNeuron => self.compute_ns_per_neuron,
            AxisKind::LayerPosition => self.layer_position,
        }
    }
}

/// A decoded, validated controller table.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlTable {
    pub provenance: Provenance,
    pub axes: Vec<Axis>,
    pub codebook: Vec<Action>,
    /// One codebook index per grid state, row-major (first axis slowest).
    pub codes: Vec<u8>,
}

/// A table loaded from a file, with the warning to show if it was made for a
/// different device.
#[derive(Debug)]
pub struct Loaded {
    pub table: ControlTable,
    pub fingerprint_warning: Option<String>,
}

/// The grid state of row-major index `idx` (the inverse of
/// [`ControlTable::state_index`]), each axis at its bin's center.
pub fn state_at(axes: &[Axis], mut idx: usize) -> ControlState {
    let mut s = ControlState::default();
    for a in axes.iter().rev() {
        let b = idx % a.bins();
        idx /= a.bins();
        let v = a.centers[b];
        match a.kind {
            AxisKind::QueuedBytes => s.queued_bytes = v,
            AxisKind::MissingBytes => s.missing_bytes = v,
            AxisKind::ReadBandwidth => s.read_bw_bytes_s = v,
            AxisKind::ComputeNsPerNeuron => s.compute_ns_per_neuron = v,
            AxisKind::LayerPosition => s.layer_position = v,
        }
    }
    s
}

impl ControlTable {
    /// Number of grid states (product of the axes' bins).
    pub fn n_states(&self) -> usize {
        self.axes.iter().map(Axis::bins).product()
    }

    /// Row-major index of the grid cell containing `s`. No allocation.
    #[inline]
    pub fn state_index(&self, s: &ControlState) -> usize {
        let mut idx = 0usize;
        for a in &self.axes {
            idx = idx * a.bins() + a.bin(s.get(a.kind));
        }
        idx
    }

    /// The action for the measured state `s`. No allocation, no system call.
    #[inline]
    pub fn lookup(&self, s: &ControlState) -> &Action {
        &self.codebook[self.codes[self.state_index(s)] as usize]
    }

    /// Encodes the table (with its checksum) as the bytes of a `.lstab` file.
    /// Panics only on a table that violates the format's limits (a bug of the caller);
    /// use [`ControlTable::validate`] first for untrusted tables.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(256 + self.codes.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        put_str(&mut b, &self.provenance.device_fingerprint);
        b.extend_from_slice(&self.provenance.seed.to_le_bytes());
        put_str(&mut b, &self.provenance.solver_settings);
        b.extend_from_slice(&(self.provenance.traces.len() as u32).to_le_bytes());
        for t in &self.provenance.traces {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&t.sha256);
        }
        b.extend_from_slice(&(self.axes.len() as u32).to_le_bytes());
        for a in &self.axes {
            b.push(a.kind as u8);
            b.extend_from_slice(&(a.bins() as u32).to_le_bytes());
            for t in &a.thresholds {
                b.extend_from_slice(&t.to_le_bytes());
            }
            for c in &a.centers {
                b.extend_from_slice(&c.to_le_bytes());
            }
        }
        b.extend_from_slice(&(self.codebook.len() as u32).to_le_bytes());
        for a in &self.codebook {
            b.push(a.stages);
            b.extend_from_slice(&a.queue_depth.to_le_bytes());
            b.extend_from_slice(&a.prefetch_breadth.to_le_bytes());
            b.extend_from_slice(&a.deadline_factor.to_le_bytes());
        }
        b.extend_from_slice(&(self.codes.len() as u64).to_le_bytes());
        b.extend_from_slice(&self.codes);
        let sum = Sha256::digest(&b);
        b.extend_from_slice(&sum);
        b
    }

    /// Checks the limits and invariants the format requires; `path` names the
    /// file in the error.
    pub fn validate(&self, path: &Path) -> Result<(), ControlError> {
        let inv = |field: &'static str, reason: String| ControlError::Invalid {
            path: path.to_path_buf(),
            field,
            reason,
        };
        if self.axes.is_empty() || self.axes.len() > MAX_AXES {
            return Err(inv(
                "axes",
                format!("{} axes (1..={MAX_AXES} allowed)", self.axes.len()),
            ));
        }
        for a in &self.axes {
            if a.bins() == 0 || a.bins() > MAX_BINS {
                return Err(inv("axis.bins", format!("{} bins (1..={MAX_BINS})", a.bins())));
            }
            if a.thresholds.len() + 1 != a.bins() {
                return Err(inv("axis.thresholds", "must be one fewer than the bins".into()));
            }
            if a.thresholds.iter().chain(&a.centers).any(|v| !v.is_finite()) {
                return Err(inv("axis", format!("{}: non-finite value", a.kind.name())));
            }
            if a.thresholds.windows(2).any(|w| w[0] >= w[1]) {
                return Err(inv(
                    "axis.thresholds",
                    format!("{}: not strictly increasing", a.kind.name()),
                ));
            }
        }
        if self.codebook.is_empty() || self.codebook.len() > MAX_ACTIONS {
            return Err(inv(
                "codebook",
                format!("{} actions (1..={MAX_ACTIONS})", self.codebook.len()),
            ));
        }
        for a in &self.codebook {
            if a.stages == 0 || a.queue_depth == 0 {
                return Err(inv("codebook", format!("action `{a}`: zero stages or queue depth")));
            }
            let ok = a.prefetch_breadth.is_finite()
                && a.prefetch_breadth >= 0.0
                && a.deadline_factor.is_finite()
                && a.deadline_factor > 0.0;
            if !ok {
                return Err(inv("codebook", format!("action `{a}`: bad breadth or deadline")));
            }
        }
        if self.codes.len() != self.n_states() {
            return Err(inv(
                "states",
                format!("{} codes for a grid of {} states", self.codes.len(), self.n_states()),
            ));
        }
        if let Some((i, c)) = self
            .codes
            .iter()
            .enumerate()
            .find(|(_, &c)| c as usize >= self.codebook.len())
        {
            return Err(inv(
                "states",
                format!("state {i} has action code {c}, codebook has {}", self.codebook.len()),
            ));
        }
        Ok(())
    }

    /// Decodes and validates the bytes of a `.lstab` file; `path` names it in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, ControlError> {
        let mut r: Reader = binread::checked_body(bytes, path, &MAGIC, VERSION)?;
        let device_fingerprint = r.string("device_fingerprint", MAX_STRING)?;
        let seed = r.u64("seed")?;
        let solver_settings = r.string("solver_settings", MAX_STRING)?;
        let n_traces = r.count("traces", MAX_TRACES, 4 + 32)?;
        let mut traces = Vec::with_capacity(n_traces);
        for _ in 0..n_traces {
            let name = r.string("trace.name", MAX_STRING)?;
            let mut sha256 = [0u8; 32];
            sha256.copy_from_slice(r.take(32, "trace.sha256")?);
            traces.push(TraceHash { name, sha256 });
        }
        let n_axes = r.count("axes", MAX_AXES, 5)?;
        let mut axes = Vec::with_capacity(n_axes);
        for _ in 0..n_axes {
            let k = r.u8("axis.kind")?;
            let kind = AxisKind::from_u8(k).ok_or_else(|| r.invalid("axis.kind", format!("unknown axis kind {k}")))?;
            let bins = r.u32("axis.bins")? as usize;
            if bins == 0 || bins > MAX_BINS {
                return Err(r.invalid("axis.bins", format!("{bins} bins (1..={MAX_BINS})")));
            }
            r.need((2 * bins - 1) as u64 * 8, "axis.values")?;
            let thresholds = (0..bins - 1)
                .map(|_| r.f64("axis.thresholds"))
                .collect::<Result<Vec<_>, _>>()?;
            let centers = (0..bins)
                .map(|_| r.f64("axis.centers"))
                .collect::<Result<Vec<_>, _>>()?;
            axes.push(Axis {
                kind,
                thresholds,
                centers,
            });
        }
        let n_actions = r.count("codebook", MAX_ACTIONS, 11)?;
        let mut codebook = Vec::with_capacity(n_actions);
        for _ in 0..n_actions {
            let stages = r.u8("action.stages")?;
            let queue_depth = u16::from_le_bytes(r.take(2, "action.queue_depth")?.try_into().unwrap());
            let prefetch_breadth = f32::from_le_bytes(r.take(4, "action.prefetch_breadth")?.try_into().unwrap());
            let deadline_factor = f32::from_le_bytes(r.take(4, "action.deadline_factor")?.try_into().unwrap());
            codebook.push(Action {
                stages,
                queue_depth,
                prefetch_breadth,
                deadline_factor,
            });
        }
        let n_states = r.u64("states")?;
        let left = r.left() as u64;
        if n_states != left {
            return Err(r.invalid(
                "states",
                format!("{n_states} states declared, {left} bytes of codes present"),
            ));
        }
        let codes = r.take(n_states as usize, "states")?.to_vec();
        let t = ControlTable {
            provenance: Provenance {
                device_fingerprint,
                seed,
                solver_settings,
                traces,
            },
            axes,
            codebook,
            codes,
        };
        t.validate(path)?;
        Ok(t)
    }

    /// Reads and decodes `path`; a fingerprint different from `local_fingerprint`
    /// is reported in [`Loaded::fingerprint_warning`] (the table still loads).
    pub fn load_for(path: &Path, local_fingerprint: &str) -> Result<Loaded, ControlError> {
        let bytes = std::fs::read(path).map_err(|source| ControlError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let table = Self::from_bytes(&bytes, path)?;
        let fingerprint_warning = (table.provenance.device_fingerprint != local_fingerprint).then(|| {
            format!(
                "warning: {}: controller table was synthesized for device `{}`, this device is `{}`; \
                 its actions may be far from optimal here (profile this device and run `leanstream-synth controller`)",
                path.display(),
                table.provenance.device_fingerprint,
                local_fingerprint
            )
        });
        Ok(Loaded {
            table,
            fingerprint_warning,
        })
    }

    /// [`ControlTable::load_for`] against this machine's [`device_fingerprint`],
    /// printing the warning (if any) on stderr.
    pub fn load(path: &Path) -> Result<Self, ControlError> {
        let l = Self::load_for(path, &device_fingerprint())?;
        if let Some(w) = &l.fingerprint_warning {
            eprintln!("{w}");
        }
        Ok(l.table)
    }

    /// Validates, then writes the table whole or not at all ([`crate::durable`]).
    pub fn save(&self, path: &Path) -> Result<(), ControlError> {
        self.validate(path)?;
        crate::durable::write(path, &self.to_bytes()).map_err(|source| ControlError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A coarse identity of this device's class: CPU model, logical CPUs and
/// memory rounded to GiB, e.g. `x86_64/AMD EPYC/2cpu/24GiB`. The same string
/// is derived from a profiler run's `device.json` by [`fingerprint_from_parts`].
pub fn device_fingerprint() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == "model name").then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                let rest = l.strip_prefix("MemTotal:")?;
                rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
            })
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0);
    fingerprint_from_parts(std::env::consts::ARCH, &model, cpus, mem)
}

/// The fingerprint string of a device with these properties.
pub fn fingerprint_from_parts(arch: &str, cpu_model: &str, logical_cpus: usize, mem_total_bytes: u64) -> String {
    let gib = (mem_total_bytes as f64 / (1u64 << 30) as f64).round() as u64;
    format!("{arch}/{}/{logical_cpus}cpu/{gib}GiB", cpu_model.trim())
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

type Reader<'a> = binread::Reader<'a, ControlError>;

crate::impl_field_error!(ControlError);
