//! Down tiles: the down matrix in the source model's own type, cut so that
//! bundles still stream neuron by neuron.
//!
//! `ffn_down` is `n_embd` rows of `n_ff` values, quantized in blocks along
//! the neuron axis: a block of row r covers a *group* of `G =
//! ty.block_size()` consecutive neurons (32 for Q4_0..Q8_0, 256 for the
//! K-quants). Group g's *tile* is its `n_embd` blocks, one per row, in row
//! order (`T = n_embd × block_bytes` bytes). The tile is cut into `G` equal
//! *parts* of [`part_bytes`] (zero-padded at the end), and part k rides in
//! the bundle of neuron `g·G + k`, after its gate and up rows.
//!
//! To compute, [`DownTiles`] gathers the tiles of the groups a call uses
//! back into the row-major matrix (for all groups: the source matrix, byte
//! for byte; absent groups zero), converts the activations to the type's
//! vec-dot type and runs [`crate::matmul`], the dense path's own product. So with every
//! group present the output is bit for bit the dense path's down
//! projection, on every CPU path and row count (repacked Q4_K and the tiled
//! K-quant products included), and the bytes read per neuron are the
//! source's (4.5 bits a weight for Q4_0, where Q8_0 columns take 8.5).
//! The price: a group is read and computed whole, so sparsity only saves
//! down bytes where whole groups are idle.

use rayon::prelude::*;

use super::{check_weight_type, BundleFormat, DownLayout};
use crate::matmul::{matmul, matmul_scalar, ActBuffer, QMatrix};
use crate::{GgmlType, KernelError};

/// Parts are padded to this many bytes, so that the rows of the next bundle
/// stay aligned for their block types.
const PART_ALIGN: usize = 4;
/// The largest block (QK_K): no group has more neurons.
const MAX_GROUP: usize = 256;
/// Output rows per parallel gather task (below this, one thread copies).
const GATHER_TASK_ROWS: usize = 64;

/// Bytes of one block of `ty` (a block covers one group of neurons).
fn block_bytes(ty: GgmlType) -> Result<usize, KernelError> {
    ty.row_bytes(ty.block_size())
}

/// Bytes of a group's tile: one block per output row.
pub fn tile_bytes(ty: GgmlType, n_embd: usize) -> Result<usize, KernelError> {
    check_weight_type(ty)?;
    if ty.block_size() > MAX_GROUP {
        return Err(KernelError::UnsupportedType(format!("{ty} as a tiled down type")));
    }
    n_embd.checked_mul(block_bytes(ty)?).ok_or(KernelError::Length {
        what: "down tile (n_embd)",
        expected: usize::MAX,
        got: n_embd,
    })
}

/// Bytes of the tile part each bundle carries: `ceil(T / G)`, padded to 4.
pub fn part_bytes(ty: GgmlType, n_embd: usize) -> Result<usize, KernelError> {
    let tile = tile_bytes(ty, n_embd)?;
    Ok(tile.div_ceil(ty.block_size()).next_multiple_of(PART_ALIGN))
}

/// Part `k` of a group's `tile` into `out` ([`part_bytes`] long): the tile's
/// bytes `[k·P, (k+1)·P)`, zeros past its end.
pub fn tile_part(ty: GgmlType, n_embd: usize, tile: &[u8], k: usize, out: &mut [u8]) -> Result<(), KernelError> {
    let (t, p) = (tile_bytes(ty, n_embd)?, part_bytes(ty, n_embd)?);
    if tile.len() != t || out.len() != p || k >= ty.block_size() {
        return Err(KernelError::ByteLength {
            what: "down tile part",
            expected: if tile.len() != t { t } else { p },
            got: if tile.len() != t { tile.len() } else { out.len() },
        });
    }
    let start = (k * p).min(t);
    let end = ((k + 1) * p).min(t);
    out[..end - start].copy_from_slice(&tile[start..end]);
    out[end - start..].fill(0);
    Ok(())
}

/// Group g's tile from a row-major down matrix (`n_embd` rows of `n_ff`).
pub fn tile_of(
    ty: GgmlType,
    n_embd: usize,
    n_ff: usize,
    matrix: &[u8],
    g: usize,
    tile: &mut [u8],
) -> Result<(), KernelError> {
    let bb = block_bytes(ty)?;
    let row_bytes = ty.row_bytes(n_ff)?;
    let groups = n_ff / ty.block_size();
    if matrix.len() != n_embd * row_bytes || tile.len() != n_embd * bb || g >= groups {
        return Err(KernelError::ByteLength {
            what: "down matrix for a tile",
            expected: n_embd * row_bytes,
            got: matrix.len(),
        });
    }
    for (r, dst) in tile.chunks_exact_mut(bb).enumerate() {
        let at = r * row_bytes + g * bb;
        dst.copy_from_slice(&matrix[at..at + bb]);
    }
    Ok(())
}

/// The down product of a tiled layer, with its scratch (grown on the first
/// larger call, then kept: no allocation in steady state).
#[derive(Debug, Clone)]
pub struct DownTiles {
    /// The gathered matrix (u64 backing keeps every block type aligned).
    matrix: Vec<u64>,
    /// The activations of the gathered groups, `[n][k·G]`.
    values: Vec<f32>,
    acts: ActBuffer,
    acts_len: usize,
    /// The layer the matrix was begun for by [`begin`](DownTiles::begin),
    /// while parts are put into it one by one.
    begun: Option<Begun>,
}

/// A begun layer's shape and the byte geometry [`DownTiles::put`] needs,
/// worked out once per layer rather than once per neuron.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Begun {
    ty: GgmlType,
    n_embd: usize,
    n_ff: usize,
    /// Neurons per group, bytes per block, per tile part, per matrix row.
    group: usize,
    block: usize,
    part: usize,
    row_bytes: usize,
    /// Where the tile part starts in a bundle, and the bundle's length.
    part_at: usize,
    bundle: usize,
}

impl Begun {
    fn is(&self, ty: GgmlType, n_embd: usize, n_ff: usize) -> bool {
        (self.ty, self.n_embd, self.n_ff) == (ty, n_embd, n_ff)
    }
}

impl Default for DownTiles {
    fn default() -> Self {
        Self::new()
    }
}

impl DownTiles {
    /// Each row's product with the bits of that row alone (see
    /// [`ActBuffer::set_rows_alone`]).
    pub fn set_rows_alone(&mut self, on: bool) {
        self.acts.set_rows_alone(on);
    }

    pub fn new() -> Self {
        Self {
            matrix: Vec::new(),
            values: Vec::new(),
            acts: ActBuffer::with_capacity(0, 0),
            acts_len: 0,
            begun: None,
        }
    }

    /// Bytes of scratch held.
    pub fn bytes(&self) -> u64 {
        (self.matrix.len() * 8 + self.values.len() * 4 + self.acts_len * 4) as u64
    }

    /// Bytes of scratch for `n` rows of a layer of `ty` (known before construction).
    pub fn bytes_for(ty: GgmlType, n_embd: usize, n_ff: usize, n: usize) -> u64 {
        let matrix = n_embd * ty.row_bytes(n_ff).unwrap_or(0);
        (matrix.next_multiple_of(8) + 2 * n.max(1) * n_ff * 4) as u64
    }

    /// `ys[t] = down · a[t]` over the neurons of `groups` (ascending group
    /// ids; the other neurons count as 0), the tiles read from the groups'
    /// bundles (`bundle(i)`: neuron i's whole bundle). `a` is `[n][n_ff]`,
    /// `ys` is `[n][n_embd]`. The dense path's bits for the same
    /// activations with the absent groups' set to 0.
    pub fn run<'b>(
        &mut self,
        format: &BundleFormat,
        groups: &[u32],
        a: &[f32],
        n_ff: usize,
        bundle: impl Fn(usize) -> &'b [u8] + Sync,
        ys: &mut [f32],
    ) -> Result<(), KernelError> {
        self.run_on(format, groups, a, n_ff, bundle, ys, true)
    }

    /// Single-threaded, portable twin of [`run`](Self::run) (GGML's generic
    /// dots, as [`matmul_scalar`]).
    pub fn run_scalar<'b>(
        &mut self,
        format: &BundleFormat,
        groups: &[u32],
        a: &[f32],
        n_ff: usize,
        bundle: impl Fn(usize) -> &'b [u8] + Sync,
        ys: &mut [f32],
    ) -> Result<(), KernelError> {
        self.run_on(format, groups, a, n_ff, bundle, ys, false)
    }

    /// `ys[t] = down · a[t]` with the whole matrix already gathered
    /// (row-major, as the source stores it): the dense path's product.
    pub fn run_matrix(
        &mut self,
        ty: GgmlType,
        matrix: &[u8],
        n_embd: usize,
        a: &[f32],
        n_ff: usize,
        ys: &mut [f32],
    ) -> Result<(), KernelError> {
        let n = check_rows(n_embd, n_ff, a, ys)?;
        let w = QMatrix::new(ty, n_embd, n_ff, matrix)?;
        self.convert(ty, a, n, n_ff)?;
        matmul(&w, &self.acts, ys)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_on<'b>(
        &mut self,
        format: &BundleFormat,
        groups: &[u32],
        a: &[f32],
        n_ff: usize,
        bundle: impl Fn(usize) -> &'b [u8] + Sync,
        ys: &mut [f32],
        fast: bool,
    ) -> Result<(), KernelError> {
        format.validate()?;
        if format.down_layout != DownLayout::Tiles {
            return Err(KernelError::UnsupportedType(format!(
                "{} down columns in the tile product",
                format.down_ty
            )));
        }
        let (ty, d) = (format.down_ty, format.n_embd);
        check_rows(d, n_ff, a, ys)?;
        let row_bytes = ty.row_bytes(n_ff)?;
        let matrix = self.matrix_for(d * row_bytes);
        gather(format, n_ff, groups, &bundle, matrix, fast)?;
        self.begun = None;
        self.product(format, groups, a, n_ff, ys, fast)
    }

    /// Starts a layer whose tiles arrive one neuron at a time: [`put`](Self::put)
    /// each wanted neuron's bundle (in any order), then
    /// [`run_gathered`](Self::run_gathered). Holds one layer's down matrix,
    /// the same scratch [`run`](Self::run) gathers into.
    pub fn begin(&mut self, format: &BundleFormat, n_ff: usize) -> Result<(), KernelError> {
        format.validate()?;
        if format.down_layout != DownLayout::Tiles || !n_ff.is_multiple_of(format.group()) {
            return Err(KernelError::UnsupportedType(format!(
                "{} down columns (or n_ff {n_ff} not in whole groups) in the tile product",
                format.down_ty
            )));
        }
        let (ty, d) = (format.down_ty, format.n_embd);
        let row_bytes = ty.row_bytes(n_ff)?;
        self.matrix_for(d * row_bytes);
        self.begun = Some(Begun {
            ty,
            n_embd: d,
            n_ff,
            group: format.group(),
            block: block_bytes(ty)?,
            part: format.down_bytes(),
            row_bytes,
            part_at: format.gate_bytes() + format.up_bytes(),
            bundle: format.bundle_bytes(),
        });
        Ok(())
    }

    /// Copies neuron `i`'s tile part out of its whole `bundle` into its place
    /// in the matrix [`begin`](Self::begin) started.
    pub fn put(&mut self, format: &BundleFormat, i: usize, bundle: &[u8]) -> Result<(), KernelError> {
        let Some(b) = self
            .begun
            .filter(|b| b.ty == format.down_ty && b.n_embd == format.n_embd && i < b.n_ff)
        else {
            return Err(KernelError::Length {
                what: "tile part of a neuron outside the begun layer",
                expected: self.begun.map_or(0, |b| b.n_ff),
                got: i,
            });
        };
        if bundle.len() != b.bundle {
            return Err(KernelError::ByteLength {
                what: "neuron bundle",
                expected: b.bundle,
                got: bundle.len(),
            });
        }
        let (grp, k) = (i / b.group, i % b.group);
        let tile = b.n_embd * b.block;
        // The part is tile bytes [k·P, (k+1)·P), cut at the tile's end; tile
        // byte t is byte t % B of row t / B's block of this group.
        let (start, end) = ((k * b.part).min(tile), ((k + 1) * b.part).min(tile));
        if start == end {
            return Ok(()); // a part wholly past the tile's end: padding only
        }
        let part = &bundle[b.part_at..b.part_at + (end - start)];
        let matrix = self.matrix_for(b.n_embd * b.row_bytes);
        let (row, offset) = (start / b.block, start % b.block);
        let dst = &mut matrix[row * b.row_bytes + grp * b.block..];
        if offset == 0 && part.len().is_multiple_of(b.block) {
            // Whole blocks, as every 32-neuron type's parts are: fixed-size
            // copies with no per-block arithmetic.
            match b.block {
                18 => put_blocks::<18>(part, dst, b.row_bytes),
                20 => put_blocks::<20>(part, dst, b.row_bytes),
                22 => put_blocks::<22>(part, dst, b.row_bytes),
                24 => put_blocks::<24>(part, dst, b.row_bytes),
                34 => put_blocks::<34>(part, dst, b.row_bytes),
                _ => put_pieces(part, dst, 0, b.block, b.row_bytes),
            }
        } else {
            put_pieces(part, dst, offset, b.block, b.row_bytes);
        }
        Ok(())
    }

    /// `ys[t] = down · a[t]` over the neurons of `groups` (ascending) from
    /// the parts [`put`](Self::put) since [`begin`](Self::begin): every
    /// member of each group must have been put. The other groups count as
    /// 0 (their blocks are zeroed here, whatever an earlier layer left), so
    /// the bits are [`run`](Self::run)'s for the same groups.
    pub fn run_gathered(
        &mut self,
        format: &BundleFormat,
        groups: &[u32],
        a: &[f32],
        n_ff: usize,
        ys: &mut [f32],
    ) -> Result<(), KernelError> {
        let (ty, d, g) = (format.down_ty, format.n_embd, format.group());
        if !self.begun.is_some_and(|b| b.is(ty, d, n_ff)) {
            return Err(KernelError::UnsupportedType(format!(
                "a {ty} tile product over a layer that was not begun"
            )));
        }
        let n_groups = n_ff / g;
        check_groups(groups, n_groups)?;
        check_rows(d, n_ff, a, ys)?;
        if groups.len() < n_groups {
            let (blk, row_bytes) = (block_bytes(ty)?, ty.row_bytes(n_ff)?);
            let matrix = self.matrix_for(d * row_bytes);
            let mut present = groups.iter().peekable();
            for grp in 0..n_groups {
                if present.next_if(|&&x| x as usize == grp).is_some() {
                    continue;
                }
                for row in matrix.chunks_exact_mut(row_bytes) {
                    row[grp * blk..(grp + 1) * blk].fill(0);
                }
            }
        }
        self.begun = None;
        self.product(format, groups, a, n_ff, ys, true)
    }

    /// The gathered matrix's first `len` bytes (grown, never shrunk).
    fn matrix_for(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.matrix.len() < words {
            self.matrix.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.matrix)[..len]
    }

    /// The product over the gathered matrix, the activations of the groups
    /// not in `groups` taken as 0.
    fn product(
        &mut self,
        format: &BundleFormat,
        groups: &[u32],
        a: &[f32],
        n_ff: usize,
        ys: &mut [f32],
        fast: bool,
    ) -> Result<(), KernelError> {
        let (ty, d, g) = (format.down_ty, format.n_embd, format.group());
        let n = check_rows(d, n_ff, a, ys)?;
        let n_groups = n_ff / g;
        let row_bytes = ty.row_bytes(n_ff)?;
        // Absent groups count as 0 whatever `a` holds there. The product
        // keeps the full width: dropping columns would move the remaining
        // blocks to other SIMD lanes and change the rounding.
        if groups.len() == n_groups {
            self.convert(ty, a, n, n_ff)?;
        } else {
            if self.values.len() < n * n_ff {
                self.values.resize(n * n_ff, 0.0);
            }
            let values = &mut self.values[..n * n_ff];
            values.fill(0.0);
            for (dst, src) in values.chunks_exact_mut(n_ff).zip(a.chunks_exact(n_ff)) {
                for &grp in groups {
                    let at = grp as usize * g;
                    dst[at..at + g].copy_from_slice(&src[at..at + g]);
                }
            }
            let values = std::mem::take(&mut self.values);
            let converted = self.convert(ty, &values[..n * n_ff], n, n_ff);
            self.values = values;
            converted?;
        }
        let matrix = &bytemuck::cast_slice::<u64, u8>(&self.matrix)[..d * row_bytes];
        let w = QMatrix::new(ty, d, n_ff, matrix)?;
        if fast {
            matmul(&w, &self.acts, ys)
        } else {
            matmul_scalar(&w, &self.acts, ys)
        }
    }

    /// Converts `n` rows of `cols` activations to `ty`'s vec-dot type.
    fn convert(&mut self, ty: GgmlType, a: &[f32], n: usize, cols: usize) -> Result<(), KernelError> {
        if self.acts_len < n * cols {
            let alone = self.acts.rows_alone();
            self.acts = ActBuffer::with_capacity(cols, n);
            self.acts.set_rows_alone(alone);
            self.acts_len = n * cols;
        }
        self.acts.quantize(ty.vec_dot_type(), a, n, cols)
    }
}

/// Group ids of a call: strictly ascending and below `n_groups`.
fn check_groups(groups: &[u32], n_groups: usize) -> Result<(), KernelError> {
    if groups.windows(2).any(|w| w[0] >= w[1]) || groups.last().is_some_and(|&x| x as usize >= n_groups) {
        return Err(KernelError::Length {
            what: "tile groups (ascending, below n_ff / group)",
            expected: n_groups,
            got: groups.last().map_or(0, |&x| x as usize),
        });
    }
    Ok(())
}

/// Rows of a down call: `a` is `[n][n_ff]` and `ys` `[n][n_embd]`.
fn check_rows(n_embd: usize, n_ff: usize, a: &[f32], ys: &[f32]) -> Result<usize, KernelError> {
    if n_embd == 0 || n_ff == 0 || !ys.len().is_multiple_of(n_embd) || a.len() != ys.len() / n_embd * n_ff {
        return Err(KernelError::Length {
            what: "down rows (activations per output row)",
            expected: ys.len() / n_embd.max(1) * n_ff,
            got: a.len(),
        });
    }
    Ok(ys.len() / n_embd)
}

/// The down matrix (`n_embd` rows of `n_ff`, row-major, the source's
/// layout) in `dst`, the blocks of `groups` (ascending) taken from their
/// neurons' bundles and every other group's blocks zero (weights 0, so
/// their products are exact zeros at the same positions as in the source
/// product). Parallel over output rows when `parallel` (a copy: the bytes do
/// not depend on the split).
pub fn gather<'b>(
    format: &BundleFormat,
    n_ff: usize,
    groups: &[u32],
    bundle: &(impl Fn(usize) -> &'b [u8] + Sync),
    dst: &mut [u8],
    parallel: bool,
) -> Result<(), KernelError> {
    format.validate()?;
    let (ty, d, g) = (format.down_ty, format.n_embd, format.group());
    let (bb, p) = (block_bytes(ty)?, format.down_bytes());
    let n_groups = n_ff / g;
    let row_bytes = n_groups * bb;
    if format.down_layout != DownLayout::Tiles || !n_ff.is_multiple_of(g) || dst.len() != d * row_bytes {
        return Err(KernelError::ByteLength {
            what: "gathered down tiles",
            expected: d * row_bytes,
            got: dst.len(),
        });
    }
    check_groups(groups, n_groups)?;
    if groups.len() < n_groups {
        dst.fill(0);
    }
    // Rows r0.. of every group: per group, its parts once, then row by row.
    let rows = |r0: usize, out: &mut [u8]| -> Result<(), KernelError> {
        let mut part_refs = [&[][..]; MAX_GROUP];
        for &grp in groups {
            let j = grp as usize;
            let parts = &mut part_refs[..g];
            for (k, slot) in parts.iter_mut().enumerate() {
                *slot = format.down_part(bundle(grp as usize * g + k))?;
            }
            for (i, row) in out.chunks_exact_mut(row_bytes).enumerate() {
                copy_from_parts(parts, p, (r0 + i) * bb, &mut row[j * bb..(j + 1) * bb]);
            }
        }
        Ok(())
    };
    if !parallel || d < 2 * GATHER_TASK_ROWS {
        return rows(0, dst);
    }
    let tasks = rayon::current_num_threads().clamp(1, d / GATHER_TASK_ROWS);
    let per_task = d.div_ceil(tasks);
    dst.par_chunks_mut(per_task * row_bytes)
        .enumerate()
        .try_for_each(|(t, out)| rows(t * per_task, out))
}

/// `out.len()` bytes of a tile from offset `at`, the tile being `parts`
/// (each `p` bytes) back to back.
#[inline]
fn copy_from_parts(parts: &[&[u8]], p: usize, at: usize, out: &mut [u8]) {
    let (k, off) = (at / p, at % p);
    if off + out.len() <= p {
        out.copy_from_slice(&parts[k][off..off + out.len()]);
        return;
    }
    let mut done = 0;
    let (mut k, mut off) = (k, off);
    while done < out.len() {
        let take = (p - off).min(out.len() - done);
        out[done..done + take].copy_from_slice(&parts[k][off..off + take]);
        done += take;
        k += 1;
        off = 0;
    }
}

/// Copies `part`, whole blocks of `B` bytes, one block per matrix row
/// starting at `dst[0]`, rows `row_bytes` apart.
#[inline]
fn put_blocks<const B: usize>(part: &[u8], dst: &mut [u8], row_bytes: usize) {
    for (r, block) in part.chunks_exact(B).enumerate() {
        dst[r * row_bytes..r * row_bytes + B].copy_from_slice(block);
    }
}

/// Copies `part` into blocks of `block` bytes one matrix row apart, the
/// first piece starting `offset` bytes into its block at `dst[0]`.
fn put_pieces(part: &[u8], dst: &mut [u8], mut offset: usize, block: usize, row_bytes: usize) {
    let (mut at, mut src) = (0, part);
    while !src.is_empty() {
        let take = (block - offset).min(src.len());
        dst[at + offset..at + offset + take].copy_from_slice(&src[..take]);
        src = &src[take..];
        (at, offset) = (at + row_bytes, 0);
    }
}
