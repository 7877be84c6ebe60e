//! Commit order: the block committed first leaves first, whatever is read.

use std::collections::{BTreeMap, HashMap};

use super::policy::{BlockFacts, BlockId, EvictionPolicy, PolicyKind, Removal};

/// Oldest commit first. Blocks restored at open keep their commit sequence, so the order
/// survives a restart.
#[derive(Debug, Default)]
pub struct Fifo {
    by_seq: BTreeMap<u64, BlockId>,
    seq_of: HashMap<BlockId, u64>,
}

impl EvictionPolicy for Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Fifo
    }

    fn insert(&mut self, block: &BlockFacts) {
        if let Some(old) = self.seq_of.insert(block.id, block.seq) {
            self.by_seq.remove(&old);
        }
        self.by_seq.insert(block.seq, block.id);
    }

    fn hit(&mut self, _id: BlockId) {}

    fn remove(&mut self, id: BlockId, _why: Removal) {
        if let Some(seq) = self.seq_of.remove(&id) {
            self.by_seq.remove(&seq);
        }
    }

    fn victim(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        self.by_seq.values().copied().find(|id| eligible(*id))
    }

    fn resident(&self) -> usize {
        self.seq_of.len()
    }

    fn ghosts(&self) -> usize {
        0
    }
}
