//! The fallback backend: a pool of std threads issuing `pread(2)`, fed by a
//! channel. Used where io_uring is unavailable (old kernels, seccomp sandboxes).

use std::io;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::backend::{Backend, ReadOp, ReadResult};

pub struct PreadBackend {
    ops: Option<Sender<ReadOp>>,
    results: Receiver<ReadResult>,
    workers: Vec<JoinHandle<()>>,
}

impl PreadBackend {
    /// Starts `threads` (at least 1) worker threads.
    pub fn new(threads: usize) -> io::Result<Self> {
        let (op_tx, op_rx) = channel::<ReadOp>();
        let (res_tx, res_rx) = channel::<ReadResult>();
        let op_rx = Arc::new(Mutex::new(op_rx));
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let op_rx = Arc::clone(&op_rx);
            let res_tx = res_tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("leanstream-pread-{i}"))
                .spawn(move || worker(&op_rx, &res_tx))?;
            workers.push(handle);
        }
        Ok(Self {
            ops: Some(op_tx),
            results: res_rx,
            workers,
        })
    }
}

fn worker(ops: &Mutex<Receiver<ReadOp>>, results: &Sender<ReadResult>) {
    loop {
        let op = {
            let Ok(rx) = ops.lock() else { return };
            match rx.recv() {
                Ok(op) => op,
                Err(_) => return,
            }
        };
        // SAFETY: the engine guarantees `buf` is valid for `len` bytes and ours
        // alone until this completion is delivered.
        let n = unsafe { libc::pread(op.fd, op.buf.cast(), op.len as usize, op.offset as libc::off_t) };
        let result = if n < 0 {
            -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
        } else {
            n as i32
        };
        if results.send(ReadResult { tag: op.tag, result }).is_err() {
            return;
        }
    }
}

impl Backend for PreadBackend {
    fn name(&self) -> String {
        format!("pread×{}", self.workers.len())
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        let tx = self
            .ops
            .as_ref()
            .ok_or_else(|| io::Error::other("pread backend shut down"))?;
        tx.send(op).map_err(|_| io::Error::other("pread workers gone"))
    }

    fn complete(&mut self, min: usize, out: &mut Vec<ReadResult>) -> io::Result<()> {
        for _ in 0..min {
            out.push(
                self.results
                    .recv()
                    .map_err(|_| io::Error::other("pread workers gone"))?,
            );
        }
        out.extend(self.results.try_iter());
        Ok(())
    }
}

impl Drop for PreadBackend {
    fn drop(&mut self) {
        self.ops = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
