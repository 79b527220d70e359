//! `leanstream-profile activations` on a synthetic model: what each array
//! holds, shard commits and resumption, refusals and damaged files.

use std::fs;
use std::path::{Path, PathBuf};

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::record::{record, RecordOptions};
use leanstream_profiler::activations::{Array, Manifest};
use leanstream_runtime::synthetic::SyntheticSpec;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("profile-acts-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn text(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/text").join(name)
}

fn options(model: &Path, out: &Path, hot_fraction: f32) -> RecordOptions {
    RecordOptions {
        model: model.to_path_buf(),
        train: vec![text("apache-2.0.txt")],
        heldout: vec![text("gpl-3.0-excerpt.txt")],
        out: out.to_path_buf(),
        ctx: 64,
        shard_tokens: 128,
        max_tokens: Some(300),
        hot_fraction,
        progress: false,
    }
}

fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("tiny.gguf");
    fs::write(&model, SyntheticSpec::tiny("llama").build().unwrap().to_bytes()).unwrap();
    model
}

#[test]
fn arrays_hold_the_forward_pass_and_splits_stay_apart() {
    let dir = tmp("arrays");
    let model = tiny_model(&dir);
    // Every neuron hot: the partial output is the whole FFN output, so the
    // residual after attention plus it is the next layer's input.
    let m = record(&options(&model, &dir.join("acts"), 1.0)).unwrap();
    let t = Trace::open(&dir.join("acts")).unwrap();
    assert_eq!(m.splits.len(), 2);
    let (train, heldout) = (t.split("train").unwrap(), t.split("heldout").unwrap());
    assert_eq!(train.recorded_tokens(), 300);
    assert_eq!(train.recorded_tokens(), train.planned_tokens);
    assert!(heldout.recorded_tokens() > 0);
    assert_ne!(train.texts[0].sha256, heldout.texts[0].sha256);
    // Shards are whole windows of at most 128 tokens.
    assert!(train.shards.iter().all(|s| s.tokens <= 128));
    let tokens = t.tokens("train").unwrap();
    assert_eq!(tokens.len(), 300);
    for l in 0..t.n_layer() - 1 {
        let resid = t.layer("train", Array::Resid, l).unwrap();
        let partial = t.layer("train", Array::Partial, l).unwrap();
        let next = t.layer("train", Array::LayerIn, l + 1).unwrap();
        let mut worst = 0.0f32;
        for i in 0..next.data.len() {
            let scale = next.data[i].abs().max(1.0);
            worst = worst.max((resid.data[i] + partial.data[i] - next.data[i]).abs() / scale);
        }
        // f16 storage of three arrays.
        assert!(worst < 5e-3, "layer {l}: resid + partial vs next input, worst {worst}");
    }
    let act = t.layer("heldout", Array::Act, 0).unwrap();
    assert_eq!(act.cols, t.n_ff());
    assert!(act.data.iter().any(|&v| v != 0.0));
    let hot = t.hot().unwrap();
    assert!(hot.data.iter().all(|&h| h == 1.0));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_lost_shard_is_recorded_again_identically_and_other_settings_are_refused() {
    let dir = tmp("resume");
    let model = tiny_model(&dir);
    let out = dir.join("acts");
    let opts = options(&model, &out, 0.25);
    record(&opts).unwrap();
    let manifest_path = out.join("manifest.json");
    let full: Manifest = serde_json::from_slice(&fs::read(&manifest_path).unwrap()).unwrap();
    // Simulate a kill before the last shard of each split was committed.
    let mut cut = full.clone();
    let mut lost = Vec::new();
    for s in &mut cut.splits {
        let shard = s.shards.pop().unwrap();
        let files: Vec<(PathBuf, Vec<u8>)> = fs::read_dir(out.join(&shard.dir))
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                let b = fs::read(&p).unwrap();
                (p, b)
            })
            .collect();
        fs::remove_dir_all(out.join(&shard.dir)).unwrap();
        lost.extend(files);
    }
    fs::write(&manifest_path, serde_json::to_vec(&cut).unwrap()).unwrap();
    let again = record(&opts).unwrap();
    assert_eq!(again, full);
    for (p, bytes) in lost {
        assert_eq!(fs::read(&p).unwrap(), bytes, "{} differs after resuming", p.display());
    }
    // Another context length in the same directory is refused, naming it.
    let mut other = opts.clone();
    other.ctx = 32;
    let err = record(&other).unwrap_err().to_string();
    assert!(err.contains("other settings") && err.contains("acts"), "{err}");
    // A damaged array is an error naming the file, not garbage.
    let victim = out.join(&full.splits[0].shards[0].dir).join("act.npy");
    let len = fs::metadata(&victim).unwrap().len();
    let f = fs::OpenOptions::new().write(true).open(&victim).unwrap();
    f.set_len(len - 10).unwrap();
    let err = Trace::open(&out)
        .unwrap()
        .layer("train", Array::Act, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("act.npy") && err.contains("truncated"), "{err}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn texts_in_both_splits_and_empty_directories_are_checked() {
    let dir = tmp("refuse");
    let model = tiny_model(&dir);
    let mut opts = options(&model, &dir.join("acts"), 0.25);
    opts.heldout = opts.train.clone();
    let err = record(&opts).unwrap_err().to_string();
    assert!(err.contains("both a training and a held-out text"), "{err}");
    let busy = dir.join("busy");
    fs::create_dir_all(&busy).unwrap();
    fs::write(busy.join("other.txt"), "x").unwrap();
    let mut opts = options(&model, &busy, 0.25);
    opts.out = busy.clone();
    let err = record(&opts).unwrap_err().to_string();
    assert!(err.contains("not empty"), "{err}");
    let _ = fs::remove_dir_all(&dir);
}
