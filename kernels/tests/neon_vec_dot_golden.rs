//! On aarch64, each form of the NEON vec-dots against llama.cpp's own
//! aarch64 vec-dots on the same rows, bit for bit:
//!
//! * the plain form (every aarch64 CPU) against
//!   data/golden/aarch64/vec_dot.jsonl, from the `libggml-cpu.so` of
//!   `scripts/aarch64.sh llama armv8-a` (GCC, `-O3 -march=armv8-a`: NEON
//!   without dotprod, the build of data/golden/aarch64/), always;
//! * the `sdot` form against data/golden/aarch64/vec_dot_dotprod.jsonl, from
//!   that of `scripts/aarch64.sh llama armv8.2-a+dotprod` (whose
//!   `ggml_vdotq_s32` is `sdot`, so its 32-value formats round by `sdot`'s
//!   lanes), where the CPU has FEAT_DotProd (`QEMU_CPU=max`; it says so and
//!   skips elsewhere);
//! * `vec_dot`, which takes the `sdot` form where it can, against the file
//!   of the form it took.
//!
//! Both recordings call the same `ggml_vec_dot_*` symbols directly, so the
//! dotprod one holds that build's vec-dots, not the repacked gemv/gemm it
//! uses for Q4_0, Q8_0 and the K formats in a model (see `neon.rs`). On
//! other targets the test only says it skipped.
//!
//! The rows are arbitrary bytes with finite scales, built here rather than
//! quantized, so the recordings depend on nothing but the kernels. To record
//! again, see the oracle's header: this test writes the cases when
//! `LEANSTREAM_RECORD_NEON_CASES` names a file.

use half::f16;
use leanstream_kernels::dot::vec_dot;
use leanstream_kernels::GgmlType;
use serde_json::Value;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

struct Case {
    ty: GgmlType,
    n: usize,
    w: Vec<u8>,
    a: Vec<u8>,
}

/// GGML's type ids, as the oracle takes them.
fn type_id(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q5_0 => 6,
        GgmlType::Q5_1 => 7,
        GgmlType::Q8_0 => 8,
        GgmlType::Q4K => 12,
        GgmlType::Q5K => 13,
        GgmlType::Q6K => 14,
        other => panic!("no case of {other}"),
    }
}

fn type_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_K",
        GgmlType::Q5K => "q5_K",
        GgmlType::Q6K => "q6_K",
        other => panic!("no case of {other}"),
    }
}

/// Byte offsets of a block's f16 scales (the f32 one of Q8_K is at 0).
fn f16_scales(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

/// `n` values of `ty`: arbitrary quants (runs of the byte products' edge
/// values now and then) with finite scales, or random floats.
fn row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
    match ty {
        GgmlType::F32 => {
            for chunk in bytes.chunks_exact_mut(4) {
                chunk.copy_from_slice(&(3.0 * rng.unit()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for chunk in bytes.chunks_exact_mut(2) {
                chunk.copy_from_slice(&f16::from_f32(3.0 * rng.unit()).to_le_bytes());
            }
        }
        _ => {
            let edge = rng.next().is_multiple_of(4);
            for b in bytes.iter_mut() {
                let r = rng.next() as u8;
                *b = if edge {
                    [0x80, 0x7F, 0x81, r][(r % 4) as usize]
                } else {
                    r
                };
            }
            let block_bytes = ty.row_bytes(ty.block_size()).unwrap();
            for block in bytes.chunks_exact_mut(block_bytes) {
                for &o in f16_scales(ty) {
                    let d = rng.unit() * [1.0, 0.05, 2e-3][(rng.next() % 3) as usize];
                    block[o..o + 2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                }
                if ty == GgmlType::Q8K {
                    block[..4].copy_from_slice(&(0.02 * rng.unit()).to_le_bytes());
                }
            }
        }
    }
    bytes
}

fn cases() -> Vec<Case> {
    let mut rng = Rng(0x5EED_A64A_0000_0001);
    let legacy = [32usize, 64, 96, 160, 1056];
    let k = [256usize, 512, 768, 2304];
    let floats = [
        1usize, 2, 3, 4, 5, 7, 8, 12, 15, 16, 17, 19, 20, 31, 32, 33, 47, 48, 63, 64, 65, 100, 255, 1000, 4099,
    ];
    let plan: [(GgmlType, &[usize], usize); 10] = [
        (GgmlType::Q4_0, &legacy, 4),
        (GgmlType::Q4_1, &legacy, 4),
        (GgmlType::Q5_0, &legacy, 4),
        (GgmlType::Q5_1, &legacy, 4),
        (GgmlType::Q8_0, &legacy, 4),
        (GgmlType::Q4K, &k, 4),
        (GgmlType::Q5K, &k, 4),
        (GgmlType::Q6K, &k, 4),
        (GgmlType::F32, &floats, 1),
        (GgmlType::F16, &floats, 1),
    ];
    let mut cases = Vec::new();
    for (ty, lens, reps) in plan {
        for &n in lens {
            for _ in 0..reps {
                let w = row(ty, n, &mut rng);
                let a = row(ty.vec_dot_type(), n, &mut rng);
                cases.push(Case { ty, n, w, a });
            }
        }
    }
    cases
}

/// The cases in the oracle's input format.
fn write_cases(path: &str, cases: &[Case]) {
    let mut out = Vec::new();
    for c in cases {
        for v in [type_id(c.ty), c.n as u32, c.w.len() as u32, c.a.len() as u32] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&c.w);
        out.extend_from_slice(&c.a);
    }
    std::fs::write(path, out).unwrap();
}

/// `bytes` in an 8-byte aligned buffer, as the kernels want them.
fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
    words
}

/// The recording `file` (under data/golden/aarch64/) checked against
/// `dot` on every case: the mismatches, described.
fn mismatches(cases: &[Case], file: &str, dot: impl Fn(&Case, &[u8], &[u8]) -> f32) -> Vec<String> {
    let path = format!("{}/../data/golden/aarch64/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let want: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(want.len(), cases.len(), "{file}: recording and cases differ in number");
    let mut out = Vec::new();
    for (case, want) in cases.iter().zip(&want) {
        assert_eq!(want["type"].as_str().unwrap(), type_name(case.ty), "{file}");
        assert_eq!(want["n"].as_u64().unwrap() as usize, case.n, "{file}");
        let bits = u32::from_str_radix(want["bits"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
        let (w, a) = (aligned(&case.w), aligned(&case.a));
        let w = &bytemuck::cast_slice::<u64, u8>(&w)[..case.w.len()];
        let a = &bytemuck::cast_slice::<u64, u8>(&a)[..case.a.len()];
        let got = dot(case, w, a);
        if got.to_bits() != bits {
            out.push(format!(
                "{} n={}: ours {got:e}, llama.cpp {:e}",
                case.ty,
                case.n,
                f32::from_bits(bits)
            ));
        }
    }
    out
}

fn assert_none(mismatches: Vec<String>, what: &str, cases: usize) {
    assert!(
        mismatches.is_empty(),
        "{} of {cases} dot products of {what} differ from llama.cpp's ({}):\n{}",
        mismatches.len(),
        leanstream_kernels::Device::cpu_features(),
        mismatches.join("\n")
    );
}

/// Writes the cases where `LEANSTREAM_RECORD_NEON_CASES` asks; true if so.
fn recording(cases: &[Case]) -> bool {
    match std::env::var("LEANSTREAM_RECORD_NEON_CASES") {
        Ok(path) => {
            write_cases(&path, cases);
            eprintln!("wrote {} cases to {path}", cases.len());
            true
        }
        Err(_) => false,
    }
}

#[test]
fn plain_form_matches_llama_cpp_armv8_a_bit_for_bit() {
    let cases = cases();
    if recording(&cases) {
        return;
    }
    #[cfg(target_arch = "aarch64")]
    {
        use leanstream_kernels::dot::vec_dot_neon;
        let found = mismatches(&cases, "vec_dot.jsonl", |c, w, a| {
            vec_dot_neon(c.ty, w, a, c.n, false).unwrap()
        });
        assert_none(found, "the plain NEON form", cases.len());
    }
    #[cfg(not(target_arch = "aarch64"))]
    eprintln!("not aarch64: llama.cpp's aarch64 bits are not this target's (see tests/vec_dot_golden.rs)");
}

#[test]
fn sdot_form_matches_llama_cpp_dotprod_bit_for_bit() {
    #[cfg(target_arch = "aarch64")]
    {
        use leanstream_kernels::dot::{has_neon_dotprod, vec_dot_neon};
        if !has_neon_dotprod() {
            eprintln!("no FEAT_DotProd on this CPU: the sdot form is not checked (QEMU_CPU=max checks it)");
            return;
        }
        let cases = cases();
        let found = mismatches(&cases, "vec_dot_dotprod.jsonl", |c, w, a| {
            vec_dot_neon(c.ty, w, a, c.n, true).unwrap()
        });
        assert_none(found, "the sdot NEON form", cases.len());
    }
    #[cfg(not(target_arch = "aarch64"))]
    eprintln!("not aarch64: llama.cpp's aarch64 bits are not this target's (see tests/vec_dot_golden.rs)");
}

#[test]
fn vec_dot_matches_the_llama_cpp_build_of_its_form() {
    if !cfg!(target_arch = "aarch64") {
        eprintln!("not aarch64: llama.cpp's aarch64 bits are not this target's (see tests/vec_dot_golden.rs)");
        return;
    }
    let file = if leanstream_kernels::dot::has_neon_dotprod() {
        "vec_dot_dotprod.jsonl"
    } else {
        "vec_dot.jsonl"
    };
    let cases = cases();
    let found = mismatches(&cases, file, |c, w, a| vec_dot(c.ty, w, a, c.n).unwrap());
    assert_none(found, &format!("vec_dot (against {file})"), cases.len());
}

/// Not a check: a fixed workload for counting guest instructions under qemu
/// (`scripts/aarch64/insn_count.c`), one thread. `LEANSTREAM_NEON_COUNT="TYPE
/// ROWS COLS REPS [TOKENS]"` runs REPS matmuls of a ROWS x COLS matrix with
/// TOKENS activation rows (default 1); the difference between two REPS
/// counts is the kernels' share. For example
///
/// ```text
/// LEANSTREAM_NEON_COUNT="Q8_0 262144 640 2" RAYON_NUM_THREADS=1 QEMU_CPU=max \
///     qemu-aarch64 -L /usr/aarch64-linux-gnu -plugin insn_count.so -d plugin \
///     TEST_BINARY --ignored --exact matvec_workload
/// ```
#[test]
#[ignore = "a workload for instruction counts, not a check"]
fn matvec_workload() {
    use leanstream_kernels::{matmul, ActBuffer, QMatrix};
    let Ok(spec) = std::env::var("LEANSTREAM_NEON_COUNT") else {
        eprintln!("set LEANSTREAM_NEON_COUNT=\"TYPE ROWS COLS REPS [TOKENS]\"");
        return;
    };
    let args: Vec<&str> = spec.split_whitespace().collect();
    let ty = (0..40)
        .filter_map(|id| GgmlType::from_id(id).ok())
        .find(|ty| ty.name() == args[0])
        .unwrap_or_else(|| panic!("unknown type {}", args[0]));
    let (rows, cols, reps): (usize, usize, usize) = (
        args[1].parse().unwrap(),
        args[2].parse().unwrap(),
        args[3].parse().unwrap(),
    );
    let tokens: usize = args.get(4).map_or(1, |a| a.parse().unwrap());
    let mut rng = Rng(0x00C0_FFEE);
    let bytes = rows * ty.row_bytes(cols).unwrap();
    let mut words = vec![0u64; bytes.div_ceil(8)];
    for w in words.iter_mut() {
        *w = rng.next();
    }
    let data = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes];
    let block_bytes = ty.row_bytes(ty.block_size()).unwrap();
    for block in data.chunks_exact_mut(block_bytes) {
        for &o in f16_scales(ty) {
            block[o..o + 2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        }
    }
    let w = QMatrix::new(ty, rows, cols, data).unwrap();
    let x: Vec<f32> = (0..cols * tokens).map(|_| rng.unit()).collect();
    let mut acts = ActBuffer::with_capacity(cols, tokens);
    acts.quantize(ty.vec_dot_type(), &x, tokens, cols).unwrap();
    let mut out = vec![0.0f32; rows * tokens];
    let mut check = 0.0f32;
    for rep in 0..reps {
        matmul(&w, &acts, &mut out).unwrap();
        check += out[rep % rows];
    }
    eprintln!("{ty} {rows}x{cols}, {tokens} tokens, x{reps}: {check}");
}
