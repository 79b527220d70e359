//! The KV cache: keys and values in f16 for every layer and position, laid
//! out for the attention path that reads them (see `attention.rs`).

use half::f16;

use super::config::Config;
use crate::{Result, RuntimeError};

/// The standard attention path sums in groups of this many positions,
/// aligned to position 0 (see `attention::standard`).
pub(super) const LANES: usize = 64;

/// Keys as `[layer][pos][kv_head * head_dim]`. Values the same way for
/// flash attention (which adds one value row per position), or transposed
/// as `[layer][kv_head][dim][pos]` for the standard path (whose product of
/// probabilities and values is then a contiguous dot per dimension), as
/// llama.cpp lays them out for each.
pub struct KvCache {
    k: Vec<f16>,
    v: Vec<f16>,
    pub(super) ctx: usize,
    kv_dim: usize,
    head_dim: usize,
    value_rows: bool,
}

impl KvCache {
    pub(super) fn new(c: &Config, ctx: usize, value_rows: bool) -> Self {
        // Room for a whole group of LANES past the last position, which reads as zeros.
        let ctx = ctx.div_ceil(LANES) * LANES;
        let n = c.n_layer * ctx * c.kv_dim();
        Self {
            k: zeroed_f16(n),
            v: zeroed_f16(n),
            ctx,
            kv_dim: c.kv_dim(),
            head_dim: c.head_dim,
            value_rows,
        }
    }

    pub(super) fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let base = (layer * self.ctx + pos) * self.kv_dim;
        for (dst, &src) in self.k[base..base + self.kv_dim].iter_mut().zip(k) {
            *dst = f16::from_f32(src);
        }
        if self.value_rows {
            for (dst, &src) in self.v[base..base + self.kv_dim].iter_mut().zip(v) {
                *dst = f16::from_f32(src);
            }
            return;
        }
        let layer_base = layer * self.kv_dim * self.ctx;
        for (i, &src) in v.iter().enumerate() {
            // i = kv_head * head_dim + dim, which is also the row index in the transposed layout.
            self.v[layer_base + i * self.ctx + pos] = f16::from_f32(src);
        }
    }

    pub(super) fn key(&self, layer: usize, pos: usize, kv_head: usize) -> &[f16] {
        let base = (layer * self.ctx + pos) * self.kv_dim + kv_head * self.head_dim;
        &self.k[base..base + self.head_dim]
    }

    /// The value row of one kv head at `pos` (value-row layout only).
    pub(super) fn value(&self, layer: usize, pos: usize, kv_head: usize) -> &[f16] {
        debug_assert!(self.value_rows);
        let base = (layer * self.ctx + pos) * self.kv_dim + kv_head * self.head_dim;
        &self.v[base..base + self.head_dim]
    }

    /// Values of one dimension of one kv head over positions `lo..hi`
    /// (transposed layout only).
    pub(super) fn value_row(&self, layer: usize, kv_head: usize, dim: usize, lo: usize, hi: usize) -> &[f16] {
        debug_assert!(!self.value_rows);
        let row = layer * self.kv_dim * self.ctx + (kv_head * self.head_dim + dim) * self.ctx;
        &self.v[row + lo..row + hi]
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 2
    }

    fn layers(&self) -> usize {
        self.k.len() / (self.ctx * self.kv_dim).max(1)
    }

    /// A copy of the keys and values of positions `0..n` of every layer.
    pub fn save_prefix(&self, n: usize) -> KvPrefix {
        let (n, d, ctx) = (n.min(self.ctx), self.kv_dim, self.ctx);
        let rows = |x: &[f16]| {
            let mut out = Vec::with_capacity(self.layers() * n * d);
            for l in 0..self.layers() {
                out.extend_from_slice(&x[l * ctx * d..(l * ctx + n) * d]);
            }
            out
        };
        let k = rows(&self.k);
        let v = if self.value_rows {
            rows(&self.v)
        } else {
            let mut v = Vec::with_capacity(self.layers() * n * d);
            for row in 0..self.layers() * d {
                v.extend_from_slice(&self.v[row * ctx..row * ctx + n]);
            }
            v
        };
        KvPrefix {
            n,
            k,
            v,
            value_rows: self.value_rows,
        }
    }

    /// Puts back what [`save_prefix`](Self::save_prefix) copied: positions
    /// `0..p.len()` then hold what they held then.
    pub fn restore_prefix(&mut self, p: &KvPrefix) -> Result<()> {
        let (n, d, ctx) = (p.n, self.kv_dim, self.ctx);
        if n > ctx || p.k.len() != self.layers() * n * d || p.v.len() != p.k.len() || p.value_rows != self.value_rows {
            let layout = |rows: bool| if rows { "value rows" } else { "transposed values" };
            return Err(RuntimeError::Invalid(format!(
                "a saved KV prefix of {n} positions ({}) does not fit this cache ({ctx} positions, {d} wide, {})",
                layout(p.value_rows),
                layout(self.value_rows)
            )));
        }
        let layers = self.layers();
        let put_rows = |dst: &mut [f16], src: &[f16]| {
            for l in 0..layers {
                dst[l * ctx * d..(l * ctx + n) * d].copy_from_slice(&src[l * n * d..(l + 1) * n * d]);
            }
        };
        put_rows(&mut self.k, &p.k);
        if self.value_rows {
            put_rows(&mut self.v, &p.v);
        } else {
            for row in 0..layers * d {
                self.v[row * ctx..row * ctx + n].copy_from_slice(&p.v[row * n..(row + 1) * n]);
            }
        }
        Ok(())
    }
}

/// Keys and values of a prompt's first positions, kept to start a later
/// prompt with the same beginning without running it again.
pub struct KvPrefix {
    n: usize,
    k: Vec<f16>,
    v: Vec<f16>,
    value_rows: bool,
}

impl KvPrefix {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 2
    }
}

/// `n` zeros in one zeroed allocation, whose pages the OS maps only when
/// first written: a cache sized for a long context holds memory only for the
/// positions used, and a process refused by its memory budget (or killed by
/// a cgroup) is not charged for it up front. (`vec![f16::ZERO; n]` writes
/// every element.)
fn zeroed_f16(n: usize) -> Vec<f16> {
    let mut v = std::mem::ManuallyDrop::new(vec![0u16; n]);
    // SAFETY: `f16` is `repr(transparent)` over `u16` (same size, alignment
    // and bit pattern for 0), and the allocation is handed over whole.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<f16>(), v.len(), v.capacity()) }
}
