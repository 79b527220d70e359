//! Times the matrix products of one token (decode) and of a 512-token prompt
//! for the shapes of the two reference models, on rayon's threads
//! (`RAYON_NUM_THREADS=2` to compare with `llama-bench -t 2`).
//!
//! Run: `RAYON_NUM_THREADS=2 cargo run --release -p leanstream-kernels --example matmul_bench`
//! (`BENCH_Q4K_ONLY=1` / `BENCH_Q6K_ONLY=1`: Gemma 3's Q4_K / Q6_K matrices only;
//! `BENCH_LEGACY_ONLY=1`: one Q5_0/Q8_0/Q4_1 matrix of each shape, alone)
//! The tok/s it prints cover matrix products only (no attention, norms or
//! activation conversion), so they are upper bounds for a whole model.
//! Every matrix gets its own random data (about 400 MB in all), so weights
//! come from memory as in a real forward pass.

use std::time::Instant;

use half::f16;
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};

/// (weight type, rows, cols, matrices of this shape per model)
type Shape = (GgmlType, usize, usize, usize);

const SMOLLM2: &[Shape] = &[
    (GgmlType::Q4_1, 576, 576, 60),  // attn_q, attn_output
    (GgmlType::Q4_1, 192, 576, 60),  // attn_k, attn_v
    (GgmlType::Q4_1, 1536, 576, 60), // ffn_gate, ffn_up
    (GgmlType::Q4_1, 576, 1536, 30), // ffn_down
];
const SMOLLM2_OUTPUT: Shape = (GgmlType::Q8_0, 49152, 576, 1);

const GEMMA3: &[Shape] = &[
    (GgmlType::Q5_0, 1024, 640, 18), // attn_q
    (GgmlType::Q5_0, 256, 640, 18),  // attn_k (half of the layers use Q8_0 for v)
    (GgmlType::Q8_0, 256, 640, 9),
    (GgmlType::Q5_0, 256, 640, 9),
    (GgmlType::Q4K, 640, 1024, 18),  // attn_output
    (GgmlType::Q5_0, 2048, 640, 36), // ffn_gate, ffn_up
    (GgmlType::Q6K, 640, 2048, 9),   // ffn_down
    (GgmlType::Q4K, 640, 2048, 9),
];
const GEMMA3_OUTPUT: Shape = (GgmlType::Q8_0, 262144, 640, 1);
/// Gemma 3's Q4_K matrices alone (the repack-emulating path).
const GEMMA3_Q4K: &[Shape] = &[(GgmlType::Q4K, 640, 1024, 18), (GgmlType::Q4K, 640, 2048, 9)];
/// Gemma 3's Q6_K matrices alone (the tiled-matmul-emulating path for n >= 8).
const GEMMA3_Q6K: &[Shape] = &[(GgmlType::Q6K, 640, 2048, 9)];
/// One matrix each of the legacy-format shapes (Q5_0/Q8_0 of Gemma 3, Q4_1 of SmolLM2).
const LEGACY: &[Shape] = &[
    (GgmlType::Q5_0, 2048, 640, 1),
    (GgmlType::Q5_0, 1024, 640, 1),
    (GgmlType::Q8_0, 256, 640, 1),
    (GgmlType::Q4_1, 1536, 576, 1),
];

/// Offsets of the f16 scale fields in each block, set to a small finite value
/// so random bits never make NaNs or denormals.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u64> {
    let bytes = rows * ty.row_bytes(cols).unwrap();
    let mut words = vec![0u64; bytes.div_ceil(8)];
    let mut state = seed | 1;
    for w in words.iter_mut() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *w = state;
    }
    let data: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut words)[..bytes];
    let scale = f16::from_f32(0.01).to_le_bytes();
    for block in data.chunks_exact_mut(ty.type_size()) {
        for &offset in scale_offsets(ty) {
            block[offset..offset + 2].copy_from_slice(&scale);
        }
    }
    words
}

/// Seconds for all products of `shapes` at `n` activation rows, best of a
/// few runs. Every matrix of the model gets its own data, so weights stream
/// from memory as they do in a real forward pass.
fn time_products(shapes: &[Shape], n: usize) -> f64 {
    let max_cols = shapes.iter().map(|s| s.2).max().unwrap();
    let max_rows = shapes.iter().map(|s| s.1).max().unwrap();
    let mut acts = ActBuffer::with_capacity(max_cols, n);
    let x: Vec<f32> = (0..max_cols * n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let mut out = vec![0.0f32; max_rows * n];
    let mut seed = 1;
    let matrices: Vec<(GgmlType, usize, usize, Vec<u64>)> = shapes
        .iter()
        .flat_map(|&(ty, rows, cols, count)| std::iter::repeat_n((ty, rows, cols), count))
        .map(|(ty, rows, cols)| {
            seed += 1;
            (ty, rows, cols, random_matrix(ty, rows, cols, seed))
        })
        .collect();
    let runs = if n == 1 { 5 } else { 2 };
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let mut total = 0.0;
        for (ty, rows, cols, words) in &matrices {
            let data = &bytemuck::cast_slice(words)[..rows * ty.row_bytes(*cols).unwrap()];
            let w = QMatrix::new(*ty, *rows, *cols, data).unwrap();
            // Conversion happens once per layer input in a model; not timed.
            acts.quantize(ty.vec_dot_type(), &x[..n * cols], n, *cols).unwrap();
            let start = Instant::now();
            matmul(&w, &acts, &mut out[..rows * n]).unwrap();
            total += start.elapsed().as_secs_f64();
        }
        best = best.min(total);
    }
    if std::env::var_os("BENCH_VERBOSE").is_some() {
        println!("  {} products at n={n}: {:.2} ms", matrices.len(), best * 1e3);
    }
    best
}

fn report(name: &str, layers: &[Shape], output: Shape) {
    let mut decode = layers.to_vec();
    decode.push(output);
    let decode_s = time_products(&decode, 1);
    // Prompt: every layer for all 512 tokens, logits for the last one only.
    let prompt_s = time_products(layers, 512) + time_products(&[output], 1);
    println!(
        "{name}: decode {:.2} ms/token ({:.0} tok/s), prompt-512 {:.1} ms ({:.0} tok/s)",
        decode_s * 1e3,
        1.0 / decode_s,
        prompt_s * 1e3,
        512.0 / prompt_s
    );
}

/// Matrix products of `layers` only: one token, and a 512-token prompt.
fn report_layers(name: &str, layers: &[Shape]) {
    let decode_s = time_products(layers, 1);
    let prompt_s = time_products(layers, 512);
    println!(
        "{name}: decode {:.3} ms/token, prompt-512 {:.1} ms",
        decode_s * 1e3,
        prompt_s * 1e3
    );
}

fn main() {
    if std::env::var_os("BENCH_Q6K_ONLY").is_some() {
        rayon::scope(|_| {
            for _ in 0..3 {
                report_layers("gemma3 Q6_K matrices only", GEMMA3_Q6K);
            }
        });
        return;
    }
    if std::env::var_os("BENCH_LEGACY_ONLY").is_some() {
        rayon::scope(|_| {
            for _ in 0..3 {
                for &shape in LEGACY {
                    let (ty, rows, cols, _) = shape;
                    report_layers(&format!("{ty:?} {rows}x{cols}"), &[shape]);
                }
            }
        });
        return;
    }
    if std::env::var_os("BENCH_Q4K_ONLY").is_some() {
        rayon::scope(|_| {
            for _ in 0..3 {
                report_layers("gemma3 Q4_K matrices only", GEMMA3_Q4K);
            }
        });
        return;
    }
    let run = || {
        println!(
            "threads: {}, simd: {}",
            rayon::current_num_threads(),
            leanstream_kernels::Device::cpu_features()
        );
        report("smollm2 (Q4_1)", SMOLLM2, SMOLLM2_OUTPUT);
        report("gemma3 (Q5_0/Q8_0/Q4_K/Q6_K)", GEMMA3, GEMMA3_OUTPUT);
        report_layers("gemma3 Q4_K matrices only", GEMMA3_Q4K);
    };
    // Calling from inside the pool lets this thread take part in each
    // product instead of handing it off and sleeping (as a runtime should).
    if std::env::var_os("BENCH_OUTSIDE_POOL").is_some() {
        run();
    } else {
        rayon::scope(|_| run());
    }
}
