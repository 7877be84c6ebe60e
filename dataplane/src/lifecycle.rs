//! The block lifecycle as a typed state machine.
//!
//! ```text
//! ABSENT -> RESERVED -> WRITING -> COMMITTED -> EVICTING -> ABSENT
//!              |  \         |  \                   |
//!              |   \-> ABSENT (retired abort)      |
//!              \-----------> QUARANTINED <---------/   (outcome unknown)
//!                                 |
//!                                 \-> ABSENT  only with a ReclaimProof
//! ```
//!
//! COMMITTED is the only readable state. QUARANTINED means some agent (NIC, GPU stream, DPU
//! queue, kernel, peer) may still touch the block's registered region; the only way out is a
//! [`ReclaimProof`], which only [`crate::registry`] can mint (a drained attestation or an epoch
//! fence). Owns no storage.

use std::fmt;

// The proof is defined beside the table that mints it; it is named here too, where the
// lifecycle demands it.
pub use crate::registry::ReclaimProof;
use crate::registry::RegionId;

/// Where a block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    Absent,
    Reserved,
    Writing,
    Committed,
    Evicting,
    Quarantined,
}

impl BlockState {
    /// Only a committed block may be read, and only while its checksum matches.
    pub fn is_readable(self) -> bool {
        self == Self::Committed
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Absent => "ABSENT",
            Self::Reserved => "RESERVED",
            Self::Writing => "WRITING",
            Self::Committed => "COMMITTED",
            Self::Evicting => "EVICTING",
            Self::Quarantined => "QUARANTINED",
        }
    }
}

impl fmt::Display for BlockState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An event that moves a block between states.
#[derive(Debug)]
pub enum Transition {
    /// Admission charged and a region was registered for the block.
    Reserve,
    /// The first payload bytes are being written.
    BeginWrite,
    /// Every byte is written and the checksum recorded.
    Commit,
    /// The write failed or was abandoned and every writer is known to have stopped.
    Abort,
    /// Some agent may still touch the region: the outcome of an operation is unknown.
    Quarantine,
    /// Eviction or invalidation started; the block stops being readable.
    Evict,
    /// Every reader of an evicting block has retired.
    Release,
    /// A quarantined region is proven idle.
    Reclaim(ReclaimProof),
}

impl Transition {
    fn name(&self) -> &'static str {
        match self {
            Self::Reserve => "reserve",
            Self::BeginWrite => "begin_write",
            Self::Commit => "commit",
            Self::Abort => "abort",
            Self::Quarantine => "quarantine",
            Self::Evict => "evict",
            Self::Release => "release",
            Self::Reclaim(_) => "reclaim",
        }
    }
}

/// A transition that the lifecycle does not allow from the current state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("block in region {region} cannot {transition} from {from}{detail}")]
pub struct IllegalTransition {
    pub region: RegionId,
    pub from: BlockState,
    pub transition: &'static str,
    pub detail: &'static str,
}

/// One block's state, bound to the region that holds its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lifecycle {
    region: RegionId,
    state: BlockState,
}

impl Lifecycle {
    /// A new block; it starts ABSENT and must be reserved before anything else.
    pub fn new(region: RegionId) -> Self {
        Self { region, state: BlockState::Absent }
    }

    pub fn region(&self) -> RegionId {
        self.region
    }
    pub fn state(&self) -> BlockState {
        self.state
    }

    /// Applies `t`, or leaves the state unchanged and says why it is illegal.
    pub fn apply(&mut self, t: Transition) -> Result<BlockState, IllegalTransition> {
        use BlockState::*;
        let next = match (&t, self.state) {
            (Transition::Reserve, Absent) => Reserved,
            (Transition::BeginWrite, Reserved) => Writing,
            (Transition::Commit, Writing) => Committed,
            (Transition::Abort, Reserved | Writing) => Absent,
            (Transition::Quarantine, Reserved | Writing | Evicting) => Quarantined,
            (Transition::Evict, Committed) => Evicting,
            (Transition::Release, Evicting) => Absent,
            (Transition::Reclaim(proof), Quarantined) => {
                if proof.region() != self.region {
                    return Err(self.illegal(&t, " (the proof names another region)"));
                }
                Absent
            }
            _ => return Err(self.illegal(&t, "")),
        };
        self.state = next;
        Ok(next)
    }

    fn illegal(&self, t: &Transition, detail: &'static str) -> IllegalTransition {
        IllegalTransition { region: self.region, from: self.state, transition: t.name(), detail }
    }
}
