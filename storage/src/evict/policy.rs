//! The trait every eviction policy implements, what the catalog tells it, and the policies'
//! names.

use std::fmt;
use std::str::FromStr;

/// The catalog's name for a committed block: unique while the block is resident, never reused.
pub type BlockId = u64;

/// Most entries a policy keeps for blocks that have left, whatever its capacity.
pub const GHOST_ENTRIES_MAX: usize = 1 << 20;

/// What a policy may know of a block when it is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockFacts {
    pub id: BlockId,
    /// A fingerprint of the block's key that stays the same when the block is written again
    /// after it left: what ghost lists remember.
    pub name: u64,
    /// The fingerprint of the block one chain link shorter with the same shape, tenant and
    /// model: the block a prefix hit on this one needs first. `None` for the first block of a
    /// chain.
    pub parent: Option<u64>,
    /// How many chain links the block's key carries (1 for the first block of a prompt).
    pub depth: u32,
    /// The block holds fewer tokens than its capacity: the end of a prompt, which only the
    /// same prompt again can hit (a longer one has a different block there).
    pub partial: bool,
    /// A fingerprint of the owning tenant.
    pub tenant: u64,
    pub len: u64,
    /// Commit order (restored blocks keep theirs).
    pub seq: u64,
    /// The request that wrote the block, when the writer gave one.
    pub request: Option<u64>,
}

/// Why a block left the policy's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// The policy named it and the catalog took it to make room.
    Evicted,
    /// Its owner invalidated it.
    Invalidated,
    /// It was found damaged, reclaimed or otherwise removed by the store.
    Dropped,
}

/// An eviction order over the committed blocks of one store.
pub trait EvictionPolicy: Send + fmt::Debug {
    fn kind(&self) -> PolicyKind;
    /// A block was committed (or restored at open).
    fn insert(&mut self, block: &BlockFacts);
    /// A committed block was read.
    fn hit(&mut self, id: BlockId);
    /// A block left: after [`Self::victim`] named it, or for another reason.
    fn remove(&mut self, id: BlockId, why: Removal);
    /// The first block in eviction order that `eligible` accepts, or `None` when it accepts
    /// none. The block stays until [`Self::remove`] is called for it.
    fn victim(&mut self, eligible: &mut dyn FnMut(BlockId) -> bool) -> Option<BlockId>;
    /// Resident blocks the policy tracks.
    fn resident(&self) -> usize;
    /// Entries kept for blocks that have left.
    fn ghosts(&self) -> usize;
}

/// The policies a tier may be configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Commit order, oldest first: what the FileStore did before policies existed.
    Fifo,
    /// Least recently committed or read first.
    Lru,
    /// Adaptive replacement: recency and frequency lists whose split follows the names of
    /// recently evicted blocks ([`AdaptiveReplacement`](super::AdaptiveReplacement)).
    Arc,
    /// A small FIFO that filters one-time blocks ahead of a main FIFO, with a ghost FIFO of
    /// names ([`S3Fifo`](super::S3Fifo)).
    S3Fifo,
    /// Ours, for KV blocks: adaptive replacement that also ranks by what a prefix cache knows
    /// (partial blocks and blocks whose parent left go first; [`PrefixAware`](super::PrefixAware)).
    Prefix,
}

impl PolicyKind {
    pub const ALL: &'static [PolicyKind] = &[
        PolicyKind::Fifo,
        PolicyKind::Lru,
        PolicyKind::Arc,
        PolicyKind::S3Fifo,
        PolicyKind::Prefix,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Fifo => "fifo",
            Self::Lru => "lru",
            Self::Arc => "arc",
            Self::S3Fifo => "s3-fifo",
            Self::Prefix => "prefix",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not one of [`PolicyKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy {given:?} (known: {known})")]
pub struct UnknownPolicy {
    pub given: String,
    pub known: String,
}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.iter().copied().find(|k| k.name() == s).ok_or_else(|| UnknownPolicy {
            given: s.to_owned(),
            known: Self::ALL.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
        })
    }
}
