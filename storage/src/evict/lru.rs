//! Recency: the block committed or read longest ago leaves first.

use super::order::Order;
use super::policy::{BlockFacts, BlockId, EvictionPolicy, PolicyKind, Removal};

#[derive(Debug, Default)]
pub struct Lru {
    order: Order,
}

impl EvictionPolicy for Lru {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }

    fn insert(&mut self, block: &BlockFacts) {
        self.order.push_back(block.id);
    }

    fn hit(&mut self, id: BlockId) {
        if self.order.contains(id) {
            self.order.push_back(id);
        }
    }

    fn remove(&mut self, id: BlockId, _why: Removal) {
        self.order.remove(id);
    }

    fn victim(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        self.order.first(eligible)
    }

    fn resident(&self) -> usize {
        self.order.len()
    }

    fn ghosts(&self) -> usize {
        0
    }
}
