//! The block files a FileStore keeps open for reads, so that a GET does not pay an `open` and a
//! `close` (and, cold, a directory lookup) per block.
//!
//! # Keying
//!
//! An entry is keyed by the block's catalog region and by how the file was opened (O_DIRECT or
//! buffered), never by the block's key or path. Region ids are never reused (not even across a
//! restart: each run's ids start at its epoch), so a block re-put under the same key after an
//! invalidation, an eviction or a corrupt drop has a new region and can never be handed the old
//! block's descriptor. The store also forgets a region's entry when the block leaves the catalog,
//! before it unlinks the file, so that an unlinked file is not held open by the cache.
//!
//! A kept descriptor keeps reading the inode the store committed: a file replaced or unlinked
//! behind the store's back is read from the original inode until its entry goes. Every read is
//! checked against the checksum recorded at commit, so this can never serve other bytes.
//!
//! # Bounds
//!
//! At most `limit` descriptors are kept; taking one more evicts the least recently used. An
//! entry handed out is an `Arc<File>`: a read in progress keeps its descriptor open even when
//! the entry is evicted meanwhile, so the descriptors open at any moment are at most `limit`
//! plus those held by reads in flight (each bounded by its batch window).

use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use gpucache_dataplane::registry::RegionId;
use lru::LruCache;
use memmap2::Mmap;

/// Block-log segments kept mapped for lending warm blocks at most (64 MiB of address space
/// each by default); mapping one more unmaps the least recently used.
pub(crate) const MAPPED_SEGMENTS_MAX: usize = 64;

/// What a kept descriptor is the descriptor of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct OpenKey {
    id: OpenId,
    direct: bool,
}

/// What a kept descriptor reads: a block's own file (named by its region), or a segment of the
/// block log that many blocks share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum OpenId {
    Region(RegionId),
    Segment(u64),
}

/// Counters of an [`OpenFiles`] (for tests and operators).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenFilesStats {
    /// Descriptors kept now.
    pub kept: usize,
    /// Most descriptors kept at once.
    pub limit: usize,
    /// Files opened since the store opened (misses of the cache).
    pub opened: u64,
    /// Reads served by a kept descriptor.
    pub reused: u64,
    /// Descriptors dropped to make room for another.
    pub evicted: u64,
}

/// A bounded, least-recently-used set of open block files; see the [module documentation](self).
#[derive(Debug)]
pub(crate) struct OpenFiles {
    kept: Mutex<LruCache<OpenKey, Arc<File>>>,
    /// Read-only maps of log segments, by segment number (see [`Self::map_segment`]).
    maps: Mutex<LruCache<u64, Arc<Mmap>>>,
    opened: AtomicU64,
    reused: AtomicU64,
    evicted: AtomicU64,
}

impl OpenFiles {
    pub(crate) fn new(limit: NonZeroUsize) -> Self {
        Self {
            kept: Mutex::new(LruCache::new(limit)),
            maps: Mutex::new(LruCache::new(
                NonZeroUsize::new(MAPPED_SEGMENTS_MAX).unwrap_or(NonZeroUsize::MIN),
            )),
            opened: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LruCache<OpenKey, Arc<File>>> {
        // The cache holds only descriptors; it stays consistent across a panic elsewhere.
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The descriptor of `region`'s block file at `path`, opened read-only (with O_DIRECT when
    /// `direct`) the first time and kept for the next reads. The caller must hold a read pin on
    /// the region, so that the block cannot leave the catalog (and be forgotten here) meanwhile.
    pub(crate) fn get(&self, id: OpenId, path: &Path, direct: bool) -> io::Result<Arc<File>> {
        let key = OpenKey { id, direct };
        if let Some(file) = self.lock().get(&key) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            return Ok(Arc::clone(file));
        }
        // The open runs outside the lock: a cold one waits on the device.
        let mut options = OpenOptions::new();
        options.read(true);
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = Arc::new(options.open(path)?);
        self.opened.fetch_add(1, Ordering::Relaxed);
        let evicted = {
            let mut kept = self.lock();
            // Another reader of the same region may have opened it meanwhile: keep one.
            if let Some(other) = kept.get(&key) {
                return Ok(Arc::clone(other));
            }
            kept.push(key, Arc::clone(&file))
        };
        if evicted.is_some() {
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        // The evicted descriptor (if no read holds it) closes here, outside the lock.
        drop(evicted);
        Ok(file)
    }

    /// A read-only map of log segment `number` at `path`, made the first time and kept for the
    /// next reads (at most [`MAPPED_SEGMENTS_MAX`]). As for [`Self::get`], the caller holds a
    /// read pin on a block of the segment, so the segment is not deleted meanwhile; a segment
    /// is never shortened while the store runs (it is made at its full size and only deleted),
    /// so no page of the map can lie past the end of its file.
    pub(crate) fn map_segment(&self, number: u64, path: &Path) -> io::Result<Arc<Mmap>> {
        let maps = || self.maps.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(map) = maps().get(&number) {
            return Ok(Arc::clone(map));
        }
        let file = self.get(OpenId::Segment(number), path, false)?;
        // SAFETY: the map is read-only, and the store never truncates or rewrites a segment's
        // bytes while a block in them lives (a removal changes one state byte of a record's
        // frame, which no lent payload covers); every lent payload is hashed and checked against
        // its committed checksum before the sender uses it.
        let map = Arc::new(unsafe { Mmap::map(&*file)? });
        let mut kept = maps();
        if let Some(other) = kept.get(&number) {
            return Ok(Arc::clone(other));
        }
        let evicted = kept.push(number, Arc::clone(&map));
        drop(kept);
        drop(evicted);
        Ok(map)
    }

    /// Drops the descriptors kept for `region` (its block left the catalog).
    pub(crate) fn forget(&self, region: RegionId) {
        self.forget_id(OpenId::Region(region));
    }

    /// Drops the kept descriptors and map of a deleted log segment (readers holding one keep
    /// it).
    pub(crate) fn forget_segment(&self, number: u64) {
        self.forget_id(OpenId::Segment(number));
        let map = self.maps.lock().unwrap_or_else(PoisonError::into_inner).pop(&number);
        drop(map);
    }

    fn forget_id(&self, id: OpenId) {
        let dropped = {
            let mut kept = self.lock();
            [false, true].map(|direct| kept.pop(&OpenKey { id, direct }))
        };
        drop(dropped);
    }

    pub(crate) fn stats(&self) -> OpenFilesStats {
        let kept = self.lock();
        OpenFilesStats {
            kept: kept.len(),
            limit: kept.cap().get(),
            opened: self.opened.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).expect("nonzero")
    }

    #[test]
    fn keeps_at_most_its_limit_and_evicts_the_least_recently_used() {
        let dir = tempfile::tempdir().expect("dir");
        let files = OpenFiles::new(limit(2));
        let paths: Vec<_> = (0..3)
            .map(|i| {
                let p = dir.path().join(format!("{i}.blk"));
                std::fs::write(&p, [i]).expect("write");
                p
            })
            .collect();
        files.get(OpenId::Region(RegionId(1)), &paths[0], false).expect("open");
        files.get(OpenId::Region(RegionId(2)), &paths[1], false).expect("open");
        // Region 1 is used again, so region 2 is the one to go.
        files.get(OpenId::Region(RegionId(1)), &paths[0], false).expect("reuse");
        files.get(OpenId::Region(RegionId(3)), &paths[2], false).expect("open");
        let s = files.stats();
        assert_eq!((s.kept, s.limit, s.opened, s.reused, s.evicted), (2, 2, 3, 1, 1));
        files.get(OpenId::Region(RegionId(1)), &paths[0], false).expect("still kept");
        assert_eq!(files.stats().opened, 3, "region 1 was evicted instead of region 2");
        files.get(OpenId::Region(RegionId(2)), &paths[1], false).expect("reopened");
        assert_eq!(files.stats().opened, 4);
        assert_eq!(files.stats().kept, 2);
    }

    #[test]
    fn regions_and_modes_are_kept_apart_and_forgotten() {
        let dir = tempfile::tempdir().expect("dir");
        let files = OpenFiles::new(limit(8));
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"a").expect("write");
        std::fs::write(&b, b"b").expect("write");
        let first = files.get(OpenId::Region(RegionId(1)), &a, false).expect("open");
        // The same path under another region is another block: never the kept descriptor.
        let other = files.get(OpenId::Region(RegionId(2)), &a, false).expect("open");
        assert!(!Arc::ptr_eq(&first, &other));
        assert!(Arc::ptr_eq(
            &first,
            &files.get(OpenId::Region(RegionId(1)), &b, false).expect("kept")
        ));
        files.forget(RegionId(1));
        assert_eq!(files.stats().kept, 1);
        // Forgotten: region 1 opens whatever its path names now.
        std::fs::remove_file(&a).expect("unlink");
        assert_eq!(
            files.get(OpenId::Region(RegionId(1)), &a, false).expect_err("gone").kind(),
            io::ErrorKind::NotFound
        );
        // A descriptor handed out stays usable after its entry goes.
        files.forget(RegionId(2));
        assert_eq!(other.metadata().expect("fstat").len(), 1);
    }
}
