//! The CUDA kernels against the CPU kernels, on a GPU where one is present
//! (`cargo test -p leanstream-cuda --test device`). Without a device every
//! test but the first prints SKIPPED: opening the device is then an
//! ordinary error, which the first test checks on every machine.
//!
//! Exact where the arithmetic is the same operations (activation
//! quantization, RoPE, the gated activations, dequantization, attention by
//! each of the CPU's routes); within a bound from the sum of |terms| where
//! only the order of float adds differs (matrix products, norms, the
//! streaming FFN).

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::f16;
use leanstream_cuda::device::{blocks_of, grid_1d, AttentionAt, AttentionHeads, DevPtr, Gpu, Keep, StreamInput};
use leanstream_cuda::flags::Slot;
use leanstream_cuda::order::CpuOrder;
use leanstream_cuda::CudaError;
use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::flash_attn::{self, KvHead, Route, Tile};
use leanstream_kernels::ops;
use leanstream_kernels::quantize::quantize_row;
use leanstream_kernels::sparse_ffn::{axpy_down, neuron_activation, BundleFormat, DownLayout, FfnActivation, FfnInput};
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};
use leanstream_runtime::engine::keeps;

mod common;

use common::{random_bundles, weights, Rng, GPU_WEIGHT_TYPES};

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => {
            eprintln!("{} (compute {:?}, {})", g.name, g.compute_capability, g.arch);
            Some(g)
        }
        Err(CudaError::NoDevice(why)) => {
            eprintln!("SKIPPED: no CUDA device ({why})");
            None
        }
        // A device is there but the kernels do not build or load: a failure.
        Err(e) => panic!("{e}"),
    }
}

/// `|a - b| <= rel * scale + 1e-6` for each pair, `scale` per element.
fn close(what: &str, got: &[f32], want: &[f32], scale: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (g - w).abs() <= rel * s + 1e-6,
            "{what}[{i}]: GPU {g}, CPU {w} (scale {s})"
        );
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn opening_a_missing_device_is_an_error_not_a_panic() {
    match Gpu::open(1 << 20) {
        Err(CudaError::NoDevice(why)) => eprintln!("as expected: {why}"),
        Ok(g) => panic!("device 2^20 opened: {}", g.name),
        Err(e) => panic!("expected NoDevice, got {e}"),
    }
}

#[test]
fn activation_quantization_is_the_cpus_bit_for_bit() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(1);
    let n = 4096;
    let mut x = rng.floats(n);
    x[256..512].iter_mut().for_each(|v| *v = 0.0); // an all-zero super-block
    x[600] = -x[601].abs() - 0.5; // a negative extreme
    let dx = g.upload(&x).unwrap();
    for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K, GgmlType::F16] {
        let bytes = ty.row_bytes(n).unwrap();
        let mut want = vec![0u8; bytes];
        quantize_row(ty, &x, &mut want).unwrap();
        let mut out = g.zeros::<u8>(bytes).unwrap();
        g.quantize(ty, &dx, n, &mut out).unwrap();
        assert_eq!(g.download(&out).unwrap(), want, "{ty}");
    }
}

#[test]
fn matvec_matches_the_cpu_matmul_for_every_weight_type() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(2);
    let cols = 512;
    for ty in GPU_WEIGHT_TYPES {
        // 72 rows (Q4_K repacked) and 68 (not); 1 token (decode), 5 (the
        // repacked gemm and gemv), 11 (tiled K-quants; two launches' worth
        // of grid.y).
        for (rows, n) in [(72usize, 1usize), (72, 5), (72, 11), (68, 1), (68, 11)] {
            let w = weights(ty, rows, cols, &mut rng);
            let x = rng.floats(n * cols);
            let mut acts = ActBuffer::with_capacity(cols, n);
            acts.quantize(ty.vec_dot_type(), &x, n, cols).unwrap();
            let mut want = vec![0.0f32; n * rows];
            matmul(&QMatrix::new(ty, rows, cols, &w).unwrap(), &acts, &mut want).unwrap();
            let (dw, dx) = (
                g.upload(&w).unwrap(),
                g.upload(&acts.bytes()[..n * ty.vec_dot_type().row_bytes(cols).unwrap()])
                    .unwrap(),
            );
            let mut dy = g.zeros::<f32>(n * rows).unwrap();
            g.matvec(ty, &dw, rows, cols, &dx, n, &mut dy).unwrap();
            let got = g.download(&dy).unwrap();
            let what = format!("{ty} {rows} rows × {n} tokens ({:?})", CpuOrder::of(ty, rows, n));
            assert_eq!(bits(&got), bits(&want), "{what}");
        }
    }
}

#[test]
fn norms_rope_activations_and_embeddings_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(3);
    let f = |name: &str| g.function(name).unwrap();

    // RMS norm of 3 rows of 576.
    let (rows, d) = (3usize, 576usize);
    let x = rng.floats(rows * d);
    let w = rng.floats(d);
    let mut want = vec![0.0f32; rows * d];
    ops::rms_norm_rows(&x, &w, 1e-5, &mut want);
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut dout = g.zeros::<f32>(rows * d).unwrap();
    let (d_i, eps) = (d as i32, 1e-5f32);
    let mut b = g.stream.launch_builder(f("rms_norm_rows"));
    b.arg(&dx).arg(&dw).arg(&mut dout).arg(&d_i).arg(&eps);
    unsafe { b.launch(blocks_of(rows as u32, 256)) }.unwrap();
    let scale: Vec<f32> = want.iter().map(|v| v.abs()).collect();
    close("rms_norm", &g.download(&dout).unwrap(), &want, &scale, 4e-7);

    // RoPE, both styles: the same table, the same fused multiply-adds.
    let (n_tok, heads, head_dim, n_rot, pos0) = (2usize, 3usize, 64usize, 64usize, 17usize);
    for (style, neox) in [(ops::RopeStyle::Interleaved, 0i32), (ops::RopeStyle::Neox, 1)] {
        let q = rng.floats(n_tok * heads * head_dim);
        let mut want = q.clone();
        let mut table = Vec::new();
        for t in 0..n_tok {
            let mut rope = ops::RopeTable::new(n_rot);
            rope.fill(pos0 + t, 10000.0, 1.0);
            rope.apply(
                &mut want[t * heads * head_dim..(t + 1) * heads * head_dim],
                head_dim,
                style,
            );
            // The same angles as `RopeTable::fill`.
            let theta_scale = 10000f32.powf(-2.0 / n_rot as f32);
            let mut theta = (pos0 + t) as f32;
            let (mut c, mut s) = (Vec::new(), Vec::new());
            for _ in 0..n_rot / 2 {
                c.push(theta.cos());
                s.push(theta.sin());
                theta *= theta_scale;
            }
            table.extend(c);
            table.extend(s);
        }
        let mut dq = g.upload(&q).unwrap();
        let dt = g.upload(&table).unwrap();
        let (a, b_, c_, r_) = (n_tok as i32, heads as i32, head_dim as i32, n_rot as i32);
        let mut b = g.stream.launch_builder(f("rope"));
        b.arg(&mut dq).arg(&dt).arg(&a).arg(&b_).arg(&c_).arg(&r_).arg(&neox);
        unsafe { b.launch(grid_1d((n_tok * heads * n_rot / 2) as u64, 128)) }.unwrap();
        assert_eq!(bits(&g.download(&dq).unwrap()), bits(&want), "rope {style:?}");
    }

    // SwiGLU and GeGLU with GGML's exp and GELU table.
    let dtable = g.upload(ops::gelu_table()).unwrap();
    let n = 5000usize;
    let gate: Vec<f32> = rng.floats(n).iter().map(|v| v * 12.0).collect();
    let up = rng.floats(n);
    for (act, kind) in [(FfnActivation::Silu, 0i32), (FfnActivation::GeluTanh, 1)] {
        let want: Vec<f32> = gate.iter().zip(&up).map(|(&gv, &u)| act.apply(gv, u)).collect();
        let (mut dg, du) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
        let n64 = n as u64;
        let mut b = g.stream.launch_builder(f("gated_activation"));
        b.arg(&mut dg).arg(&du).arg(&dtable).arg(&n64).arg(&kind);
        unsafe { b.launch(grid_1d(n64, 256)) }.unwrap();
        assert_eq!(bits(&g.download(&dg).unwrap()), bits(&want), "{act:?}");
    }

    // Embedding rows of every type, dequantized as the CPU does.
    let (vocab, n_embd) = (8usize, 512usize);
    let tokens: Vec<u32> = vec![5, 0, 7];
    for ty in GPU_WEIGHT_TYPES {
        let table = weights(ty, vocab, n_embd, &mut rng);
        let row = ty.row_bytes(n_embd).unwrap();
        let mut want = vec![0.0f32; tokens.len() * n_embd];
        for (t, &tok) in tokens.iter().enumerate() {
            dequantize_row(
                ty,
                &table[tok as usize * row..][..row],
                &mut want[t * n_embd..][..n_embd],
            )
            .unwrap();
        }
        let (dtab, dtok) = (g.upload(&table).unwrap(), g.upload(&tokens).unwrap());
        let mut dout = g.zeros::<f32>(tokens.len() * n_embd).unwrap();
        let (row64, ty_id, n_i, scale) = (row as u64, ty.id() as i32, n_embd as i32, 0.0f32);
        let mut b = g.stream.launch_builder(f("embed"));
        b.arg(&dtab)
            .arg(&row64)
            .arg(&ty_id)
            .arg(&dtok)
            .arg(&mut dout)
            .arg(&n_i)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (2, tokens.len() as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(cfg) }.unwrap();
        assert_eq!(bits(&g.download(&dout).unwrap()), bits(&want), "embed {ty}");
    }
}

/// One kv head of a test cache, `[cell][kv_dim]` f16.
struct TestHead<'a> {
    k: &'a [f16],
    v: &'a [f16],
    kv_dim: usize,
    off: usize,
    hd: usize,
}

impl KvHead for TestHead<'_> {
    fn key(&self, cell: usize) -> &[f16] {
        &self.k[cell * self.kv_dim + self.off..][..self.hd]
    }
    fn value(&self, cell: usize) -> &[f16] {
        &self.v[cell * self.kv_dim + self.off..][..self.hd]
    }
}

#[test]
fn attention_takes_the_cpu_routes_bit_for_bit() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(4);
    // (head_dim, queries, first position, window, cache view, threads): the
    // vector route with and without a window and at Gemma's head size, the
    // split route, the tiled route.
    let cases = [
        (64usize, 2usize, 298usize, 0usize, 512usize, 2usize),
        (64, 3, 297, 100, 512, 2),
        (256, 2, 40, 16, 256, 2),
        (128, 1, 599, 0, 768, 3),
        (64, 70, 530, 0, 768, 2),
        (64, 70, 530, 200, 768, 2),
    ];
    for (hd, n_tok, pos0, window, cells, threads) in cases {
        let (n_head, n_kv) = (4usize, 2usize);
        let kv_dim = n_kv * hd;
        // The CPU's tiled route reads whole tiles of the cache view (masked).
        let stored = cells.max(pos0 + n_tok);
        let k: Vec<f16> = rng
            .floats(stored * kv_dim)
            .iter()
            .map(|&v| f16::from_f32(v * 2.0))
            .collect();
        let v: Vec<f16> = rng.floats(stored * kv_dim).iter().map(|&v| f16::from_f32(v)).collect();
        let q = rng.floats(n_tok * n_head * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want = vec![0.0f32; q.len()];
        let route = flash_attn::route(n_tok, cells, threads);
        for t in 0..n_tok {
            let pos = pos0 + t;
            let visible = if window > 0 {
                (pos + 1).saturating_sub(window)
            } else {
                0
            }..pos + 1;
            for h in 0..n_head {
                let head = TestHead {
                    k: &k,
                    v: &v,
                    kv_dim,
                    off: h / (n_head / n_kv) * hd,
                    hd,
                };
                let qr = &q[(t * n_head + h) * hd..][..hd];
                let o = &mut want[(t * n_head + h) * hd..][..hd];
                match route {
                    Route::Vector => {
                        let mut scratch = vec![0.0f32; flash_attn::vector_scratch_len(hd)];
                        flash_attn::vector(&head, qr, visible.clone(), |_| true, scale, &mut scratch, o);
                    }
                    Route::Split { chunks } => {
                        let mut scratch = vec![0.0f32; flash_attn::vector_scratch_len(hd)];
                        flash_attn::split(
                            &head,
                            qr,
                            visible.clone(),
                            |_| true,
                            cells,
                            chunks,
                            scale,
                            &mut scratch,
                            o,
                        );
                    }
                    Route::Tiled => {
                        let mut scratch = vec![0.0f32; flash_attn::tile_scratch_len(hd)];
                        let tile = Tile {
                            q: qr,
                            head_dim: hd,
                            cells,
                            scale,
                        };
                        flash_attn::tiled(&head, tile, |_| visible.clone(), |_, _| true, &mut scratch, o);
                    }
                }
            }
        }
        let bits16 = |x: &[f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
        let (dq, dk, dv) = (
            g.upload(&q).unwrap(),
            g.upload(&bits16(&k)).unwrap(),
            g.upload(&bits16(&v)).unwrap(),
        );
        let dout = g.zeros::<f32>(q.len()).unwrap();
        let heads = AttentionHeads {
            n_head,
            n_head_kv: n_kv,
            head_dim: hd,
        };
        let partials = g.zeros::<f32>(Gpu::partials_len(heads, threads)).unwrap();
        let at = AttentionAt {
            pos0,
            window,
            kq_scale: scale,
            cells,
            threads,
        };
        g.attention(
            g.ptr(&dq),
            g.ptr(&dk),
            g.ptr(&dv),
            g.ptr(&dout),
            n_tok,
            heads,
            at,
            &partials,
        )
        .unwrap();
        assert_eq!(
            bits(&g.download(&dout).unwrap()),
            bits(&want),
            "{route:?}: head size {hd}, {n_tok} queries from {pos0}, window {window}"
        );
    }
}

#[test]
fn the_streaming_ffn_computes_ready_slots_and_skips_missing_ones_at_the_deadline() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(5);
    let (n_embd, n_ff) = (256usize, 64usize);
    let format = BundleFormat::new(
        GgmlType::Q4_0,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        DownLayout::Columns,
        n_embd,
    )
    .unwrap();
    let bb = format.bundle_bytes();
    let bundles = random_bundles(&mut rng, n_embd, n_ff).concat();
    let x = rng.floats(n_embd);
    let mut acts = ActBuffer::with_capacity(n_embd, 1);
    acts.quantize(GgmlType::Q8_0, &x, 1, n_embd).unwrap();
    let input = FfnInput::new(&format, &acts, &acts, 0).unwrap();

    // Slot s holds neuron (7 s) mod n_ff; every third slot never arrives.
    let epoch = 3u32;
    let neurons: Vec<usize> = (0..n_ff).map(|s| (7 * s) % n_ff).collect();
    let flags: Vec<u32> = (0..n_ff).map(|s| if s % 3 == 2 { epoch - 1 } else { epoch }).collect();
    let dbundles = g.upload(&bundles).unwrap();
    let dflags = g.upload(&flags).unwrap();
    let (bundle_base, flag_base) = {
        let (b, _sb) = dbundles.device_ptr(&g.stream);
        let (f, _sf) = dflags.device_ptr(&g.stream);
        (b, f)
    };
    let slots: Vec<Slot> = neurons
        .iter()
        .enumerate()
        .map(|(s, &n)| Slot {
            bundle: bundle_base + (n * bb) as u64,
            flag: flag_base + (s * 4) as u64,
            neuron: n as u32,
            pad: 0,
        })
        .collect();
    let dslots = g.upload(&slots).unwrap();
    let dx = g.upload(acts.row(0)).unwrap();
    let table = vec![0.0f32; 1 << 16];
    let dtable = g.upload(&table).unwrap();
    let start = g.zeros::<u64>(1).unwrap();
    let act = g.zeros::<f32>(n_ff).unwrap();
    let skipped = g.zeros::<u8>(n_ff).unwrap();
    let (n_slots, kind, deadline_ns) = (n_ff as i32, 0i32, 2_000_000u64);
    // Stage 1 over every slot, keeping what `keep` keeps, into `act`.
    let stage1 = |keep: Keep, act: &CudaSlice<f32>| {
        g.zero_at(g.ptr(&start), 8).unwrap();
        g.ffn_stream_activations(
            g.ptr(&dslots),
            n_ff,
            epoch,
            StreamInput::new(g.ptr(&dx), g.ptr(&dx), &format, n_ff, 0, 1),
            &format,
            kind,
            g.ptr(&dtable),
            g.ptr(&start),
            deadline_ns,
            keep,
            g.ptr(act),
            g.ptr(&skipped),
        )
        .unwrap();
    };
    stage1(Keep::ALL, &act);
    let got_act = g.download(&act).unwrap();
    let got_skipped = g.download(&skipped).unwrap();
    let mut want_y = vec![0.0f32; n_embd];
    let offset = format.gate_bytes() + format.up_bytes();
    let mut order: Vec<u32> = (0..n_ff as u32).collect();
    order.sort_by_key(|&s| neurons[s as usize]);
    for &s in &order {
        let s = s as usize;
        let n = neurons[s];
        assert_eq!(got_skipped[s] == 1, s % 3 == 2, "slot {s}");
        if s % 3 == 2 {
            assert_eq!(got_act[s], 0.0);
            continue;
        }
        let a = neuron_activation(&format, &input, FfnActivation::Silu, &bundles[n * bb..][..bb]).unwrap();
        // The CPU's vec-dot order (`cpu_order.cuh`): its bits.
        assert_eq!(
            got_act[s].to_bits(),
            a.to_bits(),
            "slot {s}: GPU {}, CPU {a}",
            got_act[s]
        );
        axpy_down(
            format.down_ty,
            a,
            &bundles[n * bb + offset..][..format.down_bytes()],
            &mut want_y,
        )
        .unwrap();
    }

    let dorder = g.upload(&order).unwrap();
    let mut dy = g.zeros::<f32>(n_embd).unwrap();
    let (down_offset, down_ty, n_embd_i) = (offset as u64, GgmlType::Q8_0.id() as i32, n_embd as i32);
    let mut b = g.stream.launch_builder(g.function("ffn_stream_down").unwrap());
    b.arg(&dslots)
        .arg(&dorder)
        .arg(&n_slots)
        .arg(&act)
        .arg(&down_offset)
        .arg(&down_ty)
        .arg(&mut dy)
        .arg(&n_embd_i);
    unsafe { b.launch(grid_1d(n_embd as u64, 128)) }.unwrap();
    assert_eq!(bits(&g.download(&dy).unwrap()), bits(&want_y), "streaming FFN output");

    // What a policy keeps (the CPU tail's rule): by a threshold (the median
    // |a|), then by a bitmap over neuron ids; the same launch otherwise.
    let mut mags: Vec<f32> = got_act.iter().map(|a| a.abs()).filter(|&a| a > 0.0).collect();
    mags.sort_by(f32::total_cmp);
    let bitmap = vec![0x5555_5555_5555_5555u64; n_ff.div_ceil(64)];
    let dbitmap = g.upload(&bitmap).unwrap();
    let by_threshold = Keep {
        threshold: mags[mags.len() / 2],
        rows: DevPtr(0),
    };
    let by_bitmap = Keep {
        threshold: 0.0,
        rows: g.ptr(&dbitmap),
    };
    for (keep, row) in [(by_threshold, None), (by_bitmap, Some(&bitmap[..]))] {
        let act2 = g.zeros::<f32>(n_ff).unwrap();
        stage1(keep, &act2);
        let got = g.download(&act2).unwrap();
        let dropped = (0..n_ff).filter(|&s| got[s] == 0.0 && got_act[s] != 0.0).count();
        assert!(dropped > 0, "{keep:?} dropped nothing");
        for s in 0..n_ff {
            let want = if keeps(keep.threshold, row, neurons[s], got_act[s]) {
                got_act[s]
            } else {
                0.0
            };
            assert_eq!(got[s].to_bits(), want.to_bits(), "slot {s}: {keep:?}");
        }
    }
}
