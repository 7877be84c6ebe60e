//! Tenant authentication for the native service (ADR 0012): what a server knows of a tenant's
//! keys, what a client signs with, and the replay window of a sealed connection.
//!
//! The MAC and the key derivations are the codec's ([`crate::tcp::proto::seal`]); this module
//! owns files, policy and per-connection state, and never touches the store.

pub mod keys;
pub mod replay;

use std::sync::Arc;

pub use keys::{
    KEY_FILE_BYTES_MAX, KEY_ID_BYTES_MAX, KEYS_PER_TENANT_MAX, KeyFileError, LineError, Secret,
    TenantKey, TenantKeys, read_key_file,
};
pub use replay::{REPLAY_WINDOW_IDS, ReplayWindow};

use super::proto::SealAlgorithm;

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

/// What a client signs a tenant's sessions with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub key_id: String,
    pub secret: Secret,
    /// The seal algorithm proposed in HELLO; BLAKE3 by default (ADR 0012).
    pub seal: SealAlgorithm,
}

impl Credentials {
    pub fn new(key_id: impl Into<String>, secret: Secret) -> Self {
        Self { key_id: key_id.into(), secret, seal: SealAlgorithm::Blake3 }
    }

    /// The credentials for `key_id` from a key file (the same format the server reads).
    pub fn from_key_file(path: &std::path::Path, key_id: &str) -> Result<Self, String> {
        let keys = read_key_file(path).map_err(|e| e.to_string())?;
        let key = keys
            .into_iter()
            .find(|k| k.id == key_id)
            .ok_or_else(|| format!("{}: no key with id {key_id:?}", path.display()))?;
        Ok(Self::new(key.id, key.secret))
    }
}
