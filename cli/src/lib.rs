//! The `gpucache` service pieces the binary wires together, as a library so that integration
//! tests can drive them: the validated `serve` configuration ([`config`]) and the HTTP endpoint
//! for metrics and health ([`http`]), and the DPU agent's wiring and offload report ([`dpu`]).

pub mod config;
pub mod dpu;
pub mod http;
