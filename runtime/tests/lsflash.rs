//! The packed `.lsflash` format: round trips against the source GGUF, placement,
//! and hostile files (never a panic, always an error naming the file).

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::sparse_ffn::tiles::{part_bytes, tile_bytes, tile_of};
use leanstream_kernels::sparse_ffn::DownLayout;
use leanstream_kernels::GgmlType;
use leanstream_runtime::flash::format::{ALIGN, PREAMBLE_LEN};
use leanstream_runtime::flash::{pack, DownType, Header, LsFlash, PackOptions};
use leanstream_runtime::gguf::GgufFile;
use leanstream_runtime::model::Config;
use leanstream_runtime::synthetic::SyntheticSpec;
use leanstream_runtime::RuntimeError;

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("lsflash");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn synthetic(name: &str, ty: GgmlType) -> PathBuf {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = ty;
    let p = dir().join(format!("{name}.gguf"));
    std::fs::write(&p, spec.build().unwrap().to_bytes()).unwrap();
    p
}

fn opts(down: DownType, placement: Option<Vec<Vec<u32>>>) -> PackOptions {
    PackOptions {
        down,
        placement,
        sparsity: Vec::new(),
        neuron_scores: Vec::new(),
        progress: false,
    }
}

fn down_column(g: &GgufFile, l: usize, i: usize, n_embd: usize, n_ff: usize) -> Vec<f32> {
    let m = g.matrix(&format!("blk.{l}.ffn_down.weight"), n_embd, n_ff).unwrap();
    let mut row = vec![0f32; n_ff];
    (0..n_embd)
        .map(|r| {
            dequantize_row(m.ty, m.row(r), &mut row).unwrap();
            row[i]
        })
        .collect()
}

/// Checks every bundle of `flash` against the GGUF; returns the largest
/// absolute error of the down columns.
fn check_round_trip(gguf: &Path, flash: &LsFlash, placement: Option<&[Vec<u32>]>) -> f32 {
    let g = GgufFile::open(gguf).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    assert_eq!(flash.config().n_layer, c.n_layer);
    assert_eq!(flash.config().n_ff, c.n_ff);
    assert_eq!(flash.config().n_embd, c.n_embd);
    // The resident image has everything but the FFN matrices, byte for byte.
    let res = flash.resident().unwrap();
    assert_eq!(res.tensors.len(), g.tensors.len() - 3 * c.n_layer);
    for t in &res.tensors {
        assert!(!t.name.contains("ffn_gate.") && !t.name.contains("ffn_up.") && !t.name.contains("ffn_down."));
        let src = g.tensor_info(&t.name).unwrap();
        assert_eq!(res.tensor_bytes(t), g.tensor_bytes(src), "{}", t.name);
    }
    let (n_embd, n_ff) = (c.n_embd, c.n_ff);
    let mut worst = 0f32;
    let mut down = vec![0f32; n_embd];
    for l in 0..c.n_layer {
        let layout = flash.layout(l);
        let (layer_off, layer_len) = flash.layer_extent(l);
        assert_eq!(layer_off % ALIGN, 0);
        assert_eq!(layer_len, (layout.bundle_bytes() * n_ff) as u64);
        let gate = g.matrix(&format!("blk.{l}.ffn_gate.weight"), n_ff, n_embd).unwrap();
        let up = g.matrix(&format!("blk.{l}.ffn_up.weight"), n_ff, n_embd).unwrap();
        for i in 0..n_ff {
            let pos = placement.map_or(i, |p| p[l].iter().position(|&n| n as usize == i).unwrap());
            assert_eq!(flash.position(l, i), pos);
            assert_eq!(flash.neuron_at(l, pos), i);
            let (off, len) = flash.bundle_extent(l, i);
            assert_eq!(off, layer_off + (pos * len) as u64);
            let bytes = flash.read_bundle(l, i).unwrap();
            let (gb, ub, db) = layout.split(&bytes).unwrap();
            assert_eq!(gb, gate.row(i), "layer {l} neuron {i} gate");
            assert_eq!(ub, up.row(i), "layer {l} neuron {i} up");
            if layout.down_layout == DownLayout::Tiles {
                continue; // checked whole by check_tiles
            }
            dequantize_row(layout.down_type, db, &mut down).unwrap();
            let want = down_column(&g, l, i, n_embd, n_ff);
            let amax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in down.iter().zip(&want) {
                let err = (a - b).abs();
                let tol = match layout.down_type {
                    // Q8_0: half a step of the block's scale (amax/127), plus the f16 scale's rounding.
                    GgmlType::Q8_0 => amax / 127.0 * 0.5 + amax * 1e-3,
                    _ => b.abs() / 1024.0 + 1e-7,
                };
                assert!(err <= tol, "layer {l} neuron {i}: {a} vs {b}");
                worst = worst.max(err);
            }
        }
    }
    worst
}

#[test]
fn round_trip_f32_model_q8_0_and_f16_down() {
    let src = synthetic("f32", GgmlType::F32);
    for down in [DownType::Q8_0, DownType::F16] {
        let out = dir().join(format!("f32_{down:?}.lsflash"));
        let r = pack(&src, &out, &opts(down, None)).unwrap();
        assert_eq!(std::fs::metadata(&out).unwrap().len(), r.file_len);
        assert!(!dir().join(format!("f32_{down:?}.lsflash.tmp")).exists());
        let f = LsFlash::open(&out).unwrap();
        f.verify().unwrap();
        assert_eq!(f.header().down_type, down);
        assert_eq!(Some(f.layout(0).down_type), down.column_type());
        let worst = check_round_trip(&src, &f, None);
        eprintln!("down {down:?}: worst abs error {worst:e}");
    }
}

/// Each group's tile, put back together from its neurons' bundles, is the
/// source's down blocks byte for byte (zero padding after them).
fn check_tiles(gguf: &Path, flash: &LsFlash) {
    let g = GgufFile::open(gguf).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let (n_embd, n_ff) = (c.n_embd, c.n_ff);
    for l in 0..c.n_layer {
        let layout = flash.layout(l);
        let down = g.matrix(&format!("blk.{l}.ffn_down.weight"), n_embd, n_ff).unwrap();
        assert_eq!(layout.down_layout, DownLayout::Tiles);
        assert_eq!(layout.down_type, down.ty);
        let (gsize, p) = (down.ty.block_size(), part_bytes(down.ty, n_embd).unwrap());
        assert_eq!(layout.down_bytes, p);
        let mut want = vec![0u8; tile_bytes(down.ty, n_embd).unwrap()];
        for grp in 0..n_ff / gsize {
            tile_of(down.ty, n_embd, n_ff, down.data, grp, &mut want).unwrap();
            let mut got = Vec::new();
            for k in 0..gsize {
                let b = flash.read_bundle(l, grp * gsize + k).unwrap();
                got.extend_from_slice(layout.split(&b).unwrap().2);
            }
            assert_eq!(&got[..want.len()], &want[..], "layer {l} group {grp}");
            assert!(
                got[want.len()..].iter().all(|&b| b == 0),
                "layer {l} group {grp} padding"
            );
        }
    }
}

#[test]
fn round_trip_source_down_tiles_with_placement() {
    for (name, ty) in [("tiles_q4_0", GgmlType::Q4_0), ("tiles_q8_0", GgmlType::Q8_0)] {
        let src = synthetic(name, ty);
        let spec = SyntheticSpec::tiny("llama");
        let placement: Vec<Vec<u32>> = (0..spec.n_layer)
            .map(|l| {
                let mut p: Vec<u32> = (0..spec.n_ff as u32).rev().collect();
                p.rotate_left(l * 7);
                p
            })
            .collect();
        let out = dir().join(format!("{name}.lsflash"));
        pack(&src, &out, &opts(DownType::Source, Some(placement.clone()))).unwrap();
        let f = LsFlash::open(&out).unwrap();
        f.verify().unwrap();
        assert_eq!(f.header().down_type, DownType::Source);
        check_round_trip(&src, &f, Some(&placement));
        check_tiles(&src, &f);
        // Fewer bytes than Q8_0 columns for a 4-bit source.
        let q8 = dir().join(format!("{name}_q8.lsflash"));
        pack(&src, &q8, &opts(DownType::Q8_0, None)).unwrap();
        let cols = LsFlash::open(&q8).unwrap();
        assert!(f.layout(0).bundle_bytes() <= cols.layout(0).bundle_bytes(), "{name}");
    }
}

#[test]
fn version_2_files_still_open() {
    // A version-2 file is a version-3 file with down columns, 0 in each
    // layer's down type and 2 in the preamble.
    let (_, good) = packed_bytes("v2");
    let f = LsFlash::open(write("v2_probe.lsflash", &good)).unwrap();
    let table_at = 32 + 8 + 4 + f.header().arch.len() + 8 * 4 + 8 + 8 + 32 + 8 + 8 + f.n_layer() * f.n_ff() * 4;
    let n_layer = f.n_layer();
    let p = forged(&good, "v2_meta.lsflash", move |m| {
        for l in 0..n_layer {
            let at = table_at + l * 72 + 20;
            m[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        }
    });
    let mut b = std::fs::read(&p).unwrap();
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    let v2 = LsFlash::open(write("v2.lsflash", &b)).unwrap();
    assert_eq!(v2.layout(0), f.layout(0));
    assert_eq!(v2.header().down_type, DownType::Q8_0);
}

#[test]
fn round_trip_q8_0_model_with_placement() {
    let src = synthetic("q8", GgmlType::Q8_0);
    let spec = SyntheticSpec::tiny("llama");
    // A different permutation per layer: reversed, then rotated.
    let placement: Vec<Vec<u32>> = (0..spec.n_layer)
        .map(|l| {
            let n = spec.n_ff as u32;
            if l % 2 == 0 {
                (0..n).rev().collect()
            } else {
                (0..n).map(|i| (i + 37) % n).collect()
            }
        })
        .collect();
    let out = dir().join("q8_placed.lsflash");
    pack(&src, &out, &opts(DownType::Q8_0, Some(placement.clone()))).unwrap();
    let f = LsFlash::open(&out).unwrap();
    f.verify().unwrap();
    assert_eq!(f.header().placement, placement);
    assert_eq!(f.layout(0).gate_type, GgmlType::Q8_0);
    check_round_trip(&src, &f, Some(&placement));

    // The same bundles as the identity packing, only moved.
    let ident = dir().join("q8_ident.lsflash");
    pack(&src, &ident, &opts(DownType::Q8_0, None)).unwrap();
    let fi = LsFlash::open(&ident).unwrap();
    for l in 0..spec.n_layer {
        for i in 0..spec.n_ff {
            assert_eq!(f.read_bundle(l, i).unwrap(), fi.read_bundle(l, i).unwrap());
        }
    }
    assert_ne!(std::fs::read(&out).unwrap(), std::fs::read(&ident).unwrap());
}

#[test]
fn placement_must_be_a_permutation() {
    let src = synthetic("perm", GgmlType::F32);
    let spec = SyntheticSpec::tiny("llama");
    let n = spec.n_ff as u32;
    let ident: Vec<u32> = (0..n).collect();
    let mut dup = ident.clone();
    dup[5] = 6;
    let mut out_of_range = ident.clone();
    out_of_range[0] = n;
    let short = ident[1..].to_vec();
    let out = dir().join("perm.lsflash");
    for (what, p) in [
        ("duplicate", vec![ident.clone(), dup]),
        ("out of range", vec![out_of_range, ident.clone()]),
        ("short", vec![ident.clone(), short]),
        ("too few layers", vec![ident.clone()]),
    ] {
        let err = pack(&src, &out, &opts(DownType::Q8_0, Some(p))).unwrap_err();
        eprintln!("{what}: {err}");
        assert!(matches!(err, RuntimeError::Invalid(_)), "{what}: {err:?}");
        assert!(!out.exists());
    }
}

/// A packed synthetic model; `tag` keeps tests running in parallel apart.
fn packed_bytes(tag: &str) -> (PathBuf, Vec<u8>) {
    let src = synthetic(&format!("hostile_{tag}"), GgmlType::Q8_0);
    let out = dir().join(format!("hostile_{tag}.lsflash"));
    pack(&src, &out, &opts(DownType::Q8_0, None)).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    (out, bytes)
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn open_err(path: &Path) -> String {
    let err = LsFlash::open(path).expect_err("a damaged file must not open");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "error does not name the file: {msg}"
    );
    msg
}

#[test]
fn wrong_magic_and_version() {
    let (_, good) = packed_bytes("magic");
    let mut b = good.clone();
    b[0] = b'X';
    let msg = open_err(&write("magic.lsflash", &b));
    assert!(msg.contains("magic"), "{msg}");
    let mut b = good.clone();
    b[8] = 1;
    let msg = open_err(&write("version.lsflash", &b));
    assert!(msg.contains("version") && msg.contains("re-pack"), "{msg}");
    let p = write(
        "gguf.lsflash",
        &SyntheticSpec::tiny("llama").build().unwrap().to_bytes(),
    );
    open_err(&p);
}

#[test]
fn truncated_files_are_errors() {
    let (_, good) = packed_bytes("trunc");
    let n = good.len();
    let f = LsFlash::open(write("whole.lsflash", &good)).unwrap();
    let (res_off, _) = f.resident_range();
    let mut lens: Vec<usize> = (0..200).chain([256, 1000, 4095, 4096]).collect();
    lens.extend((1..64).map(|k| n * k / 64));
    lens.extend([res_off as usize, res_off as usize + 100, n - 4096, n - 1]);
    for len in lens {
        let p = write("truncated.lsflash", &good[..len]);
        let msg = open_err(&p);
        assert!(!msg.is_empty(), "length {len}");
    }
}

#[test]
fn flipped_header_byte_is_a_checksum_error() {
    let (_, good) = packed_bytes("header");
    for at in [20usize, 64, 64 + 40, 64 + 100, 200] {
        let mut b = good.clone();
        b[at] ^= 0x10;
        let msg = open_err(&write("flip_header.lsflash", &b));
        assert!(msg.contains("meta_len") || msg.contains("checksum"), "byte {at}: {msg}");
    }
}

#[test]
fn flipped_bundle_byte_fails_verify_naming_the_layer() {
    let (path, good) = packed_bytes("bundle");
    let f = LsFlash::open(&path).unwrap();
    for l in 0..f.n_layer() {
        let (off, len) = f.layer_extent(l);
        let mut b = good.clone();
        b[(off + len / 2) as usize] ^= 1;
        let p = write("flip_bundle.lsflash", &b);
        let damaged = LsFlash::open(&p).expect("bundles are not checked at open");
        let msg = damaged.verify().unwrap_err().to_string();
        assert!(msg.contains(&format!("layer {l}")), "{msg}");
        assert!(msg.contains(&p.display().to_string()), "{msg}");
    }
    let (res_off, res_len) = f.resident_range();
    let mut b = good.clone();
    b[(res_off + res_len - 1) as usize] ^= 1;
    let p = write("flip_resident.lsflash", &b);
    if let Ok(damaged) = LsFlash::open(&p) {
        let msg = damaged.verify().unwrap_err().to_string();
        assert!(msg.contains("resident"), "{msg}");
    }
}

#[test]
fn smollm2_round_trip() {
    let Some(src) = common::model_path("smollm2") else {
        return;
    };
    let out = dir().join("smollm2.lsflash");
    let t = Instant::now();
    let r = pack(&src, &out, &opts(DownType::Q8_0, None)).unwrap();
    let pack_s = t.elapsed().as_secs_f64();
    let gguf_len = std::fs::metadata(&src).unwrap().len();
    eprintln!(
        "smollm2: GGUF {gguf_len} bytes, .lsflash {} bytes (resident {}, bundles {}), packed in {pack_s:.2} s",
        r.file_len, r.resident_len, r.bundle_len
    );
    let f = LsFlash::open(&out).unwrap();
    let t = Instant::now();
    f.verify().unwrap();
    eprintln!("smollm2: verify {:.2} s", t.elapsed().as_secs_f64());
    let worst = check_round_trip(&src, &f, None);
    eprintln!("smollm2: worst down abs error {worst:e}");
    std::fs::remove_file(&out).unwrap();
    let r = pack(&src, &out, &opts(DownType::Source, None)).unwrap();
    eprintln!("smollm2 with source down tiles: {} bytes of bundles", r.bundle_len);
    let f = LsFlash::open(&out).unwrap();
    f.verify().unwrap();
    check_round_trip(&src, &f, None);
    check_tiles(&src, &f);
    std::fs::remove_file(&out).unwrap();
}

type MetaEdit = dyn Fn(&mut Vec<u8>);

/// Rewrites the meta block with `edit` and re-signs it, as a forger would.
fn forged(good: &[u8], name: &str, edit: impl Fn(&mut Vec<u8>)) -> PathBuf {
    let meta_len = u64::from_le_bytes(good[16..24].try_into().unwrap()) as usize;
    let mut meta = good[PREAMBLE_LEN..PREAMBLE_LEN + meta_len].to_vec();
    edit(&mut meta);
    let mut b = Header::encode_preamble(&meta).to_vec();
    b.extend_from_slice(&meta);
    b.extend_from_slice(&good[PREAMBLE_LEN + meta_len..]);
    write(name, &b)
}

#[test]
fn forged_headers_with_valid_checksums_are_rejected_naming_the_field() {
    let (path, good) = packed_bytes("forged");
    let f = LsFlash::open(&path).unwrap();
    let arch_len = f.header().arch.len();
    // Offsets inside the meta block.
    let dims = 32 + 8 + 4 + arch_len;
    let n_ff_at = dims + 8;
    let down_at = dims + 28;
    let res_off_at = down_at + 4;
    let res_len_at = res_off_at + 8;
    let bundle_len_at = res_len_at + 8 + 32 + 8;
    let placement_at = bundle_len_at + 8;
    let n_ff = f.n_ff();
    let table_at = placement_at + f.n_layer() * n_ff * 4;
    let put32 = |m: &mut Vec<u8>, at: usize, v: u32| m[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put64 = |m: &mut Vec<u8>, at: usize, v: u64| m[at..at + 8].copy_from_slice(&v.to_le_bytes());
    let cases: Vec<(&str, Box<MetaEdit>)> = vec![
        ("n_ff", Box::new(move |m| put32(m, n_ff_at, 1 << 30))),
        ("meta_len", Box::new(move |m| put32(m, n_ff_at, 64))),
        ("n_layer", Box::new(move |m| put32(m, dims, 0))),
        ("down_type", Box::new(move |m| put32(m, down_at, 2))),
        ("resident_offset", Box::new(move |m| put64(m, res_off_at, 100))),
        ("resident_len", Box::new(move |m| put64(m, res_len_at, u64::MAX - 10))),
        ("bundle_len", Box::new(move |m| put64(m, bundle_len_at, 1 << 40))),
        ("placement[0]", Box::new(move |m| put32(m, placement_at, 1))),
        ("layer[0].gate_type", Box::new(move |m| put32(m, table_at, 99))),
        ("layer[0].gate_bytes", Box::new(move |m| put32(m, table_at + 8, 3))),
        ("layer[0].down_bytes", Box::new(move |m| put32(m, table_at + 16, 7))),
        ("layer[0].down_type", Box::new(move |m| put32(m, table_at + 20, 1))),
        ("layer[0].offset", Box::new(move |m| put64(m, table_at + 24, 4097))),
        ("layer[1].offset", Box::new(move |m| put64(m, table_at + 72 + 24, 0))),
        ("layer[0].len", Box::new(move |m| put64(m, table_at + 32, 5))),
    ];
    for (field, edit) in cases {
        let p = forged(&good, &format!("forged_{field}.lsflash"), edit);
        let msg = open_err(&p);
        eprintln!("{field}: {msg}");
        assert!(msg.contains(&format!("'{field}'")), "{field}: {msg}");
    }
}

#[test]
fn sparsity_levels_and_neuron_scores_round_trip_and_forgeries_are_named() {
    use leanstream_runtime::flash::SparsityLevel;
    let src = synthetic("levels", GgmlType::Q8_0);
    let probe = LsFlash::open({
        let out = dir().join("levels_probe.lsflash");
        pack(&src, &out, &opts(DownType::Q8_0, None)).unwrap();
        out
    })
    .unwrap();
    let (n_layer, n_ff) = (probe.n_layer(), probe.n_ff());
    let level = |s: f32| SparsityLevel {
        sparsity: s,
        full: (0..n_layer).map(|l| s + l as f32).collect(),
        gate: (0..n_layer).map(|l| 2.0 * s + l as f32).collect(),
    };
    let scores: Vec<Vec<f32>> = (0..n_layer)
        .map(|l| (0..n_ff).map(|i| (l * n_ff + i) as f32).collect())
        .collect();
    let mut o = opts(DownType::Q8_0, None);
    o.sparsity = vec![level(0.8), level(0.5)];
    o.neuron_scores = scores.clone();
    let out = dir().join("levels.lsflash");
    pack(&src, &out, &o).unwrap();
    let f = LsFlash::open(&out).unwrap();
    let h = f.header();
    // Stored by ascending sparsity; 0 needs no thresholds.
    assert_eq!(h.sparsity, vec![level(0.5), level(0.8)]);
    assert_eq!(h.level(0.8), Some(level(0.8)));
    assert_eq!(h.level(0.0), Some(SparsityLevel::dense(n_layer)));
    assert_eq!(h.level(0.7), None);
    assert_eq!(h.neuron_scores, scores);
    f.verify().unwrap();

    // Bad levels are refused at pack time, naming the problem.
    let mut bad = opts(DownType::Q8_0, None);
    bad.sparsity = vec![SparsityLevel {
        full: vec![f32::NAN; n_layer],
        ..level(0.5)
    }];
    let e = pack(&src, dir().join("bad_levels.lsflash"), &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sparsity level 0.5"), "{e}");

    // Forged values with a valid checksum are named by field.
    let good = std::fs::read(&out).unwrap();
    let arch_len = h.arch.len();
    let levels_at = 32 + 8 + 4 + arch_len + 8 * 4 + 8 + 8 + 32 + 8 + 8 + n_layer * n_ff * 4 + n_layer * 72;
    let level_len = 4 + 2 * n_layer * 4;
    let scores_flag_at = levels_at + 4 + 2 * level_len;
    let put32 = |m: &mut Vec<u8>, at: usize, v: u32| m[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let cases: Vec<(&str, Box<MetaEdit>)> = vec![
        ("n_sparsity_levels", Box::new(move |m| put32(m, levels_at, 1000))),
        // One level more shifts the scores flag onto threshold bytes.
        ("has_neuron_scores", Box::new(move |m| put32(m, levels_at, 3))),
        (
            "sparsity[0].sparsity",
            Box::new(move |m| put32(m, levels_at + 4, 1.5f32.to_bits())),
        ),
        (
            "sparsity[1].full[0]",
            Box::new(move |m| put32(m, levels_at + 4 + level_len + 4, f32::NAN.to_bits())),
        ),
        (
            "sparsity[0].gate[1]",
            Box::new(move |m| put32(m, levels_at + 8 + (n_layer + 1) * 4, (-1.0f32).to_bits())),
        ),
        ("has_neuron_scores", Box::new(move |m| put32(m, scores_flag_at, 7))),
        (
            "neuron_scores[0][2]",
            Box::new(move |m| put32(m, scores_flag_at + 12, f32::INFINITY.to_bits())),
        ),
    ];
    for (k, (field, edit)) in cases.into_iter().enumerate() {
        let p = forged(&good, &format!("forged_levels_{k}.lsflash"), edit);
        let msg = open_err(&p);
        eprintln!("{field}: {msg}");
        assert!(msg.contains(&format!("'{field}'")), "{field}: {msg}");
    }
}
