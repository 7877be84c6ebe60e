//! GPUCache stores behind the `gpucache_dataplane::Store` contract, and the fronts that serve
//! them.
//!
//! Owns one module per store: [`memory`] (the in-process reference), [`file`](mod@file) (the FileStore:
//! one durable file per block through io_uring or pread/pwrite), [`tcp`] (the GPCW service and
//! `TcpStore`, its client) and [`mooncake`] (a live Mooncake Store driven through a Python
//! sidecar). Stores share the contract's admission ledger, region table and lifecycle instead of
//! keeping their own. [`resp`] is the Redis-protocol (RESP2) front over any store, [`shm`] the
//! same-host shared-memory segment, [`metered`] and [`executor_metrics`] the Prometheus series,
//! and [`pool`] huge-page backed host memory for registered pools. The cold object-store tier
//! does not exist yet.

mod catalog;
pub mod create_only;
pub mod executor_metrics;
pub mod file;
mod listener;
pub mod memory;
pub mod metered;
pub mod mooncake;
pub mod pool;
pub mod resp;
pub mod shm;
pub mod tcp;

pub use memory::MemoryStore;
