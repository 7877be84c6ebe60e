//! The GPUCache DPU agent: a process that owns storage queues bound to reactors (threads pinned
//! to cores, polling run-to-completion), backed by io_uring on the host here and by SPDK or DOCA
//! behind features that fail closed where those are absent.
//!
//! Owns queue affinity, the agent's registered slab, its persisted epoch and the honest report
//! of whether offload is active. It must not own block identity or lifecycle: [`DpuStore`]
//! forwards those to the store it wraps.
//!
//! # API
//!
//! - [`AgentConfig`] (state dir, [`ReactorSpec`]s, [`QueueSpec`]s, [`SlabConfig`],
//!   [`PinPolicy`]) → [`AgentConfig::start`] → [`Agent`]. Starting bumps and persists the
//!   agent epoch ([`Agent::epoch`]); everything submitted under an older epoch is fenced.
//! - Block I/O: [`Agent::submit_write`] / [`Agent::submit_read`] `(reactor, queue, block, ..)`
//!   → [`Ticket`]; [`Agent::wait`]`(ticket, deadline, dst)` → [`Outcome`] (`Written`,
//!   `Read { len }`, `Miss(MissCause)`). Refusals are typed [`DpuError`]s with nothing
//!   submitted: `AffinityViolation { queue, owner, asked }`, `QueueFull { queue, depth_max }`,
//!   `SlabExhausted`, ... A wait that passes its deadline is `Lost` (slot quarantined); an
//!   error completion is `Completion` (slot quarantined).
//! - Routing: [`Agent::route`]`(hash)` → `(ReactorId, QueueId)`, stable for a configuration.
//! - Slab: [`Agent::slab`] ([`SlabCounts`]), [`Agent::expire_slab_leases`] (quarantines,
//!   never frees), [`Agent::bump_epoch`] + [`Agent::reclaim_fenced`] (the fence that returns
//!   quarantined slots).
//! - Reporting for INFO/STATS: [`Agent::offload`] ([`Offload`]; `HostThreads` or `Simulated`
//!   here, never `Active` without a native backend), [`Agent::reactors`] ([`ReactorReport`]
//!   with the real [`Pinning`]), [`Agent::stats`] ([`AgentStats`], per queue [`QueueStats`]).
//! - [`DpuStore`]: the dataplane `Store` over an agent and a backing store (a FileStore with
//!   the io_uring engine in the service): every call routes by key to its queue's reactor
//!   ([`DpuStore::route`]); a batch call gives every queue its items before waiting on any,
//!   with at most [`BATCH_IN_FLIGHT_MAX`] items (and no more than the slab's slots) in flight.
//! - [`sim`]: the simulated queue with seeded faults ([`sim::SimConfig`], [`sim::FaultRates`]).
//! - `spdk` / `doca` features: [`QueueKind::Spdk`] / [`QueueKind::Doca`], which fail closed at
//!   start with [`DpuError::NativeUnavailable`] naming what is missing.

mod agent;
mod batch;
mod epoch;
mod error;
mod ids;
mod job;
mod native;
mod queue;
mod reactor;
pub mod sim;
mod slab;
mod store;
mod uring;

pub use agent::{
    Agent, AgentConfig, AgentStats, Offload, QUEUES_MAX, QueueKind, QueueSpec,
    REACTOR_STOP_PATIENCE, REACTORS_MAX, ReactorSpec, SlabConfig, SlabCounts,
};
pub use batch::BATCH_IN_FLIGHT_MAX;
pub use epoch::{EPOCH_FILE, read_persisted_epoch};
pub use error::{DpuError, NativeMissing};
#[cfg(feature = "doca")]
pub use native::doca::DocaConfig;
#[cfg(feature = "spdk")]
pub use native::spdk::SpdkConfig;
pub use queue::{BlockId, MissCause, Outcome, QUEUE_DEPTH_MAX, QueueId, QueueStats, Ticket};
pub use reactor::{PinPolicy, Pinning, ReactorId, ReactorReport, allowed_cores};
pub use slab::{SLAB_SLOTS_MAX, SlabMemory};
pub use store::{DpuStore, DpuStoreConfig};
pub use uring::BLOCK_HEADER_BYTES;
