//! Every kept input through its target: the seeds (valid files our tools
//! made) must be accepted, and every input a fuzzer once crashed on must now
//! come back as a clean result, never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use leanstream_fuzz::{corpus_root, run, Scratch, Target};

fn files(target: Target, kind: &str) -> Vec<PathBuf> {
    let dir = corpus_root().join(target.name()).join(kind);
    let mut v: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd.map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

#[test]
fn every_seed_is_accepted_and_every_kept_crash_is_handled() {
    let mut failures = Vec::new();
    let mut seen = 0;
    for t in Target::ALL {
        let seeds = files(t, "seeds");
        assert!(!seeds.is_empty(), "no seeds for target {}", t.name());
        let scratch = Scratch::prepare(t, &corpus_root().join(t.name())).unwrap();
        for (kind, list) in [("seed", seeds), ("crash", files(t, "crashes"))] {
            for f in list {
                seen += 1;
                let data = std::fs::read(&f).unwrap();
                match catch_unwind(AssertUnwindSafe(|| run(t, &data, &scratch))) {
                    Err(_) => failures.push(format!("{}: panicked", f.display())),
                    Ok(Err(e)) if kind == "seed" => failures.push(format!("{}: seed rejected: {e}", f.display())),
                    Ok(_) => {}
                }
            }
        }
    }
    eprintln!("{seen} inputs replayed");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
