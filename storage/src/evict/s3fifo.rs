//! S3-FIFO, weighted by bytes: a small FIFO that filters out blocks read only once, a main
//! FIFO for the rest, and a ghost FIFO of names that lets a block evicted too early from the
//! small queue come back straight into the main one.
//!
//! Every resident block counts its reads since it was queued, up to [`FREQ_MAX`]. When room is
//! needed and the small queue holds at least a tenth of the capacity (or the main queue has
//! nothing the catalog may take), the small queue is walked from its head: a block read while
//! there moves to the main queue's tail with its count cleared, and the first unread one is the
//! victim. Otherwise the main queue is walked from its head: a read block gives up one count
//! and goes back to the tail, and the first block with no count left is the victim.
//!
//! Where this differs from the published algorithm:
//! - Sizes are bytes: the small queue's tenth and the ghost bound are byte counts.
//! - The catalog evicts before it commits and removes the victim itself, so promotion happens
//!   during the walk for a victim rather than when a queue overflows on insert, and the victim
//!   stays queued until [`EvictionPolicy::remove`] is called for it.
//! - One read in the small queue is enough to be promoted.
//! - Blocks the catalog refuses (`eligible`) are passed over untouched: their counts and places
//!   stay as they are. When the small queue has nothing eligible the main queue is walked, and
//!   the other way round.
//! - The ghost queue holds at most [`GHOST_ENTRIES_MAX`] names and as many bytes as the main
//!   queue is meant to hold (the capacity less the small queue's tenth), oldest dropped first.
//! - A block that leaves for a reason other than eviction leaves no ghost, and a block evicted
//!   from the main queue leaves none either.
//!
//! Each walk is bounded: the small queue's is one pass, and in the main queue's every block is
//! passed at most `FREQ_MAX + 1` times (once per count it gives up, once more to be taken or
//! skipped), so a walk visits at most four times the blocks the queue held. Each move a walk
//! makes undoes an earlier insert or read (a promotion, a count given up), so apart from the
//! blocks the catalog refuses, a walk's length is paid for by earlier events: O(log n) per
//! event, amortized.

use super::ghost::Ghosts;
use super::lists::{Resident, TwoQueues};
use super::policy::{BlockFacts, BlockId, EvictionPolicy, GHOST_ENTRIES_MAX, PolicyKind, Removal};

/// The most reads a resident block counts.
pub const FREQ_MAX: u8 = 3;

/// The small queue of [`TwoQueues`]; the main queue is the other.
const SMALL: bool = false;
const MAIN: bool = true;

#[derive(Debug)]
pub struct S3Fifo {
    capacity: u64,
    /// [`GHOST_ENTRIES_MAX`]; tests lower it.
    pub(super) ghost_entries_max: usize,
    /// The small and the main queue; each block counts its reads (`0..=FREQ_MAX`).
    queues: TwoQueues<u8>,
    ghosts: Ghosts,
}

impl S3Fifo {
    /// A policy for a store that retains at most `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes,
            ghost_entries_max: GHOST_ENTRIES_MAX,
            queues: TwoQueues::default(),
            ghosts: Ghosts::default(),
        }
    }

    /// The bytes the small queue is meant to hold: a tenth of the capacity.
    pub fn small_target(&self) -> u64 {
        self.capacity / 10
    }

    /// The most bytes the ghost queue remembers: what the main queue is meant to hold.
    pub fn ghost_bytes_max(&self) -> u64 {
        self.capacity - self.small_target()
    }

    /// One pass over the small queue: read blocks move to the main queue, the first unread
    /// eligible one is the victim.
    fn walk_small(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        let mut cursor = 0;
        while let Some((stamp, id)) = self.queues.queue(SMALL).at_or_after(cursor) {
            cursor = stamp + 1;
            if !eligible(id) {
                continue;
            }
            if self.queues.get(id)?.extra == 0 {
                return Some(id);
            }
            self.queues.requeue(id, |r| Resident { extra: 0, second: MAIN, ..r });
        }
        None
    }

    /// The main queue from its head, read blocks giving up one count and going to the tail.
    fn walk_main(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        let visits_max = (usize::from(FREQ_MAX) + 1) * self.queues.queue(MAIN).len();
        let mut cursor = 0;
        for _ in 0..visits_max {
            let (stamp, id) = self.queues.queue(MAIN).at_or_after(cursor)?;
            cursor = stamp + 1;
            if !eligible(id) {
                continue;
            }
            if self.queues.get(id)?.extra == 0 {
                return Some(id);
            }
            self.queues.requeue(id, |r| Resident { extra: r.extra - 1, ..r });
        }
        None
    }

    fn trim_ghosts(&mut self) {
        while self.ghosts.bytes() > self.ghost_bytes_max()
            || self.ghosts.len() > self.ghost_entries_max
        {
            if !self.ghosts.drop_oldest() {
                break;
            }
        }
    }
}

impl EvictionPolicy for S3Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::S3Fifo
    }

    fn insert(&mut self, block: &BlockFacts) {
        self.queues.unlink(block.id);
        let main = self.ghosts.take(block.name);
        self.queues
            .link(block.id, Resident { name: block.name, len: block.len, second: main, extra: 0 });
    }

    fn hit(&mut self, id: BlockId) {
        self.queues.update(id, |freq| *freq = (*freq + 1).min(FREQ_MAX));
    }

    fn remove(&mut self, id: BlockId, why: Removal) {
        let Some(r) = self.queues.unlink(id) else { return };
        if why == Removal::Evicted && r.second == SMALL {
            self.ghosts.push(r.name, r.len);
            self.trim_ghosts();
        }
    }

    fn victim(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        let small_first = self.queues.bytes(SMALL) >= self.small_target()
            || self.queues.queue(MAIN).first(eligible).is_none();
        if small_first {
            self.walk_small(eligible).or_else(|| self.walk_main(eligible))
        } else {
            self.walk_main(eligible).or_else(|| self.walk_small(eligible))
        }
    }

    fn resident(&self) -> usize {
        self.queues.len()
    }

    fn ghosts(&self) -> usize {
        self.ghosts.len()
    }
}
