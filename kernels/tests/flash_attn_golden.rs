//! Our flash attention against llama.cpp's `ggml_flash_attn_ext` on the CPU
//! (data/golden/flash_attn.json, recorded by
//! scripts/golden/golden_flash_attn.c): the same inputs must give the same
//! bits by each of ggml's three routes (vector, split across threads, tiled).
//! On aarch64 the recording is the same program's output against the
//! `libggml-cpu.so` of `scripts/aarch64.sh llama armv8-a`, run under qemu
//! (data/golden/aarch64/flash_attn.json; the armv8.2-a+dotprod build records
//! the same bytes), whose f16 dot product, exp and softmax sums follow
//! ggml's NEON code.

mod harness;

use std::ops::Range;

use half::f16;
use harness::{bits_fnv, Lcg};
use leanstream_kernels::flash_attn::{self, KvHead, Route, Tile, Q_TILE};
use serde_json::Value;

/// Keys and values as `[kv_head][cell][dim]`, as the harness lays them out.
struct Cache {
    k: Vec<f16>,
    v: Vec<f16>,
    cells: usize,
    hd: usize,
}

struct Head<'a>(&'a Cache, usize);

impl KvHead for Head<'_> {
    fn key(&self, cell: usize) -> &[f16] {
        let at = (self.1 * self.0.cells + cell) * self.0.hd;
        &self.0.k[at..at + self.0.hd]
    }
    fn value(&self, cell: usize) -> &[f16] {
        let at = (self.1 * self.0.cells + cell) * self.0.hd;
        &self.0.v[at..at + self.0.hd]
    }
}

fn field(case: &Value, name: &str) -> usize {
    case[name].as_u64().unwrap() as usize
}

#[test]
fn flash_attention_matches_llama_cpp_bit_for_bit() {
    let path = if cfg!(target_arch = "aarch64") {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../data/golden/aarch64/flash_attn.json")
    } else {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../data/golden/flash_attn.json")
    };
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(cases.len() >= 15);
    let mut routes = Vec::new();
    let mut mismatches = Vec::new();
    for case in &cases {
        let (hd, n_head, n_head_kv) = (field(case, "head_dim"), field(case, "n_head"), field(case, "n_head_kv"));
        let (n_q, cells, pos0) = (field(case, "n_q"), field(case, "n_kv"), field(case, "pos0"));
        let (window, threads) = (field(case, "window"), field(case, "threads"));
        let scale = f32::from_bits(case["scale_bits"].as_u64().unwrap() as u32);
        let mut rng = Lcg(case["seed"].as_u64().unwrap());
        let q: Vec<f32> = (0..n_q * n_head * hd).map(|_| rng.next_value()).collect();
        let nk = n_head_kv * cells * hd;
        let k: Vec<f16> = (0..nk).map(|_| f16::from_f32(rng.next_value())).collect();
        let v: Vec<f16> = (0..nk).map(|_| f16::from_f32(rng.next_value())).collect();
        let cache = Cache { k, v, cells, hd };
        let visible = |t: usize| -> Range<usize> {
            let pos = pos0 + t;
            let lo = if window > 0 {
                (pos + 1).saturating_sub(window)
            } else {
                0
            };
            lo..(pos + 1).min(cells)
        };
        let group = n_head / n_head_kv;
        let mut out = vec![0.0f32; n_q * n_head * hd];
        let route = flash_attn::route(n_q, cells, threads);
        routes.push(route);
        match route {
            Route::Vector | Route::Split { .. } => {
                let mut scratch = vec![0.0f32; flash_attn::vector_scratch_len(hd)];
                for t in 0..n_q {
                    for h in 0..n_head {
                        let kv = Head(&cache, h / group);
                        let qr = &q[(t * n_head + h) * hd..][..hd];
                        let o = &mut out[(t * n_head + h) * hd..][..hd];
                        match route {
                            Route::Split { chunks } => {
                                flash_attn::split(&kv, qr, visible(t), |_| true, cells, chunks, scale, &mut scratch, o)
                            }
                            _ => flash_attn::vector(&kv, qr, visible(t), |_| true, scale, &mut scratch, o),
                        }
                    }
                }
            }
            Route::Tiled => {
                let mut scratch = vec![0.0f32; flash_attn::tile_scratch_len(hd)];
                for h in 0..n_head {
                    let kv = Head(&cache, h / group);
                    // Tiles of 37 rows: the grouping must not matter.
                    for t0 in (0..n_q).step_by(37.min(Q_TILE)) {
                        let rows = 37.min(n_q - t0);
                        let qt: Vec<f32> = (0..rows)
                            .flat_map(|r| q[((t0 + r) * n_head + h) * hd..][..hd].iter().copied())
                            .collect();
                        let mut ot = vec![0.0f32; rows * hd];
                        let tile = Tile {
                            q: &qt,
                            head_dim: hd,
                            cells,
                            scale,
                        };
                        flash_attn::tiled(&kv, tile, |r| visible(t0 + r), |_, _| true, &mut scratch, &mut ot);
                        for r in 0..rows {
                            out[((t0 + r) * n_head + h) * hd..][..hd].copy_from_slice(&ot[r * hd..(r + 1) * hd]);
                        }
                    }
                }
            }
        }
        let want = u64::from_str_radix(case["out_fnv"].as_str().unwrap(), 16).unwrap();
        if bits_fnv(&out) != want {
            let first: Vec<u32> = case["first"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u32)
                .collect();
            let diff = (0..16).filter(|&i| out[i].to_bits() != first[i]).count();
            mismatches.push(format!(
                "{route:?} hd {hd} q {n_q} cells {cells} pos0 {pos0} window {window}: {diff} of the first 16 differ (ours {:e}, llama.cpp {:e})",
                out[0],
                f32::from_bits(first[0])
            ));
        }
    }
    for r in [Route::Vector, Route::Tiled] {
        assert!(routes.contains(&r), "no case takes the {r:?} route");
    }
    assert!(routes.iter().any(|r| matches!(r, Route::Split { .. })));
    assert!(
        mismatches.is_empty(),
        "flash attention differs from llama.cpp:\n{}",
        mismatches.join("\n")
    );
}
