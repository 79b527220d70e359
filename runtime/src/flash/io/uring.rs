//! The io_uring backend: one ring per engine, sized to the in-flight limit.

use std::io;

use io_uring::{opcode, types, IoUring};

use super::backend::{Backend, ReadOp, ReadResult};

pub struct UringBackend {
    ring: IoUring,
    queued: usize,
    /// The engine's buffers are registered: reads go in as `ReadFixed`.
    fixed: bool,
}

impl UringBackend {
    /// Creates a ring with room for `depth` reads and checks that it really
    /// works (a sandbox may let `io_uring_setup` through yet refuse to enter).
    pub fn new(depth: u32) -> io::Result<Self> {
        let ring = IoUring::new(depth.max(2).next_power_of_two())?;
        let mut this = Self {
            ring,
            queued: 0,
            fixed: false,
        };
        let nop = opcode::Nop::new().build().user_data(u64::MAX);
        // SAFETY: a NOP references no memory.
        unsafe { this.ring.submission().push(&nop) }.map_err(|_| io::Error::other("io_uring queue full"))?;
        submit_and_wait(&this.ring, 1)?;
        let mut got = false;
        for cqe in this.ring.completion() {
            got |= cqe.user_data() == u64::MAX;
        }
        if !got {
            return Err(io::Error::other("io_uring NOP did not complete"));
        }
        Ok(this)
    }
}

fn submit_and_wait(ring: &IoUring, want: usize) -> io::Result<usize> {
    loop {
        match ring.submit_and_wait(want) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

impl Backend for UringBackend {
    fn name(&self) -> String {
        "io_uring".to_string()
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        let entry = if self.fixed {
            // The engine's promise: the read lies inside registered buffer `tag`.
            opcode::ReadFixed::new(types::Fd(op.fd), op.buf, op.len, op.tag as u16)
                .offset(op.offset)
                .build()
        } else {
            opcode::Read::new(types::Fd(op.fd), op.buf, op.len)
                .offset(op.offset)
                .build()
        }
        .user_data(op.tag);
        if self.ring.submission().is_full() {
            submit_and_wait(&self.ring, 0)?;
        }
        // SAFETY: the caller guarantees the buffer outlives the read.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        self.queued += 1;
        Ok(())
    }

    unsafe fn register_buffers(&mut self, base: *mut u8, count: usize, size: usize) -> bool {
        // The kernel takes at most 16,384 buffers; pinned memory counts
        // against RLIMIT_MEMLOCK, so a refusal just keeps plain reads.
        if count > 1 << 14 || self.fixed {
            return false;
        }
        let iovecs: Vec<libc::iovec> = (0..count)
            .map(|i| libc::iovec {
                // SAFETY: buffer i lies inside the caller's allocation.
                iov_base: unsafe { base.add(i * size) }.cast(),
                iov_len: size,
            })
            .collect();
        // SAFETY: the caller keeps the memory valid and in place while we live.
        self.fixed = unsafe { self.ring.submitter().register_buffers(&iovecs) }.is_ok();
        self.fixed
    }

    fn complete(&mut self, min: usize, out: &mut Vec<ReadResult>) -> io::Result<()> {
        // Completions already in the queue count towards `min`.
        let want = min.saturating_sub(self.ring.completion().len());
        submit_and_wait(&self.ring, want)?;
        self.queued = 0;
        for cqe in self.ring.completion() {
            out.push(ReadResult {
                tag: cqe.user_data(),
                result: cqe.result(),
            });
        }
        Ok(())
    }
}
