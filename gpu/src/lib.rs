//! GPU buffers for GPUCache through cudarc, loaded at run time: device discovery that never
//! panics without CUDA, device buffers under the registration contract, pinned host staging and
//! H2D/D2H copies whose completion events map onto retirement facts.
//!
//! Owns device memory and streams. It must not own block identity or lifecycle. Nothing is
//! implemented yet.
