//! The GPUCache client: [`TcpStore`], a `Store` served by a remote `gpucache serve` over GPCW,
//! with the same-host shared-memory path and the staging calls of one-sided transfers.
//!
//! - [`tcp`]: the connection pool, the handshake, pipelined batches (framed or through the
//!   shared segment), staging.
//! - [`credentials`]: what a client signs a tenant's sessions with.
//! - [`key_file`]: reading a tenant key file, as the server does.

pub mod credentials;
pub mod key_file;
pub mod tcp;

pub use credentials::Credentials;
pub use tcp::{
    ClientConfig, ConnectError, FRAME_PAYLOAD_TARGET, FRAMES_IN_FLIGHT_MAX, LocalConfig,
    SharedStats, Stripe, TcpStore,
};
