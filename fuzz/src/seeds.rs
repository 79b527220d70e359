//! The seed corpus: small files made by our own tools, run for real on a
//! tiny synthetic model and on real prose, so every seed is a valid file of
//! its format. Kilobytes each; written under `data/fuzz/<target>/seeds/`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::record::{record, RecordOptions};
use leanstream_runtime::flash::{pack, DownType, PackOptions};
use leanstream_runtime::model::Model;
use leanstream_runtime::sparsity::{calibrate, Calibration};
use leanstream_runtime::synthetic::{SyntheticSpec, VOCAB};
use leanstream_synth::{eviction, placement, predictor};

use leanstream_fuzz::{copy_tree, Target};

/// The smallest model every reader takes: 2 layers, width 32, 64 neurons,
/// Q4_0 (a quantized type, as real models have), byte-level vocabulary.
fn tiny_spec(arch: &str) -> SyntheticSpec {
    SyntheticSpec {
        n_layer: 2,
        n_embd: 32,
        n_ff: 64,
        n_head: 2,
        n_head_kv: 1,
        n_vocab: VOCAB,
        context_length: 64,
        weight_type: leanstream_kernels::GgmlType::Q4_0,
        ..SyntheticSpec::tiny(arch)
    }
}

/// Writes the seeds of every target under `out` (normally `data/fuzz`).
/// `repo` holds `data/text` and `data/controller`; `profile_bin` is the
/// `leanstream-profile` binary (a real I/O run makes the profiler's seeds).
pub fn write_all(out: &Path, repo: &Path, profile_bin: &Path) -> Result<()> {
    let work = std::env::temp_dir().join(format!("leanstream-fuzz-seeds-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let seeds = |t: Target| -> Result<PathBuf> {
        let d = out.join(t.name()).join("seeds");
        fs::create_dir_all(&d)?;
        Ok(d)
    };
    let put = |t: Target, name: &str, from: &Path| -> Result<()> {
        let to = seeds(t)?.join(name);
        fs::copy(from, &to).with_context(|| format!("{} -> {}", from.display(), to.display()))?;
        Ok(())
    };
    let text = repo.join("data/text/apache-2.0.txt");
    let heldout = repo.join("data/text/gpl-3.0-excerpt.txt");

    // Models: two architectures, then packed both ways and calibrated.
    let mut models = Vec::new();
    for arch in ["llama", "qwen2"] {
        let path = work.join(format!("tiny-{arch}.gguf"));
        tiny_spec(arch).write_file(&path, false)?;
        put(Target::Gguf, &format!("tiny-{arch}.gguf"), &path)?;
        models.push(path);
    }
    let model = &models[0];
    let loaded = Model::load(model)?;
    let prose = fs::read_to_string(&text)?;
    let cal = calibrate(&loaded, &prose[..4000], 32, &[0.5, 0.8])?;
    let calibration = Calibration {
        model: "tiny-llama.gguf".into(),
        text: "apache-2.0.txt".into(),
        tokens: cal.tokens,
        levels: cal.levels.clone(),
        neuron_scores: cal.neuron_scores.clone(),
    };
    fs::write(
        seeds(Target::Calibration)?.join("tiny-llama.json"),
        serde_json::to_vec(&calibration)?,
    )?;
    let flash = work.join("source.lsflash");
    pack(
        model,
        &flash,
        &PackOptions {
            down: DownType::Source,
            ..PackOptions::default()
        },
    )?;
    put(Target::Lsflash, "source-down.lsflash", &flash)?;
    let sparse = work.join("q8.lsflash");
    let levels = cal
        .levels
        .iter()
        .map(|t| t.for_layers(2))
        .collect::<leanstream_runtime::Result<Vec<_>>>()?;
    pack(
        model,
        &sparse,
        &PackOptions {
            down: DownType::Q8_0,
            sparsity: levels,
            neuron_scores: cal.neuron_scores,
            ..PackOptions::default()
        },
    )?;
    put(Target::Lsflash, "q8-down-calibrated.lsflash", &sparse)?;

    // An activation trace of the tiny model on real prose, and what
    // leanstream-synth learns from it.
    let trace_dir = work.join("trace");
    record(&RecordOptions {
        model: model.clone(),
        train: vec![text.clone()],
        heldout: vec![heldout],
        out: trace_dir.clone(),
        ctx: 16,
        shard_tokens: 16,
        max_tokens: Some(32),
        hot_fraction: 0.25,
        progress: false,
    })?;
    let trace = Trace::open(&trace_dir)?;
    let base = out.join(Target::TraceManifest.name()).join("base");
    let _ = fs::remove_dir_all(&base);
    copy_tree(&trace_dir, &base)?;
    put(Target::TraceManifest, "manifest.json", &trace_dir.join("manifest.json"))?;
    let shard = trace_dir.join(&trace.split("train")?.shards[0].dir);
    for f in ["tokens.npy", "act.npy", "ffn_in.npy"] {
        put(Target::Npy, f, &shard.join(f))?;
    }
    for f in ["scores.npy", "hot.npy"] {
        put(Target::Npy, f, &trace_dir.join(f))?;
    }
    let trained = predictor::train(
        &trace,
        &predictor::TrainOptions {
            group: 8,
            epochs: 2,
            soft_epochs: 1,
            progress: false,
            ..predictor::TrainOptions::default()
        },
    )?;
    trained.hashing.save(&seeds(Target::Lspred)?.join("hashing.lspred"))?;
    trained.low_rank.save(&seeds(Target::Lspred)?.join("low-rank.lspred"))?;
    let evict = eviction::learn(&trace, &eviction::EvictionOptions::default())?;
    evict.table.save(&seeds(Target::Lsevict)?.join("tiny-llama.lsevict"))?;
    let placed = placement::learn(
        &trace,
        &placement::PlacementOptions {
            epochs: 2,
            refine_tokens: 16,
            ..placement::PlacementOptions::default()
        },
    )?;
    placed.save(&seeds(Target::Placement)?.join("tiny-llama.json"))?;
    put(
        Target::Lstab,
        "controller.lstab",
        &repo.join("data/controller/controller.lstab"),
    )?;

    // A real I/O profile: a few conditions, a shard per visit.
    let run = work.join("profile");
    let status = Command::new(profile_bin)
        .args(["--quiet", "io", "--dir"])
        .arg(&work)
        .args(["--file-size", "1m", "--block-sizes", "4k", "--queue-depths", "1,2"])
        .args(["--workers", "1", "--patterns", "random", "--engines", "pread"])
        .args(["--budget", "1h", "--seed", "1", "--reps", "8", "--flush-every", "0s"])
        .args(["--min-batch", "4", "--max-batch", "4", "--out"])
        .arg(&run)
        .status()
        .with_context(|| format!("running {}", profile_bin.display()))?;
    if !status.success() {
        bail!("{} io failed: {status}", profile_bin.display());
    }
    for t in [Target::ProfileShard, Target::ProfileManifest] {
        let base = out.join(t.name()).join("base");
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(base.join("shards"))?;
        // The manifest lists the first shard only: one shard keeps a run fast.
        let mut store = leanstream_profiler::shard::ShardStore::open(&run)?;
        store.manifest.shards.truncate(1);
        let first = store.manifest.shards[0].file.clone();
        fs::copy(run.join(&first), base.join(&first))?;
        fs::copy(run.join("plan.json"), base.join("plan.json"))?;
        fs::write(base.join("manifest.json"), serde_json::to_vec_pretty(&store.manifest)?)?;
        match t {
            Target::ProfileShard => put(t, "shard.parquet", &base.join(&first))?,
            _ => put(t, "manifest.json", &base.join("manifest.json"))?,
        }
    }

    // Text and requests: real prose, and what OpenAI's clients send.
    let lines: Vec<&str> = prose.lines().filter(|l| l.len() > 20).take(4).collect();
    for (i, l) in lines.iter().enumerate() {
        let mode = [0u8, 2, 4, 6][i];
        let mut b = vec![mode];
        b.extend_from_slice(l.as_bytes());
        fs::write(seeds(Target::Tokenizer)?.join(format!("prose-{i}")), b)?;
    }
    fs::write(
        seeds(Target::Tokenizer)?.join("ids"),
        [1u8, 0, 0, 1, 0, 0, 0, 200, 0, 1, 255, 255],
    )?;
    fs::write(
        seeds(Target::Tokenizer)?.join("special"),
        b"\x04<|im_start|>user\nHi<|im_end|> <start_of_turn>model\n\xe2\x82\xac \xf0\x9f\x98\x80",
    )?;
    let chat = serde_json::json!({
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Name a licence."}]},
            {"role": "assistant", "content": "Apache 2.0"},
            {"role": "user", "content": "Another?"}
        ],
        "max_completion_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7,
        "stop": ["\n\n", "END"], "stream": true, "stream_options": {"include_usage": true}, "n": 1
    });
    fs::write(
        seeds(Target::ChatRequest)?.join("full.json"),
        serde_json::to_vec(&chat)?,
    )?;
    fs::write(
        seeds(Target::ChatRequest)?.join("minimal.json"),
        br#"{"messages":[{"role":"user","content":"Hi"}]}"#,
    )?;
    let completion = serde_json::json!({
        "model": "smollm2", "prompt": "Licensed under the Apache License", "max_tokens": 8,
        "temperature": 0, "stop": "\n", "logprobs": null, "echo": false, "presence_penalty": 0,
        "frequency_penalty": 0, "user": "u1"
    });
    fs::write(
        seeds(Target::CompletionRequest)?.join("full.json"),
        serde_json::to_vec(&completion)?,
    )?;
    fs::write(
        seeds(Target::CompletionRequest)?.join("minimal.json"),
        br#"{"prompt":"Hello"}"#,
    )?;
    fs::remove_dir_all(&work)?;
    Ok(())
}
