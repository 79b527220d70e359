//! The controller table format and lookup.

use std::path::{Path, PathBuf};

use leanstream_runtime::control::{
    state_at, Action, Axis, AxisKind, ControlError, ControlState, ControlTable, Provenance, TraceHash, VERSION,
};
use sha2::{Digest, Sha256};

fn axis(kind: AxisKind, centers: &[f64]) -> Axis {
    Axis {
        kind,
        thresholds: centers.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect(),
        centers: centers.to_vec(),
    }
}

fn sample() -> ControlTable {
    let axes = vec![
        axis(AxisKind::QueuedBytes, &[0.0, 1e5, 3e5]),
        axis(AxisKind::MissingBytes, &[1e5, 5e5]),
        axis(AxisKind::ReadBandwidth, &[1e8, 1e9, 2e9]),
        axis(AxisKind::ComputeNsPerNeuron, &[50.0, 100.0]),
        axis(AxisKind::LayerPosition, &[0.2, 0.6, 0.95]),
    ];
    let codebook: Vec<Action> = (0..5)
        .map(|i| Action {
            stages: 1 + i as u8,
            queue_depth: 1 << i,
            prefetch_breadth: 1.0 + i as f32 * 0.5,
            deadline_factor: 2.0,
        })
        .collect();
    let n: usize = axes.iter().map(Axis::bins).product();
    ControlTable {
        provenance: Provenance {
            device_fingerprint: "x86_64/test cpu/2cpu/24GiB".into(),
            seed: 7,
            solver_settings: r#"{"horizon":3}"#.into(),
            traces: vec![TraceHash {
                name: "io/shards/shard-000000.parquet".into(),
                sha256: [0xab; 32],
            }],
        },
        axes,
        codebook,
        codes: (0..n).map(|i| (i * 7 % 5) as u8).collect(),
    }
}

fn p() -> PathBuf {
    PathBuf::from("/tmp/some/controller.lstab")
}

fn resum(b: &mut [u8]) {
    let n = b.len() - 32;
    let sum = Sha256::digest(&b[..n]);
    b[n..].copy_from_slice(&sum);
}

#[test]
fn round_trip_bytes_and_file() {
    let t = sample();
    let bytes = t.to_bytes();
    assert_eq!(ControlTable::from_bytes(&bytes, &p()).unwrap(), t);
    let dir = std::env::temp_dir().join(format!("lstab-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("c.lstab");
    t.save(&f).unwrap();
    let l = ControlTable::load_for(&f, "x86_64/test cpu/2cpu/24GiB").unwrap();
    assert_eq!(l.table, t);
    assert!(l.fingerprint_warning.is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn different_device_loads_with_warning_naming_file() {
    let t = sample();
    let dir = std::env::temp_dir().join(format!("lstab-fp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("other.lstab");
    t.save(&f).unwrap();
    let l = ControlTable::load_for(&f, "aarch64/phone/8cpu/8GiB").unwrap();
    let w = l.fingerprint_warning.expect("warning");
    assert!(
        w.contains("other.lstab") && w.contains("aarch64/phone") && w.contains("test cpu"),
        "{w}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_flipped_byte_is_rejected() {
    let bytes = sample().to_bytes();
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x5a;
        let e = ControlTable::from_bytes(&b, &p()).expect_err("corrupt accepted");
        assert!(e.to_string().contains("controller.lstab"), "{e}");
    }
    let mut b = bytes.clone();
    b[40] ^= 1;
    assert!(matches!(
        ControlTable::from_bytes(&b, &p()),
        Err(ControlError::Checksum { .. })
    ));
}

#[test]
fn every_truncation_is_rejected() {
    let bytes = sample().to_bytes();
    for n in 0..bytes.len() {
        let e = ControlTable::from_bytes(&bytes[..n], &p()).expect_err("truncated accepted");
        assert!(e.to_string().contains("controller.lstab"), "{n}: {e}");
    }
}

#[test]
fn wrong_version_and_magic() {
    let mut b = sample().to_bytes();
    b[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
    resum(&mut b);
    let e = ControlTable::from_bytes(&b, &p()).unwrap_err();
    assert!(
        matches!(e, ControlError::Version { found, .. } if found == VERSION + 1),
        "{e}"
    );
    assert!(e.to_string().contains("version 2"), "{e}");
    let mut b = sample().to_bytes();
    b[0] = b'X';
    assert!(matches!(
        ControlTable::from_bytes(&b, &p()),
        Err(ControlError::Magic { .. })
    ));
}

#[test]
fn hostile_fields_with_valid_checksum() {
    let t = sample();
    // An action code past the codebook.
    let mut b = t.to_bytes();
    let n = b.len();
    b[n - 33] = 200;
    resum(&mut b);
    let e = ControlTable::from_bytes(&b, &p()).unwrap_err();
    assert!(matches!(e, ControlError::Invalid { field: "states", .. }), "{e}");
    // A huge fingerprint length: refused before allocating.
    let mut b = t.to_bytes();
    b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    resum(&mut b);
    assert!(ControlTable::from_bytes(&b, &p()).is_err());
    let mut b = t.to_bytes();
    b[12..16].copy_from_slice(&1000u32.to_le_bytes());
    resum(&mut b);
    assert!(matches!(
        ControlTable::from_bytes(&b, &p()),
        Err(ControlError::Truncated { .. })
    ));
    // Unsorted thresholds.
    let mut bad = t.clone();
    bad.axes[0].thresholds = vec![2e5, 1e5];
    assert!(bad.validate(Path::new("x.lstab")).is_err());
    let b = bad.to_bytes();
    assert!(ControlTable::from_bytes(&b, &p()).is_err());
}

#[test]
fn missing_file_names_it() {
    let e = ControlTable::load(Path::new("/nonexistent/dir/c.lstab")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/dir/c.lstab"), "{e}");
}

#[test]
fn lookup_picks_the_bin_of_each_axis() {
    let t = sample();
    // Indices worked out by hand from the axes of `sample`: bins 3, 2, 3, 2,
    // 3 with thresholds halfway between centers (queued 5e4, 2e5; missing
    // 3e5; bandwidth 5.5e8, 1.5e9; compute 75; position 0.4, 0.775). A value
    // on a threshold belongs to the bin above it; below the first
    // threshold, NaN and beyond the last clamp to the edge bins.
    let cases = [
        // bins (2, 1, 0, 0, 2): 2e5 sits on a threshold.
        (
            ControlState {
                queued_bytes: 2e5,
                missing_bytes: 5e5,
                read_bw_bytes_s: 5e8,
                compute_ns_per_neuron: 10.0,
                layer_position: 0.99,
            },
            92,
        ),
        // bins (0, 1, 0, 1, 2): out of range and NaN.
        (
            ControlState {
                queued_bytes: -1.0,
                missing_bytes: 1e12,
                read_bw_bytes_s: f64::NAN,
                compute_ns_per_neuron: 1e9,
                layer_position: 2.0,
            },
            23,
        ),
        // bins (2, 0, 2, 0, 0).
        (
            ControlState {
                queued_bytes: 3e5,
                missing_bytes: 0.0,
                read_bw_bytes_s: 2e9,
                compute_ns_per_neuron: 50.0,
                layer_position: 0.1,
            },
            84,
        ),
    ];
    for (s, want) in cases {
        assert_eq!(t.state_index(&s), want, "{s:?}");
        assert_eq!(*t.lookup(&s), t.codebook[want * 7 % 5], "{s:?}");
    }
    // Each cell's center maps back to the cell.
    for idx in 0..t.n_states() {
        assert_eq!(t.state_index(&state_at(&t.axes, idx)), idx);
    }
}
