//! Workload pieces every bench uses, so that the same key shape and the same put loop are
//! measured against every store.

use std::hint::black_box;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, RopeParams, RopeScaling,
    Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Invalidate, Put, Store};

pub const TENANT: &str = "tenant-0042";
pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;

/// The seed of [`payload`]'s bytes.
const PAYLOAD_SEED: u64 = 0x1234_5678;

/// A digest whose 32 bytes are the first bytes of `seed`'s generator stream, so that distinct
/// seeds give distinct, unremarkable-looking digests.
pub fn digest(seed: u64) -> Digest32 {
    let mut out = [0u8; 32];
    SplitMix64::new(seed).fill_bytes(&mut out);
    Digest32(out)
}

/// A production-looking identity: a 70B-class model on an 8-way tensor-parallel shard, bf16 KV,
/// paged layout, Llama-3 RoPE scaling, 16-token blocks, and a chain of `links` hashes whose
/// values start from `chain_seed`.
pub fn identity(links: usize, chain_seed: u64) -> CacheIdentity {
    let rope = match RopeParams::new(500_000.0, RopeScaling::Llama3, 8.0, 8192) {
        Ok(r) => r,
        Err(e) => panic!("bench RoPE parameters are invalid: {e}"),
    };
    let chain = (0u64..).take(links).map(|i| digest(chain_seed.wrapping_add(i))).collect();
    let built = CacheIdentity::builder()
        .tenant(TENANT)
        .trust_domain("prod-us-east-1")
        .model_revision("meta-llama/Llama-3.1-70B-Instruct@945c8663")
        .model_config(digest(1))
        .tokenizer_revision("meta-llama/Llama-3.1-70B-Instruct@945c8663:tokenizer")
        .kv_dtype(KvDtype::Bf16)
        .quant(QuantFormat::None)
        .layout("paged-nhd", 2)
        .shard(Shard { tp_rank: 3, tp_size: 8, pp_rank: 0, pp_size: 1 })
        .position(PositionEncoding::Rope)
        .rope(Some(rope))
        .chain(chain)
        .block_tokens(16)
        .valid_tokens(16)
        .build();
    match built {
        Ok(id) => id,
        Err(e) => panic!("bench identity is invalid: {e}"),
    }
}

/// `n` distinct keys with 16-link chains, starting at `first_seed`.
pub fn keys(first_seed: u64, n: usize) -> Vec<PhysicalKey> {
    (0..to_u64(n)).map(|i| PhysicalKey::new(identity(16, first_seed + i * 16))).collect()
}

/// The caller every bench acts as.
pub fn caller() -> Caller {
    match TenantId::parse(TENANT) {
        Ok(t) => Caller::new(t, Rights::READ_WRITE),
        Err(e) => panic!("bench tenant is invalid: {e}"),
    }
}

/// Pseudo-random bytes (no zero pages), the same for every call: a shorter payload is a prefix
/// of a longer one.
pub fn payload(bytes: usize) -> Vec<u8> {
    SplitMix64::bytes(PAYLOAD_SEED, bytes)
}

pub fn size_label(bytes: usize) -> String {
    if bytes >= MIB { format!("{}MiB", bytes / MIB) } else { format!("{}KiB", bytes / KIB) }
}

pub fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Puts `src` under `key`, which must hold no block.
pub fn put(store: &dyn Store, caller: &Caller, key: &PhysicalKey, src: &[u8]) {
    match store.put(caller, key, black_box(src), None) {
        Ok(Put::Committed(sum)) => {
            black_box(sum);
        }
        other => panic!("put was not committed: {other:?}"),
    }
}

/// Times `iters` puts of `src`, each into a key with no block under it. Keys come from `pool`
/// in batches; after each batch its blocks are invalidated outside the timing, so usage stays
/// bounded and the next batch finds its keys free again.
pub fn timed_puts(
    store: &dyn Store,
    caller: &Caller,
    pool: &[PhysicalKey],
    src: &[u8],
    iters: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(pool.len());
        let batch = &pool[..n];
        let start = Instant::now();
        for key in batch {
            put(store, caller, key, src);
        }
        total += start.elapsed();
        for key in batch {
            match store.invalidate(caller, key) {
                Ok(Invalidate::Removed) => {}
                other => panic!("invalidate did not remove the block: {other:?}"),
            }
        }
        left -= to_u64(n);
    }
    total
}
