//! How the streamer turns a layer's needed flash positions into read
//! requests; shared with offline evaluation (`leanstream-synth placement`)
//! so that both count reads the same way.

use super::io::IoConfig;

/// Most bundle bytes one request may span under `cfg`: a read buffer less
/// the alignment slack at both ends.
pub fn max_run_bytes(cfg: &IoConfig) -> usize {
    cfg.max_read_bytes.saturating_sub(2 * cfg.alignment)
}

/// The merging rule of one layer: bundles of `bundle_bytes`, a run spans at
/// most `max_run_bytes` (at least one bundle), and a gap of unneeded bundles
/// of at most `merge_gap_bytes` is read along rather than split the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunRule {
    pub bundle_bytes: usize,
    /// Most bundles in one run.
    pub max_run: usize,
    pub merge_gap_bytes: usize,
}

impl RunRule {
    pub fn new(bundle_bytes: usize, max_run_bytes: usize, merge_gap_bytes: usize) -> Self {
        Self {
            bundle_bytes,
            max_run: (max_run_bytes / bundle_bytes.max(1)).max(1),
            merge_gap_bytes,
        }
    }

    /// Adds needed position `p` to `runs` (each `(first position, bundles)`);
    /// positions must come in increasing order.
    #[inline]
    pub fn push(&self, runs: &mut Vec<(usize, usize)>, p: usize) {
        match runs.last_mut() {
            Some((p0, n))
                if p + 1 - *p0 <= self.max_run && (p - (*p0 + *n)) * self.bundle_bytes <= self.merge_gap_bytes =>
            {
                *n = p + 1 - *p0
            }
            _ => runs.push((p, 1)),
        }
    }
}
