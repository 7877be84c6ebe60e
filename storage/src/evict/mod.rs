//! Eviction policies: which committed block a full store gives up first.
//!
//! The block catalog owns every block and every rule about which ones may go (never a block
//! being read, never an open or quarantined one, never another tenant's block to make room under
//! a tenant's own quota). A policy only ranks the committed blocks the catalog tells it about:
//! it hears of each commit, each hit and each removal, and when the catalog needs room it names
//! the first block in its order that the catalog's `eligible` test accepts. A policy never sees
//! payloads, and a wrong guess costs a hit, never correctness.
//!
//! Every policy does O(1) or O(log n) work per event, and the history a policy keeps of blocks
//! that already left (the ghosts of ARC and S3-FIFO) is bounded by [`GHOST_ENTRIES_MAX`] and by
//! the capacity it was built for.

mod arc;
mod build;
mod fifo;
mod ghost;
mod lists;
mod lru;
mod order;
mod policy;
mod prefix;
mod s3fifo;

pub use arc::AdaptiveReplacement;
pub use fifo::Fifo;
pub use lru::Lru;
pub use policy::{
    BlockFacts, BlockId, EvictionPolicy, GHOST_ENTRIES_MAX, PolicyKind, Removal, UnknownPolicy,
};
pub use prefix::PrefixAware;
pub use s3fifo::{FREQ_MAX, S3Fifo};

#[cfg(test)]
mod tests;
