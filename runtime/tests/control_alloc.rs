//! `ControlTable::lookup` does not allocate (a counting global allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use leanstream_runtime::control::{Action, Axis, AxisKind, ControlState, ControlTable, Provenance};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn lookup_does_not_allocate() {
    let kinds = [
        AxisKind::QueuedBytes,
        AxisKind::MissingBytes,
        AxisKind::ReadBandwidth,
        AxisKind::ComputeNsPerNeuron,
        AxisKind::LayerPosition,
    ];
    let axes: Vec<Axis> = kinds
        .iter()
        .map(|&kind| Axis {
            kind,
            thresholds: vec![1.0, 2.0, 3.0],
            centers: vec![0.5, 1.5, 2.5, 3.5],
        })
        .collect();
    let table = ControlTable {
        provenance: Provenance::default(),
        codes: (0..4usize.pow(5)).map(|i| (i % 3) as u8).collect(),
        axes,
        // Distinct depths, so the sum below depends on which actions were found.
        codebook: (0..3)
            .map(|i| Action {
                stages: 1,
                queue_depth: 4 << i,
                prefetch_breadth: 1.0,
                deadline_factor: 2.0,
            })
            .collect(),
    };
    let states: Vec<ControlState> = (0..64)
        .map(|i| ControlState {
            queued_bytes: i as f64 * 0.07,
            missing_bytes: i as f64 * 0.05,
            read_bw_bytes_s: 4.0 - i as f64 * 0.06,
            compute_ns_per_neuron: (i % 5) as f64,
            layer_position: i as f64 / 64.0,
        })
        .collect();
    let want: u32 = states
        .iter()
        .map(|s| table.codebook[table.codes[table.state_index(s)] as usize].queue_depth as u32)
        .sum();
    let before = ALLOCS.load(Ordering::SeqCst);
    let mut acc = 0u32;
    for s in &states {
        acc += table.lookup(std::hint::black_box(s)).queue_depth as u32;
    }
    let after = ALLOCS.load(Ordering::SeqCst);
    assert_eq!(acc, want);
    assert!(
        acc != 4 * 64 && acc != 16 * 64,
        "the states cover more than one action: {acc}"
    );
    assert_eq!(after, before, "lookup allocated");
}
