//! Dot products of a weight row with an activation row already converted to
//! the weight type's vec-dot type ([`GgmlType::vec_dot_type`]).
//!
//! Two implementations per type: SIMD kernels, and portable scalar twins that
//! follow GGML's generic C. On x86_64 the SIMD kernels are AVX2+FMA ones that
//! reproduce, bit for bit, the CPU backend of the reference llama.cpp build
//! (GCC, `GGML_NATIVE` on an AVX-512 machine; its quantized kernels are its
//! AVX2 ones), used when the CPU has AVX2. On aarch64 they are NEON kernels
//! (`neon.rs`) that reproduce, bit for bit, GGML's NEON code
//! (`ggml-cpu/arch/arm/quants.c`, `vec.cpp`) as GCC builds it for
//! `-march=armv8-a` (`tests/neon_vec_dot_golden.rs`), always used (NEON is
//! part of aarch64); where the CPU has FEAT_DotProd ([`has_neon_dotprod`])
//! their `sdot` form, which reproduces instead the vec-dots of llama.cpp
//! built with `-march=armv8.2-a+dotprod` (the 32-value formats round by
//! `sdot`'s lanes there; the K formats, F16 and F32 give the same results
//! either way). BF16 has no NEON kernel: llama.cpp's NEON build has none
//! either, and its generic loop is the scalar twin. SIMD and scalar agree to
//! rounding; the tests hold them to it.
//!
//! [`tiled_dot`] is the per-output arithmetic of llama.cpp's tiled K-quant
//! matmul (Q4_K/Q5_K/Q6_K against 8+ activation rows, see
//! [`crate::matmul::uses_tiled_kquant`]); its AVX2 and scalar forms share one
//! float order and agree bit for bit.

use std::sync::atomic::{AtomicU8, Ordering};

use bytemuck::Pod;
use half::{bf16, f16};

use crate::blocks::*;
use crate::{GgmlType, KernelError};

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
mod scalar;

/// Whether the AVX2 kernels can run here: AVX2, FMA and F16C (which every
/// AVX2 CPU has), detected once. Always false off x86_64.
pub fn has_avx2() -> bool {
    static DETECTED: AtomicU8 = AtomicU8::new(0);
    const NO: u8 = 1;
    const YES: u8 = 2;
    match DETECTED.load(Ordering::Relaxed) {
        NO => false,
        YES => true,
        _ => {
            let found = detect_avx2();
            DETECTED.store(if found { YES } else { NO }, Ordering::Relaxed);
            found
        }
    }
}

/// Whether AVX-512F runs here (the CPU has it and the OS saves its
/// registers), detected once, on top of [`has_avx2`]'s set.
pub fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX512F: OnceLock<bool> = OnceLock::new();
        *AVX512F.get_or_init(|| has_avx2() && std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the AVX-512 prompt kernels (`avx512.rs`) run here.
pub(crate) fn avx512_prompts() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
fn detect_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_avx2() -> bool {
    false
}

/// Whether the NEON kernels can use `sdot` (FEAT_DotProd), detected once.
/// Always false off aarch64. Without it they run their plain NEON form
/// (llama.cpp's `armv8-a` bits; with it, its dotprod build's, see `neon.rs`).
pub fn has_neon_dotprod() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        use std::sync::OnceLock;
        static DOTPROD: OnceLock<bool> = OnceLock::new();
        *DOTPROD.get_or_init(|| std::arch::is_aarch64_feature_detected!("dotprod"))
    }
    #[cfg(not(target_arch = "aarch64"))]
    false
}

/// Whether [`Path::Fastest`] has SIMD kernels here: AVX2 on x86_64, NEON
/// (always) on aarch64, none elsewhere.
pub(crate) fn has_simd_kernels() -> bool {
    if cfg!(target_arch = "aarch64") {
        true
    } else {
        has_avx2()
    }
}

/// The plain NEON tile kernel or, where the CPU has FEAT_DotProd, its `sdot`
/// twin (llama.cpp's dotprod build's lanes, see `neon::ByteDot`), each with
/// its `decode_rows`.
#[cfg(target_arch = "aarch64")]
fn with_dotprod<W, A>(plain: (TileFn<W, A>, usize), dotprod: (TileFn<W, A>, usize)) -> (TileFn<W, A>, usize) {
    if has_neon_dotprod() {
        dotprod
    } else {
        plain
    }
}

/// Which 256-bit `vpdpbusd` the CPU has besides the AVX2 kernels' features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Vnni {
    None,
    /// AVX-VNNI (VEX encoding).
    Avx,
    /// AVX512-VNNI with AVX512VL (EVEX encoding).
    Avx512,
}

/// The [`Vnni`] form here, detected once; `None` without [`has_avx2`].
pub(crate) fn vnni() -> Vnni {
    static DETECTED: AtomicU8 = AtomicU8::new(0);
    let code = match DETECTED.load(Ordering::Relaxed) {
        0 => {
            let code = match detect_vnni() {
                Vnni::None => 1,
                Vnni::Avx => 2,
                Vnni::Avx512 => 3,
            };
            DETECTED.store(code, Ordering::Relaxed);
            code
        }
        code => code,
    };
    match code {
        2 => Vnni::Avx,
        3 => Vnni::Avx512,
        _ => Vnni::None,
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_vnni() -> Vnni {
    if !has_avx2() {
        Vnni::None
    } else if is_x86_feature_detected!("avxvnni") {
        Vnni::Avx
    } else if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        Vnni::Avx512
    } else {
        Vnni::None
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_vnni() -> Vnni {
    Vnni::None
}

/// The AVX2 tile kernel or, where the CPU has one, its VNNI twin (which
/// gives the same results, see `avx2::ByteDot`).
#[cfg(target_arch = "x86_64")]
fn with_vnni<W, A>(avx2: TileFn<W, A>, avxvnni: TileFn<W, A>, avx512vnni: TileFn<W, A>) -> TileFn<W, A> {
    match vnni() {
        Vnni::None => avx2,
        Vnni::Avx => avxvnni,
        Vnni::Avx512 => avx512vnni,
    }
}

/// Dot product of `n` values: `w_row` of type `ty` with `a_row` of type
/// `ty.vec_dot_type()`, using the fastest kernel this CPU supports.
pub fn vec_dot(ty: GgmlType, w_row: &[u8], a_row: &[u8], n: usize) -> Result<f32, KernelError> {
    dot_rows(ty, w_row, a_row, n, Path::Fastest, false)
}

/// [`vec_dot`] with one form of the NEON kernels whatever the CPU: the
/// plain one (`dotprod` false), which gives the bits of llama.cpp built
/// without dotprod, or the `sdot` one (true), those of its dotprod build's
/// vec-dots (`neon.rs`); the formats without the two forms take their one
/// kernel. For the golden tests, which hold each form to its build. Errors
/// for the `sdot` form on a CPU without FEAT_DotProd.
#[cfg(target_arch = "aarch64")]
#[doc(hidden)]
pub fn vec_dot_neon(ty: GgmlType, w_row: &[u8], a_row: &[u8], n: usize, dotprod: bool) -> Result<f32, KernelError> {
    if dotprod && !has_neon_dotprod() {
        return Err(KernelError::UnsupportedType(format!(
            "{ty} with sdot on a CPU without FEAT_DotProd"
        )));
    }
    // Checks the lengths (and gives the other formats' result).
    let fallback = vec_dot(ty, w_row, a_row, n)?;
    macro_rules! form {
        ($plain:ident, $sdot:ident, $W:ty, $A:ty) => {{
            let w = cast_blocks::<$W>(w_row, "vec_dot weight row")?;
            let a = cast_blocks::<$A>(a_row, "vec_dot activation row")?;
            let mut out = [0.0f32];
            // SAFETY: NEON is part of aarch64; the sdot form only where
            // `has_neon_dotprod()` said yes (checked above).
            unsafe {
                if dotprod {
                    neon::$sdot(&[w], &[a], &mut out)
                } else {
                    neon::$plain(&[w], &[a], &mut out)
                }
            }
            out[0]
        }};
    }
    Ok(match ty {
        GgmlType::Q4_0 => form!(q4_0_q8_0, q4_0_q8_0_dotprod, BlockQ4_0, BlockQ8_0),
        GgmlType::Q4_1 => form!(q4_1_q8_1, q4_1_q8_1_dotprod, BlockQ4_1, BlockQ8_1),
        GgmlType::Q5_0 => form!(q5_0_q8_0, q5_0_q8_0_dotprod, BlockQ5_0, BlockQ8_0),
        GgmlType::Q5_1 => form!(q5_1_q8_1, q5_1_q8_1_dotprod, BlockQ5_1, BlockQ8_1),
        GgmlType::Q8_0 => form!(q8_0_q8_0, q8_0_q8_0_dotprod, BlockQ8_0, BlockQ8_0),
        GgmlType::Q4K => form!(q4_k_q8_k, q4_k_q8_k_dotprod, BlockQ4K, BlockQ8K),
        GgmlType::Q5K => form!(q5_k_q8_k, q5_k_q8_k_dotprod, BlockQ5K, BlockQ8K),
        GgmlType::Q6K => form!(q6_k_q8_k, q6_k_q8_k_dotprod, BlockQ6K, BlockQ8K),
        _ => fallback,
    })
}

/// The portable twin of [`vec_dot`]: GGML's generic formulas, no SIMD.
pub fn vec_dot_scalar(ty: GgmlType, w_row: &[u8], a_row: &[u8], n: usize) -> Result<f32, KernelError> {
    dot_rows(ty, w_row, a_row, n, Path::Scalar, false)
}

/// One output of llama.cpp's tiled K-quant matmul ([`crate::matmul::uses_tiled_kquant`]):
/// `n` values of a Q4_K/Q5_K/Q6_K `w_row` with a Q8_K `a_row`, using the
/// fastest kernel this CPU supports.
pub fn tiled_dot(ty: GgmlType, w_row: &[u8], a_row: &[u8], n: usize) -> Result<f32, KernelError> {
    dot_rows(ty, w_row, a_row, n, Path::Fastest, true)
}

/// The portable twin of [`tiled_dot`] (bit-identical to it).
pub fn tiled_dot_scalar(ty: GgmlType, w_row: &[u8], a_row: &[u8], n: usize) -> Result<f32, KernelError> {
    dot_rows(ty, w_row, a_row, n, Path::Scalar, true)
}

/// Which implementation family to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// SIMD when the CPU has it, else scalar.
    Fastest,
    /// Always the scalar twins.
    Scalar,
}

fn dot_rows(ty: GgmlType, w_row: &[u8], a_row: &[u8], n: usize, path: Path, tiled: bool) -> Result<f32, KernelError> {
    let w_expected = ty.row_bytes(n)?;
    let a_expected = ty.vec_dot_type().row_bytes(n)?;
    if w_row.len() != w_expected {
        return Err(KernelError::ByteLength {
            what: "vec_dot weight row",
            expected: w_expected,
            got: w_row.len(),
        });
    }
    if a_row.len() != a_expected {
        return Err(KernelError::ByteLength {
            what: "vec_dot activation row",
            expected: a_expected,
            got: a_row.len(),
        });
    }
    let user = SingleDot { w_row, a_row };
    if tiled {
        with_tiled_kernel(ty, path, user)?
    } else {
        with_kernel(ty, path, user)?
    }
}

struct SingleDot<'a> {
    w_row: &'a [u8],
    a_row: &'a [u8],
}

impl KernelUser for SingleDot<'_> {
    type Output = Result<f32, KernelError>;

    fn run<W: Pod + Sync, A: Pod + Sync>(self, kernel: Kernel<W, A>) -> Self::Output {
        let w = cast_blocks::<W>(self.w_row, "vec_dot weight row")?;
        let a = cast_blocks::<A>(self.a_row, "vec_dot activation row")?;
        let mut out = [0.0f32];
        kernel.dot(&[w], &[a], &mut out);
        Ok(out[0])
    }
}

/// A kernel computing weight rows (blocks `W`) against activation rows
/// (blocks `A`): `(w_rows, a_rows, out)` with
/// `out[r * a_rows.len() + t] = dot(w_rows[r], a_rows[t])`.
type TileFn<W, A> = unsafe fn(&[&[W]], &[&[A]], &mut [f32]);
type PortableFn<W, A> = fn(&[&[W]], &[&[A]], &mut [f32]);

/// A dot kernel chosen for one (weight, activation) type pair.
pub(crate) struct Kernel<W, A> {
    // Invariant: an AVX2 kernel is stored only after `has_avx2()` said yes,
    // a VNNI one only after `vnni()` named its form, a NEON `sdot` one only
    // after `has_neon_dotprod()` said yes.
    run: TileFn<W, A>,
    /// Weight rows worth handing over together for one activation row.
    decode_rows: usize,
}

impl<W, A> Clone for Kernel<W, A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<W, A> Copy for Kernel<W, A> {}

impl<W, A> Kernel<W, A> {
    fn portable(run: PortableFn<W, A>) -> Self {
        Self { run, decode_rows: 1 }
    }

    /// The SIMD kernel if wanted and supported, else the portable one.
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    fn choose(path: Path, simd: TileFn<W, A>, decode_rows: usize, portable: PortableFn<W, A>) -> Self {
        if path == Path::Fastest && has_simd_kernels() {
            Self { run: simd, decode_rows }
        } else {
            Self::portable(portable)
        }
    }

    /// How many weight rows to pass per call when there is one activation
    /// row: several where the kernel gains from independent FMA chains,
    /// one where a single sequential stream of weights is faster.
    pub(crate) fn decode_rows(&self) -> usize {
        self.decode_rows
    }

    /// `out[r * a_rows.len() + t] = dot(w_rows[r], a_rows[t])` over the
    /// blocks all operands share; `out` must hold every pair.
    #[inline]
    pub(crate) fn dot(&self, w_rows: &[&[W]], a_rows: &[&[A]], out: &mut [f32]) {
        // SAFETY: `run` is portable, or SIMD selected after runtime detection
        // (see `choose`); every kernel bounds its reads by the slice lengths.
        unsafe { (self.run)(w_rows, a_rows, out) }
    }
}

/// Something to do with a kernel, generic over its block types. Lets one
/// `match` on [`GgmlType`] serve single dots and whole matrix products.
pub(crate) trait KernelUser {
    type Output;
    fn run<W: Pod + Sync, A: Pod + Sync>(self, kernel: Kernel<W, A>) -> Self::Output;
}

/// Adapts a single-row scalar dot to the tile form.
macro_rules! scalar_rows {
    ($single:path, $W:ty, $A:ty) => {{
        fn rows(w_rows: &[&[$W]], a_rows: &[&[$A]], out: &mut [f32]) {
            let n = a_rows.len();
            for (w, out) in w_rows.iter().zip(out.chunks_mut(n.max(1))) {
                for (o, a) in out.iter_mut().zip(a_rows) {
                    *o = $single(w, a);
                }
            }
        }
        rows as PortableFn<$W, $A>
    }};
}

/// The kernel for weights of type `ty` on `path`, handed to `user`.
pub(crate) fn with_kernel<U: KernelUser>(ty: GgmlType, path: Path, user: U) -> Result<U::Output, KernelError> {
    // `x86 = (kernel, decode_rows)` for x86_64 and `arm = ...` the same for
    // aarch64 (`arm = portable`: no NEON kernel). x86 `decode_rows` as
    // measured on the AVX2 kernels: the 32-value formats with cheap unpacking
    // are bound by their FMA chain and gain from 4 rows; Q5_0's bit unpacking
    // and the K formats' larger state do not. NEON's, per form, by guest
    // instructions per output row of a one-token matmul under qemu (no timing
    // on hardware yet): 8 rows per call (the most `matmul` passes), which the
    // kernels take in tiles of 4 (8 spill registers), unless fewer took less:
    // plain Q4_K 1 (its tiles of 2 and 4 spill).
    macro_rules! pick {
        ($name:ident, $W:ty, $A:ty, x86 = ($x86:expr, $rows:literal), arm = portable) => {
            pick!(@ $name, $W, $A, ($x86, $rows), (scalar_rows!(scalar::$name, $W, $A) as TileFn<$W, $A>, 1))
        };
        ($name:ident, $W:ty, $A:ty, x86 = ($x86:expr, $rows:literal), arm = $arm:expr) => {
            pick!(@ $name, $W, $A, ($x86, $rows), $arm)
        };
        (@ $name:ident, $W:ty, $A:ty, ($x86:expr, $rows:literal), $arm:expr) => {{
            let portable = scalar_rows!(scalar::$name, $W, $A);
            #[cfg(target_arch = "x86_64")]
            let kernel = Kernel::<$W, $A>::choose(path, $x86, $rows, portable);
            #[cfg(target_arch = "aarch64")]
            let kernel = {
                let (simd, rows) = $arm;
                Kernel::<$W, $A>::choose(path, simd, rows, portable)
            };
            #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
            let kernel = {
                let _ = path;
                Kernel::<$W, $A>::portable(portable)
            };
            user.run(kernel)
        }};
    }
    // The byte-dot formats' two NEON forms, each with its `decode_rows`.
    #[cfg(target_arch = "aarch64")]
    macro_rules! neon {
        ($plain:ident / $plain_rows:literal | $dotprod:ident / $dotprod_rows:literal) => {
            with_dotprod((neon::$plain, $plain_rows), (neon::$dotprod, $dotprod_rows))
        };
    }
    Ok(match ty {
        GgmlType::Q4_0 => pick!(
            q4_0_q8_0,
            BlockQ4_0,
            BlockQ8_0,
            x86 = (avx2::q4_0_q8_0, 4),
            arm = neon!(q4_0_q8_0 / 8 | q4_0_q8_0_dotprod / 8)
        ),
        GgmlType::Q4_1 => pick!(
            q4_1_q8_1,
            BlockQ4_1,
            BlockQ8_1,
            x86 = (
                with_vnni(avx2::q4_1_q8_1, avx2::q4_1_q8_1_avxvnni, avx2::q4_1_q8_1_avx512vnni),
                4
            ),
            arm = neon!(q4_1_q8_1 / 8 | q4_1_q8_1_dotprod / 8)
        ),
        GgmlType::Q5_0 => pick!(
            q5_0_q8_0,
            BlockQ5_0,
            BlockQ8_0,
            x86 = (
                with_vnni(avx2::q5_0_q8_0, avx2::q5_0_q8_0_avxvnni, avx2::q5_0_q8_0_avx512vnni),
                1
            ),
            arm = neon!(q5_0_q8_0 / 8 | q5_0_q8_0_dotprod / 8)
        ),
        GgmlType::Q5_1 => pick!(
            q5_1_q8_1,
            BlockQ5_1,
            BlockQ8_1,
            x86 = (avx2::q5_1_q8_1, 4),
            arm = neon!(q5_1_q8_1 / 8 | q5_1_q8_1_dotprod / 8)
        ),
        GgmlType::Q8_0 => pick!(
            q8_0_q8_0,
            BlockQ8_0,
            BlockQ8_0,
            x86 = (
                with_vnni(avx2::q8_0_q8_0, avx2::q8_0_q8_0_avxvnni, avx2::q8_0_q8_0_avx512vnni),
                4
            ),
            arm = neon!(q8_0_q8_0 / 8 | q8_0_q8_0_dotprod / 8)
        ),
        GgmlType::Q4K => pick!(
            q4_k_q8_k,
            BlockQ4K,
            BlockQ8K,
            x86 = (avx2::q4_k_q8_k, 1),
            arm = neon!(q4_k_q8_k / 8 | q4_k_q8_k_dotprod / 8)
        ),
        GgmlType::Q5K => pick!(
            q5_k_q8_k,
            BlockQ5K,
            BlockQ8K,
            x86 = (avx2::q5_k_q8_k, 1),
            arm = neon!(q5_k_q8_k / 8 | q5_k_q8_k_dotprod / 8)
        ),
        GgmlType::Q6K => pick!(
            q6_k_q8_k,
            BlockQ6K,
            BlockQ8K,
            x86 = (avx2::q6_k_q8_k, 1),
            arm = neon!(q6_k_q8_k / 8 | q6_k_q8_k_dotprod / 8)
        ),
        GgmlType::F32 => pick!(
            f32_f32,
            f32,
            f32,
            x86 = (avx2::f32_f32, 1),
            arm = (neon::f32_f32 as TileFn<f32, f32>, 1)
        ),
        GgmlType::F16 => pick!(
            f16_f16,
            f16,
            f16,
            x86 = (avx2::f16_f16, 1),
            arm = (neon::f16_f16 as TileFn<f16, f16>, 1)
        ),
        GgmlType::BF16 => pick!(bf16_bf16, bf16, bf16, x86 = (avx2::bf16_bf16, 1), arm = portable),
        // GGML has no dot kernel with these as weights either.
        GgmlType::Q8_1 | GgmlType::Q8K => {
            return Err(KernelError::UnsupportedType(format!("{ty} as a weight type")));
        }
    })
}

/// The kernel of llama.cpp's tiled K-quant matmul for weights of type `ty`
/// on `path`, handed to `user` (see [`crate::matmul::uses_tiled_kquant`]).
/// Errors for types this crate does not emulate it for. That matmul is
/// x86-only in llama.cpp, so off x86_64 only the portable form exists (for
/// [`tiled_dot`]; `matmul` never takes it there).
pub(crate) fn with_tiled_kernel<U: KernelUser>(ty: GgmlType, path: Path, user: U) -> Result<U::Output, KernelError> {
    macro_rules! pick {
        ($name:ident, $W:ty) => {{
            let portable = scalar_rows!(scalar::$name, $W, BlockQ8K);
            #[cfg(target_arch = "x86_64")]
            let kernel = Kernel::<$W, BlockQ8K>::choose(path, avx2::$name, 1, portable);
            #[cfg(not(target_arch = "x86_64"))]
            let kernel = {
                let _ = path;
                Kernel::<$W, BlockQ8K>::portable(portable)
            };
            user.run(kernel)
        }};
    }
    Ok(match ty {
        GgmlType::Q4K => pick!(q4_k_q8_k_tiled, BlockQ4K),
        GgmlType::Q5K => pick!(q5_k_q8_k_tiled, BlockQ5K),
        GgmlType::Q6K => pick!(q6_k_q8_k_tiled, BlockQ6K),
        _ => {
            return Err(KernelError::UnsupportedType(format!(
                "{ty} in the tiled K-quant matmul"
            )));
        }
    })
}
