//! The host side of the streaming FFN's hand-off (`kernels/cuda/ffn_stream.cu`).
//!
//! A layer's FFN for one token runs over *slots*: a neuron bundle's address
//! and the address of a flag. The host takes a fresh *epoch* per layer and
//! token, launches the kernel, and as each bundle lands (its read's
//! completion reaped, so its bytes are in memory) publishes the slot's flag
//! with a release store of the epoch. The device's warps poll their flag
//! with acquire loads and compute once it reaches the epoch; a slot still
//! short of it at the deadline is skipped. Flags only grow, so one left from
//! an earlier epoch never reads as ready and nothing is reset between
//! layers; bundles held in the device's neuron cache point at a flag fixed
//! at [`ALWAYS_READY`].
//!
//! On a GPU the flags live in pinned, device-mapped host memory; here they
//! are any `AtomicU32`s, which is what the CPU emulation ([`crate::emulate`])
//! polls.

use std::sync::atomic::{AtomicU32, Ordering};

use bytemuck::{Pod, Zeroable};

use crate::{CudaError, Result};

/// The flag value of a slot that is always ready (a cached bundle).
pub const ALWAYS_READY: u32 = u32::MAX;

/// One unit of the streaming FFN's work, as the kernel reads it (`Slot` in
/// `ffn_stream.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct Slot {
    /// Where the bundle's bytes are: a device address, or in the CPU
    /// emulation an offset into its staging buffer.
    pub bundle: u64,
    /// Where its flag is: a device address, or in the emulation an index
    /// into the flag board.
    pub flag: u64,
    /// The neuron the bundle belongs to.
    pub neuron: u32,
    pub pad: u32,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 24);

/// Epochs handed out one per layer and token, increasing from 1.
#[derive(Debug, Default)]
pub struct Epochs {
    last: u32,
}

impl Epochs {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next epoch. After 2^32 - 2 of them (years of decoding) the
    /// board must be reset, which this says rather than wrapping into
    /// epochs that stale flags would satisfy.
    pub fn advance(&mut self) -> Result<u32> {
        if self.last + 1 == ALWAYS_READY {
            return Err(CudaError::Invalid(
                "flag epochs exhausted: reset the flag board before the next epoch".into(),
            ));
        }
        self.last += 1;
        Ok(self.last)
    }
}

/// Flags in memory the host and the device (or the emulation) both see.
#[derive(Debug)]
pub struct FlagBoard<'a> {
    flags: &'a [AtomicU32],
}

impl<'a> FlagBoard<'a> {
    pub fn new(flags: &'a [AtomicU32]) -> Self {
        Self { flags }
    }

    pub fn len(&self) -> usize {
        self.flags.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flags.is_empty()
    }

    fn flag(&self, index: usize) -> Result<&AtomicU32> {
        self.flags
            .get(index)
            .ok_or_else(|| CudaError::Invalid(format!("flag {index} of a board of {}", self.flags.len())))
    }

    /// Publishes slot `index` as ready for `epoch`. Everything the caller
    /// wrote before (the bundle's bytes) is visible to whoever sees the flag
    /// (release). Publishing an epoch older than the flag's value is an
    /// error: it would mean a bundle written for a layer already done.
    pub fn publish(&self, index: usize, epoch: u32) -> Result<()> {
        let previous = self.flag(index)?.fetch_max(epoch, Ordering::Release);
        if previous > epoch && previous != ALWAYS_READY {
            return Err(CudaError::Invalid(format!(
                "flag {index} published for epoch {epoch} after epoch {previous}"
            )));
        }
        Ok(())
    }

    /// Marks slot `index` as always ready (its bundle is resident).
    pub fn pin(&self, index: usize) -> Result<()> {
        self.flag(index)?.store(ALWAYS_READY, Ordering::Release);
        Ok(())
    }

    /// Whether slot `index` is ready for `epoch`; acquire, so a `true`
    /// makes the bundle's bytes visible to the caller.
    pub fn is_ready(&self, index: usize, epoch: u32) -> Result<bool> {
        Ok(self.flag(index)?.load(Ordering::Acquire) >= epoch)
    }

    /// Every flag back to 0 (no epoch satisfied); only between launches.
    pub fn reset(&self) {
        for f in self.flags {
            f.store(0, Ordering::Release);
        }
    }
}

/// The slot order stage 2 sums in: by neuron id, so `y` does not depend on
/// the order bundles were requested or arrived in.
pub fn down_order(slots: &[Slot]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..slots.len() as u32).collect();
    order.sort_by_key(|&s| slots[s as usize].neuron);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_only_grow_and_old_epochs_never_read_ready() {
        let cells: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        let board = FlagBoard::new(&cells);
        let mut epochs = Epochs::new();
        let (e1, e2) = (epochs.advance().unwrap(), epochs.advance().unwrap());
        assert!(e2 > e1 && e1 > 0);
        board.publish(0, e1).unwrap();
        assert!(board.is_ready(0, e1).unwrap());
        assert!(
            !board.is_ready(0, e2).unwrap(),
            "a flag of the last layer must not satisfy the next"
        );
        board.publish(0, e2).unwrap();
        assert!(
            board.publish(0, e1).is_err(),
            "a late publish for a finished epoch is refused"
        );
        assert!(board.is_ready(0, e2).unwrap());
        board.pin(1).unwrap();
        assert!(board.is_ready(1, e2).unwrap() && board.is_ready(1, ALWAYS_READY - 1).unwrap());
        assert!(!board.is_ready(2, e1).unwrap());
        assert!(board.publish(3, e1).is_err() && board.is_ready(3, e1).is_err());
        board.reset();
        assert!(!board.is_ready(0, e1).unwrap());
    }

    #[test]
    fn epochs_run_out_with_an_error_not_a_wrap() {
        let mut epochs = Epochs { last: ALWAYS_READY - 2 };
        assert_eq!(epochs.advance().unwrap(), ALWAYS_READY - 1);
        assert!(epochs.advance().is_err());
    }
}
