//! Evicted blocks handed to a tier below: when a store is told to hand its evictions down, an
//! evicted block's file is kept (out of the catalog, so it no longer counts against any limit
//! and no read finds it) until the tier below takes it, reads it and lets it go. At most 4,096
//! wait; beyond that the oldest file is removed as an eviction always removes it.
//!
//! A crash leaves the files not taken yet in place, and the next open finds them as the
//! committed blocks they were (the bytes are theirs, checked as every block is).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;

use super::block_log::{BlockLog, LogSlot};
use super::{FilePayload, FileStore};

/// A block the file tier evicted, whose file waits for the tier below. Dropping it removes
/// the file.
#[derive(Debug)]
pub struct EvictedFile {
    pub key: PhysicalKey,
    pub checksum: Checksum,
    pub len: u64,
    path: PathBuf,
    header_len: u64,
    /// Its record, when the block lives in the block log (marked removed when let go).
    record: Option<(Arc<BlockLog>, LogSlot)>,
}

/// Why an evicted block's bytes could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EvictedReadError {
    #[error("reading {}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{} no longer matches its checksum", .path.display())]
    Corrupt { path: PathBuf },
}

impl EvictedFile {
    /// The block's bytes, checked against its checksum.
    pub fn read(&self) -> Result<Vec<u8>, EvictedReadError> {
        let io = |source| EvictedReadError::Io { path: self.path.clone(), source };
        let len = usize::try_from(self.len)
            .map_err(|_| io(io::Error::new(io::ErrorKind::InvalidData, "block too large")))?;
        let mut bytes = vec![0u8; len];
        File::open(&self.path)
            .and_then(|f| f.read_exact_at(&mut bytes, self.header_len))
            .map_err(io)?;
        if Checksum::of(&bytes) != self.checksum {
            return Err(EvictedReadError::Corrupt { path: self.path.clone() });
        }
        Ok(bytes)
    }
}

impl Drop for EvictedFile {
    fn drop(&mut self) {
        match &self.record {
            Some((log, slot)) => {
                if let Err(e) = log.kill(*slot) {
                    tracing::warn!(segment = %self.path.display(), error = %e,
                        "could not mark a handed-down block's log record; the next open finds it");
                }
            }
            None => super::remove_block_file(&self.path),
        }
    }
}

/// Moves a committed block's file out of an entry being evicted, leaving a stand-in that
/// removes nothing.
fn take_file(p: &mut FilePayload) -> FilePayload {
    match p {
        FilePayload::Stored { .. } => std::mem::replace(p, FilePayload::Staged(Vec::new())),
        _ => FilePayload::Staged(Vec::new()),
    }
}

impl FileStore {
    /// From now on, keeps each evicted block's file for [`Self::take_handed_down`].
    pub fn hand_down_evictions(&self) {
        self.lock().hand_down_evictions(take_file);
    }

    /// The blocks evicted since the last call whose files wait, oldest first. Blocks with no
    /// file (deferred ones, whose bytes the tier above held) are not among them.
    pub fn take_handed_down(&self) -> Vec<EvictedFile> {
        let handed = self.lock().take_handed_down();
        handed
            .into_iter()
            .filter_map(|h| match h.payload {
                FilePayload::Stored { region, path, header_len, slot, .. } => {
                    if slot.is_none() {
                        self.files.forget(region);
                    }
                    let record = slot.and_then(|slot| Some((Arc::clone(self.log.as_ref()?), slot)));
                    Some(EvictedFile {
                        key: h.key,
                        checksum: h.checksum,
                        len: h.len,
                        path: path.to_path_buf(),
                        header_len,
                        record,
                    })
                }
                _ => None,
            })
            .collect()
    }

    /// Evicted blocks whose files were removed before the tier below took them.
    pub fn handed_down_dropped(&self) -> u64 {
        self.lock().handed_down_dropped()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpucache_dataplane::clock::ManualClock;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::limits::ResourceLimits;
    use gpucache_dataplane::store::{Get, MissReason, Put, Store};
    use gpucache_dataplane::testing::fixture;

    use super::super::FileStoreConfig;

    #[test]
    fn evicted_files_wait_for_the_tier_below_and_go_when_let_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = FileStoreConfig::new(dir.path());
        config.limits = ResourceLimits {
            retained_bytes_max: 3 * 4096,
            tenant_retained_bytes_max: 3 * 4096,
            object_bytes_max: 4096,
            tenant_inflight_bytes_max: 4096,
            ..ResourceLimits::default()
        };
        let store = config.open(Arc::new(ManualClock::default())).expect("open");
        store.hand_down_evictions();
        let caller = fixture::caller(0);
        let keys: Vec<_> = (0..5u8).map(|n| fixture::key(0, &[n], KvDtype::F16, 16)).collect();
        for (n, key) in keys.iter().enumerate() {
            let bytes = fixture::payload(n as u64, 4096);
            assert!(matches!(store.put(&caller, key, &bytes, None), Ok(Put::Committed(_))));
        }
        let evicted = store.take_handed_down();
        assert_eq!(evicted.iter().map(|e| e.key.clone()).collect::<Vec<_>>(), keys[..2]);
        let mut dst = vec![0u8; 4096];
        assert_eq!(
            store.get_into(&caller, &keys[0], &mut dst).expect("get"),
            Get::Miss(MissReason::Absent),
            "an evicted block is gone from the store"
        );
        for (n, e) in evicted.iter().enumerate() {
            assert_eq!(e.read().expect("read"), fixture::payload(n as u64, 4096));
        }
        let path = evicted[0].path.clone();
        assert!(path.exists());
        drop(evicted);
        assert!(!path.exists(), "letting the block go removes its file");
        assert!(store.take_handed_down().is_empty());
    }
}
