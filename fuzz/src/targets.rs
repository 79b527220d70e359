//! What each target does with its bytes. Checksummed formats get their
//! checksum recomputed first, so that mutations reach the decoder behind it
//! instead of all stopping at the checksum (which has its own tests).

use std::path::Path;
use std::sync::OnceLock;

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::{npy, Array};
use leanstream_profiler::shard::ShardStore;
use leanstream_runtime::cache::RetentionTable;
use leanstream_runtime::control::{state_at, ControlTable};
use leanstream_runtime::flash::pack::load_placement;
use leanstream_runtime::flash::{format::check_permutation, LsFlash};
use leanstream_runtime::gguf::GgufFile;
use leanstream_runtime::model::{Config, Model, RunState};
use leanstream_runtime::predict::{ComputePath, Predictor};
use leanstream_runtime::sparsity::Calibration;
use leanstream_runtime::tokenizer::Tokenizer;
use leanstream_server::api::{ChatRequest, CompletionRequest};
use sha2::{Digest, Sha256};

use crate::{Scratch, Target};

/// Runs `target` on `data`. `Err` is a clean rejection; a bug panics, hangs
/// or allocates without bound, which the fuzzer reports.
pub fn run(target: Target, data: &[u8], scratch: &Scratch) -> Result<(), String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    match target {
        Target::Gguf => gguf(&scratch.file("model.gguf", data)?),
        Target::Lsflash => lsflash(&scratch.file("model.lsflash", &with_lsflash_checksum(data))?),
        Target::Lstab => {
            let p = Path::new("fuzz.lstab");
            let t = ControlTable::from_bytes(&with_trailing_checksum(data), p).map_err(|e| s(&e))?;
            for i in [0, t.n_states().saturating_sub(1)] {
                t.lookup(&state_at(&t.axes, i));
            }
            Ok(())
        }
        Target::Lspred => lspred(&with_trailing_checksum(data)),
        Target::Lsevict => {
            let t = RetentionTable::from_bytes(&with_trailing_checksum(data), Path::new("fuzz.lsevict"))
                .map_err(|e| s(&e))?;
            for age in [0, 1, 7, 1000, u64::MAX] {
                t.priority(t.n_layer.saturating_sub(1), t.n_ff.saturating_sub(1), age);
            }
            t.model_sha();
            Ok(())
        }
        Target::Npy => {
            let p = scratch.file("array.npy", data)?;
            // Each reader on its own; the file is good if one of them takes it.
            let f = npy::read_f32(&p).map(drop).map_err(|e| s(&e));
            let u = npy::read_u8(&p).map(drop).map_err(|e| s(&e));
            f.or(u).or(npy::read_u32(&p).map(drop).map_err(|e| s(&e)))
        }
        Target::TraceManifest => {
            let dir = scratch.dir().join("base");
            scratch.file("base/manifest.json", data)?;
            trace(&dir)
        }
        Target::ProfileShard => {
            let dir = scratch.dir().join("base");
            let mut store = ShardStore::open(&dir).map_err(|e| s(&e))?;
            let entry = store.manifest.shards.first_mut().ok_or("base run has no shard")?;
            // The manifest vouches for these bytes: what reaches the Parquet reader.
            entry.bytes = data.len() as u64;
            entry.sha256 = leanstream_runtime::fetch::hex(&Sha256::digest(data));
            scratch.file(&format!("base/{}", entry.file), data)?;
            store.write_manifest().map_err(|e| s(&e))?;
            profile(&dir)
        }
        Target::ProfileManifest => {
            scratch.file("base/manifest.json", data)?;
            profile(&scratch.dir().join("base"))
        }
        Target::Calibration => {
            let c = Calibration::load(&scratch.file("calibration.json", data)?).map_err(|e| s(&e))?;
            for t in &c.levels {
                t.for_layers(t.full.len()).map_err(|e| s(&e))?;
            }
            Ok(())
        }
        Target::Placement => {
            let layers = load_placement(&scratch.file("placement.json", data)?).map_err(|e| s(&e))?;
            for order in &layers {
                check_permutation(order, order.len())?;
            }
            Ok(())
        }
        Target::Tokenizer => {
            tokenizer(data);
            Ok(())
        }
        Target::ChatRequest => ChatRequest::parse(data).map(drop).map_err(|e| s(&e)),
        Target::CompletionRequest => CompletionRequest::parse(data).map(drop).map_err(|e| s(&e)),
    }
}

/// Bytes of a file in the `binread` layout (magic, version, body, SHA-256
/// of all before it) with a checksum that matches.
fn with_trailing_checksum(data: &[u8]) -> Vec<u8> {
    let mut v = data.to_vec();
    if v.len() >= 44 {
        let body = v.len() - 32;
        let sum = Sha256::digest(&v[..body]);
        v[body..].copy_from_slice(&sum);
    }
    v
}

/// An `.lsflash` whose preamble's meta checksum matches its meta bytes.
fn with_lsflash_checksum(data: &[u8]) -> Vec<u8> {
    const PREAMBLE: usize = leanstream_runtime::flash::format::PREAMBLE_LEN;
    let mut v = data.to_vec();
    if v.len() >= PREAMBLE {
        let meta_len = u64::from_le_bytes(v[16..24].try_into().expect("8 bytes"));
        if let Some(end) = (PREAMBLE as u64).checked_add(meta_len).filter(|&e| e <= v.len() as u64) {
            let sum = Sha256::digest(&v[PREAMBLE..end as usize]);
            v[24..56].copy_from_slice(&sum);
        }
    }
    v
}

/// Tensors a forward step over a fuzzed model may touch without making a
/// run of the fuzzer slow: the seeds are far below this.
const SMALL_MODEL: usize = 1 << 20;

fn gguf(path: &Path) -> Result<(), String> {
    let s = |e: leanstream_runtime::RuntimeError| e.to_string();
    let g = GgufFile::open(path).map_err(s)?;
    for t in &g.tensors {
        g.tensor_bytes(t);
    }
    // Each part on its own, so that one bad part does not hide the next.
    let config = Config::from_gguf(&g);
    let tok = Tokenizer::from_gguf(&g);
    if let Ok(t) = &tok {
        t.decode(&t.encode("Hello, world! <s> \u{1F600}", true, true));
    }
    config.map_err(s)?;
    tok.map_err(s)?;
    drop(g);
    let model = Model::load(path).map_err(s)?;
    let c = &model.config;
    if c.n_embd * c.n_layer.max(1) * c.n_ff.max(1) <= SMALL_MODEL && c.n_vocab <= 1 << 16 {
        let mut st = RunState::new(c, 4, 2, 2);
        model.forward(&mut st, &[0, (c.n_vocab - 1) as u32], 0).map_err(s)?;
    }
    Ok(())
}

fn lsflash(path: &Path) -> Result<(), String> {
    let s = |e: leanstream_runtime::RuntimeError| e.to_string();
    let mut f = LsFlash::open(path).map_err(s)?;
    let (n_layer, n_ff) = (f.n_layer(), f.n_ff());
    for l in 0..n_layer.min(4) {
        for i in [0, n_ff.saturating_sub(1)] {
            if let Ok(b) = f.read_bundle(l, i) {
                f.layout(l).split(&b);
            }
        }
    }
    let verified = f.verify().map_err(s);
    if let Some(g) = f.take_resident() {
        Model::from_gguf_without_ffn(g).map_err(s)?;
    }
    verified
}

fn lspred(bytes: &[u8]) -> Result<(), String> {
    let p = Predictor::from_bytes(bytes, Path::new("fuzz.lspred")).map_err(|e| e.to_string())?;
    let c = &p.config;
    if c.d_model <= 1 << 14 && c.n_groups() <= 1 << 16 {
        let mut scratch = p.scratch();
        let x = vec![0.5f32; c.d_model];
        let mut out = vec![0.0f32; c.n_groups()];
        for path in [ComputePath::Scalar, ComputePath::Simd] {
            for (u, _) in p.uses.iter().enumerate() {
                p.scores(u, c.n_layer.saturating_sub(1), &x, path, &mut scratch, &mut out)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}

/// Every reader of a trace directory, as the trainers call them.
fn trace(dir: &Path) -> Result<(), String> {
    let s = |e: leanstream_profiler::ProfileError| e.to_string();
    let t = Trace::open(dir).map_err(s)?;
    let mut result = t.scores().map(drop).map_err(s).and(t.hot().map(drop).map_err(s));
    for split in ["train", "heldout"] {
        result = result.and(t.tokens(split).map(drop).map_err(s));
        for array in [Array::Resid, Array::FfnIn, Array::Partial, Array::Act] {
            for l in [0, t.n_layer().saturating_sub(1)] {
                result = result.and(t.layer(split, array, l).map(drop).map_err(s));
            }
        }
    }
    result
}

fn profile(dir: &Path) -> Result<(), String> {
    let s = |e: leanstream_profiler::ProfileError| e.to_string();
    let all = ShardStore::open(dir).map_err(s)?.load().map(drop).map_err(s);
    let run = leanstream_profiler::summary::load(dir).map_err(s)?;
    leanstream_profiler::summary::summarize(&run.frame, &run.plan.conditions).map_err(s)?;
    all?;
    match run.problems.first() {
        Some(p) => Err(p.to_string()),
        None => Ok(()),
    }
}

struct Tokenizers {
    smollm2: Tokenizer,
    gemma3: Tokenizer,
}

fn tokenizers() -> &'static Tokenizers {
    static T: OnceLock<Tokenizers> = OnceLock::new();
    T.get_or_init(|| {
        let load = |name: &str| {
            let path = leanstream_runtime::fetch::reference_model(name)
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|| panic!("the tokenizer target needs {name}: leanstream fetch {name}"));
            let g = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
            Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{e}"))
        };
        Tokenizers {
            smollm2: load("smollm2"),
            gemma3: load("gemma3"),
        }
    })
}

/// First byte: what to do; the rest: text (lossily UTF-8) or token ids.
fn tokenizer(data: &[u8]) {
    let t = tokenizers();
    let (mode, rest) = data.split_first().unwrap_or((&0, &[]));
    for tok in [&t.smollm2, &t.gemma3] {
        if mode & 1 == 0 {
            let text = String::from_utf8_lossy(rest);
            let (add, special) = (mode & 2 != 0, mode & 4 != 0);
            let ids = tok.encode(&text, add, special);
            // A chat prompt whose whole text is one message's: no control
            // token may come out of it; with no message, it is a raw prompt.
            let whole = 0..text.len();
            assert_eq!(
                tok.encode_chat(&text, std::slice::from_ref(&whole)),
                tok.encode(&text, true, false)
            );
            assert_eq!(tok.encode_chat(&text, &[]), tok.encode(&text, true, true));
            let back = tok.decode(&ids);
            if std::ptr::eq(tok, &t.smollm2) && !add && !special {
                // Byte-level BPE invents nothing and keeps the order; it drops
                // only bytes without a token (SmolLM2 has none for 0x04, say,
                // and llama.cpp drops them too), so printable ASCII survives.
                assert!(
                    is_subsequence(&back, text.as_bytes()),
                    "SmolLM2 decoded {back:?} from {text:?}"
                );
                if text.chars().all(|c| c.is_ascii_graphic() || c == ' ' || c == '\n') {
                    assert_eq!(back, text.as_bytes(), "SmolLM2 decode(encode(text)) != text");
                }
            }
        } else {
            // Ids past the vocabulary included: a client can send any.
            let n = tok.vocab_size() as u32 + 8;
            let ids: Vec<u32> = rest
                .chunks(4)
                .map(|c| c.iter().fold(0u32, |a, &b| a << 8 | b as u32) % n)
                .collect();
            tok.decode(&ids);
            for &id in &ids {
                tok.token_piece(id);
            }
        }
    }
}

/// Whether `a` is `b` with some bytes left out.
fn is_subsequence(a: &[u8], b: &[u8]) -> bool {
    let mut rest = b.iter();
    a.iter().all(|x| rest.any(|y| y == x))
}
