//! Per-condition summary of a run: counts and latency quantiles through
//! polars' lazy API, throughput from the per-visit wall times, the precision
//! actually reached, and contamination flags.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use polars::prelude::*;
use serde::Serialize;

use crate::plan::Plan;
use crate::plan::{quantile_ci_rel, Condition};
use crate::runner::{label, read_plan};
use crate::shard::{SampleRow, ShardProblem, ShardStore};
use crate::{ProfileError, Result};

/// p50 below this (µs) cannot be a flash read: the page cache (or some
/// cache in front of the device) answered.
pub const CACHE_FLOOR_US: f64 = 3.0;
/// The device must serve at least this share of the bytes requested.
pub const MIN_DEVICE_SHARE: f64 = 0.9;
/// The first visit's median differs from the median of the later visits'
/// medians by more than this, and lies outside their range.
pub const WARMUP_TOLERANCE: f64 = 0.25;

/// One condition's row of the summary (`--json` emits these objects).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConditionSummary {
    pub condition_id: u32,
    pub condition: String,
    pub sweep: String,
    pub engine: String,
    pub pattern: String,
    pub block_size: u64,
    pub queue_depth: u32,
    pub workers: u32,
    pub kernel: String,
    pub neurons: u32,
    pub stages: u32,
    pub ctx_len: u32,
    pub threads: u32,
    pub background_io: bool,
    pub samples: u64,
    pub rounds: u64,
    pub throughput_bytes_s: f64,
    pub lat_mean_us: f64,
    pub lat_p50_us: f64,
    pub lat_p90_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    pub lat_max_us: f64,
    /// Relative half-width of the 95 % CI of p50 / p99 (null: too few samples).
    pub p50_ci_rel: Option<f64>,
    pub p99_ci_rel: Option<f64>,
    /// Bytes the block device served / bytes requested (I/O, when sysfs tells).
    pub device_read_ratio: Option<f64>,
    pub page_cache_suspect: bool,
    pub warmup_suspect: bool,
    pub first_round_p50_us: f64,
    pub later_rounds_p50_us: Option<f64>,
}

/// The columns the summary reads (labels come from the plan, so the wide
/// string columns of a long run are never loaded).
pub const COLUMNS: [&str; 7] = [
    "condition_id",
    "round",
    "latency_ns",
    "batch_wall_ns",
    "batch_bytes",
    "device_read_bytes",
    "sample_idx",
];

/// A loaded run: its plan, its samples (the [`COLUMNS`]) and the shards that had to be skipped.
pub struct Loaded {
    pub plan: Plan,
    pub frame: DataFrame,
    pub problems: Vec<ShardProblem>,
}

pub fn load(dir: &Path) -> Result<Loaded> {
    let plan = read_plan(dir)?;
    let store = ShardStore::open(dir)?;
    let (frame, problems, _) = store.load_columns(Some(&COLUMNS))?;
    Ok(Loaded { plan, frame, problems })
}

fn us(name: &str, q: f64) -> Expr {
    (col("latency_ns")
        .cast(DataType::Float64)
        .quantile(lit(q), QuantileMethod::Linear)
        / lit(1000.0))
    .alias(name)
}

/// Summarizes the samples of `df` (at least the [`COLUMNS`]) per condition
/// of `conditions`, ordered by condition id.
pub fn summarize(df: &DataFrame, conditions: &[Condition]) -> Result<Vec<ConditionSummary>> {
    if df.height() == 0 {
        return Ok(Vec::new());
    }
    let labels: HashMap<u32, SampleRow> = conditions
        .iter()
        .map(|c| {
            let mut r = SampleRow::default();
            label(&mut r, c);
            (c.id, r)
        })
        .collect();
    let lf = df.clone().lazy();
    let mut aggs: Vec<Expr> = Vec::new();
    aggs.extend([
        len().cast(DataType::UInt64).alias("samples"),
        (col("latency_ns").cast(DataType::Float64).mean() / lit(1000.0)).alias("lat_mean_us"),
        us("lat_p50_us", 0.5),
        us("lat_p90_us", 0.9),
        us("lat_p99_us", 0.99),
        us("lat_p999_us", 0.999),
        (col("latency_ns").cast(DataType::Float64).max() / lit(1000.0)).alias("lat_max_us"),
    ]);
    let stats = lf
        .clone()
        .group_by([col("condition_id")])
        .agg(aggs)
        .sort(["condition_id"], SortMultipleOptions::default())
        .collect()?;
    // One row per visit: a condition is visited once per round.
    let visits = lf
        .group_by([col("condition_id"), col("round")])
        .agg([
            col("batch_wall_ns").first().cast(DataType::Float64),
            col("batch_bytes").first().cast(DataType::Float64),
            col("device_read_bytes").first().cast(DataType::Float64),
            col("latency_ns").cast(DataType::Float64).median().alias("visit_p50_ns"),
        ])
        .sort(["condition_id", "round"], SortMultipleOptions::default())
        .collect()?;

    #[derive(Default)]
    struct V {
        wall: f64,
        bytes: f64,
        dev: f64,
        dev_bytes: f64,
        p50s: Vec<f64>,
    }
    let mut per: HashMap<u32, V> = HashMap::new();
    {
        let id = visits.column("condition_id")?.u32()?;
        let wall = visits.column("batch_wall_ns")?.f64()?;
        let bytes = visits.column("batch_bytes")?.f64()?;
        let dev = visits.column("device_read_bytes")?.f64()?;
        let p50 = visits.column("visit_p50_ns")?.f64()?;
        for i in 0..visits.height() {
            let v = per.entry(id.get(i).unwrap_or(0)).or_default();
            let b = bytes.get(i).unwrap_or(0.0);
            v.wall += wall.get(i).unwrap_or(0.0);
            v.bytes += b;
            if let Some(d) = dev.get(i) {
                v.dev += d;
                v.dev_bytes += b;
            }
            v.p50s.push(p50.get(i).unwrap_or(0.0));
        }
    }
    // Raw latencies per condition for the precision reached.
    let mut lats: HashMap<u32, Vec<f64>> = HashMap::new();
    {
        let id = df.column("condition_id")?.u32()?;
        let lat = df.column("latency_ns")?.u64()?;
        for (c, l) in id.iter().zip(lat.iter()) {
            if let (Some(c), Some(l)) = (c, l) {
                lats.entry(c).or_default().push(l as f64);
            }
        }
    }

    let f64c = |name: &str| -> Result<Float64Chunked> { Ok(stats.column(name)?.f64()?.clone()) };
    let ids = stats.column("condition_id")?.u32()?.clone();
    let samples = stats.column("samples")?.u64()?.clone();
    let (mean, p50, p90, p99, p999, max) = (
        f64c("lat_mean_us")?,
        f64c("lat_p50_us")?,
        f64c("lat_p90_us")?,
        f64c("lat_p99_us")?,
        f64c("lat_p999_us")?,
        f64c("lat_max_us")?,
    );
    let mut out = Vec::with_capacity(stats.height());
    for i in 0..stats.height() {
        let id = ids.get(i).unwrap_or(0);
        let v = per.remove(&id).unwrap_or_default();
        let mut l = lats.remove(&id).unwrap_or_default();
        l.sort_by(f64::total_cmp);
        let lab = labels
            .get(&id)
            .ok_or_else(|| ProfileError::Invalid(format!("samples of condition {id}, which the plan does not have")))?;
        let sweep_i = lab.sweep.clone();
        let p50_us = p50.get(i).unwrap_or(f64::NAN);
        let device_read_ratio = (sweep_i == "io" && v.dev_bytes > 0.0).then(|| v.dev / v.dev_bytes);
        let page_cache_suspect =
            sweep_i == "io" && (p50_us < CACHE_FLOOR_US || device_read_ratio.is_some_and(|r| r < MIN_DEVICE_SHARE));
        let first = v.p50s.first().copied().unwrap_or(f64::NAN) / 1000.0;
        // The later visits' medians: their median, and their range (how much
        // a visit's median varies anyway on this device).
        let (later, later_lo, later_hi) = if v.p50s.len() >= 3 {
            let mut rest = v.p50s[1..].to_vec();
            rest.sort_by(f64::total_cmp);
            (
                Some(rest[rest.len() / 2] / 1000.0),
                rest[0] / 1000.0,
                rest[rest.len() - 1] / 1000.0,
            )
        } else {
            (None, f64::NAN, f64::NAN)
        };
        let warmup_suspect = later.is_some_and(|m| {
            m > 0.0 && (first / m - 1.0).abs() > WARMUP_TOLERANCE && (first < later_lo || first > later_hi)
        });
        out.push(ConditionSummary {
            condition_id: id,
            condition: lab.condition.clone(),
            sweep: sweep_i,
            engine: lab.engine.clone(),
            pattern: lab.pattern.clone(),
            block_size: lab.block_size,
            queue_depth: lab.queue_depth,
            workers: lab.workers,
            kernel: lab.kernel.clone(),
            neurons: lab.neurons,
            stages: lab.stages,
            ctx_len: lab.ctx_len,
            threads: lab.threads,
            background_io: lab.background_io,
            samples: samples.get(i).unwrap_or(0),
            rounds: v.p50s.len() as u64,
            throughput_bytes_s: if v.wall > 0.0 { v.bytes / (v.wall * 1e-9) } else { 0.0 },
            lat_mean_us: mean.get(i).unwrap_or(f64::NAN),
            lat_p50_us: p50_us,
            lat_p90_us: p90.get(i).unwrap_or(f64::NAN),
            lat_p99_us: p99.get(i).unwrap_or(f64::NAN),
            lat_p999_us: p999.get(i).unwrap_or(f64::NAN),
            lat_max_us: max.get(i).unwrap_or(f64::NAN),
            p50_ci_rel: quantile_ci_rel(&l, 0.5),
            p99_ci_rel: quantile_ci_rel(&l, 0.99),
            device_read_ratio,
            page_cache_suspect,
            warmup_suspect,
            first_round_p50_us: first,
            later_rounds_p50_us: later,
        });
    }
    Ok(out)
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("±{:.1}%", v * 100.0))
}

/// The summary as a plain-text table.
pub fn table(rows: &[ConditionSummary]) -> String {
    let mut out = format!(
        "{:<44} {:>8} {:>6} {:>11} {:>10} {:>10} {:>10} {:>8} {:>8}  flags\n",
        "condition", "samples", "rounds", "MiB/s", "p50 µs", "p90 µs", "p99 µs", "p50 CI", "p99 CI"
    );
    for r in rows {
        let mut flags = Vec::new();
        if r.page_cache_suspect {
            flags.push("PAGE-CACHE?");
        }
        if r.warmup_suspect {
            flags.push("WARM-UP?");
        }
        out += &format!(
            "{:<44} {:>8} {:>6} {:>11.1} {:>10.1} {:>10.1} {:>10.1} {:>8} {:>8}  {}\n",
            r.condition,
            r.samples,
            r.rounds,
            r.throughput_bytes_s / (1 << 20) as f64,
            r.lat_p50_us,
            r.lat_p90_us,
            r.lat_p99_us,
            pct(r.p50_ci_rel),
            pct(r.p99_ci_rel),
            flags.join(" ")
        );
    }
    let total: u64 = rows.iter().map(|r| r.samples).sum();
    out += &format!("{} conditions, {} samples\n", rows.len(), total);
    out
}

/// Latencies (µs) per group key, for the CDF plot.
pub fn latencies_by<K: Ord + Clone>(
    df: &DataFrame,
    rows: &[ConditionSummary],
    key: impl Fn(&ConditionSummary) -> Option<K>,
) -> Result<BTreeMap<K, Vec<f64>>> {
    let keys: HashMap<u32, K> = rows.iter().filter_map(|r| Some((r.condition_id, key(r)?))).collect();
    let mut out: BTreeMap<K, Vec<f64>> = BTreeMap::new();
    let id = df.column("condition_id")?.u32()?;
    let lat = df.column("latency_ns")?.u64()?;
    for (c, l) in id.iter().zip(lat.iter()) {
        if let (Some(c), Some(l)) = (c, l) {
            if let Some(k) = keys.get(&c) {
                out.entry(k.clone()).or_default().push(l as f64 / 1000.0);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ConditionKind, Engine, IoCondition, Pattern};
    use crate::shard::{to_frame, SampleRow};

    fn conditions(n: u32) -> Vec<Condition> {
        (0..n)
            .map(|id| Condition {
                id,
                kind: ConditionKind::Io(IoCondition {
                    engine: Engine::IoUring,
                    pattern: Pattern::Random,
                    block_size: 4096,
                    queue_depth: 4 << id,
                    workers: 1,
                }),
            })
            .collect()
    }

    /// `visits` visits of 100 reads of 4 KiB, each visit 1 ms of wall time;
    /// latency `lat(visit, k)` ns.
    fn io_rows(id: u32, visits: u32, dev_share: f64, lat: impl Fn(u32, u64) -> u64) -> Vec<SampleRow> {
        let mut out = Vec::new();
        for v in 0..visits {
            for k in 0..100u64 {
                out.push(SampleRow {
                    sweep: "io".into(),
                    condition_id: id,
                    condition: format!("c{id}"),
                    engine: "io_uring".into(),
                    pattern: "random".into(),
                    block_size: 4096,
                    queue_depth: 4,
                    workers: 1,
                    round: v,
                    sample_idx: u64::from(v) * 100 + k,
                    bytes: 4096,
                    latency_ns: lat(v, k),
                    batch_wall_ns: 1_000_000,
                    batch_bytes: 409_600,
                    batch_samples: 100,
                    device_read_bytes: Some((409_600.0 * dev_share) as u64),
                    ..Default::default()
                });
            }
        }
        out
    }

    #[test]
    fn quantiles_throughput_and_flags() {
        let mut rows = io_rows(0, 5, 1.0, |_, k| 50_000 + k * 1000); // clean
        rows.extend(io_rows(1, 5, 1.0, |_, k| 1_000 + k)); // 1 µs reads: a cache answered
        rows.extend(io_rows(2, 5, 0.2, |_, k| 80_000 + k)); // device served 20 % of the bytes
        rows.extend(io_rows(
            3,
            5,
            1.0,
            |v, k| if v == 0 { 400_000 } else { 100_000 + k * 10 },
        )); // slow first visit
        let s = summarize(&to_frame(&rows).unwrap(), &conditions(4)).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[3].condition, "io_uring/random/4KiB/qd32/w1");
        assert_eq!(
            (s[3].engine.as_str(), s[3].queue_depth, s[3].block_size),
            ("io_uring", 32, 4096)
        );
        let c0 = &s[0];
        assert_eq!((c0.samples, c0.rounds), (500, 5));
        // latencies 50..149 µs: linear p50 = 99.5 µs, p99 = 148.01 µs.
        assert!((c0.lat_p50_us - 99.5).abs() < 1e-9, "{}", c0.lat_p50_us);
        assert!((c0.lat_p99_us - 148.01).abs() < 1e-9, "{}", c0.lat_p99_us);
        // 5 × 409600 bytes in 5 ms.
        assert!((c0.throughput_bytes_s - 409_600.0 / 1e-3).abs() < 1e-3);
        assert_eq!(c0.device_read_ratio, Some(1.0));
        assert!(!c0.page_cache_suspect && !c0.warmup_suspect);
        assert!(s[1].page_cache_suspect && !s[1].warmup_suspect);
        assert!(s[2].page_cache_suspect);
        assert!((s[2].device_read_ratio.unwrap() - 0.2).abs() < 1e-6);
        assert!(s[3].warmup_suspect && !s[3].page_cache_suspect);
        assert!((s[3].first_round_p50_us - 400.0).abs() < 1e-9);
        let t = table(&s);
        assert!(t.contains("PAGE-CACHE?") && t.contains("WARM-UP?") && t.contains("4 conditions, 2000 samples"));
    }
}
