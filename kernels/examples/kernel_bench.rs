//! Single-thread timing of one product shape, best of many runs (robust to
//! a shared machine): `cargo run --release -p leanstream-kernels --example
//! kernel_bench -- Q4_1 576 1536 1` (type, rows, cols, n).

use std::time::Instant;

use half::f16;
use leanstream_kernels::matmul::matmul_scalar;
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};

fn parse_type(name: &str) -> GgmlType {
    (0..40)
        .filter_map(|id| GgmlType::from_id(id).ok())
        .find(|ty| ty.name() == name)
        .unwrap_or_else(|| panic!("unknown type {name}"))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("quantize") {
        return quantize_bench(&args);
    }
    let ty = parse_type(args.first().map(String::as_str).unwrap_or("Q4_1"));
    let rows: usize = args.get(1).map_or(576, |a| a.parse().unwrap());
    let cols: usize = args.get(2).map_or(1536, |a| a.parse().unwrap());
    let n: usize = args.get(3).map_or(1, |a| a.parse().unwrap());
    let scalar = args.iter().any(|a| a == "scalar");

    let bytes = rows * ty.row_bytes(cols).unwrap();
    let mut words = vec![0u64; bytes.div_ceil(8)];
    let mut state = 0x1234_5678_9abc_def1u64;
    for w in words.iter_mut() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *w = state;
    }
    let data: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut words)[..bytes];
    // Sane f16 scales everywhere a block keeps one (never NaN or denormal).
    let offsets: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    for block in data.chunks_exact_mut(ty.type_size()) {
        for &o in offsets {
            block[o..o + 2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        }
    }
    let w = QMatrix::new(ty, rows, cols, data).unwrap();
    let x: Vec<f32> = (0..cols * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
    let mut acts = ActBuffer::with_capacity(cols, n);
    acts.quantize(ty.vec_dot_type(), &x, n, cols).unwrap();
    let mut out = vec![0.0f32; rows * n];

    let reps = (200_000_000 / (rows * cols * n).max(1)).clamp(3, 2000);
    let mut best = f64::INFINITY;
    let mut run = || {
        for _ in 0..reps {
            let start = Instant::now();
            if scalar {
                matmul_scalar(&w, &acts, &mut out).unwrap();
            } else {
                matmul(&w, &acts, &mut out).unwrap();
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
    };
    // From inside the pool (as a runtime using `install` would) unless asked.
    if args.iter().any(|a| a == "outside") {
        run();
    } else {
        rayon::scope(|_| run());
    }
    let macs = (rows * cols * n) as f64;
    println!(
        "{ty} {rows}x{cols} n={n} threads={}: best {:.1} us, {:.1} GMAC/s",
        rayon::current_num_threads(),
        best * 1e6,
        macs / best / 1e9
    );
}

/// Activation conversion throughput: `kernel_bench quantize Q8_0 640 512`.
fn quantize_bench(args: &[String]) {
    let ty = parse_type(args.get(1).map(String::as_str).unwrap_or("Q8_0"));
    let cols: usize = args.get(2).map_or(640, |a| a.parse().unwrap());
    let n: usize = args.get(3).map_or(512, |a| a.parse().unwrap());
    let x: Vec<f32> = (0..cols * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
    let mut acts = ActBuffer::with_capacity(cols, n);
    let mut best = f64::INFINITY;
    for _ in 0..50 {
        let start = Instant::now();
        acts.quantize(ty, &x, n, cols).unwrap();
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!(
        "quantize {ty} {n}x{cols} threads={}: best {:.1} us, {:.2} ns/value",
        rayon::current_num_threads(),
        best * 1e6,
        best * 1e9 / (cols * n) as f64
    );
}
