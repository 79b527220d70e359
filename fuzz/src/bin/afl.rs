//! The AFL++ entry point: `leanstream-fuzz-afl TARGET`, input on stdin, in
//! AFL's persistent mode. Built and run by `scripts/fuzz.sh`.

use leanstream_fuzz::{corpus_root, run, Scratch, Target};

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let target = Target::parse(&name).unwrap_or_else(|| {
        let names: Vec<_> = Target::ALL.iter().map(|t| t.name()).collect();
        eprintln!("usage: leanstream-fuzz-afl TARGET (one of {})", names.join(", "));
        std::process::exit(2)
    });
    let scratch = Scratch::prepare(target, &corpus_root().join(target.name()))
        .unwrap_or_else(|e| panic!("scratch directory: {e}"));
    // No abort-on-panic hook: a panic a reader catches and reports (the
    // Parquet reader's, say) is handled; one that escapes still aborts.
    afl::fuzz_nohook!(|data: &[u8]| {
        let _ = run(target, data, &scratch);
    });
}
