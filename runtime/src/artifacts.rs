//! The artifacts that drive a `.lsflash` model's streaming: the predictor
//! (`.lspred`) and the controller (`.lstab`, or a fixed action). Named on
//! the command line, or found beside the model without flags:
//!
//! - predictor: `<stem>.lspred`, else `predictor.lspred`, in the model's folder;
//! - controller: `<stem>.lstab`, else `controller.lstab`, in the model's
//!   folder, else the table built into the binary (`data/controller/`).
//!
//! (`<stem>` is the model file's name without `.lsflash`.) A predictor is
//! checked against the model it is given to: its provenance names the
//! SHA-256 of the GGUF its traces were recorded on, which must be the
//! `.lsflash` file's source, and its shape must be the model's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::control::ControlTable;
use crate::engine::{Controller, FlashModel, Speculation};
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

/// The controller table beside `model`, if there is one.
pub fn controller_beside(model: &Path) -> Option<PathBuf> {
    beside(model, "lstab", "controller.lstab")
}

/// Loads the predictor at `path` and checks it was made for `fm`'s model.
pub fn load_predictor(path: &Path, fm: &FlashModel) -> Result<Predictor> {
    let p = Predictor::load(path).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
    check_predictor(&p, path, fm)?;
    Ok(p)
}

/// The SHA-256 (hex) of the model a predictor's provenance names.
pub fn predictor_model_sha(p: &Predictor) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&p.provenance).ok()?;
    v.get("model")?.get("sha256")?.as_str().map(str::to_ascii_lowercase)
}

/// Refuses a predictor made for another model (by hash) or shape.
pub fn check_predictor(p: &Predictor, path: &Path, fm: &FlashModel) -> Result<()> {
    let source = crate::fetch::hex(&fm.flash.header().source_sha256);
    let model = fm.flash.path().display();
    match predictor_model_sha(p) {
        None => {
            return Err(RuntimeError::Invalid(format!(
                "{}: the predictor's provenance does not name the model it was made for (field `model.sha256`); \
                 train it with leanstream-synth predictor on traces of {model}'s source GGUF",
                path.display()
            )))
        }
        Some(sha) if sha != source => {
            return Err(RuntimeError::Invalid(format!(
                "{}: predictor made for another model (field `model.sha256` {sha}); {model} was packed from a \
                 GGUF with SHA-256 {source}",
                path.display()
            )))
        }
        Some(_) => {}
    }
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

/// What a `speculate` engine over `fm` (at `model`) runs with: the predictor
/// `predictor` (or the one beside the model) and the controller `controller`.
pub fn speculation(
    fm: &FlashModel,
    model: &Path,
    predictor: Option<&Path>,
    controller: Option<&str>,
) -> Result<Speculation> {
    let path = match predictor {
        Some(p) => p.to_path_buf(),
        None => predictor_beside(model).ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "{}: the speculate policy needs a predictor: pass --predictor FILE or put {} beside the model \
                 (leanstream-synth predictor makes one)",
                model.display(),
                model.with_extension("lspred").display()
            ))
        })?,
    };
    let p = load_predictor(&path, fm)?;
    Ok(Speculation {
        predictor: Arc::new(p),
        predictor_name: path.display().to_string(),
        controller: load_controller(controller, model)?,
    })
}
