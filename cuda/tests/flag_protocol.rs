//! The streaming FFN's hand-off, host side against the CPU emulation of the
//! device kernels: storage workers write bundles in any order and publish
//! flags; the emulated warps compute exactly the published slots, skip the
//! rest at the deadline, and stage 2's sum does not depend on arrival order.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use leanstream_cuda::emulate::{activations, down, Staging, StreamLayer};
use leanstream_cuda::flags::{down_order, Epochs, FlagBoard, Slot};
use leanstream_kernels::sparse_ffn::{
    activations as cpu_activations, axpy_down, BundleFormat, DownLayout, FfnActivation, FfnInput, LayerActivations,
};
use leanstream_kernels::{ActBuffer, GgmlType};

mod common;

use common::{random_bundles, Rng};

const N_EMBD: usize = 64;
const N_FF: usize = 48;

struct Layer {
    format: BundleFormat,
    bundles: Vec<Vec<u8>>,
    input: ActBuffer,
}

fn layer(seed: u64) -> Layer {
    let format = BundleFormat::new(
        GgmlType::Q4_0,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        DownLayout::Columns,
        N_EMBD,
    )
    .unwrap();
    let mut rng = Rng(seed);
    let bundles = random_bundles(&mut rng, N_EMBD, N_FF);
    let x: Vec<f32> = (0..N_EMBD).map(|_| rng.float()).collect();
    let mut input = ActBuffer::with_capacity(N_EMBD, 1);
    input.quantize(GgmlType::Q8_0, &x, 1, N_EMBD).unwrap();
    Layer { format, bundles, input }
}

/// The CPU engine's result over `neurons`: stage 1 then stage 2 in ascending id.
fn reference(l: &Layer, neurons: &[usize]) -> Vec<f32> {
    let input = FfnInput::new(&l.format, &l.input, &l.input, 0).unwrap();
    let bundles: Vec<(usize, &[u8])> = neurons.iter().map(|&n| (n, l.bundles[n].as_slice())).collect();
    let mut acts = LayerActivations::new(N_FF);
    let mut abs = vec![0.0; bundles.len()];
    cpu_activations(&l.format, &input, FfnActivation::Silu, &bundles, &mut acts, &mut abs).unwrap();
    let mut y = vec![0.0f32; N_EMBD];
    let offset = l.format.gate_bytes() + l.format.up_bytes();
    for (id, a) in acts.iter() {
        if a != 0.0 {
            axpy_down(l.format.down_ty, a, &l.bundles[id][offset..], &mut y).unwrap();
        }
    }
    y
}

/// Slots for `neurons` in request order, bundle `i` at staging slot `i`,
/// flag `i`.
fn slots(l: &Layer, neurons: &[usize]) -> Vec<Slot> {
    neurons
        .iter()
        .enumerate()
        .map(|(i, &n)| Slot {
            bundle: (i * l.format.bundle_bytes()) as u64,
            flag: i as u64,
            neuron: n as u32,
            pad: 0,
        })
        .collect()
}

/// Runs one layer: a storage thread writes and publishes the slots in
/// `arrival` (with a pause before each), while the emulated device computes.
fn run(
    l: &Layer,
    slots: &[Slot],
    arrival: &[usize],
    pause: Duration,
    deadline: Option<Duration>,
) -> (Vec<f32>, Vec<bool>) {
    let cells: Vec<AtomicU32> = slots.iter().map(|_| AtomicU32::new(0)).collect();
    let board = FlagBoard::new(&cells);
    let mut epochs = Epochs::new();
    // An earlier layer left its flags behind: they must not count.
    let stale = epochs.advance().unwrap();
    for i in 0..slots.len() {
        board.publish(i, stale).unwrap();
    }
    let epoch = epochs.advance().unwrap();
    // Garbage until written: a read that beats its write changes the result.
    let staging = Staging::new(slots.len() * l.format.bundle_bytes(), 0xee);
    let input = FfnInput::new(&l.format, &l.input, &l.input, 0).unwrap();
    let layer = StreamLayer {
        format: l.format,
        input,
        act: FfnActivation::Silu,
        threshold: 0.0,
        keep: None,
    };
    let stage1 = std::thread::scope(|scope| {
        scope.spawn(|| {
            for &i in arrival {
                std::thread::sleep(pause);
                let s = &slots[i];
                // SAFETY: slot i is written once, before its flag is published.
                unsafe { staging.write(s.bundle, &l.bundles[s.neuron as usize]).unwrap() };
                board.publish(s.flag as usize, epoch).unwrap();
            }
        });
        activations(&layer, slots, epoch, &board, &staging, deadline, 3).unwrap()
    });
    let mut y = vec![0.0f32; N_EMBD];
    down(&l.format, slots, &down_order(slots), &stage1.act, &staging, &mut y).unwrap();
    (y, stage1.skipped)
}

#[test]
fn any_arrival_order_gives_the_cpu_engines_bits() {
    let l = layer(7);
    let mut rng = Rng(99);
    // Requested in a predictor's priority order, not by id.
    let mut neurons: Vec<usize> = (0..N_FF).collect();
    for i in (1..N_FF).rev() {
        neurons.swap(i, rng.below(i + 1));
    }
    neurons.truncate(N_FF * 3 / 4);
    let slots = slots(&l, &neurons);
    let expected = reference(&l, &neurons);
    for trial in 0..8 {
        let mut arrival: Vec<usize> = (0..slots.len()).collect();
        for i in (1..arrival.len()).rev() {
            arrival.swap(i, rng.below(i + 1));
        }
        let pause = Duration::from_micros(if trial % 2 == 0 { 0 } else { 200 });
        let (y, skipped) = run(&l, &slots, &arrival, pause, None);
        assert!(
            skipped.iter().all(|&s| !s),
            "trial {trial}: nothing may be skipped without a deadline"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y), bits(&expected), "trial {trial}: arrival {arrival:?}");
    }
}

#[test]
fn slots_missing_at_the_deadline_are_skipped_and_late_ones_do_not_count() {
    let l = layer(11);
    let neurons: Vec<usize> = (0..N_FF).collect();
    let slots = slots(&l, &neurons);
    // Two thirds land at once; the rest come long after the deadline.
    let on_time: Vec<usize> = (0..N_FF).filter(|i| i % 3 != 1).collect();
    let late: Vec<usize> = (0..N_FF).filter(|i| i % 3 == 1).collect();
    let cells: Vec<AtomicU32> = slots.iter().map(|_| AtomicU32::new(0)).collect();
    let board = FlagBoard::new(&cells);
    let epoch = Epochs::new().advance().unwrap();
    let staging = Staging::new(N_FF * l.format.bundle_bytes(), 0xee);
    for &i in &on_time {
        // SAFETY: written once, before its flag.
        unsafe { staging.write(slots[i].bundle, &l.bundles[i]).unwrap() };
        board.publish(i, epoch).unwrap();
    }
    let input = FfnInput::new(&l.format, &l.input, &l.input, 0).unwrap();
    let layer = StreamLayer {
        format: l.format,
        input,
        act: FfnActivation::Silu,
        threshold: 0.0,
        keep: None,
    };
    let stage1 = activations(
        &layer,
        &slots,
        epoch,
        &board,
        &staging,
        Some(Duration::from_millis(30)),
        2,
    )
    .unwrap();
    // The late bundles land now; stage 2 must not read them.
    for &i in &late {
        // SAFETY: the kernel is done with this epoch's stage 1.
        unsafe { staging.write(slots[i].bundle, &l.bundles[i]).unwrap() };
        board.publish(i, epoch).unwrap();
    }
    let skipped: Vec<usize> = (0..N_FF).filter(|&i| stage1.skipped[i]).collect();
    assert_eq!(skipped, late);
    assert!(late.iter().all(|&i| stage1.act[i] == 0.0));
    let mut y = vec![0.0f32; N_EMBD];
    down(&l.format, &slots, &down_order(&slots), &stage1.act, &staging, &mut y).unwrap();
    assert_eq!(y, reference(&l, &on_time));
}

#[test]
fn bad_slot_tables_are_errors_not_panics() {
    let l = layer(3);
    let cells: Vec<AtomicU32> = (0..2).map(|_| AtomicU32::new(u32::MAX)).collect();
    let board = FlagBoard::new(&cells);
    let staging = Staging::new(l.format.bundle_bytes(), 0);
    let input = FfnInput::new(&l.format, &l.input, &l.input, 0).unwrap();
    let layer = StreamLayer {
        format: l.format,
        input,
        act: FfnActivation::Silu,
        threshold: 0.0,
        keep: None,
    };
    let mut slots = slots(&l, &[0]);
    slots[0].bundle = 1; // runs past the staging buffer
    let err = activations(&layer, &slots, 1, &board, &staging, None, 2).unwrap_err();
    assert!(err.to_string().contains("outside a buffer"), "{err}");
    slots[0].bundle = 0;
    slots[0].flag = 5;
    let err = activations(&layer, &slots, 1, &board, &staging, None, 2).unwrap_err();
    assert!(err.to_string().contains("flag 5 of a board of 2"), "{err}");
    let mut y = vec![0.0f32; N_EMBD];
    let err = down(&l.format, &slots, &[3], &[1.0], &staging, &mut y).unwrap_err();
    assert!(err.to_string().contains("order names slot 3"), "{err}");
}
