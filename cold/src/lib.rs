//! GPUCache's cold tier, on any S3-compatible object store.
//!
//! - [`ColdObjects`]: the object store as the tier needs it (create-only PUT, HEAD, ranged
//!   GET, DELETE, LIST), every failure typed as absent, already there, worth another try, or
//!   not. [`S3Objects`] is the real one (the `object_store` crate's S3 client);
//!   [`FaultyObjects`] wraps any of them with seeded faults for tests (latency, server errors,
//!   timeouts, lost acknowledgements, torn ranges), and says it is a simulation, as
//!   [`MemoryObjects`] (an object store in memory) does.
//! - [`manifest`]: packs of blocks and their version 3 manifests, both content-addressed, each
//!   range bound to its tenant and the digest of its block's full identity.
//! - [`ColdTier`]: stores sealed packs, indexes them, refills blocks under a byte and time
//!   budget (misses, never wrong bytes, when anything is off), records retention, reclaims and
//!   retires tenants.
//! - [`ColdSink`]: the bounded queue that carries blocks down, in drain rounds with bounded
//!   retries and a failed queue.
//! - [`ColdTiered`]: the cold tier as the bottom tier of the tiered store (memory over file):
//!   file-tier evictions go down through the sink, misses refill from it.

mod faulty;
mod layer;
pub mod manifest;
mod memory;
pub mod moto;
mod objects;
mod s3;
mod sink;
mod tier;

pub use faulty::{FaultKind, FaultPlan, FaultyObjects};
pub use layer::{
    ColdLayerConfig, ColdLayerCounters, ColdTiered, DRAIN_INTERVAL_MS_DEFAULT, DROP_CLOSE_WITHIN,
    RECLAIM_INTERVAL_S_DEFAULT,
};
pub use memory::MemoryObjects;
pub use objects::{ColdError, ColdObjects, LIST_OBJECTS_MAX};
pub use s3::{S3_REQUEST_TIMEOUT_MS_DEFAULT, S3Config, S3Objects};
pub use sink::{
    BackfillReport, BackfillStop, ColdSink, DRAIN_JOBS_MAX_DEFAULT, DrainFailed, DrainReport,
    FailedJob, Job, PACK_BLOCKS_TARGET_DEFAULT, PACK_BYTES_TARGET_DEFAULT, SINK_ATTEMPTS_MAX,
    SINK_BYTES_MAX_DEFAULT, SINK_JOBS_MAX_DEFAULT, SinkCounters, SinkDepth, SinkLimits,
    SinkRefused,
};
pub use tier::{
    COLD_MISS_REASONS, ColdConfig, ColdMiss, ColdStats, ColdTier, DEGRADE_MS_DEFAULT,
    FORGOTTEN_MAX, INDEX_ENTRIES_MAX_DEFAULT, OPEN_FETCH_WITHIN_MIN, OpenReport,
    REFILL_BYTES_MAX_DEFAULT, REFILL_WITHIN_MS_DEFAULT, ReclaimReport, RefillBudget, RefillRefused,
    Refilled,
};
