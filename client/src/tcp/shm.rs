//! The bookkeeping of the same-host path: where an item's bytes sit in the segment shared with
//! the server, and the counts of what the path did.

use std::sync::atomic::{AtomicU64, Ordering};

use gpucache_dataplane::store::{Retirement, StoreError};
use gpucache_storage::host::segment::{SharedArena, SharedBuf};

/// What the same-host path did, for operators and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedStats {
    /// Items served straight from or into a caller's shared buffer.
    pub direct_items: u64,
    /// Items that went through a bounce buffer of the segment.
    pub bounced_items: u64,
    /// Batches sent as ordinary frames because the segment had no room for a bounce buffer.
    pub framed_batches: u64,
    /// Segment bytes withheld for good after failed requests.
    pub quarantined_bytes: u64,
    /// Segment bytes free now.
    pub free_bytes: u64,
}

#[derive(Debug, Default)]
pub(super) struct SharedCounters {
    pub(super) direct_items: AtomicU64,
    pub(super) bounced_items: AtomicU64,
    pub(super) framed_batches: AtomicU64,
}

impl SharedCounters {
    pub(super) fn count(&self, places: &[Place]) {
        let direct = places.iter().filter(|p| matches!(p, Place::Caller(_))).count() as u64;
        self.direct_items.fetch_add(direct, Ordering::Relaxed);
        self.bounced_items.fetch_add(places.len() as u64 - direct, Ordering::Relaxed);
    }
}

/// Where one item's bytes sit in the shared segment.
pub(super) enum Place {
    /// The caller's own buffer, a [`SharedBuf`], at this offset.
    Caller(u64),
    /// A bounce buffer taken for a buffer outside the segment.
    Bounce(SharedBuf),
}

impl Place {
    pub(super) fn of(arena: &SharedArena, bytes: &[u8]) -> Option<Self> {
        match arena.segment().offset_of(bytes) {
            Some(offset) => Some(Self::Caller(offset)),
            None => arena.alloc(bytes.len()).map(Self::Bounce),
        }
    }

    pub(super) fn offset(&self) -> u64 {
        match self {
            Self::Caller(offset) => *offset,
            Self::Bounce(b) => b.offset(),
        }
    }

    pub(super) fn quarantine(self) {
        if let Self::Bounce(b) = self {
            b.quarantine();
        }
    }
}

/// The same failure, without the promise that the caller's buffers are no longer touched.
pub(super) fn unknown_retirement(e: StoreError) -> StoreError {
    match e {
        StoreError::Backend { operation, detail, .. } => {
            StoreError::Backend { operation, detail, retirement: Retirement::Unknown }
        }
        StoreError::Io { operation, kind, detail, .. } => {
            StoreError::Io { operation, kind, detail, retirement: Retirement::Unknown }
        }
        other => other,
    }
}
