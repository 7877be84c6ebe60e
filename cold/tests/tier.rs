//! The cold tier's rules against a real S3 server on loopback (moto): packs and manifests,
//! refill and every way it turns into a miss, the sink's retries and failed queue, backfill,
//! retention, reclaim and retired tenants.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpucache_cold::manifest::{self, Manifest, PackBuilder, content_digest};
use gpucache_cold::moto::{Moto, open, start};
use gpucache_cold::{
    ColdConfig, ColdError, ColdMiss, ColdObjects, ColdSink, ColdTier, FaultPlan, FaultyObjects,
    RefillBudget, RefillRefused, Refilled, SINK_ATTEMPTS_MAX, SinkLimits, SinkRefused,
};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::{Clock, ManualClock, UnixClock};
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::StoreError;
use gpucache_dataplane::testing::fixture;

/// Counts the reads that reach the store, by the kind of object read.
#[derive(Debug)]
struct Counting<S> {
    inner: S,
    pack_gets: AtomicU64,
    calls: AtomicU64,
}

impl<S> Counting<S> {
    fn new(inner: S) -> Self {
        Self { inner, pack_gets: AtomicU64::new(0), calls: AtomicU64::new(0) }
    }
    fn pack_gets(&self) -> u64 {
        self.pack_gets.load(Ordering::SeqCst)
    }
    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl<S: ColdObjects> ColdObjects for Counting<S> {
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.put_new(key, bytes)
    }
    fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.head(key)
    }
    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        within: Duration,
    ) -> Result<Vec<u8>, ColdError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if key.contains("/packs/") {
            self.pack_gets.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get_range(key, range, within)
    }
    fn delete(&self, key: &str) -> Result<(), ColdError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.delete(key)
    }
    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.list(prefix)
    }
}

/// Which calls a [`Split`] sends to its other store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Reads of packs (lists and manifests stay on the base, so a tier opens cleanly).
    PackReads,
    /// PUTs, HEADs and DELETEs.
    Writes,
}

/// One store for most calls, another for those `route` names.
struct Split<A, B> {
    base: A,
    other: B,
    route: Route,
}

impl<A: ColdObjects, B: ColdObjects> ColdObjects for Split<A, B> {
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
        match self.route {
            Route::Writes => self.other.put_new(key, bytes),
            Route::PackReads => self.base.put_new(key, bytes),
        }
    }
    fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
        match self.route {
            Route::Writes => self.other.head(key),
            Route::PackReads => self.base.head(key),
        }
    }
    fn get_range(&self, key: &str, r: Range<u64>, within: Duration) -> Result<Vec<u8>, ColdError> {
        if self.route == Route::PackReads && key.contains("/packs/") {
            self.other.get_range(key, r, within)
        } else {
            self.base.get_range(key, r, within)
        }
    }
    fn delete(&self, key: &str) -> Result<(), ColdError> {
        match self.route {
            Route::Writes => self.other.delete(key),
            Route::PackReads => self.base.delete(key),
        }
    }
    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
        self.base.list(prefix)
    }
}

fn key(tenant: usize, n: u32) -> PhysicalKey {
    let chain: Vec<u8> = n.to_le_bytes().to_vec();
    fixture::key(tenant, &chain, KvDtype::F16, 16)
}

fn payload(n: u32, len: usize) -> Vec<u8> {
    fixture::payload(u64::from(n) * 7919 + 1, len)
}

fn budget() -> RefillBudget {
    RefillBudget { bytes_max: 64 << 20, within: Duration::from_secs(10) }
}

fn tier_on(objects: Arc<dyn ColdObjects>, clock: Arc<dyn Clock>) -> ColdTier {
    let (tier, _) = ColdTier::open(objects, ColdConfig::default(), clock).expect("open the tier");
    tier
}

/// A tier over moto, with the counting store it reads through.
fn counted(moto: &Moto, bucket: &str) -> (ColdTier, Arc<Counting<gpucache_cold::S3Objects>>) {
    let counting = Arc::new(Counting::new(open(moto, bucket)));
    let tier = tier_on(counting.clone(), Arc::new(UnixClock));
    (tier, counting)
}

/// Offers blocks `ns` of `tenant` (of `len` bytes) and drains until the sink is empty.
fn store_blocks(tier: &ColdTier, sink: &ColdSink, tenant: usize, ns: Range<u32>, len: usize) {
    for n in ns {
        let bytes = payload(n, len);
        sink.offer(tier, &key(tenant, n), &bytes, Checksum::of(&bytes)).expect("offer");
    }
    let report = sink.drain(tier).expect("drain");
    assert_eq!(report.pending, 0, "{report:?}");
}

fn hit(answer: &Result<Refilled, RefillRefused>) -> Option<&[u8]> {
    match answer {
        Ok(Refilled::Hit { bytes, .. }) => Some(bytes),
        _ => None,
    }
}

fn miss(answer: &Result<Refilled, RefillRefused>) -> Option<ColdMiss> {
    match answer {
        Ok(Refilled::Miss(m)) => Some(*m),
        _ => None,
    }
}

#[test]
fn packs_round_trip_and_a_restart_rebuilds_the_index_from_the_bucket() {
    let Some(moto) = start("round") else { return };
    let (tier, counting) = counted(&moto, "round");
    let limits = SinkLimits { pack_blocks_target: 8, ..SinkLimits::default() };
    let sink = ColdSink::new(limits);
    store_blocks(&tier, &sink, 0, 0..20, 3000);
    store_blocks(&tier, &sink, 1, 100..105, 5000);
    let stats = tier.stats();
    assert_eq!(stats.blocks, 25);
    assert_eq!(stats.manifests, 4, "20 blocks in packs of 8 make 3, the other tenant 1");
    let keys: Vec<PhysicalKey> = (0..20).map(|n| key(0, n)).collect();
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    let before = counting.pack_gets();
    let answers = tier.refill(&fixture::caller(0), &refs, budget());
    for (n, a) in (0..20).zip(&answers) {
        assert_eq!(hit(a), Some(&payload(n, 3000)[..]), "block {n}");
    }
    assert_eq!(counting.pack_gets() - before, 3, "adjacent ranges of a pack come in one read");

    let (again, report) =
        ColdTier::open(Arc::new(open(&moto, "round")), ColdConfig::default(), Arc::new(UnixClock))
            .expect("reopen");
    assert_eq!((report.manifests, report.blocks, report.legacy, report.damaged), (4, 25, 0, 0));
    let k = key(1, 103);
    let a = again.refill(&fixture::caller(1), &[&k], budget());
    assert_eq!(hit(&a[0]), Some(&payload(103, 5000)[..]));
    let absent = key(1, 999);
    let a = again.refill(&fixture::caller(1), &[&absent], budget());
    assert_eq!(miss(&a[0]), Some(ColdMiss::Absent));
}

#[test]
fn a_wrong_tenant_is_refused_before_anything_is_downloaded() {
    let Some(moto) = start("tenant") else { return };
    let (tier, counting) = counted(&moto, "tenant");
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&tier, &sink, 0, 0..4, 1000);
    let k = key(0, 1);
    let calls = counting.calls();
    let a = tier.refill(&fixture::caller(1), &[&k], budget());
    assert!(matches!(&a[0], Err(RefillRefused::Store(StoreError::WrongTenant { .. }))), "{a:?}");
    assert_eq!(counting.calls(), calls, "no call reached the object store");
}

#[test]
fn a_legacy_manifest_is_never_indexed_and_its_pack_never_read() {
    let Some(moto) = start("legacy") else { return };
    let s3 = open(&moto, "legacy");
    // A pack and a manifest as an older build would leave them: version 2, named by digest.
    let mut b = PackBuilder::new(fixture::tenant(0));
    let bytes = payload(5, 2000);
    b.push(key(0, 5), &bytes, Checksum::of(&bytes));
    let sealed = b.seal("gpucache", 1, u64::MAX).expect("seal");
    let mut legacy = sealed.manifest_bytes.to_vec();
    legacy[4] = 2;
    let name = manifest::manifest_name("gpucache", &fixture::tenant(0), &content_digest(&legacy));
    s3.put_new(&sealed.pack_name, &sealed.pack).expect("pack");
    s3.put_new(&name, &legacy).expect("legacy manifest");

    let counting = Arc::new(Counting::new(open(&moto, "legacy")));
    let (tier, report) =
        ColdTier::open(counting.clone(), ColdConfig::default(), Arc::new(UnixClock)).expect("open");
    assert_eq!((report.manifests, report.legacy), (0, 1));
    let k = key(0, 5);
    let a = tier.refill(&fixture::caller(0), &[&k], budget());
    assert_eq!(miss(&a[0]), Some(ColdMiss::Absent));
    assert_eq!(counting.pack_gets(), 0, "the legacy manifest's pack was never downloaded");
}

#[test]
fn a_manifest_changed_under_its_name_is_a_miss_without_a_payload_download() {
    let Some(moto) = start("changed") else { return };
    let (tier, counting) = counted(&moto, "changed");
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&tier, &sink, 0, 0..3, 1000);
    let name = tier.manifests_of(&fixture::tenant(0)).pop().expect("a manifest");
    let s3 = open(&moto, "changed");
    let mut bytes = s3.get_range(&name, 0..1_000_000, Duration::from_secs(5)).expect("get");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    s3.delete(&name).expect("delete");
    s3.put_new(&name, &bytes).expect("put the changed manifest under the old name");
    let before = counting.pack_gets();
    let k = key(0, 1);
    let a = tier.refill(&fixture::caller(0), &[&k], budget());
    assert_eq!(miss(&a[0]), Some(ColdMiss::Mismatch));
    assert_eq!(counting.pack_gets(), before, "no payload download");
}

#[test]
fn a_corrupt_range_is_a_miss_and_never_a_hit() {
    let Some(moto) = start("corrupt") else { return };
    let (tier, _) = counted(&moto, "corrupt");
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&tier, &sink, 0, 0..3, 4096);
    let k = key(0, 1);
    let (pack, len) = tier.pack_of(&k).expect("indexed");
    let s3 = open(&moto, "corrupt");
    let mut bytes = s3.get_range(&pack, 0..len, Duration::from_secs(5)).expect("get");
    bytes[4096 + 17] ^= 1;
    s3.delete(&pack).expect("delete");
    s3.put_new(&pack, &bytes).expect("put the damaged pack under the old name");
    let (k0, k2) = (key(0, 0), key(0, 2));
    let a = tier.refill(&fixture::caller(0), &[&k0, &k, &k2], budget());
    assert_eq!(hit(&a[0]), Some(&payload(0, 4096)[..]), "the undamaged neighbours still serve");
    assert_eq!(miss(&a[1]), Some(ColdMiss::Corrupt));
    assert_eq!(hit(&a[2]), Some(&payload(2, 4096)[..]));
    assert_eq!(tier.stats().refill_misses[7], 1, "counted under corrupt");
}

#[test]
fn torn_ranges_are_misses() {
    let Some(moto) = start("torn") else { return };
    let plan = FaultPlan { torn_ranges: 1000, ..FaultPlan::none(3) };
    let faulty = FaultyObjects::new(open(&moto, "torn"), plan);
    let writer = tier_on(Arc::new(open(&moto, "torn")), Arc::new(UnixClock));
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&writer, &sink, 0, 0..2, 4096);
    // Opened on the clean store, the tier reads its packs through the faults.
    let torn_tier = tier_on(
        Arc::new(Split { base: open(&moto, "torn"), other: faulty, route: Route::PackReads }),
        Arc::new(UnixClock),
    );
    assert_eq!(torn_tier.stats().blocks, 2);
    let k = key(0, 1);
    let a = torn_tier.refill(&fixture::caller(0), &[&k], budget());
    assert_eq!(miss(&a[0]), Some(ColdMiss::Corrupt), "a short range is never a hit");
    let a = writer.refill(&fixture::caller(0), &[&k], budget());
    assert_eq!(hit(&a[0]), Some(&payload(1, 4096)[..]), "the clean path serves it");
}

#[test]
fn over_budget_requests_are_misses_and_download_nothing_beyond_the_budget() {
    let Some(moto) = start("budget") else { return };
    let (tier, counting) = counted(&moto, "budget");
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&tier, &sink, 0, 0..4, 10_000);
    let keys: Vec<PhysicalKey> = (0..4).map(|n| key(0, n)).collect();
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    let small = RefillBudget { bytes_max: 25_000, within: Duration::from_secs(10) };
    let a = tier.refill(&fixture::caller(0), &refs, small);
    assert_eq!(hit(&a[0]), Some(&payload(0, 10_000)[..]));
    assert_eq!(hit(&a[1]), Some(&payload(1, 10_000)[..]));
    assert_eq!(miss(&a[2]), Some(ColdMiss::OverBudget));
    assert_eq!(miss(&a[3]), Some(ColdMiss::OverBudget));
    let before = counting.calls();
    let none = RefillBudget { bytes_max: 9_999, within: Duration::from_secs(10) };
    let a = tier.refill(&fixture::caller(0), &refs[..1], none);
    assert_eq!(miss(&a[0]), Some(ColdMiss::OverBudget));
    assert_eq!(counting.calls(), before, "nothing was asked of the store");
}

#[test]
fn a_store_that_is_down_turns_refills_into_misses_then_degraded_ones_that_call_nothing() {
    let Some(mut moto) = start("down") else { return };
    let (tier, counting) = counted(&moto, "down");
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&tier, &sink, 0, 0..2, 1000);
    moto.kill();
    let k = key(0, 0);
    let started = Instant::now();
    let a = tier.refill(&fixture::caller(0), &[&k], budget());
    assert_eq!(miss(&a[0]), Some(ColdMiss::Unavailable));
    assert!(tier.stats().degraded, "the tier says it is degraded");
    let calls = counting.calls();
    let a = tier.refill(&fixture::caller(0), &[&k], budget());
    assert_eq!(miss(&a[0]), Some(ColdMiss::Degraded));
    assert_eq!(counting.calls(), calls, "a degraded refill asks nothing of the store");
    assert!(started.elapsed() < budget().within + Duration::from_secs(5));
}

#[test]
fn a_slow_store_is_cut_off_by_the_refill_deadline() {
    let Some(moto) = start("slow") else { return };
    let plan = FaultPlan { slow: 1000, latency_ms: 3_000, ..FaultPlan::none(9) };
    let writer = tier_on(Arc::new(open(&moto, "slow")), Arc::new(UnixClock));
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&writer, &sink, 0, 0..1, 1000);
    let slow = Split {
        base: open(&moto, "slow"),
        other: FaultyObjects::new(open(&moto, "slow"), plan),
        route: Route::PackReads,
    };
    let (tier, _) =
        ColdTier::open(Arc::new(slow), ColdConfig::default(), Arc::new(UnixClock)).expect("open");
    let k = key(0, 0);
    let tight = RefillBudget { bytes_max: 1 << 20, within: Duration::from_millis(300) };
    let started = Instant::now();
    let a = tier.refill(&fixture::caller(0), &[&k], tight);
    let took = started.elapsed();
    assert_eq!(miss(&a[0]), Some(ColdMiss::Unavailable));
    assert!(took < Duration::from_millis(2_500), "waited {took:?}, past the 300 ms budget");
}

#[test]
fn an_ambiguous_put_keeps_the_objects_a_visible_manifest_may_reference() {
    let Some(moto) = start("ambiguous") else { return };
    // Every PUT lands and its acknowledgement is lost.
    let plan = FaultPlan { lost_acks: 1000, ..FaultPlan::none(1) };
    let lossy =
        tier_on(Arc::new(FaultyObjects::new(open(&moto, "ambiguous"), plan)), Arc::new(UnixClock));
    let sink = ColdSink::new(SinkLimits::default());
    for n in 0..3 {
        let bytes = payload(n, 2000);
        sink.offer(&lossy, &key(0, n), &bytes, Checksum::of(&bytes)).expect("offer");
    }
    let s3 = open(&moto, "ambiguous");
    // Round 1: the pack's PUT lands unacknowledged; the job goes back to the queue.
    let r = sink.drain_round(&lossy);
    assert_eq!((r.retried, r.stored), (1, 0), "{r:?}");
    assert_eq!(s3.list("gpucache/packs/").expect("list").len(), 1, "the pack is there");
    // Round 2: the retry finds the pack there (its name is its digest) and goes on to the
    // manifest, whose PUT lands unacknowledged too.
    let r = sink.drain_round(&lossy);
    assert_eq!((r.retried, r.stored), (1, 0), "{r:?}");
    // Round 3 meets a store that fails everything: the job is out of tries.
    let failing = tier_on(
        Arc::new(Split {
            base: open(&moto, "ambiguous"),
            other: FaultyObjects::new(
                open(&moto, "ambiguous"),
                FaultPlan { server_errors: 1000, ..FaultPlan::none(2) },
            ),
            route: Route::Writes,
        }),
        Arc::new(UnixClock),
    );
    let r = sink.drain_round(&failing);
    assert_eq!(r.failed, 1, "{r:?}");
    let failed = sink.failed();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].attempts, SINK_ATTEMPTS_MAX);
    assert!(failed[0].error.is_transient());
    // Nothing was deleted: the manifest is visible, and so is the pack it names.
    let (clean, report) = ColdTier::open(
        Arc::new(open(&moto, "ambiguous")),
        ColdConfig::default(),
        Arc::new(UnixClock),
    )
    .expect("open");
    assert_eq!((report.manifests, report.blocks), (1, 3));
    let k = key(0, 2);
    assert_eq!(
        hit(&clean.refill(&fixture::caller(0), &[&k], budget())[0]),
        Some(&payload(2, 2000)[..])
    );
    // Tried again on a store that answers, the job succeeds on the objects already there.
    assert!(sink.retry_failed(failed[0].id));
    let report = sink.drain(&clean).expect("drain");
    assert_eq!((report.stored, report.failed), (1, 0));
    assert_eq!(s3.list("gpucache/").expect("list").len(), 2, "one pack, one manifest");
}

#[test]
fn permanent_failures_go_to_a_failed_queue_that_shares_the_limits() {
    let Some(moto) = start("present") else { return };
    // The bucket does not exist: every PUT fails for good.
    let tier = tier_on(
        Arc::new(Split {
            base: open(&moto, "present"),
            other: open(&moto, "missing-bucket"),
            route: Route::Writes,
        }),
        Arc::new(UnixClock),
    );
    let limits = SinkLimits {
        jobs_max: 3,
        bytes_max: 10_000,
        pack_blocks_target: 1,
        ..SinkLimits::default()
    };
    let sink = ColdSink::new(limits);
    for n in 0..2 {
        let bytes = payload(n, 3000);
        sink.offer(&tier, &key(0, n), &bytes, Checksum::of(&bytes)).expect("offer");
    }
    let failure = sink.drain(&tier).expect_err("every job fails");
    let (report, error) = (failure.report, failure.error);
    assert_eq!((report.attempted, report.stored, report.failed, report.retried), (2, 0, 2, 0));
    assert!(!error.is_transient(), "{error:?}");
    assert_eq!(report.first_error.as_ref().map(|(_, e)| e), Some(&error));
    let failed = sink.failed();
    assert_eq!(failed.len(), 2);
    assert!(failed.iter().all(|f| f.attempts == 1 && f.blocks == 1 && f.bytes == 3000));
    // Failed jobs still count: 6,000 of 10,000 bytes held, so a 5,000-byte block is refused.
    let big = payload(9, 5000);
    let refused = sink.offer(&tier, &key(0, 9), &big, Checksum::of(&big));
    assert!(matches!(refused, Err(SinkRefused::Full { .. })), "{refused:?}");
    // Taking one out frees its share.
    let job = sink.take_failed(failed[0].id).expect("the failed job");
    assert_eq!(job.sealed.manifest.entries.len(), 1);
    sink.offer(&tier, &key(0, 9), &big, Checksum::of(&big)).expect("room again");
    assert_eq!(sink.depth().bytes, 8000);
}

#[test]
fn backfill_stops_at_its_byte_budget() {
    let Some(moto) = start("backfill") else { return };
    let (tier, _) = counted(&moto, "backfill");
    let sink = ColdSink::new(SinkLimits::default());
    let blocks: Vec<(PhysicalKey, Vec<u8>)> =
        (0..10).map(|n| (key(0, n), payload(n, 1000))).collect();
    let report =
        sink.backfill(&tier, blocks.iter().map(|(k, b)| (k, b.as_slice(), Checksum::of(b))), 3_500);
    assert_eq!((report.blocks, report.bytes), (3, 3000));
    assert_eq!(report.stopped, Some(gpucache_cold::BackfillStop::Budget { budget: 3_500 }));
    sink.drain(&tier).expect("drain");
    let refs: Vec<&PhysicalKey> = blocks.iter().map(|(k, _)| k).collect();
    let a = tier.refill(&fixture::caller(0), &refs, budget());
    assert_eq!(a.iter().filter(|a| hit(a).is_some()).count(), 3);
}

#[test]
fn retention_reclaims_with_a_head_that_proves_absence_and_retired_tenants_are_refused() {
    let Some(moto) = start("retain") else { return };
    let clock = ManualClock::default();
    clock.advance_ms(1_000_000);
    let tier = tier_on(Arc::new(open(&moto, "retain")), Arc::new(clock.clone()));
    tier.record_retention(&fixture::tenant(0), 10);
    let sink = ColdSink::new(SinkLimits::default());
    store_blocks(&tier, &sink, 0, 0..3, 1000);
    store_blocks(&tier, &sink, 0, 10..13, 1000);
    // Tenant 1's blocks have the same bytes as tenant 0's first three: one pack, two manifests.
    store_blocks(&tier, &sink, 1, 0..3, 1000);
    assert_eq!(tier.packs().len(), 2);
    assert_eq!(tier.reclaim().manifests, 0, "nothing has expired yet");
    clock.advance_ms(11_000);
    let s3 = open(&moto, "retain");
    let packs_before = tier.packs();
    let report = tier.reclaim();
    assert_eq!((report.manifests, report.packs, report.failed.len()), (2, 1, 0), "{report:?}");
    assert!(tier.manifests_of(&fixture::tenant(0)).is_empty());
    let gone: Vec<&String> = packs_before.iter().filter(|p| !tier.packs().contains(p)).collect();
    assert_eq!(gone.len(), 1, "the pack tenant 1 still references stays");
    assert_eq!(s3.head(gone[0]).expect("head"), None, "the other pack is gone from the bucket");
    let k = key(0, 1);
    assert_eq!(miss(&tier.refill(&fixture::caller(0), &[&k], budget())[0]), Some(ColdMiss::Absent));
    // Tenant 1 kept no retention: its blocks stay, until it is retired.
    let k1 = key(1, 1);
    assert!(hit(&tier.refill(&fixture::caller(1), &[&k1], budget())[0]).is_some());
    tier.retire(&fixture::tenant(1)).expect("retire");
    assert!(matches!(
        &tier.refill(&fixture::caller(1), &[&k1], budget())[0],
        Err(RefillRefused::Retired(_))
    ));
    let bytes = payload(50, 100);
    assert!(matches!(
        sink.offer(&tier, &key(1, 50), &bytes, Checksum::of(&bytes)),
        Err(SinkRefused::Retired(_))
    ));
    // A restart still refuses it; the next reclaim deletes its objects.
    let (again, report) = ColdTier::open(
        Arc::new(open(&moto, "retain")),
        ColdConfig::default(),
        Arc::new(clock.clone()),
    )
    .expect("reopen");
    assert_eq!(report.retired_tenants, 1);
    assert!(again.is_retired(&fixture::tenant(1)));
    let report = again.reclaim();
    assert_eq!((report.manifests, report.packs), (1, 1));
    assert!(s3.list("gpucache/packs/").expect("list").is_empty(), "every pack was reclaimed");
}

#[test]
fn manifests_check_their_version_on_every_read() {
    // Decoding is what each refill does to the manifest it fetched; a legacy one is refused
    // there too, before any range is read.
    let mut b = PackBuilder::new(fixture::tenant(0));
    b.push(key(0, 1), b"abc", Checksum::of(b"abc"));
    let sealed = b.seal("p", 0, u64::MAX).expect("seal");
    let mut old = sealed.manifest_bytes.to_vec();
    old[4] = 1;
    assert_eq!(
        Manifest::decode(&old, &content_digest(&old)),
        Err(manifest::ManifestError::Legacy { version: 1 })
    );
}
