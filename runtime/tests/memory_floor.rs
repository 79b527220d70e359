//! A run state sized for a long context holds memory only for the positions
//! written: a process refused by its memory budget (or one in a memory
//! cgroup) is not charged for a KV cache it has not used. Alone in its test
//! binary, so no other test moves the resident set while it measures.

use leanstream_kernels::GgmlType;
use leanstream_runtime::cache::rss_bytes;
use leanstream_runtime::model::Model;
use leanstream_runtime::synthetic::SyntheticSpec;

#[test]
fn a_long_context_costs_memory_only_as_it_fills() {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    spec.context_length = 1 << 16;
    spec.n_layer = 8;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("memory_floor.gguf");
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let m = Model::load(&src).unwrap();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let before = rss_bytes();
    let mut st = m.new_state(1 << 16, 1, 1);
    let kv = st.kv.bytes() as u64;
    let allocated = rss_bytes();
    eprintln!(
        "KV cache {:.1} MiB; resident set {:.1} -> {:.1} MiB",
        mib(kv),
        mib(before),
        mib(allocated)
    );
    assert!(kv >= 64 << 20, "the test needs a large cache: {kv} bytes");
    assert!(
        allocated < before + kv / 8,
        "making the state made {:.1} MiB of its {:.1} MiB cache resident",
        mib(allocated.saturating_sub(before)),
        mib(kv)
    );
    // Running positions does write the cache: it is real memory, not a view.
    for pos in 0..64 {
        m.forward(&mut st, &[(pos % 200) as u32 + 3], pos).unwrap();
    }
    assert!(m.logits(&mut st, 0, 1).unwrap().iter().all(|v| v.is_finite()));
}
