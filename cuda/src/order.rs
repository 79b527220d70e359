//! Which float order the CPU engine's `matmul` gives an output, so the
//! device's matvec (`kernels/cuda/cpu_order.cuh`) can take the same one and
//! equal it bit for bit.
//!
//! The integer sums inside every quantized product are exact; what differs
//! between the CPU's kernels is how they add the scaled partial sums, and
//! which kernel runs depends on the matrix and the batch, as in llama.cpp's
//! CPU backend: repacked Q4_K (rows a multiple of 8) through its gemm or
//! gemv, the K-quants against 8+ activation rows through the tiled matmul,
//! everything else through the vec-dot kernels. This reads that dispatch
//! from the kernels crate itself rather than restating it.
//!
//! The vec-dot order is the AVX2 kernels' (eight lanes) on any x86 CPU with
//! AVX2 ([`has_avx2`]), and GGML's generic formulas elsewhere (an Arm host
//! such as a Jetson), as the CPU engine itself chooses.

use leanstream_kernels::dot::has_avx2;
use leanstream_kernels::matmul::uses_tiled_kquant;
use leanstream_kernels::{repack, GgmlType};

/// One of the CPU's float orders for a matrix product (`ORDER_*` in
/// `cpu_order.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuOrder {
    /// `ggml_vec_dot_*`'s AVX2 kernels: eight f32 lanes (4 × 16 for
    /// F16/F32), one fma a block each, then `hsum_float_8`.
    Lanes,
    /// The vec-dot's generic C, where the CPU has no AVX2: rounded products
    /// and adds a block (the K-quants in eight lanes by value index).
    Generic,
    /// The tiled K-quant matmul: one fma a super-block, in order.
    Tiled,
    /// Repacked Q4_K: the first `gemm_rows` activation rows through the
    /// gemm (one fma a pair of sub-blocks), the rest through the gemv (one
    /// a super-block).
    Repacked { gemm_rows: usize },
}

impl CpuOrder {
    /// The order of a `rows`-row matrix of `ty` against `n` activation rows
    /// in one `matmul` call on this CPU.
    pub fn of(ty: GgmlType, rows: usize, n: usize) -> Self {
        Self::on(ty, rows, n, has_avx2())
    }

    /// [`of`](Self::of) on a CPU with AVX2 (`simd`) or without, whose
    /// engine runs `matmul_scalar`'s formulas.
    pub fn on(ty: GgmlType, rows: usize, n: usize, simd: bool) -> Self {
        if ty == GgmlType::Q4K && repack::q4k_is_repacked(rows) {
            CpuOrder::Repacked {
                gemm_rows: repack::gemm_rows(n),
            }
        } else if uses_tiled_kquant(ty, rows, n) {
            CpuOrder::Tiled
        } else if simd {
            CpuOrder::Lanes
        } else {
            CpuOrder::Generic
        }
    }

    /// The `order` argument of the matvec kernels.
    pub fn id(self) -> i32 {
        match self {
            CpuOrder::Lanes => ORDER_LANES,
            CpuOrder::Generic => ORDER_GENERIC,
            CpuOrder::Tiled => ORDER_TILED,
            CpuOrder::Repacked { .. } => ORDER_REPACK_GEMV,
        }
    }

    /// The `order` a kernel computing token `t` of the batch takes: the
    /// repacked gemm's for the first [`gemm_rows`](Self::gemm_rows), else
    /// [`id`](Self::id).
    pub fn id_for_token(self, t: usize) -> i32 {
        match self {
            CpuOrder::Repacked { gemm_rows } if t < gemm_rows => ORDER_REPACK_GEMM,
            _ => self.id(),
        }
    }

    /// Activation rows that take the repacked gemm's order (0 otherwise).
    pub fn gemm_rows(self) -> usize {
        match self {
            CpuOrder::Repacked { gemm_rows } => gemm_rows,
            _ => 0,
        }
    }
}

/// `ORDER_LANES` … in `cpu_order.cuh` (a test checks they agree).
pub const ORDER_LANES: i32 = 0;
pub const ORDER_TILED: i32 = 1;
pub const ORDER_REPACK_GEMM: i32 = 2;
pub const ORDER_REPACK_GEMV: i32 = 3;
pub const ORDER_GENERIC: i32 = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_follows_the_cpu_dispatch() {
        // Gemma 3's Q4_K down (640 rows) is repacked: gemm for whole fours.
        assert_eq!(CpuOrder::of(GgmlType::Q4K, 640, 9), CpuOrder::Repacked { gemm_rows: 8 });
        assert_eq!(CpuOrder::of(GgmlType::Q4K, 640, 3).gemm_rows(), 0);
        // A Q4_K matrix it does not repack, and Q6_K: tiled from 8 rows on.
        assert_eq!(CpuOrder::of(GgmlType::Q4K, 644, 8), CpuOrder::Tiled);
        assert_eq!(CpuOrder::on(GgmlType::Q4K, 644, 7, true), CpuOrder::Lanes);
        assert_eq!(CpuOrder::of(GgmlType::Q6K, 64, 8), CpuOrder::Tiled);
        assert_eq!(CpuOrder::on(GgmlType::Q6K, 64, 1, true), CpuOrder::Lanes);
        assert_eq!(CpuOrder::on(GgmlType::Q4_1, 64, 512, true), CpuOrder::Lanes);
        // Without AVX2 the vec-dot cases take the generic formulas; the
        // tiled and repacked kernels are the same arithmetic either way.
        assert_eq!(CpuOrder::on(GgmlType::Q4_1, 64, 1, false), CpuOrder::Generic);
        assert_eq!(CpuOrder::on(GgmlType::Q6K, 64, 8, false), CpuOrder::Tiled);
        assert_eq!(
            CpuOrder::on(GgmlType::Q4K, 640, 5, false),
            CpuOrder::Repacked { gemm_rows: 4 }
        );
        assert_eq!(CpuOrder::Repacked { gemm_rows: 4 }.id(), ORDER_REPACK_GEMV);
        assert_eq!(CpuOrder::Repacked { gemm_rows: 4 }.id_for_token(3), ORDER_REPACK_GEMM);
        assert_eq!(CpuOrder::Repacked { gemm_rows: 4 }.id_for_token(4), ORDER_REPACK_GEMV);
        assert_eq!(CpuOrder::Tiled.id_for_token(0), ORDER_TILED);
    }
}
