//! Greedy decoding of one model on a CUDA device and on the CPU engine,
//! side by side: the tokens (equal or where they part), the first step's
//! logits (largest difference), and decode tokens/s of each. Prints JSON.
//!
//! `cargo run --release -p leanstream-cuda --example greedy -- MODEL [PROMPT] [N]`
//! (MODEL: a GGUF path, or `smollm2` / `gemma3`, fetched on first use)

use std::time::Instant;

use leanstream_cuda::device::Gpu;
use leanstream_cuda::engine::GpuModel;
use leanstream_runtime::generate::sampler::argmax;
use leanstream_runtime::model::Model;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model_arg = args.next().ok_or("usage: greedy MODEL [PROMPT] [N]")?;
    let prompt = args.next().unwrap_or_else(|| "The license grants".into());
    let n: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let path = leanstream_runtime::fetch::resolve_model(&model_arg)?;
    let model = Model::load(&path)?;
    let tokens = model.tokenizer.encode(&prompt, true, false);
    let ctx = tokens.len() + n + 1;

    // CPU: the same loop (no stop on end-of-generation, so both run n steps).
    let mut st = model.new_state(ctx, 512, 1);
    let mut cpu = Vec::new();
    let mut pos = 0;
    for chunk in tokens.chunks(512) {
        model.forward_outputs(&mut st, chunk, pos, chunk.len() - 1..chunk.len())?;
        pos += chunk.len();
    }
    let cpu_first = model.logits(&mut st, 0, 1)?.to_vec();
    let t = Instant::now();
    for i in 0..n {
        let next = argmax(model.logits(&mut st, 0, 1)?);
        cpu.push(next);
        if i + 1 < n {
            model.forward(&mut st, &[next], pos)?;
            pos += 1;
        }
    }
    let cpu_tok_s = n as f64 / t.elapsed().as_secs_f64();

    let gpu = Gpu::open(0)?;
    let device = format!("{} (compute {:?})", gpu.name, gpu.compute_capability);
    let mut g = GpuModel::new(gpu, &model, ctx, 512)?;
    let mut pos = 0;
    for chunk in tokens.chunks(512) {
        g.forward(chunk, pos)?;
        pos += chunk.len();
    }
    let gpu_first = g.logits()?;
    let t = Instant::now();
    let mut gpu_tokens = Vec::new();
    for i in 0..n {
        let next = argmax(&g.logits()?);
        gpu_tokens.push(next);
        if i + 1 < n {
            g.forward(&[next], pos)?;
            pos += 1;
        }
    }
    g.gpu.synchronize()?;
    let gpu_tok_s = n as f64 / t.elapsed().as_secs_f64();

    let max_diff = cpu_first
        .iter()
        .zip(&gpu_first)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let max_logit = cpu_first.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    let parted = cpu.iter().zip(&gpu_tokens).position(|(a, b)| a != b);
    println!(
        "{{\"model\": {:?}, \"device\": {:?}, \"tokens\": {n}, \"equal\": {}, \"first_difference\": {}, \
         \"first_logits_max_abs_diff\": {max_diff}, \"first_logits_max_abs\": {max_logit}, \
         \"cpu_decode_tok_s\": {cpu_tok_s:.2}, \"gpu_decode_tok_s\": {gpu_tok_s:.2}, \"cpu\": {:?}, \"gpu\": {:?}}}",
        path.display().to_string(),
        device,
        cpu == gpu_tokens,
        parted.map_or("null".to_string(), |p| p.to_string()),
        cpu,
        gpu_tokens
    );
    Ok(())
}
