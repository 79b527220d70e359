//! Writes an `.lsflash` file from a GGUF model (see [`super::format`]).
//!
//! The writer streams layer by layer: only one layer's down matrix (as f32,
//! transposed, for columns; cut into tiles, for the source layout) and one
//! bundle are in memory at a time. It writes to
//! `OUT.tmp`, fsyncs, drops the written pages from the page cache and renames
//! the file into place, so a crash never leaves a half-written `OUT`.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::quantize::{quantize_row_as, GgmlBuild};
use leanstream_kernels::sparse_ffn::{tiles, DownLayout};
use sha2::{Digest, Sha256};

use super::format::{
    align_up, check_permutation, sha256_file, BundleLayout, DownType, Header, LayerEntry, SparsityLevel,
    MAX_SPARSITY_LEVELS, PREAMBLE_LEN,
};
use crate::durable;
use crate::gguf::{GgufFile, GgufWriter};
use crate::model::Config;
use crate::{Result, RuntimeError};

#[derive(Debug, Clone, Default)]
pub struct PackOptions {
    pub down: DownType,
    /// Per layer, the neuron to store at each position; identity when `None`.
    pub placement: Option<Vec<Vec<u32>>>,
    /// Calibrated sparsity thresholds to store in the header.
    pub sparsity: Vec<SparsityLevel>,
    /// Per layer, each neuron's calibrated mean |activation| (or empty).
    pub neuron_scores: Vec<Vec<f32>>,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

/// What [`pack`] wrote.
#[derive(Debug, Clone)]
pub struct PackReport {
    pub path: PathBuf,
    pub file_len: u64,
    pub resident_len: u64,
    pub bundle_len: u64,
    pub seconds: f64,
}

/// Each layer's bundle layout for the FFN of `g` with the down matrix as
/// `down` (checks the three matrices' shapes).
pub fn bundle_layouts(g: &GgufFile, c: &Config, down: DownType) -> Result<Vec<BundleLayout>> {
    let (n_embd, n_ff) = (c.n_embd, c.n_ff);
    (0..c.n_layer)
        .map(|l| {
            let gate = g.matrix(&ffn_name(l, "gate"), n_ff, n_embd)?;
            let up = g.matrix(&ffn_name(l, "up"), n_ff, n_embd)?;
            let down_name = ffn_name(l, "down");
            let source = g.matrix(&down_name, n_embd, n_ff)?;
            let down_ty = down.column_type().unwrap_or(source.ty);
            let down_bytes = match down.layout() {
                DownLayout::Columns => down_ty.row_bytes(n_embd),
                DownLayout::Tiles | DownLayout::Matrix => tiles::part_bytes(down_ty, n_embd),
            }
            .map_err(|e| {
                RuntimeError::Unsupported(format!(
                    "{down_name}: down as {down} ({down_ty}) with n_embd = {n_embd}: {e}"
                ))
            })?;
            Ok(BundleLayout {
                gate_type: gate.ty,
                up_type: up.ty,
                down_type: down_ty,
                down_layout: down.layout(),
                gate_bytes: gate.row_bytes(),
                up_bytes: up.row_bytes(),
                down_bytes,
            })
        })
        .collect()
}

/// Reads a placement file: JSON `{"layers": [[neuron ids...], ...]}`.
pub fn load_placement(path: &Path) -> Result<Vec<Vec<u32>>> {
    #[derive(serde::Deserialize)]
    struct PlacementFile {
        layers: Vec<Vec<u32>>,
    }
    let text = std::fs::read_to_string(path).map_err(|e| RuntimeError::io(path, e))?;
    let p: PlacementFile = serde_json::from_str(&text).map_err(|e| RuntimeError::Corrupt {
        path: path.to_path_buf(),
        problem: format!("placement JSON: {e}"),
    })?;
    Ok(p.layers)
}

/// Per layer, neuron ids by descending score (ties by id): a placement that
/// puts a layer's hot neurons in one contiguous range at its start.
pub fn order_by_score(scores: &[Vec<f32>]) -> Vec<Vec<u32>> {
    scores
        .iter()
        .map(|row| {
            let mut order: Vec<u32> = (0..row.len() as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            order
        })
        .collect()
}

/// The least share of the FFN's neurons [`hot_prefix`] puts first when
/// the budget is not known or is smaller: the hot set of every budget up
/// to half the FFN is then one piece (a smaller budget's set is a prefix
/// of a larger one's). On SmolLM2 at a 50% budget a file with a 25% prefix
/// read 44.0 MiB a token (merged over the scattered rest of the hot set),
/// one with a 50% prefix 29.6, and both read 44.3 at 25%.
pub const HOT_PREFIX_AT_LEAST: f64 = 0.5;

/// `placement` with each layer's share of the static hot set first,
/// hottest first: the neurons `--cache-policy hot` holds at a budget of
/// `fraction` of the FFN's neurons (ranked from `scores` as the engine
/// ranks them, [`crate::cache::relative_ranking`]), then the rest in the
/// placement's order. With the hot set scattered through a learned order,
/// reads merge over cached bundles and read them again (the tuned SmolLM2
/// read 98.6% of its FFN a token with a quarter of it cached); as a prefix,
/// what is cached is skipped, and a smaller budget's hot set is a prefix
/// of the prefix. Neurons must be their own read units (down columns).
pub fn hot_prefix(placement: &[Vec<u32>], scores: &[Vec<f32>], fraction: f64) -> Result<Vec<Vec<u32>>> {
    let n_ff = placement.first().map_or(0, Vec::len);
    let bad = scores.len() != placement.len()
        || scores.iter().any(|r| r.len() != n_ff)
        || placement.iter().any(|o| o.len() != n_ff);
    if bad {
        return Err(RuntimeError::Invalid(format!(
            "hot prefix: {} layers of scores for a placement of {} layers of {n_ff} neurons",
            scores.len(),
            placement.len()
        )));
    }
    if !(0.0..=1.0).contains(&fraction) {
        return Err(RuntimeError::Invalid(format!(
            "hot prefix: fraction {fraction} is not in 0..=1"
        )));
    }
    let mut ranking = crate::cache::relative_ranking(scores);
    crate::cache::sort_ranking(&mut ranking);
    let n_hot = ((ranking.len() as f64) * fraction).floor() as usize;
    let mut hot = vec![Vec::new(); placement.len()];
    let mut is_hot = vec![vec![false; n_ff]; placement.len()];
    for r in &ranking[..n_hot] {
        hot[r.layer as usize].push(r.neuron);
        is_hot[r.layer as usize][r.neuron as usize] = true;
    }
    Ok(placement
        .iter()
        .zip(hot)
        .zip(&is_hot)
        .map(|((order, mut first), hot)| {
            // An id out of range stays in; `pack` refuses the permutation.
            first.extend(
                order
                    .iter()
                    .filter(|&&i| !hot.get(i as usize).copied().unwrap_or(false)),
            );
            first
        })
        .collect())
}

/// [`order_by_score`] for layers whose neurons are read in groups (down
/// tiles: `groups[l]` consecutive ids share blocks): whole groups by
/// descending mean score (ties by id), ids ascending inside a group, so a
/// group stays one contiguous read.
pub fn order_groups_by_score(scores: &[Vec<f32>], groups: &[usize]) -> Vec<Vec<u32>> {
    scores
        .iter()
        .zip(groups)
        .map(|(row, &g)| {
            let g = g.max(1);
            let means: Vec<f32> = row.chunks(g).map(|c| c.iter().sum::<f32>() / c.len() as f32).collect();
            order_by_score(std::slice::from_ref(&means))[0]
                .iter()
                .flat_map(|&grp| (grp as usize * g..((grp as usize + 1) * g).min(row.len())).map(|i| i as u32))
                .collect()
        })
        .collect()
}

/// Per layer, the neurons that are read together when the down matrix is
/// stored as `down` (1 for columns, the down type's block for tiles).
pub fn neuron_groups(gguf_path: &Path, down: DownType) -> Result<Vec<usize>> {
    let g = GgufFile::open(gguf_path)?;
    let c = Config::from_gguf(&g)?;
    bundle_layouts(&g, &c, down)?
        .iter()
        .map(|l| Ok(l.format(c.n_embd)?.group()))
        .collect()
}

fn ffn_name(l: usize, part: &str) -> String {
    format!("blk.{l}.ffn_{part}.weight")
}

/// Packs the GGUF at `gguf_path` into an `.lsflash` file at `out_path`.
pub fn pack(gguf_path: impl AsRef<Path>, out_path: impl AsRef<Path>, opts: &PackOptions) -> Result<PackReport> {
    let start = Instant::now();
    let (src_path, out_path) = (gguf_path.as_ref(), out_path.as_ref());
    let g = GgufFile::open(src_path)?;
    let c = Config::from_gguf(&g)?;
    let (n_layer, n_embd, n_ff) = (c.n_layer, c.n_embd, c.n_ff);
    durable::create_parent(out_path).map_err(|e| RuntimeError::io(out_path, e))?;

    let placement = match &opts.placement {
        None => vec![(0..n_ff as u32).collect::<Vec<u32>>(); n_layer],
        Some(p) => {
            if p.len() != n_layer {
                return Err(RuntimeError::Invalid(format!(
                    "placement has {} layers, the model has {n_layer}",
                    p.len()
                )));
            }
            for (l, order) in p.iter().enumerate() {
                check_permutation(order, n_ff).map_err(|e| {
                    RuntimeError::Invalid(format!("placement layer {l} is not a permutation of 0..{n_ff}: {e}"))
                })?;
            }
            p.clone()
        }
    };

    let mut sparsity = opts.sparsity.clone();
    sparsity.sort_by(|a, b| a.sparsity.total_cmp(&b.sparsity));
    if sparsity.len() > MAX_SPARSITY_LEVELS {
        return Err(RuntimeError::Invalid(format!(
            "{} sparsity levels; a file holds at most {MAX_SPARSITY_LEVELS}",
            sparsity.len()
        )));
    }
    for level in &sparsity {
        let bad = level.full.len() != n_layer
            || level.gate.len() != n_layer
            || !(0.0..1.0).contains(&level.sparsity)
            || level.full.iter().chain(&level.gate).any(|t| t.is_nan() || *t < 0.0);
        if bad {
            return Err(RuntimeError::Invalid(format!(
                "sparsity level {}: needs {n_layer} non-negative thresholds per criterion and a sparsity in [0, 1)",
                level.sparsity
            )));
        }
    }

    let scores_ok = opts.neuron_scores.is_empty()
        || (opts.neuron_scores.len() == n_layer
            && opts
                .neuron_scores
                .iter()
                .all(|r| r.len() == n_ff && r.iter().all(|v| v.is_finite() && *v >= 0.0)));
    if !scores_ok {
        return Err(RuntimeError::Invalid(format!(
            "neuron scores: need {n_layer} layers of {n_ff} finite non-negative values"
        )));
    }

    // Per-layer bundle layouts, checked before anything is written.
    let layouts = bundle_layouts(&g, &c, opts.down)?;

    let arch = g.req_str("general.architecture")?.to_string();
    let resident = resident_image(&g, n_layer);
    let resident_sha256: [u8; 32] = Sha256::digest(&resident).into();
    let (source_sha256, source_len) = sha256_file(src_path)?;

    // The layout of the whole file.
    let scores_len = if opts.neuron_scores.is_empty() {
        0
    } else {
        n_layer * n_ff * 4
    };
    let meta_len = Header::meta_len(arch.len(), n_layer, n_ff, sparsity.len()) + scores_len;
    let resident_offset = align_up((PREAMBLE_LEN + meta_len) as u64);
    let bundle_offset = align_up(resident_offset + resident.len() as u64);
    let mut layers = Vec::with_capacity(n_layer);
    let mut pos = bundle_offset;
    for layout in &layouts {
        let offset = align_up(pos);
        let len = (layout.bundle_bytes() * n_ff) as u64;
        layers.push(LayerEntry {
            layout: *layout,
            offset,
            len,
            sha256: [0; 32],
        });
        pos = offset + len;
    }
    let u32_dim = |v: usize| v as u32;
    let mut header = Header {
        source_sha256,
        source_len,
        arch,
        n_layer: u32_dim(n_layer),
        n_embd: u32_dim(n_embd),
        n_ff: u32_dim(n_ff),
        n_head: u32_dim(c.n_head),
        n_head_kv: u32_dim(c.n_head_kv),
        head_dim: u32_dim(c.head_dim),
        n_vocab: u32_dim(c.n_vocab),
        down_type: opts.down,
        resident_offset,
        resident_len: resident.len() as u64,
        resident_sha256,
        bundle_offset,
        bundle_len: pos - bundle_offset,
        placement,
        layers,
        sparsity,
        neuron_scores: opts.neuron_scores.clone(),
    };

    let tmp_path = durable::tmp_path(out_path);
    let result = write_file(&g, &tmp_path, &mut header, &resident, opts.progress);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp_path);
        return Err(e);
    }
    durable::commit(&tmp_path, out_path).map_err(|e| RuntimeError::io(out_path, e))?;
    Ok(PackReport {
        path: out_path.to_path_buf(),
        file_len: pos,
        resident_len: header.resident_len,
        bundle_len: header.bundle_len,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The GGUF image of everything except the layers' FFN matrices.
fn resident_image(g: &GgufFile, n_layer: usize) -> Vec<u8> {
    let mut w = GgufWriter::new();
    let mut keys: Vec<&String> = g.metadata.keys().collect();
    keys.sort();
    for k in keys {
        // The writer uses its own (default) alignment.
        if k != "general.alignment" {
            w.meta(k, g.metadata[k].clone());
        }
    }
    let ffn: std::collections::HashSet<String> = (0..n_layer)
        .flat_map(|l| ["gate", "up", "down"].map(|p| ffn_name(l, p)))
        .collect();
    for t in g.tensors.iter().filter(|t| !ffn.contains(&t.name)) {
        w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
    }
    w.to_bytes()
}

fn write_file(g: &GgufFile, tmp_path: &Path, header: &mut Header, resident: &[u8], progress: bool) -> Result<()> {
    let io = |e: std::io::Error| RuntimeError::io(tmp_path, e);
    let file = File::create(tmp_path).map_err(io)?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    let mut at = 0u64;
    let pad_to = |w: &mut BufWriter<File>, at: &mut u64, target: u64| -> Result<()> {
        let zeros = vec![0u8; (target - *at) as usize];
        w.write_all(&zeros).map_err(io)?;
        *at = target;
        Ok(())
    };
    // Preamble and meta block are written last; zeros hold their place.
    pad_to(&mut w, &mut at, header.resident_offset)?;
    w.write_all(resident).map_err(io)?;
    at += resident.len() as u64;

    let (n_embd, n_ff) = (header.n_embd as usize, header.n_ff as usize);
    let bar = crate::progress::bar(
        header.layers.len() as u64,
        progress,
        "pack {bar:30} {pos}/{len} layers, ETA {eta}",
    );
    let mut down_t = Vec::new();
    let mut down_tiles = Vec::new();
    let mut row = vec![0f32; n_ff];
    let mut bundle = Vec::new();
    for l in 0..header.layers.len() {
        let entry = &header.layers[l];
        let layout = entry.layout;
        pad_to(&mut w, &mut at, entry.offset)?;
        let gate = g.matrix(&ffn_name(l, "gate"), n_ff, n_embd)?;
        let up = g.matrix(&ffn_name(l, "up"), n_ff, n_embd)?;
        let down_name = ffn_name(l, "down");
        let down = g.matrix(&down_name, n_embd, n_ff)?;
        let tensor_error = |e: leanstream_kernels::KernelError| RuntimeError::Tensor {
            path: g.path().to_path_buf(),
            name: down_name.clone(),
            problem: e.to_string(),
        };
        let group = layout.down_type.block_size();
        match layout.down_layout {
            // Transpose the down matrix: column i becomes a contiguous run.
            DownLayout::Columns => {
                down_t.resize(n_embd * n_ff, 0.0);
                for r in 0..n_embd {
                    dequantize_row(down.ty, down.row(r), &mut row).map_err(tensor_error)?;
                    for (i, &v) in row.iter().enumerate() {
                        down_t[i * n_embd + r] = v;
                    }
                }
            }
            // Cut the source blocks into one tile per group of neurons.
            DownLayout::Tiles | DownLayout::Matrix => {
                let tile = tiles::tile_bytes(down.ty, n_embd).map_err(tensor_error)?;
                let mut cut = vec![0u8; n_ff / group * tile];
                for (grp, t) in cut.chunks_exact_mut(tile).enumerate() {
                    tiles::tile_of(down.ty, n_embd, n_ff, down.data, grp, t).map_err(tensor_error)?;
                }
                down_tiles = cut;
            }
        }
        let mut hasher = Sha256::new();
        bundle.resize(layout.bundle_bytes(), 0);
        for &i in &header.placement[l] {
            let i = i as usize;
            let (gb, rest) = bundle.split_at_mut(layout.gate_bytes);
            let (ub, db) = rest.split_at_mut(layout.up_bytes);
            gb.copy_from_slice(gate.row(i));
            ub.copy_from_slice(up.row(i));
            match layout.down_layout {
                DownLayout::Columns => quantize_row_as(
                    GgmlBuild::FILES,
                    layout.down_type,
                    &down_t[i * n_embd..(i + 1) * n_embd],
                    db,
                )?,
                DownLayout::Tiles | DownLayout::Matrix => {
                    let tile = down_tiles.len() / (n_ff / group);
                    let t = &down_tiles[i / group * tile..(i / group + 1) * tile];
                    tiles::tile_part(down.ty, n_embd, t, i % group, db).map_err(tensor_error)?;
                }
            }
            hasher.update(&bundle);
            w.write_all(&bundle).map_err(io)?;
        }
        at += entry.len;
        header.layers[l].sha256 = hasher.finalize().into();
        bar.inc(1);
    }
    bar.finish_and_clear();

    let meta = header.encode_meta();
    debug_assert_eq!(meta.len(), header.encoded_len());
    w.seek(SeekFrom::Start(0)).map_err(io)?;
    w.write_all(&Header::encode_preamble(&meta)).map_err(io)?;
    w.write_all(&meta).map_err(io)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    // SAFETY: plain syscall on an open descriptor; advice only, failure is harmless.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{relative_ranking, EvictionPolicy, StaticHot};

    #[test]
    fn the_hot_prefix_is_what_the_static_hot_cache_holds_and_the_rest_keeps_the_placement_order() {
        // Layer 1's scores are ten times layer 0's: ranked relative to each
        // layer's mean, both layers get hot neurons.
        let scores = vec![
            vec![1.0, 9.0, 2.0, 8.0, 1.0, 1.0, 3.0, 1.0],
            vec![10.0, 10.0, 70.0, 10.0, 90.0, 10.0, 10.0, 20.0],
        ];
        let placement = vec![vec![7, 6, 5, 4, 3, 2, 1, 0], vec![0, 2, 4, 6, 1, 3, 5, 7]];
        let p = hot_prefix(&placement, &scores, 0.25).unwrap();
        assert_eq!(p[0], vec![1, 3, 7, 6, 5, 4, 2, 0]);
        assert_eq!(p[1], vec![4, 2, 0, 6, 1, 3, 5, 7]);
        for order in &p {
            check_permutation(order, 8).unwrap();
        }
        // What the engine's static hot set loads at the same share of slots.
        let mut hot = StaticHot::new(relative_ranking(&scores));
        hot.init(4, 2, 8).unwrap();
        let mut held = hot.prefill_list();
        held.sort();
        assert_eq!(held, vec![(0, 1), (0, 3), (1, 2), (1, 4)]);
        // A smaller budget's hot set is a prefix of the prefix.
        let q = hot_prefix(&placement, &scores, 0.125).unwrap();
        assert_eq!((&q[0][..1], &q[1][..1]), (&[1u32][..], &[4u32][..]));
        assert_eq!(hot_prefix(&placement, &scores, 0.0).unwrap(), placement);
        assert!(hot_prefix(&placement, &scores[..1], 0.25).is_err());
        assert!(hot_prefix(&placement, &scores, 1.5).is_err());
    }
}
