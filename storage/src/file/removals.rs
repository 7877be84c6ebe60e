//! [`Store::invalidate_batch`] for the FileStore: the invalidations of a window of keys share
//! one catalog lock to start, one durability step (one sync per block directory under
//! `PerBlock`, one group flush under `GroupCommit`) and one lock to finish, and each key is
//! answered exactly as [`Store::invalidate`] would answer it.
//!
//! Each key's file is unlinked before any of the window's directories is synced, and each key
//! is acknowledged only after the sync that covers its unlink, so every acknowledged removal is
//! as durable as it is one key at a time. A key named twice waits for the next window, so that
//! the second sees what an invalidation after the first would see.
//!
//! [`Store::invalidate_batch`]: gpucache_dataplane::store::Store::invalidate_batch
//! [`Store::invalidate`]: gpucache_dataplane::store::Store::invalidate

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::path::Path;
use std::sync::Arc;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::registry::RegionId;
use gpucache_dataplane::store::{Invalidate, StorageEffect, StoreError};

use super::block_log::LogSlot;
use super::engine::IoSide;
use super::{BATCH_WINDOW_ITEMS, Durability, FilePayload, FileStore, LOG_DIR};

const OP: &str = "invalidate";

impl FileStore {
    /// Unlinks an invalidated block's file (a file already gone counts as unlinked), or marks
    /// its log record removed; a failure changed nothing.
    pub(super) fn unlink_block(
        &self,
        path: &Path,
        slot: Option<LogSlot>,
    ) -> Result<(), StoreError> {
        if let (Some(slot), Some(log)) = (slot, &self.log) {
            let marked = log.kill(slot);
            self.io_watch.record(IoSide::Write, &marked);
            return marked.map_err(|e| {
                StoreError::storage(OP, "log record", path, &e, StorageEffect::Unchanged)
            });
        }
        match self.engine.remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::storage(OP, "unlink", path, &e, StorageEffect::Unchanged)),
        }
    }

    /// Makes the removals already done in `dir` durable under the store's policy: a sync of
    /// the directory (`PerBlock`), the shared flush (`GroupCommit`, which covers every
    /// directory), a flush of the block log for records marked in it, or nothing (`None`,
    /// which survives a process crash only, as its commits do).
    pub(super) fn sync_removals(&self, dir: &Path) -> Result<(), StoreError> {
        let in_log = self.log.as_ref().filter(|_| dir == self.root.join(LOG_DIR));
        let synced = match (self.durability, in_log) {
            (Durability::None, _) => Ok(()),
            (_, Some(log)) => log.barrier().map_err(|e| ("block log flush", e)),
            (Durability::PerBlock, None) => {
                self.engine.sync_dir(dir).map_err(|e| ("directory sync", e))
            }
            (Durability::GroupCommit, None) => self.group.barrier().map_err(|e| ("group flush", e)),
        };
        synced
            .map_err(|(step, e)| StoreError::storage(OP, step, dir, &e, StorageEffect::NotDurable))
    }

    /// [`Store::invalidate_batch`](gpucache_dataplane::store::Store::invalidate_batch).
    pub(super) fn invalidate_many(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
    ) -> Vec<Result<Invalidate, StoreError>> {
        let mut answers = Vec::with_capacity(keys.len());
        while answers.len() < keys.len() {
            self.invalidate_window(caller, &keys[answers.len()..], &mut answers);
        }
        answers
    }

    /// Answers a window at the front of `keys` (at least one key), appending to `answers`.
    fn invalidate_window(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
        answers: &mut Vec<Result<Invalidate, StoreError>>,
    ) {
        let first = answers.len();
        // (answer slot, block, its file) of every block this window removes.
        let mut marked: Vec<(usize, RegionId, Arc<Path>, Option<LogSlot>)> = Vec::new();
        // Payloads of blocks that left the catalog (deferred ones at once, stored ones once
        // their files are gone).
        let mut released = Vec::new();
        {
            let mut seen: HashSet<KeyDigest> = HashSet::new();
            let mut catalog = self.lock();
            for key in keys.iter().take(BATCH_WINDOW_ITEMS) {
                if !seen.insert(key.digest()) {
                    break;
                }
                let answer = match catalog.removable(caller, key) {
                    Err(e) => Err(e),
                    Ok(Err(answer)) => Ok(answer),
                    Ok(Ok(id)) => match catalog.entry_mut(id).map(|b| &mut b.payload) {
                        Some(FilePayload::Stored {
                            path,
                            removing: removing @ false,
                            slot,
                            ..
                        }) => {
                            *removing = true;
                            marked.push((answers.len(), id, Arc::clone(path), *slot));
                            Ok(Invalidate::Removed)
                        }
                        // No file to remove: the block leaves the catalog now.
                        Some(FilePayload::Deferred { writing: false, .. }) => {
                            released.extend(catalog.remove_committed(id));
                            Ok(Invalidate::Removed)
                        }
                        // Another invalidation is removing it, or its deferred write is under
                        // way.
                        _ => Ok(Invalidate::Busy),
                    },
                };
                answers.push(answer);
            }
        }
        if marked.is_empty() {
            self.dispose(released);
            return;
        }
        // Every unlink first, then one durability step per directory (or one flush).
        let unlinked: Vec<Result<(), StoreError>> =
            marked.iter().map(|(_, _, path, slot)| self.unlink_block(path, *slot)).collect();
        let mut synced: BTreeMap<&Path, Result<(), StoreError>> = BTreeMap::new();
        // Under `GroupCommit`, the one flush that covers every block directory.
        let mut group_flush: Option<Result<(), StoreError>> = None;
        let log_dir = self.root.join(LOG_DIR);
        for ((_, _, path, _), unlinked) in marked.iter().zip(&unlinked) {
            let dir = path.parent().unwrap_or(&self.root);
            if unlinked.is_ok() && !synced.contains_key(dir) {
                let result = match (self.durability, &group_flush) {
                    (Durability::GroupCommit, Some(done)) if dir != log_dir => done.clone(),
                    _ => self.sync_removals(dir),
                };
                if self.durability == Durability::GroupCommit && dir != log_dir {
                    group_flush = Some(result.clone());
                }
                synced.insert(dir, result);
            }
        }
        let removed: Vec<Result<(), StoreError>> = marked
            .iter()
            .zip(unlinked)
            .map(|((_, _, path, _), unlinked)| {
                let dir = path.parent().unwrap_or(&self.root);
                unlinked.and_then(|()| synced.get(dir).cloned().unwrap_or(Ok(())))
            })
            .collect();
        {
            let mut catalog = self.lock();
            for ((_, id, _, _), removed) in marked.iter().zip(&removed) {
                match removed {
                    Err(StoreError::Storage { effect: StorageEffect::Unchanged, .. }) => {
                        if let Some(FilePayload::Stored { removing, .. }) =
                            catalog.entry_mut(*id).map(|b| &mut b.payload)
                        {
                            *removing = false;
                        }
                    }
                    // The file is gone (durably, or at least from the namespace): so is the
                    // block.
                    _ => released.extend(catalog.remove_committed(*id)),
                }
            }
        }
        self.dispose(released);
        for ((slot, _, path, _), removed) in marked.into_iter().zip(removed) {
            if let Err(e) = removed {
                tracing::warn!(path = %path.display(), error = %e, "invalidation not acknowledged");
                if let Some(answer) = answers.get_mut(slot) {
                    *answer = Err(e);
                }
            }
        }
        debug_assert!(answers.len() > first, "a window answers at least one key");
    }
}
