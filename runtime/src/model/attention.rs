//! Attention of a batch of queries against the KV cache, by either of
//! llama.cpp's CPU paths, each reproduced bit for bit: the standard one
//! (`-fa off`: all scores, a softmax, probabilities rounded to f16, then the
//! values) and flash attention (`-fa on`, and what llama.cpp's default
//! `auto` picks on a CPU: an online softmax over one cell at a time or over
//! tiles, see `leanstream_kernels::flash_attn`).

use std::ops::Range;
use std::str::FromStr;

use half::f16;
use half::slice::HalfFloatSliceExt;
use leanstream_kernels::f16dot::{dot_f16_f32_gemm, dot_f16_gemm, dot_f16_gemm_rows, dot_f16_vec, GEMM_TILE_ROWS};
use leanstream_kernels::flash_attn::{self, KvHead, Route, Tile, Q_TILE};
use leanstream_kernels::ops;
use rayon::prelude::*;

use super::config::Config;
use super::kv_cache::{KvCache, LANES};
use crate::RuntimeError;

/// Which attention path runs (llama.cpp's `--flash-attn`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashAttn {
    /// As llama.cpp decides: on wherever the device runs flash attention,
    /// which the CPU does.
    #[default]
    Auto,
    On,
    Off,
}

impl FlashAttn {
    pub fn enabled(self) -> bool {
        self != FlashAttn::Off
    }
}

impl FromStr for FlashAttn {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, RuntimeError> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(RuntimeError::Invalid(format!(
                "flash attention \"{other}\": expected auto, on or off"
            ))),
        }
    }
}

impl std::fmt::Display for FlashAttn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// Attention score scratch of the standard path is processed in waves of
/// (token, head) pairs so its size is bounded whatever the batch and context.
const SCORE_SCRATCH: usize = 1 << 20;

/// Tiles of the flash path computed at once per thread (more waves otherwise).
const TILES_PER_THREAD: usize = 2;

/// (token, head) pairs of the flash path's vector routes computed at once.
const VECTOR_WAVE: usize = 64;

/// An attention path with the scratch it needs, allocated once.
pub(super) struct Attention {
    flash: bool,
    /// The context the state was made for (llama.cpp's `n_ctx`).
    ctx: usize,
    // Standard path: q in f16, scores, probabilities.
    q16: Vec<f16>,
    scores: Vec<f32>,
    probs: Vec<f16>,
    /// Flash path: per-query or per-tile scratch of a wave.
    work: Vec<f32>,
}

impl Attention {
    pub(super) fn new(c: &Config, ctx: usize, max_batch: usize, flash: bool) -> Self {
        let b = max_batch.max(1);
        if flash {
            let threads = rayon::current_num_threads().max(1);
            let hd = c.head_dim;
            // A decode step's heads in one wave; longer batches take several.
            let pairs = (c.n_head * b.min(Q_TILE - 1)).min(c.n_head.max(VECTOR_WAVE));
            let vector = pairs * flash_attn::vector_scratch_len(hd);
            let tiles = if b >= Q_TILE {
                (c.n_head * b.div_ceil(Q_TILE)).min(TILES_PER_THREAD * threads) * tile_item_len(hd)
            } else {
                0
            };
            return Self {
                flash,
                ctx,
                q16: Vec::new(),
                scores: Vec::new(),
                probs: Vec::new(),
                work: vec![0.0; vector.max(tiles)],
            };
        }
        // One wave holds every (token, head) pair of a batch when that is
        // smaller than the bound: a short context needs little scratch.
        let ctx_padded = ctx.div_ceil(LANES) * LANES;
        // At least one token's heads that share a kv head (the unit of work).
        let group = c.n_head / c.n_head_kv.max(1);
        let score_len = SCORE_SCRATCH.min(b * c.n_head * ctx_padded).max(group * ctx_padded);
        Self {
            flash,
            ctx,
            q16: vec![f16::ZERO; b * c.q_dim()],
            scores: vec![0.0; score_len],
            probs: vec![f16::ZERO; score_len],
            work: Vec::new(),
        }
    }

    pub(super) fn is_flash(&self) -> bool {
        self.flash
    }

    pub(super) fn bytes(&self) -> usize {
        (self.scores.len() + self.work.len()) * 4 + (self.q16.len() + self.probs.len()) * 2
    }

    /// Causal (and, on sliding layers, windowed) attention of the query
    /// rows `q` (`[token][head * head_dim]`, the first at `pos0`) against
    /// the cache, written to `out` in the same layout.
    pub(super) fn run(&mut self, c: &Config, layer: usize, kv: &KvCache, q: &[f32], pos0: usize, out: &mut [f32]) {
        if self.flash {
            return self.run_flash(c, layer, kv, q, pos0, out);
        }
        let q16 = &mut self.q16[..q.len()];
        // F16C where the CPU has it: the same rounding (to nearest even).
        q16.convert_from_f32_slice(q);
        standard(c, layer, kv, q16, pos0, &mut self.scores, &mut self.probs, out);
    }

    fn run_flash(&mut self, c: &Config, layer: usize, kv: &KvCache, q: &[f32], pos0: usize, out: &mut [f32]) {
        let (hd, q_dim) = (c.head_dim, c.q_dim());
        let group = c.n_head / c.n_head_kv;
        let n = q.len() / q_dim;
        let threads = rayon::current_num_threads().max(1);
        let cells = cache_view(c, layer, kv, self.ctx, kv.used_cells(layer, pos0 + n));
        let vis = Visibility::new(c, layer, kv, pos0 + n);
        let visible = |t: usize| vis.range(pos0 + t);
        let sees = |t: usize, cell: usize| vis.sees(pos0 + t, cell);
        let head = |h: usize| CacheHead {
            kv,
            layer,
            kv_head: h / group,
        };
        let route = flash_attn::route(n, cells, threads);
        if route == Route::Tiled {
            let item = tile_item_len(hd);
            let items = c.n_head * n.div_ceil(Q_TILE);
            // `new` sized the scratch for at least one tile (batches of 64+).
            debug_assert!(self.work.len() >= item);
            let wave = (self.work.len() / item).clamp(1, items);
            for start in (0..items).step_by(wave) {
                let end = (start + wave).min(items);
                // Item i: head i % n_head, queries from (i / n_head) * Q_TILE.
                let rows_of = |i: usize| {
                    let t0 = i / c.n_head * Q_TILE;
                    (i % c.n_head, t0, Q_TILE.min(n - t0))
                };
                self.work[..(end - start) * item]
                    .par_chunks_mut(item)
                    .enumerate()
                    .for_each(|(i, s)| {
                        let (h, t0, rows) = rows_of(start + i);
                        let (qt, rest) = s.split_at_mut(Q_TILE * hd);
                        let (ot, scratch) = rest.split_at_mut(Q_TILE * hd);
                        for r in 0..rows {
                            qt[r * hd..(r + 1) * hd].copy_from_slice(&q[(t0 + r) * q_dim + h * hd..][..hd]);
                        }
                        let (qt, ot) = (&qt[..rows * hd], &mut ot[..rows * hd]);
                        let tile = Tile {
                            q: qt,
                            head_dim: hd,
                            cells,
                            scale: c.kq_scale,
                        };
                        flash_attn::tiled(
                            &head(h),
                            tile,
                            |r| visible(t0 + r),
                            |r, cell| sees(t0 + r, cell),
                            scratch,
                            ot,
                        );
                    });
                for (i, s) in self.work[..(end - start) * item].chunks(item).enumerate() {
                    let (h, t0, rows) = rows_of(start + i);
                    let ot = &s[Q_TILE * hd..];
                    for r in 0..rows {
                        out[(t0 + r) * q_dim + h * hd..][..hd].copy_from_slice(&ot[r * hd..(r + 1) * hd]);
                    }
                }
            }
            return;
        }
        let item = flash_attn::vector_scratch_len(hd);
        let pairs = n * c.n_head;
        debug_assert!(self.work.len() >= item);
        let wave = (self.work.len() / item).clamp(1, pairs);
        for start in (0..pairs).step_by(wave) {
            let end = (start + wave).min(pairs);
            out[start * hd..end * hd]
                .par_chunks_mut(hd)
                .zip(self.work.par_chunks_mut(item))
                .enumerate()
                .for_each(|(i, (o, s))| {
                    let pair = start + i;
                    let (t, h) = (pair / c.n_head, pair % c.n_head);
                    let qr = &q[pair * hd..(pair + 1) * hd];
                    match route {
                        Route::Split { chunks } => flash_attn::split(
                            &head(h),
                            qr,
                            visible(t),
                            |cell| sees(t, cell),
                            cells,
                            chunks,
                            c.kq_scale,
                            s,
                            o,
                        ),
                        _ => flash_attn::vector(&head(h), qr, visible(t), |cell| sees(t, cell), c.kq_scale, s, o),
                    }
                });
        }
    }
}

/// f32 scratch of one tile of the flash path: gathered queries, outputs, kernel scratch.
fn tile_item_len(head_dim: usize) -> usize {
    2 * Q_TILE * head_dim + flash_attn::tile_scratch_len(head_dim)
}

/// Cells of llama.cpp's KV cache view when `used` cells are in use: a
/// multiple of 256, capped at the cache's size (`n_ctx` rounded up to 256;
/// the sliding-window layers' own cache is smaller, see
/// `kv_cache::swa_cache_cells`). It decides, as there, whether a single
/// query's cells are split across threads, and where.
fn cache_view(c: &Config, layer: usize, kv: &KvCache, ctx: usize, used: usize) -> usize {
    let pad = |x: usize| x.div_ceil(256) * 256;
    let size = match kv.swa_size() {
        Some(cells) if c.swa_layers[layer] => cells,
        _ => pad(ctx),
    };
    size.min(pad(used).max(256))
}

/// `each(h, dots)` for every head `h < heads`, where `dots[k]` is
/// `dot_f16_gemm(row(h), ys[k])`: the heads go through the GEMM tile up to
/// [`GEMM_TILE_ROWS`] at a time.
fn gemm_heads<'a>(
    heads: usize,
    row: impl Fn(usize) -> &'a [f16],
    ys: [&[f16]; 4],
    mut each: impl FnMut(usize, &[f32; 4]),
) {
    let mut dots = [[0.0f32; 4]; GEMM_TILE_ROWS];
    for h0 in (0..heads).step_by(GEMM_TILE_ROWS) {
        let rows = GEMM_TILE_ROWS.min(heads - h0);
        let xs: [&[f16]; GEMM_TILE_ROWS] = std::array::from_fn(|m| row(h0 + m.min(rows - 1)));
        dot_f16_gemm_rows(&xs[..rows], ys, &mut dots);
        for (m, d) in dots[..rows].iter().enumerate() {
            each(h0 + m, d);
        }
    }
}

/// Which cells a query sees on one layer: those from its window's start to
/// itself while cells hold their own positions, else (a sliding-window ring
/// that wrapped) every cell in use whose position is in the window.
struct Visibility<'a> {
    c: &'a Config,
    layer: usize,
    kv: &'a KvCache,
    wrapped: bool,
    /// Cells in use (wrapped rings).
    used: usize,
    window: Option<usize>,
}

impl<'a> Visibility<'a> {
    fn new(c: &'a Config, layer: usize, kv: &'a KvCache, end: usize) -> Self {
        Self {
            c,
            layer,
            kv,
            wrapped: kv.wrapped(layer),
            used: kv.used_cells(layer, end),
            window: c.sliding_window.filter(|_| c.swa_layers[layer]),
        }
    }

    /// Cells to look at for a query at `pos` (a superset of those it sees).
    fn range(&self, pos: usize) -> Range<usize> {
        if self.wrapped {
            0..self.used
        } else {
            self.c.first_visible(self.layer, pos)..pos + 1
        }
    }

    /// Whether a query at `pos` sees `cell` (one of its range).
    #[inline(always)]
    fn sees(&self, pos: usize, cell: usize) -> bool {
        if !self.wrapped {
            return true;
        }
        match self.kv.swa_position(cell) {
            Some(p) => p <= pos && self.window.is_none_or(|w| pos - p < w),
            None => false,
        }
    }
}

/// One kv head of one layer of the cache, for the flash kernels.
struct CacheHead<'a> {
    kv: &'a KvCache,
    layer: usize,
    kv_head: usize,
}

impl KvHead for CacheHead<'_> {
    fn key(&self, cell: usize) -> &[f16] {
        self.kv.key(self.layer, cell, self.kv_head)
    }

    fn value(&self, cell: usize) -> &[f16] {
        self.kv.value(self.layer, cell, self.kv_head)
    }
}

/// Causal (and, on sliding layers, windowed) attention of every query row in
/// `q16` against the cache, written to `out` as `[token][head * head_dim]`.
///
/// Scores and probabilities are laid out in groups of `LANES` aligned to
/// cache position 0, masked entries holding -inf (then 0), so the sums run in
/// the same groups as llama.cpp's over its padded cache.
#[allow(clippy::too_many_arguments)]
fn standard(
    c: &Config,
    layer: usize,
    kv: &KvCache,
    q16: &[f16],
    pos0: usize,
    scores: &mut [f32],
    probs: &mut [f16],
    out: &mut [f32],
) {
    let hd = c.head_dim;
    let group = c.n_head / c.n_head_kv;
    let pairs = out.len() / hd;
    let ctx = kv.ctx;
    // llama.cpp takes its GEMM route for batches and its vector route for one
    // query. Built for aarch64 (no FP16 arithmetic) its GEMM has no f16 × f16
    // kernel: q·k takes the vector route there too, and a batch's value
    // product is f16 values against the f32 probabilities (see f16dot.rs).
    let batch = pairs > c.n_head;
    let arm = cfg!(target_arch = "aarch64");
    let gemm = batch && !arm;
    let dot = if gemm { dot_f16_gemm } else { dot_f16_vec };
    let vis = Visibility::new(c, layer, kv, pos0 + pairs / c.n_head);
    // Work comes in units of one token's `group` heads that share a kv head
    // (consecutive pairs): the same cells and visibility, so their rows go
    // through the GEMM tile together.
    let wave = (scores.len() / ctx / group * group).clamp(group, pairs.max(group));
    for start in (0..pairs).step_by(wave) {
        let end = (start + wave).min(pairs);
        out[start * hd..end * hd]
            .par_chunks_mut(group * hd)
            .zip(scores.par_chunks_mut(group * ctx))
            .zip(probs.par_chunks_mut(group * ctx))
            .enumerate()
            .for_each(|(i, ((o, s), p))| {
                let first = start + i * group;
                let (t, kv_head) = (first / c.n_head, first % c.n_head / group);
                let pos = pos0 + t;
                let range = vis.range(pos);
                let (lo_a, hi_a) = (range.start / LANES * LANES, range.end.div_ceil(LANES) * LANES);
                let width = hi_a - lo_a;
                let heads = o.len() / hd;
                let q = |h: usize| &q16[(first + h) * hd..(first + h + 1) * hd];
                let key = |at: usize| kv.key(layer, at, kv_head);
                for h in 0..heads {
                    s[h * ctx..h * ctx + width].fill(f32::NEG_INFINITY);
                }
                let mut at = range.start;
                if gemm && !vis.wrapped {
                    // Four keys per call against the heads; each sum keeps its order.
                    while at + 4 <= range.end {
                        let keys = [key(at), key(at + 1), key(at + 2), key(at + 3)];
                        gemm_heads(heads, q, keys, |h, dots| {
                            for (k, dk) in dots.iter().enumerate() {
                                s[h * ctx + at + k - lo_a] = dk * c.kq_scale;
                            }
                        });
                        at += 4;
                    }
                }
                for h in 0..heads {
                    let row = &mut s[h * ctx..h * ctx + width];
                    for at in at..range.end {
                        if vis.sees(pos, at) {
                            row[at - lo_a] = dot(key(at), q(h)) * c.kq_scale;
                        }
                    }
                    ops::softmax(row);
                    p[h * ctx..h * ctx + width].convert_from_f32_slice(row);
                }
                let value = |dim: usize| kv.value_row(layer, kv_head, dim, lo_a, hi_a);
                let prob = |h: usize| &p[h * ctx..h * ctx + width];
                let mut dim = 0;
                if gemm {
                    while dim + 4 <= hd {
                        let values = [value(dim), value(dim + 1), value(dim + 2), value(dim + 3)];
                        gemm_heads(heads, prob, values, |h, dots| {
                            o[h * hd + dim..][..4].copy_from_slice(dots)
                        });
                        dim += 4;
                    }
                }
                for h in 0..heads {
                    let prob_f32 = &s[h * ctx..h * ctx + width];
                    for (d, od) in o[h * hd..(h + 1) * hd].iter_mut().enumerate().skip(dim) {
                        *od = if batch && arm {
                            dot_f16_f32_gemm(value(d), prob_f32)
                        } else {
                            dot(value(d), prob(h))
                        };
                    }
                }
            });
    }
}
