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
use std::path::{Path, PathBuf};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::registry::RegionId;
use gpucache_dataplane::store::{Invalidate, StorageEffect, StoreError};

use super::{BATCH_WINDOW_ITEMS, Durability, FilePayload, FileStore};

const OP: &str = "invalidate";

impl FileStore {
    /// Unlinks an invalidated block's file (a file already gone counts as unlinked); a failure
    /// changed nothing.
    pub(super) fn unlink_block(&self, path: &Path) -> Result<(), StoreError> {
        self.log_gone(path);
        match self.engine.remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::storage(OP, "unlink", path, &e, StorageEffect::Unchanged)),
        }
    }

    /// Makes the unlinks already done in `dir` durable under the store's policy: a sync of the
    /// directory (`PerBlock`), the shared flush (`GroupCommit`, which covers every directory),
    /// or nothing (`None`, which survives a process crash only, as its commits do).
    pub(super) fn sync_removals(&self, dir: &Path) -> Result<(), StoreError> {
        let synced = match self.durability {
            Durability::PerBlock => self.engine.sync_dir(dir).map_err(|e| ("directory sync", e)),
            Durability::GroupCommit => self.group.barrier().map_err(|e| ("group flush", e)),
            // The gone records `unlink_block` appended are durable after the log's flush.
            Durability::Logged => match &self.log {
                Some(log) => log.barrier().map_err(|e| ("commit log flush", e)),
                None => self.engine.sync_dir(dir).map_err(|e| ("directory sync", e)),
            },
            Durability::None => Ok(()),
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
        let mut marked: Vec<(usize, RegionId, PathBuf)> = Vec::new();
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
                        Some(FilePayload::Stored { path, removing: removing @ false, .. }) => {
                            *removing = true;
                            marked.push((answers.len(), id, path.clone()));
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
            marked.iter().map(|(_, _, path)| self.unlink_block(path)).collect();
        let mut synced: BTreeMap<&Path, Result<(), StoreError>> = BTreeMap::new();
        for ((_, _, path), unlinked) in marked.iter().zip(&unlinked) {
            let dir = path.parent().unwrap_or(&self.root);
            if unlinked.is_ok() && !synced.contains_key(dir) {
                let result = match (self.durability, synced.values().next()) {
                    // One flush covers every directory.
                    (Durability::GroupCommit | Durability::Logged, Some(done)) => done.clone(),
                    _ => self.sync_removals(dir),
                };
                synced.insert(dir, result);
            }
        }
        let removed: Vec<Result<(), StoreError>> = marked
            .iter()
            .zip(unlinked)
            .map(|((_, _, path), unlinked)| {
                let dir = path.parent().unwrap_or(&self.root);
                unlinked.and_then(|()| synced.get(dir).cloned().unwrap_or(Ok(())))
            })
            .collect();
        {
            let mut catalog = self.lock();
            for ((_, id, _), removed) in marked.iter().zip(&removed) {
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
        for ((slot, _, path), removed) in marked.into_iter().zip(removed) {
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
