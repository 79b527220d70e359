//! `leanstream-profiler`: resumable device profiling for LeanStream.
//!
//! - [`activations`]: activation traces of a real model on real text (`.npy` shards);
//! - [`plan`]: conditions, randomized rounds, the time budget and adaptive repetition;
//! - [`runner`]: the run loop shared by every sweep (flushes, Ctrl-C, progress);
//! - [`shard`]: append-only Parquet shards committed through a checksummed manifest;
//! - [`device`]: what the run measured on (CPU, memory, storage queue, fs, kernel, temperatures);
//! - [`io_sweep`] / [`compute_sweep`]: the executors of the two sweeps;
//! - [`sweeps`]: the grids of the two sweeps, and starting or resuming a run of one;
//! - [`summary`] / [`plot`]: per-condition quantiles (polars lazy) and SVG plots.

pub mod activations;
pub mod compute_gpu;
pub mod compute_sweep;
pub mod device;
pub mod error;
pub mod io_sweep;
pub mod parquet_check;
pub mod plan;
pub mod plot;
pub mod runner;
pub mod shard;
pub mod summary;
pub mod sweeps;
pub mod units;

pub use error::{ProfileError, Result};
