//! Byte sizes on the command line and in reports.

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

pub const TIB: u64 = 1 << 40;

/// The one grammar of byte counts, on the command line and in the configuration: a plain count
/// (`4096`) or a number with a binary unit, `K`, `M`, `G` or `T` (1024-based, as fio reads
/// them), optionally followed by `B` or `iB` and in any case (`64K`, `256k`, `4MiB`, `1T`).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, suffix) = t.split_at(digits_end);
    if number.is_empty() {
        return Err(format!("{text:?} is not a byte count (expected e.g. 64K, 1M, 4096)"));
    }
    let n: u64 = number.parse().map_err(|e| format!("{text:?}: {e}"))?;
    let unit = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => KIB,
        "M" | "MB" | "MIB" => MIB,
        "G" | "GB" | "GIB" => GIB,
        "T" | "TB" | "TIB" => TIB,
        other => return Err(format!("{text:?}: unknown unit {other:?} (use K, M, G or T)")),
    };
    n.checked_mul(unit).ok_or_else(|| format!("{text:?} does not fit in 64 bits"))
}

/// A size that must be positive (a block or a buffer on the command line): [`parse_bytes`],
/// refusing 0.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let bytes = parse_bytes(text)?;
    if bytes == 0 {
        return Err(format!("{text:?}: a size must be positive"));
    }
    Ok(bytes)
}

/// Parses a comma-separated list of sizes.
pub fn parse_size_list(text: &str) -> Result<Vec<u64>, String> {
    let sizes: Vec<u64> = text
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(parse_size)
        .collect::<Result<_, _>>()?;
    if sizes.is_empty() {
        return Err("no sizes given".to_owned());
    }
    Ok(sizes)
}

/// Block sizes as given on a bench's command line (a clap value, parsed by [`size_list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeList(pub Vec<u64>);

/// [`parse_size_list`] as a clap `value_parser`.
pub fn size_list(text: &str) -> Result<SizeList, String> {
    parse_size_list(text).map(SizeList)
}

/// `64K`, `1M`, `1536K`, `100B`: the shortest exact binary label.
pub fn size_label(bytes: u64) -> String {
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{}G", bytes / GIB)
    } else if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{}M", bytes / MIB)
    } else if bytes >= KIB && bytes.is_multiple_of(KIB) {
        format!("{}K", bytes / KIB)
    } else {
        format!("{bytes}B")
    }
}

/// A human-readable amount: `1.50 MiB`.
pub fn human_bytes(bytes: u64) -> String {
    // Display only: the rounding of a u64 to f64 does not matter here.
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.2} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.2} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

/// `usize` to `u64` (lossless on every target Rust supports; saturates otherwise).
pub fn wide(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// `u64` to `usize`, saturating.
pub fn narrow(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_label() {
        assert_eq!(parse_size("64K"), Ok(64 * KIB));
        assert_eq!(parse_size("256k"), Ok(256 * KIB));
        assert_eq!(parse_size("4MiB"), Ok(4 * MIB));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0K").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("3X").is_err());
        // One grammar with the configuration's byte counts: T, and 0 where 0 is allowed.
        assert_eq!(parse_size("2T"), Ok(2 * TIB));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("1 GiB"), Ok(GIB));
        assert!(parse_bytes("99999999T").is_err());
        assert_eq!(parse_size_list("64K,1M"), Ok(vec![64 * KIB, MIB]));
        assert_eq!(size_label(64 * KIB), "64K");
        assert_eq!(size_label(4 * MIB), "4M");
        assert_eq!(size_label(1536 * KIB), "1536K");
        assert_eq!(size_label(100), "100B");
        assert_eq!(human_bytes(3 * MIB / 2), "1.50 MiB");
    }
}
