//! The slim LeanStream engine: GGUF loading, tokenizers, the dense forward
//! pass, sampling and generation. The `leanstream` binary sits on top.

pub mod aligned;
pub mod artifacts;
pub mod binread;
pub mod cache;
pub mod control;
pub mod durable;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod flash;
pub mod generate;
pub mod gguf;
pub mod model;
pub mod perplexity;
pub mod predict;
pub mod progress;
pub mod session;
pub mod sparsity;
pub mod synthetic;
pub mod tokenizer;

pub use error::{error_chain, Result, RuntimeError};
