//! The identity namespace plain names live in (ADR 0003 keys, the RESP front's mapping): a plain
//! name is an opaque byte string inside one fixed [`CacheIdentity`] of a tenant, whose chain is
//! the one link [`chain_link`] of the name's bytes. The RESP front, `gpucache put/get` and the
//! Python package all map names through this one function, so each reads what another wrote.

use gpucache_dataplane::identity::{
    CacheIdentity, CacheIdentityBuilder, Digest32, IdentityError, KvDtype, PositionEncoding,
    QuantFormat, Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;

/// The identity namespace plain keys live in: a fixed [`CacheIdentity`] whose chain is replaced,
/// per key, by the one link [`chain_link`] of the key's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityTemplate {
    base: CacheIdentity,
}

impl IdentityTemplate {
    /// Trust domain of the default namespace.
    pub const TRUST_DOMAIN: &'static str = "resp";
    /// Model revision of the default namespace.
    pub const MODEL_REVISION: &'static str = "resp";
    /// Tokenizer revision of the default namespace.
    pub const TOKENIZER_REVISION: &'static str = "resp";
    /// Layout ABI of the default namespace: opaque bytes.
    pub const LAYOUT: &'static str = "resp-value";
    pub const LAYOUT_VERSION: u32 = 1;

    /// The default namespace of `tenant`: the constants above, a model config digest that is the
    /// BLAKE3 hash of `gpucache/resp/v1`, no adapter, dtype U8, no quantization, one shard, no
    /// position encoding, no multimodal inputs.
    pub fn for_tenant(tenant: &TenantId) -> Result<Self, IdentityError> {
        let base = CacheIdentity::builder()
            .tenant(tenant.as_str())
            .trust_domain(Self::TRUST_DOMAIN)
            .model_revision(Self::MODEL_REVISION)
            .model_config(Digest32(*blake3::hash(b"gpucache/resp/v1").as_bytes()))
            .tokenizer_revision(Self::TOKENIZER_REVISION)
            .no_adapter()
            .kv_dtype(KvDtype::U8)
            .quant(QuantFormat::None)
            .layout(Self::LAYOUT, Self::LAYOUT_VERSION)
            .shard(Shard::SOLO)
            .position(PositionEncoding::None)
            .rope(None)
            .multimodal(None);
        Self::from_builder(base)
    }

    /// A namespace built on every field of `identity` except the chain and the block and valid
    /// token counts, which are set per key.
    pub fn from_identity(identity: &CacheIdentity) -> Result<Self, IdentityError> {
        Self::from_builder(identity.to_builder())
    }

    fn from_builder(b: CacheIdentityBuilder) -> Result<Self, IdentityError> {
        let base = b.chain(vec![chain_link(b"")]).block_tokens(1).valid_tokens(1).build()?;
        Ok(Self { base })
    }

    /// The tenant that owns every key of the namespace.
    pub fn tenant(&self) -> &TenantId {
        self.base.tenant()
    }

    /// The namespace's identity, with the chain of the empty key.
    pub fn identity(&self) -> &CacheIdentity {
        &self.base
    }

    /// The physical key of the plain key `plain`.
    pub fn key_for(&self, plain: &[u8]) -> Result<PhysicalKey, IdentityError> {
        self.key_for_link(chain_link(plain))
    }

    /// The physical key of the plain key whose [`chain_link`] is `link`.
    pub fn key_for_link(&self, link: Digest32) -> Result<PhysicalKey, IdentityError> {
        let identity =
            self.base.to_builder().chain(vec![link]).block_tokens(1).valid_tokens(1).build()?;
        Ok(PhysicalKey::new(identity))
    }
}

/// The one chain link of a plain key: the BLAKE3 hash of its bytes.
pub fn chain_link(plain: &[u8]) -> Digest32 {
    Digest32(*blake3::hash(plain).as_bytes())
}
