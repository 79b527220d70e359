//! Tokenizers read from GGUF metadata, matching llama.cpp token for token:
//! SentencePiece (`tokenizer.ggml.model = "llama"`) and byte-level BPE
//! (`"gpt2"`, with the pre-tokenizer named by `tokenizer.ggml.pre`).
//!
//! - `vocab`: metadata loading, validation, special ids, token attributes.
//! - `special`: cutting special tokens out of raw text.
//! - `pretokenize`: BPE word splitting per `tokenizer.ggml.pre`.
//! - `bpe` / `spm`: the two merge algorithms.
//! - `stream`: incremental UTF-8 detokenization.

mod bpe;
mod pretokenize;
mod special;
mod spm;
mod stream;
mod unicode;
mod vocab;

use std::ops::Range;

use crate::gguf::GgufFile;
use crate::Result;

use bpe::{Bpe, ByteDecoder};
use special::{Fragment, SpecialTokens};
use spm::Spm;
pub use stream::StreamDecoder;
use vocab::{attr, Model, Vocab};

enum Algo {
    Spm(Box<Spm>),
    Bpe(Box<Bpe>),
}

/// A tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.
pub struct Tokenizer {
    vocab: Vocab,
    special: SpecialTokens,
    algo: Algo,
    /// Every token's bytes, as llama.cpp's `token_to_piece(special = true)`.
    pieces: Vec<u8>,
    piece_end: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.vocab.model)
            .field("vocab_size", &self.vocab.len())
            .field("bos", &self.vocab.bos)
            .field("eos", &self.vocab.eos)
            .field("add_bos", &self.vocab.add_bos)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Reads and validates the tokenizer metadata of `gguf`.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
        let vocab = Vocab::from_gguf(gguf)?;
        let dec = ByteDecoder::new();
        let algo = match vocab.model {
            Model::Spm => Algo::Spm(Box::new(Spm::new(&vocab))),
            Model::Bpe(pre) => Algo::Bpe(Box::new(Bpe::new(gguf, &vocab, pre, &dec)?)),
        };
        let special = SpecialTokens::new(&vocab);

        let mut pieces = Vec::new();
        let mut piece_end = Vec::with_capacity(vocab.len());
        for id in 0..vocab.len() {
            render_piece(&vocab, &dec, id, &mut pieces);
            let end = u32::try_from(pieces.len())
                .map_err(|_| gguf.bad_metadata("tokenizer.ggml.tokens", "token texts exceed 4 GiB in total"))?;
            piece_end.push(end);
        }
        Ok(Tokenizer {
            vocab,
            special,
            algo,
            pieces,
            piece_end,
        })
    }

    /// Tokenizes `text` as `llama_tokenize` does.
    ///
    /// `add_special` adds BOS (and EOS) when the metadata asks for them.
    /// `parse_special` lets control tokens written in the text (e.g.
    /// `<|im_start|>`) become those tokens; user-defined tokens always do.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.encode_parts(text, add_special, parse_special, &[])
    }

    /// Tokenizes a rendered chat prompt (BOS added as [`encode`](Self::encode)
    /// adds it): control tokens the template wrote become tokens, but text in
    /// the byte ranges `content` (the messages' own text) always stays text,
    /// so a message cannot end its turn or open another by writing
    /// `<|im_end|>`, as in OpenAI's API. Outside those ranges, and wherever
    /// the content holds no control token's text, the ids are `encode`'s.
    pub fn encode_chat(&self, text: &str, content: &[Range<usize>]) -> Vec<u32> {
        self.encode_parts(text, true, true, content)
    }

    fn encode_parts(&self, text: &str, add_special: bool, parse_special: bool, literal: &[Range<usize>]) -> Vec<u32> {
        let v = &self.vocab;
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && v.add_bos {
            out.extend(v.bos);
        }
        let fragments = self.special.partition(v, text, parse_special, literal);
        match &self.algo {
            Algo::Spm(spm) => {
                // A space goes before the first text and before any text following a special token.
                let mut prev_special = true;
                let mut buf = String::new();
                for frag in fragments {
                    match frag {
                        Fragment::Text(t) => {
                            buf.clear();
                            if v.add_space_prefix && prev_special {
                                buf.push('▁');
                            }
                            for c in t.chars() {
                                buf.push(if c == ' ' { '▁' } else { c });
                            }
                            spm.tokenize(v, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Algo::Bpe(bpe) => {
                for frag in fragments {
                    match frag {
                        Fragment::Text(t) => bpe.tokenize(t, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && v.add_eos {
            out.extend(v.eos);
        }
        out
    }

    /// The bytes of `ids` (may be invalid UTF-8 where a character is split
    /// across a boundary). Ids out of range contribute nothing.
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_piece(id));
        }
        out
    }

    /// The bytes of one token as llama.cpp's `token_to_piece(special = true)`
    /// renders it; empty for an id out of range.
    pub fn token_piece(&self, id: u32) -> &[u8] {
        let i = id as usize;
        if i >= self.piece_end.len() {
            return &[];
        }
        let start = if i == 0 { 0 } else { self.piece_end[i - 1] as usize };
        &self.pieces[start..self.piece_end[i] as usize]
    }

    /// The token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(|t| &**t)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// Estimated heap bytes (for memory accounting): buffer capacities, and
    /// for each small allocation the size glibc's malloc gives it.
    pub fn heap_bytes(&self) -> u64 {
        let algo = match &self.algo {
            Algo::Spm(_) => std::mem::size_of::<Spm>(),
            Algo::Bpe(b) => b.heap_bytes(),
        };
        (self.vocab.heap_bytes()
            + algo
            + self.special.heap_bytes()
            + self.pieces.capacity()
            + self.piece_end.capacity() * 4) as u64
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// End of turn (`<|im_end|>`, `<end_of_turn>`, ...), when the model has one.
    pub fn eot(&self) -> Option<u32> {
        self.vocab.eot
    }

    /// Whether generation stops at `id` (llama.cpp's `llama_vocab_is_eog`).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.vocab.eog.get(id as usize).copied().unwrap_or(false)
    }

    /// Every id that ends a generation (EOS, EOT, ...).
    pub fn end_of_generation_ids(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.vocab.eog.len() as u32).filter(|&i| self.is_end_of_generation(i))
    }

    /// Whether `id` is a control token (BOS, `<|im_start|>`, ...), which
    /// detokenizers usually hide.
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab
            .attrs
            .get(id as usize)
            .is_some_and(|a| a & attr::CONTROL != 0)
    }

    /// Exact vocabulary lookup of a token's text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }
}

fn render_piece(vocab: &Vocab, dec: &ByteDecoder, id: usize, out: &mut Vec<u8>) {
    let a = vocab.attrs[id];
    let text = &*vocab.texts[id];
    if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
        out.extend_from_slice(text.as_bytes());
    } else if a & attr::NORMAL != 0 {
        match vocab.model {
            Model::Spm => {
                for c in text.chars() {
                    if c == '▁' {
                        out.push(b' ');
                    } else {
                        out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                }
            }
            Model::Bpe(_) => {
                for c in text.chars() {
                    match dec.byte(c) {
                        Some(b) => out.push(b),
                        None => {
                            // llama.cpp's rendering of a character outside the byte alphabet
                            out.extend_from_slice(b"[UNK_BYTE_0x");
                            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                                out.extend_from_slice(format!("{b:02x}").as_bytes());
                            }
                            out.extend_from_slice(text.as_bytes());
                            out.push(b']');
                        }
                    }
                }
            }
        }
    } else if a & attr::BYTE != 0 {
        out.extend(vocab::parse_byte_token(text));
    }
}

#[cfg(test)]
mod tests;
