//! The GPUCache service: everything `gpucache serve` runs, as a library.
//!
//! - [`config`]: the configuration schema, its defaults and its validation, which gives the
//!   [`config::ValidConfig`] a service is built from; [`build`]: that configuration turned into
//!   a running [`build::Service`] in one step; [`serve`]: runs it until a stop signal.
//! - [`server`] and [`listener`]: the GPCW server over any shared `Store`, one thread per
//!   connection, and the bounded acceptors of every front; [`resp`]: the Redis-protocol front;
//!   [`auth`]: tenant keys and replay windows; [`create_only`]: the create-only answers the
//!   fronts share; [`bounds`]: what keeps the fronts bounded under hostile clients (the
//!   in-flight request-body budget, connections per peer, body, HELLO and write deadlines, and
//!   the refusal counts).
//! - [`metered`] and [`executor_metrics`]: the Prometheus series; [`http`]: metrics, liveness and
//!   readiness, with the checks in [`ready`]; [`logging`]: log output.
//! - [`dpu`]: the DPU agent's wiring and offload report; [`units`]: sizes and durations as
//!   people write them.

pub mod auth;
pub mod bounds;
pub mod build;
pub mod cluster;
pub mod cold_metrics;
pub mod config;
pub mod connection;
pub mod create_only;
pub mod dpu;
pub mod executor_metrics;
pub mod fills;
pub mod http;
pub mod listener;
pub mod logging;
pub mod metered;
pub mod ready;
pub mod resp;
pub mod serve;
pub mod server;
pub mod tier_metrics;
pub mod units;

pub use auth::TenantAuth;
pub use server::{Server, ServerConfig};
