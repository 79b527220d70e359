//! Faults under the running engine, for every streaming policy, injected
//! through the fault backend between the engine and the disk: a failed read
//! is an error naming the file, never a panic or wrong text; short reads
//! change nothing; a stalled read is waited for, or, under `speculate`'s
//! deadline, skipped and counted; a file replaced while it is read keeps
//! serving the file that was opened. After each, a new engine on the same
//! file runs the reference tokens. (Truncation under a running engine:
//! `flash_engine.rs`.)

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leanstream_kernels::GgmlType;
use leanstream_runtime::engine::{
    ActiveTrace, BackendFactory, Controller, EngineOptions, FlashEngine, FlashModel, Policy, Speculation,
};
use leanstream_runtime::flash::io::{make_backend, Backend, Fault, FaultyBackend, IoConfig};
use leanstream_runtime::flash::{DownType, PackOptions};
use leanstream_runtime::predict::{Predictor, PredictorConfig};
use leanstream_runtime::synthetic::SyntheticSpec;

const STREAMING: [Policy; 7] = [
    Policy::DenseStream,
    Policy::Oracle,
    Policy::GateFirst,
    Policy::Speculate,
    Policy::DejaVu,
    Policy::LlmInAFlash,
    Policy::PowerInfer2,
];
const PROMPT: [u32; 6] = [1, 20, 33, 47, 5, 9];
const N: usize = 4;

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine_faults");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A synthetic model packed with per-neuron down columns and neuron scores
/// (so `powerinfer2` has a hot set), layers of many reads.
fn packed(name: &str, seed: u64) -> PathBuf {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    (spec.n_embd, spec.n_ff, spec.n_layer, spec.seed) = (256, 1024, 3, seed);
    let src = dir().join(format!("{name}.gguf"));
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let out = dir().join(format!("{name}.lsflash"));
    let opts = PackOptions {
        down: DownType::Q8_0,
        neuron_scores: (0..3)
            .map(|l| (0..1024).map(|i| ((i * 7 + l) % 13) as f32 + 0.5).collect())
            .collect(),
        ..PackOptions::default()
    };
    leanstream_runtime::flash::pack(&src, &out, &opts).unwrap();
    out
}

/// `policy` at sparsity 0 with a quarter of the FFN cached, no merging (many
/// reads), a random predictor and `controller`.
fn options(fx: &Fixture, policy: Policy, controller: Controller) -> EngineOptions {
    let fm = &fx.fm;
    let c = &fm.model.config;
    let cfg = PredictorConfig::hashing(c.n_embd, c.n_ff, 32, c.n_layer, 32, 16, 8, 2);
    let mut p = Predictor::random(cfg, &["speculate", "refine"], 3).unwrap();
    let sha = leanstream_runtime::fetch::hex(&fm.flash.header().source_sha256);
    p.provenance = serde_json::json!({"model": {"sha256": sha}}).to_string();
    EngineOptions {
        // The oracle replays the dense run's sets.
        trace: (policy == Policy::Oracle).then(|| fx.trace.clone()),
        speculation: Some(Speculation {
            predictor: Arc::new(p),
            predictor_name: "random.lspred".into(),
            controller,
            prior_breadth: Speculation::PRIOR_BREADTH,
        }),
        ..common::plain_options(fm, policy, fm.ffn_bytes() / 4)
    }
}

/// No deadline: at sparsity 0 every policy computes what `dense` does.
fn exact() -> Controller {
    Controller::parse_fixed("fixed:d=inf").unwrap()
}

fn faulty(faults: Vec<(u64, Fault)>) -> BackendFactory {
    Box::new(move |cfg: &IoConfig| {
        Ok(Box::new(FaultyBackend::new(make_backend(cfg)?, faults.clone())) as Box<dyn Backend>)
    })
}

/// A packed model and its dense run: tokens, logits and kept sets.
struct Fixture {
    fm: FlashModel,
    want: common::Run,
    trace: ActiveTrace,
}

fn fixture(path: &Path) -> Fixture {
    let fm = FlashModel::open(path).unwrap();
    let mut dense = fm
        .engine_with(EngineOptions {
            record: true,
            ..common::plain_options(&fm, Policy::Dense, fm.ffn_bytes())
        })
        .unwrap();
    let want = common::greedy_flash(&fm, &mut dense, &PROMPT, N).unwrap();
    let trace = dense.take_trace().unwrap();
    Fixture { fm, want, trace }
}

impl Fixture {
    fn engine(&self, policy: Policy, controller: Controller, faults: Option<Vec<(u64, Fault)>>) -> FlashEngine {
        self.fm
            .engine_on(options(self, policy, controller), faults.map(faulty))
            .unwrap()
    }

    fn run(&self, e: &mut FlashEngine) -> leanstream_runtime::Result<common::Run> {
        common::greedy_flash(&self.fm, e, &PROMPT, N)
    }

    /// A new engine without faults gives the dense run.
    fn runs_again(&self, policy: Policy) {
        let run = self.run(&mut self.engine(policy, exact(), None)).unwrap();
        assert!(
            common::same_bits(&run, &self.want),
            "{policy}: a new engine after the fault"
        );
    }
}

#[test]
fn a_failed_read_is_an_error_naming_the_file_for_every_policy() {
    let path = packed("eio", 1);
    let fx = fixture(&path);
    for policy in STREAMING {
        // Read 0 fails before any token; read 40 in the middle of the run.
        for (at, errno) in [(0u64, libc::EIO), (40, libc::EIO), (25, libc::ENODEV)] {
            let mut e = fx.engine(policy, exact(), Some(vec![(at, Fault::Errno(errno))]));
            let err = fx
                .run(&mut e)
                .expect_err(&format!(
                    "{policy}: read {at} failed with errno {errno}, yet the run succeeded"
                ))
                .to_string();
            eprintln!("{policy}, read {at}: {err}");
            assert!(err.contains(&path.display().to_string()), "{policy}: {err}");
            let os = std::io::Error::from_raw_os_error(errno).to_string();
            assert!(err.contains(&os), "{policy}: {err} does not say {os}");
        }
        fx.runs_again(policy);
    }
}

#[test]
fn short_reads_change_nothing_for_every_policy() {
    let fx = fixture(&packed("short", 2));
    // Every third read of the first 300 comes back short, down to one byte.
    let faults: Vec<(u64, Fault)> = (0..100u64)
        .map(|k| (3 * k, Fault::Short([4096, 1000, 1][k as usize % 3])))
        .collect();
    for policy in STREAMING {
        let run = fx.run(&mut fx.engine(policy, exact(), Some(faults.clone()))).unwrap();
        assert!(common::same_bits(&run, &fx.want), "{policy} with short reads");
    }
}

#[test]
fn a_stalled_read_is_waited_for_or_skipped_under_a_deadline() {
    const STALL: Duration = Duration::from_millis(1500);
    let fx = fixture(&packed("stall", 3));
    // Without a deadline every policy waits and computes the same bits.
    for policy in [Policy::DenseStream, Policy::Speculate] {
        let mut e = fx.engine(policy, exact(), Some(vec![(30, Fault::Stall(STALL))]));
        let t = Instant::now();
        let run = fx.run(&mut e).unwrap();
        assert!(t.elapsed() >= STALL, "{policy}: the stall was not injected");
        assert!(common::same_bits(&run, &fx.want), "{policy} after waiting out a stall");
        assert_eq!(e.stats().late_skipped, 0);
    }
    // Under a deadline `speculate` skips what has not landed and counts it,
    // and the run still finishes with finite logits.
    let deadline = Controller::parse_fixed("fixed:d=2").unwrap();
    let stalls: Vec<(u64, Fault)> = (10..400).step_by(7).map(|k| (k, Fault::Stall(STALL))).collect();
    let mut e = fx.engine(Policy::Speculate, deadline, Some(stalls));
    let (toks, logits) = fx.run(&mut e).unwrap();
    let s = e.stats();
    eprintln!("speculate under stalls: {s:?}");
    assert_eq!(toks.len(), N);
    assert!(logits.iter().flatten().all(|v| v.is_finite()));
    assert!(s.late_skipped > 0, "no bundle was skipped past its deadline: {s:?}");
    assert!(s.skipped_fraction() > 0.0, "{s:?}");
    fx.runs_again(Policy::Speculate);
}

/// Renames another model over `path` (what a re-pack or a download does).
fn replace(path: &Path, with: &Path) {
    let tmp = path.with_extension("replacing");
    std::fs::copy(with, &tmp).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn a_file_replaced_while_running_keeps_serving_the_opened_one() {
    let path = packed("replaced", 4);
    let other = packed("replacement", 5);
    let orig = dir().join("replaced.orig.lsflash");
    std::fs::copy(&path, &orig).unwrap();
    for policy in STREAMING {
        let fx = fixture(&path);
        let fm = &fx.fm;
        let mut e = fx.engine(policy, exact(), None);
        let mut st = fm.model.new_state(PROMPT.len() + N + 1, PROMPT.len(), 1);
        fm.forward(&mut st, &mut e, &PROMPT, 0, PROMPT.len() - 1..PROMPT.len())
            .unwrap();
        replace(&path, &other);
        let mut toks = Vec::new();
        for pos in PROMPT.len()..PROMPT.len() + N {
            let tok = leanstream_runtime::generate::argmax(fm.model.logits(&mut st, 0, 1).unwrap());
            toks.push(tok);
            fm.forward(&mut st, &mut e, &[tok], pos, 0..1).unwrap();
        }
        assert_eq!(toks, fx.want.0, "{policy}: tokens changed when the file was replaced");
        // Put the original back for the next policy.
        replace(&path, &orig);
    }
}
