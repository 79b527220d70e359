//! `speculate`: LeanStream's speculate-and-refine streaming, driven by a
//! predictor (`.lspred`) and a controller (`.lstab` or a fixed action).
//!
//! Per layer l of a token:
//! - **control**, before l's attention: the state the table was built on
//!   (bytes queued for l, bytes of l's predicted need not cached, recent
//!   read bandwidth, compute ns per neuron, layer position) picks the action
//!   (stages K, queue depth q, breadth b, deadline factor d); q applies at once;
//! - **refine** l with its true input, still before attention: the
//!   predictor's `refine` use ranks l's neurons from the layer input; reads
//!   for the top `b × need` not yet asked for are added, most likely first,
//!   and queued reads outside that set are cancelled (layer 0 of a token is
//!   requested here, from the token embedding);
//! - **speculate** l+1 when l's FFN starts: the `speculate` use ranks l+1's
//!   neurons from the residual after l's attention and the top `b × need`
//!   are queued behind l's reads, while l computes;
//! - **stages**: l's FFN takes its bundles in arrival order in K parts; after
//!   each part but the last the partial output updates the estimate of
//!   l+1's input (residual + partial) and the `refine` use re-ranks l+1's
//!   reads as above (down-column layouts without a post-FFN norm, where the
//!   partial output is a cheap sum; otherwise K only splits the wait);
//! - **deadline**: reads of l not landed `d ×` the expected compute time of
//!   its bundles after the FFN started are skipped (counted as late) and the
//!   layer goes on with what it has;
//! - **no ranking where it decides nothing**: a layer the cache holds whole
//!   is computed whole when ranking would cost more than the compute it
//!   saves; an action whose breadth selects every neuron reads them all in
//!   file order, unless a deadline fired within the last token (then the
//!   ranked order decides what is cut), and reads the layers after it
//!   whole as far ahead as `dense-stream` does. Counted as `unranked`.
//!
//! `need` is the share of neurons the sparsity level keeps, `(1 - s) ×
//! n_ff`; at sparsity 0 every neuron is needed, every breadth reads them
//! all, and with no deadline the layer computes what `dense` computes, bit
//! for bit. Computed neurons are kept by the level's thresholds, as in
//! `dense`; neurons the predictor missed are not read and so not computed.

use std::time::{Duration, Instant};

use super::ranking::Ranking;
use super::{streamer, FfnPolicy, LayerCall, Plan, Policy, Shape};
use crate::control::{Action, ControlState};
use crate::engine::controller::{ewma, ActionCount, Controller, Decisions, Meter};
use crate::engine::plan::{Select, StageHook};
use crate::engine::source::Source;
use crate::engine::stream::{Streamer, Want, STAGES};
use crate::engine::tail::Tail;
use crate::Result;

/// Ranks a layer's neurons with the predictor (shared by refinement
/// inside a layer's stages and by the policy between layers).
pub(crate) struct Ranker {
    ranking: Ranking,
    /// Use indices of `speculate` and `refine` (the latter falls back to the former).
    speculate: usize,
    refine: usize,
    shape: Shape,
    /// The estimated next-layer input rows (residual + partial output).
    estimate: Vec<f32>,
    /// The residual of the call in progress, `[n][n_embd]`.
    resid: Vec<f32>,
    n: usize,
    /// The current layer's action.
    action: Action,
    /// Whether the layer has no next layer to refine (the last one, one the
    /// cache holds whole, or one read whole): then it runs in one stage.
    no_refine: bool,
    refinements: u64,
    added: u64,
    cancelled: u64,
}

impl Ranker {
    /// Re-ranks layer `layer`'s queued reads from input estimate `rows`:
    /// adds the new top set, cancels queued reads outside it.
    fn refine_reads(&mut self, layer: usize, rows: &[f32], n: usize, s: &mut Streamer) -> Result<()> {
        self.ranking
            .rank(self.refine, layer, rows, n, self.action.prefetch_breadth)?;
        self.apply_refined(layer, s)
    }

    /// Makes layer `layer`'s queued reads follow the ranked set.
    fn apply_refined(&mut self, layer: usize, s: &mut Streamer) -> Result<()> {
        let before = s.wanted_count(layer);
        let r = &self.ranking;
        s.extend(layer, Want::Set(&r.bits), Some(&r.urgency))?;
        self.added += (s.wanted_count(layer) - before) as u64;
        self.cancelled += s.cancel_outside(layer, &r.bits) as u64;
        self.refinements += 1;
        Ok(())
    }
}

impl StageHook for Ranker {
    fn stages(&self) -> usize {
        if self.no_refine {
            1
        } else {
            self.action.stages as usize
        }
    }

    fn wants_partial(&self) -> bool {
        !self.shape.post_ffn_norm && !self.no_refine
    }

    fn refine(&mut self, layer: usize, _stage: usize, partial: Option<&[f32]>, s: &mut Streamer) -> Result<()> {
        let (Some(partial), false) = (partial, self.no_refine) else {
            return Ok(());
        };
        let m = self.n * self.shape.n_embd;
        let mut est = std::mem::take(&mut self.estimate);
        est.clear();
        est.extend(self.resid[..m].iter().zip(&partial[..m]).map(|(r, p)| r + p));
        let r = self.refine_reads(layer + 1, &est, self.n, s);
        self.estimate = est;
        r
    }
}

/// Weight of the newest sample in the ranking cost and need-share averages.
const RANK_ALPHA: f64 = 0.125;

pub(crate) struct Speculate {
    ranker: Ranker,
    controller: Controller,
    /// Layers decided with each code of the controller's codebook.
    counts: Vec<u64>,
    meter: Meter,
    bundle_bytes: Vec<usize>,
    /// Time to rank a layer from one input row, ns (EWMA), and the neurons
    /// the last ranking selected: what skipping the predictor on a layer
    /// the cache holds whole is weighed against.
    rank_ns: Option<f64>,
    selected: usize,
    /// Per layer, the share of its uncached neurons that the predicted need
    /// missed when last ranked (EWMA): the state's missing bytes when the
    /// layer is not ranked.
    need_share: Vec<Option<f64>>,
    /// Bundles skipped late so far, and layer calls since the last one: the
    /// order of reads only matters while deadlines fire.
    late_seen: u64,
    calm_layers: usize,
    /// Layer calls that took every neuron without ranking.
    unranked: u64,
}

impl Speculate {
    pub(crate) fn new(
        ranking: Ranking,
        controller: Controller,
        shape: Shape,
        bundle_bytes: Vec<usize>,
    ) -> Result<Self> {
        let speculate = ranking.use_index("speculate")?;
        let refine = ranking.own_input_use()?;
        let n_codes = controller.codebook().len();
        Ok(Self {
            ranker: Ranker {
                ranking,
                speculate,
                refine,
                shape,
                estimate: Vec::new(),
                resid: Vec::new(),
                n: 0,
                action: Controller::DEFAULT_FIXED,
                no_refine: false,
                refinements: 0,
                added: 0,
                cancelled: 0,
            },
            controller,
            counts: vec![0; n_codes],
            meter: Meter::default(),
            bundle_bytes,
            rank_ns: None,
            selected: 0,
            need_share: vec![None; shape.n_layer],
            late_seen: 0,
            calm_layers: 0,
            unranked: 0,
        })
    }

    /// Whether `action` reads every neuron without a ranking: its breadth
    /// selects them all, and either it sets no deadline or none has fired
    /// for a token's worth of layers (a ranking would only order the reads,
    /// which matters when a deadline cuts them short).
    fn reads_whole(&self, action: &Action) -> bool {
        self.ranker.ranking.selects_all(action.prefetch_breadth)
            && (!action.deadline_factor.is_finite() || self.calm_layers >= self.ranker.shape.n_layer)
    }

    /// Whether layer `l` is computed whole, without ranking: the cache holds
    /// all of it (no reads to choose) and ranking costs at least the compute
    /// the selection saves, per input row `(n_ff - selected) × ns/neuron`
    /// (always at sparsity 0, where the selection is every neuron; before
    /// both are measured, only then).
    fn computes_whole(&self, l: usize, s: &Streamer) -> bool {
        if !s.holds_layer(l) {
            return false;
        }
        let n_ff = self.ranker.shape.n_ff;
        match (self.rank_ns, self.meter.ns_per_neuron()) {
            (Some(rank), Some(neuron)) => rank >= n_ff.saturating_sub(self.selected) as f64 * neuron,
            _ => self.ranker.ranking.need >= n_ff,
        }
    }

    /// The controller's action for layer `layer` in the measured state,
    /// `missing` uncached neurons of its predicted need.
    fn look_up(&self, layer: usize, missing: usize, s: &Streamer) -> (usize, Action) {
        let r = &self.ranker;
        let missing = missing as f64 * self.bundle_bytes[layer] as f64;
        let state = ControlState {
            // The model counts these bytes as loaded: in-flight reads are not.
            queued_bytes: s.landed_bytes(layer) as f64,
            missing_bytes: missing,
            read_bw_bytes_s: self.meter.read_bw(),
            compute_ns_per_neuron: self.meter.ns_per_neuron().unwrap_or(f64::NAN),
            layer_position: layer as f64 / r.shape.n_layer as f64,
        };
        self.controller.decide(&state)
    }

    /// Takes action `code` for the layer.
    fn take(&mut self, (code, action): (usize, Action), s: &Streamer) {
        self.counts[code] += 1;
        self.ranker.action = action;
        s.set_depth(action.queue_depth as usize, 0);
    }
}

impl FfnPolicy for Speculate {
    fn kind(&self) -> Policy {
        Policy::Speculate
    }

    fn layer_input(&mut self, layer: usize, x: &[f32], n: usize, source: &mut Source) -> Result<()> {
        let s = streamer(source)?;
        let st = s.stats();
        self.meter.observe_io(st.bytes_read, st.io_busy_seconds);
        if st.late_skipped > self.late_seen {
            (self.late_seen, self.calm_layers) = (st.late_skipped, 0);
        } else {
            self.calm_layers += 1;
        }
        // A layer held whole, or an action that reads every neuron, needs
        // no ranking; the state is then estimated from the layer's uncached
        // neurons.
        let whole = if self.computes_whole(layer, s) {
            Some(self.look_up(layer, 0, s))
        } else {
            self.need_share[layer].and_then(|share| {
                let missing = (share * s.uncached_in(layer) as f64).round() as usize;
                Some(self.look_up(layer, missing, s)).filter(|d| self.reads_whole(&d.1))
            })
        };
        if let Some(decision) = whole {
            self.take(decision, s);
            self.unranked += 1;
            return s.ensure_ranked(layer, Want::All, None);
        }
        let r = &mut self.ranker;
        let t0 = Instant::now();
        r.ranking.score(r.refine, layer, x, n)?;
        // The state is measured on the breadth-1 set (the predicted need),
        // then the action's breadth applies.
        r.ranking.select(n, 1.0);
        let missing = s.uncached_count(layer, &r.ranking.bits);
        let uncached = s.uncached_in(layer);
        if uncached > 0 {
            ewma(
                &mut self.need_share[layer],
                missing as f64 / uncached as f64,
                RANK_ALPHA,
            );
        }
        self.take(self.look_up(layer, missing, s), s);
        let r = &mut self.ranker;
        r.ranking.select(n, r.action.prefetch_breadth);
        let row_ns = t0.elapsed().as_nanos() as f64 / n.max(1) as f64;
        ewma(&mut self.rank_ns, row_ns, RANK_ALPHA);
        self.selected = r.ranking.bits.iter().map(|w| w.count_ones() as usize).sum();
        if s.is_queued(layer) {
            r.apply_refined(layer, s)
        } else {
            s.ensure_ranked(layer, Want::Set(&r.ranking.bits), Some(&r.ranking.urgency))
        }
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        let s = streamer(source)?;
        let (l, n) = (call.layer, call.n);
        let whole = self.reads_whole(&self.ranker.action);
        let r = &mut self.ranker;
        let b = r.action.prefetch_breadth;
        if !s.is_queued(l) {
            // Not seen before attention (a hook-less caller): rank from the residual.
            r.ranking.rank(r.refine, l, call.resid, n, b)?;
            s.ensure_ranked(l, Want::Set(&r.ranking.bits), Some(&r.ranking.urgency))?;
        }
        // Speculate the next layer of this token (layer 0 of the next one
        // waits for its embedding; one the cache holds whole needs no reads,
        // and is ranked, if at all, from its true input). An action that
        // reads whole needs no prediction, so its reads run as far ahead as
        // dense-stream's, into the next token's layers; a later layer whose
        // action ranks cancels what it does not want.
        r.no_refine = l + 1 == r.shape.n_layer || s.holds_layer(l + 1) || whole;
        if whole {
            for ahead in 1..STAGES {
                s.prefetch(call.layer_ahead(ahead), Want::All)?;
            }
        } else if !r.no_refine {
            let m = n * r.shape.n_embd;
            r.resid.clear();
            r.resid.extend_from_slice(&call.resid[..m]);
            r.n = n;
            r.ranking.rank(r.speculate, l + 1, call.resid, n, b)?;
            s.prefetch_ranked(l + 1, Want::Set(&r.ranking.bits), Some(&r.ranking.urgency))?;
        }
        let d = r.action.deadline_factor as f64;
        let deadline = match self.meter.ns_per_neuron() {
            Some(ns) if d.is_finite() => {
                let expected = s.progress(l)?.1 * n;
                Some(Instant::now() + Duration::from_secs_f64(d * ns * expected as f64 * 1e-9))
            }
            _ => None,
        };
        Ok(Plan {
            select: Select::Threshold(call.threshold),
            want: None,
            deadline,
            stages: Some(&mut self.ranker),
        })
    }

    fn finished(&mut self, _layer: usize, tail: &Tail) {
        self.meter.observe_compute(tail.last.ns_per_neuron());
    }

    fn held_bytes(&self) -> u64 {
        self.ranker.ranking.predictor.weight_bytes() as u64
    }

    fn scratch_bytes(&self) -> u64 {
        let r = &self.ranker;
        r.ranking.scratch_bytes() + ((r.estimate.capacity() + r.resid.capacity()) * 4) as u64
    }

    fn predictor_name(&self) -> Option<&str> {
        Some(&self.ranker.ranking.predictor_name)
    }

    fn decisions(&self) -> Option<Decisions> {
        let book = self.controller.codebook();
        let r = &self.ranker;
        Some(Decisions {
            controller: self.controller.describe(),
            predictor: r.ranking.predictor_name.clone(),
            actions: self
                .counts
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(code, &layers)| ActionCount {
                    action: book[code],
                    code,
                    layers,
                })
                .collect(),
            refinements: r.refinements,
            refine_added: r.added,
            refine_cancelled: r.cancelled,
            unranked: self.unranked,
        })
    }
}
