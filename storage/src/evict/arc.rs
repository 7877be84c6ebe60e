//! Adaptive replacement (ARC), weighted by bytes.
//!
//! Resident blocks sit on T1 (committed, not read since) or T2 (read at least once, or
//! committed again soon after leaving). The names of evicted blocks stay for a while on B1 (they
//! left from T1) or B2 (from T2). A commit whose name is on B1 says T1 was too small, so the
//! target `p` for T1's bytes grows; one on B2 says T2 was too small, so `p` shrinks. When room
//! is needed, T1's oldest block goes while T1 holds more than `p` bytes, T2's otherwise.
//!
//! Where this differs from the published algorithm:
//! - Sizes are bytes, not entries: `p`, the list sizes and the ghost bound are byte counts, and
//!   a ghost hit moves `p` by the usual ratio times the block's length (at least 1).
//! - The catalog evicts before it commits, so the choice between T1 and T2 cannot see the
//!   incoming block: the published tie rule (take from T1 when it holds exactly `p` and the
//!   incoming name is on B2) is left out, and T1 gives up a block only when it holds more
//!   than `p` bytes.
//! - A ghost hit is noticed at commit, after the room was already made, so it moves `p` for
//!   the next eviction rather than this one.
//! - The catalog may refuse blocks (`eligible`): the preferred list's oldest eligible block
//!   goes, and the other list is tried when the preferred one has none.
//! - The ghosts together hold at most the store's capacity in bytes and [`GHOST_ENTRIES_MAX`]
//!   entries, trimmed from the oldest end of the list holding more bytes, instead of the
//!   published per-list entry bounds.
//! - A block that leaves for a reason other than eviction leaves no ghost.

use super::ghost::Ghosts;
use super::lists::{Resident, TwoQueues};
use super::policy::{BlockFacts, BlockId, EvictionPolicy, GHOST_ENTRIES_MAX, PolicyKind, Removal};

/// The T1 queue of [`TwoQueues`]; T2 is the other.
const T1: bool = false;
const T2: bool = true;

#[derive(Debug)]
pub struct AdaptiveReplacement {
    capacity: u64,
    /// [`GHOST_ENTRIES_MAX`]; tests lower it.
    pub(super) ghost_entries_max: usize,
    /// The bytes T1 should hold, `0..=capacity`.
    p: u64,
    /// T1 and T2.
    lists: TwoQueues<()>,
    b1: Ghosts,
    b2: Ghosts,
}

impl AdaptiveReplacement {
    /// A policy for a store that retains at most `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes,
            ghost_entries_max: GHOST_ENTRIES_MAX,
            p: 0,
            lists: TwoQueues::default(),
            b1: Ghosts::default(),
            b2: Ghosts::default(),
        }
    }

    /// Moves a resident block to the end of its list that leaves first.
    pub(super) fn send_first(&mut self, id: BlockId) {
        self.lists.send_first(id);
    }

    /// The current target for T1's bytes.
    pub fn target(&self) -> u64 {
        self.p
    }

    fn trim_ghosts(&mut self) {
        while self.b1.bytes() + self.b2.bytes() > self.capacity
            || self.b1.len() + self.b2.len() > self.ghost_entries_max
        {
            let from_b1 = (self.b1.bytes(), self.b1.len()) >= (self.b2.bytes(), self.b2.len());
            let dropped = if from_b1 { self.b1.drop_oldest() } else { self.b2.drop_oldest() };
            if !dropped {
                break;
            }
        }
    }
}

/// How far a ghost hit moves `p`: the other ghost list's bytes over the bytes of the list the
/// name was found on (at least 1), times the block's length (at least 1).
fn step(this: u64, other: u64, len: u64) -> u64 {
    let ratio = other.checked_div(this).unwrap_or(0).max(1);
    ratio.saturating_mul(len.max(1))
}

impl EvictionPolicy for AdaptiveReplacement {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn insert(&mut self, block: &BlockFacts) {
        self.lists.unlink(block.id);
        let again = if self.b1.contains(block.name) {
            let up = step(self.b1.bytes(), self.b2.bytes(), block.len);
            self.p = self.p.saturating_add(up).min(self.capacity);
            self.b1.take(block.name);
            true
        } else if self.b2.contains(block.name) {
            let down = step(self.b2.bytes(), self.b1.bytes(), block.len);
            self.p = self.p.saturating_sub(down);
            self.b2.take(block.name);
            true
        } else {
            false
        };
        self.lists.link(
            block.id,
            Resident { name: block.name, len: block.len, second: again, extra: () },
        );
    }

    fn hit(&mut self, id: BlockId) {
        self.lists.requeue(id, |r| Resident { second: T2, ..r });
    }

    fn remove(&mut self, id: BlockId, why: Removal) {
        let Some(r) = self.lists.unlink(id) else { return };
        if why == Removal::Evicted {
            self.b1.take(r.name);
            self.b2.take(r.name);
            if r.second == T2 {
                self.b2.push(r.name, r.len);
            } else {
                self.b1.push(r.name, r.len);
            }
            self.trim_ghosts();
        }
    }

    fn victim(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        let first = if self.lists.bytes(T1) > self.p { T1 } else { T2 };
        let lists = &self.lists;
        lists.queue(first).first(eligible).or_else(|| lists.queue(!first).first(eligible))
    }

    fn resident(&self) -> usize {
        self.lists.len()
    }

    fn ghosts(&self) -> usize {
        self.b1.len() + self.b2.len()
    }
}
