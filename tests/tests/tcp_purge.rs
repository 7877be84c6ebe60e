//! PURGE end to end: one request from one client removes every block of a namespace (one
//! model's keys of one connector) that several ranks wrote through their own connections, and
//! nothing of another model, another connector's layouts or another tenant; it needs the write
//! right; a store with more than `PURGE_BLOCKS_MAX` blocks of the namespace is purged over
//! several requests, each bounded.

use std::sync::Arc;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Right, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, Shard,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{
    Lookup, PURGE_BLOCKS_MAX, PurgeScope, Purged, Put, Store, StoreError, purge,
};
use gpucache_dataplane::testing::fixture::{link, tenant};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;

/// The fields one rank of one engine instance puts into its keys.
struct Rank {
    tenant: usize,
    model: u8,
    layout: &'static str,
    dtype: KvDtype,
    shard: Shard,
}

fn rank(tenant: usize, model: u8, layout: &'static str, tp: (u16, u16), pp: (u16, u16)) -> Rank {
    let shard = Shard { tp_rank: tp.0, tp_size: tp.1, pp_rank: pp.0, pp_size: pp.1 };
    Rank { tenant, model, layout, dtype: KvDtype::F16, shard }
}

fn key_of(r: &Rank, page: u32, block_tokens: u32) -> PhysicalKey {
    let mut link_bytes = link(r.model).0;
    link_bytes[1..5].copy_from_slice(&page.to_le_bytes());
    let identity = CacheIdentity::builder()
        .tenant(tenant(r.tenant).as_str())
        .trust_domain("default")
        .model_revision("main")
        .model_config(Digest32([r.model; 32]))
        .tokenizer_revision("main")
        .no_adapter()
        .kv_dtype(r.dtype)
        .quant(QuantFormat::None)
        .layout(r.layout, 1)
        .shard(r.shard)
        .position(PositionEncoding::None)
        .rope(None)
        .multimodal(None)
        .chain(vec![Digest32(link_bytes)])
        .block_tokens(block_tokens)
        .valid_tokens(block_tokens)
        .build()
        .expect("identity");
    PhysicalKey::new(identity)
}

fn server() -> Server {
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
            .expect("store"),
    );
    let config = ServerConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        vec![
            Caller::new(tenant(0), Rights::READ_WRITE),
            Caller::new(tenant(1), Rights::READ_WRITE),
        ],
    );
    Server::start(config, store).expect("server")
}

fn client(server: &Server, caller: &Caller) -> TcpStore {
    TcpStore::new(ClientConfig::new(server.local_addr(), caller.clone()))
}

/// Stores `pages` blocks of rank `r` through a connection of its own; returns their keys.
fn write_rank(server: &Server, r: &Rank, pages: u32) -> Vec<PhysicalKey> {
    let caller = Caller::new(tenant(r.tenant), Rights::READ_WRITE);
    let c = client(server, &caller);
    let block_tokens = if r.layout.contains("mamba") { 1 } else { 16 };
    (0..pages)
        .map(|p| {
            let k = key_of(r, p, block_tokens);
            let data = vec![u8::try_from(p % 251).unwrap_or(0); 64];
            assert!(matches!(c.put(&caller, &k, &data, None), Ok(Put::Committed(_))));
            k
        })
        .collect()
}

fn held(server: &Server, tenant_index: usize, keys: &[PhysicalKey]) -> usize {
    let caller = Caller::new(tenant(tenant_index), Rights::READ_WRITE);
    let c = client(server, &caller);
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    c.lookup_batch(&caller, &refs)
        .into_iter()
        .filter(|a| matches!(a, Ok(Lookup::Hit { .. })))
        .count()
}

#[test]
fn one_purge_removes_every_rank_of_the_namespace_and_nothing_else() {
    let server = server();
    // Model 1's SGLang pools over TP 4 x PP 2, two pool kinds (another layout, dtype and
    // block size each), written by eight connections as eight ranks would.
    let mut ours = Vec::new();
    for tp in 0..4 {
        for pp in 0..2 {
            ours.extend(write_rank(
                &server,
                &rank(0, 1, "sglang-mha-page_first", (tp, 4), (pp, 2)),
                5,
            ));
            let mut mamba = rank(0, 1, "sglang-mamba-page_first", (tp, 4), (pp, 2));
            mamba.dtype = KvDtype::Bf16;
            ours.extend(write_rank(&server, &mamba, 3));
        }
    }
    // What must stay: another model, another connector's layout of the same model, the same
    // model's SGLang pages of another tenant.
    let other_model = write_rank(&server, &rank(0, 2, "sglang-mha-page_first", (0, 1), (0, 1)), 4);
    let other_layout = write_rank(&server, &rank(0, 1, "vllm-paged", (0, 1), (0, 1)), 4);
    let other_tenant = write_rank(&server, &rank(1, 1, "sglang-mha-page_first", (0, 4), (0, 2)), 4);
    assert_eq!(held(&server, 0, &ours), ours.len());

    // Any key of the namespace names it: here TP rank 3's, from a connection of its own.
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let sample = key_of(&rank(0, 1, "sglang-mha-page_first", (3, 4), (1, 2)), 999, 16);
    let scope = PurgeScope::new(sample, "sglang-").expect("scope");
    let done = client(&server, &caller).purge(&caller, &scope).expect("purge");
    assert_eq!(done, Purged { removed: ours.len() as u64, busy: 0, more: false });
    assert_eq!(held(&server, 0, &ours), 0, "every rank's blocks are gone");
    assert_eq!(held(&server, 0, &other_model), other_model.len(), "another model stays");
    assert_eq!(held(&server, 0, &other_layout), other_layout.len(), "another layout stays");
    assert_eq!(held(&server, 1, &other_tenant), other_tenant.len(), "another tenant stays");

    // Again: nothing left to remove.
    let again = client(&server, &caller).purge(&caller, &scope).expect("purge again");
    assert_eq!(again, Purged::default());
}

#[test]
fn purge_needs_the_write_right_on_its_own_tenant() {
    let server = server();
    let r = rank(0, 1, "sglang-mha-page_first", (0, 1), (0, 1));
    let keys = write_rank(&server, &r, 4);
    let scope = PurgeScope::new(keys[0].clone(), "").expect("scope");

    let reader = Caller::new(tenant(0), Rights::READ_ONLY);
    let e = client(&server, &reader).purge(&reader, &scope).expect_err("read-only purge");
    assert!(matches!(e, StoreError::Forbidden { right: Right::Write, .. }), "{e}");

    let stranger = Caller::new(tenant(1), Rights::READ_WRITE);
    let e = client(&server, &stranger).purge(&stranger, &scope).expect_err("foreign purge");
    assert!(matches!(e, StoreError::WrongTenant { .. }), "{e}");
    assert_eq!(held(&server, 0, &keys), keys.len(), "a refused purge removes nothing");
}

#[test]
fn a_namespace_larger_than_one_request_is_purged_in_bounded_steps() {
    let store = MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
        .expect("store");
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let r = rank(0, 1, "sglang-mha-page_first", (0, 1), (0, 1));
    let extra = 10;
    let total = u32::try_from(PURGE_BLOCKS_MAX).expect("fits") + extra;
    for p in 0..total {
        let k = key_of(&r, p, 16);
        assert!(matches!(store.put(&caller, &k, &[1], None), Ok(Put::Committed(_))));
    }
    let scope = PurgeScope::new(key_of(&r, 0, 16), "sglang-").expect("scope");
    let first = purge(&store, &caller, &scope).expect("first purge");
    assert_eq!(first, Purged { removed: PURGE_BLOCKS_MAX as u64, busy: 0, more: true });
    let second = purge(&store, &caller, &scope).expect("second purge");
    assert_eq!(second, Purged { removed: u64::from(extra), busy: 0, more: false });
    assert_eq!(store.stats().committed_blocks, 0);
}
