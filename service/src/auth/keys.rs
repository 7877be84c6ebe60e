//! Tenant key files on disk: reading and validating one (a regular file, private to its owner,
//! small), and the per-tenant key set that is re-read when its file changes. The line format is
//! the wire crate's ([`gpucache_wire::keys`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub use gpucache_wire::keys::{
    KEY_ID_BYTES_MAX, KEYS_PER_TENANT_MAX, LineError, SECRET_BYTES_MAX, Secret, TenantKey,
    parse_keys, unhex, valid_key_id,
};

// Reading one key file (private, small, well-formed) is the client crate's, so that every client
// reads a key file exactly as the server does.
pub use gpucache_client::key_file::{
    FileStamp, KEY_FILE_BYTES_MAX, KeyFileError, read_key_file, read_with_stamp,
};

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
}
