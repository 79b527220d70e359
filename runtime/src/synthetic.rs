//! Synthetic models: GGUF files of a chosen architecture and shape with
//! seeded random weights and a byte-level vocabulary. They exercise loading
//! and the forward pass (and, at 7B shapes, the I/O path) without a
//! download; their outputs mean nothing and are never reported as quality.
//!
//! Small specs are built in memory ([`SyntheticSpec::build`]); the 7B shapes
//! ([`SyntheticSpec::shape`]) are written straight to disk a row block at a
//! time ([`SyntheticSpec::write_file`]), with the same bytes either way.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use leanstream_kernels::quantize::{quantize_row_as, quantize_row_q4_0, GgmlBuild};
use leanstream_kernels::GgmlType;
use rayon::prelude::*;

use crate::generate::sampler::Rng;
use crate::gguf::{GgufStreamWriter, GgufWriter, MetaArray, MetaValue, TensorDesc};
use crate::{Result, RuntimeError};

#[derive(Debug, Clone)]
pub struct SyntheticSpec {
    /// `llama`, `mistral` (llama with a sliding window) or `qwen2` (q/k/v biases).
    pub arch: String,
    /// Goes into `general.name` as `synthetic {name}`.
    pub name: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// At least [`VOCAB`]: the specials and byte tokens, then filler pieces.
    pub n_vocab: usize,
    pub context_length: usize,
    pub sliding_window: Option<usize>,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// A separate `output.weight`; without it the embeddings are tied.
    pub untied_output: bool,
    /// Type of the 2-D weight matrices (F32, F16, Q8_0 or Q4_0).
    pub weight_type: GgmlType,
    pub seed: u64,
}

/// Byte tokens `<0x00>`..`<0xFF>` after `<unk>`, `<s>`, `</s>`: every text encodes.
const N_SPECIAL: usize = 3;
pub const VOCAB: usize = N_SPECIAL + 256;

/// The named shapes [`SyntheticSpec::shape`] knows.
pub const SHAPES: [&str; 3] = ["mistral-7b", "llama2-7b", "qwen2.5-7b"];

/// Values generated (and quantized) per piece written: bounds the memory a
/// tensor of any size needs.
const BLOCK_VALUES: usize = 1 << 20;

/// What a tensor holds.
#[derive(Clone, Copy)]
enum Fill {
    /// All ones (norm weights).
    Ones,
    /// `rows` rows of uniform values in `±mul / sqrt(cols)`, `cols` = `dims[0]`.
    Random { rows: usize, mul: f32 },
}

/// What [`SyntheticSpec::write_file`] wrote.
#[derive(Debug, Clone)]
pub struct WriteReport {
    pub path: PathBuf,
    pub bytes: u64,
    pub tensors: usize,
    pub seconds: f64,
}

impl SyntheticSpec {
    /// A small model for tests.
    pub fn tiny(arch: &str) -> Self {
        Self {
            arch: arch.to_string(),
            name: arch.to_string(),
            n_layer: 2,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            n_vocab: VOCAB,
            context_length: 256,
            sliding_window: None,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            untied_output: false,
            weight_type: GgmlType::F32,
            seed: 7,
        }
    }

    /// A published model's shape (one of [`SHAPES`]), Q4_0 weights, seed 0.
    ///
    /// Mistral-7B-v0.1 is written as llama.cpp's converter writes it:
    /// architecture `llama`, without its 4096-token sliding window, which
    /// llama.cpp's `llama` architecture does not apply (so neither do we here).
    pub fn shape(name: &str) -> Result<Self> {
        let base = Self {
            name: name.to_string(),
            untied_output: true,
            weight_type: GgmlType::Q4_0,
            seed: 0,
            ..Self::tiny("llama")
        };
        let spec = match name {
            "mistral-7b" => Self {
                n_layer: 32,
                n_embd: 4096,
                n_ff: 14336,
                n_head: 32,
                n_head_kv: 8,
                n_vocab: 32000,
                context_length: 32768,
                ..base
            },
            "llama2-7b" => Self {
                n_layer: 32,
                n_embd: 4096,
                n_ff: 11008,
                n_head: 32,
                n_head_kv: 32,
                n_vocab: 32000,
                context_length: 4096,
                ..base
            },
            "qwen2.5-7b" => Self {
                arch: "qwen2".into(),
                n_layer: 28,
                n_embd: 3584,
                n_ff: 18944,
                n_head: 28,
                n_head_kv: 4,
                n_vocab: 152064,
                context_length: 32768,
                rope_base: 1_000_000.0,
                rms_eps: 1e-6,
                ..base
            },
            other => {
                return Err(RuntimeError::Unsupported(format!(
                    "synthetic shape '{other}' (known: {})",
                    SHAPES.join(", ")
                )))
            }
        };
        Ok(spec)
    }

    /// The GGUF file, ready to write (it holds every tensor: small specs only).
    pub fn build(&self) -> Result<GgufWriter> {
        let mut w = GgufWriter::new();
        for (k, v) in self.metadata()? {
            w.meta(&k, v);
        }
        let descs = self.tensor_descs()?;
        let mut data = vec![Vec::new(); descs.len()];
        self.generate(|i, bytes| {
            data[i].extend_from_slice(bytes);
            Ok(())
        })?;
        for (d, bytes) in descs.iter().zip(data) {
            w.tensor(&d.name, &d.dims, d.ty, bytes);
        }
        Ok(w)
    }

    /// Streams the file to `w`, one row block in memory at a time; `bar`
    /// counts bytes.
    pub fn write_to<W: Write>(&self, w: W, bar: &ProgressBar) -> Result<W> {
        let io = |e: std::io::Error| RuntimeError::Invalid(format!("writing synthetic GGUF: {e}"));
        let descs = self.tensor_descs()?;
        let mut s = GgufStreamWriter::new(w, &self.metadata()?, descs).map_err(io)?;
        bar.set_position(s.position());
        self.generate(|_, bytes| {
            s.write_data(bytes).map_err(io)?;
            bar.set_position(s.position());
            Ok(())
        })?;
        s.finish().map_err(io)
    }

    /// Writes the file to `path` through `path.tmp` and a rename, with a
    /// progress bar on stderr when `progress`.
    pub fn write_file(&self, path: &Path, progress: bool) -> Result<WriteReport> {
        let t0 = Instant::now();
        let descs = self.tensor_descs()?;
        let total: u64 = descs.iter().map(|d| d.size.div_ceil(32) * 32).sum();
        let bar = crate::progress::bar(
            total,
            progress,
            "synthetic {bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec}, ETA {eta}",
        );
        let tmp = crate::durable::tmp_path(path);
        let result = (|| {
            crate::durable::create_parent(path).map_err(|e| RuntimeError::io(path, e))?;
            let file = std::fs::File::create(&tmp).map_err(|e| RuntimeError::io(&tmp, e))?;
            let buf = self.write_to(std::io::BufWriter::with_capacity(8 << 20, file), &bar)?;
            let file = buf.into_inner().map_err(|e| RuntimeError::io(&tmp, e.into_error()))?;
            file.sync_all().map_err(|e| RuntimeError::io(&tmp, e))?;
            let bytes = file.metadata().map_err(|e| RuntimeError::io(&tmp, e))?.len();
            crate::durable::commit(&tmp, path).map_err(|e| RuntimeError::io(path, e))?;
            Ok(bytes)
        })();
        bar.finish_and_clear();
        match result {
            Ok(bytes) => Ok(WriteReport {
                path: path.to_path_buf(),
                bytes,
                tensors: descs.len(),
                seconds: t0.elapsed().as_secs_f64(),
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    fn check(&self) -> Result<()> {
        let arch = self.arch.as_str();
        if !matches!(arch, "llama" | "mistral" | "qwen2") {
            return Err(RuntimeError::Unsupported(format!("synthetic architecture '{arch}'")));
        }
        if self.n_vocab < VOCAB {
            return Err(RuntimeError::Invalid(format!(
                "synthetic vocabulary of {} tokens: at least {VOCAB} needed",
                self.n_vocab
            )));
        }
        if !matches!(
            self.weight_type,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_0
        ) {
            return Err(RuntimeError::Unsupported(format!(
                "synthetic weight type {} (F32, F16, Q8_0 or Q4_0)",
                self.weight_type
            )));
        }
        Ok(())
    }

    /// The key-value metadata, vocabulary included.
    pub fn metadata(&self) -> Result<Vec<(String, MetaValue)>> {
        self.check()?;
        let arch = self.arch.as_str();
        let key = |k: &str| format!("{arch}.{k}");
        let u32v = |v: usize| MetaValue::U32(v as u32);
        let mut m: Vec<(String, MetaValue)> = vec![
            ("general.architecture".into(), MetaValue::String(arch.into())),
            (
                "general.name".into(),
                MetaValue::String(format!("synthetic {}", self.name)),
            ),
            (key("block_count"), u32v(self.n_layer)),
            (key("context_length"), u32v(self.context_length)),
            (key("embedding_length"), u32v(self.n_embd)),
            (key("feed_forward_length"), u32v(self.n_ff)),
            (key("attention.head_count"), u32v(self.n_head)),
            (key("attention.head_count_kv"), u32v(self.n_head_kv)),
            (key("attention.layer_norm_rms_epsilon"), MetaValue::F32(self.rms_eps)),
            (key("rope.freq_base"), MetaValue::F32(self.rope_base)),
        ];
        if let Some(window) = self.sliding_window {
            m.push((key("attention.sliding_window"), u32v(window)));
        }
        // SentencePiece-style: specials, byte tokens, then unreachable filler
        // pieces with descending scores (text encodes through the bytes).
        let n_filler = self.n_vocab - VOCAB;
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        tokens.extend((0..n_filler).map(|i| format!("\u{2581}t{i}")));
        let mut scores = vec![0.0f32; VOCAB];
        scores.extend((0..n_filler).map(|i| -(i as f32) - 1.0));
        let mut types = vec![2i32, 3, 3];
        types.extend(std::iter::repeat_n(6, 256));
        types.extend(std::iter::repeat_n(1, n_filler));
        let s = |v: &str| MetaValue::String(v.into());
        m.extend([
            ("tokenizer.ggml.model".into(), s("llama")),
            (
                "tokenizer.ggml.tokens".into(),
                MetaValue::Array(MetaArray::String(tokens)),
            ),
            ("tokenizer.ggml.scores".into(), MetaValue::Array(MetaArray::F32(scores))),
            (
                "tokenizer.ggml.token_type".into(),
                MetaValue::Array(MetaArray::I32(types)),
            ),
            ("tokenizer.ggml.unknown_token_id".into(), MetaValue::U32(0)),
            ("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(1)),
            ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(2)),
            ("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true)),
            ("tokenizer.ggml.add_space_prefix".into(), MetaValue::Bool(false)),
        ]);
        Ok(m)
    }

    /// Every tensor in file order with what it holds.
    fn plan(&self) -> Result<Vec<(TensorDesc, Fill)>> {
        self.check()?;
        let head_dim = self.n_embd / self.n_head;
        let (q_dim, kv_dim) = (self.n_head * head_dim, self.n_head_kv * head_dim);
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<(TensorDesc, Fill)> {
            let d = TensorDesc::new(name, &[cols as u64, rows as u64], self.weight_type)?;
            Ok((d, Fill::Random { rows, mul: 1.0 }))
        };
        let norm = |name: &str| -> Result<(TensorDesc, Fill)> {
            Ok((TensorDesc::new(name, &[self.n_embd as u64], GgmlType::F32)?, Fill::Ones))
        };
        let mut plan = vec![
            matrix("token_embd.weight", self.n_vocab, self.n_embd)?,
            norm("output_norm.weight")?,
        ];
        if self.untied_output {
            plan.push(matrix("output.weight", self.n_vocab, self.n_embd)?);
        }
        for il in 0..self.n_layer {
            let t = |s: &str| format!("blk.{il}.{s}");
            let shapes = [
                ("attn_q.weight", q_dim, self.n_embd),
                ("attn_k.weight", kv_dim, self.n_embd),
                ("attn_v.weight", kv_dim, self.n_embd),
                ("attn_output.weight", self.n_embd, q_dim),
                ("ffn_gate.weight", self.n_ff, self.n_embd),
                ("ffn_up.weight", self.n_ff, self.n_embd),
                ("ffn_down.weight", self.n_embd, self.n_ff),
            ];
            for (name, rows, cols) in shapes {
                plan.push(matrix(&t(name), rows, cols)?);
            }
            plan.push(norm(&t("attn_norm.weight"))?);
            plan.push(norm(&t("ffn_norm.weight"))?);
            if self.arch == "qwen2" {
                for (name, n) in [("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)] {
                    let d = TensorDesc::new(&t(name), &[n as u64], GgmlType::F32)?;
                    plan.push((d, Fill::Random { rows: 1, mul: 4.0 }));
                }
            }
        }
        Ok(plan)
    }

    /// The header entries of every tensor, in file order.
    pub fn tensor_descs(&self) -> Result<Vec<TensorDesc>> {
        Ok(self.plan()?.into_iter().map(|(d, _)| d).collect())
    }

    /// Generates every tensor's bytes in file order, handing each row block
    /// to `sink` with its tensor's index. One random stream runs through all
    /// tensors, row by row, so the values do not depend on the block size.
    fn generate(&self, mut sink: impl FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        let mut rng = Rng::new(self.seed);
        let mut values = Vec::new();
        let mut bytes = Vec::new();
        for (i, (d, fill)) in self.plan()?.into_iter().enumerate() {
            let cols = d.dims[0] as usize;
            match fill {
                Fill::Ones => sink(i, &f32_bytes(&vec![1.0; cols]))?,
                Fill::Random { rows, mul } => {
                    let scale = 1.0 / (cols as f32).sqrt();
                    let block_rows = (BLOCK_VALUES / cols).max(1);
                    let mut done = 0;
                    while done < rows {
                        let n = block_rows.min(rows - done);
                        values.clear();
                        values.extend((0..n * cols).map(|_| (rng.next_f32() * 2.0 - 1.0) * scale * mul));
                        encode(&values, cols, d.ty, &mut bytes)?;
                        sink(i, &bytes)?;
                        done += n;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Parses a weight type name: `q4_0`, `q8_0`, `f16` or `f32`.
pub fn parse_weight_type(s: &str) -> Result<GgmlType> {
    match s.to_ascii_lowercase().as_str() {
        "q4_0" => Ok(GgmlType::Q4_0),
        "q8_0" => Ok(GgmlType::Q8_0),
        "f16" => Ok(GgmlType::F16),
        "f32" => Ok(GgmlType::F32),
        other => Err(RuntimeError::Unsupported(format!(
            "synthetic weight type '{other}' (q4_0, q8_0, f16 or f32)"
        ))),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Rows of `cols` values in `ty`, into `out` (resized to fit).
fn encode(values: &[f32], cols: usize, ty: GgmlType, out: &mut Vec<u8>) -> Result<()> {
    if ty == GgmlType::F32 {
        out.clear();
        out.extend(values.iter().flat_map(|x| x.to_le_bytes()));
        return Ok(());
    }
    let row_bytes = ty.row_bytes(cols)?;
    out.resize(values.len() / cols * row_bytes, 0);
    values
        .par_chunks_exact(cols)
        .zip(out.par_chunks_exact_mut(row_bytes))
        .try_for_each(|(row, dst)| match ty {
            GgmlType::Q4_0 => quantize_row_q4_0(row, dst),
            _ => quantize_row_as(GgmlBuild::FILES, ty, row, dst),
        })?;
    Ok(())
}
