//! Tenant authentication for the native service (ADR 0012): what a server knows of a tenant's
//! key files and the replay window of a sealed connection (what a client signs with is
//! `gpucache_client::Credentials`).
//!
//! The MAC and the key derivations are the codec's ([`gpucache_wire::seal`]); this module
//! owns files, policy and per-connection state, and never touches the store.

pub mod keys;
pub mod replay;

use std::sync::Arc;

pub use keys::{
    KEY_FILE_BYTES_MAX, KEY_ID_BYTES_MAX, KEYS_PER_TENANT_MAX, KeyFileError, LineError, Secret,
    TenantKey, TenantKeys, read_key_file,
};
pub use replay::{REPLAY_WINDOW_IDS, ReplayWindow};

use gpucache_wire::SealAlgorithm;

/// How a server authenticates one tenant: its keys, and the seal algorithms it accepts.
#[derive(Debug, Clone)]
pub struct TenantAuth {
    pub keys: Arc<TenantKeys>,
    /// Never empty; [`SealAlgorithm::ALL`] by default.
    pub accepted: Vec<SealAlgorithm>,
}

impl TenantAuth {
    /// Keys that accept both seal algorithms.
    pub fn new(keys: TenantKeys) -> Self {
        Self { keys: Arc::new(keys), accepted: SealAlgorithm::ALL.to_vec() }
    }
}

pub use gpucache_client::key_file::credentials_from_key_file;
