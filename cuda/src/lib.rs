//! The GPU backend's device-independent half.
//!
//! - [`sources`]: the CUDA kernels (`kernels/cuda/*.cu`, headers `*.cuh`),
//!   embedded in the binary and compiled at run time by NVRTC ([`nvrtc`]) for
//!   the device's architecture, so no CUDA toolkit is needed to build.
//! - [`flags`]: the host side of the streaming FFN's hand-off: storage
//!   workers publish per-slot flags that the device's warps poll, instead of
//!   the host synchronizing the device between stages.
//! - [`stream`]: the host's half of a streamed layer, whoever computes it:
//!   the wanted neurons as slots, then each bundle landed (staging write,
//!   flag publish) as the neuron cache and the runtime's reads supply it.
//! - [`emulate`]: the device kernels of that hand-off run on CPU threads
//!   against the same flags, which is how the protocol is tested without a GPU.
//! - [`order`]: which float order the CPU engine's matrix products take, so
//!   the device's (`kernels/cuda/cpu_order.cuh`) can equal them bit for bit.
//! - [`device`]: a CUDA device with every kernel compiled and loaded, and
//!   typed launches of them (what `tests/device.rs` checks against the CPU
//!   kernels where a GPU is present).
//! - [`engine`]: the dense forward pass on the device (weights and the KV
//!   cache in device memory), greedy decoding; of a GGUF's matrices or of a
//!   packed model's bundles ([`ffn`]: every neuron resident in device
//!   memory, computed by the streaming kernels; [`streamed`]: read from
//!   flash each token, landed in mapped memory while those kernels poll).
//! - [`model`]: a model as the device engine opens it (a GGUF, or a packed
//!   model resident or streamed under the CPU engine's policy).
//!
//! CUDA's libraries are loaded at run time (cudarc's dynamic loading) and
//! looked for first ([`library`]): cudarc panics where one is missing, and a
//! machine without CUDA must get an ordinary error.

pub mod device;
pub mod emulate;
pub mod engine;
mod error;
pub mod ffn;
pub mod flags;
pub mod library;
pub mod model;
pub mod nvrtc;
pub mod order;
pub mod sources;
pub mod stream;
pub mod streamed;

pub use error::{CudaError, Result};
