//! The GPUCache native TCP service and its client.
//!
//! - [`proto`]: the GPCW wire codec (frames, typed requests and responses, the incremental frame
//!   decoder), as specified in `docs/PROTOCOL.md`.
//! - [`server`]: the service, one thread per connection (ADR 0011), over any shared `Store`.
//! - [`auth`]: tenant key files, client credentials and the replay window (ADR 0012).
//! - [`staging`]: the contract between the service and memory registered for one-sided
//!   transfers (NIXL block staging, ADR 0018), implemented in `gpucache-nic`.
//! - [`client`]: [`TcpStore`], a `Store` that is served by a remote `gpucache serve`.

pub mod auth;
pub mod client;
pub mod proto;
pub mod server;
pub mod staging;

pub use auth::{Credentials, TenantAuth};
pub use client::{ClientConfig, ConnectError, LocalConfig, SharedStats, TcpStore};
pub use server::{Server, ServerConfig};
