//! Where a layer's bundles come from: memory, or the flash streamer.

use super::resident::Resident;
use super::stream::Streamer;

/// Where a layer's bundles are.
pub enum Source {
    Resident(Resident),
    Stream(Box<Streamer>),
}
