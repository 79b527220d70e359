//! Unit tests on tiny synthetic vocabularies (the real-model goldens live in
//! `runtime/tests/tokenizer_golden.rs`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::unicode::byte_to_char_table;
use super::{StreamDecoder, Tokenizer};
use crate::gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use crate::RuntimeError;

fn strings(v: &[&str]) -> MetaValue {
    MetaValue::Array(MetaArray::String(v.iter().map(|s| s.to_string()).collect()))
}

/// Metadata under construction: later `set`s of a key replace earlier ones.
#[derive(Default)]
struct Meta(Vec<(String, MetaValue)>);

impl Meta {
    fn meta(&mut self, key: &str, value: MetaValue) -> &mut Meta {
        self.0.retain(|(k, _)| k != key);
        self.0.push((key.to_string(), value));
        self
    }
}

fn open(name: &str, m: &Meta) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in &m.0 {
        w.meta(k, v.clone());
    }
    let dir = std::env::temp_dir().join(format!("leanstream-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // tests run in parallel and may build the same vocabulary: one file each
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let path: PathBuf = dir.join(format!("{}-{name}", SEQ.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&path, w.to_bytes()).unwrap();
    GgufFile::open(&path).unwrap()
}

/// A SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, a few pieces.
fn spm_writer(pieces: &[(&str, f32, i32)]) -> Meta {
    let mut toks = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut scores = vec![0.0f32; 3];
    let mut types = vec![2i32, 3, 3];
    for b in 0..256 {
        toks.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for &(t, s, ty) in pieces {
        toks.push(t.to_string());
        scores.push(s);
        types.push(ty);
    }
    let mut w = Meta::default();
    w.meta("tokenizer.ggml.model", MetaValue::String("llama".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(toks)))
        .meta("tokenizer.ggml.scores", MetaValue::Array(MetaArray::F32(scores)))
        .meta("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(types)))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
        .meta("tokenizer.ggml.unknown_token_id", MetaValue::U32(0));
    w
}

fn spm() -> Tokenizer {
    let w = spm_writer(&[
        ("▁", -1.0, 1),
        ("a", -2.0, 1),
        ("b", -2.0, 1),
        ("ab", -1.5, 1),
        ("▁a", -0.5, 1),
        ("▁ab", -0.2, 1),
        ("<ctl>", 0.0, 3),
        ("<ud>", 0.0, 4),
        ("<|im_end|>", 0.0, 3),
    ]);
    Tokenizer::from_gguf(&open("spm.gguf", &w)).unwrap()
}

#[test]
fn spm_merges_by_score_and_falls_back_to_bytes() {
    let t = spm();
    let id = |s: &str| t.token_id(s).unwrap();
    assert!(t.add_bos());
    // add_space_prefix defaults to true for SentencePiece
    assert_eq!(t.encode("ab", true, false), vec![1, id("▁ab")]);
    assert_eq!(t.encode("ab a", false, false), vec![id("▁ab"), id("▁a")]);
    // 'é' is not a piece: two byte tokens
    assert_eq!(t.encode("é", false, false), vec![id("▁"), 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(t.decode(&t.encode("ab é", false, false)), " ab é".as_bytes());
    assert_eq!(t.token_piece(id("▁ab")), b" ab");
    assert_eq!(t.token_piece(3 + 0x41), b"A");
    assert_eq!(t.token_piece(1), b"<s>");
}

#[test]
fn spm_special_tokens() {
    let t = spm();
    let id = |s: &str| t.token_id(s).unwrap();
    // control tokens only with parse_special; user-defined always
    assert_eq!(t.encode("a<ctl>", false, true), vec![id("▁a"), id("<ctl>")]);
    assert_ne!(t.encode("a<ctl>", false, false)[1], id("<ctl>"));
    // text after a special token gets the space prefix again
    assert_eq!(t.encode("<ud>a", false, false), vec![id("<ud>"), id("▁a")]);
    assert!(t.is_end_of_generation(2));
    assert!(t.is_end_of_generation(id("<|im_end|>")));
    assert_eq!(t.eot(), Some(id("<|im_end|>")));
    assert!(!t.is_end_of_generation(id("a")));
    assert!(t.encode("", false, false).is_empty());
    assert_eq!(t.encode("", true, false), vec![1]);
}

#[test]
fn chat_content_ranges_keep_control_tokens_as_text() {
    let t = spm();
    let id = |s: &str| t.token_id(s).unwrap();
    // "<ctl>a" (template) then a message "a<|im_end|><ctl>b" at bytes 6..22, then "<|im_end|>".
    let text = "<ctl>aa<|im_end|><ctl>b<|im_end|>";
    let content = 6..23;
    assert_eq!(&text[content.clone()], "a<|im_end|><ctl>b");
    let chat = t.encode_chat(text, std::slice::from_ref(&content));
    // The template's own control tokens are tokens, the message's are text.
    assert_eq!(chat[..3], [1, id("<ctl>"), id("▁a")]);
    assert_eq!(*chat.last().unwrap(), id("<|im_end|>"));
    let inside: Vec<u32> = chat[2..chat.len() - 1].to_vec();
    assert!(
        !inside.contains(&id("<ctl>")) && !inside.contains(&id("<|im_end|>")),
        "{chat:?}"
    );
    assert_eq!(t.decode(&chat[1..]), format!("<ctl> {}", &text[5..]).as_bytes());
    // Without control text in the content, encode_chat is encode.
    let plain = "<ctl>ab a<|im_end|>";
    assert_eq!(
        t.encode_chat(plain, std::slice::from_ref(&(5..9))),
        t.encode(plain, true, true)
    );
    // A token reaching into the range from outside stays text too.
    assert!(!t
        .encode_chat("<ctl>", std::slice::from_ref(&(4..5)))
        .contains(&id("<ctl>")));
    // User-defined tokens are parsed everywhere, as `encode` parses them.
    assert!(t
        .encode_chat("a<ud>", std::slice::from_ref(&(0..5)))
        .contains(&id("<ud>")));
}

/// A byte-level BPE vocabulary: the 256 byte tokens, then merged tokens.
fn bpe(pre: &str, merges: &[&str], extra: &[(&str, i32)]) -> Result<Tokenizer, RuntimeError> {
    let table = byte_to_char_table();
    let mut toks: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    for m in merges {
        toks.push(m.replace(' ', ""));
        types.push(1);
    }
    for &(t, ty) in extra {
        toks.push(t.to_string());
        types.push(ty);
    }
    let mut w = Meta::default();
    w.meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::String(pre.into()))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(toks)))
        .meta("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(types)))
        .meta("tokenizer.ggml.merges", strings(merges));
    Tokenizer::from_gguf(&open(&format!("bpe-{pre}.gguf"), &w))
}

#[test]
fn bpe_merges_by_rank() {
    let merges = ["Ġ t", "h e", "Ġt he", "t h", "th e"];
    let t = bpe("gpt-2", &merges, &[("<|endoftext|>", 3)]).unwrap();
    let id = |s: &str| t.token_id(s).unwrap();
    // " the": Ġ+t (rank 0), h+e (1), Ġt+he (2)
    assert_eq!(t.encode(" the", false, false), vec![id("Ġthe")]);
    // "the": t+h is rank 3 but h+e is rank 1: "t" "he", no "t he" merge
    assert_eq!(t.encode("the", false, false), vec![id("t"), id("he")]);
    assert_eq!(
        t.encode("the<|endoftext|>", false, true),
        vec![id("t"), id("he"), id("<|endoftext|>")]
    );
    assert_eq!(t.decode(&t.encode("a\nthe é", false, false)), "a\nthe é".as_bytes());
    assert_eq!(t.token_piece(id("Ġthe")), b" the");
    assert!(t.is_end_of_generation(id("<|endoftext|>")));
    assert!(!t.add_bos());
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let t = spm();
    // '€' is E2 82 AC: three byte tokens
    let ids: Vec<u32> = "€".bytes().map(|b| 3 + b as u32).collect();
    let a = t.token_id("▁a").unwrap();
    let mut d = StreamDecoder::new();
    assert_eq!(d.push(&t, a), " a");
    assert_eq!(d.push(&t, ids[0]), "");
    assert_eq!(d.push(&t, ids[1]), "");
    assert_eq!(d.pending(), &[0xE2, 0x82]);
    assert_eq!(d.push(&t, ids[2]), "€");
    assert_eq!(d.push(&t, a), " a");
    // an invalid byte is replaced at once; an unfinished character at the end by finish()
    assert_eq!(d.push(&t, 3 + 0xFF), "\u{FFFD}");
    assert_eq!(d.push(&t, ids[0]), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

fn load_err(name: &str, w: &Meta) -> String {
    match Tokenizer::from_gguf(&open(name, w)) {
        Ok(_) => panic!("{name}: accepted bad metadata"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_metadata_is_an_error() {
    let mut w = spm_writer(&[]);
    w.meta("tokenizer.ggml.scores", MetaValue::Array(MetaArray::F32(vec![0.0; 5])));
    let e = load_err("scores.gguf", &w);
    assert!(e.contains("tokenizer.ggml.scores") && e.contains("5 scores"), "{e}");

    let mut w = spm_writer(&[]);
    w.meta(
        "tokenizer.ggml.token_type",
        MetaValue::Array(MetaArray::I32(vec![1; 7])),
    );
    let e = load_err("types.gguf", &w);
    assert!(e.contains("tokenizer.ggml.token_type"), "{e}");

    let mut w = spm_writer(&[]);
    w.meta("tokenizer.ggml.eos_token_id", MetaValue::U32(100_000));
    let e = load_err("eos.gguf", &w);
    assert!(
        e.contains("tokenizer.ggml.eos_token_id") && e.contains("out of range"),
        "{e}"
    );

    let mut w = spm_writer(&[]);
    w.meta("tokenizer.ggml.model", MetaValue::String("t5".into()));
    let e = load_err("model.gguf", &w);
    assert!(e.contains("tokenizer.ggml.model") && e.contains("'t5'"), "{e}");

    let mut w = spm_writer(&[("a", 0.0, 1), ("a", 0.0, 1)]);
    w.meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1));
    let e = load_err("dup.gguf", &w);
    assert!(e.contains("duplicates"), "{e}");

    let e = bpe("gpt-4o", &[], &[]).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.pre") && e.contains("'gpt-4o'"), "{e}");

    let mut w = spm_writer(&[]);
    w.meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    let e = load_err("merges.gguf", &w);
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");
}
