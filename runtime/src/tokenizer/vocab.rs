//! The vocabulary as GGUF metadata describes it: token texts, scores, types,
//! special ids and flags, validated, plus the per-token attributes llama.cpp
//! derives from them (control tokens found by name, end-of-generation set).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::gguf::{GgufFile, MetaArray};
use crate::{Result, RuntimeError};

use super::pretokenize::PreType;

/// A small, fast, non-cryptographic hasher for token lookups (FxHash).
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const FX_K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_K);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8-byte chunk")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut buf = [0u8; 8];
            buf[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(buf) ^ ((rest.len() as u64) << 56));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// Token attributes (bit flags, as llama.cpp's `llama_token_attr`).
pub(crate) mod attr {
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 7;
    pub const RSTRIP: u16 = 1 << 8;
}

/// Which algorithm splits text into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Model {
    /// SentencePiece with scores (`tokenizer.ggml.model = "llama"`).
    Spm,
    /// Byte-level BPE with ranked merges (`tokenizer.ggml.model = "gpt2"`).
    Bpe(PreType),
}

/// Bytes glibc's malloc takes for an allocation of `len` bytes.
pub(crate) fn malloc_bytes(len: usize) -> usize {
    if len == 0 {
        0
    } else {
        (len + 8).next_multiple_of(16).max(32)
    }
}

/// Heap bytes of a hash map's table (keys' own allocations not included).
pub(crate) fn table_bytes<K, V, S>(m: &std::collections::HashMap<K, V, S>) -> usize {
    m.capacity() * (std::mem::size_of::<(K, V)>() + 1)
}

pub(crate) struct Vocab {
    pub model: Model,
    pub texts: Vec<Box<str>>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u16>,
    pub by_text: FxHashMap<Box<str>, u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// End-of-generation flags, indexed by id.
    pub eog: Vec<bool>,
}

pub(crate) const KEY_MODEL: &str = "tokenizer.ggml.model";
pub(crate) const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";

/// Special-id slots: the ones that change how text is tokenized or when generation ends.
#[derive(Clone, Copy)]
enum Slot {
    Bos,
    Eos,
    Eot,
    Eom,
    Unk,
    FimPre,
    FimSuf,
    FimMid,
    FimPad,
    FimRep,
    FimSep,
}
const N_SLOTS: usize = 11;

/// Metadata keys for the slots, in llama.cpp's order (the deprecated
/// prefix/suffix/middle keys come last and win).
const SLOT_KEYS: &[(Slot, &str)] = &[
    (Slot::Bos, "tokenizer.ggml.bos_token_id"),
    (Slot::Eos, "tokenizer.ggml.eos_token_id"),
    (Slot::Eot, "tokenizer.ggml.eot_token_id"),
    (Slot::Eom, "tokenizer.ggml.eom_token_id"),
    (Slot::Unk, "tokenizer.ggml.unknown_token_id"),
    (Slot::FimPre, "tokenizer.ggml.fim_pre_token_id"),
    (Slot::FimSuf, "tokenizer.ggml.fim_suf_token_id"),
    (Slot::FimMid, "tokenizer.ggml.fim_mid_token_id"),
    (Slot::FimPad, "tokenizer.ggml.fim_pad_token_id"),
    (Slot::FimRep, "tokenizer.ggml.fim_rep_token_id"),
    (Slot::FimSep, "tokenizer.ggml.fim_sep_token_id"),
    (Slot::FimPre, "tokenizer.ggml.prefix_token_id"),
    (Slot::FimSuf, "tokenizer.ggml.suffix_token_id"),
    (Slot::FimMid, "tokenizer.ggml.middle_token_id"),
];

/// Token texts by which llama.cpp recognises special tokens the metadata did not name.
const AUTO_DETECT: &[(Slot, &[&str])] = &[
    (
        Slot::Eot,
        &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ],
    ),
    (Slot::Eom, &["<|eom_id|>"]),
    (
        Slot::FimPre,
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        Slot::FimSuf,
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        Slot::FimMid,
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (
        Slot::FimPad,
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        Slot::FimRep,
        &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    ),
    (Slot::FimSep, &["<|file_sep|>"]),
];

/// Token texts that end generation (llama.cpp's `special_eog_ids` heuristics).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

fn meta_err(gguf: &GgufFile, key: &str, problem: impl Into<String>) -> RuntimeError {
    gguf.bad_metadata(key, problem)
}

impl Vocab {
    pub(crate) fn heap_bytes(&self) -> usize {
        let texts: usize = self.texts.iter().map(|t| malloc_bytes(t.len())).sum();
        let keys: usize = self.by_text.keys().map(|t| malloc_bytes(t.len())).sum();
        self.texts.capacity() * std::mem::size_of::<Box<str>>()
            + texts
            + self.scores.capacity() * 4
            + self.attrs.capacity() * 2
            + table_bytes(&self.by_text)
            + keys
            + self.eog.capacity()
    }

    pub fn from_gguf(gguf: &GgufFile) -> Result<Vocab> {
        let model_name = gguf
            .get_str(KEY_MODEL)?
            .ok_or_else(|| meta_err(gguf, KEY_MODEL, "missing"))?;
        let model = match model_name {
            "llama" => Model::Spm,
            "gpt2" => {
                let pre = gguf.get_str(KEY_PRE)?.unwrap_or("");
                if pre.is_empty() {
                    // llama.cpp falls back to its default pre-tokenizer (with a warning).
                    Model::Bpe(PreType::Default)
                } else {
                    Model::Bpe(
                        PreType::from_name(pre)
                            .ok_or_else(|| meta_err(gguf, KEY_PRE, format!("unsupported BPE pre-tokenizer '{pre}'")))?,
                    )
                }
            }
            other => {
                return Err(meta_err(
                    gguf,
                    KEY_MODEL,
                    format!("unsupported tokenizer model '{other}' (supported: 'llama' (SentencePiece), 'gpt2' (BPE))"),
                ))
            }
        };

        let texts = match gguf.get_array(KEY_TOKENS)? {
            Some(MetaArray::String(v)) => v,
            Some(_) => return Err(meta_err(gguf, KEY_TOKENS, "expected an array of strings")),
            None => return Err(meta_err(gguf, KEY_TOKENS, "missing")),
        };
        let n = texts.len();
        if n == 0 {
            return Err(meta_err(gguf, KEY_TOKENS, "empty vocabulary"));
        }
        if n > i32::MAX as usize {
            return Err(meta_err(gguf, KEY_TOKENS, format!("{n} tokens is too many")));
        }

        let scores: Vec<f32> = match gguf.get_array(KEY_SCORES)? {
            None => vec![0.0; n],
            Some(MetaArray::F32(v)) => v.clone(),
            Some(MetaArray::I32(v)) => v.iter().map(|&s| s as f32).collect(),
            Some(_) => return Err(meta_err(gguf, KEY_SCORES, "expected an array of f32 or i32")),
        };
        if scores.len() != n {
            return Err(meta_err(
                gguf,
                KEY_SCORES,
                format!("{} scores for {n} tokens", scores.len()),
            ));
        }

        let mut attrs: Vec<u16> = match gguf.get_array(KEY_TYPES)? {
            None => vec![attr::NORMAL; n],
            Some(a) => {
                let types = a
                    .to_i64_vec()
                    .ok_or_else(|| meta_err(gguf, KEY_TYPES, "expected an array of integers"))?;
                if types.len() != n {
                    return Err(meta_err(
                        gguf,
                        KEY_TYPES,
                        format!("{} token types for {n} tokens", types.len()),
                    ));
                }
                types
                    .iter()
                    .map(|&t| match t {
                        1 => attr::NORMAL,
                        2 => attr::UNKNOWN,
                        3 => attr::CONTROL,
                        4 => attr::USER_DEFINED,
                        5 => attr::UNUSED,
                        6 => attr::BYTE,
                        _ => 0, // undefined
                    })
                    .collect()
            }
        };

        let mut by_text: FxHashMap<Box<str>, u32> = FxHashMap::default();
        by_text.reserve(n);
        let mut boxed = Vec::with_capacity(n);
        for (i, t) in texts.iter().enumerate() {
            let t: Box<str> = if t.is_empty() {
                format!("[EMPTY_{i}]").into()
            } else {
                t.as_str().into()
            };
            if by_text.insert(t.clone(), i as u32).is_some() {
                return Err(meta_err(
                    gguf,
                    KEY_TOKENS,
                    format!("token {i} duplicates the text {t:?} of an earlier token"),
                ));
            }
            if attrs[i] & attr::BYTE != 0 && parse_byte_token(&t).is_none() {
                return Err(meta_err(
                    gguf,
                    KEY_TYPES,
                    format!("token {i} {t:?} has type BYTE but is not of the form <0xNN>"),
                ));
            }
            boxed.push(t);
        }
        let texts = boxed;

        // Special ids: per-model defaults, then metadata.
        let mut slots: [Option<u32>; N_SLOTS] = [None; N_SLOTS];
        match model {
            Model::Spm => {
                slots[Slot::Bos as usize] = Some(1);
                slots[Slot::Eos as usize] = Some(2);
                slots[Slot::Unk as usize] = Some(0);
            }
            Model::Bpe(_) => {
                slots[Slot::Bos as usize] = Some(11);
                slots[Slot::Eos as usize] = Some(11);
            }
        }
        for s in slots.iter_mut() {
            if s.is_some_and(|id| id as usize >= n) {
                *s = None;
            }
        }
        for &(slot, key) in SLOT_KEYS {
            let Some(v) = gguf.get(key) else { continue };
            let id = v
                .as_u64()
                .ok_or_else(|| meta_err(gguf, key, format!("expected a token id, found {}", v.type_name())))?;
            if id >= n as u64 {
                return Err(meta_err(
                    gguf,
                    key,
                    format!("token id {id} is out of range (vocabulary has {n} tokens)"),
                ));
            }
            slots[slot as usize] = Some(id as u32);
        }

        // SentencePiece adds BOS and a leading space unless told otherwise; BPE neither.
        let spm_default = model == Model::Spm;
        let flag = |key: &str, default: bool| -> Result<bool> { Ok(gguf.get_bool(key)?.unwrap_or(default)) };
        let add_bos = flag("tokenizer.ggml.add_bos_token", spm_default)?;
        let add_eos = flag("tokenizer.ggml.add_eos_token", false)?;
        let add_space_prefix = flag("tokenizer.ggml.add_space_prefix", spm_default)?;

        // Special tokens recognised by their text.
        let id_of = |s: &str| by_text.get(s).copied();
        for &(slot, names) in AUTO_DETECT {
            if slots[slot as usize].is_some() {
                continue;
            }
            // llama.cpp takes whichever its hash map yields first; we take the lowest id.
            if let Some(id) = names.iter().filter_map(|s| id_of(s)).min() {
                slots[slot as usize] = Some(id);
                attrs[id as usize] |= attr::CONTROL;
            }
        }
        for (t, a) in texts.iter().zip(attrs.iter_mut()) {
            if *a & attr::CONTROL != 0 && t.contains("unused") {
                *a |= attr::UNUSED;
            }
        }

        let mut eog = vec![false; n];
        for slot in [Slot::FimPad, Slot::FimRep, Slot::FimSep] {
            if let Some(id) = slots[slot as usize] {
                eog[id as usize] = true;
            }
        }
        for s in EOG_TEXTS {
            if let Some(id) = id_of(s) {
                eog[id as usize] = true;
                attrs[id as usize] |= attr::CONTROL;
            }
        }
        // gpt-oss: always rendered, never special
        for s in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = id_of(s) {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        for slot in [Slot::Eos, Slot::Eot, Slot::Eom] {
            if let Some(id) = slots[slot as usize] {
                eog[id as usize] = true;
            }
        }
        let in_eog = |eog: &[bool], s: &str| id_of(s).filter(|&id| eog[id as usize]);
        if let Some(end) = in_eog(&eog, "<|end|>") {
            let ret_call = in_eog(&eog, "<|return|>").is_some() && in_eog(&eog, "<|call|>").is_some();
            let calls_flush = in_eog(&eog, "<|calls|>").is_some() && in_eog(&eog, "<|flush|>").is_some();
            if ret_call || calls_flush {
                eog[end as usize] = false;
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        if let Some(s) = in_eog(&eog, "</s>") {
            if in_eog(&eog, "<|tool_response>").is_some() || in_eog(&eog, "<|plamo:eos|>").is_some() {
                eog[s as usize] = false;
                attrs[s as usize] = attr::NORMAL;
            }
        }

        // Per-model strip attributes.
        let name = gguf.get_str("general.name").ok().flatten().unwrap_or("").to_lowercase();
        let pre_name = gguf.get_str(KEY_PRE).ok().flatten().unwrap_or("");
        let arch = gguf.get_str("general.architecture").ok().flatten().unwrap_or("");
        if ["jina-v2-de", "jina-v2-es", "jina-v2-code"]
            .iter()
            .any(|p| pre_name.contains(p))
            || ["nomic-bert-moe", "jina-bert-v3"].iter().any(|a| arch.contains(a))
        {
            if let Some(id) = id_of("<mask>") {
                attrs[id as usize] |= attr::LSTRIP;
            }
        } else if name.contains("phi-3") || name.contains("phi3") {
            for a in attrs.iter_mut() {
                if *a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0 {
                    *a |= attr::RSTRIP;
                }
            }
            if let Some(id) = id_of("</s>") {
                attrs[id as usize] |= attr::RSTRIP;
            }
            for s in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(id) = id_of(s) {
                    attrs[id as usize] &= !attr::RSTRIP;
                }
            }
        } else if name.contains("modern-bert") {
            if let Some(id) = id_of("[MASK]") {
                attrs[id as usize] |= attr::LSTRIP;
            }
        }

        let bos = slots[Slot::Bos as usize];
        let eos = slots[Slot::Eos as usize];
        if add_bos && bos.is_none() {
            return Err(meta_err(
                gguf,
                "tokenizer.ggml.add_bos_token",
                "BOS is to be added but there is no BOS token",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(meta_err(
                gguf,
                "tokenizer.ggml.add_eos_token",
                "EOS is to be added but there is no EOS token",
            ));
        }

        Ok(Vocab {
            model,
            texts,
            scores,
            attrs,
            by_text,
            bos,
            eos,
            eot: slots[Slot::Eot as usize],
            unk: slots[Slot::Unk as usize],
            add_bos,
            add_eos,
            add_space_prefix,
            eog,
        })
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// Tokens matched in raw text before tokenizing: control, user-defined and unknown.
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
    }
}

/// The byte of a `<0xNN>` token.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
