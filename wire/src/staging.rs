//! Block staging for one-sided transfers between GPUCache nodes (NIXL, ADR 0018).
//!
//! The server never initiates a transfer. It leases slots of memory it registered with a
//! transport, fills them (a GET) or waits for the client to fill them (a PUT), and hands the
//! client a descriptor; the client READs or WRITEs the slot itself and tells the server over the
//! GPCW connection when it is done. This module owns the contract between the server and the
//! memory: [`BlockStaging`]. It knows no transport: the NIXL implementation lives in
//! `gpucache-nic` (which depends on this crate, never the reverse) and `gpucache serve` wires it
//! in when its configuration asks for it.
//!
//! Slot rules every implementation keeps:
//! - A staged slot is lent under a lease of `stage_lease_ms`. Only RELEASE (or COMMIT_PUT) of
//!   the stage returns it. A lease that runs out quarantines the slot (the peer may still be
//!   transferring); so does a connection that closes with any stage open: the peer may still be
//!   writing a PUT stage, or reading a GET stage whose READ it gave up on (a client does not
//!   RELEASE a stage its READ of may still be running), and a freed slot would be refilled with
//!   another block under that READ.
//! - A quarantined slot comes back only through [`BlockStaging::fence`] (BUMP_EPOCH followed by
//!   RECLAIM_FENCED): the epoch advances, every peer's metadata is dropped, and every slot lent
//!   before the new epoch is reclaimed.
//! - Stages are bounded per connection and overall ([`StagingLimits`]).

use std::fmt;

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{Put, StoreError};

use crate::WireError;

/// Default [`StagingLimits::per_connection_max`].
pub const STAGED_PER_CONNECTION_MAX_DEFAULT: usize = 64;
/// Default [`StagingLimits::staged_max`].
pub const STAGED_MAX_DEFAULT: usize = 1024;
/// Default [`StagingLimits::stage_lease_ms`].
pub const STAGE_LEASE_MS_DEFAULT: u64 = 30_000;
/// Longest agent metadata NIXL_ATTACH carries either way.
pub const AGENT_METADATA_BYTES_MAX: usize = 256 << 10;
/// Longest encoded block descriptor a stage answer carries.
pub const DESCRIPTOR_BYTES_MAX: usize = 1024;

/// How many stages may be open, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingLimits {
    /// Open stages of one connection.
    pub per_connection_max: usize,
    /// Open stages of the whole server (also bounded by the slots of the pool).
    pub staged_max: usize,
    /// A stage's lease: past it the slot is quarantined.
    pub stage_lease_ms: u64,
}

impl Default for StagingLimits {
    fn default() -> Self {
        Self {
            per_connection_max: STAGED_PER_CONNECTION_MAX_DEFAULT,
            staged_max: STAGED_MAX_DEFAULT,
            stage_lease_ms: STAGE_LEASE_MS_DEFAULT,
        }
    }
}

/// Names one open stage; unique for the life of a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StageId(pub u64);

impl fmt::Display for StageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stage#{}", self.0)
    }
}

/// Who opened a stage: the connection (for the per-connection limit and the cleanup at close)
/// and its tenant (only that tenant may commit or release it, from any of its connections).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageOwner {
    pub connection: u64,
    pub tenant: TenantId,
}

/// What a PUT stage will store when it is committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutIntent {
    pub key: PhysicalKey,
    pub len: u64,
    /// The client's checksum of the bytes it writes; COMMIT_PUT checks the slot against it.
    pub checksum: Checksum,
    pub request: Option<RequestId>,
}

/// A leased slot described for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedSlot {
    pub stage: StageId,
    /// The transport's encoding of the slot's first `len` bytes (for NIXL a `RemoteBlock`).
    pub descriptor: Vec<u8>,
    /// The lease, from the server's clock's now.
    pub lease_ms: u64,
}

/// The answer to one STAGE_GET key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StagedGet {
    /// The block's bytes sit in the slot; the client reads `len` bytes and checks `checksum`.
    Staged {
        slot: StagedSlot,
        len: u64,
        checksum: Checksum,
    },
    Miss(gpucache_dataplane::store::MissReason),
}

/// What staging has done, for STAGE_STATS, tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Stages opened (GET and PUT).
    pub staged: u64,
    /// PUT stages stored through the store.
    pub committed: u64,
    /// Stages returned by RELEASE or a refused commit.
    pub released: u64,
    /// Slots quarantined (lease expiry, a stage open at close).
    pub quarantined: u64,
    /// Slots returned by fences.
    pub fenced: u64,
    /// Stages open now.
    pub open: u64,
    /// Slots free now.
    pub free_slots: u64,
    /// Slots quarantined now.
    pub quarantined_slots: u64,
    /// Peers whose metadata is loaded now.
    pub peers: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
}

/// Why a staging request was refused, as it crosses the wire inside
/// [`WireError::Staging`]. Every refusal leaves nothing staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StagingFailure {
    /// The server has no block staging (not configured, or not built with it).
    NotEnabled,
    /// A per-connection or server-wide stage limit, or the pool's free slots.
    OverBudget,
    /// No open stage of the caller's tenant has that id (never made, settled, or fenced).
    UnknownStage,
    /// The slot's bytes do not hash to the checksum the client announced.
    ChecksumMismatch,
    /// A block or length that does not fit a slot.
    TooLarge,
    /// The peer's metadata was refused.
    Peer,
    /// The staging memory failed (a slot no longer usable, a transport call refused).
    Memory,
    /// The connection attached before a fence re-registered the staging memory: its metadata
    /// and descriptors are stale. Attach again, then retry.
    Reattach,
}

impl StagingFailure {
    /// Every reason, in code order.
    pub const ALL: [Self; 8] = [
        Self::NotEnabled,
        Self::OverBudget,
        Self::UnknownStage,
        Self::ChecksumMismatch,
        Self::TooLarge,
        Self::Peer,
        Self::Memory,
        Self::Reattach,
    ];

    pub fn code(self) -> u8 {
        match self {
            Self::NotEnabled => 0,
            Self::OverBudget => 1,
            Self::UnknownStage => 2,
            Self::ChecksumMismatch => 3,
            Self::TooLarge => 4,
            Self::Peer => 5,
            Self::Memory => 6,
            Self::Reattach => 7,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == code)
    }
}

impl fmt::Display for StagingFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotEnabled => "block staging is not enabled on this server",
            Self::OverBudget => "the stage limits are reached",
            Self::UnknownStage => "no such open stage",
            Self::ChecksumMismatch => "the staged bytes do not match their checksum",
            Self::TooLarge => "the block does not fit a staging slot",
            Self::Peer => "the peer's metadata was refused",
            Self::Memory => "the staging memory failed",
            Self::Reattach => "the staging memory was re-registered since this peer attached",
        })
    }
}

/// A staging refusal, with its numbers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StagingError {
    #[error("block staging is not enabled: {reason}")]
    NotEnabled { reason: String },
    #[error("{scope} holds {open} open stages, {asked} more refused (limit {max})")]
    OverBudget { scope: &'static str, open: usize, asked: usize, max: usize },
    #[error("{stage} is not an open stage of this tenant")]
    UnknownStage { stage: StageId },
    #[error("{stage}: the slot hashes to {computed:016x}, the client announced {announced:016x}")]
    ChecksumMismatch { stage: StageId, announced: u64, computed: u64 },
    #[error("a block of {len_bytes} bytes does not fit a {slot_bytes}-byte staging slot")]
    TooLarge { len_bytes: u64, slot_bytes: u64 },
    #[error("peer metadata refused: {detail}")]
    Peer { detail: String },
    #[error("staging memory: {detail}")]
    Memory { detail: String },
    #[error(
        "this connection attached to registration {attached}; a fence re-registered the staging \
         memory (now {current}): attach again"
    )]
    Reattach { attached: u64, current: u64 },
}

impl StagingError {
    pub fn failure(&self) -> StagingFailure {
        match self {
            Self::NotEnabled { .. } => StagingFailure::NotEnabled,
            Self::OverBudget { .. } => StagingFailure::OverBudget,
            Self::UnknownStage { .. } => StagingFailure::UnknownStage,
            Self::ChecksumMismatch { .. } => StagingFailure::ChecksumMismatch,
            Self::TooLarge { .. } => StagingFailure::TooLarge,
            Self::Peer { .. } => StagingFailure::Peer,
            Self::Memory { .. } => StagingFailure::Memory,
            Self::Reattach { .. } => StagingFailure::Reattach,
        }
    }
}

impl From<StagingError> for WireError {
    fn from(e: StagingError) -> Self {
        WireError::Staging { reason: e.failure(), detail: e.to_string() }
    }
}

/// A stage op as the client sees it fail: the store's error (transport failures included), or
/// the server's typed staging refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StageCallError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("staging refused: {reason}: {detail}")]
    Refused { reason: StagingFailure, detail: String },
}

impl StageCallError {
    /// The typed refusal, when it is one.
    pub fn refusal(&self) -> Option<StagingFailure> {
        match self {
            Self::Refused { reason, .. } => Some(*reason),
            Self::Store(_) => None,
        }
    }
}

/// What the server does with a GET stage's slot: fill it from the store (`get_into` as the
/// caller) and say what landed.
pub type FillSlot<'a> =
    dyn FnMut(&mut [u8]) -> Result<gpucache_dataplane::store::Get, StoreError> + 'a;
/// What the server does with a committed PUT stage's bytes: store them (`put` as the caller).
pub type StoreSlot<'a> = dyn FnMut(&PutIntent, &[u8]) -> Result<Put, StoreError> + 'a;

/// Registered memory the server stages blocks in. Shared by every connection thread.
pub trait BlockStaging: Send + Sync + fmt::Debug {
    /// Loads a peer agent's metadata for `owner`'s connection; answers this side's. The
    /// connection's stage ops are refused with [`StagingError::Reattach`] once a fence has
    /// re-registered the memory since, until it attaches again.
    fn attach(&self, owner: &StageOwner, peer_metadata: &[u8]) -> Result<Vec<u8>, StagingError>;

    /// Bytes per slot: the largest block that can be staged.
    fn slot_bytes(&self) -> u64;

    /// Leases one slot per fill, all or nothing (the limits are checked for the whole batch
    /// first), runs each fill on its slot, and answers per fill: a staged slot on a hit, the
    /// miss or the store's error otherwise (their slots are returned at once).
    fn stage_get(
        &self,
        owner: &StageOwner,
        now_ms: u64,
        fills: &mut [&mut FillSlot<'_>],
    ) -> Result<Vec<Result<StagedGet, StoreError>>, StagingError>;

    /// Leases one empty slot for `intent` (whose length must fit a slot).
    fn reserve_put(
        &self,
        owner: &StageOwner,
        now_ms: u64,
        intent: PutIntent,
    ) -> Result<StagedSlot, StagingError>;

    /// Checks the stage's bytes against its intent's checksum, stores them with `store`, and
    /// returns the slot (whether the checksum matched or the store took them or not).
    fn commit_put(
        &self,
        owner: &StageOwner,
        stage: StageId,
        store: &mut StoreSlot<'_>,
    ) -> Result<Result<Put, StoreError>, StagingError>;

    /// Returns stages the client is done with; answers per stage whether it was open (a
    /// quarantined slot stays quarantined).
    fn release(&self, owner: &StageOwner, stages: &[StageId]) -> Vec<bool>;

    /// The connection closed: its open stages are quarantined (the peer may still be moving
    /// their bytes).
    fn connection_closed(&self, connection: u64);

    /// Quarantines the slots whose lease ran out by `now_ms`; answers how many.
    fn expire(&self, now_ms: u64) -> usize;

    /// The fence: drops every peer's metadata, advances the staging epoch, reclaims every slot
    /// lent before it (open stages included: they end) and registers the memory anew, so
    /// attached peers must attach again. Answers how many slots came back.
    fn fence(&self) -> Result<usize, StagingError>;

    fn stats(&self) -> StagingStats;

    /// Whether the staging memory is registered with the transport now (a fence whose
    /// re-registration failed leaves it unregistered, and every stage op is refused).
    fn registered(&self) -> bool;
}
