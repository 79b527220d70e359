//! Character classes and the GPT-2 byte-to-unicode mapping, as llama.cpp's
//! pre-tokenizers see them.
//!
//! llama.cpp reduces every code point to one coarse class (letter, number,
//! punctuation, ...) plus a separate "whitespace" flag taken from Unicode's
//! `White_Space` property. We compute the same from the exact General Category.

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// The coarse category of a code point (`\p{L}`, `\p{N}`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cat {
    /// `Cn`: unassigned.
    Undefined,
    Number,
    Letter,
    Separator,
    Mark,
    Punctuation,
    Symbol,
    /// `Cc`, `Cf`, `Co`, `Cs`.
    Control,
}

/// What a pre-tokenizer knows about one code point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CharInfo {
    pub cat: Cat,
    pub ws: bool,
}

impl CharInfo {
    #[inline]
    pub fn letter(self) -> bool {
        self.cat == Cat::Letter
    }
    #[inline]
    pub fn number(self) -> bool {
        self.cat == Cat::Number
    }
}

pub(crate) fn category(c: char) -> Cat {
    if (c as u32) >= UNICODE_16_ADDED[0].0 && added_in_unicode_16(c as u32) {
        return Cat::Undefined;
    }
    match get_general_category(c) {
        G::Unassigned => Cat::Undefined,
        G::Control | G::Format | G::PrivateUse | G::Surrogate => Cat::Control,
        G::LowercaseLetter | G::ModifierLetter | G::OtherLetter | G::TitlecaseLetter | G::UppercaseLetter => {
            Cat::Letter
        }
        G::SpacingMark | G::EnclosingMark | G::NonspacingMark => Cat::Mark,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Cat::Number,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::ClosePunctuation
        | G::FinalPunctuation
        | G::InitialPunctuation
        | G::OtherPunctuation
        | G::OpenPunctuation => Cat::Punctuation,
        G::CurrencySymbol | G::ModifierSymbol | G::MathSymbol | G::OtherSymbol => Cat::Symbol,
        G::LineSeparator | G::ParagraphSeparator | G::SpaceSeparator => Cat::Separator,
        #[allow(unreachable_patterns)]
        _ => Cat::Undefined,
    }
}

/// Code points assigned in Unicode 16.0. llama.cpp's tables are Unicode 15.1,
/// where these are unassigned (`Cn`); the category crate is Unicode 16.0. We
/// follow llama.cpp so both split text alike.
const UNICODE_16_ADDED: &[(u32, u32)] = &[
    (0x0897, 0x0897),
    (0x1B4E, 0x1B4F),
    (0x1B7F, 0x1B7F),
    (0x1C89, 0x1C8A),
    (0x2427, 0x2429),
    (0x31E4, 0x31E5),
    (0xA7CB, 0xA7CD),
    (0xA7DA, 0xA7DC),
    (0x105C0, 0x105F3),
    (0x10D40, 0x10D65),
    (0x10D69, 0x10D85),
    (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC4),
    (0x10EFC, 0x10EFC),
    (0x11380, 0x11389),
    (0x1138B, 0x1138B),
    (0x1138E, 0x1138E),
    (0x11390, 0x113B5),
    (0x113B7, 0x113C0),
    (0x113C2, 0x113C2),
    (0x113C5, 0x113C5),
    (0x113C7, 0x113CA),
    (0x113CC, 0x113D5),
    (0x113D7, 0x113D8),
    (0x113E1, 0x113E2),
    (0x116D0, 0x116E3),
    (0x11BC0, 0x11BE1),
    (0x11BF0, 0x11BF9),
    (0x11F5A, 0x11F5A),
    (0x13460, 0x143FA),
    (0x16100, 0x16139),
    (0x16D40, 0x16D79),
    (0x18CFF, 0x18CFF),
    (0x1CC00, 0x1CCF9),
    (0x1CD00, 0x1CEB3),
    (0x1E5D0, 0x1E5FA),
    (0x1E5FF, 0x1E5FF),
    (0x1F8B2, 0x1F8BB),
    (0x1F8C0, 0x1F8C1),
    (0x1FA89, 0x1FA89),
    (0x1FA8F, 0x1FA8F),
    (0x1FABE, 0x1FABE),
    (0x1FAC6, 0x1FAC6),
    (0x1FADC, 0x1FADC),
    (0x1FADF, 0x1FADF),
    (0x1FAE9, 0x1FAE9),
    (0x1FBCB, 0x1FBEF),
];

fn added_in_unicode_16(cp: u32) -> bool {
    let i = UNICODE_16_ADDED.partition_point(|&(lo, _)| lo <= cp);
    i > 0 && cp <= UNICODE_16_ADDED[i - 1].1
}

/// Unicode `White_Space` (the set llama.cpp uses for `\s`).
#[inline]
pub(crate) fn is_whitespace(c: char) -> bool {
    matches!(
        c as u32,
        0x09..=0x0D
            | 0x20
            | 0x85
            | 0xA0
            | 0x1680
            | 0x2000..=0x200A
            | 0x2028
            | 0x2029
            | 0x202F
            | 0x205F
            | 0x3000
    )
}

#[inline]
pub(crate) fn char_info(c: char) -> CharInfo {
    if c.is_ascii() {
        return ASCII_INFO[c as usize];
    }
    CharInfo {
        cat: category(c),
        ws: is_whitespace(c),
    }
}

static ASCII_INFO: [CharInfo; 128] = {
    let mut t = [CharInfo {
        cat: Cat::Control,
        ws: false,
    }; 128];
    let mut i = 0;
    while i < 128 {
        let b = i as u8;
        let cat = if b.is_ascii_digit() {
            Cat::Number
        } else if b.is_ascii_alphabetic() {
            Cat::Letter
        } else if b == b' ' {
            Cat::Separator
        } else if b < 0x20 || b == 0x7F {
            Cat::Control
        } else if matches!(b, b'$' | b'+' | b'<' | b'=' | b'>' | b'^' | b'`' | b'|' | b'~') {
            Cat::Symbol
        } else {
            Cat::Punctuation
        };
        t[i] = CharInfo {
            cat,
            ws: matches!(b, 0x09..=0x0D | 0x20),
        };
        i += 1;
    }
    t
};

/// Simple lowercase mapping used by the case-insensitive contraction rules.
#[inline]
pub(crate) fn to_lower(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    let mut it = c.to_lowercase();
    match (it.next(), it.next()) {
        (Some(l), None) => l,
        _ => c,
    }
}

/// GPT-2's reversible byte -> printable code point map.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(cp).expect("byte map code points are valid");
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_table_matches_general_category() {
        for b in 0u8..128 {
            let c = b as char;
            assert_eq!(char_info(c).cat, category(c), "byte {b:#x}");
        }
    }

    #[test]
    fn unicode_version_is_pinned() {
        // UNICODE_16_ADDED must be extended if the category crate moves on.
        assert_eq!(unicode_general_category::UNICODE_VERSION, (16, 0, 0));
        assert_eq!(category('\u{1C89}'), Cat::Undefined);
        assert_eq!(category('\u{13460}'), Cat::Undefined);
        assert_eq!(category('\u{1FAE9}'), Cat::Undefined);
        assert_eq!(category('\u{1FAE8}'), Cat::Symbol);
        assert_eq!(category('\u{13455}'), Cat::Mark);
    }

    #[test]
    fn byte_map_is_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let mut seen = std::collections::HashSet::new();
        assert!(t.iter().all(|c| seen.insert(*c)));
    }
}
