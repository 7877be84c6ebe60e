//! Reading a tenant key file (ADR 0012): a regular file, private to its owner, small, with 1 to
//! [`KEYS_PER_TENANT_MAX`] well-formed keys in the wire crate's line format. The server reads
//! its tenants' files with it; a client reads the key it signs with from the same kind of file.

use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use gpucache_wire::keys::{KEYS_PER_TENANT_MAX, LineError, TenantKey, parse_keys};

use crate::Credentials;

/// Largest key file read.
pub const KEY_FILE_BYTES_MAX: u64 = 64 << 10;

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

/// What identifies one version of a file: a rename (new inode), a write (mtime, size) or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_s: i64,
    mtime_ns: i64,
}

impl FileStamp {
    pub fn of(meta: &std::fs::Metadata) -> Self {
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

pub fn read_with_stamp(path: &Path) -> Result<(Vec<TenantKey>, FileStamp), KeyFileError> {
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

/// The credentials for `key_id` from a key file (the same file format a server reads).
pub fn credentials_from_key_file(path: &Path, key_id: &str) -> Result<Credentials, String> {
    let keys = read_key_file(path).map_err(|e| e.to_string())?;
    let key = keys
        .into_iter()
        .find(|k| k.id == key_id)
        .ok_or_else(|| format!("{}: no key with id {key_id:?}", path.display()))?;
    Ok(Credentials::new(key.id, key.secret))
}
