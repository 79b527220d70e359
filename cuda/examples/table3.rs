//! The paper's Table 3 on a CUDA device: handing a layer's FFN work from
//! the host to the device in K stages, by flags in mapped memory (one
//! launch; the host publishes stage k's flag, the stage's thread blocks
//! poll it) against the host synchronizing the device between stages (a
//! launch per stage, then `cuCtxSynchronize`). The work is a 7B-shape
//! layer's FFN bytes (Mistral 7B, Q4_0: 3 × 14336 × 4096 weights) read once
//! in total, split evenly over the stages. Prints one JSON line per K with
//! median milliseconds of each mode over the repetitions.
//!
//! `cargo run --release -p leanstream-cuda --example table3 [REPS]`

use std::time::Instant;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use leanstream_cuda::device::{Gpu, MappedFlags};
use leanstream_cuda::flags::{Epochs, FlagBoard};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let g = Gpu::open(0)?;
    eprintln!("{} (compute {:?})", g.name, g.compute_capability);
    // Q4_0 bytes of the layer's three matrices, as f32 words to stream.
    let n: u64 = 3 * 14336 * 4096 * 18 / 32 / 4;
    let data = g.upload(&vec![0.5f32; n as usize])?;
    let mut out = g.zeros::<f32>(16)?;
    let always = MappedFlags::new(&g, 16)?;
    let always_board = FlagBoard::new(always.host());
    for k in 0..16 {
        always_board.pin(k)?;
    }
    let flags = MappedFlags::new(&g, 16)?;
    let board = FlagBoard::new(flags.host());
    let mut epochs = Epochs::new();
    let f = g.function("staged_handoff")?;
    let blocks_per_stage = 64u32;
    let (always_ptr, flags_ptr) = (always.device_ptr(), flags.device_ptr());
    for stages in [1u32, 2, 4, 8, 16] {
        let (mut sync_ms, mut flag_ms) = (Vec::new(), Vec::new());
        let k_i = stages as i32;
        for rep in 0..reps + 1 {
            // Host synchronization between stages.
            let t = Instant::now();
            for stage in 0..stages as i32 {
                let epoch = 1u32;
                let mut b = g.stream.launch_builder(f);
                b.arg(&always_ptr)
                    .arg(&epoch)
                    .arg(&stage)
                    .arg(&k_i)
                    .arg(&data)
                    .arg(&n)
                    .arg(&mut out);
                let cfg = LaunchConfig {
                    grid_dim: (blocks_per_stage, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the kernel reads `n` floats of `data` and 16 flags.
                unsafe { b.launch(cfg) }?;
                g.ctx.synchronize()?;
            }
            let sync = t.elapsed().as_secs_f64() * 1e3;
            // One launch; stages handed over by flags.
            let epoch = epochs.advance()?;
            let t = Instant::now();
            let all = -1i32;
            let mut b = g.stream.launch_builder(f);
            b.arg(&flags_ptr)
                .arg(&epoch)
                .arg(&all)
                .arg(&k_i)
                .arg(&data)
                .arg(&n)
                .arg(&mut out);
            let cfg = LaunchConfig {
                grid_dim: (blocks_per_stage * stages, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; every stage's flag is published below.
            unsafe { b.launch(cfg) }?;
            for stage in 0..stages as usize {
                board.publish(stage, epoch)?;
            }
            g.ctx.synchronize()?;
            let flag = t.elapsed().as_secs_f64() * 1e3;
            // The first round warms the clocks and caches.
            if rep > 0 {
                sync_ms.push(sync);
                flag_ms.push(flag);
            }
        }
        println!(
            "{{\"stages\": {stages}, \"sync_ms\": {:.3}, \"flags_ms\": {:.3}, \"reps\": {reps}}}",
            median(sync_ms),
            median(flag_ms)
        );
    }
    Ok(())
}
