//! The KV cache: keys and values in f16 for every layer and position, laid
//! out for the attention path that reads them (see `attention.rs`).

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::config::Config;
use crate::{Result, RuntimeError};

/// The standard attention path sums in groups of this many cells,
/// aligned to cell 0 (see `attention::standard`).
pub(super) const LANES: usize = 64;

/// llama.cpp's default micro-batch (`n_ubatch`): a batch is placed in the
/// cache this many tokens at a time, and the sliding-window cache holds this
/// many cells beyond the window. A state made for larger batches runs as
/// llama.cpp with `-ub` that large.
pub const UBATCH: usize = 512;

/// Keys as `[layer][cell][kv_head * head_dim]`. Values the same way for
/// flash attention (which adds one value row per cell), or transposed as
/// `[layer][kv_head][dim][cell]` for the standard path (whose product of
/// probabilities and values is then a contiguous dot per dimension), as
/// llama.cpp lays them out for each.
///
/// Cell `p` holds position `p`, except on sliding-window layers: there, as
/// in llama.cpp's separate sliding-window cache, positions go to the cells
/// of a ring its slot search picks ([`SwaCells`]). The order of cells is the
/// order attention sums in, so matching llama.cpp past the ring's size
/// takes the same cells.
pub struct KvCache {
    k: Vec<f16>,
    v: Vec<f16>,
    pub(super) ctx: usize,
    kv_dim: usize,
    head_dim: usize,
    value_rows: bool,
    swa: Option<SwaCells>,
    swa_layers: Vec<bool>,
    /// Cells of the sliding-window layers for the positions of the batch being run.
    batch_cells: Vec<usize>,
    batch_pos0: usize,
}

impl KvCache {
    /// A cache for `ctx` positions run in batches of up to `max_batch`.
    pub(super) fn new(c: &Config, ctx: usize, max_batch: usize, value_rows: bool) -> Self {
        let ubatch = max_batch.max(UBATCH);
        let swa = match c.sliding_window {
            Some(w) if c.swa_layers.iter().any(|&s| s) => {
                Some(SwaCells::new(swa_cache_cells(ctx, w, ubatch), w, ubatch))
            }
            _ => None,
        };
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
            swa,
            swa_layers: c.swa_layers.clone(),
            batch_cells: Vec::with_capacity(max_batch),
            batch_pos0: 0,
        }
    }

    /// Makes room for positions `pos0..pos0 + n`: anything held at `pos0` or later is dropped first (a
    /// sequence restarted or rewound), then the sliding-window layers' cells
    /// are picked as llama.cpp picks them.
    pub(super) fn place(&mut self, pos0: usize, n: usize) -> Result<()> {
        self.batch_pos0 = pos0;
        self.batch_cells.clear();
        let Some(swa) = &mut self.swa else { return Ok(()) };
        if pos0 == 0 {
            // A new sequence: llama.cpp clears its cache.
            swa.clear();
        } else {
            swa.remove(pos0..usize::MAX);
        }
        swa.place(pos0, n, &mut self.batch_cells)?;
        // The ring holds the window plus a whole batch (`new`), so no
        // position of this batch took a cell another one still needs.
        debug_assert!((0..n).all(|i| swa.pos[self.batch_cells[i]] == Some(pos0 + i)));
        Ok(())
    }

    /// The cell of `pos` (a position of the batch being run) on `layer`.
    pub(super) fn cell(&self, layer: usize, pos: usize) -> usize {
        match &self.swa {
            Some(_) if self.swa_layers[layer] => self.batch_cells[pos - self.batch_pos0],
            _ => pos,
        }
    }

    /// Whether `layer`'s cells hold positions out of order (a sliding-window
    /// ring that wrapped): attention must then look up each cell's position.
    pub(super) fn wrapped(&self, layer: usize) -> bool {
        matches!(&self.swa, Some(s) if self.swa_layers[layer] && s.wrapped)
    }

    /// The position held by `cell` of a sliding-window layer.
    pub(super) fn swa_position(&self, cell: usize) -> Option<usize> {
        self.swa.as_ref().and_then(|s| s.pos.get(cell).copied().flatten())
    }

    /// Whether a sequence can go on at position `pos` with what the cache
    /// holds of positions `0..pos`: a sliding-window ring that wrapped may
    /// have dropped positions the next queries still see (llama.cpp's
    /// server then runs the prompt again, and so should callers).
    pub fn resumable(&self, pos: usize) -> bool {
        match &self.swa {
            Some(s) => s.holds(pos.saturating_sub(s.window.saturating_sub(1))..pos),
            None => true,
        }
    }

    /// Cells of the sliding-window layers' cache, if the model has them.
    pub(super) fn swa_size(&self) -> Option<usize> {
        self.swa.as_ref().map(|s| s.pos.len())
    }

    /// One past the last cell in use on `layer` after the batch ending at `end`.
    pub(super) fn used_cells(&self, layer: usize, end: usize) -> usize {
        match &self.swa {
            Some(s) if self.swa_layers[layer] => s.used_max_p1(),
            _ => end,
        }
    }

    pub(super) fn store(&mut self, layer: usize, cell: usize, k: &[f32], v: &[f32]) {
        let base = (layer * self.ctx + cell) * self.kv_dim;
        // F16C where the CPU has it: the same rounding (to nearest even).
        let to_f16 = |dst: &mut [f16], src: &[f32]| dst.convert_from_f32_slice(src);
        to_f16(&mut self.k[base..base + self.kv_dim], k);
        if self.value_rows {
            to_f16(&mut self.v[base..base + self.kv_dim], v);
            return;
        }
        let layer_base = layer * self.kv_dim * self.ctx;
        for (i, &src) in v.iter().enumerate() {
            // i = kv_head * head_dim + dim, which is also the row index in the transposed layout.
            self.v[layer_base + i * self.ctx + cell] = f16::from_f32(src);
        }
    }

    /// Where one kv head's row of `cell` lies in the key (and value-row) layout.
    fn head_row(&self, layer: usize, cell: usize, kv_head: usize) -> std::ops::Range<usize> {
        let base = (layer * self.ctx + cell) * self.kv_dim + kv_head * self.head_dim;
        base..base + self.head_dim
    }

    pub(super) fn key(&self, layer: usize, cell: usize, kv_head: usize) -> &[f16] {
        &self.k[self.head_row(layer, cell, kv_head)]
    }

    /// The value row of one kv head at `cell` (value-row layout only).
    pub(super) fn value(&self, layer: usize, cell: usize, kv_head: usize) -> &[f16] {
        debug_assert!(self.value_rows);
        &self.v[self.head_row(layer, cell, kv_head)]
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

    /// A copy of the keys and values of positions `0..n` of every layer, or
    /// `None` when a sliding-window ring no longer holds them all in place.
    pub fn save_prefix(&self, n: usize) -> Option<KvPrefix> {
        if let Some(s) = &self.swa {
            if (0..n).any(|p| s.pos.get(p).copied().flatten() != Some(p)) {
                return None;
            }
        }
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
        Some(KvPrefix {
            n,
            k,
            v,
            value_rows: self.value_rows,
        })
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
        if let Some(s) = &mut self.swa {
            s.restore_prefix(n);
        }
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

    /// Whether `other` holds the same positions with the same bits.
    pub fn same_bits(&self, other: &KvPrefix) -> bool {
        let bits =
            |x: &[f16], y: &[f16]| x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
        self.n == other.n && self.value_rows == other.value_rows && bits(&self.k, &other.k) && bits(&self.v, &other.v)
    }
}

/// Cells of llama.cpp's sliding-window cache for a context of `ctx`: the
/// window plus a micro-batch of `ubatch`, rounded up to 256, at most the
/// whole context (itself rounded up to 256).
pub fn swa_cache_cells(ctx: usize, window: usize, ubatch: usize) -> usize {
    let pad = |x: usize| x.div_ceil(256) * 256;
    pad(pad(ctx).min(window + ubatch))
}

/// Which position each cell of llama.cpp's sliding-window KV cache holds,
/// for one sequence: its slot search (`llama_kv_cache::find_slot`, cells
/// taken one by one from the head, empty or out of every later query's
/// window), its placement (`apply_ubatch`, which then purges older
/// positions so the cache holds a contiguous run) and its removal
/// (`seq_rm`), reproduced so the same positions land in the same cells.
pub struct SwaCells {
    window: usize,
    /// Positions placed at a time.
    ubatch: usize,
    pos: Vec<Option<usize>>,
    head: usize,
    /// Some cell holds a position other than its own index.
    wrapped: bool,
}

impl SwaCells {
    pub fn new(cells: usize, window: usize, ubatch: usize) -> Self {
        Self {
            window,
            ubatch,
            pos: vec![None; cells],
            head: 0,
            wrapped: false,
        }
    }

    /// Every cell empty, the head at 0 (`llama_kv_cache::clear`).
    fn clear(&mut self) {
        self.pos.fill(None);
        self.head = 0;
        self.wrapped = false;
    }

    fn used(&self) -> usize {
        self.pos.iter().filter(|p| p.is_some()).count()
    }

    fn used_max_p1(&self) -> usize {
        self.pos.iter().rposition(Option::is_some).map_or(0, |i| i + 1)
    }

    /// Empties the cells holding positions in `range` (`seq_rm`).
    pub fn remove(&mut self, range: std::ops::Range<usize>) {
        let mut first = None;
        for (i, p) in self.pos.iter_mut().enumerate() {
            if matches!(p, Some(x) if range.contains(x)) {
                *p = None;
                first.get_or_insert(i);
            }
        }
        if let Some(f) = first {
            self.head = self.head.min(f);
        }
        if self.pos.iter().all(Option::is_none) {
            self.wrapped = false;
        }
    }

    /// Places positions `pos0..pos0 + n`, a micro-batch at a time, pushing
    /// their cells to `cells`.
    pub fn place(&mut self, pos0: usize, n: usize, cells: &mut Vec<usize>) -> Result<()> {
        let mut done = 0;
        while done < n {
            let m = (n - done).min(self.ubatch);
            self.place_ubatch(pos0 + done, m, cells)?;
            done += m;
        }
        Ok(())
    }

    fn place_ubatch(&mut self, pos0: usize, n: usize, cells: &mut Vec<usize>) -> Result<()> {
        let size = self.pos.len();
        let start = cells.len();
        if n > size {
            return Err(RuntimeError::Invalid(format!(
                "a micro-batch of {n} tokens does not fit the {size}-cell sliding-window cache"
            )));
        }
        // Find the slot without touching the cells.
        let next = self.pos.iter().flatten().max().map(|&m| m + 1);
        let mut head = if self.head > self.used() + 2 * n { 0 } else { self.head };
        let mut tested = 0;
        while cells.len() - start < n {
            if head >= size {
                tested += size - head;
                head = 0;
                continue;
            }
            let free = match (self.pos[head], next) {
                (None, _) => true,
                (Some(p), Some(next)) => next - p >= self.window,
                (Some(_), None) => false,
            };
            if free {
                cells.push(head);
            }
            head += 1;
            tested += 1;
            if cells.len() - start < n && tested >= size {
                cells.truncate(start);
                return Err(RuntimeError::Invalid(format!(
                    "no room for {n} positions from {pos0} in the {size}-cell sliding-window cache"
                )));
            }
        }
        // Place, then purge what precedes the positions overwritten.
        let mut overwritten = None;
        for (i, &c) in cells[start..].iter().enumerate() {
            if let Some(p) = self.pos[c] {
                overwritten = overwritten.max(Some(p));
            }
            self.pos[c] = Some(pos0 + i);
            self.wrapped |= c != pos0 + i;
        }
        if let (Some(max_rm), Some(&min)) = (overwritten, self.pos.iter().flatten().min()) {
            if min <= max_rm {
                self.remove(min..max_rm + 1);
            }
        }
        self.head = cells[cells.len() - 1] + 1;
        Ok(())
    }

    /// Whether every position of `range` sits in some cell.
    fn holds(&self, range: std::ops::Range<usize>) -> bool {
        let mut held = vec![false; range.len()];
        for &p in self.pos.iter().flatten() {
            if range.contains(&p) {
                held[p - range.start] = true;
            }
        }
        held.iter().all(|&h| h)
    }

    /// Cells `0..n` hold positions `0..n` and nothing else (a restored prefix).
    fn restore_prefix(&mut self, n: usize) {
        for (i, p) in self.pos.iter_mut().enumerate() {
            *p = (i < n).then_some(i);
        }
        self.head = n;
        self.wrapped = false;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn place(s: &mut SwaCells, pos0: usize, n: usize) -> Vec<usize> {
        let mut cells = Vec::new();
        s.place(pos0, n, &mut cells).unwrap();
        cells
    }

    /// Gemma 3's ring (window 512, 1024 cells) as llama.cpp fills it: in
    /// order until full, then from cell 0 over positions out of every later
    /// query's window, the next micro-batch after the previous one.
    #[test]
    fn positions_go_where_llama_cpp_puts_them() {
        assert_eq!(swa_cache_cells(2048, 512, 512), 1024);
        assert_eq!(swa_cache_cells(300, 512, 512), 512);
        let mut s = SwaCells::new(1024, 512, 512);
        assert_eq!(place(&mut s, 0, 1000), (0..1000).collect::<Vec<_>>()); // 512 + 488
        assert!(!s.wrapped);
        assert_eq!(place(&mut s, 1000, 24), (1000..1024).collect::<Vec<_>>());
        // Full: the next 211 take cells 0..211, whose positions left the window.
        assert_eq!(place(&mut s, 1024, 211), (0..211).collect::<Vec<_>>());
        assert!(s.wrapped);
        assert_eq!(s.used_max_p1(), 1024);
        // Decoding goes on at the head.
        assert_eq!(place(&mut s, 1235, 1), vec![211]);
        assert_eq!(s.pos[211], Some(1235));
        // The next micro-batch takes the cells after it, whose positions
        // (212..) are out of the window of 1236 and later.
        let next = place(&mut s, 1236, 300);
        assert_eq!(next, (212..512).collect::<Vec<_>>());
        // Every position the last query sees is still held.
        let last = 1535;
        let held: Vec<usize> = s.pos.iter().flatten().copied().filter(|&p| last - p < 512).collect();
        assert_eq!(held.len(), 512);
    }

    #[test]
    fn a_wrapped_ring_resumes_only_where_it_holds_the_window() {
        let mut s = SwaCells::new(1024, 512, 512);
        place(&mut s, 0, 512);
        place(&mut s, 512, 512);
        place(&mut s, 1024, 512);
        // Positions 0..512 were overwritten: going on at 1536 needs 1025..1536, held;
        // going back to 300 (a shared prefix) needs 0..300, gone.
        assert!(s.holds(1025..1536));
        assert!(!s.holds(0..300));
        assert!(s.holds(600..1000));
    }

    #[test]
    fn removing_positions_frees_their_cells_and_moves_the_head_back() {
        let mut s = SwaCells::new(512, 256, 256);
        place(&mut s, 0, 300);
        s.remove(200..usize::MAX);
        assert_eq!(s.used(), 200);
        assert_eq!(place(&mut s, 200, 10), (200..210).collect::<Vec<_>>());
        s.remove(0..usize::MAX);
        assert!(!s.wrapped && s.used() == 0);
    }

    #[test]
    fn a_micro_batch_larger_than_the_ring_is_an_error() {
        let mut s = SwaCells::new(256, 128, 512);
        let mut cells = Vec::new();
        let err = s.place(0, 300, &mut cells).unwrap_err().to_string();
        assert!(err.contains("256-cell sliding-window cache"), "{err}");
    }
}
