//! Our policy for KV blocks: adaptive replacement, told what a prefix cache knows.
//!
//! An engine reuses a block only through a prefix hit: it looks up a prompt's blocks in chain
//! order and stops at the first miss. Two kinds of block are therefore worth less than their
//! recency and frequency say, and this policy puts them at the end of their list that leaves
//! first:
//! - a **partial** block (fewer tokens than its capacity) ends a prompt; a longer prompt that
//!   shares it has a different, fuller block there, so only the very same prompt can hit it.
//!   In the conversation trace of docs/PERFORMANCE.md under 1 % of them were ever read again,
//!   against about a quarter of full blocks.
//! - an **orphan**, a block whose parent (the block one link shorter in its chain) has left or
//!   was never there, cannot be reached by a prefix walk until the parent comes back.
//!
//! Everything else is [`AdaptiveReplacement`]: its recency and frequency lists, its ghosts and
//! its adaptive split, so a workload with neither kind of block sees plain ARC. The extra
//! state is one entry per resident block (its name and parent) and one list of resident
//! children per parent name, so memory stays bounded by what the store holds; each event costs
//! O(log n) plus, on a removal, O(children of the block).

use std::collections::HashMap;

use super::arc::AdaptiveReplacement;
use super::policy::{BlockFacts, BlockId, EvictionPolicy, PolicyKind, Removal};

#[derive(Debug)]
pub struct PrefixAware {
    pub(super) arc: AdaptiveReplacement,
    /// Resident blocks: their name and their parent's name.
    resident: HashMap<BlockId, (u64, Option<u64>)>,
    /// Resident blocks by name, for a child to find its parent.
    by_name: HashMap<u64, BlockId>,
    /// Resident blocks by their parent's name.
    children: HashMap<u64, Vec<BlockId>>,
}

impl PrefixAware {
    /// A policy for a store that retains at most `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            arc: AdaptiveReplacement::new(capacity_bytes),
            resident: HashMap::new(),
            by_name: HashMap::new(),
            children: HashMap::new(),
        }
    }

    /// Forgets `id` in the chain maps, and puts its resident children first in line: without
    /// it they cannot be reached by a prefix walk.
    fn unlink(&mut self, id: BlockId) {
        let Some((name, parent)) = self.resident.remove(&id) else { return };
        if self.by_name.get(&name) == Some(&id) {
            self.by_name.remove(&name);
            for child in self.children.get(&name).into_iter().flatten() {
                self.arc.send_first(*child);
            }
        }
        if let Some(parent) = parent
            && let Some(siblings) = self.children.get_mut(&parent)
        {
            siblings.retain(|c| *c != id);
            if siblings.is_empty() {
                self.children.remove(&parent);
            }
        }
    }
}

impl EvictionPolicy for PrefixAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Prefix
    }

    fn insert(&mut self, block: &BlockFacts) {
        self.unlink(block.id);
        self.arc.insert(block);
        let orphan = block.parent.is_some_and(|p| !self.by_name.contains_key(&p));
        if block.partial || orphan {
            self.arc.send_first(block.id);
        }
        self.resident.insert(block.id, (block.name, block.parent));
        self.by_name.insert(block.name, block.id);
        if let Some(parent) = block.parent {
            self.children.entry(parent).or_default().push(block.id);
        }
    }

    fn hit(&mut self, id: BlockId) {
        self.arc.hit(id);
    }

    fn remove(&mut self, id: BlockId, why: Removal) {
        self.arc.remove(id, why);
        self.unlink(id);
    }

    fn victim(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId> {
        self.arc.victim(eligible)
    }

    fn resident(&self) -> usize {
        self.arc.resident()
    }

    fn ghosts(&self) -> usize {
        self.arc.ghosts()
    }
}
