//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

/// Path of a reference model ("smollm2" or "gemma3"): `$LEANSTREAM_SMOLLM2` /
/// `$LEANSTREAM_GEMMA3` when set, else the `leanstream fetch` cache. A
/// missing model fails the test unless `LEANSTREAM_ALLOW_MISSING_MODELS=1`
/// (then a SKIPPED line and `None`).
pub fn model_path(name: &str) -> Option<PathBuf> {
    leanstream_runtime::fetch::reference_model(name).unwrap_or_else(|e| panic!("{e}"))
}

/// Greedy tokens and the logits before each.
pub type Run = (Vec<u32>, Vec<Vec<f32>>);

/// Greedy decoding of `n` tokens after `prompt` with a `.lsflash` model's engine.
pub fn greedy_flash(
    fm: &leanstream_runtime::engine::FlashModel,
    engine: &mut leanstream_runtime::engine::FlashEngine,
    prompt: &[u32],
    n: usize,
) -> leanstream_runtime::Result<Run> {
    let mut st = fm.model.new_state(prompt.len() + n + 1, prompt.len().max(8), 1);
    let (mut toks, mut logits) = (Vec::new(), Vec::new());
    fm.forward(&mut st, engine, prompt, 0, prompt.len() - 1..prompt.len())?;
    for pos in prompt.len()..prompt.len() + n {
        let l = fm.model.logits(&mut st, 0, 1)?.to_vec();
        let tok = leanstream_runtime::generate::argmax(&l);
        toks.push(tok);
        logits.push(l);
        fm.forward(&mut st, engine, &[tok], pos, 0..1)?;
    }
    Ok((toks, logits))
}

/// Greedy decoding of `n` tokens after `prompt` with the GGUF engine on `src`.
pub fn greedy_gguf(src: &std::path::Path, prompt: &[u32], n: usize) -> Run {
    let m = leanstream_runtime::model::Model::load(src).unwrap();
    let mut st = m.new_state(prompt.len() + n + 1, prompt.len(), 1);
    let (mut toks, mut logits) = (Vec::new(), Vec::new());
    m.forward_outputs(&mut st, prompt, 0, prompt.len() - 1..prompt.len())
        .unwrap();
    for pos in prompt.len()..prompt.len() + n {
        let l = m.logits(&mut st, 0, 1).unwrap().to_vec();
        let tok = leanstream_runtime::generate::argmax(&l);
        toks.push(tok);
        logits.push(l);
        m.forward(&mut st, &[tok], pos).unwrap();
    }
    (toks, logits)
}

/// Whether two runs have the same tokens and bit-identical logits.
pub fn same_bits(a: &Run, b: &Run) -> bool {
    a.0 == b.0
        && a.1.len() == b.1.len()
        && a.1
            .iter()
            .zip(&b.1)
            .all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// Packs `src` into `dir/NAME.lsflash` with `down` columns or tiles and an
/// optional placement, without thresholds.
pub fn pack_down(
    dir: &std::path::Path,
    src: &std::path::Path,
    name: &str,
    placement: Option<Vec<Vec<u32>>>,
    down: leanstream_runtime::flash::DownType,
) -> PathBuf {
    let out = dir.join(format!("{name}.lsflash"));
    let opts = leanstream_runtime::flash::PackOptions {
        down,
        placement,
        sparsity: Vec::new(),
        neuron_scores: Vec::new(),
        progress: false,
    };
    leanstream_runtime::flash::pack(src, &out, &opts).unwrap();
    out
}
