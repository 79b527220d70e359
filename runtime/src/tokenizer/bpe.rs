//! Byte-level BPE (GPT-2 style), as llama.cpp's `llm_tokenizer_bpe`.
//!
//! Vocabulary texts are written in GPT-2's byte-to-unicode alphabet. We undo
//! that mapping once at load time and merge directly on raw bytes: every byte
//! is one initial symbol, and adjacent symbols merge lowest rank first (ties:
//! leftmost first) for as long as a ranked merge applies.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::gguf::{GgufFile, MetaArray};
use crate::Result;

use super::pretokenize::{PreTokenizer, PreType};
use super::unicode::byte_to_char_table;
use super::vocab::{FxHashMap, Vocab};

const KEY_MERGES: &str = "tokenizer.ggml.merges";

pub(crate) struct Bpe {
    pre: PreTokenizer,
    /// Raw bytes -> id, for every token whose text is in the byte alphabet.
    raw_to_id: FxHashMap<Box<[u8]>, u32>,
    /// Id of each single byte.
    byte_id: [Option<u32>; 256],
    /// What llama.cpp emits for a byte of a symbol that is not a token.
    fallback: [Option<u32>; 256],
    /// Merge rank by the ids of its two sides.
    rank_by_ids: FxHashMap<(u32, u32), u32>,
    /// Merge rank for merges with a side that is not itself a token, keyed by
    /// `len(left) as u32 LE ++ left ++ right` in raw bytes.
    rank_by_bytes: FxHashMap<Box<[u8]>, u32>,
}

impl Bpe {
    pub(crate) fn heap_bytes(&self) -> usize {
        use super::vocab::{malloc_bytes, table_bytes};
        let raw: usize = self.raw_to_id.keys().map(|k| malloc_bytes(k.len())).sum();
        let merged: usize = self.rank_by_bytes.keys().map(|k| malloc_bytes(k.len())).sum();
        std::mem::size_of::<Self>()
            + table_bytes(&self.raw_to_id)
            + raw
            + table_bytes(&self.rank_by_ids)
            + table_bytes(&self.rank_by_bytes)
            + merged
    }
}

/// Maps a text in the GPT-2 byte alphabet back to raw bytes.
pub(crate) struct ByteDecoder {
    table: FxHashMap<char, u8>,
}

impl ByteDecoder {
    pub fn new() -> ByteDecoder {
        let table = byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        ByteDecoder { table }
    }

    pub fn byte(&self, c: char) -> Option<u8> {
        self.table.get(&c).copied()
    }

    /// `None` when a character is outside the byte alphabet.
    pub fn decode(&self, text: &str) -> Option<Vec<u8>> {
        text.chars().map(|c| self.byte(c)).collect()
    }
}

impl Bpe {
    pub fn new(gguf: &GgufFile, vocab: &Vocab, pre: PreType, dec: &ByteDecoder) -> Result<Bpe> {
        let merges = match gguf.get_array(KEY_MERGES)? {
            Some(MetaArray::String(v)) => v,
            Some(_) => return Err(gguf.bad_metadata(KEY_MERGES, "expected an array of strings")),
            None => return Err(gguf.bad_metadata(KEY_MERGES, "missing (required for BPE vocabularies)")),
        };

        let mut raw_to_id: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
        raw_to_id.reserve(vocab.len());
        for (id, text) in vocab.texts.iter().enumerate() {
            if let Some(raw) = dec.decode(text) {
                raw_to_id.insert(raw.into_boxed_slice(), id as u32);
            }
        }
        let mut byte_id = [None; 256];
        for (b, slot) in byte_id.iter_mut().enumerate() {
            *slot = raw_to_id.get(&[b as u8][..]).copied();
        }
        // llama.cpp looks each UTF-8 byte of the symbol's alphabet text up as a
        // one-byte token text: only printable ASCII can ever be found.
        let alphabet = byte_to_char_table();
        let mut fallback = [None; 256];
        for (b, slot) in fallback.iter_mut().enumerate() {
            let c = alphabet[b];
            if c.is_ascii() {
                *slot = vocab.id(c.encode_utf8(&mut [0; 4]));
            }
        }

        let mut rank_by_ids = FxHashMap::default();
        rank_by_ids.reserve(merges.len());
        let mut rank_by_bytes = FxHashMap::default();
        for (rank, line) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let Some(sp) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (left, right) = (&line[..sp], &line[sp + 1..]);
            let (Some(l), Some(r)) = (dec.decode(left), dec.decode(right)) else {
                continue; // can never match a symbol
            };
            let rank = rank as u32;
            match (raw_to_id.get(&l[..]), raw_to_id.get(&r[..])) {
                (Some(&li), Some(&ri)) => {
                    rank_by_ids.entry((li, ri)).or_insert(rank);
                }
                _ => {
                    rank_by_bytes
                        .entry(pair_key(&mut Vec::new(), &l, &r).into())
                        .or_insert(rank);
                }
            }
        }

        Ok(Bpe {
            pre: PreTokenizer::new(pre),
            raw_to_id,
            byte_id,
            fallback,
            rank_by_ids,
            rank_by_bytes,
        })
    }

    /// Tokenizes one fragment of text (no special tokens in it).
    pub fn tokenize(&self, text: &str, out: &mut Vec<u32>) {
        let mut work = Work::default();
        for word in self.pre.split(text) {
            self.tokenize_word(word.as_bytes(), &mut work, out);
        }
    }

    fn rank(&self, work: &mut Vec<u8>, word: &[u8], l: &Sym, r: &Sym) -> Option<u32> {
        match (l.id, r.id) {
            (Some(li), Some(ri)) => self.rank_by_ids.get(&(li, ri)).copied(),
            _ if self.rank_by_bytes.is_empty() => None,
            _ => {
                let key = pair_key(work, l.bytes(word), r.bytes(word));
                self.rank_by_bytes.get(key).copied()
            }
        }
    }

    fn tokenize_word(&self, word: &[u8], work: &mut Work, out: &mut Vec<u32>) {
        if word.len() == 1 {
            self.emit(word, self.byte_id[word[0] as usize], out);
            return;
        }
        let n = word.len();
        let syms = &mut work.syms;
        syms.clear();
        syms.extend((0..n).map(|i| Sym {
            start: i as u32,
            len: 1,
            prev: i as i32 - 1,
            next: if i + 1 == n { -1 } else { i as i32 + 1 },
            id: self.byte_id[word[i] as usize],
        }));
        let heap = &mut work.heap;
        heap.clear();
        let key = &mut work.key;
        let push = |heap: &mut BinaryHeap<Reverse<Bigram>>, key: &mut Vec<u8>, syms: &[Sym], l: i32, r: i32| {
            if l < 0 || r < 0 {
                return;
            }
            let (ls, rs) = (&syms[l as usize], &syms[r as usize]);
            if let Some(rank) = self.rank(key, word, ls, rs) {
                heap.push(Reverse(Bigram {
                    rank,
                    left: l as u32,
                    right: r as u32,
                    size: ls.len + rs.len,
                }));
            }
        };
        for i in 1..n as i32 {
            push(heap, key, syms, i - 1, i);
        }
        while let Some(Reverse(bg)) = heap.pop() {
            let (l, r) = (bg.left as usize, bg.right as usize);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != bg.size {
                continue; // outdated
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let next = syms[r].next;
            syms[l].next = next;
            if next >= 0 {
                syms[next as usize].prev = l as i32;
            }
            syms[l].id = self.raw_to_id.get(syms[l].bytes(word)).copied();
            let prev = syms[l].prev;
            push(heap, key, syms, prev, l as i32);
            push(heap, key, syms, l as i32, next);
        }
        let mut i = 0i32;
        while i >= 0 {
            let s = &syms[i as usize];
            self.emit(s.bytes(word), s.id, out);
            i = s.next;
        }
    }

    fn emit(&self, bytes: &[u8], id: Option<u32>, out: &mut Vec<u32>) {
        match id {
            Some(id) => out.push(id),
            None => out.extend(bytes.iter().filter_map(|&b| self.fallback[b as usize])),
        }
    }
}

fn pair_key<'k>(key: &'k mut Vec<u8>, l: &[u8], r: &[u8]) -> &'k [u8] {
    key.clear();
    key.extend_from_slice(&(l.len() as u32).to_le_bytes());
    key.extend_from_slice(l);
    key.extend_from_slice(r);
    key
}

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: i32,
    next: i32,
    id: Option<u32>,
}

impl Sym {
    #[inline]
    fn bytes<'w>(&self, word: &'w [u8]) -> &'w [u8] {
        &word[self.start as usize..(self.start + self.len) as usize]
    }
}

/// Ordered by rank, then leftmost position (compared field by field).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Bigram {
    rank: u32,
    left: u32,
    right: u32,
    size: u32,
}

/// Scratch buffers reused across the words of one call.
#[derive(Default)]
struct Work {
    syms: Vec<Sym>,
    heap: BinaryHeap<Reverse<Bigram>>,
    key: Vec<u8>,
}
