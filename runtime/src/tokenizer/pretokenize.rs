//! BPE pre-tokenizers: split text into words before merging, the way
//! llama.cpp's `unicode_regex_split` does for each `tokenizer.ggml.pre`.
//!
//! llama.cpp applies a list of patterns in turn; each pattern splits every
//! current piece into its matches and the gaps between them. The big GPT-2 /
//! Llama 3 / Qwen 2 patterns (with their `\s+(?!\S)` lookahead) are hand-written
//! state machines there, and the small ones run through `std::regex`. Both kinds
//! are reimplemented here as explicit matchers over code points.

use super::unicode::{char_info, to_lower, Cat, CharInfo};

/// A pre-tokenizer family (several `tokenizer.ggml.pre` names share one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreType {
    Default,
    Gpt2,
    Llama3,
    Qwen2,
    Starcoder,
    Falcon,
    DeepseekLlm,
    DeepseekCoder,
}

impl PreType {
    /// Maps a `tokenizer.ggml.pre` value; `None` for names we do not implement.
    pub fn from_name(name: &str) -> Option<PreType> {
        Some(match name {
            "default" => PreType::Default,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
            | "jina-v5-nano" | "dbrx" | "smaug-bpe" => PreType::Llama3,
            "deepseek-llm" => PreType::DeepseekLlm,
            "deepseek-coder" => PreType::DeepseekCoder,
            "falcon" => PreType::Falcon,
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0"
            | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo" | "jais"
            | "trillion" | "granite-docling" | "exaone4" => PreType::Gpt2,
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                PreType::Starcoder
            }
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" | "solar-open" => {
                PreType::Qwen2
            }
            _ => return None,
        })
    }

    fn stages(self) -> Vec<Stage> {
        use Stage::*;
        match self {
            // [\p{P}\$\+<=>\^~\|]+ , gpt2 , \p{N}+ , [0-9][0-9][0-9]
            PreType::Default => vec![Run(Class::PunctOr("$+<=>^~|")), Gpt2, Run(Class::Number), Digits3],
            PreType::Gpt2 => vec![Gpt2],
            PreType::Llama3 => vec![Llama3],
            PreType::Qwen2 => vec![Qwen2],
            // \p{N} , gpt2
            PreType::Starcoder => vec![One(Class::Number), Gpt2],
            // [\p{P}\$\+<=>\^~\|`]+ , gpt2 (without the final \s+) , [0-9][0-9][0-9]
            PreType::Falcon => vec![Run(Class::PunctOr("$+<=>^~|`")), Gpt2, Digits3],
            PreType::DeepseekLlm => vec![
                One(Class::ranges("\r\n")),
                OptSpaceRun(Class::ranges(DEEPSEEK_LETTERS)),
                OptSpaceRun(Class::ranges(
                    "!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}",
                )),
                TrailingSpace,
                Run(Class::ranges(CJK)),
                Run(Class::Number),
            ],
            PreType::DeepseekCoder => vec![
                One(Class::ranges("\r\n")),
                OptSpaceRun(Class::Letter),
                OptSpaceRun(Class::Punct),
                Run(Class::ranges(CJK)),
                One(Class::Number),
            ],
        }
    }
}

/// `[一-龥ࠀ-一가-퟿]` of the deepseek patterns (escaped: editors normalise some
/// of these characters to canonically equivalent ones).
const CJK: &str = "\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}";

/// The letter class of deepseek-llm's second pattern, verbatim.
const DEEPSEEK_LETTERS: &str = concat!(
    "A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}",
    "\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}",
    "\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}",
    "\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}",
    "\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}",
    "\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}",
    "\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}",
    "\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}",
    "\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}",
    "\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}",
    "\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}",
    "\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}",
    "\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}",
    "\u{1E900}-\u{1E943}",
);

/// A character class of one of the simple patterns.
#[derive(Clone, Debug)]
enum Class {
    Number,
    Letter,
    Punct,
    /// `\p{P}` plus some ASCII characters.
    PunctOr(&'static str),
    /// Explicit code point ranges (inclusive).
    Ranges(Vec<(u32, u32)>),
}

impl Class {
    /// Parses the inside of a `[...]` class made of literal characters and `a-b` ranges.
    fn ranges(spec: &str) -> Class {
        let chars: Vec<char> = spec.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            if i + 2 < chars.len() && chars[i + 1] == '-' {
                out.push((chars[i] as u32, chars[i + 2] as u32));
                i += 3;
            } else {
                out.push((chars[i] as u32, chars[i] as u32));
                i += 1;
            }
        }
        Class::Ranges(out)
    }

    /// `c` is the code point as llama.cpp's `std::regex` sees it: non-ASCII
    /// whitespace has been replaced by U+000B, so it belongs to no category.
    fn contains(&self, c: char, info: CharInfo) -> bool {
        let c = if !c.is_ascii() && info.ws { '\u{0B}' } else { c };
        let cat = if c == '\u{0B}' { Cat::Control } else { info.cat };
        match self {
            Class::Number => cat == Cat::Number,
            Class::Letter => cat == Cat::Letter,
            Class::Punct => cat == Cat::Punctuation,
            Class::PunctOr(extra) => cat == Cat::Punctuation || (c.is_ascii() && extra.contains(c)),
            Class::Ranges(r) => {
                let c = c as u32;
                r.iter().any(|&(lo, hi)| lo <= c && c <= hi)
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Stage {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3,
    /// As Llama3 with `\p{N}` instead of `\p{N}{1,3}`.
    Qwen2,
    /// `C+`
    Run(Class),
    /// `C`
    One(Class),
    /// `\s?C+`
    OptSpaceRun(Class),
    /// `\s+$`
    TrailingSpace,
    /// `[0-9][0-9][0-9]`
    Digits3,
}

/// Splits `text` into the words the BPE merges run on.
pub(crate) struct PreTokenizer {
    stages: Vec<Stage>,
}

/// Code points of the text being split, with their classes.
struct Cpts {
    chars: Vec<char>,
    info: Vec<CharInfo>,
}

impl PreTokenizer {
    pub fn new(pre: PreType) -> PreTokenizer {
        PreTokenizer { stages: pre.stages() }
    }

    /// The words of `text`, in order; they concatenate back to `text`.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut byte_at: Vec<usize> = Vec::with_capacity(text.len() + 1);
        let mut chars = Vec::with_capacity(text.len());
        for (i, c) in text.char_indices() {
            byte_at.push(i);
            chars.push(c);
        }
        byte_at.push(text.len());
        let info = chars.iter().map(|&c| char_info(c)).collect();
        let cpts = Cpts { chars, info };

        let mut pieces = vec![(0usize, cpts.chars.len())];
        let mut next = Vec::with_capacity(pieces.len());
        for stage in &self.stages {
            next.clear();
            for &(s, e) in &pieces {
                split_piece(stage, &cpts, s, e, &mut next);
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        pieces.iter().map(|&(s, e)| &text[byte_at[s]..byte_at[e]]).collect()
    }
}

fn split_piece(stage: &Stage, cpts: &Cpts, s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    let mut w = Piece {
        cpts,
        ini: s,
        end: e,
        prev_end: s,
        out,
    };
    match stage {
        Stage::Gpt2 => w.gpt2(),
        Stage::Llama3 => w.llama3(true),
        Stage::Qwen2 => w.llama3(false),
        Stage::TrailingSpace => {
            let mut t = e;
            while t > s && cpts.info[t - 1].ws {
                t -= 1;
            }
            if t > s {
                w.out.push((s, t));
            }
            if t < e {
                w.out.push((t, e));
            }
        }
        _ => w.regex(stage),
    }
}

/// One piece being split: code points `ini..end` of the text.
struct Piece<'a> {
    cpts: &'a Cpts,
    ini: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<(usize, usize)>,
}

impl Piece<'_> {
    /// The code point at `pos`, `None` outside the piece.
    #[inline]
    fn cpt(&self, pos: usize) -> Option<char> {
        (pos >= self.ini && pos < self.end).then(|| self.cpts.chars[pos])
    }

    /// The class of the code point at `pos`, `None` outside the piece.
    #[inline]
    fn info(&self, pos: usize) -> Option<CharInfo> {
        (pos >= self.ini && pos < self.end).then(|| self.cpts.info[pos])
    }

    #[inline]
    fn is_letter(&self, pos: usize) -> bool {
        self.info(pos).is_some_and(CharInfo::letter)
    }

    #[inline]
    fn is_number(&self, pos: usize) -> bool {
        self.info(pos).is_some_and(CharInfo::number)
    }

    #[inline]
    fn is_ws(&self, pos: usize) -> bool {
        self.info(pos).is_some_and(|i| i.ws)
    }

    /// In the piece and neither whitespace, letter nor number.
    #[inline]
    fn is_other(&self, pos: usize) -> bool {
        self.info(pos).is_some_and(|i| !(i.ws || i.letter() || i.number()))
    }

    /// Ends the current word at `end`; returns its length (0 emits nothing).
    #[inline]
    fn emit(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push((self.prev_end, end));
        }
        self.prev_end = end;
        len
    }

    /// Length of an English contraction (`'s`, `'re`, ...) starting at `pos`, or 0.
    fn contraction(&self, pos: usize, case_insensitive: bool) -> usize {
        if self.cpt(pos) != Some('\'') || pos + 1 >= self.end {
            return 0;
        }
        let low = |c: Option<char>| match c {
            Some(c) if case_insensitive => Some(to_lower(c)),
            c => c,
        };
        let n1 = low(self.cpt(pos + 1));
        if matches!(n1, Some('s' | 't' | 'm' | 'd')) {
            return 2;
        }
        if pos + 2 < self.end {
            let n2 = low(self.cpt(pos + 2));
            if matches!(
                (n1, n2),
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
            ) {
                return 3;
            }
        }
        0
    }

    /// Whitespace handling shared by all the big patterns:
    /// `\s+(?!\S)|\s+` (plus `\s*[\r\n]+` first when `newline_rule`).
    fn whitespace(&mut self, pos: usize, newline_rule: bool) -> usize {
        let mut n = 0;
        let mut last_newline_end = 0;
        while self.is_ws(pos + n) {
            if newline_rule && matches!(self.cpt(pos + n), Some('\r' | '\n')) {
                last_newline_end = pos + n + 1;
            }
            n += 1;
        }
        if last_newline_end > 0 {
            self.emit(last_newline_end);
            return last_newline_end;
        }
        let end = if n > 1 && pos + n < self.end {
            // leave the last whitespace to prefix the next word
            pos + n - 1
        } else if n > 0 {
            pos + n
        } else {
            pos + 1
        };
        self.emit(end);
        end
    }

    fn gpt2(&mut self) {
        let mut pos = self.ini;
        while pos < self.end {
            let c = self.cpts.chars[pos];
            let k = self.contraction(pos, false);
            if k > 0 {
                pos += k;
                self.emit(pos);
                continue;
            }
            // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
            let body = if c == ' ' { pos + 1 } else { pos };
            type Test<'p> = fn(&Piece<'p>, usize) -> bool;
            let tests: [Test; 3] = [Piece::is_letter, Piece::is_number, Piece::is_other];
            if let Some(test) = tests.iter().find(|t| t(self, body)) {
                pos = body;
                while test(self, pos) {
                    pos += 1;
                }
                self.emit(pos);
                continue;
            }
            pos = self.whitespace(pos, false);
        }
    }

    /// Llama 3 (`digits3`) and Qwen 2 (single digits).
    fn llama3(&mut self, digits3: bool) {
        let mut pos = self.ini;
        while pos < self.end {
            let c = self.cpts.chars[pos];
            let info = self.cpts.info[pos];
            let k = self.contraction(pos, true);
            if k > 0 {
                pos += k;
                self.emit(pos);
                continue;
            }
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if !(c == '\r' || c == '\n' || info.number()) && (info.letter() || self.is_letter(pos + 1)) {
                pos += 1;
                while self.is_letter(pos) {
                    pos += 1;
                }
                self.emit(pos);
                continue;
            }
            // `\p{N}{1,3}` or `\p{N}`
            if info.number() {
                if digits3 {
                    let mut ini = pos;
                    while self.is_number(pos) {
                        pos += 1;
                        if pos - ini >= 3 {
                            self.emit(pos);
                            ini = pos;
                        }
                    }
                } else {
                    pos += 1;
                }
                self.emit(pos);
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`; a lone trailing space also lands here.
            let body = if c == ' ' { pos + 1 } else { pos };
            if self.is_other(body) || (c == ' ' && body >= self.end) {
                pos = body;
                while self.is_other(pos) {
                    pos += 1;
                }
                while matches!(self.cpt(pos), Some('\r' | '\n')) {
                    pos += 1;
                }
                self.emit(pos);
                continue;
            }
            pos = self.whitespace(pos, true);
        }
    }

    /// Leftmost-first matching of one simple pattern, as `std::regex_iterator`
    /// does: matches and the gaps between them all become words.
    fn regex(&mut self, stage: &Stage) {
        let mut pos = self.ini;
        while pos < self.end {
            match self.match_at(stage, pos) {
                Some(len) => {
                    self.emit(pos);
                    pos += len;
                    self.emit(pos);
                }
                None => pos += 1,
            }
        }
        self.emit(self.end);
    }

    fn in_class(&self, class: &Class, pos: usize) -> bool {
        self.info(pos).is_some_and(|i| class.contains(self.cpts.chars[pos], i))
    }

    fn run(&self, class: &Class, from: usize) -> usize {
        let mut p = from;
        while self.in_class(class, p) {
            p += 1;
        }
        p - from
    }

    /// Length of the match of `stage` starting exactly at `pos`.
    fn match_at(&self, stage: &Stage, pos: usize) -> Option<usize> {
        match stage {
            Stage::Run(class) => Some(self.run(class, pos)).filter(|&n| n > 0),
            Stage::One(class) => self.in_class(class, pos).then_some(1),
            Stage::OptSpaceRun(class) => {
                // `\s?` is greedy: try with the whitespace first, then without.
                if self.is_ws(pos) {
                    let n = self.run(class, pos + 1);
                    if n > 0 {
                        return Some(n + 1);
                    }
                }
                Some(self.run(class, pos)).filter(|&n| n > 0)
            }
            Stage::Digits3 => {
                let digit = |p| self.cpt(p).is_some_and(|c: char| c.is_ascii_digit());
                (digit(pos) && digit(pos + 1) && digit(pos + 2)).then_some(3)
            }
            Stage::Gpt2 | Stage::Llama3 | Stage::Qwen2 | Stage::TrailingSpace => unreachable!(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pre: PreType, text: &str) -> Vec<String> {
        PreTokenizer::new(pre)
            .split(text)
            .into_iter()
            .map(String::from)
            .collect()
    }

    #[test]
    fn gpt2_words() {
        assert_eq!(
            split(PreType::Gpt2, "Hello world's  end  \n"),
            ["Hello", " world", "'s", " ", " end", "  \n"]
        );
        assert_eq!(split(PreType::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(split(PreType::Gpt2, "x!!  ?"), ["x", "!!", " ", " ?"]);
    }

    #[test]
    fn starcoder_splits_digits() {
        assert_eq!(split(PreType::Starcoder, "ab 123x"), ["ab", " ", "1", "2", "3", "x"]);
    }

    #[test]
    fn llama3_words() {
        assert_eq!(
            split(PreType::Llama3, "I'M 12345 (ok)\n\n  x"),
            ["I", "'M", " ", "123", "45", " (", "ok", ")\n\n", " ", " x"]
        );
    }

    #[test]
    fn default_digits() {
        assert_eq!(split(PreType::Default, "a 1234567"), ["a", " ", "123", "456", "7"]);
    }

    #[test]
    fn deepseek_trailing_space() {
        assert_eq!(split(PreType::DeepseekLlm, "ab  "), ["ab", "  "]);
    }

    #[test]
    fn empty() {
        assert!(split(PreType::Gpt2, "").is_empty());
    }
}
