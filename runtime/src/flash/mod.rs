//! Flash streaming: the packed `.lsflash` format and the I/O engine that
//! reads neuron bundles from it.

pub mod format;
pub mod io;
pub mod pack;
pub mod pagecache;
pub mod runs;

pub use format::{BundleLayout, DownType, Header, LsFlash, SparsityLevel};
pub use pack::{pack, PackOptions, PackReport};
