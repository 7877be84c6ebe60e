//! The crate's one error type.

use std::fmt;
use std::path::PathBuf;

use gpucache_dataplane::registry::PoolError;

use crate::ids::{QueueId, ReactorId};

/// Why an agent call failed. Submission refusals submit nothing and lease nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DpuError {
    #[error(
        "queue {queue} is owned by reactor {owner}; submission through reactor {asked} refused"
    )]
    AffinityViolation { queue: QueueId, owner: ReactorId, asked: ReactorId },
    #[error("queue {queue} is full ({depth_max} submissions outstanding)")]
    QueueFull { queue: QueueId, depth_max: usize },
    #[error("slab exhausted: {free} of {total} slots free")]
    SlabExhausted { free: usize, total: usize },
    #[error("payload of {len} bytes exceeds the slab slot of {slot_bytes} bytes")]
    PayloadTooLarge { len: usize, slot_bytes: usize },
    #[error("destination holds {provided} bytes, the block has {needed}")]
    BufferTooSmall { needed: usize, provided: usize },
    #[error("queue {0} does not exist")]
    UnknownQueue(QueueId),
    #[error("reactor {0} does not exist")]
    UnknownReactor(ReactorId),
    #[error("ticket {seq} of queue {queue} is not outstanding (already reaped or abandoned)")]
    UnknownTicket { queue: QueueId, seq: u64 },
    #[error(
        "no completion for ticket {seq} of queue {queue} by its deadline; slab slot quarantined"
    )]
    Lost { queue: QueueId, seq: u64 },
    #[error("queue {queue} completed ticket {seq} with an error: {detail}; slab slot quarantined")]
    Completion { queue: QueueId, seq: u64, detail: String },
    #[error("a {expected} job was answered as {got}")]
    ForeignAnswer { expected: &'static str, got: &'static str },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("pinning reactor {reactor} to core {core} was refused: {detail}")]
    PinRefused { reactor: ReactorId, core: usize, detail: String },
    #[error("{backend} backend unavailable: missing {}", list(.missing))]
    NativeUnavailable { backend: &'static str, missing: Vec<NativeMissing> },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("I/O engine unavailable: {0}")]
    Engine(String),
    #[error("slab: {0}")]
    Slab(#[from] PoolError),
    #[error(
        "the slab fence did not drain by its deadline: {executing} submissions still executing"
    )]
    FenceNotDrained { executing: usize },
    #[error("the agent is stopping")]
    Stopped,
}

fn list(missing: &[NativeMissing]) -> String {
    let parts: Vec<String> = missing.iter().map(ToString::to_string).collect();
    parts.join("; ")
}

pub(crate) fn io_at(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> DpuError + '_ {
    move |source| DpuError::Io { path: path.to_owned(), source }
}

/// One thing a native backend needs and does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NativeMissing {
    /// A shared library that could not be loaded.
    Library { name: String },
    /// A device node or PCI function that is not present.
    Device { what: String },
    /// Reserved huge pages (SPDK and DOCA DMA both need them).
    HugePages,
    /// The GPUCache binding for the backend, which this build does not include.
    Binding { backend: &'static str },
}

impl fmt::Display for NativeMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Library { name } => write!(f, "library {name}"),
            Self::Device { what } => write!(f, "device {what}"),
            Self::HugePages => write!(f, "hugepages (HugePages_Free is 0 in /proc/meminfo)"),
            Self::Binding { backend } => write!(f, "the gpucache {backend} binding (not built)"),
        }
    }
}
