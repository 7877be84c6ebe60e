//! GPUCache stores behind the `gpucache_dataplane::Store` contract.
//!
//! Owns one module per backend: [`memory`] (the in-process reference) now; the FileStore, the
//! TCP client and the cold tier join it with their issues. Backends share the contract's
//! admission ledger, region table and lifecycle instead of keeping their own. [`resp`] is the
//! Redis-protocol (RESP2) front over any store. [`mooncake`] drives a live Mooncake Store through
//! a Python sidecar. [`pool`] is huge-page backed host memory for registered pools.

mod catalog;
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
