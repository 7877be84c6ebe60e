//! Storage queues: each bound to one reactor at creation, with a bounded depth, a backend that
//! moves block bytes (io_uring files, a simulation, or a native backend that fails closed) and
//! a completion table its submitters wait on with deadlines.
//!
//! A submission owns one leased slab slot from submit until it settles. Settling happens in the
//! submitter's thread when it reaps a completion ([`crate::Agent::wait`]); a write's bytes are
//! published (made readable) only then, so a write whose completion nobody reaped (a crash, a
//! lost completion) never becomes visible.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Condvar, Mutex, MutexGuard};

use gpucache_dataplane::registry::{Epoch, SlotLease};

pub use crate::ids::QueueId;
use crate::ids::ReactorId;

/// Most submissions one queue may hold outstanding.
pub const QUEUE_DEPTH_MAX: usize = 4096;

/// A block's number within its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u64);

/// Why a read found nothing usable. Every miss leaves the caller's destination untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissCause {
    /// No block under this id.
    Absent,
    /// The stored bytes failed their header or checksum.
    Corrupt,
    /// The ticket is from an older agent epoch (before a restart) or an older slab epoch.
    Fenced,
}

/// What a reaped submission did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The block is stored and readable.
    Written,
    /// `len` verified bytes were copied to the front of the destination.
    Read {
        len: usize,
    },
    Miss(MissCause),
}

/// A handle to one submission. Reap it with [`crate::Agent::wait`].
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    pub queue: QueueId,
    pub seq: u64,
    /// The agent epoch it was submitted under.
    pub epoch: Epoch,
}

/// Counters of one queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub queue: Option<QueueId>,
    pub owner: Option<ReactorId>,
    pub backend: &'static str,
    pub depth_max: usize,
    /// Submissions outstanding now (queued, executing or completed but not reaped).
    pub outstanding: usize,
    pub submitted: u64,
    pub reaped: u64,
    pub queue_full: u64,
    pub affinity_violations: u64,
    pub lost: u64,
    pub late: u64,
    pub duplicated: u64,
    pub errors: u64,
    pub stalled_polls: u64,
    pub fenced: u64,
}

/// A write a backend made but has not made readable yet: published (or discarded) by the
/// submitter when it reaps the completion. Each backend stages writes in its own form and
/// refuses to publish another's.
#[derive(Debug)]
pub(crate) enum Staged {
    /// The simulation's block bytes, kept aside until published.
    Sim { block: BlockId, bytes: Vec<u8> },
    /// A host block file under its temporary name, renamed to `dst` when published.
    File { tmp: std::path::PathBuf, dst: std::path::PathBuf },
}

/// What the backend did.
pub(crate) enum Done {
    Staged(Staged),
    Read {
        len: usize,
    },
    Miss(MissCause),
    /// A store job's answer.
    Store(crate::job::Answer),
}

/// A fault the backend injects into one submission's completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// Executed, completion never posted.
    Lost,
    /// Executed, completion posted after `polls` more reactor polls.
    Late {
        polls: u32,
    },
    /// Executed, completion posted twice.
    Duplicated,
    /// Not executed; an error completion is posted.
    Error,
    /// The queue makes no progress for `polls` polls.
    Stall {
        polls: u32,
    },
}

/// Moves block bytes for one queue. Called on the owning reactor (execute) and in the
/// submitter's thread (publish, discard).
pub(crate) trait QueueBackend: Send + fmt::Debug {
    fn name(&self) -> &'static str;
    /// `Some(seed)` for a simulation.
    fn simulated(&self) -> Option<u64>;
    /// The fault for the next submission; real backends inject none.
    fn next_fault(&mut self) -> Fault;
    /// Writes `data` under `block` somewhere not yet readable.
    fn write(&mut self, block: BlockId, data: &[u8], tag: u64) -> Result<Staged, String>;
    /// Makes a staged write readable.
    fn publish(&mut self, staged: Staged) -> Result<(), String>;
    /// Drops a staged write nobody will publish.
    fn discard(&mut self, staged: Staged);
    /// Reads `block` into `dst`, verified.
    fn read(&mut self, block: BlockId, dst: &mut [u8]) -> Result<Done, String>;
}

/// What a submission asks its reactor to do with its slab slot. A store job travels by value
/// (it is most of a submission's size) so that submitting one allocates nothing; the queues
/// that hold submissions grow only as far as their bounded depth.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Op {
    /// Stage the first `len` bytes of the slot as `block`.
    Write { block: BlockId, len: usize },
    /// Read `block` into the slot.
    Read { block: BlockId },
    /// Run a store call against the slot.
    Store(crate::job::Job),
}

pub(crate) struct Submission {
    pub(crate) seq: u64,
    pub(crate) lease: SlotLease,
    pub(crate) op: Op,
}

pub(crate) type Posted = Result<Done, String>;

/// The mutable state of one queue.
pub(crate) struct QueueState {
    pub(crate) pending: VecDeque<Submission>,
    /// Completions waiting for their submitter.
    pub(crate) completed: BTreeMap<u64, Posted>,
    /// Outstanding seqs (submitted, not yet reaped or abandoned) and their leases.
    pub(crate) outstanding: BTreeMap<u64, SlotLease>,
    /// Completions held back by a `Late` fault: (polls left, seq, result).
    pub(crate) delayed: Vec<(u32, u64, Posted)>,
    /// The slab epoch of the submission the reactor is executing now.
    pub(crate) executing: Option<Epoch>,
    pub(crate) stall_polls_left: u32,
    pub(crate) next_seq: u64,
    pub(crate) stats: QueueStats,
}

/// One queue, shared by its reactor and its submitters.
pub(crate) struct Queue {
    pub(crate) id: QueueId,
    pub(crate) owner: ReactorId,
    pub(crate) depth_max: usize,
    pub(crate) state: Mutex<QueueState>,
    /// Signalled on every posted completion and when execution ends.
    pub(crate) changed: Condvar,
    pub(crate) backend: Mutex<Box<dyn QueueBackend>>,
}

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Queue({}, owner {}, depth_max {})", self.id, self.owner, self.depth_max)
    }
}

impl Queue {
    pub(crate) fn new(
        id: QueueId,
        owner: ReactorId,
        depth_max: usize,
        backend: Box<dyn QueueBackend>,
    ) -> Self {
        let stats = QueueStats {
            queue: Some(id),
            owner: Some(owner),
            backend: backend.name(),
            depth_max,
            ..QueueStats::default()
        };
        Self {
            id,
            owner,
            depth_max,
            state: Mutex::new(QueueState {
                // Grown on demand, never past `depth_max` entries (`submit` refuses beyond it):
                // a submission is a few hundred bytes, too many to reserve for every queue's
                // largest possible depth up front.
                pending: VecDeque::new(),
                completed: BTreeMap::new(),
                outstanding: BTreeMap::new(),
                delayed: Vec::new(),
                executing: None,
                stall_polls_left: 0,
                next_seq: 1,
                stats,
            }),
            changed: Condvar::new(),
            backend: Mutex::new(backend),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A panicking reactor leaves counters, never half-moved submissions: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn backend(&self) -> MutexGuard<'_, Box<dyn QueueBackend>> {
        self.backend.lock().unwrap_or_else(|p| p.into_inner())
    }
}
