//! GPUCache benchmarks: criterion benches of the contract and the stores in `benches/`, and
//! (with its issue) the peer harness behind `gpucache bench`.
