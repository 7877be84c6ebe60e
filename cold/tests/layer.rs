//! The cold tier below the tiered store, against moto: file-tier evictions go down and come back
//! byte for byte, lookups see them, a store that is down makes misses and changes nothing in
//! the upper tiers, an invalidation survives a restart, and another tenant gets nothing.

use std::sync::Arc;
use std::time::Duration;

use gpucache_cold::moto::{Moto, open, start};
use gpucache_cold::{
    ColdConfig, ColdLayerConfig, ColdSink, ColdTier, ColdTiered, RefillBudget, SinkLimits,
};
use gpucache_dataplane::clock::{ManualClock, UnixClock};
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{
    Get, Invalidate, Lookup, MissReason, Put, Store, StoreError, Tier,
};
use gpucache_dataplane::testing::fixture;
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::tiered::{MemoryTier, TieredStore};

const BLOCK: usize = 8192;

fn key(n: u8) -> PhysicalKey {
    fixture::key(0, &[n, 0xc0], KvDtype::F16, 16)
}

/// A tiered store of 2 blocks in memory over 4 in files, the cold tier on `bucket` below.
fn layered(moto: &Moto, bucket: &str, dir: &std::path::Path) -> ColdTiered {
    let mut file = FileStoreConfig::new(dir);
    file.engine = EngineChoice::Psync;
    file.durability = Durability::None;
    file.policy = PolicyKind::Fifo;
    let b = BLOCK as u64;
    file.limits = ResourceLimits {
        retained_bytes_max: 4 * b,
        tenant_retained_bytes_max: 4 * b,
        object_bytes_max: b,
        tenant_inflight_bytes_max: b,
        ..ResourceLimits::default()
    };
    let memory = MemoryTier::new(2 * b, PolicyKind::Fifo);
    let upper = TieredStore::open(file, memory, Arc::new(ManualClock::default())).expect("tiered");
    let (cold, _) =
        ColdTier::open(Arc::new(open(moto, bucket)), ColdConfig::default(), Arc::new(UnixClock))
            .expect("cold tier");
    let config = ColdLayerConfig {
        refill: RefillBudget { bytes_max: 1 << 20, within: Duration::from_secs(10) },
        drain_interval_ms: 0,
        reclaim_interval_s: 0,
    };
    let sink = Arc::new(ColdSink::new(SinkLimits::default()));
    ColdTiered::new(Arc::new(upper), Arc::new(cold), sink, config).expect("layer")
}

fn sum(n: u8) -> gpucache_dataplane::checksum::Checksum {
    gpucache_dataplane::checksum::Checksum::of(&fixture::payload(u64::from(n), BLOCK))
}

fn put_all(store: &ColdTiered, n: u8) {
    let caller = fixture::caller(0);
    for i in 0..n {
        let bytes = fixture::payload(u64::from(i), BLOCK);
        assert!(matches!(store.put(&caller, &key(i), &bytes, None), Ok(Put::Committed(_))));
    }
}

fn get(store: &ColdTiered, n: u8) -> Result<Get, StoreError> {
    let mut dst = vec![0u8; BLOCK];
    let got = store.get_into(&fixture::caller(0), &key(n), &mut dst)?;
    if matches!(got, Get::Hit { .. }) {
        assert_eq!(dst, fixture::payload(u64::from(n), BLOCK), "block {n}'s bytes");
    }
    Ok(got)
}

#[test]
fn evicted_blocks_go_down_and_come_back_byte_for_byte() {
    let Some(moto) = start("layer") else { return };
    let dir = tempfile::tempdir().expect("dir");
    let store = layered(&moto, "layer", dir.path());
    put_all(&store, 12);
    let c = store.counters();
    assert_eq!(c.demoted, 8, "the file tier holds 4 of 12: {c:?}");
    let report = store.sink().drain(store.cold()).expect("drain");
    assert_eq!(report.blocks_stored, 8);
    let caller = fixture::caller(0);
    let keys: Vec<PhysicalKey> = (0..12).map(key).collect();
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    let located = store.locate(&caller, &refs);
    let tiers: Vec<Option<Tier>> =
        located.iter().map(|l| l.as_ref().expect("locate").tier).collect();
    assert!(tiers[..8].iter().all(|t| *t == Some(Tier::Cold)), "{tiers:?}");
    assert!(tiers[8..].iter().all(|t| matches!(t, Some(Tier::Memory | Tier::File))), "{tiers:?}");
    assert_eq!(store.lookup(&caller, &key(0)).expect("lookup"), Lookup::Hit { len: BLOCK as u64 });
    // Each refill moves a block up, which evicts another down into the sink: a block read
    // before the sink drained it misses once, and hits after the drain.
    let mut drains = 0;
    for n in 0..12 {
        if get(&store, n).expect("get") != (Get::Hit { len: BLOCK as u64, checksum: sum(n) }) {
            store.sink().drain(store.cold()).expect("drain");
            drains += 1;
            assert!(matches!(get(&store, n).expect("get"), Get::Hit { .. }), "block {n}");
        }
    }
    assert!(drains > 0, "the refills evicted blocks the first drain had not seen");
    let c = store.counters();
    assert!(c.cold_hits >= 8, "{c:?}");
    assert!(c.refilled_up >= 8, "cold hits move up: {c:?}");
    assert!(c.demote_already_cold > 0, "a refilled block evicted again is not stored twice: {c:?}");
    // A batch GET refills the same way.
    store.sink().drain(store.cold()).expect("drain");
    let mut bufs: Vec<Vec<u8>> = (0..12).map(|_| vec![0u8; BLOCK]).collect();
    let mut items: Vec<gpucache_dataplane::store::BatchGet<'_>> = keys
        .iter()
        .zip(bufs.iter_mut())
        .map(|(k, b)| gpucache_dataplane::store::BatchGet { key: k, dst: b })
        .collect();
    let answers = store.get_batch(&caller, &mut items);
    assert!(answers.iter().all(|a| matches!(a, Ok(Get::Hit { .. }))), "{answers:?}");
    for (n, b) in (0..12u8).zip(&bufs) {
        assert_eq!(b, &fixture::payload(u64::from(n), BLOCK), "batch block {n}");
    }
}

#[test]
fn a_store_that_is_down_makes_misses_and_leaves_the_upper_tiers_untouched() {
    let Some(mut moto) = start("down") else { return };
    let dir = tempfile::tempdir().expect("dir");
    let store = layered(&moto, "down", dir.path());
    put_all(&store, 8);
    store.sink().drain(store.cold()).expect("drain");
    moto.kill();
    let before = (store.upper().stats(), store.upper().counters());
    assert_eq!(get(&store, 0).expect("get"), Get::Miss(MissReason::Absent));
    assert!(store.cold().stats().degraded);
    // In the degraded window no call is made at all; still a miss.
    assert_eq!(get(&store, 1).expect("get"), Get::Miss(MissReason::Absent));
    let after = (store.upper().stats(), store.upper().counters());
    assert_eq!(before.0.committed_blocks, after.0.committed_blocks);
    assert_eq!(before.0.usage, after.0.usage, "the upper tiers hold what they held");
    assert_eq!(before.1.promotions, after.1.promotions);
    assert_eq!(store.counters().cold_hits, 0);
    // The blocks the upper tiers hold still serve.
    assert!(matches!(get(&store, 7).expect("get"), Get::Hit { .. }));
}

#[test]
fn an_invalidated_cold_block_stays_gone_across_a_restart() {
    let Some(moto) = start("forget") else { return };
    let dir = tempfile::tempdir().expect("dir");
    let caller = fixture::caller(0);
    {
        let store = layered(&moto, "forget", dir.path());
        put_all(&store, 8);
        store.sink().drain(store.cold()).expect("drain");
        assert_eq!(store.invalidate(&caller, &key(1)).expect("invalidate"), Invalidate::Removed);
        assert_eq!(get(&store, 1).expect("get"), Get::Miss(MissReason::Absent));
        assert!(matches!(get(&store, 2).expect("get"), Get::Hit { .. }), "its neighbours stay");
    }
    let dir2 = tempfile::tempdir().expect("dir");
    let again = layered(&moto, "forget", dir2.path());
    assert_eq!(get(&again, 1).expect("get"), Get::Miss(MissReason::Absent), "still gone");
    assert!(matches!(get(&again, 3).expect("get"), Get::Hit { .. }), "the rest came back");
}

#[test]
fn another_tenant_gets_nothing_from_the_cold_tier() {
    let Some(moto) = start("tenants") else { return };
    let dir = tempfile::tempdir().expect("dir");
    let store = layered(&moto, "tenants", dir.path());
    put_all(&store, 8);
    store.sink().drain(store.cold()).expect("drain");
    let other = fixture::caller(1);
    let mut dst = vec![0u8; BLOCK];
    let got = store.get_into(&other, &key(0), &mut dst);
    assert!(matches!(got, Err(StoreError::WrongTenant { .. })), "{got:?}");
    assert!(dst.iter().all(|b| *b == 0), "no byte reached the other tenant");
    let l = store.locate(&other, &[&key(0)]);
    assert!(matches!(&l[0], Err(StoreError::WrongTenant { .. })), "{l:?}");
}
