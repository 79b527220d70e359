//! Cutting special tokens out of raw text before the tokenizer proper runs
//! (llama.cpp's `tokenizer_st_partition`).
//!
//! llama.cpp takes the special tokens longest first and, for each, splits every
//! remaining text fragment at its leftmost non-overlapping occurrences. We find
//! all occurrences of all special tokens in one pass over a byte trie, then
//! accept them in that same priority order, skipping any that overlap text
//! already taken: the result is identical, without a pass per special token.

use std::ops::Range;

use super::vocab::{attr, FxHashMap, Vocab};

/// A piece of the input: raw text still to be tokenized, or a special token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

pub(crate) struct SpecialTokens {
    /// First trie step from the root, by byte (0: none).
    root: [u32; 256],
    /// Further trie edges: (node, byte) -> node.
    edges: FxHashMap<(u32, u8), u32>,
    /// The special token ending at each node, if any, as its rank in `order`.
    terminal: Vec<Option<u32>>,
    /// Special token ids in priority order: longest text first, then lowest id.
    order: Vec<u32>,
}

impl SpecialTokens {
    pub(crate) fn heap_bytes(&self) -> usize {
        super::vocab::table_bytes(&self.edges)
            + self.terminal.capacity() * std::mem::size_of::<Option<u32>>()
            + self.order.capacity() * 4
    }
}

/// Byte state while partitioning.
const FREE: u8 = 0;
const TAKEN: u8 = 1;

impl SpecialTokens {
    pub fn new(vocab: &Vocab) -> SpecialTokens {
        let mut ids: Vec<u32> = (0..vocab.len() as u32).filter(|&id| vocab.is_special(id)).collect();
        ids.sort_by_key(|&id| (std::cmp::Reverse(vocab.texts[id as usize].len()), id));
        let mut st = SpecialTokens {
            root: [0; 256],
            edges: FxHashMap::default(),
            terminal: vec![None],
            order: Vec::new(),
        };
        for (rank, &id) in ids.iter().enumerate() {
            let mut node = 0u32;
            for (depth, &b) in vocab.texts[id as usize].as_bytes().iter().enumerate() {
                let existing = if depth == 0 {
                    Some(st.root[b as usize]).filter(|&n| n != 0)
                } else {
                    st.edges.get(&(node, b)).copied()
                };
                node = match existing {
                    Some(n) => n,
                    None => {
                        let n = st.terminal.len() as u32;
                        st.terminal.push(None);
                        if depth == 0 {
                            st.root[b as usize] = n;
                        } else {
                            st.edges.insert((node, b), n);
                        }
                        n
                    }
                };
            }
            st.terminal[node as usize] = Some(rank as u32);
        }
        st.order = ids;
        st
    }

    /// Splits `text` around special tokens. Control and unknown tokens are only
    /// recognised when `parse_special`, and never where they would overlap a
    /// byte range of `literal` (text that must stay text, such as a chat
    /// message's content); user-defined ones always are.
    pub fn partition<'t>(
        &self,
        vocab: &Vocab,
        text: &'t str,
        parse_special: bool,
        literal: &[Range<usize>],
    ) -> Vec<Fragment<'t>> {
        let bytes = text.as_bytes();
        if bytes.is_empty() {
            return Vec::new();
        }
        let wanted = |id: u32, start: usize| {
            if vocab.attrs[id as usize] & (attr::CONTROL | attr::UNKNOWN) == 0 {
                return true;
            }
            let end = start + vocab.texts[id as usize].len();
            parse_special && !literal.iter().any(|r| r.start < end && start < r.end)
        };

        // Every occurrence of every special token: (rank, start).
        let mut occ: Vec<(u32, u32)> = Vec::new();
        for start in 0..bytes.len() {
            let mut node = self.root[bytes[start] as usize];
            let mut pos = start + 1;
            while node != 0 {
                if let Some(rank) = self.terminal[node as usize] {
                    if wanted(self.order[rank as usize], start) {
                        occ.push((rank, start as u32));
                    }
                }
                if pos == bytes.len() {
                    break;
                }
                node = self.edges.get(&(node, bytes[pos])).copied().unwrap_or(0);
                pos += 1;
            }
        }
        if occ.is_empty() {
            return vec![Fragment::Text(text)];
        }
        // Counting sort by rank; starts stay ascending within a rank.
        let mut first = vec![0u32; self.order.len() + 1];
        for &(rank, _) in &occ {
            first[rank as usize + 1] += 1;
        }
        for r in 1..first.len() {
            first[r] += first[r - 1];
        }
        let mut sorted = vec![(0u32, 0u32); occ.len()];
        for &(rank, start) in &occ {
            let slot = &mut first[rank as usize];
            sorted[*slot as usize] = (rank, start);
            *slot += 1;
        }
        let occ = sorted;

        let mut state = vec![FREE; bytes.len()];
        let mut accepted: Vec<(usize, u32)> = Vec::new();
        for &(rank, start) in &occ {
            let id = self.order[rank as usize];
            let (s, len) = (start as usize, vocab.texts[id as usize].len());
            if state[s..s + len].iter().any(|&b| b != FREE) {
                continue;
            }
            state[s..s + len].fill(TAKEN);
            accepted.push((s, id));
            let a = vocab.attrs[id as usize];
            if a & attr::LSTRIP != 0 {
                let mut j = s;
                while j > 0 && state[j - 1] == FREE && c_isspace(bytes[j - 1]) {
                    state[j - 1] = TAKEN;
                    j -= 1;
                }
            }
            if a & attr::RSTRIP != 0 {
                let mut j = s + len;
                while j < bytes.len() && state[j] == FREE && c_isspace(bytes[j]) {
                    state[j] = TAKEN;
                    j += 1;
                }
            }
        }
        accepted.sort_unstable();

        let mut out = Vec::with_capacity(2 * accepted.len() + 1);
        let mut pos = 0;
        let push_text = |from: usize, to: usize, out: &mut Vec<Fragment<'t>>| {
            // free runs between taken bytes; stripped whitespace is taken but not a token
            let mut i = from;
            while i < to {
                if state[i] != FREE {
                    i += 1;
                    continue;
                }
                let j = (i..to).find(|&j| state[j] != FREE).unwrap_or(to);
                out.push(Fragment::Text(&text[i..j]));
                i = j;
            }
        };
        for &(s, id) in &accepted {
            push_text(pos, s, &mut out);
            out.push(Fragment::Token(id));
            pos = s + vocab.texts[id as usize].len();
        }
        push_text(pos, bytes.len(), &mut out);
        out
    }
}

/// C's `isspace` in the "C" locale.
#[inline]
fn c_isspace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}
