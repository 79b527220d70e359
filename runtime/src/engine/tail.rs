//! The shared tail of every policy: take the layer's bundles as they become
//! available (all at once when resident, cache hits first and then runs in
//! arrival order when streamed), compute stage 1 over each run with the
//! blocked kernels, keep what the selection says, then stage 2 over the kept
//! neurons in ascending id (down columns), or the source's own down product
//! over the groups used (down tiles: with every group, the GGUF engine's
//! bits). A streamed run's bundles are let go once stage 1 has seen them,
//! so stage 2's operand is copied out as each run is taken: the kept
//! neurons' down columns, or every neuron's tile part into the gathered
//! down matrix; only the first runs of a layer that the streamer keeps
//! until the layer is done are read in place. Stage 1's values are pure
//! functions of a bundle and a row, and stage 2's order is fixed, so the
//! output does not depend on arrival order, run boundaries, which runs
//! were kept, batch size or thread count: every policy that keeps the same
//! neurons gets the same bits.

use std::time::Instant;

use leanstream_kernels::sparse_ffn::{
    run_activations, run_activations_split, run_activations_strided, run_down, run_down_columns, BundleFormat,
    DownLayout, DownTiles, FfnActivation, FfnRows,
};
use leanstream_kernels::ActBuffer;
use rayon::prelude::*;

use super::plan::{keeps, CallCost, Plan, Select};
use super::resident::Resident;
use super::source::Source;
use super::stream::{LandedRun, Streamer};
use super::trace::{bit_is_set, set_bit, widen_to_groups};
use crate::Result;

/// Stage-1 values per piece of a run (bundles × rows): bounds the scratch
/// while letting one decode row take a whole layer in one parallel call.
const PIECE_VALUES: usize = 1 << 15;
/// Fewest bundles per parallel task of stage 1.
const TASK: usize = 32;
/// Stage-1 tasks per worker thread of a piece.
const TASKS_PER_THREAD: usize = 4;
/// Cache hits gathered per stage-1 call.
const HIT_BATCH: usize = 256;
/// Unwanted neurons a resident layer's stage-1 run steps over (computing
/// them) rather than starting a new call.
const RESIDENT_GAP: usize = 16;

/// Stage-1 input: whole bundles back to back, or the same neurons' gate
/// rows and up rows held apart.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Bundles(&'a [u8]),
    Split {
        gate: &'a [u8],
        up: &'a [u8],
    },
    /// `count` bundles `stride` bytes apart (cache slots).
    Strided {
        bytes: &'a [u8],
        stride: usize,
        count: usize,
    },
}

impl<'a> Rows<'a> {
    fn count(&self, f: &BundleFormat) -> usize {
        match self {
            Self::Bundles(b) => b.len() / f.bundle_bytes().max(1),
            Self::Split { gate, .. } => gate.len() / f.gate_bytes().max(1),
            Self::Strided { count, .. } => *count,
        }
    }

    /// Neurons `i..j` of the run.
    fn slice(&self, f: &BundleFormat, i: usize, j: usize) -> Rows<'a> {
        match *self {
            Self::Bundles(b) => Self::Bundles(&b[i * f.bundle_bytes()..j * f.bundle_bytes()]),
            Self::Split { gate, up } => {
                let (gb, ub) = (f.gate_bytes(), f.up_bytes());
                Self::Split {
                    gate: &gate[i * gb..j * gb],
                    up: &up[i * ub..j * ub],
                }
            }
            Self::Strided { bytes, stride, .. } => Self::Strided {
                bytes: if j > i {
                    &bytes[i * stride..(j - 1) * stride + f.bundle_bytes()]
                } else {
                    &[]
                },
                stride,
                count: j - i,
            },
        }
    }

    fn activations(
        &self,
        f: &BundleFormat,
        rows: &FfnRows,
        act: FfnActivation,
        out: &mut [f32],
        scratch: &mut [f32],
    ) -> std::result::Result<(), leanstream_kernels::KernelError> {
        match *self {
            Self::Bundles(b) => run_activations(f, rows, act, b, out, scratch),
            Self::Split { gate, up } => run_activations_split(f, rows, act, gate, up, out, scratch),
            Self::Strided { bytes, stride, count } => {
                run_activations_strided(f, rows, act, bytes, stride, count, out, scratch)
            }
        }
    }
}

/// Scratch and counters of the FFN arithmetic, allocated once.
pub struct Tail {
    pub act: FfnActivation,
    n_embd: usize,
    n_ff: usize,
    gate_acts: ActBuffer,
    up_acts: ActBuffer,
    /// `[rows][n_ff]` kept activations (0: not kept).
    a: Vec<f32>,
    /// Stage-1 values of a piece, `[bundle][row]`, and the up dots.
    piece: Vec<f32>,
    scratch: Vec<f32>,
    /// Neurons stage 2 visits, ascending (down columns), or the groups (tiles).
    ids: Vec<u32>,
    down_tiles: DownTiles,
    /// A streamed layer's kept down columns by neuron id (`n_ff` × the
    /// column bytes; grown on the first streamed layer with columns).
    columns: Vec<u8>,
    /// A batch of cache hits gathered back to back (`HIT_BATCH` bundles;
    /// u64-backed, so block fields stay aligned as in a read buffer).
    hit_bundles: Vec<u64>,
    /// A layer's cache hits outside runs of consecutive slots.
    scattered: Vec<usize>,
    /// Neurons whose down column stage 2 reads from their (pinned) cache
    /// slot rather than from `columns`: a streamed layer's hits.
    in_cache: Vec<u64>,
    /// What a streamed layer computes with (its stage's want, less what did not land).
    have: Vec<u64>,
    /// A resident layer's want widened to whole down-tile groups.
    grouped: Vec<u64>,
    /// Neurons computed since the last refinement, and the partial output.
    fresh: Vec<u32>,
    collect: bool,
    partial: Vec<f32>,
    /// Rows the buffers are sized for (grown on a larger call, then kept).
    rows: usize,
    pub last: CallCost,
    pub kept: u64,
    pub considered: u64,
    /// Neuron rows whose gate and up products ran (stage 1), over every call.
    pub stage1_rows: u64,
    /// Wall time inside FFN calls (waits for bundles included).
    pub seconds: f64,
}

impl Tail {
    pub fn new(act: FfnActivation, n_embd: usize, n_ff: usize) -> Self {
        let mut t = Self {
            act,
            n_embd,
            n_ff,
            gate_acts: ActBuffer::with_capacity(n_embd, 1),
            up_acts: ActBuffer::with_capacity(n_embd, 1),
            a: Vec::new(),
            piece: Vec::new(),
            scratch: Vec::new(),
            ids: Vec::with_capacity(n_ff),
            down_tiles: DownTiles::new(),
            columns: Vec::new(),
            hit_bundles: Vec::new(),
            scattered: Vec::with_capacity(n_ff),
            in_cache: vec![0; n_ff.div_ceil(64)],
            have: vec![0; n_ff.div_ceil(64)],
            grouped: vec![0; n_ff.div_ceil(64)],
            fresh: Vec::new(),
            collect: false,
            partial: Vec::new(),
            rows: 0,
            last: CallCost::default(),
            kept: 0,
            considered: 0,
            stage1_rows: 0,
            seconds: 0.0,
        };
        t.reserve(1);
        t
    }

    /// Each row of the next calls computed with the bits of that row alone.
    pub fn set_rows_alone(&mut self, on: bool) {
        self.gate_acts.set_rows_alone(on);
        self.up_acts.set_rows_alone(on);
        self.down_tiles.set_rows_alone(on);
    }

    /// Values of one row.
    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// Words of one row bitmap.
    pub fn words(&self) -> usize {
        self.n_ff.div_ceil(64)
    }

    /// Bytes of scratch held.
    pub fn bytes(&self) -> u64 {
        Self::base_bytes(self.n_embd, self.n_ff, self.rows)
            + self.down_tiles.bytes()
            + (self.columns.len() + self.hit_bundles.len() * 8) as u64
    }

    /// Bytes of scratch for calls of up to `rows` rows over layers of
    /// `formats` (known before construction); `streamed` adds the store of
    /// a streamed layer's down columns and the batch of gathered cache hits.
    pub fn bytes_for(formats: &[BundleFormat], n_ff: usize, rows: usize, streamed: bool) -> u64 {
        let n_embd = formats.first().map_or(0, |f| f.n_embd);
        let tiles = formats
            .iter()
            .filter(|f| f.down_layout == DownLayout::Tiles)
            .map(|f| DownTiles::bytes_for(f.down_ty, n_embd, n_ff, rows))
            .max()
            .unwrap_or(0);
        let columns = if streamed {
            let max_bundle = formats.iter().map(|f| f.bundle_bytes()).max().unwrap_or(0);
            Self::columns_bytes(formats, n_ff) + HIT_BATCH * max_bundle
        } else {
            0
        };
        Self::base_bytes(n_embd, n_ff, rows) + tiles + columns as u64
    }

    /// Bytes of the down-column store for layers of `formats`.
    fn columns_bytes(formats: &[BundleFormat], n_ff: usize) -> usize {
        formats
            .iter()
            .filter(|f| f.down_layout == DownLayout::Columns)
            .map(|f| f.down_bytes() * n_ff)
            .max()
            .unwrap_or(0)
    }

    fn base_bytes(n_embd: usize, n_ff: usize, rows: usize) -> u64 {
        let rows = rows.max(1);
        // Two converted input buffers (f32 is the widest), the activation rows,
        // a piece's two value arrays, the id list.
        (2 * n_embd * rows * 4 + rows * n_ff * 4 + 2 * Self::piece_values(rows) * 4 + n_ff * 4) as u64
    }

    /// Bundles per piece for calls of `rows` rows.
    fn piece(rows: usize) -> usize {
        (PIECE_VALUES / rows.max(1)).max(TASK)
    }

    /// Values a piece of calls of up to `rows` rows holds: `piece(n) * n` for
    /// every `n <= rows`.
    fn piece_values(rows: usize) -> usize {
        PIECE_VALUES.max(TASK * rows.max(1))
    }

    fn reserve(&mut self, n: usize) {
        if n <= self.rows {
            return;
        }
        self.rows = n;
        let alone = self.gate_acts.rows_alone();
        self.gate_acts = ActBuffer::with_capacity(self.n_embd, n);
        self.up_acts = ActBuffer::with_capacity(self.n_embd, n);
        self.gate_acts.set_rows_alone(alone);
        self.up_acts.set_rows_alone(alone);
        self.a = vec![0.0; n * self.n_ff];
        self.piece = vec![0.0; Self::piece_values(n)];
        self.scratch = vec![0.0; Self::piece_values(n)];
    }

    /// The last call's kept activations, `[n][n_ff]` (0: not kept).
    pub(crate) fn kept_acts(&self, n: usize) -> &[f32] {
        &self.a[..n * self.n_ff]
    }

    /// Converts the rows for the gate and up dot products.
    pub fn prepare(&mut self, f: &BundleFormat, xb: &[f32], n: usize) -> Result<()> {
        self.reserve(n);
        let (gate_ty, up_ty) = (f.gate_ty.vec_dot_type(), f.up_ty.vec_dot_type());
        self.gate_acts.quantize(gate_ty, xb, n, self.n_embd)?;
        if up_ty != gate_ty {
            self.up_acts.quantize(up_ty, xb, n, self.n_embd)?;
        }
        self.a[..n * self.n_ff].fill(0.0);
        Ok(())
    }

    /// `out[t] = FFN(xb[t])` for the `n` rows of layer `l` from `source`,
    /// keeping what `select` says; with `record`, each row's kept set is
    /// written to its bitmap there. `want` is the union of what any row may
    /// keep (`None`: every neuron).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        f: &BundleFormat,
        l: usize,
        xb: &[f32],
        n: usize,
        out: &mut [f32],
        source: &mut Source,
        plan: Plan,
        mut record: Option<&mut [u64]>,
    ) -> Result<()> {
        let start = Instant::now();
        let Plan {
            select,
            want,
            deadline,
            mut stages,
        } = plan;
        let computed0 = self.stage1_rows;
        let wait0 = match source {
            Source::Stream(s) => s.wait_seconds(),
            Source::Resident(_) => 0.0,
        };
        self.prepare(f, xb, n)?;
        let bb = f.bundle_bytes();
        match source {
            Source::Resident(resident) => self.run_resident(resident, l, n, out, want, select, record)?,
            // Every layer held whole (a static cache with room for them
            // all): computed as `dense` computes, from the source's matrices.
            Source::Stream(s) if s.whole().is_some() => {
                let resident = s.whole().expect("checked");
                self.run_resident(resident, l, n, out, want, select, record)?;
            }
            Source::Stream(s) => {
                let k_stages = stages.as_ref().map_or(1, |h| h.stages().max(1));
                self.collect = k_stages > 1
                    && f.down_layout == DownLayout::Columns
                    && stages.as_ref().is_some_and(|h| h.wants_partial());
                if self.collect {
                    self.fresh.clear();
                    self.partial.clear();
                    self.partial.resize(n * self.n_embd, 0.0);
                }
                self.begin_down(f)?;
                self.in_cache.fill(0);
                let expected = s.progress(l)?.1;
                let (mut done, mut stage) = (0usize, 0usize);
                // Cache hits in consecutive slots (a static hot set) are
                // computed where they lie; scattered ones are gathered a
                // batch at a time and go through the blocked kernels like a
                // landed run (a bundle at a time costs more in calls than in copies).
                let hits = s.hits(l)?;
                let mut scattered = std::mem::take(&mut self.scattered);
                scattered.clear();
                let mut k = 0;
                while k < hits.len() {
                    let Some((bytes, stride, count)) = s.cached_span(l, &hits[k..]) else {
                        scattered.push(hits[k]);
                        k += 1;
                        continue;
                    };
                    let ids = &hits[k..k + count];
                    let run = Rows::Strided { bytes, stride, count };
                    self.stage1(f, run, |j| ids[j] as u32, None, n, select, record.as_deref_mut())?;
                    for (j, &i) in ids.iter().enumerate() {
                        self.keep_hit(f, n, i, &bytes[j * stride..j * stride + bb])?;
                    }
                    k += count;
                }
                let mut words = std::mem::take(&mut self.hit_bundles);
                if words.len() * 8 < HIT_BATCH * bb {
                    words.resize((HIT_BATCH * bb).div_ceil(8), 0);
                }
                let batch = bytemuck::cast_slice_mut::<u64, u8>(&mut words);
                for ids in scattered.chunks(HIT_BATCH) {
                    for (k, &i) in ids.iter().enumerate() {
                        batch[k * bb..(k + 1) * bb].copy_from_slice(s.cached(l, i));
                    }
                    let run = &batch[..ids.len() * bb];
                    self.stage1(
                        f,
                        Rows::Bundles(run),
                        |k| ids[k] as u32,
                        None,
                        n,
                        select,
                        record.as_deref_mut(),
                    )?;
                    for &i in ids {
                        self.keep_hit(f, n, i, s.cached(l, i))?;
                    }
                }
                self.hit_bundles = words;
                self.scattered = scattered;
                done += s.hits(l)?.len();
                loop {
                    // After each of the first K-1 parts of the layer: refine.
                    while stage + 1 < k_stages && done * k_stages >= expected * (stage + 1) {
                        if let Some(h) = stages.as_deref_mut() {
                            let partial = self.partial_output(f, n, s, l)?;
                            h.refine(l, stage, partial, s)?;
                        }
                        stage += 1;
                    }
                    let Some(LandedRun {
                        bytes,
                        neurons,
                        requested,
                        kept,
                    }) = s.next_run_until(l, deadline)?
                    else {
                        break;
                    };
                    // Sub-runs of the neurons asked for (a merged read carries others).
                    let mut p = 0;
                    while p < neurons.len() {
                        if !requested[neurons[p] as usize] {
                            p += 1;
                            continue;
                        }
                        let q = (p..neurons.len())
                            .find(|&q| !requested[neurons[q] as usize])
                            .unwrap_or(neurons.len());
                        let ids = &neurons[p..q];
                        let run = Rows::Bundles(&bytes[p * bb..q * bb]);
                        self.stage1(f, run, |k| ids[k], None, n, select, record.as_deref_mut())?;
                        // A kept run's columns are read where they landed
                        // (`Streamer::kept_bundle`); the others are copied.
                        if !(kept && f.down_layout == DownLayout::Columns) {
                            for (k, &i) in ids.iter().enumerate() {
                                let at = (p + k) * bb;
                                self.keep_down(f, n, i as usize, &bytes[at..at + bb])?;
                            }
                        }
                        done += q - p;
                        p = q;
                    }
                }
                self.collect = false;
                let mut have = std::mem::take(&mut self.have);
                s.available(l, &mut have)?;
                if !s.complete(l)? {
                    self.drop_incomplete(f, n, &mut have);
                }
                // A stage asked for more than this call keeps (a wider
                // prefetch): the product runs over what the call wants.
                if let Some(w) = want {
                    have.iter_mut().zip(w).for_each(|(h, w)| *h &= w);
                }
                let r = self.finish_streamed(f, n, out, &have, s, l);
                self.have = have;
                r?;
            }
        }
        self.considered += (n * self.n_ff) as u64;
        let seconds = start.elapsed().as_secs_f64();
        self.seconds += seconds;
        let wait = match source {
            Source::Stream(s) => s.wait_seconds() - wait0,
            Source::Resident(_) => 0.0,
        };
        self.last = CallCost {
            seconds,
            wait_seconds: wait,
            computed: self.stage1_rows - computed0,
        };
        Ok(())
    }

    /// Layer `l` of `resident`: stage 1 over the wanted neurons where they
    /// lie (runs joined across short gaps), stage 2 from the bundles or the
    /// down matrix. Down tiles gathered into the matrix: a wanted neuron
    /// brings its group, as a streamed layer reads and computes it.
    #[allow(clippy::too_many_arguments)]
    fn run_resident(
        &mut self,
        resident: &Resident,
        l: usize,
        n: usize,
        out: &mut [f32],
        want: Option<&[u64]>,
        select: Select,
        record: Option<&mut [u64]>,
    ) -> Result<()> {
        let f = &resident.formats[l];
        let g = if f.down_layout == DownLayout::Matrix {
            f.down_ty.block_size()
        } else {
            1
        };
        match want {
            Some(w) if g > 1 => {
                let mut grouped = std::mem::take(&mut self.grouped);
                widen_to_groups(w, self.n_ff, g, &mut grouped);
                let r = self.run_resident_set(resident, l, n, out, Some(&grouped), select, record);
                self.grouped = grouped;
                r
            }
            w => self.run_resident_set(resident, l, n, out, w, select, record),
        }
    }

    /// [`run_resident`](Self::run_resident) over `want` as it is.
    #[allow(clippy::too_many_arguments)]
    fn run_resident_set(
        &mut self,
        resident: &Resident,
        l: usize,
        n: usize,
        out: &mut [f32],
        want: Option<&[u64]>,
        select: Select,
        mut record: Option<&mut [u64]>,
    ) -> Result<()> {
        let f = &resident.formats[l];
        let all = &resident.bundles[l];
        let split = f.down_layout == DownLayout::Matrix;
        let (bb, gb, ub, n_ff) = (f.bundle_bytes(), f.gate_bytes(), f.up_bytes(), self.n_ff);
        let wanted = |i: usize| want.is_none_or(|w| bit_is_set(w, i));
        let rows = |i: usize, j: usize| {
            if split {
                let up = n_ff * gb;
                Rows::Split {
                    gate: &all[i * gb..j * gb],
                    up: &all[up + i * ub..up + j * ub],
                }
            } else {
                Rows::Bundles(&all[i * bb..j * bb])
            }
        };
        // Runs of wanted neurons (in id order, as stored), joined across
        // gaps of up to RESIDENT_GAP unwanted ones, which are computed and
        // not kept: a scattered want would otherwise be hundreds of calls
        // of a few neurons each, too short to share among threads.
        let mut i = 0;
        while i < n_ff {
            if !wanted(i) {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while let Some(next) = (j..(j + RESIDENT_GAP + 1).min(n_ff)).find(|&k| wanted(k)) {
                j = next + 1;
            }
            self.stage1(
                f,
                rows(i, j),
                |k| (i + k) as u32,
                want,
                n,
                select,
                record.as_deref_mut(),
            )?;
            i = j;
        }
        // Split layers take their down from the matrix, not from bundles.
        let bundle = |i: usize| if split { &[][..] } else { &all[i * bb..(i + 1) * bb] };
        self.finish(f, n, out, want, bundle, resident.down(l))
    }

    /// The FFN output of the neurons computed since the last call, added
    /// to the running partial output (down columns only; `None` otherwise).
    fn partial_output(&mut self, f: &BundleFormat, n: usize, s: &Streamer, l: usize) -> Result<Option<&[f32]>> {
        if !self.collect {
            return Ok(None);
        }
        self.fresh.sort_unstable();
        let column = Self::column(f, &self.columns, &self.in_cache, s, l);
        run_down_columns(
            f,
            &self.fresh,
            &self.a[..n * self.n_ff],
            self.n_ff,
            column,
            &mut self.partial[..n * self.n_embd],
        )?;
        self.fresh.clear();
        Ok(Some(&self.partial[..n * self.n_embd]))
    }

    /// Readies stage 2's operand for a streamed layer of format `f`.
    fn begin_down(&mut self, f: &BundleFormat) -> Result<()> {
        match f.down_layout {
            DownLayout::Tiles => self.down_tiles.begin(f, self.n_ff)?,
            DownLayout::Columns => {
                let len = f.down_bytes() * self.n_ff;
                if self.columns.len() < len {
                    self.columns.resize(len, 0);
                }
            }
            DownLayout::Matrix => {}
        }
        Ok(())
    }

    /// [`keep_down`](Self::keep_down) for a cache hit: its slot stays
    /// pinned until the layer is done, so stage 2 reads a down column where
    /// it lies instead of a copy.
    fn keep_hit(&mut self, f: &BundleFormat, n: usize, i: usize, bundle: &[u8]) -> Result<()> {
        if f.down_layout == DownLayout::Columns {
            set_bit(&mut self.in_cache, i);
            return Ok(());
        }
        self.keep_down(f, n, i, bundle)
    }

    /// Neuron `i`'s down column for stage 2 of streamed layer `l`: from
    /// its cache slot (a hit), from a run the streamer keeps, or from the
    /// copies the other landed runs left.
    fn column<'b>(
        f: &'b BundleFormat,
        columns: &'b [u8],
        in_cache: &'b [u64],
        s: &'b Streamer,
        l: usize,
    ) -> impl Fn(usize) -> &'b [u8] + Sync + 'b {
        let db = f.down_bytes();
        move |i| {
            if bit_is_set(in_cache, i) {
                f.down_part(s.cached(l, i)).unwrap_or(&[])
            } else if let Some(b) = s.kept_bundle(l, i) {
                f.down_part(b).unwrap_or(&[])
            } else {
                &columns[i * db..(i + 1) * db]
            }
        }
    }

    /// Copies what stage 2 needs of neuron `i`'s `bundle` (taken by stage 1
    /// just now): its down column where a row kept it, its tile part always
    /// (a group's product needs every member).
    fn keep_down(&mut self, f: &BundleFormat, n: usize, i: usize, bundle: &[u8]) -> Result<()> {
        match f.down_layout {
            DownLayout::Tiles => self.down_tiles.put(f, i, bundle)?,
            DownLayout::Columns => {
                if (0..n).any(|t| self.a[t * self.n_ff + i] != 0.0) {
                    let db = f.down_bytes();
                    self.columns[i * db..(i + 1) * db].copy_from_slice(f.down_part(bundle)?);
                }
            }
            DownLayout::Matrix => {}
        }
        Ok(())
    }

    /// Stage 2 of a streamed layer over `have`, from the operand the runs
    /// left ([`keep_down`](Self::keep_down)): the same bits as [`finish`](Self::finish)
    /// over the same bundles.
    fn finish_streamed(
        &mut self,
        f: &BundleFormat,
        n: usize,
        out: &mut [f32],
        have: &[u64],
        s: &Streamer,
        l: usize,
    ) -> Result<()> {
        let (a, y) = (&self.a[..n * self.n_ff], &mut out[..n * self.n_embd]);
        match f.down_layout {
            DownLayout::Columns => {
                column_ids(&mut self.ids, self.n_ff, Some(have));
                y.fill(0.0);
                let column = Self::column(f, &self.columns, &self.in_cache, s, l);
                run_down_columns(f, &self.ids, a, self.n_ff, column, y)?;
            }
            DownLayout::Tiles => {
                let g = f.group();
                self.ids.clear();
                self.ids
                    .extend(super::trace::groups_touched(have, self.n_ff, g).map(|grp| grp as u32));
                self.down_tiles.run_gathered(f, &self.ids, a, self.n_ff, y)?;
            }
            DownLayout::Matrix => {
                return Err(crate::RuntimeError::Invalid(
                    "a streamed layer cannot hold its down matrix whole".into(),
                ))
            }
        }
        Ok(())
    }

    /// Where reads were skipped or cancelled, a down-tile group can be
    /// short of neurons: its product needs every member's part, so the whole
    /// group is dropped (its activations zeroed, its neurons out of `have`).
    fn drop_incomplete(&mut self, f: &BundleFormat, n: usize, have: &mut [u64]) {
        if f.down_layout != DownLayout::Tiles {
            return;
        }
        let g = f.group();
        for grp in 0..self.n_ff / g {
            let members = grp * g..(grp + 1) * g;
            let some = members.clone().any(|i| bit_is_set(have, i));
            if !some || members.clone().all(|i| bit_is_set(have, i)) {
                continue;
            }
            for i in members {
                have[i / 64] &= !(1u64 << (i % 64));
                for t in 0..n {
                    let a = &mut self.a[t * self.n_ff + i];
                    if *a != 0.0 {
                        *a = 0.0;
                        self.kept -= 1;
                    }
                }
            }
        }
    }

    /// Stage 1 over `run` (whole bundles back to back; bundle k is neuron
    /// `id(k)`), keeping by `select` into the activation rows, and only
    /// neurons of `want` where given.
    #[allow(clippy::too_many_arguments)]
    fn stage1(
        &mut self,
        f: &BundleFormat,
        run: Rows,
        id: impl Fn(usize) -> u32,
        want: Option<&[u64]>,
        n: usize,
        select: Select,
        mut record: Option<&mut [u64]>,
    ) -> Result<()> {
        let (act, words, n_ff) = (self.act, self.words(), self.n_ff);
        let up_acts = if f.up_ty.vec_dot_type() == f.gate_ty.vec_dot_type() {
            &self.gate_acts
        } else {
            &self.up_acts
        };
        let rows = FfnRows::new(f, &self.gate_acts, up_acts)?.as_matrix_of(n_ff);
        // Pieces for this call's rows, not the most the buffers were sized
        // for: a decode row after a prompt batch is one piece, not dozens.
        let piece = Self::piece(n);
        let total = run.count(f);
        for (c, start) in (0..total).step_by(piece).enumerate() {
            let count = piece.min(total - start);
            let chunk = run.slice(f, start, start + count);
            let vals = &mut self.piece[..count * n];
            let scratch = &mut self.scratch[..count * n];
            if count > TASK {
                // A few tasks per thread: enough to balance, few enough that
                // a decode row's layer is not hundreds of tiny rayon jobs.
                let task = count
                    .div_ceil(TASKS_PER_THREAD * rayon::current_num_threads())
                    .next_multiple_of(TASK);
                vals.par_chunks_mut(task * n)
                    .zip(scratch.par_chunks_mut(task * n))
                    .enumerate()
                    .try_for_each(|(t, (v, s))| {
                        let k = t * task;
                        chunk
                            .slice(f, k, (k + task).min(count))
                            .activations(f, &rows, act, v, s)
                    })?;
            } else {
                chunk.activations(f, &rows, act, vals, scratch)?;
            }
            self.stage1_rows += (count * n) as u64;
            // Counted in a register: `self.kept += 1` per kept row was a
            // store-to-load chain through memory that took half of this
            // loop's time on a 128-row prompt.
            let mut kept = 0u64;
            let (rows_out, fresh) = (&mut self.a[..], &mut self.fresh);
            for k in 0..count {
                let i = id(c * piece + k) as usize;
                if want.is_some_and(|w| !bit_is_set(w, i)) {
                    continue;
                }
                if self.collect {
                    fresh.push(i as u32);
                }
                for t in 0..n {
                    let a = vals[k * n + t];
                    // The dense path's rule (Sparsifier): skip |a| < threshold;
                    // the same function a device's kernel is checked against.
                    let keep = match select {
                        Select::Threshold(th) => keeps(th, None, i, a),
                        Select::Rows(bits) => keeps(0.0, Some(&bits[t * words..(t + 1) * words]), i, a),
                    };
                    if keep {
                        rows_out[t * n_ff + i] = a;
                        kept += 1;
                        if let Some(r) = record.as_deref_mut() {
                            set_bit(&mut r[t * words..(t + 1) * words], i);
                        }
                    }
                }
            }
            self.kept += kept;
        }
        Ok(())
    }

    /// Stage 2 of a resident layer: the kept neurons' down columns in
    /// ascending id, or the source's down product over `matrix`, the layer's
    /// down held whole (tiled layers are held so; streamed ones go through
    /// [`finish_streamed`](Self::finish_streamed)).
    fn finish<'b>(
        &mut self,
        f: &BundleFormat,
        n: usize,
        out: &mut [f32],
        want: Option<&[u64]>,
        bundle: impl Fn(usize) -> &'b [u8] + Sync,
        matrix: Option<&[u8]>,
    ) -> Result<()> {
        let (a, y) = (&self.a[..n * self.n_ff], &mut out[..n * self.n_embd]);
        match f.down_layout {
            DownLayout::Columns => {
                column_ids(&mut self.ids, self.n_ff, want);
                y.fill(0.0);
                run_down(f, &self.ids, a, self.n_ff, bundle, y)?;
            }
            DownLayout::Tiles => {
                return Err(crate::RuntimeError::Invalid(
                    "a resident layer holds its down tiles gathered into the down matrix".into(),
                ))
            }
            DownLayout::Matrix => {
                let m = matrix.ok_or_else(|| {
                    crate::RuntimeError::Invalid("a layer whose down matrix is held whole was given none".into())
                })?;
                self.down_tiles.run_matrix(f.down_ty, m, f.n_embd, a, self.n_ff, y)?;
            }
        }
        Ok(())
    }
}

/// Stage 2's neurons over down columns into `ids`, ascending: those of
/// `want` (every one of `n_ff` without it).
fn column_ids(ids: &mut Vec<u32>, n_ff: usize, want: Option<&[u64]>) {
    ids.clear();
    match want {
        None => ids.extend(0..n_ff as u32),
        Some(w) => ids.extend(super::trace::set_bits(w).map(|i| i as u32)),
    }
}
