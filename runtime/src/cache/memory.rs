//! Memory accounting: where the process's bytes go, and its peak RSS.

use std::fmt;

/// Bytes held by each part of the engine. The budget story is only honest if
/// every large allocation lands in one of these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Weights kept in memory (attention, norms, embeddings, output).
    pub resident_weights: u64,
    pub kv_cache: u64,
    /// The neuron cache slab (`NeuronCache::capacity_bytes`).
    pub ffn_cache: u64,
    /// Read buffers of the I/O engine.
    pub io_buffers: u64,
    pub predictor: u64,
    /// The tokenizer's tables (estimated from their capacities).
    pub tokenizer: u64,
    pub other: u64,
}

impl MemoryReport {
    pub fn total(&self) -> u64 {
        self.resident_weights
            + self.kv_cache
            + self.ffn_cache
            + self.io_buffers
            + self.predictor
            + self.tokenizer
            + self.other
    }
}

impl fmt::Display for MemoryReport {
    /// One line, e.g. `weights 1.20 GiB + kv 64.0 MiB + ffn cache 512 MiB +
    /// io 8.00 MiB + predictor 0 B + other 0 B = 1.77 GiB`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "weights {} + kv {} + ffn cache {} + io {} + predictor {} + tokenizer {} + other {} = {}",
            fmt_bytes(self.resident_weights),
            fmt_bytes(self.kv_cache),
            fmt_bytes(self.ffn_cache),
            fmt_bytes(self.io_buffers),
            fmt_bytes(self.predictor),
            fmt_bytes(self.tokenizer),
            fmt_bytes(self.other),
            fmt_bytes(self.total()),
        )
    }
}

/// Bytes with a binary unit and three significant digits: `0 B`, `512 B`,
/// `1.50 KiB`, `64.0 MiB`, `512 MiB`, `1.20 GiB`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if v >= 100.0 {
        format!("{v:.0} {}", UNITS[u])
    } else if v >= 10.0 {
        format!("{v:.1} {}", UNITS[u])
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// The process's resident set now (`VmRSS`), in bytes; 0 where
/// `/proc/self/status` cannot be read.
pub fn rss_bytes() -> u64 {
    proc_status_kb("VmRSS:") * 1024
}

/// Peak resident set size of this process (`VmHWM`), in bytes; 0 where
/// `/proc/self/status` cannot be read.
pub fn peak_rss_bytes() -> u64 {
    proc_status_kb("VmHWM:") * 1024
}

fn proc_status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_totals_and_displays() {
        let r = MemoryReport {
            resident_weights: 3 << 29,
            kv_cache: 64 << 20,
            ffn_cache: 512 << 20,
            io_buffers: 8 << 20,
            predictor: 0,
            tokenizer: 1 << 20,
            other: 1536,
        };
        assert_eq!(r.total(), (3 << 29) + (585 << 20) + 1536);
        let s = r.to_string();
        assert_eq!(
            s,
            "weights 1.50 GiB + kv 64.0 MiB + ffn cache 512 MiB + io 8.00 MiB + predictor 0 B + tokenizer 1.00 MiB + other 1.50 KiB = 2.07 GiB"
        );
        assert!(!s.contains('\n'));
    }

    #[test]
    fn peak_rss_is_positive_on_linux() {
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(peak_rss_bytes() > 0);
        }
    }
}
