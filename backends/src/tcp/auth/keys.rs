//! Tenant key files: parsing, validation, and reloading when the file changes.
//!
//! A key file holds one key per line, `<key-id> <hex secret> [not-after]`, where `not-after` is
//! a Unix time in seconds after which the key is refused; `#` starts a comment. Several lines
//! are what make rotation work without a restart (ADR 0012, `docs/OPERATIONS.md`).

use std::fmt;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::tcp::proto::seal::SECRET_BYTES_MIN;

/// Largest key file read.
pub const KEY_FILE_BYTES_MAX: u64 = 64 << 10;
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

/// Why a key file was refused. Display never includes secret bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFileError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path} is not a regular file")]
    NotAFile { path: PathBuf },
    #[error(
        "{path} has mode {mode:04o}: group or others may access it; make it readable by the \
         service's user only (chmod 600)"
    )]
    TooOpen { path: PathBuf, mode: u32 },
    #[error("{path}: larger than {bytes_max} bytes; not a key file")]
    TooLarge { path: PathBuf, bytes_max: u64 },
    #[error("{path} line {line}: {error}")]
    Line { path: PathBuf, line: usize, error: LineError },
    #[error("{path} holds no key")]
    Empty { path: PathBuf },
    #[error("{path} holds {count} keys; at most {KEYS_PER_TENANT_MAX} are allowed")]
    TooManyKeys { path: PathBuf, count: usize },
}

fn valid_key_id(id: &str) -> bool {
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

/// What identifies one version of a file: a rename (new inode), a write (mtime, size) or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_s: i64,
    mtime_ns: i64,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_s: meta.mtime(),
            mtime_ns: meta.mtime_nsec(),
        }
    }
}

/// Reads and validates a key file: a regular file, private to its owner, small, with 1 to
/// [`KEYS_PER_TENANT_MAX`] well-formed keys.
pub fn read_key_file(path: &Path) -> Result<Vec<TenantKey>, KeyFileError> {
    read_with_stamp(path).map(|(keys, _)| keys)
}

fn read_with_stamp(path: &Path) -> Result<(Vec<TenantKey>, FileStamp), KeyFileError> {
    let io_err = |source| KeyFileError::Io { path: path.to_owned(), source };
    let file = std::fs::File::open(path).map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(KeyFileError::NotAFile { path: path.to_owned() });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::TooOpen { path: path.to_owned(), mode });
    }
    let mut text = String::new();
    file.take(KEY_FILE_BYTES_MAX + 1).read_to_string(&mut text).map_err(io_err)?;
    if text.len() as u64 > KEY_FILE_BYTES_MAX {
        return Err(KeyFileError::TooLarge {
            path: path.to_owned(),
            bytes_max: KEY_FILE_BYTES_MAX,
        });
    }
    let keys = parse_keys(&text).map_err(|(line, error)| KeyFileError::Line {
        path: path.to_owned(),
        line,
        error,
    })?;
    if keys.is_empty() {
        return Err(KeyFileError::Empty { path: path.to_owned() });
    }
    if keys.len() > KEYS_PER_TENANT_MAX {
        return Err(KeyFileError::TooManyKeys { path: path.to_owned(), count: keys.len() });
    }
    Ok((keys, FileStamp::of(&meta)))
}

#[derive(Debug)]
struct Loaded {
    keys: Arc<[TenantKey]>,
    /// The version of the file `keys` came from, or that last failed to load (so a bad file
    /// is reported once, not at every HELLO).
    stamp: Option<FileStamp>,
}

/// A tenant's keys, from a file that is re-read when it changes (checked with one `stat` per
/// HELLO), or fixed in memory. A reload that fails validation keeps the keys in force and
/// logs the error. Each tenant has its own lock, taken for a read at HELLO only.
#[derive(Debug)]
pub struct TenantKeys {
    path: Option<PathBuf>,
    loaded: RwLock<Loaded>,
}

impl TenantKeys {
    /// Loads `path` (see [`read_key_file`]).
    pub fn load(path: &Path) -> Result<Self, KeyFileError> {
        let (keys, stamp) = read_with_stamp(path)?;
        let loaded = Loaded { keys: keys.into(), stamp: Some(stamp) };
        Ok(Self { path: Some(path.to_owned()), loaded: RwLock::new(loaded) })
    }

    /// Keys held in memory only (embedding, tests). Refuses none, too many, or repeated ids.
    pub fn fixed(keys: Vec<TenantKey>) -> Result<Self, LineError> {
        for (i, k) in keys.iter().enumerate() {
            if let Some(first) = keys[..i].iter().position(|o| o.id == k.id) {
                return Err(LineError::Duplicate { id: k.id.clone(), first: first + 1 });
            }
            if !valid_key_id(&k.id) {
                return Err(LineError::KeyId { id: k.id.clone() });
            }
        }
        if keys.is_empty() || keys.len() > KEYS_PER_TENANT_MAX {
            return Err(LineError::Fields { fields: keys.len() });
        }
        Ok(Self { path: None, loaded: RwLock::new(Loaded { keys: keys.into(), stamp: None }) })
    }

    /// The keys in force, after re-reading the file if it changed since it was last read.
    pub fn current(&self) -> Arc<[TenantKey]> {
        if let Some(path) = &self.path {
            self.refresh(path);
        }
        match self.loaded.read() {
            Ok(l) => Arc::clone(&l.keys),
            Err(poisoned) => Arc::clone(&poisoned.into_inner().keys),
        }
    }

    /// The key `id`, if it is one of the keys in force.
    pub fn find(&self, id: &str) -> Option<TenantKey> {
        self.current().iter().find(|k| k.id == id).cloned()
    }

    fn refresh(&self, path: &Path) {
        let stamp = std::fs::metadata(path).ok().map(|m| FileStamp::of(&m));
        let known = self.loaded.read().map_or(None, |l| l.stamp);
        if stamp.is_none() || stamp == known {
            // A missing file keeps the keys in force (a rename in progress, or an operator's
            // mistake that the next HELLO after the fix picks up).
            return;
        }
        let Ok(mut loaded) = self.loaded.write() else { return };
        if loaded.stamp == stamp {
            return; // another HELLO reloaded it meanwhile
        }
        match read_with_stamp(path) {
            Ok((keys, fresh)) => {
                tracing::info!(path = %path.display(), keys = keys.len(), "tenant keys reloaded");
                loaded.keys = keys.into();
                loaded.stamp = Some(fresh);
            }
            Err(e) => {
                tracing::error!(error = %e, "tenant key file reload failed; the previous keys stay in force");
                loaded.stamp = stamp;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const HEX_A: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    fn private_file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap_or_else(|e| panic!("{e}"));
        f.write_all(text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600))
            .unwrap_or_else(|e| panic!("{e}"));
        f
    }

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
    fn files_open_to_others_are_refused() {
        let f = private_file(&format!("k1 {HEX_A}\n"));
        assert!(read_key_file(f.path()).is_ok());
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o644))
            .unwrap_or_else(|e| panic!("{e}"));
        let e = read_key_file(f.path()).err().unwrap_or_else(|| panic!("0644 was accepted"));
        assert!(matches!(e, KeyFileError::TooOpen { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
    }

    #[test]
    fn empty_and_oversize_files_are_refused() {
        let f = private_file("# nothing yet\n");
        assert!(matches!(read_key_file(f.path()), Err(KeyFileError::Empty { .. })));
        let many: String = (0..=KEYS_PER_TENANT_MAX).map(|i| format!("k{i} {HEX_A}\n")).collect();
        let f = private_file(&many);
        assert!(matches!(read_key_file(f.path()), Err(KeyFileError::TooManyKeys { .. })));
        let big = private_file(&"#".repeat(usize::try_from(KEY_FILE_BYTES_MAX).unwrap_or(0) + 1));
        assert!(matches!(read_key_file(big.path()), Err(KeyFileError::TooLarge { .. })));
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let keys = parse_keys(&format!("k1 {HEX_A}")).unwrap_or_else(|e| panic!("{e:?}"));
        let shown = format!("{keys:?}");
        assert!(!shown.contains("aabb") && !shown.contains("170"), "{shown}");
        assert!(shown.contains("32 bytes"), "{shown}");
    }
}
