//! Down tiles: with every group the tiled product is the dense path's
//! matmul on the source matrix bit for bit (decode and prompt rows, repacked
//! Q4_K and the tiled K-quant products included); a subset of groups is the
//! product over those columns; the scalar twin agrees with `matmul_scalar`;
//! bad calls are errors.

mod common;

use common::{random_weight_row, Aligned, Rng};
use leanstream_kernels::matmul::matmul_scalar;
use leanstream_kernels::sparse_ffn::tiles::{part_bytes, tile_bytes, tile_of, tile_part};
use leanstream_kernels::sparse_ffn::*;
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};

/// A layer in tiles: the source down matrix and bundles (gate/up filler + parts).
struct Tiled {
    format: BundleFormat,
    n_ff: usize,
    down: Aligned,
    bundles: Aligned,
}

impl Tiled {
    fn new(down_ty: GgmlType, n_embd: usize, n_ff: usize, rng: &mut Rng) -> Self {
        let q8 = GgmlType::Q8_0;
        let format = BundleFormat::new(q8, q8, down_ty, DownLayout::Tiles, n_embd).unwrap();
        let mut down = Vec::new();
        for _ in 0..n_embd {
            down.extend_from_slice(random_weight_row(down_ty, n_ff, rng).as_ref());
        }
        let (bb, p) = (format.bundle_bytes(), format.down_bytes());
        assert_eq!(p, part_bytes(down_ty, n_embd).unwrap());
        let g = format.group();
        let mut bundles = Aligned::zeroed(n_ff * bb);
        let mut tile = vec![0u8; tile_bytes(down_ty, n_embd).unwrap()];
        for grp in 0..n_ff / g {
            tile_of(down_ty, n_embd, n_ff, &down, grp, &mut tile).unwrap();
            for k in 0..g {
                let i = grp * g + k;
                let b = &mut bundles.as_mut()[i * bb..(i + 1) * bb];
                for x in &mut b[..bb - p] {
                    *x = rng.byte();
                }
                tile_part(down_ty, n_embd, &tile, k, &mut b[bb - p..]).unwrap();
            }
        }
        Self {
            format,
            n_ff,
            down: Aligned::from_bytes(&down),
            bundles,
        }
    }

    fn bundle(&self, i: usize) -> &[u8] {
        let bb = self.format.bundle_bytes();
        &self.bundles.as_ref()[i * bb..(i + 1) * bb]
    }

    /// The source matrix times `a` (`[n][n_ff]`), as the dense path computes it.
    fn dense(&self, a: &[f32], n: usize, scalar: bool) -> Vec<f32> {
        let (ty, d) = (self.format.down_ty, self.format.n_embd);
        let w = QMatrix::new(ty, d, self.n_ff, self.down.as_ref()).unwrap();
        let mut acts = ActBuffer::with_capacity(self.n_ff, n);
        acts.quantize(ty.vec_dot_type(), a, n, self.n_ff).unwrap();
        let mut y = vec![0.0; n * d];
        if scalar {
            matmul_scalar(&w, &acts, &mut y).unwrap();
        } else {
            matmul(&w, &acts, &mut y).unwrap();
        }
        y
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Down types of both block sizes; 64 rows (a multiple of 8) makes Q4_K
/// the repacked product, and 9 activation rows take the tiled K-quant path.
const TYPES: [GgmlType; 6] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q5K,
];

#[test]
fn all_groups_give_the_dense_matmul_bit_for_bit() {
    let mut rng = Rng::new(11);
    for ty in TYPES {
        let n_ff = 2 * ty.block_size() * 3;
        let layer = Tiled::new(ty, 64, n_ff, &mut rng);
        let groups: Vec<u32> = (0..(n_ff / layer.format.group()) as u32).collect();
        let mut tiles = DownTiles::new();
        for n in [1, 3, 9] {
            let a = rng.activations(n * n_ff);
            let mut y = vec![0.0; n * 64];
            tiles
                .run(&layer.format, &groups, &a, n_ff, |i| layer.bundle(i), &mut y)
                .unwrap();
            assert_eq!(bits(&y), bits(&layer.dense(&a, n, false)), "{ty} with {n} rows");
            let mut ys = vec![0.0; n * 64];
            tiles
                .run_scalar(&layer.format, &groups, &a, n_ff, |i| layer.bundle(i), &mut ys)
                .unwrap();
            assert_eq!(bits(&ys), bits(&layer.dense(&a, n, true)), "{ty} scalar with {n} rows");
            // The whole matrix held resident: the same product.
            let mut yr = vec![0.0; n * 64];
            tiles
                .run_matrix(ty, layer.down.as_ref(), 64, &a, n_ff, &mut yr)
                .unwrap();
            assert_eq!(bits(&yr), bits(&y), "{ty} resident with {n} rows");
        }
    }
}

#[test]
fn a_subset_of_groups_is_the_product_with_the_rest_zeroed() {
    let mut rng = Rng::new(12);
    for ty in [GgmlType::Q4_0, GgmlType::Q6K, GgmlType::F16] {
        let n_ff = ty.block_size() * 6;
        let layer = Tiled::new(ty, 64, n_ff, &mut rng);
        let g = layer.format.group();
        let groups = [1u32, 2, 4];
        let mut a = rng.activations(2 * n_ff);
        for (i, v) in a.iter_mut().enumerate() {
            if !groups.contains(&(((i % n_ff) / g) as u32)) {
                *v = 0.0;
            }
        }
        let mut y = vec![0.0; 2 * 64];
        DownTiles::new()
            .run(&layer.format, &groups, &a, n_ff, |i| layer.bundle(i), &mut y)
            .unwrap();
        // Absent groups are zero blocks in place: exact zeros at the same
        // positions, so the same bits as the whole matrix.
        assert_eq!(bits(&y), bits(&layer.dense(&a, 2, false)), "{ty}");
        let mut none = vec![1.0; 2 * 64];
        DownTiles::new()
            .run(&layer.format, &[], &a, n_ff, |i| layer.bundle(i), &mut none)
            .unwrap();
        assert!(none.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn tile_calls_with_bad_input_are_errors() {
    let mut rng = Rng::new(13);
    let layer = Tiled::new(GgmlType::Q4_0, 64, 128, &mut rng);
    let a = vec![0.5f32; 128];
    let mut y = vec![0.0; 64];
    let mut t = DownTiles::new();
    let f = &layer.format;
    assert!(
        t.run(f, &[1, 0], &a, 128, |i| layer.bundle(i), &mut y).is_err(),
        "descending groups"
    );
    assert!(
        t.run(f, &[4], &a, 128, |i| layer.bundle(i), &mut y).is_err(),
        "group out of range"
    );
    assert!(
        t.run(f, &[0], &a[..100], 128, |i| layer.bundle(i), &mut y).is_err(),
        "short activations"
    );
    assert!(
        t.run(f, &[0], &a, 128, |i| &layer.bundle(i)[1..], &mut y).is_err(),
        "short bundle"
    );
    let columns = BundleFormat::new(GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0, DownLayout::Columns, 64).unwrap();
    assert!(
        t.run(&columns, &[0], &a, 128, |i| layer.bundle(i), &mut y).is_err(),
        "columns format"
    );
    // The per-neuron column kernels refuse tiles.
    let ids = [0u32];
    assert!(run_down(f, &ids, &a, 128, |i| layer.bundle(i), &mut y).is_err());
    assert!(BundleFormat::new(GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8K, DownLayout::Tiles, 64).is_err());
}

/// Parts put one neuron at a time, in any order, over a matrix an earlier
/// layer of another type left behind, give `run`'s bits for the same groups.
#[test]
fn parts_put_in_any_order_give_the_gathered_product() {
    let mut rng = Rng::new(14);
    let mut tiles = DownTiles::new();
    // 96 rows cut 32-neuron tiles into parts that are not whole blocks.
    for (ty, d) in TYPES.into_iter().flat_map(|ty| [(ty, 64), (ty, 96)]) {
        let n_ff = ty.block_size() * 6;
        let layer = Tiled::new(ty, d, n_ff, &mut rng);
        let g = layer.format.group();
        for groups in [vec![0u32, 1, 2, 3, 4, 5], vec![1, 4], vec![]] {
            // Whatever the last layer left: every neuron of this one.
            tiles.begin(&layer.format, n_ff).unwrap();
            for i in 0..n_ff {
                tiles.put(&layer.format, i, layer.bundle(i)).unwrap();
            }
            let _ = tiles.run_gathered(&layer.format, &[], &vec![0.0; n_ff], n_ff, &mut vec![0.0; d]);
            // Now only `groups`, their members in a scrambled order.
            let mut members: Vec<usize> = groups
                .iter()
                .flat_map(|&grp| (grp as usize * g..(grp as usize + 1) * g).collect::<Vec<_>>())
                .collect();
            for k in (1..members.len()).rev() {
                members.swap(k, rng.next_u64() as usize % (k + 1));
            }
            let a = rng.activations(3 * n_ff);
            tiles.begin(&layer.format, n_ff).unwrap();
            for &i in &members {
                tiles.put(&layer.format, i, layer.bundle(i)).unwrap();
            }
            let mut put = vec![0.0; 3 * d];
            tiles.run_gathered(&layer.format, &groups, &a, n_ff, &mut put).unwrap();
            let mut gathered = vec![0.0; 3 * d];
            DownTiles::new()
                .run(&layer.format, &groups, &a, n_ff, |i| layer.bundle(i), &mut gathered)
                .unwrap();
            assert_eq!(bits(&put), bits(&gathered), "{ty}, n_embd {d}, groups {groups:?}");
        }
    }
    // A part outside a begun layer, or a product of a layer not begun, is an error.
    let layer = Tiled::new(GgmlType::Q4_0, 64, 128, &mut rng);
    let mut t = DownTiles::new();
    assert!(t.put(&layer.format, 0, layer.bundle(0)).is_err(), "not begun");
    t.begin(&layer.format, 128).unwrap();
    assert!(t.put(&layer.format, 128, layer.bundle(0)).is_err(), "neuron past n_ff");
    assert!(t.put(&layer.format, 0, &layer.bundle(0)[1..]).is_err(), "short bundle");
    assert!(t
        .run_gathered(&layer.format, &[1, 0], &[0.0; 128], 128, &mut [0.0; 64])
        .is_err());
    t.run_gathered(&layer.format, &[0], &[0.0; 128], 128, &mut [0.0; 64])
        .unwrap();
    assert!(
        t.run_gathered(&layer.format, &[0], &[0.0; 128], 128, &mut [0.0; 64])
            .is_err(),
        "a second product without begin"
    );
}
