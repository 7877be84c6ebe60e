//! Tenant key-file text: the key lines a tenant's secrets are written in, parsed and validated.
//!
//! A key file holds one key per line, `<key-id> <hex secret> [not-after]`, where `not-after` is
//! a Unix time in seconds after which the key is refused; `#` starts a comment. Several lines
//! are what make rotation work without a restart (ADR 0012, `docs/OPERATIONS.md`). Reading the
//! file, its permissions and its reloads belong to the service (`gpucache_service::auth`).

use std::fmt;

use crate::seal::SECRET_BYTES_MIN;

/// Most keys one tenant may have at once (a rotation needs two).
pub const KEYS_PER_TENANT_MAX: usize = 16;
/// Longest key id.
pub const KEY_ID_BYTES_MAX: usize = 64;
/// Longest secret, in bytes (after hex decoding).
pub const SECRET_BYTES_MAX: usize = 1024;

/// A tenant secret. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Refuses a secret shorter than [`SECRET_BYTES_MIN`] or longer than [`SECRET_BYTES_MAX`].
    pub fn new(bytes: Vec<u8>) -> Result<Self, LineError> {
        if !(SECRET_BYTES_MIN..=SECRET_BYTES_MAX).contains(&bytes.len()) {
            return Err(LineError::SecretLength { bytes: bytes.len() });
        }
        Ok(Self(bytes))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

/// One key of a tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantKey {
    pub id: String,
    pub secret: Secret,
    /// Unix seconds after which the key is refused; `None` never expires.
    pub not_after_s: Option<u64>,
}

impl TenantKey {
    /// Whether the key is refused at `now_ms` (Unix milliseconds): once the clock is past
    /// `not_after`.
    pub fn expired(&self, now_ms: u64) -> bool {
        self.not_after_s.is_some_and(|s| now_ms > s.saturating_mul(1000))
    }
}

/// What is wrong with one line of a key file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LineError {
    #[error("expected `<key-id> <hex secret> [not-after unix-seconds]`, found {fields} fields")]
    Fields { fields: usize },
    #[error(
        "key id {id:?} must be 1 to {KEY_ID_BYTES_MAX} characters of A-Z a-z 0-9 . _ - \
         and may not start with #"
    )]
    KeyId { id: String },
    #[error("the secret is not hexadecimal (two digits per byte)")]
    NotHex,
    #[error("the secret has {bytes} bytes; it needs {SECRET_BYTES_MIN} to {SECRET_BYTES_MAX}")]
    SecretLength { bytes: usize },
    #[error("not-after {text:?} is not a Unix time in seconds")]
    NotAfter { text: String },
    #[error("key id {id} is already defined on line {first}")]
    Duplicate { id: String, first: usize },
}

/// Whether `id` may name a key: 1 to [`KEY_ID_BYTES_MAX`] ASCII letters, digits, `.`, `_`, `-`.
pub fn valid_key_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= KEY_ID_BYTES_MAX
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Hexadecimal text (two digits per byte) as bytes.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| char::from(c).to_digit(16).and_then(|d| u8::try_from(d).ok());
    text.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// Parses key-file text. Errors carry the 1-based line number.
pub fn parse_keys(text: &str) -> Result<Vec<TenantKey>, (usize, LineError)> {
    let mut keys: Vec<(usize, TenantKey)> = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let content = raw.split('#').next().unwrap_or_default().trim();
        if content.is_empty() {
            continue;
        }
        let fields: Vec<&str> = content.split_whitespace().collect();
        let (id, hex, not_after) = match fields.as_slice() {
            [id, hex] => (*id, *hex, None),
            [id, hex, not_after] => (*id, *hex, Some(*not_after)),
            other => return Err((line, LineError::Fields { fields: other.len() })),
        };
        if !valid_key_id(id) {
            return Err((line, LineError::KeyId { id: id.to_owned() }));
        }
        let secret =
            Secret::new(unhex(hex).ok_or((line, LineError::NotHex))?).map_err(|e| (line, e))?;
        let not_after_s = not_after
            .map(|t| t.parse::<u64>().map_err(|_| LineError::NotAfter { text: t.to_owned() }))
            .transpose()
            .map_err(|e| (line, e))?;
        if let Some((first, _)) = keys.iter().find(|(_, k)| k.id == id) {
            return Err((line, LineError::Duplicate { id: id.to_owned(), first: *first }));
        }
        keys.push((line, TenantKey { id: id.to_owned(), secret, not_after_s }));
    }
    Ok(keys.into_iter().map(|(_, k)| k).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX_A: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn parses_keys_comments_and_expiry() {
        let text = format!("# rotation\n\nk1 {HEX_A} 1700000000 # old\n  k2 {HEX_A}\n");
        let keys = parse_keys(&text).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(keys.len(), 2);
        assert_eq!((keys[0].id.as_str(), keys[0].not_after_s), ("k1", Some(1_700_000_000)));
        assert_eq!((keys[1].id.as_str(), keys[1].not_after_s), ("k2", None));
        assert_eq!(keys[0].secret.bytes().len(), 32);
        assert!(keys[0].expired(1_700_000_000_001));
        assert!(!keys[0].expired(1_700_000_000_000));
        assert!(!keys[1].expired(u64::MAX));
    }

    #[test]
    fn every_bad_line_names_its_number_and_problem() {
        let short = &HEX_A[..62];
        let cases: [(String, LineError); 6] = [
            ("k1\n".to_owned(), LineError::Fields { fields: 1 }),
            (format!("\nk/1 {HEX_A}"), LineError::KeyId { id: "k/1".into() }),
            (format!("k1 {HEX_A}x"), LineError::NotHex),
            (format!("k1 {short}"), LineError::SecretLength { bytes: 31 }),
            (format!("k1 {HEX_A} soon"), LineError::NotAfter { text: "soon".into() }),
            (format!("k1 {HEX_A}\nk1 {HEX_A}"), LineError::Duplicate { id: "k1".into(), first: 1 }),
        ];
        for (i, (text, expected)) in cases.into_iter().enumerate() {
            let got = parse_keys(&text).err().unwrap_or_else(|| panic!("case {i} parsed"));
            let line = text.lines().count();
            assert_eq!(got, (line, expected.clone()), "case {i}");
            assert!(!got.1.to_string().is_empty());
        }
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let keys = parse_keys(&format!("k1 {HEX_A}")).unwrap_or_else(|e| panic!("{e:?}"));
        let shown = format!("{keys:?}");
        assert!(!shown.contains("aabb") && !shown.contains("170"), "{shown}");
        assert!(shown.contains("32 bytes"), "{shown}");
    }
}
