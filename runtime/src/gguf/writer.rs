//! A GGUF v3 writer: used to build test fixtures (including deliberately
//! broken ones) and synthetic models that llama.cpp can load too.

use std::io::Write;

use leanstream_kernels::GgmlType;

use super::{MetaArray, MetaValue};

const ALIGNMENT: usize = 32;

#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(TensorDesc, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor with GGML dims (`dims[0]` contiguous) and its raw bytes
    /// (taken as they are, so fixtures can give a wrong length on purpose).
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        let desc = TensorDesc {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            size: data.len() as u64,
        };
        self.tensors.push((desc, data));
        self
    }

    /// Serialises the whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        self.write_to(&mut b).expect("writing to a Vec cannot fail");
        b
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        let descs: Vec<TensorDesc> = self.tensors.iter().map(|(d, _)| d.clone()).collect();
        let mut s = GgufStreamWriter::new(w, &self.metadata, descs)?;
        for (_, data) in &self.tensors {
            s.write_data(data)?;
        }
        s.finish()?;
        Ok(())
    }
}

/// A tensor's entry in the header: name, GGML dims, type and data size in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub size: u64,
}

impl TensorDesc {
    /// A tensor whose size follows from its dims and type.
    pub fn new(name: &str, dims: &[u64], ty: GgmlType) -> Result<Self, leanstream_kernels::KernelError> {
        let rows: u64 = dims.iter().skip(1).product();
        let row_bytes = ty.row_bytes(dims.first().copied().unwrap_or(1) as usize)? as u64;
        Ok(Self {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            size: rows * row_bytes,
        })
    }
}

/// Writes a GGUF file front to back without holding its tensors: the header
/// (metadata and every tensor's offset, known from the sizes up front) goes
/// out first, then each tensor's bytes in order, in pieces of any size, with
/// the padding between tensors. The bytes equal [`GgufWriter::to_bytes`]'s
/// for the same contents.
pub struct GgufStreamWriter<W: Write> {
    w: W,
    tensors: Vec<TensorDesc>,
    /// The tensor being written and the bytes of it written so far.
    current: usize,
    written: u64,
    /// Bytes written to `w` so far.
    pos: u64,
}

impl<W: Write> GgufStreamWriter<W> {
    /// Writes the header; the tensors' data must follow in `tensors`' order.
    pub fn new(mut w: W, metadata: &[(String, MetaValue)], tensors: Vec<TensorDesc>) -> std::io::Result<Self> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut b, k);
            put_value(&mut b, v);
        }
        let mut offset = 0u64;
        for t in &tensors {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.id().to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.size).div_ceil(ALIGNMENT as u64) * ALIGNMENT as u64;
        }
        b.resize(b.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        w.write_all(&b)?;
        let mut s = Self {
            w,
            tensors,
            current: 0,
            written: 0,
            pos: b.len() as u64,
        };
        s.skip_finished()?;
        Ok(s)
    }

    /// Bytes of the file written so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Appends `data` to the current tensor's bytes; a piece may not run past
    /// the end of the tensor it belongs to.
    pub fn write_data(&mut self, data: &[u8]) -> std::io::Result<()> {
        let Some(t) = self.tensors.get(self.current) else {
            return Err(invalid(format!("{} bytes of data past the last tensor", data.len())));
        };
        let left = t.size - self.written;
        if data.len() as u64 > left {
            return Err(invalid(format!(
                "tensor '{}': {} more bytes given, {left} expected",
                t.name,
                data.len()
            )));
        }
        self.w.write_all(data)?;
        self.written += data.len() as u64;
        self.pos += data.len() as u64;
        self.skip_finished()
    }

    /// Checks every tensor was written in full and returns the sink.
    pub fn finish(mut self) -> std::io::Result<W> {
        if let Some(t) = self.tensors.get(self.current) {
            return Err(invalid(format!(
                "tensor '{}' (and {} after it) not written in full: {} of {} bytes",
                t.name,
                self.tensors.len() - self.current - 1,
                self.written,
                t.size
            )));
        }
        self.w.flush()?;
        Ok(self.w)
    }

    /// Moves past complete tensors, padding before the next one's start (the
    /// last tensor gets no padding after it).
    fn skip_finished(&mut self) -> std::io::Result<()> {
        while self.current < self.tensors.len() && self.written == self.tensors[self.current].size {
            self.current += 1;
            self.written = 0;
            if self.current < self.tensors.len() {
                let pad = self.pos.div_ceil(ALIGNMENT as u64) * ALIGNMENT as u64 - self.pos;
                self.w.write_all(&[0u8; ALIGNMENT][..pad as usize])?;
                self.pos += pad;
            }
        }
        Ok(())
    }
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, msg)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn descs() -> Vec<TensorDesc> {
        vec![
            TensorDesc::new("a", &[3], GgmlType::F32).unwrap(),
            TensorDesc::new("b", &[32, 2], GgmlType::Q4_0).unwrap(),
        ]
    }

    #[test]
    fn stream_writer_matches_in_memory_writer_for_any_piece_sizes() {
        let meta = vec![("k".to_string(), MetaValue::U32(5))];
        let a = vec![1u8; 12];
        let b: Vec<u8> = (0..36).collect();
        let mut mem = GgufWriter::new();
        mem.meta("k", MetaValue::U32(5));
        mem.tensor("a", &[3], GgmlType::F32, a.clone());
        mem.tensor("b", &[32, 2], GgmlType::Q4_0, b.clone());
        let mut s = GgufStreamWriter::new(Vec::new(), &meta, descs()).unwrap();
        s.write_data(&a[..5]).unwrap();
        s.write_data(&a[5..]).unwrap();
        for chunk in b.chunks(7) {
            s.write_data(chunk).unwrap();
        }
        let bytes = s.finish().unwrap();
        assert_eq!(bytes, mem.to_bytes());
        // The second tensor starts aligned, with no padding after the last.
        assert_eq!(bytes.len() % ALIGNMENT, 36 % ALIGNMENT);
    }

    #[test]
    fn stream_writer_rejects_wrong_sizes() {
        let mut s = GgufStreamWriter::new(Vec::new(), &[], descs()).unwrap();
        assert!(s.write_data(&[0u8; 13]).is_err(), "past the end of a tensor");
        s.write_data(&[0u8; 12]).unwrap();
        s.write_data(&[0u8; 20]).unwrap();
        assert!(s.finish().is_err(), "a tensor left short");
        let mut s = GgufStreamWriter::new(Vec::new(), &[], descs()).unwrap();
        s.write_data(&[0u8; 12]).unwrap();
        s.write_data(&[0u8; 36]).unwrap();
        assert!(s.write_data(&[0u8; 1]).is_err(), "past the last tensor");
        assert!(s.finish().is_ok());
    }
}
