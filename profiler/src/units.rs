//! Human-friendly durations (`90s`, `10m`, `90h`, `2d`) and sizes (`4k`, `128KiB`, `2g`).

use crate::{ProfileError, Result};

/// Parses a duration: a number followed by `ms`, `s`, `m`, `h` or `d` (seconds without a unit).
pub fn parse_duration(s: &str) -> Result<std::time::Duration> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| ProfileError::Invalid(format!("duration {s:?}: expected e.g. 90s, 10m, 90h")))?;
    let mult = match unit.trim() {
        "" | "s" | "sec" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        u => return Err(ProfileError::Invalid(format!("duration {s:?}: unknown unit {u:?}"))),
    };
    let secs = v * mult;
    if !secs.is_finite() || secs < 0.0 {
        return Err(ProfileError::Invalid(format!("duration {s:?} out of range")));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// Parses a byte size: `4096`, `4k`, `4KiB`, `128K`, `4m`, `2g` (binary
/// multiples; `kB`, `MB`, `GB` are decimal), with the runtime's size parser.
pub fn parse_size(s: &str) -> Result<u64> {
    leanstream_runtime::cache::parse_bytes(s).map_err(|e| ProfileError::Invalid(format!("size {s:?}: {e}")))
}

/// Comma-separated list parsed with `f`.
pub fn parse_list<T>(s: &str, f: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| f(p.trim()))
        .collect()
}

/// `4096` → `4KiB`, `131072` → `128KiB`, `4194304` → `4MiB`.
pub fn format_size(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}KiB", b >> 10)
    } else {
        format!("{b}B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("10m").unwrap().as_secs(), 600);
        assert_eq!(parse_duration("90h").unwrap().as_secs(), 90 * 3600);
        assert_eq!(parse_duration("1.5s").unwrap().as_millis(), 1500);
        assert_eq!(parse_duration("250ms").unwrap().as_millis(), 250);
        assert!(parse_duration("10x").is_err());
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128KiB").unwrap(), 128 * 1024);
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert!(parse_size("4q").is_err());
        assert_eq!(format_size(131072), "128KiB");
    }
}
