//! What a client signs a tenant's sessions with (ADR 0012).

use gpucache_wire::SealAlgorithm;
use gpucache_wire::keys::Secret;

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
}
