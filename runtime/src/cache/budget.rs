//! `--ffn-budget`: the FFN cache budget, as bytes or as a share of the FFN.

use std::fmt;
use std::str::FromStr;

/// Why a budget string was rejected. Every message quotes the input and says
/// what is accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    #[error("empty FFN budget (expected e.g. '25%', '64MiB', '1.5GB' or '1000000')")]
    Empty,
    #[error("FFN budget '{0}': not a number (expected e.g. '25%', '64MiB', '1.5GB' or '1000000')")]
    BadNumber(String),
    #[error(
        "FFN budget '{input}': unknown unit '{unit}' (expected B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T or %)"
    )]
    UnknownUnit { input: String, unit: String },
    #[error("FFN budget '{0}': a percentage must lie between 0% and 100%")]
    PercentRange(String),
    #[error("FFN budget '{0}': too large (more than 2^64 bytes)")]
    Overflow(String),
}

/// An FFN cache budget: a byte count, or a percentage of the model's FFN bytes.
///
/// Units are case-insensitive. `KiB`/`MiB`/`GiB`/`TiB` (and the bare `K`,
/// `M`, `G`, `T`) are powers of 1024; `KB`/`MB`/`GB`/`TB` are powers of 1000;
/// `B` or no unit means bytes. Fractions are allowed (`1.5GiB`, `12.5%`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FfnBudget {
    Bytes(u64),
    /// Percent of the FFN, in `0.0..=100.0`.
    Percent(f64),
}

impl FfnBudget {
    pub fn parse(s: &str) -> Result<Self, BudgetError> {
        let t = s.trim();
        if t.is_empty() {
            return Err(BudgetError::Empty);
        }
        if let Some(num) = t.strip_suffix('%') {
            let p = parse_number(num.trim()).ok_or_else(|| BudgetError::BadNumber(s.into()))?;
            if !(0.0..=100.0).contains(&p) {
                return Err(BudgetError::PercentRange(s.into()));
            }
            return Ok(Self::Percent(p));
        }
        parse_bytes(t).map(Self::Bytes)
    }

    /// The budget in bytes for a model whose FFN takes `total_ffn_bytes`
    /// (the engine passes the slot bytes that hold all of it). A byte budget
    /// is returned as given, even above the FFN size (the cache never makes
    /// more slots than there are neurons); a percentage is rounded down.
    pub fn resolve(&self, total_ffn_bytes: u64) -> u64 {
        match *self {
            Self::Bytes(b) => b,
            Self::Percent(p) => {
                if p >= 100.0 {
                    total_ffn_bytes
                } else {
                    ((total_ffn_bytes as f64) * p / 100.0).floor() as u64
                }
            }
        }
    }
}

/// A byte count: digits (`_` allowed, a decimal point too) and an optional
/// unit, binary (`k`, `KiB`, `m`, `MiB`, `g`, `GiB`, `t`, `TiB`) or decimal
/// (`kB`, `MB`, `GB`, `TB`). The one parser of sizes (budgets, the profiler's
/// file sizes).
pub fn parse_bytes(s: &str) -> Result<u64, BudgetError> {
    let t = s.trim();
    if t.is_empty() {
        return Err(BudgetError::Empty);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    if num.is_empty() {
        return Err(BudgetError::BadNumber(s.into()));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(BudgetError::UnknownUnit {
                input: s.into(),
                unit: unit.into(),
            })
        }
    };
    let digits: String = num.chars().filter(|&c| c != '_').collect();
    if digits.contains('.') {
        let v = parse_number(&digits).ok_or_else(|| BudgetError::BadNumber(s.into()))?;
        let bytes = v * mult as f64;
        if bytes >= u64::MAX as f64 {
            return Err(BudgetError::Overflow(s.into()));
        }
        Ok(bytes as u64)
    } else {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(BudgetError::BadNumber(s.into()));
        }
        let v: u64 = digits.parse().map_err(|_| BudgetError::Overflow(s.into()))?;
        v.checked_mul(mult).ok_or_else(|| BudgetError::Overflow(s.into()))
    }
}

/// A plain non-negative decimal number (no sign, no exponent, no inf/nan).
fn parse_number(s: &str) -> Option<f64> {
    let ok = !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && s.bytes().any(|b| b.is_ascii_digit())
        && s.bytes().filter(|&b| b == b'.').count() <= 1;
    if !ok {
        return None;
    }
    s.parse::<f64>().ok().filter(|v| v.is_finite())
}

impl FromStr for FfnBudget {
    type Err = BudgetError;
    fn from_str(s: &str) -> Result<Self, BudgetError> {
        Self::parse(s)
    }
}

impl fmt::Display for FfnBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bytes(b) => write!(f, "{b}"),
            Self::Percent(p) => write!(f, "{p}%"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bytes_units_and_percent() {
        let b = |s: &str| FfnBudget::parse(s).unwrap();
        assert_eq!(b("1000000"), FfnBudget::Bytes(1_000_000));
        assert_eq!(b("1_000"), FfnBudget::Bytes(1000));
        assert_eq!(b("64MiB"), FfnBudget::Bytes(64 << 20));
        assert_eq!(b(" 64 mib "), FfnBudget::Bytes(64 << 20));
        assert_eq!(b("2G"), FfnBudget::Bytes(2 << 30));
        assert_eq!(b("2GB"), FfnBudget::Bytes(2_000_000_000));
        assert_eq!(b("1.5GiB"), FfnBudget::Bytes(3 << 29));
        assert_eq!(b("512B"), FfnBudget::Bytes(512));
        assert_eq!(b("4k"), FfnBudget::Bytes(4096));
        assert_eq!(b("1TiB"), FfnBudget::Bytes(1 << 40));
        assert_eq!(b("25%"), FfnBudget::Percent(25.0));
        assert_eq!(b("12.5 %"), FfnBudget::Percent(12.5));
        assert_eq!(b("0%"), FfnBudget::Percent(0.0));
        assert_eq!(b("100%"), FfnBudget::Percent(100.0));
        assert_eq!("64MiB".parse::<FfnBudget>().unwrap(), FfnBudget::Bytes(64 << 20));
    }

    #[test]
    fn rejects_bad_input() {
        let e = |s: &str| FfnBudget::parse(s).unwrap_err();
        assert_eq!(e(""), BudgetError::Empty);
        assert_eq!(e("   "), BudgetError::Empty);
        assert!(matches!(e("abc"), BudgetError::BadNumber(_)));
        assert!(matches!(e("MiB"), BudgetError::BadNumber(_)));
        assert!(matches!(e("12 parsecs"), BudgetError::UnknownUnit { .. }));
        assert!(matches!(e("1.2.3GiB"), BudgetError::BadNumber(_)));
        assert!(matches!(e("-5%"), BudgetError::BadNumber(_)));
        assert!(matches!(e("-5"), BudgetError::BadNumber(_)));
        assert!(matches!(e("_"), BudgetError::BadNumber(_)));
        assert!(matches!(e("150%"), BudgetError::PercentRange(_)));
        assert!(matches!(e("%"), BudgetError::BadNumber(_)));
        assert!(matches!(e("nan%"), BudgetError::BadNumber(_)));
        assert!(matches!(e("99999999999999999999"), BudgetError::Overflow(_)));
        assert!(matches!(e("99999999999TiB"), BudgetError::Overflow(_)));
        // Messages quote the input and name what is accepted.
        let msg = e("12 parsecs").to_string();
        assert!(msg.contains("12 parsecs") && msg.contains("MiB"), "{msg}");
    }

    #[test]
    fn resolves_against_ffn_size() {
        assert_eq!(FfnBudget::Percent(25.0).resolve(1000), 250);
        assert_eq!(FfnBudget::Percent(100.0).resolve(u64::MAX), u64::MAX);
        assert_eq!(FfnBudget::Percent(0.0).resolve(1000), 0);
        assert_eq!(FfnBudget::Percent(33.3).resolve(1000), 333);
        assert_eq!(FfnBudget::Bytes(5000).resolve(1000), 5000);
        assert_eq!(FfnBudget::parse("50%").unwrap().resolve(10 << 30), 5 << 30);
    }
}
