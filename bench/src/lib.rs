//! GPUCache benchmarks: criterion benches of the contract and the stores in `benches/`, and
//! (with its issue) the peer harness behind `gpucache bench`.
//!
//! This library holds what the benches share ([`fixtures`]): production-looking keys,
//! deterministic payloads, and the timed-put loop.

pub mod fixtures;
