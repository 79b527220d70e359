//! Read latencies as the engine sees them: from a read's submission to its
//! completion being reaped, by the queue depth in force when it was issued.
//! The controller's model is fitted to these (`leanstream-synth`), not only
//! to the profiler's, because the engine's reads (merged runs of bundles,
//! reaped by a thread that shares the cores with compute) are not the
//! profiler's fixed-size blocks on an idle machine.

use std::collections::BTreeMap;

/// Samples kept per queue depth (the most recent).
const KEEP: usize = 4096;

/// Points of the latency summary: the 0, 1, ..., 100th percentiles.
pub const QUANTILES: usize = 101;

#[derive(Debug, Clone, Default)]
struct Ring {
    latency_us: Vec<f32>,
    bytes: Vec<u32>,
    next: usize,
    reads: u64,
}

impl Ring {
    fn push(&mut self, latency_us: f32, bytes: u32) {
        if self.latency_us.len() < KEEP {
            self.latency_us.push(latency_us);
            self.bytes.push(bytes);
        } else {
            self.latency_us[self.next] = latency_us;
            self.bytes[self.next] = bytes;
            self.next = (self.next + 1) % KEEP;
        }
        self.reads += 1;
    }
}

/// Latency samples of finished reads, per queue depth.
#[derive(Debug, Clone, Default)]
pub struct LatencyLog {
    by_depth: BTreeMap<u32, Ring>,
}

/// The latencies of one queue depth.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DepthLatency {
    pub queue_depth: u32,
    /// Reads finished at this depth (all of them; the summary covers the
    /// most recent few thousand).
    pub reads: u64,
    /// Mean bytes per read of the summarized ones.
    pub mean_bytes: f64,
    /// Latency percentiles 0..=100 in µs ([`QUANTILES`] points).
    pub latency_us: Vec<f64>,
}

impl LatencyLog {
    pub fn record(&mut self, queue_depth: u32, latency_us: f32, bytes: u32) {
        self.by_depth.entry(queue_depth).or_default().push(latency_us, bytes);
    }

    /// One summary per queue depth that finished a read, by depth.
    pub fn summary(&self) -> Vec<DepthLatency> {
        self.by_depth
            .iter()
            .filter(|(_, r)| !r.latency_us.is_empty())
            .map(|(&queue_depth, r)| {
                let mut v: Vec<f64> = r.latency_us.iter().map(|&x| x as f64).collect();
                v.sort_by(f64::total_cmp);
                let n = v.len();
                let latency_us = (0..QUANTILES)
                    .map(|i| {
                        let x = i as f64 / (QUANTILES - 1) as f64 * (n - 1) as f64;
                        let (lo, hi) = (x.floor() as usize, (x.floor() as usize + 1).min(n - 1));
                        v[lo] + (v[hi] - v[lo]) * (x - lo as f64)
                    })
                    .collect();
                DepthLatency {
                    queue_depth,
                    reads: r.reads,
                    mean_bytes: r.bytes.iter().map(|&b| b as f64).sum::<f64>() / n as f64,
                    latency_us,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_per_depth_follow_the_samples() {
        let mut log = LatencyLog::default();
        for i in 0..=100 {
            log.record(16, i as f32 * 10.0, 4096);
        }
        log.record(1, 7.0, 8192);
        let s = log.summary();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].queue_depth, s[0].reads, s[0].mean_bytes), (1, 1, 8192.0));
        assert!(s[0].latency_us.iter().all(|&x| x == 7.0));
        let d16 = &s[1];
        assert_eq!(d16.latency_us.len(), QUANTILES);
        assert_eq!(d16.latency_us[0], 0.0);
        assert_eq!(d16.latency_us[50], 500.0);
        assert_eq!(d16.latency_us[100], 1000.0);
    }

    #[test]
    fn only_the_most_recent_samples_are_summarized() {
        let mut log = LatencyLog::default();
        for _ in 0..KEEP {
            log.record(4, 1.0, 100);
        }
        for _ in 0..KEEP {
            log.record(4, 9.0, 300);
        }
        let s = &log.summary()[0];
        assert_eq!(s.reads, 2 * KEEP as u64);
        assert_eq!(s.mean_bytes, 300.0);
        assert!(s.latency_us.iter().all(|&x| x == 9.0));
    }
}
