//! A GGUF v3 writer: used to build test fixtures (including deliberately
//! broken ones) and synthetic models that llama.cpp can load too.

use std::io::Write;

use leanstream_kernels::GgmlType;

use super::{MetaArray, MetaValue};

const ALIGNMENT: usize = 32;

#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor with GGML dims (`dims[0]` contiguous) and its raw bytes.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// Serialises the whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut b, k);
            put_value(&mut b, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.id().to_le_bytes());
            b.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        let data_start = b.len().div_ceil(ALIGNMENT) * ALIGNMENT;
        b.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(data_start + off, 0);
            b.extend_from_slice(data);
        }
        b
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.to_bytes())
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(b: &mut Vec<u8>, v: &MetaValue) {
    b.extend_from_slice(&value_type(v).to_le_bytes());
    put_payload(b, v);
}

fn put_payload(b: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => b.push(*x),
        MetaValue::I8(x) => b.push(*x as u8),
        MetaValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => b.push(*x as u8),
        MetaValue::String(s) => put_str(b, s),
        MetaValue::Array(a) => put_array(b, a),
    }
}

fn put_array(b: &mut Vec<u8>, a: &MetaArray) {
    macro_rules! prim {
        ($ty:expr, $v:expr) => {{
            b.extend_from_slice(&($ty as u32).to_le_bytes());
            b.extend_from_slice(&($v.len() as u64).to_le_bytes());
            for x in $v {
                b.extend_from_slice(&x.to_le_bytes());
            }
        }};
    }
    match a {
        MetaArray::U8(v) => prim!(0, v),
        MetaArray::I8(v) => prim!(1, v),
        MetaArray::U16(v) => prim!(2, v),
        MetaArray::I16(v) => prim!(3, v),
        MetaArray::U32(v) => prim!(4, v),
        MetaArray::I32(v) => prim!(5, v),
        MetaArray::F32(v) => prim!(6, v),
        MetaArray::U64(v) => prim!(10, v),
        MetaArray::I64(v) => prim!(11, v),
        MetaArray::F64(v) => prim!(12, v),
        MetaArray::Bool(v) => {
            b.extend_from_slice(&7u32.to_le_bytes());
            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
            b.extend(v.iter().map(|&x| x as u8));
        }
        MetaArray::String(v) => {
            b.extend_from_slice(&8u32.to_le_bytes());
            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                put_str(b, s);
            }
        }
        MetaArray::Array(v) => {
            b.extend_from_slice(&9u32.to_le_bytes());
            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for inner in v {
                put_array(b, inner);
            }
        }
    }
}
