//! A layer's neurons ranked by a predictor (`.lspred`): the part every
//! predicting policy shares (`speculate`, `dejavu`, `llm-in-a-flash`,
//! `powerinfer2`). Scores a layer from input rows, then selects the union
//! over rows of each row's top `breadth × need` neurons with an urgency by
//! rank, the form [`Streamer::ensure_ranked`](crate::engine::Streamer::ensure_ranked) takes.

use std::sync::Arc;

use super::Shape;
use crate::engine::stream::{Streamer, Want};
use crate::engine::trace::set_bit;
use crate::predict::{top_groups, ComputePath, Predictor, Scratch};
use crate::{Result, RuntimeError};

/// When a ranked layer is asked for.
#[derive(Clone, Copy)]
pub(crate) enum When {
    /// It runs next: anything else queued is dropped (what the policies
    /// that predict and then wait do).
    Now,
    /// A look-ahead, queued behind the stages the streamer holds.
    Ahead,
}

pub(crate) struct Ranking {
    pub predictor: Arc<Predictor>,
    pub predictor_name: String,
    path: ComputePath,
    n_embd: usize,
    /// Neurons a row needs at the operating sparsity.
    pub need: usize,
    scratch: Scratch,
    /// Per row, the group scores; the order scratch.
    scores: Vec<f32>,
    order: Vec<u32>,
    /// The selected set (bitmap over neurons) and each neuron's urgency (0 first).
    pub bits: Vec<u64>,
    pub urgency: Vec<u16>,
}

impl Ranking {
    /// Checks that `predictor` fits `shape`; `need` follows from `sparsity`.
    pub fn new(predictor: Arc<Predictor>, predictor_name: String, shape: Shape, sparsity: f32) -> Result<Self> {
        let c = &predictor.config;
        if (c.n_layer, c.d_model, c.n_ff) != (shape.n_layer, shape.n_embd, shape.n_ff) {
            return Err(RuntimeError::Invalid(format!(
                "{predictor_name}: predictor made for {} layers × {} × {} FFN, the model has {} × {} × {}",
                c.n_layer, c.d_model, c.n_ff, shape.n_layer, shape.n_embd, shape.n_ff
            )));
        }
        let need = (((1.0 - sparsity as f64) * shape.n_ff as f64).round() as usize).clamp(1, shape.n_ff);
        Ok(Self {
            scratch: predictor.scratch(),
            predictor,
            predictor_name,
            path: ComputePath::best(),
            n_embd: shape.n_embd,
            need,
            scores: Vec::new(),
            order: Vec::new(),
            bits: vec![0; shape.n_ff.div_ceil(64)],
            urgency: vec![u16::MAX; shape.n_ff],
        })
    }

    /// The index of use `name` (an error naming the uses the file has).
    pub fn use_index(&self, name: &str) -> Result<usize> {
        self.predictor.use_index(name).ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "{}: predictor has no `{name}` use (it has: {})",
                self.predictor_name,
                self.predictor.uses.join(", ")
            ))
        })
    }

    /// The use that predicts a layer from its own input: `refine`, else
    /// `speculate` (an error naming the uses the file has if neither).
    pub fn own_input_use(&self) -> Result<usize> {
        match self.predictor.use_index("refine") {
            Some(u) => Ok(u),
            None => self.use_index("speculate"),
        }
    }

    /// Scores layer `layer` for use `use_` from `n` input rows `rows`.
    pub fn score(&mut self, use_: usize, layer: usize, rows: &[f32], n: usize) -> Result<()> {
        let (d, g) = (self.n_embd, self.predictor.n_groups());
        self.scores.resize(n * g, 0.0);
        for t in 0..n {
            self.predictor
                .scores(
                    use_,
                    layer,
                    &rows[t * d..(t + 1) * d],
                    self.path,
                    &mut self.scratch,
                    &mut self.scores[t * g..(t + 1) * g],
                )
                .map_err(|e| RuntimeError::Invalid(format!("predictor, layer {layer}: {e}")))?;
        }
        Ok(())
    }

    /// Groups a row's top `breadth × need` neurons take.
    fn top_count(&self, breadth: f32) -> usize {
        let group = self.predictor.config.group;
        ((breadth as f64 * self.need as f64 / group as f64).ceil() as usize).clamp(1, self.predictor.n_groups())
    }

    /// Whether a selection at `breadth` is every neuron, whatever the scores.
    pub fn selects_all(&self, breadth: f32) -> bool {
        self.top_count(breadth) == self.predictor.n_groups()
    }

    /// The union over the `n` scored rows of each row's top `breadth ×
    /// need` neurons into `bits`, with urgency by best rank.
    pub fn select(&mut self, n: usize, breadth: f32) {
        let g = self.predictor.n_groups();
        let group = self.predictor.config.group;
        let k = self.top_count(breadth);
        self.bits.fill(0);
        self.urgency.fill(u16::MAX);
        for t in 0..n {
            let top = top_groups(&self.scores[t * g..(t + 1) * g], k, &mut self.order);
            for (rank, &grp) in top.iter().enumerate() {
                let u = (rank as u64 * u16::MAX as u64 / g as u64) as u16;
                for i in grp as usize * group..(grp as usize + 1) * group {
                    set_bit(&mut self.bits, i);
                    self.urgency[i] = self.urgency[i].min(u);
                }
            }
        }
    }

    /// [`score`](Self::score) then [`select`](Self::select).
    pub fn rank(&mut self, use_: usize, layer: usize, rows: &[f32], n: usize, breadth: f32) -> Result<()> {
        self.score(use_, layer, rows, n)?;
        self.select(n, breadth);
        Ok(())
    }

    /// Unless layer `layer` is queued already: ranks it for `use_` from `n`
    /// rows `rows` at `breadth` and asks `s` for the selection, most likely
    /// first, for the layer about to run or as a look-ahead (`when`). A
    /// layer the cache holds whole, or a breadth that selects every neuron,
    /// is asked for whole, unranked: a ranking would decide nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn request(
        &mut self,
        when: When,
        use_: usize,
        layer: usize,
        rows: &[f32],
        n: usize,
        breadth: f32,
        s: &mut Streamer,
    ) -> Result<()> {
        if s.is_queued(layer) {
            return Ok(());
        }
        let whole = s.holds_layer(layer) || self.selects_all(breadth);
        if !whole {
            self.rank(use_, layer, rows, n, breadth)?;
        }
        let (want, urgency) = if whole {
            (Want::All, None)
        } else {
            (Want::Set(&self.bits), Some(&self.urgency[..]))
        };
        match when {
            When::Now => s.ensure_ranked(layer, want, urgency),
            When::Ahead => s.prefetch_ranked(layer, want, urgency),
        }
    }

    /// Bytes of scratch (the predictor's weights are counted where it is held).
    pub fn scratch_bytes(&self) -> u64 {
        (self.predictor.scratch_bytes()
            + self.scores.capacity() * 4
            + self.order.capacity() * 4
            + self.bits.capacity() * 8
            + self.urgency.capacity() * 2) as u64
    }
}
