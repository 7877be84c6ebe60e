//! The values that cross the executor's boundary: what a submission may be refused for, what a
//! finished operation reports, the pressure observation, and the counters.
//!
//! A result states facts only: which keys succeeded, which objects are confirmed missing or
//! invalid, and whether the operation has retired (stopped touching its Host ranges). It never
//! decides publication or negative-cache policy; the owner does.

use std::fmt;

use super::agreement::{CompletionRecord, OperationId, OperationKind, Pressure};
use super::health::Rejected;
use super::host::{HostRange, RangeError};
use gpucache_dataplane::store::{MissReason, StoreError};

/// Why a submission was refused. Nothing was queued and no id was spent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitRefusal {
    #[error("the {kind} queue holds {queued} jobs, its depth is {depth}")]
    QueueFull { kind: OperationKind, queued: usize, depth: usize },
    #[error("{outstanding} operations are outstanding, operations_outstanding_max is {max}")]
    OutstandingFull { outstanding: usize, max: usize },
    #[error(transparent)]
    Unhealthy(#[from] Rejected),
    #[error("{operation} left an unretired result: the executor takes no more work until restart")]
    Quarantined { operation: OperationId },
    #[error("the executor is closed")]
    Closed,
    #[error("a job needs at least one key")]
    NoKeys,
    #[error("a job of {keys} keys exceeds keys_per_job_max {max}")]
    TooManyKeys { keys: usize, max: usize },
    #[error("key {index} has an unusable Host range: {error}")]
    BadRange { index: usize, error: RangeError },
}

/// What [`cancel`](super::Executor::cancel) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelOutcome {
    /// The job was still queued: it is inert, and its cancelled result is already waiting to be
    /// polled.
    Cancelled,
    /// A worker is running the job. It keeps its own lifetime; its result still comes, marked
    /// detached, and carries the retirement fact its Host references wait for.
    Detached,
    /// The job had already finished (its result is waiting or was polled), or the id was never
    /// issued.
    NotOutstanding,
}

/// How an operation ended as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Ending {
    /// A worker ran it against the store.
    Ran,
    /// Cancelled while queued; the store never saw it.
    Cancelled,
    /// Dropped from the queue without reaching the store: the health monitor recorded an
    /// outage after it was admitted, or the executor was quarantined.
    Rejected,
    /// Dropped from the queue by `close()`.
    Shutdown,
}

/// The answer for one key of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyResult {
    /// QUERY: the exact key is committed, `len` bytes.
    Found { len: u64 },
    /// GET: exactly the range's byte count was read and verified.
    Read { bytes: u64 },
    /// PUT: this call committed a new object.
    Written { bytes: u64 },
    /// PUT: the create-only object already existed; idempotent success, no new write.
    AlreadyStored,
    /// A confirmed object fact (GET only): the object is absent, exists only in another
    /// physical form, or was invalid and dropped.
    ObjectFailed(MissReason),
    /// Failed without object evidence.
    Failed(KeyFailure),
}

impl KeyResult {
    /// Whether the key succeeded (found, read at full length, or stored).
    pub fn is_success(&self) -> bool {
        matches!(
            self,
            Self::Found { .. } | Self::Read { .. } | Self::Written { .. } | Self::AlreadyStored
        )
    }

    /// Whether the key carries a confirmed object failure.
    pub fn is_object_failure(&self) -> bool {
        matches!(self, Self::ObjectFailed(_))
    }
}

/// A failure that says nothing about the stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFailure {
    /// QUERY found nothing usable under the exact key (miss or only a prefix).
    NotFound,
    /// The block exists but cannot be read now (being written or evicted).
    NotReadable,
    /// GET read fewer bytes than the range: a retired failure.
    ShortRead { expected: u64, got: u64 },
    /// GET reported more bytes than the range holds: a malformed result.
    Malformed { expected: u64, reported: u64 },
    /// PUT found another writer holding the key.
    Busy,
    /// PUT was refused by the store's admission (space, quotas) before any transfer.
    Refused,
    /// The store call failed.
    Store(StoreError),
    /// The key was never sent to the store (cancelled, rejected, shut down, or an earlier batch
    /// call of the job failed the backend).
    NotAttempted,
}

/// Everything the executor reports about one finished operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationResult {
    pub operation: OperationId,
    pub kind: OperationKind,
    pub ending: Ending,
    /// One answer per key, in submission order.
    pub keys: Vec<KeyResult>,
    /// The operation has stopped touching its Host ranges. When false, every one of its ranges
    /// is quarantined for the life of the process.
    pub retired: bool,
    /// The owner cancelled the job while it was running.
    pub detached: bool,
}

impl OperationResult {
    /// This owner's completion record for owner agreement.
    pub fn record(&self) -> CompletionRecord {
        CompletionRecord {
            operation: self.operation,
            kind: self.kind,
            key_ok: self.keys.iter().map(KeyResult::is_success).collect(),
            object_failed: self.keys.iter().map(KeyResult::is_object_failure).collect(),
            retired: self.retired,
        }
    }
}

/// Queued jobs of one kind and their payload bytes (always zero for QUERY).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct QueueLoad {
    pub jobs: u64,
    pub payload_bytes: u64,
}

/// The pressure observation returned with every poll, taken under the same lock as the results.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PressureSnapshot {
    pub query: QueueLoad,
    pub get: QueueLoad,
    pub put: QueueLoad,
    /// Jobs a worker is running, detached ones included.
    pub running_jobs: u64,
    /// Finished results not yet polled (after this poll: zero).
    pub undelivered_results: u64,
    /// Age of the oldest queued or running job, zero when there is none.
    pub oldest_job_age_ms: u64,
}

impl PressureSnapshot {
    /// The three observations the owner report carries.
    pub fn observation(&self) -> Pressure {
        Pressure {
            queued_jobs: self.query.jobs + self.get.jobs + self.put.jobs,
            queued_payload_bytes: self.get.payload_bytes + self.put.payload_bytes,
            oldest_job_age_ms: self.oldest_job_age_ms,
        }
    }
}

/// What one poll returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Poll {
    pub results: Vec<OperationResult>,
    pub pressure: PressureSnapshot,
}

/// Cumulative counts since start. PUT successes are split into new writes and create-only
/// duplicates, because a successful PUT does not prove a new object was written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ExecutorCounters {
    /// Store calls made: batch calls, each carrying up to `batch_keys_max` keys of one job (one
    /// call for most jobs).
    pub backend_calls: u64,
    pub query_keys_found: u64,
    pub get_keys_read: u64,
    pub get_bytes_read: u64,
    pub put_new_writes: u64,
    pub put_new_bytes: u64,
    pub put_already_stored: u64,
    /// Operations that ended unretired.
    pub unretired_operations: u64,
    pub query: KindCounters,
    pub get: KindCounters,
    pub put: KindCounters,
}

impl ExecutorCounters {
    /// The totals of one kind of job.
    pub fn of(&self, kind: OperationKind) -> &KindCounters {
        match kind {
            OperationKind::Query => &self.query,
            OperationKind::Get => &self.get,
            OperationKind::Put => &self.put,
        }
    }

    pub(crate) fn of_mut(&mut self, kind: OperationKind) -> &mut KindCounters {
        match kind {
            OperationKind::Query => &mut self.query,
            OperationKind::Get => &mut self.get,
            OperationKind::Put => &mut self.put,
        }
    }
}

/// Cumulative totals of the jobs of one kind that a worker ran: how many, their payload bytes,
/// and the milliseconds (on the executor's clock) they spent queued and in store calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct KindCounters {
    pub completed_jobs: u64,
    pub completed_payload_bytes: u64,
    pub queued_ms: u64,
    pub backend_ms: u64,
}

/// The ranges an unretired operation leaves quarantined for the life of the process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedOperation {
    pub operation: OperationId,
    pub kind: OperationKind,
    pub ranges: Vec<HostRange>,
}

/// What `close()` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReport {
    /// Workers that exited before the deadline and were joined.
    pub workers_joined: usize,
    /// Workers still inside a store call at the deadline; left running, never joined.
    pub workers_stuck: usize,
    /// Results nobody polled, including the queued jobs `close()` dropped.
    pub results: Vec<OperationResult>,
    /// Operations whose Host ranges stay quarantined.
    pub quarantined: Vec<QuarantinedOperation>,
    /// Native retirement is unknown somewhere: the store and the Host allocation are kept for
    /// the process, and reclaiming them safely needs a process restart.
    pub restart_required: bool,
}

impl fmt::Display for CloseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} workers joined, {} stuck, {} quarantined operations",
            self.workers_joined,
            self.workers_stuck,
            self.quarantined.len()
        )?;
        if self.restart_required {
            f.write_str("; native retirement unknown: restart the process to reclaim the store")?;
        }
        Ok(())
    }
}
