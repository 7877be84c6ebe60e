//! The agent's persisted epoch: one small file under the state dir, replaced atomically (write
//! a temporary file, fsync it, rename it over the old one, fsync the directory) and bumped at
//! every start, so that a restarted agent never reuses the epoch of work it may have lost.

use std::fs::{self, File};
use std::path::Path;

use gpucache_dataplane::registry::Epoch;

use crate::error::{DpuError, io_at};

/// The epoch file's name under the state dir.
pub const EPOCH_FILE: &str = "AGENT_EPOCH";
const MAGIC: &str = "gpucache-dpu-epoch v1";

/// The epoch the state dir records, if any (an unreadable file reads as none).
pub fn read_persisted_epoch(state_dir: &Path) -> Option<Epoch> {
    let text = fs::read_to_string(state_dir.join(EPOCH_FILE)).ok()?;
    let mut lines = text.lines();
    (lines.next()? == MAGIC).then_some(())?;
    lines.next()?.trim().parse().ok().map(Epoch)
}

/// How far the epoch jumps past an unreadable record, so no lost epoch is reused.
const EPOCH_JUMP_AFTER_LOSS: u64 = 1 << 20;

/// The epoch this run will have: one past the persisted record, or past
/// [`EPOCH_JUMP_AFTER_LOSS`] when the record is unreadable. Persists nothing.
pub(crate) fn next_epoch(state_dir: &Path) -> Result<Epoch, DpuError> {
    let previous = match read_persisted_epoch(state_dir) {
        Some(e) => e.0,
        None if state_dir.join(EPOCH_FILE).exists() => EPOCH_JUMP_AFTER_LOSS,
        None => 0,
    };
    previous
        .checked_add(1)
        .map(Epoch)
        .ok_or_else(|| DpuError::Config(format!("agent epoch space exhausted at {previous}")))
}

/// Persists `epoch` (from [`next_epoch`]) as the state dir's record, durably.
pub(crate) fn persist(state_dir: &Path, epoch: Epoch) -> Result<(), DpuError> {
    fs::create_dir_all(state_dir).map_err(io_at(state_dir))?;
    let path = state_dir.join(EPOCH_FILE);
    let next = epoch.0;
    let tmp = state_dir.join(format!("{EPOCH_FILE}.tmp"));
    fs::write(&tmp, format!("{MAGIC}\n{next}\n")).map_err(io_at(&tmp))?;
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_at(&tmp))?;
    fs::rename(&tmp, &path).map_err(io_at(&path))?;
    File::open(state_dir).and_then(|f| f.sync_all()).map_err(io_at(state_dir))?;
    Ok(())
}
