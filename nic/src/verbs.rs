//! A small, transport-neutral trait set shaped like RDMA verbs: register memory (a local and a
//! remote key), post one-sided READ and WRITE work requests against a remote region, and poll a
//! bounded completion queue.
//!
//! Two endpoints implement it: the simulated NIC ([`crate::sim`]) and the real verbs backend
//! (`crate::rdma`, sideway, behind the off-by-default `verbs` feature), so the transfer glue in
//! [`crate::transfer`] and its tests are the same for both.
//!
//! How this maps to verbs: [`NicEndpoint::register`] is `ibv_reg_mr` (the access flags are
//! `IBV_ACCESS_REMOTE_READ`/`WRITE`), [`NicEndpoint::post`] is `ibv_post_send` on a connected
//! RC queue pair with one scatter-gather entry, and [`NicEndpoint::poll`] is `ibv_poll_cq` with
//! `num_entries` capped at [`POLL_ENTRIES_MAX`]. The one difference is the local buffer: verbs
//! take a raw address and keep using it after the post returns; here the caller lends a slice
//! for the post and the registration contract (a slot stays lent until a completion retires it)
//! is what makes that later use safe for the real backend.

use std::fmt;

use crate::error::NicError;

/// The most completions one [`NicEndpoint::poll`] returns.
pub const POLL_ENTRIES_MAX: usize = 32;

/// What is behind an endpoint. A simulation always says it is one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Implementation {
    /// The in-process simulated NIC, replayable from its seed.
    Simulated { seed: u64 },
    /// A real RDMA device through libibverbs.
    Verbs { device: String },
}

impl Implementation {
    /// The transport name recorded in `MemoryKind::NicRegistered`.
    pub fn transport(&self) -> &'static str {
        match self {
            Self::Simulated { .. } => "sim",
            Self::Verbs { .. } => "verbs",
        }
    }
}

/// The key a local work request names its buffer with (verbs `lkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalKey(pub u32);

/// The key a peer names this region with in one-sided operations (verbs `rkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteKey(pub u32);

/// What a peer may do to a registered region. Local access is always granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    pub remote_read: bool,
    pub remote_write: bool,
}

impl Access {
    /// Only this endpoint's own work requests may use the region.
    pub const LOCAL: Self = Self { remote_read: false, remote_write: false };
    /// Peers may READ and WRITE the region.
    pub const REMOTE_READ_WRITE: Self = Self { remote_read: true, remote_write: true };
}

/// A registration: its keys and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    pub lkey: LocalKey,
    pub rkey: RemoteKey,
    pub len_bytes: u64,
}

/// A work request's id, chosen by the poster and echoed in its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkRequestId(pub u64);

impl fmt::Display for WorkRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "wr{}", self.0)
    }
}

/// A one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// Copy the remote bytes into the local buffer.
    Read,
    /// Copy the local buffer into the remote bytes.
    Write,
}

/// Where in the peer's memory a work request lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    pub rkey: RemoteKey,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// One posted operation. The local buffer's length must equal `remote.len_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    pub id: WorkRequestId,
    pub opcode: Opcode,
    pub lkey: LocalKey,
    pub remote: RemoteSlice,
}

/// How a work request ended, as its completion reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionStatus {
    Success,
    /// The local key or length did not match a registration (`IBV_WC_LOC_PROT_ERR`).
    LocalProtectionError,
    /// The peer refused the key, the bounds or the access (`IBV_WC_REM_ACCESS_ERR`).
    RemoteAccessError,
    /// The link stopped answering; the queue pair is now in error (`IBV_WC_RETRY_EXC_ERR`).
    RetryExceeded,
    /// Posted to a queue pair already in error; never executed (`IBV_WC_WR_FLUSH_ERR`).
    Flushed,
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    pub id: WorkRequestId,
    pub opcode: Opcode,
    pub status: CompletionStatus,
    /// Bytes moved; zero unless the status is `Success`.
    pub len_bytes: u64,
}

/// One connected endpoint (a queue pair with its completion queue and registrations).
///
/// A completion, whatever its status, is the device saying it has finished with the work
/// request's buffers. Only its absence leaves the outcome unknown.
pub trait NicEndpoint: fmt::Debug {
    fn implementation(&self) -> Implementation;

    /// Registers `len_bytes` of memory with `access` for peers.
    fn register(&mut self, len_bytes: u64, access: Access) -> Result<MemoryRegion, NicError>;

    /// Removes a registration; its keys are never handed out again.
    fn deregister(&mut self, lkey: LocalKey) -> Result<(), NicError>;

    /// Posts one work request whose local buffer is `local`. `Err` means nothing was posted
    /// and the buffer was not touched.
    fn post(&mut self, request: WorkRequest, local: &mut [u8]) -> Result<(), NicError>;

    /// Moves up to `entries_max` (at most [`POLL_ENTRIES_MAX`]) completions into `out`;
    /// returns how many. Each call is one poll.
    fn poll(&mut self, out: &mut Vec<WorkCompletion>, entries_max: usize) -> usize;

    /// Takes the queue pair through error and back to ready (verbs: modify the QP to ERR,
    /// drain, then RESET/INIT/RTR/RTS): nothing posted before the reset touches memory or
    /// completes after it. The NIC half of an epoch fence.
    fn reset(&mut self);
}

/// An endpoint that registers memory its caller owns, at the memory's real address (verbs:
/// `ibv_reg_mr` on the caller's pages), so the keys it returns cover exactly those bytes and a
/// post whose local buffer lies outside them completes with `LocalProtectionError`.
///
/// [`crate::slots::NicSlots`] registers pool slots through it. [`NicEndpoint::register`] stays
/// for memory the endpoint allocates itself.
pub trait RegisterHostMemory: NicEndpoint {
    /// Registers `len_bytes` at `addr` with `access` for peers.
    ///
    /// # Safety
    /// `addr..addr + len_bytes` must be valid for reads and writes, and must not be freed or
    /// moved, until this registration is deregistered (or, for an endpoint that owns its
    /// registrations, until the endpoint is dropped). No Rust reference to those bytes may be
    /// live while a work request or a peer's one-sided access uses them: the registration
    /// contract (a slot stays lent until a completion retires it) is what provides that.
    unsafe fn register_host(
        &mut self,
        addr: std::ptr::NonNull<u8>,
        len_bytes: usize,
        access: Access,
    ) -> Result<MemoryRegion, NicError>;
}
