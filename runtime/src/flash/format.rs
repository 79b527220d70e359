//! The packed `.lsflash` file: a model's FFN weights regrouped into neuron
//! bundles for streaming from flash, plus everything else the model needs
//! (kept "resident") as an embedded GGUF image.
//!
//! # Layout (version 3, all integers little-endian)
//!
//! ```text
//! offset 0      preamble, 64 bytes
//!               0  magic            b"LSFLASH\0"
//!               8  version          u32 (= 3; 2 is read too)
//!              12  flags            u32 (= 0; readers reject other values)
//!              16  meta_len         u64   length of the meta block
//!              24  meta_sha256      [u8; 32]  SHA-256 of the meta block
//!              56  reserved         u64 (= 0)
//! offset 64     meta block (header + index), meta_len bytes:
//!               source_sha256 [32]   SHA-256 of the whole source GGUF
//!               source_len    u64    its length in bytes
//!               arch_len u32, arch   general.architecture (UTF-8, ≤ 64 bytes)
//!               n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab: u32 each
//!               down_type     u32    GGML type id of the down columns (Q8_0 = 8 or F16 = 1),
//!                                    or 0xFFFF_FFFF: down tiles in the source's type
//!               resident_offset u64, resident_len u64, resident_sha256 [32]
//!               bundle_offset u64, bundle_len u64   the bundle region
//!               placement     n_layer × n_ff × u32  per layer, the neuron stored at
//!                                                    each position (a permutation)
//!               layer table   n_layer × 72 bytes:
//!                 gate_type u32, up_type u32      GGML ids, as in the source GGUF
//!                 gate_bytes u32, up_bytes u32, down_bytes u32,
//!                 down_type u32   the layer's down type (version 2: reserved, 0)
//!                 offset u64, len u64             the layer's bundles
//!                 sha256 [32]                     of those len bytes
//! resident_offset (4096-aligned)
//!               a complete GGUF v3 image: all metadata of the source (except
//!               general.alignment) and every tensor except
//!               blk.{l}.ffn_gate / ffn_up / ffn_down.weight
//! bundle_offset (4096-aligned)
//!               per layer, starting at its own 4096-aligned offset (zero
//!               padding between layers): n_ff bundles back to back in
//!               placement order. A bundle is
//!                 gate row i  (gate_bytes, the source's raw bytes)
//!                 up row i    (up_bytes, the source's raw bytes)
//!                 down part   (down_bytes), either
//!                   column i of ffn_down (the n_embd weights neuron i feeds,
//!                   converted to Q8_0 or F16), or
//!                   part i % G of the tile of group i / G: the source's own
//!                   down blocks of neurons G·(i/G).. (G = its block size),
//!                   one per row, cut in G parts (leanstream_kernels::
//!                   sparse_ffn::tiles); a group is read whole and computed
//!                   as the source computes it
//! ```
//!
//! The bundle index is implicit: all bundles of a layer have the same size
//! `gate_bytes + up_bytes + down_bytes`, so neuron `i` of layer `l` sits at
//! `layer.offset + pos(l, i) * bundle_bytes`, where `pos` inverts the
//! placement. Storing per-neuron offsets would only add bytes that could
//! disagree with each other.
//!
//! # Trust
//!
//! [`LsFlash::open`] treats the file as hostile: the magic, version and flags
//! are checked, `meta_len` against the file size before anything is
//! allocated, the meta block's SHA-256 before it is parsed, and every count,
//! type, offset and length in it against the file and each other. The bundle
//! region and the resident image are large, so their checksums are verified
//! only by the explicit [`LsFlash::verify`].

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use leanstream_kernels::sparse_ffn::{tiles, BundleFormat, DownLayout};
use leanstream_kernels::GgmlType;
use sha2::{Digest, Sha256};

use crate::gguf::GgufFile;
use crate::model::Config;
pub use crate::sparsity::SparsityLevel;
use crate::{Result, RuntimeError};

pub const MAGIC: &[u8; 8] = b"LSFLASH\0";
/// 2 added the sparsity thresholds after the layer table; 3 the down tiles
/// and the per-layer down type.
pub const VERSION: u32 = 3;
/// The oldest version this build reads (its files have down columns only).
pub const MIN_VERSION: u32 = 2;
/// `down_type` of a file whose down matrices are kept as tiles in the source types.
const DOWN_SOURCE_ID: u32 = u32::MAX;
/// Size of the fixed preamble; the meta block follows it.
pub const PREAMBLE_LEN: usize = 64;
/// Alignment of the resident image, the bundle region and each layer's first bundle.
pub const ALIGN: u64 = 4096;
/// Bytes of one layer table entry.
pub const LAYER_ENTRY_LEN: usize = 72;
const MAX_ARCH_LEN: usize = 64;
/// Most sparsity levels one file carries.
pub const MAX_SPARSITY_LEVELS: usize = 64;
const MAX_DIM: u32 = 1 << 20;
const MAX_VOCAB: u32 = 1 << 24;

/// Rounds `x` up to a multiple of [`ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// How the down matrices are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DownType {
    /// Per-neuron columns in Q8_0: any subset of neurons can be read, but
    /// the arithmetic is not the source model's.
    #[default]
    Q8_0,
    /// Per-neuron columns in F16.
    F16,
    /// Tiles in the source's own type: exact (the source's tokens and
    /// logits at sparsity 0) and the fewest bytes, read a group of neurons
    /// (a quantization block, 32 or 256) at a time.
    Source,
}

impl DownType {
    /// The column type; `None` for tiles (their type is each layer's source type).
    pub fn column_type(self) -> Option<GgmlType> {
        match self {
            Self::Q8_0 => Some(GgmlType::Q8_0),
            Self::F16 => Some(GgmlType::F16),
            Self::Source => None,
        }
    }

    pub fn layout(self) -> DownLayout {
        match self {
            Self::Source => DownLayout::Tiles,
            _ => DownLayout::Columns,
        }
    }

    fn id(self) -> u32 {
        self.column_type().map_or(DOWN_SOURCE_ID, GgmlType::id)
    }

    fn from_id(id: u32) -> Option<Self> {
        if id == DOWN_SOURCE_ID {
            return Some(Self::Source);
        }
        match GgmlType::from_id(id).ok()? {
            GgmlType::Q8_0 => Some(Self::Q8_0),
            GgmlType::F16 => Some(Self::F16),
            _ => None,
        }
    }
}

impl std::str::FromStr for DownType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Ok(Self::Q8_0),
            "f16" => Ok(Self::F16),
            "source" => Ok(Self::Source),
            other => Err(format!("unknown down type '{other}' (expected source, q8_0 or f16)")),
        }
    }
}

impl std::fmt::Display for DownType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Q8_0 => "q8_0",
            Self::F16 => "f16",
            Self::Source => "source",
        })
    }
}

/// Byte sizes of the three parts of one layer's bundles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundleLayout {
    pub gate_type: GgmlType,
    pub up_type: GgmlType,
    pub down_type: GgmlType,
    pub down_layout: DownLayout,
    pub gate_bytes: usize,
    pub up_bytes: usize,
    pub down_bytes: usize,
}

impl BundleLayout {
    /// The kernels' view of this bundle for a model of width `n_embd`.
    pub fn format(&self, n_embd: usize) -> Result<BundleFormat> {
        Ok(BundleFormat::new(
            self.gate_type,
            self.up_type,
            self.down_type,
            self.down_layout,
            n_embd,
        )?)
    }

    /// Bytes of a whole bundle.
    pub fn bundle_bytes(&self) -> usize {
        self.gate_bytes + self.up_bytes + self.down_bytes
    }

    /// Splits one bundle into (gate row, up row, down column); `None` when
    /// `bundle` is not exactly one bundle long.
    pub fn split<'a>(&self, bundle: &'a [u8]) -> Option<(&'a [u8], &'a [u8], &'a [u8])> {
        if bundle.len() != self.bundle_bytes() {
            return None;
        }
        let (gate, rest) = bundle.split_at(self.gate_bytes);
        let (up, down) = rest.split_at(self.up_bytes);
        Some((gate, up, down))
    }
}

/// One layer's entry in the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerEntry {
    pub layout: BundleLayout,
    /// Absolute offset of the layer's first bundle (4096-aligned).
    pub offset: u64,
    /// Bytes of the layer's bundles: `n_ff * bundle_bytes`.
    pub len: u64,
    pub sha256: [u8; 32],
}

/// Everything in the preamble and meta block, decoded and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub source_sha256: [u8; 32],
    pub source_len: u64,
    pub arch: String,
    pub n_layer: u32,
    pub n_embd: u32,
    pub n_ff: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub n_vocab: u32,
    pub down_type: DownType,
    pub resident_offset: u64,
    pub resident_len: u64,
    pub resident_sha256: [u8; 32],
    pub bundle_offset: u64,
    pub bundle_len: u64,
    /// `placement[l][p]`: the neuron stored at position `p` of layer `l`.
    pub placement: Vec<Vec<u32>>,
    pub layers: Vec<LayerEntry>,
    /// Calibrated thresholds, by ascending sparsity (may be empty).
    pub sparsity: Vec<SparsityLevel>,
    /// Per layer, each neuron's calibrated mean |activation| (ranks the
    /// static hot set of the neuron cache); empty when not calibrated.
    pub neuron_scores: Vec<Vec<f32>>,
}

impl Header {
    /// Length of the meta block for a model of this shape with `n_levels`
    /// sparsity levels, without the neuron scores (`+ n_layer * n_ff * 4` with them).
    pub fn meta_len(arch_len: usize, n_layer: usize, n_ff: usize, n_levels: usize) -> usize {
        32 + 8
            + 4
            + arch_len
            + 7 * 4
            + 4
            + 8
            + 8
            + 32
            + 8
            + 8
            + n_layer * n_ff * 4
            + n_layer * LAYER_ENTRY_LEN
            + 4
            + n_levels * (4 + 2 * n_layer * 4)
            + 4
    }

    /// Length of this header's meta block.
    pub fn encoded_len(&self) -> usize {
        let scores = if self.neuron_scores.is_empty() {
            0
        } else {
            self.layers.len() * self.n_ff as usize * 4
        };
        Self::meta_len(
            self.arch.len(),
            self.layers.len(),
            self.n_ff as usize,
            self.sparsity.len(),
        ) + scores
    }

    /// The level calibrated for `sparsity` (0 needs none).
    pub fn level(&self, sparsity: f32) -> Option<SparsityLevel> {
        if sparsity == 0.0 {
            return Some(SparsityLevel::dense(self.layers.len()));
        }
        self.sparsity.iter().find(|l| l.is(sparsity)).cloned()
    }

    /// The meta block's bytes.
    pub fn encode_meta(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        b.extend_from_slice(&self.source_sha256);
        b.extend_from_slice(&self.source_len.to_le_bytes());
        b.extend_from_slice(&(self.arch.len() as u32).to_le_bytes());
        b.extend_from_slice(self.arch.as_bytes());
        for d in [
            self.n_layer,
            self.n_embd,
            self.n_ff,
            self.n_head,
            self.n_head_kv,
            self.head_dim,
            self.n_vocab,
            self.down_type.id(),
        ] {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&self.resident_offset.to_le_bytes());
        b.extend_from_slice(&self.resident_len.to_le_bytes());
        b.extend_from_slice(&self.resident_sha256);
        b.extend_from_slice(&self.bundle_offset.to_le_bytes());
        b.extend_from_slice(&self.bundle_len.to_le_bytes());
        for order in &self.placement {
            for &n in order {
                b.extend_from_slice(&n.to_le_bytes());
            }
        }
        for l in &self.layers {
            let lay = &l.layout;
            for v in [
                lay.gate_type.id(),
                lay.up_type.id(),
                lay.gate_bytes as u32,
                lay.up_bytes as u32,
                lay.down_bytes as u32,
                lay.down_type.id(),
            ] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            b.extend_from_slice(&l.offset.to_le_bytes());
            b.extend_from_slice(&l.len.to_le_bytes());
            b.extend_from_slice(&l.sha256);
        }
        b.extend_from_slice(&(self.sparsity.len() as u32).to_le_bytes());
        for level in &self.sparsity {
            b.extend_from_slice(&level.sparsity.to_le_bytes());
            for &t in level.full.iter().chain(&level.gate) {
                b.extend_from_slice(&t.to_le_bytes());
            }
        }
        b.extend_from_slice(&u32::from(!self.neuron_scores.is_empty()).to_le_bytes());
        for &v in self.neuron_scores.iter().flatten() {
            b.extend_from_slice(&v.to_le_bytes());
        }
        debug_assert_eq!(b.len(), self.encoded_len());
        b
    }

    /// The 64-byte preamble for a given meta block.
    pub fn encode_preamble(meta: &[u8]) -> [u8; PREAMBLE_LEN] {
        let mut p = [0u8; PREAMBLE_LEN];
        p[..8].copy_from_slice(MAGIC);
        p[8..12].copy_from_slice(&VERSION.to_le_bytes());
        p[16..24].copy_from_slice(&(meta.len() as u64).to_le_bytes());
        p[24..56].copy_from_slice(&Sha256::digest(meta));
        p
    }
}

/// Checks that `order` is a permutation of `0..n`; the error says why not.
pub fn check_permutation(order: &[u32], n: usize) -> std::result::Result<(), String> {
    if order.len() != n {
        return Err(format!("has {} entries, expected {n}", order.len()));
    }
    let mut seen = vec![false; n];
    for (p, &i) in order.iter().enumerate() {
        match seen.get_mut(i as usize) {
            None => return Err(format!("position {p}: neuron {i} is out of range (n_ff = {n})")),
            Some(s) if *s => return Err(format!("position {p}: neuron {i} appears twice")),
            Some(s) => *s = true,
        }
    }
    Ok(())
}

fn corrupt(path: &Path, problem: impl Into<String>) -> RuntimeError {
    RuntimeError::Corrupt {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Bounds-checked reader over the meta block.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.bytes.len() - self.pos {
            return Err(corrupt(
                self.path,
                format!(
                    "meta block truncated while reading '{what}' (at byte {})",
                    PREAMBLE_LEN + self.pos
                ),
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn f32(&mut self, what: &str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn sha(&mut self, what: &str) -> Result<[u8; 32]> {
        Ok(self.take(32, what)?.try_into().expect("32 bytes"))
    }
}

/// Decodes and validates a meta block against the file's length.
fn decode_meta(path: &Path, meta: &[u8], file_len: u64, version: u32) -> Result<Header> {
    let bad = |field: &str, problem: String| corrupt(path, format!("header field '{field}': {problem}"));
    let mut c = Cursor {
        path,
        bytes: meta,
        pos: 0,
    };
    let source_sha256 = c.sha("source_sha256")?;
    let source_len = c.u64("source_len")?;
    let arch_len = c.u32("arch_len")? as usize;
    if arch_len == 0 || arch_len > MAX_ARCH_LEN {
        return Err(bad(
            "arch_len",
            format!("{arch_len} is out of range 1..={MAX_ARCH_LEN}"),
        ));
    }
    let arch = std::str::from_utf8(c.take(arch_len, "arch")?)
        .map_err(|_| bad("arch", "not valid UTF-8".into()))?
        .to_string();
    let mut dims = [0u32; 7];
    let names = [
        "n_layer",
        "n_embd",
        "n_ff",
        "n_head",
        "n_head_kv",
        "head_dim",
        "n_vocab",
    ];
    for (d, name) in dims.iter_mut().zip(names) {
        *d = c.u32(name)?;
        let max = if name == "n_vocab" { MAX_VOCAB } else { MAX_DIM };
        if *d == 0 || *d > max {
            return Err(bad(name, format!("{d} is out of range 1..={max}")));
        }
    }
    let [n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab] = dims;
    let down_id = c.u32("down_type")?;
    let down_type = DownType::from_id(down_id)
        .filter(|d| version >= 3 || *d != DownType::Source)
        .ok_or_else(|| {
            bad(
                "down_type",
                format!("{down_id} is not Q8_0 (8), F16 (1) or source tiles"),
            )
        })?;
    let resident_offset = c.u64("resident_offset")?;
    let resident_len = c.u64("resident_len")?;
    let resident_sha256 = c.sha("resident_sha256")?;
    let bundle_offset = c.u64("bundle_offset")?;
    let bundle_len = c.u64("bundle_len")?;

    let (nl, nf) = (n_layer as usize, n_ff as usize);
    // Check the whole remaining size before allocating the placement. The
    // level count follows the layer table; the scores flag follows the levels.
    let fixed = Header::meta_len(arch_len, nl, nf, 0);
    let n_levels = meta
        .get(fixed - 8..fixed - 4)
        .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize);
    if n_levels > MAX_SPARSITY_LEVELS {
        return Err(bad(
            "n_sparsity_levels",
            format!("{n_levels} is more than {MAX_SPARSITY_LEVELS}"),
        ));
    }
    let without_scores = Header::meta_len(arch_len, nl, nf, n_levels);
    let has_scores = meta
        .get(without_scores - 4..without_scores)
        .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    if has_scores > 1 {
        return Err(bad("has_neuron_scores", format!("{has_scores}, expected 0 or 1")));
    }
    let expected = without_scores + has_scores as usize * nl * nf * 4;
    if meta.len() != expected {
        return Err(bad(
            "meta_len",
            format!(
                "{} bytes, but n_layer = {n_layer} and n_ff = {n_ff} need {expected}",
                meta.len()
            ),
        ));
    }
    let meta_end = (PREAMBLE_LEN + meta.len()) as u64;
    let in_file = |off: u64, len: u64| off.checked_add(len).is_some_and(|end| end <= file_len);
    if !resident_offset.is_multiple_of(ALIGN) || resident_offset < meta_end {
        return Err(bad(
            "resident_offset",
            format!("{resident_offset} is not a {ALIGN}-aligned offset after the meta block"),
        ));
    }
    if resident_len < 24 || !in_file(resident_offset, resident_len) || resident_len > usize::MAX as u64 {
        return Err(bad(
            "resident_len",
            format!("{resident_len} bytes at {resident_offset} do not fit a file of {file_len} bytes"),
        ));
    }
    if !bundle_offset.is_multiple_of(ALIGN) || bundle_offset < resident_offset + resident_len {
        return Err(bad(
            "bundle_offset",
            format!("{bundle_offset} is not a {ALIGN}-aligned offset after the resident image"),
        ));
    }
    if !in_file(bundle_offset, bundle_len) {
        return Err(bad(
            "bundle_len",
            format!("{bundle_len} bytes at {bundle_offset} do not fit a file of {file_len} bytes"),
        ));
    }

    let mut placement = Vec::with_capacity(nl);
    for l in 0..nl {
        let raw = c.take(nf * 4, "placement")?;
        let order: Vec<u32> = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        check_permutation(&order, nf).map_err(|e| bad(&format!("placement[{l}]"), e))?;
        placement.push(order);
    }

    let mut layers = Vec::with_capacity(nl);
    let mut prev_end = bundle_offset;
    for l in 0..nl {
        let field = |f: &str| format!("layer[{l}].{f}");
        let mut ty = |f: &str| -> Result<GgmlType> {
            let id = c.u32(&field(f))?;
            GgmlType::from_id(id).map_err(|e| bad(&field(f), e.to_string()))
        };
        let gate_type = ty("gate_type")?;
        let up_type = ty("up_type")?;
        let mut sizes = [0usize; 3];
        for (s, f) in sizes.iter_mut().zip(["gate_bytes", "up_bytes", "down_bytes"]) {
            *s = c.u32(&field(f))? as usize;
        }
        // The layer's down type follows its sizes; version 2 kept 0 there.
        let layer_down = c.u32(&field("down_type"))?;
        let layer_down_type = match down_type.column_type() {
            Some(col) if version < 3 && layer_down == 0 => col,
            Some(col) if layer_down == col.id() => col,
            Some(col) => {
                return Err(bad(
                    &field("down_type"),
                    format!("{layer_down}, but the file's down columns are {col}"),
                ))
            }
            None => GgmlType::from_id(layer_down).map_err(|e| bad(&field("down_type"), e.to_string()))?,
        };
        for (s, (f, t)) in sizes[..2]
            .iter()
            .zip([("gate_bytes", gate_type), ("up_bytes", up_type)])
        {
            let want = t
                .row_bytes(n_embd as usize)
                .map_err(|e| bad(&field(f), format!("{t} rows of n_embd = {n_embd}: {e}")))?;
            if *s != want {
                return Err(bad(
                    &field(f),
                    format!("{s}, but a {t} row of {n_embd} values is {want} bytes"),
                ));
            }
        }
        let down_want = match down_type.layout() {
            DownLayout::Columns => layer_down_type.row_bytes(n_embd as usize),
            DownLayout::Tiles | DownLayout::Matrix => layer_down_type
                .row_bytes(n_ff as usize)
                .and_then(|_| tiles::part_bytes(layer_down_type, n_embd as usize)),
        }
        .map_err(|e| {
            bad(
                &field("down_bytes"),
                format!("{layer_down_type} down of {n_embd} x {n_ff}: {e}"),
            )
        })?;
        if sizes[2] != down_want {
            return Err(bad(
                &field("down_bytes"),
                format!(
                    "{}, but {layer_down_type} down parts of this model are {down_want} bytes",
                    sizes[2]
                ),
            ));
        }
        let layout = BundleLayout {
            gate_type,
            up_type,
            down_type: layer_down_type,
            down_layout: down_type.layout(),
            gate_bytes: sizes[0],
            up_bytes: sizes[1],
            down_bytes: sizes[2],
        };
        let offset = c.u64(&field("offset"))?;
        let len = c.u64(&field("len"))?;
        let sha256 = c.sha(&field("sha256"))?;
        if !offset.is_multiple_of(ALIGN) || offset < prev_end {
            return Err(bad(
                &field("offset"),
                format!("{offset} is not {ALIGN}-aligned or overlaps what precedes it (ends at {prev_end})"),
            ));
        }
        let want = layout.bundle_bytes() as u64 * n_ff as u64;
        if len != want {
            return Err(bad(&field("len"), format!("{len}, expected n_ff × bundle = {want}")));
        }
        if offset + len > bundle_offset + bundle_len {
            return Err(bad(&field("len"), "the layer ends past the bundle region".into()));
        }
        prev_end = offset + len;
        layers.push(LayerEntry {
            layout,
            offset,
            len,
            sha256,
        });
    }
    c.u32("n_sparsity_levels")?;
    let mut sparsity = Vec::with_capacity(n_levels);
    for k in 0..n_levels {
        let field = |f: &str| format!("sparsity[{k}].{f}");
        let s = c.f32(&field("sparsity"))?;
        if !(0.0..1.0).contains(&s) {
            return Err(bad(&field("sparsity"), format!("{s} is outside [0, 1)")));
        }
        let mut values = Vec::with_capacity(2 * nl);
        for j in 0..2 * nl {
            let name = if j < nl { "full" } else { "gate" };
            let t = c.f32(&field(name))?;
            if t.is_nan() || t < 0.0 {
                return Err(bad(
                    &format!("{}[{}]", field(name), j % nl),
                    format!("{t} is not a threshold (negative or NaN)"),
                ));
            }
            values.push(t);
        }
        let gate = values.split_off(nl);
        sparsity.push(SparsityLevel {
            sparsity: s,
            full: values,
            gate,
        });
    }
    c.u32("has_neuron_scores")?;
    let mut neuron_scores = Vec::with_capacity(has_scores as usize * nl);
    for l in 0..has_scores as usize * nl {
        let raw = c.take(nf * 4, "neuron_scores")?;
        let row: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        if let Some(i) = row.iter().position(|v| !v.is_finite() || *v < 0.0) {
            return Err(bad(
                &format!("neuron_scores[{l}][{i}]"),
                format!("{} is not a mean magnitude", row[i]),
            ));
        }
        neuron_scores.push(row);
    }
    debug_assert_eq!(c.pos, meta.len());
    Ok(Header {
        source_sha256,
        source_len,
        arch,
        n_layer,
        n_embd,
        n_ff,
        n_head,
        n_head_kv,
        head_dim,
        n_vocab,
        down_type,
        resident_offset,
        resident_len,
        resident_sha256,
        bundle_offset,
        bundle_len,
        placement,
        layers,
        sparsity,
        neuron_scores,
    })
}

/// An open `.lsflash` file: validated header and index, the resident GGUF
/// image mapped, the bundles left on disk.
pub struct LsFlash {
    path: PathBuf,
    file: File,
    header: Header,
    /// `position[l][i]`: where neuron `i` of layer `l` is stored.
    position: Vec<Vec<u32>>,
    /// The resident image, until the model that runs it takes it.
    resident: Option<GgufFile>,
    config: Config,
}

impl std::fmt::Debug for LsFlash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LsFlash")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl LsFlash {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = super::pagecache::open_uncached(&path).map_err(|e| RuntimeError::io(&path, e))?;
        let file_len = file.metadata().map_err(|e| RuntimeError::io(&path, e))?.len();
        let mut pre = [0u8; PREAMBLE_LEN];
        if file_len < PREAMBLE_LEN as u64 {
            return Err(corrupt(
                &path,
                format!("{file_len} bytes is too short for the {PREAMBLE_LEN}-byte preamble"),
            ));
        }
        file.read_exact_at(&mut pre, 0)
            .map_err(|e| RuntimeError::io(&path, e))?;
        if &pre[..8] != MAGIC {
            return Err(corrupt(
                &path,
                format!("not an .lsflash file (magic {:?}, expected {:?})", &pre[..8], MAGIC),
            ));
        }
        let version = u32::from_le_bytes(pre[8..12].try_into().expect("4 bytes"));
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(corrupt(
                &path,
                format!(
                    "header field 'version': {version}, this build reads versions {MIN_VERSION} to {VERSION} \
                     (re-pack the model)"
                ),
            ));
        }
        let flags = u32::from_le_bytes(pre[12..16].try_into().expect("4 bytes"));
        let reserved = u64::from_le_bytes(pre[56..64].try_into().expect("8 bytes"));
        if flags != 0 || reserved != 0 {
            return Err(corrupt(&path, "header fields 'flags'/'reserved': must be 0"));
        }
        let meta_len = u64::from_le_bytes(pre[16..24].try_into().expect("8 bytes"));
        if meta_len > file_len - PREAMBLE_LEN as u64 {
            return Err(corrupt(
                &path,
                format!("header field 'meta_len': {meta_len} bytes, but the file has {file_len}"),
            ));
        }
        let mut meta = vec![0u8; meta_len as usize];
        file.read_exact_at(&mut meta, PREAMBLE_LEN as u64)
            .map_err(|e| RuntimeError::io(&path, e))?;
        if Sha256::digest(&meta).as_slice() != &pre[24..56] {
            return Err(corrupt(
                &path,
                "header checksum mismatch (field 'meta_sha256'): the header or index is damaged",
            ));
        }
        super::pagecache::drop_cached(&file);
        let header = decode_meta(&path, &meta, file_len, version)?;
        let position = header
            .placement
            .iter()
            .map(|order| {
                let mut pos = vec![0u32; order.len()];
                for (p, &i) in order.iter().enumerate() {
                    pos[i as usize] = p as u32;
                }
                pos
            })
            .collect();
        let resident = GgufFile::open_range(&path, header.resident_offset, header.resident_len as usize)?;
        let config = Config::from_gguf(&resident)?;
        let checks = [
            ("n_layer", config.n_layer, header.n_layer),
            ("n_embd", config.n_embd, header.n_embd),
            ("n_ff", config.n_ff, header.n_ff),
            ("n_head", config.n_head, header.n_head),
            ("n_head_kv", config.n_head_kv, header.n_head_kv),
            ("head_dim", config.head_dim, header.head_dim),
            ("n_vocab", config.n_vocab, header.n_vocab),
        ];
        for (name, from_gguf, from_header) in checks {
            if from_gguf != from_header as usize {
                return Err(corrupt(
                    &path,
                    format!("header field '{name}': {from_header}, but the resident GGUF says {from_gguf}"),
                ));
            }
        }
        let arch = resident.req_str("general.architecture")?;
        if arch != header.arch {
            return Err(corrupt(
                &path,
                format!(
                    "header field 'arch': '{}', but the resident GGUF says '{arch}'",
                    header.arch
                ),
            ));
        }
        Ok(Self {
            path,
            file,
            header,
            position,
            resident: Some(resident),
            config,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The model configuration, read from the resident image and checked against the header.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The resident part (all non-FFN tensors and all metadata) as a GGUF;
    /// `None` once [`take_resident`](Self::take_resident) moved it out.
    pub fn resident(&self) -> Option<&GgufFile> {
        self.resident.as_ref()
    }

    /// Moves the resident image out (to build the model from it without a
    /// second copy in memory).
    pub fn take_resident(&mut self) -> Option<GgufFile> {
        self.resident.take()
    }

    /// Absolute byte range of the resident GGUF image in the file.
    pub fn resident_range(&self) -> (u64, u64) {
        (self.header.resident_offset, self.header.resident_len)
    }

    pub fn n_layer(&self) -> usize {
        self.header.layers.len()
    }

    pub fn n_ff(&self) -> usize {
        self.header.n_ff as usize
    }

    /// Sizes and types of the parts of layer `layer`'s bundles. Panics when
    /// `layer` is out of range (a caller bug, not a file problem).
    pub fn layout(&self, layer: usize) -> BundleLayout {
        self.header.layers[layer].layout
    }

    /// Absolute offset and length of all of a layer's bundles.
    pub fn layer_extent(&self, layer: usize) -> (u64, u64) {
        let l = &self.header.layers[layer];
        (l.offset, l.len)
    }

    /// Position of neuron `neuron` within its layer's bundles.
    pub fn position(&self, layer: usize, neuron: usize) -> usize {
        self.position[layer][neuron] as usize
    }

    /// The neuron stored at position `pos` of layer `layer`.
    pub fn neuron_at(&self, layer: usize, pos: usize) -> usize {
        self.header.placement[layer][pos] as usize
    }

    /// All of layer `layer`'s bundles, read whole and put in neuron order
    /// (the file stores them in its placement's order): what a device that
    /// holds the layer resident uploads, and what the compute profile runs on.
    pub fn layer_by_neuron(&self, layer: usize) -> Result<Vec<u8>> {
        let (n_ff, bb) = (self.n_ff(), self.layout(layer).bundle_bytes());
        let mut bundles = vec![0u8; n_ff * bb];
        self.for_each_bundle(layer, 0..n_ff, |i, b| bundles[i * bb..(i + 1) * bb].copy_from_slice(b))?;
        Ok(bundles)
    }

    /// Absolute offset and length of the bundle of neuron `neuron` in layer
    /// `layer`. Panics when either index is out of range.
    pub fn bundle_extent(&self, layer: usize, neuron: usize) -> (u64, usize) {
        let l = &self.header.layers[layer];
        let size = l.layout.bundle_bytes();
        (l.offset + self.position[layer][neuron] as u64 * size as u64, size)
    }

    /// Reads one bundle with a plain `pread` (the I/O engine has faster paths).
    pub fn read_bundle(&self, layer: usize, neuron: usize) -> Result<Vec<u8>> {
        let (off, len) = self.bundle_extent(layer, neuron);
        let mut buf = vec![0u8; len];
        self.file
            .read_exact_at(&mut buf, off)
            .map_err(|e| RuntimeError::io(&self.path, e))?;
        self.drop_cached();
        Ok(buf)
    }

    /// Calls `f(neuron, bundle)` for each bundle stored at `positions` of
    /// layer `layer`, in position order, reading 1 MiB slices with buffered
    /// I/O (the transient buffer stays small) and leaving nothing cached.
    pub fn for_each_bundle(
        &self,
        layer: usize,
        positions: std::ops::Range<usize>,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        let (off, _) = self.layer_extent(layer);
        let bb = self.layout(layer).bundle_bytes();
        let per_read = ((1 << 20) / bb).max(1);
        let mut buf = vec![0u8; per_read.min(positions.len()) * bb];
        let mut p = positions.start;
        while p < positions.end {
            let n = per_read.min(positions.end - p);
            self.file
                .read_exact_at(&mut buf[..n * bb], off + (p * bb) as u64)
                .map_err(|e| RuntimeError::io(&self.path, e))?;
            for (j, b) in buf[..n * bb].chunks_exact(bb).enumerate() {
                f(self.neuron_at(layer, p + j), b);
            }
            p += n;
        }
        self.drop_cached();
        Ok(())
    }

    /// Reads the resident image and every layer's bundles and checks their
    /// SHA-256 sums; the error names the first damaged layer.
    pub fn verify(&self) -> Result<()> {
        let (off, len) = self.resident_range();
        if self.sha256_range(off, len)? != self.header.resident_sha256 {
            return Err(corrupt(
                &self.path,
                "resident GGUF image: SHA-256 mismatch (field 'resident_sha256')",
            ));
        }
        for (l, entry) in self.header.layers.iter().enumerate() {
            if self.sha256_range(entry.offset, entry.len)? != entry.sha256 {
                return Err(corrupt(
                    &self.path,
                    format!("layer {l}: bundle region SHA-256 mismatch (field 'layer[{l}].sha256')"),
                ));
            }
        }
        Ok(())
    }

    fn sha256_range(&self, offset: u64, len: u64) -> Result<[u8; 32]> {
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 4 << 20];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            self.file
                .read_exact_at(&mut buf[..n], offset + done)
                .map_err(|e| RuntimeError::io(&self.path, e))?;
            hasher.update(&buf[..n]);
            done += n as u64;
        }
        self.drop_cached();
        Ok(hasher.finalize().into())
    }

    /// Drops what buffered reads left of the file in the page cache.
    pub fn drop_cached(&self) {
        super::pagecache::drop_cached(&self.file);
    }
}

/// SHA-256 of a whole file, streamed.
pub fn sha256_file(path: &Path) -> Result<([u8; 32], u64)> {
    let mut f = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| RuntimeError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hasher.finalize().into(), total))
}
