//! The artifacts that drive a `.lsflash` model's streaming: the predictor
//! (`.lspred`) and the controller (`.lstab`, or a fixed action). Named on
//! the command line, or found beside the model without flags:
//!
//! - predictor: `<stem>.lspred`, else `predictor.lspred`, in the model's
//!   folder (`dejavu` and `llm-in-a-flash`, whose originals use a low-rank
//!   predictor, look for `<stem>.lowrank.lspred` first);
//! - controller: `<stem>.lstab`, else `controller.lstab`, in the model's
//!   folder, else the table built into the binary (`data/controller/`);
//! - retention table of the learned cache policy: `<stem>.lsevict`, else
//!   `eviction.lsevict`, in the model's folder.
//!
//! (`<stem>` is the model file's name without `.lsflash`.) A predictor or a
//! retention table is checked against the model it is given to: its
//! provenance names the SHA-256 of the GGUF its traces were recorded on,
//! which must be the `.lsflash` file's source, and its shape must be the
//! model's. A controller table made with `leanstream-synth controller
//! --flash` names its model the same way and is refused for another; one
//! that names only the shape it was solved for (the built-in table) is used
//! with a warning when that shape is not the model's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::RetentionTable;
use crate::control::ControlTable;
use crate::engine::{Controller, FlashModel, Policy, Speculation};
use crate::predict::Predictor;
use crate::{Result, RuntimeError};

/// The table in `data/controller/`, built in so the runtime binary needs no
/// repository checkout.
const BUILT_IN_TABLE: &[u8] = include_bytes!("../../data/controller/controller.lstab");
const BUILT_IN_NAME: &str = "built-in data/controller/controller.lstab";

/// The first of `<stem>.<ext>` and `<fallback>` that exists in the folder of `model`.
fn beside(model: &Path, ext: &str, fallback: &str) -> Option<PathBuf> {
    let dir = model.parent().unwrap_or(Path::new("."));
    let stem = model.file_stem()?.to_string_lossy().into_owned();
    [dir.join(format!("{stem}.{ext}")), dir.join(fallback)]
        .into_iter()
        .find(|p| p.is_file())
}

/// The predictor file beside `model`, if there is one.
pub fn predictor_beside(model: &Path) -> Option<PathBuf> {
    beside(model, "lspred", "predictor.lspred")
}

/// The predictor a `policy` engine over `model` uses when none is named.
pub fn predictor_beside_for(model: &Path, policy: Policy) -> Option<PathBuf> {
    let low_rank = matches!(policy, Policy::DejaVu | Policy::LlmInAFlash)
        .then(|| beside(model, "lowrank.lspred", "predictor.lowrank.lspred"))
        .flatten();
    low_rank.or_else(|| predictor_beside(model))
}

/// The controller table beside `model`, if there is one.
pub fn controller_beside(model: &Path) -> Option<PathBuf> {
    beside(model, "lstab", "controller.lstab")
}

/// The retention table beside `model`, if there is one.
pub fn retention_beside(model: &Path) -> Option<PathBuf> {
    beside(model, "lsevict", "eviction.lsevict")
}

/// Loads the retention table at `path` and checks it was made for `fm`'s model.
pub fn load_retention(path: &Path, fm: &FlashModel) -> Result<RetentionTable> {
    let t = RetentionTable::load(path).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
    check_source(t.model_sha(), path, "retention table", fm)?;
    let (n_layer, n_ff) = (fm.flash.n_layer(), fm.flash.n_ff());
    if (t.n_layer, t.n_ff) != (n_layer, n_ff) {
        return Err(RuntimeError::Invalid(format!(
            "{}: retention table for {} layers × {} neurons (fields n_layer, n_ff), {} has {n_layer} × {n_ff}",
            path.display(),
            t.n_layer,
            t.n_ff,
            fm.flash.path().display()
        )));
    }
    Ok(t)
}

/// Refuses an artifact whose provenance names no model, or another model
/// than `fm`'s source GGUF.
fn check_source(sha: Option<String>, path: &Path, what: &str, fm: &FlashModel) -> Result<()> {
    let model = fm.flash.path().display();
    match sha {
        None => Err(RuntimeError::Invalid(format!(
            "{}: the {what}'s provenance does not name the model it was made for (field `model.sha256`); \
             make it with leanstream-synth on traces of {model}'s source GGUF",
            path.display()
        ))),
        Some(sha) => check_named_source(&sha, &path.display().to_string(), what, fm),
    }
}

/// Checks that `gguf` is the file `fm` was packed from (its length, then
/// its SHA-256 against the header's), so that a quality reference or a
/// comparison run uses the model the packed file stands for.
pub fn check_source_gguf(gguf: &Path, fm: &FlashModel) -> Result<()> {
    let h = fm.flash.header();
    let refuse = |what: String| {
        Err(RuntimeError::Invalid(format!(
            "{}: not the GGUF {} was packed from ({what})",
            gguf.display(),
            fm.flash.path().display()
        )))
    };
    let len = std::fs::metadata(gguf).map_err(|e| RuntimeError::io(gguf, e))?.len();
    if len != h.source_len {
        return refuse(format!("{len} bytes; the packed file records {}", h.source_len));
    }
    let (sha, _) = crate::flash::format::sha256_file(gguf)?;
    if sha != h.source_sha256 {
        return refuse(format!(
            "SHA-256 {}; the packed file records {}",
            crate::fetch::hex(&sha),
            crate::fetch::hex(&h.source_sha256)
        ));
    }
    Ok(())
}

/// Refuses an artifact whose provenance names another model than `fm`'s source GGUF.
fn check_named_source(sha: &str, origin: &str, what: &str, fm: &FlashModel) -> Result<()> {
    let source = crate::fetch::hex(&fm.flash.header().source_sha256);
    if sha == source {
        return Ok(());
    }
    Err(RuntimeError::Invalid(format!(
        "{origin}: {what} made for another model (field `model.sha256` {sha}); {} was packed from a \
         GGUF with SHA-256 {source}",
        fm.flash.path().display()
    )))
}

/// Checks a controller table against the model it is to drive. A table that
/// names its model (`leanstream-synth controller --flash`) is refused for any
/// other; one that names only a shape (the built-in table, older tables) is
/// used, and the returned warning says when that shape is not `fm`'s.
pub fn check_controller(c: &Controller, fm: &FlashModel) -> Result<Option<String>> {
    let Controller::Table { table, origin } = c else {
        return Ok(None);
    };
    let m = table.provenance.model();
    if let Some(sha) = &m.sha256 {
        check_named_source(sha, origin, "controller table", fm)?;
    }
    let (n_layers, n_ff) = (fm.flash.n_layer(), fm.flash.n_ff());
    let bundle = fm.flash.layout(0).bundle_bytes();
    let same = m.n_layers.is_none_or(|x| x == n_layers)
        && m.n_ff.is_none_or(|x| x == n_ff)
        && m.bundle_bytes.is_none_or(|x| (x - bundle as f64).abs() < 0.5);
    if same {
        return Ok(None);
    }
    let shape = format!(
        "{} layers × {} neurons of {} bytes",
        m.n_layers.map_or("?".into(), |x| x.to_string()),
        m.n_ff.map_or("?".into(), |x| x.to_string()),
        m.bundle_bytes.map_or("?".into(), |x| x.to_string())
    );
    let model = fm.flash.path().display();
    if m.sha256.is_some() {
        // Named for this model but solved for another shape: the file was edited.
        return Err(RuntimeError::Invalid(format!(
            "{origin}: controller table solved for {shape} (fields model.n_layers, model.n_ff, \
             model.bundle_bytes), {model} has {n_layers} × {n_ff} of {bundle} bytes"
        )));
    }
    Ok(Some(format!(
        "warning: {origin}: controller table solved for {shape}, {model} has {n_layers} × {n_ff} of \
         {bundle} bytes; its actions may be far from optimal (make one for this model with \
         `leanstream-synth controller --flash {model}`)"
    )))
}

/// Loads the predictor at `path` and checks it was made for `fm`'s model.
pub fn load_predictor(path: &Path, fm: &FlashModel) -> Result<Predictor> {
    let p = Predictor::load(path).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
    check_predictor(&p, path, fm)?;
    Ok(p)
}

/// The SHA-256 (hex) of the model a predictor's provenance names.
pub fn predictor_model_sha(p: &Predictor) -> Option<String> {
    crate::binread::model_sha256(&serde_json::from_str(&p.provenance).ok()?)
}

/// Refuses a predictor made for another model (by hash) or shape.
pub fn check_predictor(p: &Predictor, path: &Path, fm: &FlashModel) -> Result<()> {
    check_source(predictor_model_sha(p), path, "predictor", fm)?;
    let model = fm.flash.path().display();
    let c = &p.config;
    let m = &fm.model.config;
    if (c.n_layer, c.d_model, c.n_ff) != (m.n_layer, m.n_embd, m.n_ff) {
        return Err(RuntimeError::Invalid(format!(
            "{}: predictor shape {} layers × {} × {} (fields n_layer, d_model, n_ff), {model} has {} × {} × {}",
            path.display(),
            c.n_layer,
            c.d_model,
            c.n_ff,
            m.n_layer,
            m.n_embd,
            m.n_ff
        )));
    }
    Ok(())
}

/// The controller `spec` names: `fixed:K=..,b=..,d=..,q=..`, a table file,
/// or (`None`) the table beside `model`, else the built-in one.
pub fn load_controller(spec: Option<&str>, model: &Path) -> Result<Controller> {
    let table = |path: &Path| -> Result<Controller> {
        let t = ControlTable::load(path).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        Ok(Controller::Table {
            table: Arc::new(t),
            origin: path.display().to_string(),
        })
    };
    match spec {
        Some(s) if s == "fixed" || s.starts_with("fixed:") => Controller::parse_fixed(s),
        Some(s) => table(Path::new(s)),
        None => match controller_beside(model) {
            Some(p) => table(&p),
            None => built_in_controller(),
        },
    }
}

/// The table of `data/controller/`, as built into this binary.
pub fn built_in_controller() -> Result<Controller> {
    let t = ControlTable::from_bytes(BUILT_IN_TABLE, Path::new(BUILT_IN_NAME))
        .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
    Ok(Controller::Table {
        table: Arc::new(t),
        origin: BUILT_IN_NAME.into(),
    })
}

/// What a predicting `policy` engine over `fm` (at `model`) runs with: the
/// predictor `predictor` (or the one beside the model) and the controller
/// `controller` (read by `speculate` only).
pub fn speculation(
    fm: &FlashModel,
    model: &Path,
    policy: Policy,
    predictor: Option<&Path>,
    controller: Option<&str>,
) -> Result<Speculation> {
    let path = match predictor {
        Some(p) => p.to_path_buf(),
        None => predictor_beside_for(model, policy).ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "{}: the {policy} policy needs a predictor: pass --predictor FILE or put {} beside the model \
                 (leanstream-synth predictor makes one)",
                model.display(),
                model.with_extension("lspred").display()
            ))
        })?,
    };
    let p = load_predictor(&path, fm)?;
    let controller = load_controller(controller, model)?;
    if let Some(w) = check_controller(&controller, fm)? {
        eprintln!("{w}");
    }
    Ok(Speculation {
        predictor: Arc::new(p),
        predictor_name: path.display().to_string(),
        controller,
        prior_breadth: Speculation::PRIOR_BREADTH,
    })
}
