//! GPUCache benchmarks, as a library the subcommands of the `gpucache-bench` binary (package
//! gpucache-cli) call.
//!
//! - [`file`]: the FileStore beside fio on the same files; [`fio`] drives fio.
//! - [`dpu`]: the DPU agent beside the FileStore and fio.
//! - [`service`]: `gpucache serve` beside Redis and Mooncake Store under one load.
//! - [`nixl`]: NIXL transfers beside our TCP path and memcpy.
//! - [`python`]: the `gpucache` Python package's batch calls beside the Rust client and
//!   Mooncake Store's Python client.
//! - [`trace`]: prefix-reuse request traces replayed through a store per eviction policy,
//!   beside Belady's bound and an offline LRU (with the cold tier below a tiered store too).
//! - [`cold`]: the cold tier (packs, sink, refill) on an S3 endpoint beside plain objects on
//!   the same bucket.
//! - [`stats`]: the figures every harness reports, computed one way (rates, ratios,
//!   nearest-rank percentiles, medians and spreads) and the table cells that show them.
//! - [`fixtures`]: what the criterion benches in `benches/` share (production-looking keys,
//!   deterministic payloads, the timed-put loop).
//!
//! The peers' driver scripts live beside the harnesses in `peers/`.

pub mod cold;
pub mod dpu;
pub mod file;
pub mod fio;
pub mod fixtures;
pub mod nixl;
pub mod python;
pub mod service;
pub mod stats;
pub mod trace;
