//! SentencePiece-style tokenization, as llama.cpp's `llm_tokenizer_spm`.
//!
//! Symbols start as single UTF-8 characters. The adjacent pair whose
//! concatenation is a vocabulary token with the highest score merges first
//! (ties: leftmost first), until no pair forms a token. A final symbol that is
//! not a token is emitted byte by byte as `<0xNN>` tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

pub(crate) struct Spm {
    /// Token for each raw byte: `<0xNN>`, else the one-byte text, else unknown.
    byte_id: [Option<u32>; 256],
}

impl Spm {
    pub fn new(vocab: &Vocab) -> Spm {
        let mut byte_id = [None; 256];
        for (b, slot) in byte_id.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = vocab
                .id(&hex)
                .or_else(|| std::str::from_utf8(&[b as u8]).ok().and_then(|s| vocab.id(s)))
                .or(vocab.unk);
        }
        Spm { byte_id }
    }

    /// Tokenizes `text`, in which spaces are already written as `▁`.
    pub fn tokenize(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, c) in text.char_indices() {
            let n = syms.len() as i32;
            syms.push(Sym {
                start: i as u32,
                len: c.len_utf8() as u32,
                prev: n - 1,
                next: n + 1,
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = -1;
        }

        let mut heap = BinaryHeap::new();
        let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: i32, r: i32| {
            if l < 0 || r < 0 {
                return;
            }
            let (ls, rs) = (&syms[l as usize], &syms[r as usize]);
            let size = ls.len + rs.len;
            let s = ls.start as usize;
            if let Some(id) = vocab.id(&text[s..s + size as usize]) {
                heap.push(Bigram {
                    score: vocab.scores[id as usize],
                    left: l as u32,
                    right: r as u32,
                    size,
                });
            }
        };
        for i in 1..syms.len() as i32 {
            try_add(&mut heap, &syms, i - 1, i);
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (bg.left as usize, bg.right as usize);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != bg.size {
                continue; // one side was merged meanwhile
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let next = syms[r].next;
            syms[l].next = next;
            if next >= 0 {
                syms[next as usize].prev = l as i32;
            }
            let prev = syms[l].prev;
            try_add(&mut heap, &syms, prev, l as i32);
            try_add(&mut heap, &syms, l as i32, next);
        }

        let mut i = 0i32;
        while i >= 0 {
            let s = &syms[i as usize];
            let piece = &text[s.start as usize..(s.start + s.len) as usize];
            match vocab.id(piece) {
                Some(id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.byte_id[b as usize])),
            }
            i = s.next;
        }
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: i32,
    next: i32,
}

/// Max-heap order: higher score first, then the leftmost pair.
struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}
