//! Deferred writes: blocks the catalog commits before their file exists.
//!
//! A tier above the FileStore that keeps a block's bytes itself (the memory tier of a tiered
//! store that writes back) commits the block here with [`FileStore::commit_deferred`].
//! Admission, quotas, request ids and eviction run exactly as for a PUT and the block counts as
//! committed, but no byte is written. The bytes reach a file when that tier hands them down
//! with [`FileStore::write_deferred`] (when it evicts the block, or at a flush). Until then a
//! read here is a miss and a restart does not find the block: its header was never written.
//! [`FileStore::forget_deferred`] takes out a block whose bytes the tier above lost, so that
//! the catalog never promises what nobody holds.
//!
//! A deferred block the catalog evicts or invalidates while its write is under way has its
//! new file removed when the write finishes; a crash between the two leaves that file, and the
//! next open loads it (a block that was committed, whole and checksummed).

use std::sync::atomic::Ordering;

use gpucache_dataplane::BlockState;
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{CorruptPhase, CorruptReason, Put, StorageEffect, StoreError};

use super::{FilePayload, FileStore, JOURNAL_FILE, layout};

impl FileStore {
    /// [`Store::put`](gpucache_dataplane::store::Store::put) without the write: the block is
    /// committed under the checksum of `src` (compared with `expected` when given) and its
    /// bytes stay with the caller, who must later pass them to [`Self::write_deferred`] or
    /// call [`Self::forget_deferred`].
    pub fn commit_deferred(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
        expected: Option<Checksum>,
    ) -> Result<Put, StoreError> {
        let admitted = match self.admit_put(caller, key, src, request, expected)? {
            Ok(admitted) => admitted,
            Err(answer) => return Ok(answer),
        };
        let (seq, epoch) = admitted.seq_epoch;
        let len = src.len() as u64;
        let now = self.clock.now_ms();
        let mut catalog = self.lock();
        let committed = catalog.finish_commit_at(admitted.region, admitted.checksum, seq, now)?;
        if let Some(b) = catalog.entry_mut(admitted.region) {
            b.payload = FilePayload::Deferred { epoch, writing: false, seq, len };
        }
        self.deferred[0].fetch_add(1, Ordering::Relaxed);
        self.deferred[1].fetch_add(len, Ordering::Relaxed);
        // Journaled before the PUT is answered, so that a crash's loss can be counted.
        let waiting = || {
            catalog
                .entries()
                .filter_map(|b| match b.payload {
                    FilePayload::Deferred { seq, len, .. } => Some((seq, len)),
                    _ => None,
                })
                .collect()
        };
        if let Err(e) = self.journal.acknowledged(seq, len, waiting) {
            let released = catalog.remove_committed(admitted.region);
            drop(catalog);
            self.dispose(released);
            let path = self.root.join(JOURNAL_FILE);
            return Err(StoreError::storage(
                "commit",
                "write-back journal",
                &path,
                &e,
                StorageEffect::Unchanged,
            ));
        }
        Ok(Put::Committed(committed.checksum))
    }

    /// One deferred block less: its file is written, or it left the catalog.
    pub(super) fn deferred_settled(&self, seq: u64, len: u64) {
        self.deferred[0].fetch_sub(1, Ordering::Relaxed);
        self.deferred[1].fetch_sub(len, Ordering::Relaxed);
        if let Err(e) = self.journal.settled(seq) {
            // Its file exists or it left: the next open counts it lost only if its file is gone.
            tracing::debug!(error = %e, "could not journal a settled write-back block");
        }
    }

    /// Committed blocks waiting for their files, and their payload bytes: what a crash now
    /// would lose.
    pub fn deferred_totals(&self) -> (u64, u64) {
        (self.deferred[0].load(Ordering::Relaxed), self.deferred[1].load(Ordering::Relaxed))
    }

    /// Writes the deferred block under `key` whose checksum is `checksum` from `bytes`, its
    /// payload, durably as the store's durability says. `Ok(false)` when no such block waits
    /// for its bytes (it was written already, evicted, invalidated, or the key holds another
    /// version). On an error the block stays deferred.
    pub fn write_deferred(
        &self,
        key: &PhysicalKey,
        checksum: Checksum,
        bytes: &[u8],
    ) -> Result<bool, StoreError> {
        let (region, seq, epoch) = {
            let mut catalog = self.lock();
            let Some(id) = catalog.find_exact(key) else { return Ok(false) };
            let Some(b) = catalog.entry_mut(id) else { return Ok(false) };
            if b.life.state() != BlockState::Committed
                || b.checksum != Some(checksum)
                || b.len != bytes.len() as u64
            {
                return Ok(false);
            }
            let seq = b.seq;
            match &mut b.payload {
                FilePayload::Deferred { epoch, writing: writing @ false, .. } => {
                    *writing = true;
                    (id, seq, *epoch)
                }
                _ => return Ok(false),
            }
        };
        match self.persist(key, region, (seq, epoch), bytes, checksum) {
            Ok((path, header_len, _, slot)) => {
                let mut catalog = self.lock();
                match catalog.entry_mut(region) {
                    Some(b) if matches!(b.payload, FilePayload::Deferred { .. }) => {
                        b.payload =
                            FilePayload::Stored { region, path, header_len, removing: false, slot };
                        drop(catalog);
                        self.deferred_settled(seq, bytes.len() as u64);
                        Ok(true)
                    }
                    // The block left while its file was written: so does the file.
                    _ => {
                        drop(catalog);
                        self.release(&path, slot);
                        Ok(false)
                    }
                }
            }
            Err(e) => {
                if let Some(FilePayload::Deferred { writing, .. }) =
                    self.lock().entry_mut(region).map(|b| &mut b.payload)
                {
                    *writing = false;
                }
                let path = layout::block_path(&self.root, key, seq);
                Err(StoreError::storage(
                    "write back",
                    "block write",
                    &path,
                    &e,
                    StorageEffect::Unchanged,
                ))
            }
        }
    }

    /// Takes out the deferred block under `key` whose checksum is `checksum` (its bytes are
    /// lost above); whether one was there. A block whose write is under way stays. `damaged`
    /// says why when the bytes were found damaged, and the drop counts among the store's
    /// corrupt drops.
    pub fn forget_deferred(
        &self,
        key: &PhysicalKey,
        checksum: Checksum,
        damaged: Option<(CorruptPhase, CorruptReason)>,
    ) -> bool {
        let released = {
            let mut catalog = self.lock();
            let Some(id) = catalog.find_exact(key) else { return false };
            let deferred = catalog.entry(id).is_some_and(|b| {
                b.checksum == Some(checksum)
                    && matches!(b.payload, FilePayload::Deferred { writing: false, .. })
            });
            if !deferred {
                return false;
            }
            if let Some((phase, reason)) = damaged {
                catalog.count_corrupt(phase, reason, 1);
            }
            catalog.remove_committed(id)
        };
        self.dispose(released);
        true
    }

    /// Whether the committed block under `key` waits for its bytes.
    pub fn is_deferred(&self, key: &PhysicalKey) -> bool {
        let catalog = self.lock();
        catalog
            .find_exact(key)
            .and_then(|id| catalog.entry(id))
            .is_some_and(|b| matches!(b.payload, FilePayload::Deferred { .. }))
    }

    /// Every committed block that waits for its bytes: key, checksum and length.
    pub fn deferred_blocks(&self) -> Vec<(PhysicalKey, Checksum, u64)> {
        let catalog = self.lock();
        catalog
            .entries()
            .filter(|b| {
                b.life.state() == BlockState::Committed
                    && matches!(b.payload, FilePayload::Deferred { .. })
            })
            .filter_map(|b| Some((b.key.clone(), b.checksum?, b.len)))
            .collect()
    }
}
