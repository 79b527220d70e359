//! Counters of the server and a snapshot of the engine, rendered in
//! Prometheus' text format for `GET /metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use leanstream_runtime::cache::MemoryReport;
use leanstream_runtime::engine::EngineStats;
use leanstream_runtime::generate::GenerationStats;

use crate::ServerError;

/// The flash engine as it stood after the last request.
#[derive(Debug, Clone)]
pub struct EngineSnapshot {
    pub policy: String,
    pub stats: EngineStats,
    pub memory: MemoryReport,
}

/// The continuous batch as it stood after the last step (`--parallel`).
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchSnapshot {
    /// Requests generating, and of them those still running their prompt.
    pub active: usize,
    pub prefilling: usize,
    /// Requests that may generate at once.
    pub max: usize,
    /// Decode passes run, and the rows (one per request) they held.
    pub passes: u64,
    pub rows: u64,
}

#[derive(Debug, Default)]
pub struct Metrics {
    completed: AtomicU64,
    cancelled: AtomicU64,
    /// Failed after being queued: a bad prompt (4xx) or an engine error.
    failed_client: AtomicU64,
    failed_server: AtomicU64,
    /// Refused before reaching the queue (malformed, unauthorised).
    rejected: AtomicU64,
    queue_full: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Prompt tokens whose KV cache an earlier request left (not run again).
    reused_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    prompt_ns: AtomicU64,
    decode_ns: AtomicU64,
    /// Decode passes, and the drafted tokens they checked and accepted.
    decode_passes: AtomicU64,
    drafted: AtomicU64,
    accepted: AtomicU64,
    busy: AtomicBool,
    prompt_cache_bytes: AtomicU64,
    engine: Mutex<Option<EngineSnapshot>>,
    batch: Mutex<Option<BatchSnapshot>>,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Metrics {
    pub fn count_completed(&self) {
        add(&self.completed, 1);
    }

    pub fn count_cancelled(&self) {
        add(&self.cancelled, 1);
    }

    pub fn count_failed(&self, e: &ServerError) {
        if e.status().is_client_error() {
            add(&self.failed_client, 1);
        } else {
            add(&self.failed_server, 1);
        }
    }

    pub fn count_rejected(&self) {
        add(&self.rejected, 1);
    }

    pub fn count_queue_full(&self) {
        add(&self.queue_full, 1);
    }

    pub fn count_tokens(&self, s: &GenerationStats) {
        add(&self.prompt_tokens, s.prompt_tokens as u64);
        add(&self.reused_tokens, s.reused_tokens as u64);
        add(&self.completion_tokens, s.generated_tokens as u64);
        add(&self.prompt_ns, s.prompt_time.as_nanos() as u64);
        add(&self.decode_ns, s.decode_time.as_nanos() as u64);
        add(&self.decode_passes, s.draft.passes);
        add(&self.drafted, s.draft.drafted);
        add(&self.accepted, s.draft.accepted);
    }

    pub fn set_prompt_cache_bytes(&self, bytes: usize) {
        self.prompt_cache_bytes.store(bytes as u64, Ordering::Relaxed);
    }

    pub fn set_busy(&self, busy: bool) {
        self.busy.store(busy, Ordering::Relaxed);
    }

    pub fn set_engine(&self, snapshot: EngineSnapshot) {
        *self.engine.lock().unwrap_or_else(|e| e.into_inner()) = Some(snapshot);
    }

    pub fn set_batch(&self, snapshot: BatchSnapshot) {
        *self.batch.lock().unwrap_or_else(|e| e.into_inner()) = Some(snapshot);
    }

    /// The Prometheus text exposition.
    pub fn render(&self, queue_len: usize, queue_capacity: usize) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP leanstream_{name} {help}\n# TYPE leanstream_{name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "leanstream_{name}{labels} {v}");
            }
        };
        let outcome = |o: &str, v: u64| (format!("{{outcome=\"{o}\"}}"), v as f64);
        let outcomes = [
            outcome("completed", g(&self.completed)),
            outcome("cancelled", g(&self.cancelled)),
            outcome("client_error", g(&self.failed_client) + g(&self.rejected)),
            outcome("server_error", g(&self.failed_server)),
            outcome("queue_full", g(&self.queue_full)),
        ];
        let outcomes: Vec<(&str, f64)> = outcomes.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        metric("requests_total", "counter", "Requests by how they ended.", &outcomes);
        let (pt, ct) = (g(&self.prompt_tokens), g(&self.completion_tokens));
        let (ps, ds) = (g(&self.prompt_ns) as f64 * 1e-9, g(&self.decode_ns) as f64 * 1e-9);
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens processed.",
            &[("", pt as f64)],
        );
        let reused = g(&self.reused_tokens) as f64;
        metric(
            "prompt_tokens_reused_total",
            "counter",
            "Prompt tokens served from the previous request's KV cache.",
            &[("", reused)],
        );
        metric(
            "completion_tokens_total",
            "counter",
            "Tokens generated.",
            &[("", ct as f64)],
        );
        metric(
            "decode_passes_total",
            "counter",
            "Forward passes of the decode (one token each without drafting).",
            &[("", g(&self.decode_passes) as f64)],
        );
        metric(
            "draft_tokens_total",
            "counter",
            "Drafted tokens checked, by outcome.",
            &[
                ("{outcome=\"accepted\"}", g(&self.accepted) as f64),
                ("{outcome=\"refused\"}", (g(&self.drafted) - g(&self.accepted)) as f64),
            ],
        );
        metric("prompt_seconds_total", "counter", "Time spent on prompts.", &[("", ps)]);
        metric("decode_seconds_total", "counter", "Time spent generating.", &[("", ds)]);
        let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        metric(
            "prompt_tokens_per_second",
            "gauge",
            "Prompt tokens per second since start.",
            &[("", rate(pt, ps))],
        );
        metric(
            "decode_tokens_per_second",
            "gauge",
            "Generated tokens per second since start.",
            &[("", rate(ct, ds))],
        );
        metric(
            "queue_length",
            "gauge",
            "Requests waiting for the engine.",
            &[("", queue_len as f64)],
        );
        metric(
            "queue_capacity",
            "gauge",
            "Requests that may wait before 503.",
            &[("", queue_capacity as f64)],
        );
        if let Some(b) = *self.batch.lock().unwrap_or_else(|e| e.into_inner()) {
            // Every slot taken is the one reason a request waits.
            let full = if b.active >= b.max { queue_len } else { 0 };
            metric(
                "queue_waiting",
                "gauge",
                "Requests waiting, by why.",
                &[("{reason=\"sequences_full\"}", full as f64)],
            );
            metric(
                "sequences",
                "gauge",
                "Requests generating together, by phase.",
                &[
                    ("{phase=\"prompt\"}", b.prefilling as f64),
                    ("{phase=\"decode\"}", (b.active - b.prefilling) as f64),
                ],
            );
            metric(
                "sequences_max",
                "gauge",
                "Requests that may generate together (--parallel).",
                &[("", b.max as f64)],
            );
            metric(
                "batch_passes_total",
                "counter",
                "Decode passes shared by the requests generating together.",
                &[("", b.passes as f64)],
            );
            metric(
                "batch_rows_total",
                "counter",
                "Rows of those passes (one per request a pass).",
                &[("", b.rows as f64)],
            );
        }
        let busy = f64::from(u8::from(self.busy.load(Ordering::Relaxed)));
        metric("busy", "gauge", "1 while a request is generating.", &[("", busy)]);
        let kept = g(&self.prompt_cache_bytes) as f64;
        metric(
            "prompt_cache_bytes",
            "gauge",
            "Earlier prompts' keys and values kept.",
            &[("", kept)],
        );
        let rss = leanstream_runtime::cache::peak_rss_bytes() as f64;
        metric(
            "peak_rss_bytes",
            "gauge",
            "Peak resident set size of the process.",
            &[("", rss)],
        );
        if let Some(e) = self.engine.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let s = &e.stats;
            let per_token = |x: u64| x as f64 / s.tokens.max(1) as f64;
            metric(
                "read_bytes_per_token",
                "gauge",
                "Flash bytes read per token.",
                &[("", per_token(s.bytes_read))],
            );
            metric(
                "reads_per_token",
                "gauge",
                "Flash reads per token.",
                &[("", per_token(s.reads))],
            );
            metric(
                "cache_miss_ratio",
                "gauge",
                "Neuron cache misses over lookups.",
                &[("", s.cache_miss_ratio())],
            );
            metric(
                "skipped_fraction",
                "gauge",
                "FFN neurons skipped.",
                &[("", s.skipped_fraction())],
            );
            let m = &e.memory;
            let cats = [
                ("resident_weights", m.resident_weights),
                ("kv_cache", m.kv_cache),
                ("ffn_cache", m.ffn_cache),
                ("io_buffers", m.io_buffers),
                ("predictor", m.predictor),
                ("tokenizer", m.tokenizer),
                ("other", m.other),
            ];
            let labels: Vec<String> = cats.iter().map(|(c, _)| format!("{{category=\"{c}\"}}")).collect();
            let samples: Vec<(&str, f64)> = labels
                .iter()
                .zip(cats)
                .map(|(l, (_, b))| (l.as_str(), b as f64))
                .collect();
            metric("memory_bytes", "gauge", "Accounted memory by category.", &samples);
            let policy = format!("{{policy=\"{}\"}}", e.policy);
            metric(
                "engine_info",
                "gauge",
                "The FFN policy in use.",
                &[(policy.as_str(), 1.0)],
            );
        }
        out
    }
}
