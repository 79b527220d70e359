//! Pure compute for LeanStream: quantized block types, dequantization,
//! activation quantization, dot products (scalar twins + SIMD), quantized
//! matrix products and the elementwise ops of a transformer layer.
//!
//! Slices in, slices out: nothing here does I/O, allocates on the hot path,
//! or reads a clock.

pub mod blocks;
pub mod dequant;
pub mod device;
pub mod dot;
pub mod error;
pub mod f16dot;
pub mod flash_attn;
pub mod ggml_type;
pub mod matmul;
pub mod ops;
pub mod quantize;
pub mod repack;
pub mod sparse_ffn;

pub use device::Device;
pub use error::KernelError;
pub use ggml_type::GgmlType;
pub use matmul::{matmul, ActBuffer, QMatrix};
