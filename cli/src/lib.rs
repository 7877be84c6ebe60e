//! The `gpucache` service pieces the binary wires together, as a library so that integration
//! tests can drive them: the validated `serve` configuration ([`config`]) and the HTTP endpoint
//! for metrics and health ([`http`]).

pub mod config;
pub mod http;
