//! Checks of a Parquet shard's structure before polars decodes it. polars
//! sizes allocations by counts the file states (thrift list lengths in the
//! footer, value counts in page headers) and a damaged count makes a failed
//! allocation, which aborts the process instead of giving an error. Fuzzing
//! found both (a 28 GB footer list, a 2^61-bit page bitmap).

use polars::prelude::{PolarsError, PolarsResult};

/// Whether polars can decode `bytes` (a shard the manifest says has `rows`)
/// without trusting an unchecked count.
pub fn check(bytes: &[u8], rows: u64) -> PolarsResult<()> {
    footer(bytes)?;
    check_pages(bytes, rows)
}

fn bad(what: String) -> PolarsError {
    PolarsError::ComputeError(what.into())
}

/// The footer (thrift compact `FileMetaData`) walked without decoding: every
/// list, map and string length must fit in the bytes left, nesting is bounded.
fn footer(bytes: &[u8]) -> PolarsResult<()> {
    let n = bytes.len();
    if n < 12 || &bytes[n - 4..] != b"PAR1" || &bytes[..4] != b"PAR1" {
        return Err(bad("no Parquet magic at both ends".into()));
    }
    let len = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().expect("4 bytes")) as usize;
    if len > n - 12 {
        return Err(bad(format!("a footer of {len} bytes in a {n}-byte file")));
    }
    let mut w = Walker {
        b: &bytes[n - 8 - len..n - 8],
        pos: 0,
    };
    w.value(STRUCT, 0)
}

const STRUCT: u8 = 12;
/// Deeper nesting than any real footer: a bound on the walk's recursion.
const MAX_DEPTH: usize = 64;

struct Walker<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Walker<'_> {
    fn byte(&mut self) -> PolarsResult<u8> {
        let v = *self
            .b
            .get(self.pos)
            .ok_or_else(|| bad("the footer ends inside a value".into()))?;
        self.pos += 1;
        Ok(v)
    }

    fn varint(&mut self) -> PolarsResult<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(bad("a varint of more than 10 bytes in the footer".into()))
    }

    fn skip(&mut self, n: u64) -> PolarsResult<()> {
        let left = (self.b.len() - self.pos) as u64;
        if n > left {
            return Err(bad(format!("the footer states {n} bytes where {left} are left")));
        }
        self.pos += n as usize;
        Ok(())
    }

    /// A count of elements that each take at least one byte.
    fn count(&mut self, n: u64) -> PolarsResult<u64> {
        let left = (self.b.len() - self.pos) as u64;
        if n > left {
            return Err(bad(format!(
                "the footer states {n} elements where {left} bytes are left"
            )));
        }
        Ok(n)
    }

    fn value(&mut self, ty: u8, depth: usize) -> PolarsResult<()> {
        if depth > MAX_DEPTH {
            return Err(bad(format!("the footer nests deeper than {MAX_DEPTH}")));
        }
        match ty {
            1 | 2 => Ok(()),
            3 => self.skip(1),
            4..=6 => self.varint().map(drop),
            7 => self.skip(8),
            8 => {
                let n = self.varint()?;
                self.skip(n)
            }
            9 | 10 => {
                let h = self.byte()?;
                let n = match h >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                let elem = h & 0x0f;
                for _ in 0..self.count(n)? {
                    // In lists a bool is a byte of its own.
                    if elem == 1 || elem == 2 {
                        self.skip(1)?;
                    } else {
                        self.value(elem, depth + 1)?;
                    }
                }
                Ok(())
            }
            11 => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let kv = self.byte()?;
                for _ in 0..self.count(n)? {
                    self.value(kv >> 4, depth + 1)?;
                    self.value(kv & 0x0f, depth + 1)?;
                }
                Ok(())
            }
            STRUCT => loop {
                let h = self.byte()?;
                if h == 0 {
                    return Ok(());
                }
                if h >> 4 == 0 {
                    // A long-form field id follows (zigzag i16).
                    self.varint()?;
                }
                self.value(h & 0x0f, depth + 1)?;
            },
            t => Err(bad(format!("a thrift value of unknown type {t} in the footer"))),
        }
    }
}

/// Checks what polars would size its buffers by before it decodes: it
/// reserves memory by the value counts in page headers, and a damaged header
/// (2^61 values, found by fuzzing) aborts the process on a failed allocation
/// instead of giving an error. Every data page must hold at most its row
/// group's rows, and the row groups together the manifest's `rows`.
fn check_pages(bytes: &[u8], rows: u64) -> PolarsResult<()> {
    use polars_parquet::parquet::page::CompressedPage;
    use polars_parquet::parquet::read::{get_page_iterator, read_metadata};
    let meta = read_metadata(&mut std::io::Cursor::new(bytes)).map_err(|e| bad(e.to_string()))?;
    let total: u64 = meta.row_groups.iter().map(|g| g.num_rows() as u64).sum();
    if total != rows || meta.num_rows as u64 != rows {
        return Err(bad(format!(
            "its metadata says {total} rows in row groups, {} in all; the manifest says {rows}",
            meta.num_rows
        )));
    }
    let buffer = polars_buffer::Buffer::from(bytes.to_vec());
    for (g, group) in meta.row_groups.iter().enumerate() {
        for column in group.parquet_columns() {
            let pages = get_page_iterator(column, std::io::Cursor::new(buffer.clone()), Vec::new(), bytes.len())
                .map_err(|e| bad(e.to_string()))?;
            for page in pages {
                // A dictionary page's size is checked by its reader.
                let values = match page.map_err(|e| bad(e.to_string()))? {
                    CompressedPage::Data(p) => p.num_values(),
                    CompressedPage::Dict(_) => 0,
                };
                if values > group.num_rows() {
                    return Err(bad(format!(
                        "a page of row group {g} claims {values} values, the group has {} rows",
                        group.num_rows()
                    )));
                }
            }
        }
    }
    Ok(())
}
