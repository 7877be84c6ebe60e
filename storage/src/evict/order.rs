//! A queue of block ids ordered by a stamp, with removal and re-stamping in O(log n): the list
//! most policies are made of.

use std::collections::{BTreeMap, HashMap};

use super::policy::BlockId;

#[derive(Debug)]
pub(super) struct Order {
    by_stamp: BTreeMap<u64, BlockId>,
    stamp_of: HashMap<BlockId, u64>,
    /// Stamps grow from the middle of the range towards the back and shrink from it towards
    /// the front; `next` is the next back stamp, `front_next` the next front one.
    next: u64,
    front_next: u64,
}

impl Default for Order {
    fn default() -> Self {
        Self {
            by_stamp: BTreeMap::new(),
            stamp_of: HashMap::new(),
            next: FIRST_BACK_STAMP,
            front_next: FIRST_BACK_STAMP - 1,
        }
    }
}

/// Half the stamp range lies on each side: 2^63 pushes either way never run out.
const FIRST_BACK_STAMP: u64 = 1 << 63;

impl Order {
    pub(super) fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub(super) fn contains(&self, id: BlockId) -> bool {
        self.stamp_of.contains_key(&id)
    }

    /// Puts `id` at the back (newest end), moving it there if it is already queued.
    pub(super) fn push_back(&mut self, id: BlockId) {
        self.remove(id);
        let stamp = self.next;
        self.next += 1;
        self.by_stamp.insert(stamp, id);
        self.stamp_of.insert(id, stamp);
    }

    /// Puts `id` at the front (the end that leaves first), moving it there if it is queued.
    pub(super) fn push_front(&mut self, id: BlockId) {
        self.remove(id);
        let stamp = self.front_next;
        self.front_next -= 1;
        self.by_stamp.insert(stamp, id);
        self.stamp_of.insert(id, stamp);
    }

    pub(super) fn remove(&mut self, id: BlockId) -> bool {
        match self.stamp_of.remove(&id) {
            Some(stamp) => {
                self.by_stamp.remove(&stamp);
                true
            }
            None => false,
        }
    }

    pub(super) fn pop_front(&mut self) -> Option<BlockId> {
        let (_, id) = self.by_stamp.pop_first()?;
        self.stamp_of.remove(&id);
        Some(id)
    }

    /// Ids from the front (oldest) to the back.
    pub(super) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.by_stamp.values().copied()
    }

    /// The first id whose stamp is `stamp` or later, with its stamp: a cursor for scans that
    /// move ids to the back while they walk.
    pub(super) fn at_or_after(&self, stamp: u64) -> Option<(u64, BlockId)> {
        self.by_stamp.range(stamp..).next().map(|(s, id)| (*s, *id))
    }

    /// The first id from the front that `eligible` accepts.
    pub(super) fn first(&self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        self.iter().find(|id| eligible(*id))
    }
}
