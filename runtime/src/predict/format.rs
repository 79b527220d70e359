//! Reading and writing `.lspred` files (layout in the module doc of `predict`).

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::binread;

use super::{
    HashStage, HashingLayer, LowRankLayer, PredictError, Predictor, PredictorConfig, PredictorKind, PredictorLayer,
    QuantMatrix, MAX_STRING, MAX_USES, MAX_USE_NAME,
};

/// File magic of a predictor file.
pub const MAGIC: [u8; 8] = *b"LSPRED\0\n";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;

impl Predictor {
    /// Encodes the predictor (with its checksum) as the bytes of a `.lspred`
    /// file. Writes the vectors as they are, without validating; use
    /// [`Predictor::validate`] first for untrusted predictors ([`Predictor::save`] does).
    pub fn to_bytes(&self) -> Vec<u8> {
        let c = &self.config;
        let mut b = Vec::with_capacity(256 + self.provenance.len() + self.weight_bytes());
        b.extend_from_slice(&MAGIC);
        put_u32(&mut b, VERSION as usize);
        put_str(&mut b, &self.provenance);
        b.push(c.kind as u8);
        for v in [c.d_model, c.n_ff, c.group, c.n_layer] {
            put_u32(&mut b, v);
        }
        match c.kind {
            PredictorKind::Hashing => {
                for v in [c.d, c.tau, c.keys, c.stages] {
                    put_u32(&mut b, v);
                }
            }
            PredictorKind::LowRank => put_u32(&mut b, c.rank),
        }
        put_u32(&mut b, self.uses.len());
        for u in &self.uses {
            put_str(&mut b, u);
        }
        for layer in self.layers.iter().flatten() {
            match layer {
                PredictorLayer::Hashing(l) => {
                    put_quant(&mut b, &l.proj);
                    for s in &l.stages {
                        put_f32s(&mut b, &s.planes);
                        put_f32s(&mut b, &s.offsets);
                        for k in &s.keys {
                            b.extend_from_slice(&k.to_le_bytes());
                        }
                        put_f32s(&mut b, &s.shift);
                        put_i8s(&mut b, &s.lut);
                    }
                    put_f32s(&mut b, &l.bias);
                    b.extend_from_slice(&l.lut_scale.to_le_bytes());
                }
                PredictorLayer::LowRank(l) => {
                    put_quant(&mut b, &l.w1);
                    put_f32s(&mut b, &l.b1);
                    put_i8s(&mut b, &l.w2);
                    put_f32s(&mut b, &l.w2_scale);
                    put_f32s(&mut b, &l.b2);
                }
            }
        }
        let sum = Sha256::digest(&b);
        b.extend_from_slice(&sum);
        b
    }

    /// Decodes and validates the bytes of a `.lspred` file; `path` names it in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, PredictError> {
        let mut r: Reader = binread::checked_body(bytes, path, &MAGIC, VERSION)?;
        let provenance = r.string("provenance", MAX_STRING)?;
        let k = r.u8("kind")?;
        let kind = PredictorKind::from_u8(k).ok_or_else(|| r.invalid("kind", format!("unknown predictor kind {k}")))?;
        let d_model = r.u32("d_model")? as usize;
        let n_ff = r.u32("n_ff")? as usize;
        let group = r.u32("group")? as usize;
        let n_layer = r.u32("n_layer")? as usize;
        let config = match kind {
            PredictorKind::Hashing => {
                let d = r.u32("d")? as usize;
                let tau = r.u32("tau")? as usize;
                let keys = r.u32("keys")? as usize;
                let stages = r.u32("stages")? as usize;
                PredictorConfig::hashing(d_model, n_ff, group, n_layer, d, tau, keys, stages)
            }
            PredictorKind::LowRank => {
                let rank = r.u32("rank")? as usize;
                PredictorConfig::low_rank(d_model, n_ff, group, n_layer, rank)
            }
        };
        config.validate(path)?;
        let n_uses = r.u32("uses")? as usize;
        if n_uses == 0 || n_uses > MAX_USES {
            return Err(r.invalid("uses", format!("{n_uses} uses (1..={MAX_USES} allowed)")));
        }
        r.need(4 * n_uses as u64, "uses")?;
        let mut uses = Vec::with_capacity(n_uses);
        for _ in 0..n_uses {
            uses.push(r.string("use.name", MAX_USE_NAME)?);
        }
        // The dimensions fix the payload size: check it all before allocating any of it.
        let payload = config.layer_bytes() * config.n_layer as u64 * n_uses as u64;
        let left = r.left() as u64;
        if payload != left {
            return Err(r.invalid(
                "layers",
                format!("dimensions imply {payload} bytes of parameters, {left} present"),
            ));
        }
        let c = config;
        let g = c.n_groups();
        let mut layers = Vec::with_capacity(n_uses);
        for _ in 0..n_uses {
            let mut set = Vec::with_capacity(c.n_layer);
            for _ in 0..c.n_layer {
                let layer = match c.kind {
                    PredictorKind::Hashing => {
                        let proj = read_quant(&mut r, "proj", c.d, c.d_model)?;
                        let mut stages = Vec::with_capacity(c.stages);
                        for _ in 0..c.stages {
                            stages.push(HashStage {
                                planes: r.f32s(c.tau * c.d, "planes")?,
                                offsets: r.f32s(c.tau, "offsets")?,
                                keys: r.u64s(c.keys, "keys")?,
                                shift: r.f32s(c.keys * c.d, "shift")?,
                                lut: r.i8s(c.keys * g, "lut")?,
                            });
                        }
                        PredictorLayer::Hashing(HashingLayer {
                            proj,
                            stages,
                            bias: r.f32s(g, "bias")?,
                            lut_scale: r.f32("lut_scale")?,
                        })
                    }
                    PredictorKind::LowRank => PredictorLayer::LowRank(LowRankLayer {
                        w1: read_quant(&mut r, "w1", c.rank, c.d_model)?,
                        b1: r.f32s(c.rank, "b1")?,
                        w2: r.i8s(g * c.rank, "w2")?,
                        w2_scale: r.f32s(g, "w2_scale")?,
                        b2: r.f32s(g, "b2")?,
                    }),
                };
                set.push(layer);
            }
            layers.push(set);
        }
        let p = Predictor {
            config,
            provenance,
            uses,
            layers,
        };
        p.validate(path)?;
        Ok(p)
    }

    /// Reads and decodes `path`.
    pub fn load(path: &Path) -> Result<Self, PredictError> {
        let bytes = std::fs::read(path).map_err(|source| PredictError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, path)
    }

    /// Validates, then writes the file whole or not at all ([`crate::durable`]).
    pub fn save(&self, path: &Path) -> Result<(), PredictError> {
        self.validate(path)?;
        crate::durable::write(path, &self.to_bytes()).map_err(|source| PredictError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

fn put_u32(b: &mut Vec<u8>, v: usize) {
    b.extend_from_slice(&(v as u32).to_le_bytes());
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    put_u32(b, s.len());
    b.extend_from_slice(s.as_bytes());
}

fn put_f32s(b: &mut Vec<u8>, v: &[f32]) {
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
}

fn put_i8s(b: &mut Vec<u8>, v: &[i8]) {
    b.extend(v.iter().map(|&x| x as u8));
}

fn put_quant(b: &mut Vec<u8>, m: &QuantMatrix) {
    put_i8s(b, &m.q);
    put_f32s(b, &m.scales);
}

type Reader<'a> = binread::Reader<'a, PredictError>;

crate::impl_field_error!(PredictError);

fn read_quant(r: &mut Reader, field: &'static str, rows: usize, cols: usize) -> Result<QuantMatrix, PredictError> {
    Ok(QuantMatrix {
        rows,
        cols,
        q: r.i8s(rows * cols, field)?,
        scales: r.f32s(rows, field)?,
    })
}
