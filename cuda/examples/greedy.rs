//! Greedy decoding of one model on a CUDA device and on the CPU engine,
//! side by side. Prints one JSON object:
//! - the tokens of each (equal, or where they part), the first step's logits
//!   (largest difference), decode tokens/s of each;
//! - `teacher_forced`: the device fed the CPU's tokens, the steps whose
//!   argmax agrees with the CPU's and the largest logit difference (what
//!   rounding does at each step, without one parting carrying over);
//! - `cpu_paths`: the same for the CPU engine's two llama.cpp attention
//!   paths against each other (flash attention on, the default, and off):
//!   the yardstick for how far rounding alone moves these models;
//! - `prompt_trace`: where the engines part over the prompt, per layer and
//!   probe point (the residual entering the layer, after attention, the
//!   FFN's input, gate, activations and output), the largest difference of
//!   the last token's row against the row's largest value.
//!
//! `cargo run --release -p leanstream-cuda --example greedy -- MODEL [PROMPT] [N]`
//! (MODEL: a GGUF path, or `smollm2` / `gemma3`, fetched on first use)

use std::time::Instant;

use leanstream_cuda::device::Gpu;
use leanstream_cuda::engine::{GpuModel, Probe};
use leanstream_runtime::generate::sampler::argmax;
use leanstream_runtime::model::{FfnActivation, FlashAttn, LayerAt, LayerHook, Model};

/// The CPU engine's rows at the device engine's probe points.
#[derive(Default)]
struct Capture(Vec<Probe>);

impl Capture {
    fn keep(&mut self, layer: usize, point: &'static str, rows: &[f32], width: usize) {
        self.0.push(Probe {
            layer,
            point,
            row: rows[rows.len() - width..].to_vec(),
        });
    }
}

impl LayerHook for Capture {
    fn layer_input(&mut self, at: &LayerAt, x: &[f32]) {
        let d = x.len() / at.n();
        self.keep(at.layer, "input", x, d);
    }
    fn ffn(
        &mut self,
        at: &LayerAt,
        resid: &[f32],
        xb: &[f32],
        _out: &mut [f32],
    ) -> leanstream_runtime::Result<leanstream_runtime::model::FfnBy> {
        let d = resid.len() / at.n();
        self.keep(at.layer, "attn_resid", resid, d);
        self.keep(at.layer, "ffn_in", xb, d);
        Ok(leanstream_runtime::model::FfnBy::Model)
    }
    fn gate(&mut self, at: &LayerAt, g: &[f32], _act: FfnActivation) {
        self.keep(at.layer, "gate", g, g.len() / at.n());
    }
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        self.keep(at.layer, "act", acts, acts.len() / at.n());
    }
    fn ffn_output(&mut self, at: &LayerAt, y: &[f32]) {
        self.keep(at.layer, "ffn_out", y, y.len() / at.n());
    }
}

/// Per probe point present in both: `[layer, point, max |cpu - gpu|, max |cpu|]`.
fn compare(cpu: &[Probe], gpu: &[Probe]) -> String {
    let rows: Vec<String> = cpu
        .iter()
        .filter_map(|c| {
            let g = gpu.iter().find(|g| g.layer == c.layer && g.point == c.point)?;
            let diff = c
                .row
                .iter()
                .zip(&g.row)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            let max = c.row.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
            Some(format!("[{}, {:?}, {diff:.3e}, {max:.3e}]", c.layer, c.point))
        })
        .collect();
    format!("[{}]", rows.join(", "))
}

/// A greedy run: the tokens, each step's logits, decode tokens/s.
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    tok_s: f64,
}

/// Greedy decoding on the CPU engine (no stop on end-of-generation, so both
/// engines run `n` steps), the prompt traced at the device's probe points;
/// with `forced`, each step is fed the forced token instead of its own choice.
fn cpu_greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    forced: Option<&[u32]>,
) -> Result<(Run, Capture), Box<dyn std::error::Error>> {
    let mut st = model.new_state(prompt.len() + n + 1, 512, 1);
    let mut trace = Capture::default();
    let mut pos = 0;
    for chunk in prompt.chunks(512) {
        let last = chunk.len() - 1..chunk.len();
        if pos == 0 {
            model.forward_with(&mut st, chunk, pos, last, &mut trace)?;
        } else {
            model.forward_outputs(&mut st, chunk, pos, last)?;
        }
        pos += chunk.len();
    }
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    let t = Instant::now();
    for i in 0..n {
        let l = model.logits(&mut st, 0, 1)?.to_vec();
        tokens.push(argmax(&l));
        logits.push(l);
        if i + 1 < n {
            let next = forced.map_or(tokens[i], |f| f[i]);
            model.forward(&mut st, &[next], pos)?;
            pos += 1;
        }
    }
    let tok_s = n as f64 / t.elapsed().as_secs_f64();
    Ok((Run { tokens, logits, tok_s }, trace))
}

/// Greedy decoding on the device; with `forced`, each step is fed the
/// forced token instead of its own choice.
fn gpu_greedy(
    g: &mut GpuModel,
    prompt: &[u32],
    n: usize,
    forced: Option<&[u32]>,
) -> Result<(Run, Vec<Probe>), Box<dyn std::error::Error>> {
    let mut trace = Vec::new();
    let mut pos = 0;
    for chunk in prompt.chunks(g.max_batch) {
        if pos == 0 {
            trace = g.trace(chunk, pos)?;
        } else {
            g.forward(chunk, pos)?;
        }
        pos += chunk.len();
    }
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    let t = Instant::now();
    for i in 0..n {
        let l = g.logits()?;
        tokens.push(argmax(&l));
        logits.push(l);
        if i + 1 < n {
            let next = forced.map_or(tokens[i], |f| f[i]);
            g.forward(&[next], pos)?;
            pos += 1;
        }
    }
    g.gpu.synchronize()?;
    let tok_s = n as f64 / t.elapsed().as_secs_f64();
    Ok((Run { tokens, logits, tok_s }, trace))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)
}

/// Where two greedy runs part (`null` if never) and their first logits' largest difference.
fn parting(a: &Run, b: &Run) -> String {
    let first = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y);
    format!(
        "{{\"first_difference\": {}, \"first_logits_max_abs_diff\": {}}}",
        first.map_or("null".to_string(), |p| p.to_string()),
        max_abs_diff(&a.logits[0], &b.logits[0])
    )
}

/// Steps of a run fed `reference`'s tokens whose argmax agrees with it, and
/// the largest logit difference over all steps.
fn agreement(reference: &Run, forced: &Run) -> String {
    let agree = reference
        .tokens
        .iter()
        .zip(&forced.tokens)
        .filter(|(a, b)| a == b)
        .count();
    let diff = reference
        .logits
        .iter()
        .zip(&forced.logits)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0f32, f32::max);
    format!(
        "{{\"agree\": {agree}, \"of\": {}, \"max_logit_diff\": {diff}}}",
        reference.tokens.len()
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model_arg = args.next().ok_or("usage: greedy MODEL [PROMPT] [N]")?;
    let prompt = args.next().unwrap_or_else(|| "The license grants".into());
    let n: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let path = leanstream_runtime::fetch::resolve_model(&model_arg)?;
    let model = Model::load(&path)?;
    let tokens = model.tokenizer.encode(&prompt, true, false);
    let ctx = tokens.len() + n + 1;

    let (cpu, cpu_trace) = cpu_greedy(&model, &tokens, n, None)?;
    let mut standard = Model::load(&path)?;
    standard.flash_attn = FlashAttn::Off;
    let (cpu_standard, _) = cpu_greedy(&standard, &tokens, n, None)?;
    // The standard path fed the default path's tokens.
    let (cpu_forced, _) = cpu_greedy(&standard, &tokens, n, Some(&cpu.tokens))?;

    let gpu = Gpu::open(0)?;
    let device = format!("{} (compute {:?})", gpu.name, gpu.compute_capability);
    let mut g = GpuModel::new(gpu, &model, ctx, 512)?;
    let (gpu_run, gpu_trace) = gpu_greedy(&mut g, &tokens, n, None)?;
    let (gpu_forced, _) = gpu_greedy(&mut g, &tokens, n, Some(&cpu.tokens))?;

    let max_logit = cpu.logits[0].iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    let first = cpu.tokens.iter().zip(&gpu_run.tokens).position(|(a, b)| a != b);
    println!(
        "{{\"model\": {:?}, \"device\": {:?}, \"tokens\": {n}, \"equal\": {}, \"first_difference\": {}, \
         \"first_logits_max_abs_diff\": {}, \"first_logits_max_abs\": {max_logit}, \
         \"cpu_decode_tok_s\": {:.2}, \"gpu_decode_tok_s\": {:.2}, \"teacher_forced\": {}, \
         \"cpu_paths\": {{\"parting\": {}, \"teacher_forced\": {}}}, \"cpu\": {:?}, \"gpu\": {:?}, \
         \"prompt_trace\": {}}}",
        path.display().to_string(),
        device,
        first.is_none(),
        first.map_or("null".to_string(), |p| p.to_string()),
        max_abs_diff(&cpu.logits[0], &gpu_run.logits[0]),
        cpu.tok_s,
        gpu_run.tok_s,
        agreement(&cpu, &gpu_forced),
        parting(&cpu, &cpu_standard),
        agreement(&cpu, &cpu_forced),
        cpu.tokens,
        gpu_run.tokens,
        compare(&cpu_trace.0, &gpu_trace)
    );
    Ok(())
}
