//! The flash engine allocates nothing per layer call once warm: the compute
//! thread's allocations over many decode steps stay at zero, for the resident
//! and the streaming tails (the I/O thread's bookkeeping is its own).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use leanstream_kernels::GgmlType;
use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::engine::{FlashModel, Policy};
use leanstream_runtime::flash::{pack, DownType, PackOptions};
use leanstream_runtime::synthetic::SyntheticSpec;

/// Counts allocations per thread.
struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(|c| c.get())
}

#[test]
fn no_allocation_per_layer_call_when_warm() {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q4_0;
    (spec.n_embd, spec.n_ff) = (128, 512);
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine_alloc");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("m.gguf");
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let out = dir.join("m.lsflash");
    let opts = PackOptions {
        down: DownType::Q8_0,
        ..PackOptions::default()
    };
    pack(&src, &out, &opts).unwrap();
    let fm = FlashModel::open(&out).unwrap();
    // One thread: the calling thread does all compute, so its count is the engine's.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for (policy, budget) in [
        (Policy::Dense, 100.0),
        (Policy::DenseStream, 0.0),
        (Policy::DenseStream, 50.0),
    ] {
        let mut e = fm.engine(policy, FfnBudget::Percent(budget)).unwrap();
        let mut st = fm.model.new_state(64, 8, 1);
        pool.install(|| {
            fm.forward(&mut st, &mut e, &[1, 2, 3, 4], 0, 3..4).unwrap();
            for pos in 4..8 {
                fm.forward(&mut st, &mut e, &[5], pos, 0..1).unwrap();
            }
            let before = allocs();
            for pos in 8..40 {
                fm.forward(&mut st, &mut e, &[(pos % 200) as u32 + 3], pos, 0..1)
                    .unwrap();
                fm.model.logits(&mut st, 0, 1).unwrap();
            }
            let n = allocs() - before;
            assert_eq!(n, 0, "{policy} at {budget}%: {n} allocations over 32 decode steps");
        });
    }
}
