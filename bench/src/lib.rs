//! GPUCache benchmarks: criterion benches in `benches/` of the contract, the FileStore, the
//! service, the seal and the executor. The peer harness behind `gpucache bench` lives in the
//! cli crate.
//!
//! This library holds what the benches share ([`fixtures`]): production-looking keys,
//! deterministic payloads, and the timed-put loop.

pub mod fixtures;
