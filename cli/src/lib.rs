//! The `gpucache` service pieces the binary wires together, as a library so that integration
//! tests can drive them: the validated `serve` configuration ([`config`]), the HTTP endpoint for
//! metrics, liveness and readiness ([`http`]) and its readiness checks ([`ready`]), the log
//! output ([`logging`]), and the DPU agent's wiring and offload report ([`dpu`]).

pub mod config;
pub mod dpu;
pub mod http;
pub mod logging;
pub mod ready;
