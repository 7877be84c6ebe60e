//! GPUCache's local stores behind the `gpucache_dataplane::Store` contract, and the host memory
//! they and the transports share.
//!
//! - [`memory`]: [`MemoryStore`], the in-process reference store.
//! - [`file`](mod@file): the FileStore, one durable file per block through io_uring or
//!   pread/pwrite, its engines, and `fsck`.
//! - [`tiered`]: [`tiered::TieredStore`], a memory tier over the FileStore.
//! - [`host`]: host memory: huge-page backed pools for registered memory ([`host::pool`]) and
//!   sealed memfd segments for the same-host path ([`host::segment`]).
//!
//! Stores share the contract's admission ledger, region table and lifecycle through the block
//! catalog instead of keeping their own.

mod catalog;
pub mod evict;
pub mod file;
pub mod host;
pub mod memory;
pub mod tiered;

pub use memory::MemoryStore;
