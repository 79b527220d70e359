//! Offline synthesis for LeanStream: profiled traces in, the controller table
//! (`.lstab`) out.
//!
//! # The control model
//!
//! The engine streams each layer's FFN neuron bundles from flash while it
//! computes. Per layer it must decide how hard to speculate and how finely to
//! refine. Solving that optimization online would cost more than it saves, so
//! it is solved here, offline, for every cell of a discretized state grid;
//! the runtime (`leanstream_runtime::control`) only looks the answer up.
//!
//! **State** (measured by the engine at the start of a layer's FFN; one axis each,
//! by default 4, 12, 4, 3 and 3 bins in this order, so 1,728 grid states):
//! - `queued_bytes` Q: bytes of this layer already loaded by the previous
//!   layer's speculative prefetch (the engine counts landed reads only:
//!   the model treats Q as in memory, and counting reads still in flight
//!   let it pick deadlines that made them late);
//! - `missing_bytes` D: bytes the predictor says are active but not cached for
//!   this layer (assumed persistent over the horizon: the next layers' need is
//!   predicted to be like this one's);
//! - `read_bw_bytes_s` B: recent read bandwidth; the ratio `B / B₅₀` (B₅₀ the
//!   profiled median at the reference queue depth) scales every read time of
//!   the horizon (a slow regime — heat, contention, GC — persists);
//! - `compute_ns_per_neuron` c: recent compute time per neuron; the horizon's
//!   compute times are `c ×` the profiled relative noise;
//! - `layer_position` p = layer / n_layers: the horizon is cut at the last
//!   layer, so prefetching for a next layer is worthless at the end.
//!
//! **Actions** (a codebook of 3×3×3×3 = 81 by default: K ∈ {1,2,4}, q ∈ {1,4,16},
//! b ∈ {1, 1.5, 2.5}, d ∈ {2, 8, 32}):
//! - `stages` K: refinement stages of the layer's FFN; the FFN is a two-stage
//!   pipeline of K chunks (read chunk i+1 while computing chunk i), so the
//!   layer takes `max(Tr, Tc) + min(Tr, Tc)/K`, and Tc is multiplied by the
//!   profiled split overhead of K stages (`ffn_split` / `ffn_split K=1`).
//!   Tc covers every row the layer holds: the bundles loaded (wasted ones
//!   too: the thresholds select after the gate and up products) and the
//!   rows the neuron cache adds (`resident_rows`, from the engine's runs);
//! - `prefetch_breadth` b: load `L = b·D` bytes (at most the layer) from the
//!   top of the predicted priority list, or, where the engine's bytes per
//!   breadth are measured (tune's engine probe), at least their share of
//!   the widest breadth's load ([`model::ModelParams::load`]: the engine
//!   re-ranks at each stage and reads the union of its picks). The
//!   activation mass covered is `recall(b)`: the engine's own at each
//!   breadth where tune's probe audited it, else the predictor's mass
//!   recall on held-out traces ([`eval::breadth_recall`], which misses what
//!   merged reads and the cache add), interpolated, else `1 − (1−r₀)^b`
//!   (r₀ = recall at breadth 1, a parameter); the rest of `L` is wasted
//!   reads. Idle I/O time of a layer prefetches up to `b·D` bytes of the
//!   next layer (that is the next state's Q);
//! - `deadline_factor` d: reads not landed by `d ×` the expected compute of
//!   the rows asked for are skipped (the engine's rule). Each read lands at
//!   its wave's start plus its own latency from the profiled distribution,
//!   so the latency tail makes reads late even where the mean wave fits
//!   (with one draw per wave, a deadline that skips reads in one layer of
//!   fifty looked free);
//! - `queue_depth` q: reads in flight. `R = max(L − Q, 0)` bytes are read as
//!   `n = ⌈R/block⌉` requests in `⌈n/m⌉` waves of `m = min(q, n)` reads, each
//!   wave taking a read latency (the mean of four draws) from the profiled
//!   distributions at the block size, interpolated linearly in m between
//!   the profiled depths around it: a deep queue is never charged for reads
//!   that are not there, and 8 reads in flight cost more than 4 (rounding
//!   down to the shallower depth made 4..15 reads one depth-4 wave, so the
//!   queued bytes Q changed nothing below 16 reads and first actions tied
//!   on queue depth); where the engine's
//!   own runs are given ([`engine_fit`]), block is the engine's mean read
//!   size and the latencies (and compute per neuron row) are the engine's.
//!
//! **Randomness**: read latencies by (request size, queue depth), compute
//! time per neuron and split overheads by K, all empirical distributions
//! fitted from the profiler's Parquet traces (even rounds; odd rounds are held
//! out for the simulator). Every condition the model needs must have been
//! profiled, or fitting fails naming what is missing.
//!
//! **Cost** of a layer: `T_layer [µs] + w_skip · skipped_mass + w_waste ·
//! wasted_MiB`, where skipped_mass is the fraction of the predicted-active
//! mass not computed (missed by breadth or by deadline).
//!
//! **Solver**: sample-average stochastic MPC over a horizon of H layers
//! (default 3) with S scenarios (default 24). The first-stage action is shared
//! by all scenarios; the later stages are per-scenario recourse actions. The
//! next state's Q is discretized to as many levels as the Q axis has bins,
//! from nothing to the widest breadth's load ([`solve::prefetch_levels`]:
//! "the next layer all prefetched" is a level, which the table's absolute
//! Q axis does not give), so each scenario's recourse is a shortest path
//! over (stage, Q level): [`solve::solve_dp`] solves it by
//! backward induction and averages each first action's cost plus cost-to-go
//! over the scenarios (exact, O(S·H·bins·actions); the default). The same
//! problem is a MILP, a binary one-hot first action and, per scenario, a flow
//! over (stage, Q level, action) arcs, formulated with `good_lp` and solved
//! with the pure-Rust `microlp` (`--solver milp`, about 8x slower);
//! [`solve::solve_enumerate`] enumerates every action sequence (tests check
//! all three reach the same optimum). They differ only in which of several
//! exactly tied first actions they return: the DP takes the deepest queue
//! ([`synth::deepest_queue_first`]). Each grid state is solved independently
//! in parallel (rayon) with scenarios from an RNG seeded by (seed, state
//! index), so the table is deterministic for a seed.

pub mod adaptive;
pub mod engine_fit;
pub mod error;
pub mod eval;
pub mod eviction;
pub mod fit;
pub mod inspect;
pub mod model;
pub mod placement;
pub mod predictor;
pub mod sim;
pub mod solve;
pub mod synth;
pub mod tune;

pub use error::{Result, SynthError};
