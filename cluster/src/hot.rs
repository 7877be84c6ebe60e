//! Which blocks a client reads often enough to keep an extra copy of.
//!
//! A block read more than [`ReplicaPolicy::reads`] times within [`ReplicaPolicy::window_ms`]
//! through one client gets a copy on its second rendezvous choice, made by that client from
//! the bytes it just read from the owner; from then on, under the same view, its reads
//! alternate between the two. A copy lives for one view (the node holding it drops it on the
//! next), is never needed for correctness, and a miss on it is asked of the owner.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpucache_dataplane::key::KeyDigest;

/// Blocks one client tracks the read rate of.
pub const HOT_KEYS_MAX: usize = 4_096;

/// When a block counts as hot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaPolicy {
    /// Reads within one window that make a block hot.
    pub reads: u32,
    pub window_ms: u64,
}

#[derive(Debug)]
struct Hot {
    window: Instant,
    reads: u32,
    /// The view epoch its copy was made under.
    copied: Option<u64>,
    /// Which of the two the next read goes to.
    to_copy: bool,
}

#[derive(Debug)]
pub(crate) struct HotKeys {
    policy: ReplicaPolicy,
    table: Mutex<HashMap<KeyDigest, Hot>>,
}

impl HotKeys {
    pub(crate) fn new(policy: ReplicaPolicy) -> Self {
        Self { policy, table: Mutex::new(HashMap::new()) }
    }

    fn window(&self) -> Duration {
        Duration::from_millis(self.policy.window_ms.max(1))
    }

    /// Counts a read of `key` served by its owner under `epoch`; true when the block just
    /// became hot and has no copy under this view yet (the caller makes one, then says
    /// [`copied`](Self::copied)).
    pub(crate) fn read(&self, key: KeyDigest, epoch: u64) -> bool {
        let now = Instant::now();
        let window = self.window();
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if !table.contains_key(&key) && table.len() >= HOT_KEYS_MAX {
            // Forget the blocks whose window ended without a copy under this view.
            table.retain(|_, h| now.duration_since(h.window) < window || h.copied == Some(epoch));
            if table.len() >= HOT_KEYS_MAX {
                return false;
            }
        }
        let hot =
            table.entry(key).or_insert(Hot { window: now, reads: 0, copied: None, to_copy: false });
        if now.duration_since(hot.window) >= window {
            hot.window = now;
            hot.reads = 0;
        }
        hot.reads = hot.reads.saturating_add(1);
        hot.reads >= self.policy.reads && hot.copied != Some(epoch)
    }

    /// A copy of `key` now stands on its second choice under `epoch`.
    pub(crate) fn copied(&self, key: KeyDigest, epoch: u64) {
        if let Some(h) = self.table.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&key) {
            h.copied = Some(epoch);
        }
    }

    /// Whether this read of `key` goes to its copy (every other read of a block copied under
    /// `epoch`).
    pub(crate) fn to_copy(&self, key: &KeyDigest, epoch: u64) -> bool {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        match table.get_mut(key) {
            Some(h) if h.copied == Some(epoch) => {
                h.to_copy = !h.to_copy;
                h.to_copy
            }
            _ => false,
        }
    }

    /// A copy turned out missing (dropped, evicted): make it again when the block is read.
    pub(crate) fn lost(&self, key: &KeyDigest) {
        if let Some(h) = self.table.lock().unwrap_or_else(|e| e.into_inner()).get_mut(key) {
            h.copied = None;
            h.reads = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_hot_after_its_reads_and_then_read_from_both() {
        let hot = HotKeys::new(ReplicaPolicy { reads: 3, window_ms: 60_000 });
        let k = KeyDigest([1; 32]);
        assert!(!hot.read(k, 5) && !hot.read(k, 5));
        assert!(hot.read(k, 5), "the third read makes it hot");
        assert!(!hot.to_copy(&k, 5), "no copy yet");
        hot.copied(k, 5);
        assert!(!hot.read(k, 5), "copied under this view");
        let turns: Vec<bool> = (0..4).map(|_| hot.to_copy(&k, 5)).collect();
        assert_eq!(turns, [true, false, true, false]);
        assert!(!hot.to_copy(&k, 6), "a copy is for its own view only");
        assert!(hot.read(k, 6), "hot again under the next view, with no copy there");
        hot.lost(&k);
        assert!(!hot.read(k, 6), "counting starts over once a copy is lost");
    }

    #[test]
    fn the_table_is_bounded() {
        let hot = HotKeys::new(ReplicaPolicy { reads: 1, window_ms: 60_000 });
        for i in 0..HOT_KEYS_MAX {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&(i as u64).to_le_bytes());
            assert!(hot.read(KeyDigest(d), 1));
        }
        assert!(!hot.read(KeyDigest([0xFF; 32]), 1), "no room, windows still open");
        assert_eq!(hot.table.lock().unwrap().len(), HOT_KEYS_MAX);
    }
}
