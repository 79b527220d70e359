//! A streamed layer as the device engine runs it, with everything but the
//! device real: a packed model's bundles read from the file by the
//! runtime's streamer (its I/O thread, its neuron cache), landed slot by
//! slot (`leanstream_cuda::stream::feed`) while the emulated device polls
//! the flags and computes. The result must be the CPU engine's bits over
//! the neurons that landed in time, whatever the arrival order, the cache
//! (on the host, or mirrored on the device and read in place) and the
//! deadline.

use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leanstream_cuda::emulate::{self, cache_fill, stream_layer, EmulatedLanding, Staging, StreamLayer};
use leanstream_cuda::flags::{Epochs, FlagBoard};
use leanstream_cuda::stream::{feed, DeviceCache, Fed, SlotAddresses, SlotPlan};
use leanstream_kernels::sparse_ffn::{activations, axpy_down, FfnActivation, FfnInput, LayerActivations};
use leanstream_kernels::{ActBuffer, GgmlType};
use leanstream_runtime::engine::{
    BackendFactory, CachePolicy, Controller, EngineOptions, FlashEngine, FlashModel, Policy, Speculation, Streamer,
    Want,
};
use leanstream_runtime::flash::io::{make_backend, Backend, Fault, FaultyBackend, IoConfig};
use leanstream_runtime::flash::{pack, DownType, PackOptions, SparsityLevel};
use leanstream_runtime::model::{LayerAt, LayerHook};
use leanstream_runtime::predict::{Predictor, PredictorConfig};
use leanstream_runtime::synthetic::SyntheticSpec;

mod common;

use common::Rng;

const N_EMBD: usize = 256;
const N_FF: usize = 1024;
const N_LAYER: usize = 3;

fn model(name: &str) -> FlashModel {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("stream_emulated");
    std::fs::create_dir_all(&dir).unwrap();
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    (spec.n_embd, spec.n_ff, spec.n_layer) = (N_EMBD, N_FF, N_LAYER);
    let src = dir.join(format!("{name}.gguf"));
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let out = dir.join(format!("{name}.lsflash"));
    // Q8_0 down columns: the layout the streaming kernels read.
    let opts = PackOptions {
        down: DownType::Q8_0,
        ..PackOptions::default()
    };
    pack(&src, &out, &opts).unwrap();
    FlashModel::open(&out).unwrap()
}

/// The CPU engine's FFN output of layer `l` over the neurons `keep` says,
/// from the file's bundles: stage 1 by the blocked kernels, stage 2 in
/// ascending neuron id.
fn reference(fm: &FlashModel, l: usize, x: &ActBuffer, keep: impl Fn(usize) -> bool) -> Vec<f32> {
    reference_with(fm, l, x, 0, |i, _| keep(i))
}

/// [`reference`] of row `t` of `x`, keeping neuron `i` with activation `a`
/// where `keep(i, a)`.
fn reference_with(fm: &FlashModel, l: usize, x: &ActBuffer, t: usize, keep: impl Fn(usize, f32) -> bool) -> Vec<f32> {
    let format = fm.formats[l];
    let bb = format.bundle_bytes();
    let bytes = fm.flash.layer_by_neuron(l).unwrap();
    let input = FfnInput::new(&format, x, x, t).unwrap();
    let bundles: Vec<(usize, &[u8])> = (0..N_FF).map(|i| (i, &bytes[i * bb..(i + 1) * bb])).collect();
    let mut acts = LayerActivations::new(N_FF);
    let mut abs = vec![0.0; bundles.len()];
    activations(&format, &input, FfnActivation::Silu, &bundles, &mut acts, &mut abs).unwrap();
    let mut y = vec![0.0f32; N_EMBD];
    let offset = format.gate_bytes() + format.up_bytes();
    for (id, a) in acts.iter() {
        if a != 0.0 && keep(id, a) {
            axpy_down(format.down_ty, a, &bytes[id * bb + offset..(id + 1) * bb], &mut y).unwrap();
        }
    }
    y
}

fn input(rng: &mut Rng, ty: GgmlType) -> ActBuffer {
    let x = rng.floats(N_EMBD);
    let mut b = ActBuffer::with_capacity(N_EMBD, 1);
    b.quantize(ty, &x, 1, N_EMBD).unwrap();
    b
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One layer of one token: the stage asked for every neuron, one layer
/// read ahead; the emulated device computes while the host lands.
struct Layer {
    y: Vec<f32>,
    skipped: Vec<bool>,
    fed: Fed,
    plan: SlotPlan,
}

/// The emulated device's memory, kept across layers and tokens: staging
/// for one layer's slots, then (with a device cache) the cache's slots; a
/// flag per slot, then the one fixed at always-ready.
struct Device {
    staging: Staging,
    cells: Vec<AtomicU32>,
    cache: Option<DeviceCache>,
    epochs: Epochs,
}

impl Device {
    /// A device for `fm` streamed through `s`; `mirror`: the neuron cache
    /// is mirrored in device memory.
    fn new(fm: &FlashModel, s: &Streamer, mirror: bool) -> Self {
        let bb = fm.formats.iter().map(|f| f.bundle_bytes()).max().unwrap() as u64;
        let cache_slots = if mirror { s.cache_slots() } else { 0 };
        let cache_base = N_FF as u64 * bb;
        let cells: Vec<AtomicU32> = (0..=N_FF).map(|_| AtomicU32::new(0)).collect();
        FlagBoard::new(&cells).pin(N_FF).unwrap();
        Self {
            // Garbage until landed: a read that beats its write changes the bits.
            staging: Staging::new((cache_base + DeviceCache::bytes(cache_slots, bb)) as usize, 0xee),
            cells,
            cache: mirror.then(|| DeviceCache::new(cache_base, bb, N_FF as u64, cache_slots)),
            epochs: Epochs::new(),
        }
    }
}

/// Layer `l` of a token: every neuron with the next layer read ahead, or
/// only those `subset` has (a bitmap), asked for when the layer begins.
fn run_layer_of(
    fm: &FlashModel,
    s: &mut Streamer,
    dev: &mut Device,
    l: usize,
    x: &ActBuffer,
    deadline: Option<Duration>,
    subset: Option<&[u64]>,
) -> leanstream_cuda::Result<Layer> {
    let format = fm.formats[l];
    let bb = format.bundle_bytes();
    match subset {
        Some(bits) => s.ensure(l, Want::Set(bits))?,
        None => {
            s.ensure(l, Want::All)?;
            if l + 1 < N_LAYER {
                s.prefetch(l + 1, Want::All)?;
            }
        }
    }
    let at = SlotAddresses {
        staging: 0,
        flags: 0,
        flag_stride: 1,
    };
    let plan = SlotPlan::new(s, l, N_FF, bb, at, dev.cache.as_ref());
    // The last layer's bundles back to garbage, so a slot read before it
    // landed shows.
    // SAFETY: no warp runs and nothing lands between layers.
    unsafe { dev.staging.write(0, &vec![0xee; N_FF * bb])? };
    let board = FlagBoard::new(&dev.cells);
    let landing = EmulatedLanding {
        staging: &dev.staging,
        board: &board,
        epoch: dev.epochs.advance()?,
    };
    let layer = StreamLayer {
        format,
        input: FfnInput::new(&format, x, x, 0)?,
        act: FfnActivation::Silu,
        threshold: 0.0,
        keep: None,
    };
    let mut y = vec![0.0f32; N_EMBD];
    let host_deadline = deadline.map(|d| Instant::now() + d);
    let (stage1, fed) = stream_layer(
        &layer,
        &plan.slots,
        &plan.down_order(),
        &landing,
        deadline,
        3,
        &mut y,
        |to| feed(s, &plan, host_deadline, to),
    )?;
    if let Some(cache) = &mut dev.cache {
        // SAFETY: stage 2 has run and every landing is done.
        cache.fill(&plan, |fills| unsafe { cache_fill(&dev.staging, fills, bb) })?;
    }
    s.finish(l, l + 1 == N_LAYER);
    Ok(Layer {
        y,
        skipped: stage1.skipped,
        fed,
        plan,
    })
}

fn run_layer(
    fm: &FlashModel,
    s: &mut Streamer,
    dev: &mut Device,
    l: usize,
    x: &ActBuffer,
    deadline: Option<Duration>,
) -> leanstream_cuda::Result<Layer> {
    run_layer_of(fm, s, dev, l, x, deadline, None)
}

/// The file's reads with `faults` injected (by submission index), handed
/// out in a shuffled order when `shuffle` seeds one.
fn faulty(faults: Vec<(u64, Fault)>, shuffle: Option<u64>) -> BackendFactory {
    Box::new(move |cfg: &IoConfig| {
        let mut b = FaultyBackend::new(make_backend(cfg)?, faults);
        if let Some(seed) = shuffle {
            b = b.shuffled(seed, Duration::from_micros(300));
        }
        Ok(Box::new(b) as Box<dyn Backend>)
    })
}

/// A streamer of `fm` through a cache of `budget` bytes, its reads landing
/// in an order `shuffle` seeds (in submission order without one).
fn streamer(fm: &FlashModel, budget: u64, policy: CachePolicy, shuffle: Option<u64>) -> Streamer {
    let backend = faulty(Vec::new(), shuffle);
    Streamer::new(fm, budget, policy, None, 0, Some(256 << 10), Some(backend)).unwrap()
}

/// EIO, without a libc dependency for one constant.
const EIO: i32 = 5;

#[test]
fn streamed_layers_give_the_cpu_engines_bits_read_or_cached_in_any_arrival_order() {
    let fm = model("bits");
    let dot = fm.formats[0].gate_ty.vec_dot_type();
    let ffn_bytes = fm.ffn_bytes();
    // No cache; then 40% of the FFN in an LRU cache (hits from the token
    // before, the rest read), with reads landing shuffled and late.
    for (budget, seed) in [(0u64, None), (ffn_bytes * 2 / 5, Some(3u64))] {
        let mut s = streamer(&fm, budget, CachePolicy::Lru, seed);
        assert!(!s.holds_whole());
        let (mut dev, mut rng) = (Device::new(&fm, &s, false), Rng(11));
        let mut hits = 0;
        for token in 0..3 {
            for l in 0..N_LAYER {
                let x = input(&mut rng, dot);
                let r = run_layer(&fm, &mut s, &mut dev, l, &x, None).unwrap();
                let what = format!("budget {budget}, token {token}, layer {l}");
                assert_eq!(r.plan.slots.len(), N_FF, "{what}");
                assert!(
                    r.skipped.iter().all(|&k| !k),
                    "{what}: nothing skipped without a deadline"
                );
                assert_eq!(
                    (r.fed.in_place, r.fed.hits + r.fed.read, r.fed.missing),
                    (0, N_FF, 0),
                    "{what}: {:?}",
                    r.fed
                );
                assert_eq!(bits(&r.y), bits(&reference(&fm, l, &x, |_| true)), "{what}");
                hits += r.fed.hits;
            }
        }
        assert_eq!(hits > 0, budget > 0, "budget {budget}: {hits} hits");
    }
}

#[test]
fn the_device_cache_reads_a_static_hot_set_in_place_from_the_second_token_on() {
    let fm = model("device_cache_hot");
    let dot = fm.formats[0].gate_ty.vec_dot_type();
    let budget = fm.ffn_bytes() * 2 / 5;
    let mut s = streamer(&fm, budget, CachePolicy::Hot, Some(5));
    let (mut dev, mut rng) = (Device::new(&fm, &s, true), Rng(13));
    let mut first_hits = [0usize; N_LAYER];
    for token in 0..3 {
        for (l, first) in first_hits.iter_mut().enumerate() {
            let x = input(&mut rng, dot);
            let r = run_layer(&fm, &mut s, &mut dev, l, &x, None).unwrap();
            let what = format!("token {token}, layer {l}: {:?}", r.fed);
            assert_eq!(
                (r.fed.in_place + r.fed.hits + r.fed.read, r.fed.missing),
                (N_FF, 0),
                "{what}"
            );
            assert_eq!(r.plan.in_place.iter().filter(|&&h| h).count(), r.fed.in_place, "{what}");
            assert_eq!(bits(&r.y), bits(&reference(&fm, l, &x, |_| true)), "{what}");
            if token == 0 {
                // Nothing is on the device yet: each hit crosses the bus once.
                assert_eq!(r.fed.in_place, 0, "{what}");
                assert!(r.fed.hits > 0, "{what}");
                *first = r.fed.hits;
            } else {
                // The same hits, now all read in place.
                assert_eq!((r.fed.in_place, r.fed.hits), (*first, 0), "{what}");
            }
        }
    }
}

#[test]
fn the_device_cache_stays_exact_while_the_host_cache_gives_its_slots_to_other_bundles() {
    let fm = model("device_cache_lru");
    let dot = fm.formats[0].gate_ty.vec_dot_type();
    // An LRU cache of 70% of the FFN, and each token a different 60% of
    // each layer's neurons: many bundles are hits again, while others are
    // evicted and their slots reused, so a device copy used after its host
    // slot moved on to another bundle (or before it was filled) would
    // change the bits.
    let budget = fm.ffn_bytes() * 7 / 10;
    let mut s = streamer(&fm, budget, CachePolicy::Lru, Some(9));
    let (mut dev, mut rng) = (Device::new(&fm, &s, true), Rng(17));
    let (mut in_place, mut landed_hits, mut taken_over) = (0, 0, 0);
    for token in 0..8 {
        for l in 0..N_LAYER {
            let mut subset = vec![0u64; N_FF / 64];
            for i in 0..N_FF {
                if rng.below(10) < 6 {
                    subset[i / 64] |= 1 << (i % 64);
                }
            }
            let wanted = |i: usize| subset[i / 64] >> (i % 64) & 1 == 1;
            let x = input(&mut rng, dot);
            let cache = dev.cache.as_ref().unwrap();
            let before: Vec<_> = (0..s.cache_slots()).map(|k| cache.held(k)).collect();
            let r = run_layer_of(&fm, &mut s, &mut dev, l, &x, None, Some(&subset)).unwrap();
            let cache = dev.cache.as_ref().unwrap();
            taken_over += (0..s.cache_slots())
                .filter(|&k| before[k].is_some() && cache.held(k) != before[k])
                .count();
            let what = format!("token {token}, layer {l}: {:?}", r.fed);
            let n = (0..N_FF).filter(|&i| wanted(i)).count();
            assert_eq!(
                (r.fed.in_place + r.fed.hits + r.fed.read, r.fed.missing),
                (n, 0),
                "{what}"
            );
            assert_eq!(bits(&r.y), bits(&reference(&fm, l, &x, wanted)), "{what}");
            in_place += r.fed.in_place;
            landed_hits += r.fed.hits;
        }
    }
    // Device slots that went from one bundle to another: what the test is for.
    assert!(
        in_place > 0 && landed_hits > 0 && taken_over > 0,
        "in place {in_place}, hits landed from the host {landed_hits}, device slots taken over {taken_over}"
    );
}

#[test]
fn a_stalled_read_is_skipped_at_the_deadline_and_the_rest_is_exact() {
    let fm = model("deadline");
    let dot = fm.formats[0].gate_ty.vec_dot_type();
    // Layer 0's second read stalls far past the deadline.
    let backend = faulty(vec![(1, Fault::Stall(Duration::from_secs(3)))], None);
    let mut s = Streamer::new(&fm, 0, CachePolicy::Lru, None, 0, Some(256 << 10), Some(backend)).unwrap();
    let mut dev = Device::new(&fm, &s, false);
    let x = input(&mut Rng(5), dot);
    let r = run_layer(&fm, &mut s, &mut dev, 0, &x, Some(Duration::from_millis(300))).unwrap();
    assert!(r.fed.missing > 0, "{:?}", r.fed);
    let skipped: Vec<usize> = (0..r.skipped.len()).filter(|&k| r.skipped[k]).collect();
    // A slot the host did not land is skipped; one it landed after the
    // device's deadline may be too (late flags do not count).
    assert!(skipped.len() >= r.fed.missing, "{} skipped, {:?}", skipped.len(), r.fed);
    let kept = |i: usize| !r.skipped[r.plan.slots.iter().position(|s| s.neuron as usize == i).unwrap()];
    assert_eq!(bits(&r.y), bits(&reference(&fm, 0, &x, kept)));
}

#[test]
fn a_failed_read_is_an_error_naming_the_file_and_the_device_is_let_go() {
    let fm = model("failed");
    let dot = fm.formats[0].gate_ty.vec_dot_type();
    let backend = faulty(vec![(1, Fault::Errno(EIO))], None);
    let mut s = Streamer::new(&fm, 0, CachePolicy::Lru, None, 0, Some(256 << 10), Some(backend)).unwrap();
    let mut dev = Device::new(&fm, &s, false);
    let x = input(&mut Rng(6), dot);
    // No deadline: without the release of every slot the emulated warps
    // would poll forever and this would hang.
    let err = match run_layer(&fm, &mut s, &mut dev, 0, &x, None) {
        Ok(_) => panic!("a failed read must fail the layer"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("failed.lsflash"), "{err}");
}

/// The file's reads handed out in an order `seed` shuffles.
fn shuffled(seed: u64) -> BackendFactory {
    faulty(Vec::new(), Some(seed))
}

/// An engine of `policy` over `fm`: a quarter of the FFN cached, these
/// thresholds, a random predictor and a one-stage controller without a
/// deadline (the device does not refine between stages, and the CPU's
/// deadline comes from its own compute time).
fn policy_engine(fm: &FlashModel, policy: Policy, level: &SparsityLevel, seed: u64) -> FlashEngine {
    let c = &fm.model.config;
    let cfg = PredictorConfig::hashing(c.n_embd, c.n_ff, 1, c.n_layer, 32, 16, 8, 2);
    let predictor = Predictor::random(cfg, &["speculate", "refine"], 7).unwrap();
    let cache_policy = if policy == Policy::PowerInfer2 {
        CachePolicy::Hot
    } else {
        CachePolicy::Lru
    };
    let opts = EngineOptions {
        policy,
        cache_bytes: fm.ffn_bytes() / 4,
        cache_policy,
        merge_gap_bytes: 0,
        staging_bytes: Some(256 << 10),
        level: level.clone(),
        record: false,
        trace: None,
        speculation: Some(Speculation {
            predictor: Arc::new(predictor),
            predictor_name: "random.lspred".into(),
            controller: Controller::parse_fixed("fixed:K=1,b=1.5,d=inf,q=16").unwrap(),
            prior_breadth: Speculation::PRIOR_BREADTH,
        }),
        retention: None,
    };
    fm.engine_on(opts, Some(shuffled(seed))).unwrap()
}

/// One layer of one token through the emulated device under `e`'s policy.
struct PolicyLayer {
    y: Vec<f32>,
    /// Slots (neurons the streamer was asked for), and activations kept.
    slots: usize,
    kept: usize,
    /// What the CPU's tail would compute from the same streamer: the
    /// available bundles' output, kept by the plan's rule.
    tail: Vec<f32>,
}

/// The policy plans from the `n` rows, the device keeps what the plan
/// says: the first row computes while the bundles land, the others after
/// (as the device engine launches them).
fn device_layer(
    fm: &FlashModel,
    e: &mut FlashEngine,
    dev: &mut Device,
    l: usize,
    n: usize,
    resid: &[f32],
    xb: &[f32],
) -> PolicyLayer {
    let format = fm.formats[l];
    let bb = format.bundle_bytes();
    let call = e.plan_device_call(l, n, resid, xb).unwrap();
    let at = SlotAddresses {
        staging: 0,
        flags: 0,
        flag_stride: 1,
    };
    let plan = SlotPlan::new(e.streamer().unwrap(), l, N_FF, bb, at, None);
    let board = FlagBoard::new(&dev.cells);
    let landing = EmulatedLanding {
        staging: &dev.staging,
        board: &board,
        epoch: dev.epochs.advance().unwrap(),
    };
    let x = {
        let mut b = ActBuffer::with_capacity(N_EMBD, n);
        b.quantize(format.gate_ty.vec_dot_type(), xb, n, N_EMBD).unwrap();
        b
    };
    let row = |t: usize| StreamLayer {
        format,
        input: FfnInput::new(&format, &x, &x, t).unwrap(),
        act: FfnActivation::Silu,
        threshold: call.threshold,
        keep: call.row(t),
    };
    let layer = row(0);
    let mut y = vec![0.0f32; n * N_EMBD];
    let deadline = call.deadline;
    let streamer = e.streamer_mut().unwrap();
    let (stage1, fed) = stream_layer(
        &layer,
        &plan.slots,
        &plan.down_order(),
        &landing,
        // A slot never landed fails the comparison instead of hanging.
        Some(Duration::from_secs(20)),
        3,
        &mut y[..N_EMBD],
        |to| feed(streamer, &plan, deadline, to),
    )
    .unwrap();
    // No deadline: every slot lands (reads the policy cancelled, as zeros).
    assert!(
        !stage1.skipped.contains(&true),
        "layer {l}: the device waited out its deadline"
    );
    assert_eq!(fed.missing, 0, "layer {l}: {fed:?}");
    let mut kept = stage1.act.iter().filter(|&&a| a != 0.0).count();
    for t in 1..n {
        let s1 = emulate::activations(&row(t), &plan.slots, landing.epoch, &board, &dev.staging, None, 3).unwrap();
        let y = &mut y[t * N_EMBD..(t + 1) * N_EMBD];
        emulate::down(&format, &plan.slots, &plan.down_order(), &s1.act, &dev.staging, y).unwrap();
        kept += s1.act.iter().filter(|&&a| a != 0.0).count();
    }
    let mut have = vec![0u64; N_FF / 64];
    e.streamer().unwrap().available(l, &mut have).unwrap();
    let tail = (0..n)
        .flat_map(|t| {
            reference_with(fm, l, &x, t, |i, a| {
                have[i / 64] >> (i % 64) & 1 == 1 && call.keeps(t, i, a)
            })
        })
        .collect();
    e.finish_device_call(l);
    PolicyLayer {
        y,
        slots: plan.slots.len(),
        kept,
        tail,
    }
}

#[test]
fn every_streaming_policy_keeps_on_the_emulated_device_what_it_keeps_on_the_cpu() {
    let fm = model("policies");
    // Thresholds that drop part of each layer (checked below), for both
    // criteria: |act(g)·u| and, for gate-first, |act(g)|.
    let level = SparsityLevel {
        sparsity: 0.5,
        full: vec![4e-3; N_LAYER],
        gate: vec![4e-2; N_LAYER],
    };
    let policies = [
        Policy::DenseStream,
        Policy::GateFirst,
        Policy::Speculate,
        Policy::DejaVu,
        Policy::LlmInAFlash,
        Policy::PowerInfer2,
    ];
    for (k, policy) in policies.into_iter().enumerate() {
        // The two engines' reads land in different shuffled orders.
        let mut cpu = policy_engine(&fm, policy, &level, 2 * k as u64 + 1);
        // The device computes what was asked for, not what reads span.
        cpu.streamer_mut().unwrap().ignore_spans();
        let mut on_device = policy_engine(&fm, policy, &level, 2 * k as u64 + 2);
        assert_eq!(on_device.reads_rows(), policy.predicts() || policy == Policy::GateFirst);
        let mut dev = Device::new(&fm, on_device.streamer().unwrap(), false);
        let mut rng = Rng(31 + k as u64);
        let (mut asked, mut kept) = (0, 0);
        // A prompt of 3 rows (each row keeps its own set: gate-first's
        // row bitmaps), then two decode steps.
        for (pos0, n) in [(0, 3), (3, 1), (4, 1)] {
            for l in 0..N_LAYER {
                let floats = |rng: &mut Rng| rng.floats(n * N_EMBD);
                let (x, resid, xb) = (floats(&mut rng), floats(&mut rng), floats(&mut rng));
                let at = LayerAt {
                    layer: l,
                    rows: 0..n,
                    pos0,
                };
                cpu.layer_input(&at, &x);
                on_device.device_layer_input(l, &x, n).unwrap();
                let mut want = vec![0.0f32; n * N_EMBD];
                cpu.ffn(&at, &resid, &xb, &mut want).unwrap();
                let r = device_layer(&fm, &mut on_device, &mut dev, l, n, &resid, &xb);
                let token = pos0;
                let what = format!("{policy}, token {token}, layer {l}");
                // What the CPU's tail computes from the device engine's own
                // streamer, whatever landed.
                assert_eq!(bits(&r.y), bits(&r.tail), "{what}");
                // Refinement cancels reads not yet submitted, so what
                // `speculate` gets depends on I/O timing; the others decide
                // the same whatever the timing, and give the CPU's bits.
                if policy != Policy::Speculate {
                    assert_eq!(bits(&r.y), bits(&want), "{what}");
                }
                // Per row, as `kept` counts.
                (asked, kept) = (asked + n * r.slots, kept + r.kept);
            }
        }
        // Not vacuous: every policy drops neurons; those that decide from
        // the rows read fewer than all, the others drop by the threshold.
        let all = 5 * N_LAYER * N_FF;
        assert!(kept > 0 && kept < all, "{policy}: kept {kept} of {all}");
        if on_device.reads_rows() {
            assert!(asked < all, "{policy}: asked for {asked} of {all}");
        } else {
            assert!(kept < asked, "{policy}: kept {kept} of {asked}");
        }
        assert_eq!(cpu.stats().tokens, on_device.stats().tokens, "{policy}");
        // The controller took an action for every layer it ranked.
        if policy == Policy::Speculate {
            let d = on_device.decisions().unwrap();
            let taken: u64 = d.actions.iter().map(|a| a.layers).sum();
            assert!(taken >= 3 * N_LAYER as u64, "{d:?}");
        }
    }
}

#[test]
fn a_device_call_is_refused_where_the_policy_cannot_run_there() {
    let fm = model("device_call_refused");
    let level = SparsityLevel::dense(N_LAYER);
    // A predicting policy needs the layer's rows.
    let mut e = policy_engine(&fm, Policy::DejaVu, &level, 1);
    let err = e.plan_device_call(0, 1, &[], &[]).unwrap_err().to_string();
    assert!(err.contains("dejavu") && err.contains("rows"), "{err}");
    // The dense policy holds its bundles in memory: nothing to stream.
    let mut e = policy_engine(&fm, Policy::Dense, &level, 1);
    let err = e.plan_device_call(0, 1, &[], &[]).unwrap_err().to_string();
    assert!(err.contains("in memory"), "{err}");
    assert!(e.streamer().is_none());
}
