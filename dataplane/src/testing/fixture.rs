//! Identities, keys and payloads the suite reuses.

use crate::caller::{Caller, Rights};
use crate::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, RopeParams, RopeScaling,
    Shard, TenantId,
};
use crate::key::PhysicalKey;

/// Tenant names used by the suite.
pub const TENANTS: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];

pub fn tenant(i: usize) -> TenantId {
    TenantId::parse(TENANTS[i % TENANTS.len()]).expect("fixture tenant is valid")
}

pub fn caller(i: usize) -> Caller {
    Caller::new(tenant(i), Rights::READ_WRITE)
}

pub fn admin(i: usize) -> Caller {
    Caller::new(tenant(i), Rights::ALL)
}

/// The n-th link of a chain (distinct per n).
pub fn link(n: u8) -> Digest32 {
    let mut d = [0u8; 32];
    d[0] = n;
    d[31] = 0xA5;
    Digest32(d)
}

/// A valid identity for `tenant` with `chain` links, `dtype` and `valid` tokens of 16.
pub fn identity(tenant: usize, chain: &[u8], dtype: KvDtype, valid: u32) -> CacheIdentity {
    CacheIdentity::builder()
        .tenant(TENANTS[tenant % TENANTS.len()])
        .trust_domain("prod.example")
        .model_revision("llama-3.1-8b@2024-07")
        .model_config(Digest32([7; 32]))
        .tokenizer_revision("tok-v3")
        .kv_dtype(dtype)
        .quant(QuantFormat::None)
        .layout("paged-nhd", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::Rope)
        .rope(Some(RopeParams::new(500_000.0, RopeScaling::Llama3, 8.0, 8192).expect("valid")))
        .chain(chain.iter().map(|n| link(*n)).collect())
        .block_tokens(16)
        .valid_tokens(valid)
        .build()
        .expect("fixture identity is valid")
}

pub fn key(tenant: usize, chain: &[u8], dtype: KvDtype, valid: u32) -> PhysicalKey {
    PhysicalKey::new(identity(tenant, chain, dtype, valid))
}

/// The per-tenant key pool of the model: prefix chains, an incompatible physical form of the
/// same logical key, a shorter valid length, and an unrelated chain.
pub fn key_pool(tenant: usize) -> Vec<PhysicalKey> {
    vec![
        key(tenant, &[1], KvDtype::F16, 16),
        key(tenant, &[1, 2], KvDtype::F16, 16),
        key(tenant, &[1, 2, 3], KvDtype::F16, 16),
        key(tenant, &[1, 2], KvDtype::Bf16, 16),
        key(tenant, &[1, 2, 3], KvDtype::F16, 8),
        key(tenant, &[9], KvDtype::F16, 16),
    ]
}

/// Deterministic payload bytes for `(seed, len)`: the seed's generator stream, so a shorter
/// payload of one seed is a prefix of a longer one.
pub fn payload(seed: u64, len: usize) -> Vec<u8> {
    crate::rng::SplitMix64::bytes(seed, len)
}

/// A store that runs `before` on every GET's destination, then hands every call, that GET
/// included, to `inner` unchanged: a test observes or holds up GETs (records their size, waits
/// at a gate) without forwarding the whole trait itself.
pub struct BeforeGet<S, F> {
    pub inner: S,
    before: F,
}

impl<S, F> BeforeGet<S, F> {
    pub fn new(inner: S, before: F) -> Self {
        Self { inner, before }
    }
}

impl<S: std::fmt::Debug, F> std::fmt::Debug for BeforeGet<S, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BeforeGet").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, F> crate::store::StoreLayer for BeforeGet<S, F>
where
    S: crate::store::Store,
    F: Fn(&[u8]) + Send + Sync,
{
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S, F> crate::store::Store for BeforeGet<S, F>
where
    S: crate::store::Store,
    F: Fn(&[u8]) + Send + Sync,
{
    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<crate::store::Get, crate::store::StoreError> {
        (self.before)(dst);
        self.inner.get_into(caller, key, dst)
    }
    fn failures_retire(&self) -> bool {
        self.inner.failures_retire()
    }
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<crate::limits::RequestId>,
    ) -> Result<crate::store::Put, crate::store::StoreError> {
        self.inner.put(caller, key, src, request)
    }
    // GET batches run `before` per item through `get_into`; the others are the inner store's.
    fn lookup_batch(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
    ) -> crate::store::BatchAnswers<crate::store::Lookup> {
        self.inner.lookup_batch(caller, keys)
    }
    fn put_batch(
        &self,
        caller: &Caller,
        items: &[crate::store::BatchPut<'_>],
    ) -> crate::store::BatchAnswers<crate::store::Put> {
        self.inner.put_batch(caller, items)
    }
    fn invalidate_batch(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
    ) -> crate::store::BatchAnswers<crate::store::Invalidate> {
        self.inner.invalidate_batch(caller, keys)
    }
    crate::forward_store!(
        fences, reports, info, lookup, reserve, write, commit, abort, invalidate, scope_keys
    );
}

/// A [`crate::store::GetTo`] for tests: lends to `lend`, copies into `copy` (sized to the
/// GET's capacity by the caller).
#[derive(Debug)]
pub struct Deliver<F> {
    pub lend: F,
    pub copy: Vec<u8>,
}

impl<F: FnMut(&[u8], crate::checksum::Checksum) -> Option<crate::checksum::Checksum>>
    crate::store::GetTo for Deliver<F>
{
    fn lend(
        &mut self,
        bytes: &[u8],
        checksum: crate::checksum::Checksum,
    ) -> Option<crate::checksum::Checksum> {
        (self.lend)(bytes, checksum)
    }

    fn buffer(&mut self) -> &mut [u8] {
        &mut self.copy
    }
}

/// [`crate::store::Store::get_one`] with a lending closure, answered as a lending-only GET
/// would be: `Some` for a lent hit or a miss, `None` for a hit the store copied instead.
pub fn get_lent(
    store: &dyn crate::store::Store,
    caller: &Caller,
    key: &PhysicalKey,
    capacity: usize,
    lend: impl FnMut(&[u8], crate::checksum::Checksum) -> Option<crate::checksum::Checksum>,
) -> Result<Option<crate::store::Get>, crate::store::StoreError> {
    use crate::store::{Delivery, Get};
    let mut to = Deliver { lend, copy: vec![0; capacity] };
    store.get_one(caller, key, capacity, &mut to).map(|got| match (got.get, got.delivery) {
        (Get::Hit { .. }, Delivery::Copied) => None,
        (get, _) => Some(get),
    })
}
