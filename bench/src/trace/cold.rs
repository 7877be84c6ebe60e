//! `--store cold`: the tiered store (memory over file) with the cold tier below it
//! ([`ColdTiered`]), on an S3 endpoint or on an object store simulated in memory.
//!
//! The replay sees the layer through [`Timed`], which passes every call through and, for each
//! GET, notes how long the layer took and which tier served it: the cold tier when the layer's
//! cold hits grew during the call, the file or memory tier when the tiered store's hits did,
//! a miss otherwise. The replay is one thread and the drain thread moves none of these
//! counters, so the difference from the previous GET's reading names the tier. Latencies go into
//! fixed-size histograms (about 3 % wide buckets), so memory stays bounded whatever the trace.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpucache_cold::{
    ColdConfig, ColdLayerConfig, ColdObjects, ColdSink, ColdTier, ColdTiered, MemoryObjects,
    RefillBudget, S3Config, S3Objects, SinkLimits,
};
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::clock::{MonotonicClock, UnixClock};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{
    BatchAnswers, Get, GetTo, GotOne, Located, Lookup, Put, Store, StoreError, StoreLayer,
};
use gpucache_storage::file::FileStoreConfig;
use gpucache_storage::tiered::{MemoryTier, TieredStore};

use super::tiers::{ColdHits, Latency, RefillMisses};

/// How long closing a layer may spend draining what its sink still holds.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// Sub-buckets per power of two in [`Histogram`]: `1 << SUB_BITS`.
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
/// Buckets of a [`Histogram`]: values below [`SUB`] one each, then [`SUB`] per power of two
/// from `SUB` up.
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) << SUB_BITS;

/// Where the cold tier's objects live.
#[derive(Debug, Clone)]
pub(super) enum ColdObjectsArg {
    /// A [`MemoryObjects`] of this many bytes: a simulation, said so in every report.
    Memory {
        bytes_max: u64,
    },
    S3(S3Config),
}

impl ColdObjectsArg {
    pub(super) fn simulated(&self) -> bool {
        matches!(self, Self::Memory { .. })
    }

    /// How the report names it.
    pub(super) fn describe(&self) -> String {
        match self {
            Self::Memory { .. } => {
                "an object store SIMULATED IN MEMORY (MemoryObjects; no S3 server)".to_owned()
            }
            Self::S3(c) => {
                format!("S3 at {} bucket {}", c.endpoint.as_deref().unwrap_or("(AWS)"), c.bucket)
            }
        }
    }

    fn open(&self) -> Result<Arc<dyn ColdObjects>, String> {
        match self {
            Self::Memory { bytes_max } => Ok(Arc::new(MemoryObjects::new(*bytes_max))),
            Self::S3(c) => S3Objects::open(c)
                .map(|o| Arc::new(o) as Arc<dyn ColdObjects>)
                .map_err(|e| format!("the cold tier's bucket {}: {e}", c.bucket)),
        }
    }
}

/// How one cold store of the replay is made.
#[derive(Debug, Clone)]
pub(super) struct ColdSetup {
    pub objects: ColdObjectsArg,
    /// The folder of this store's objects in the bucket (fresh per run and policy).
    pub prefix: String,
    pub drain_interval_ms: u64,
    /// Leave the objects in the bucket afterwards (S3 only; a simulation holds nothing).
    pub keep: bool,
}

/// A latency histogram of fixed size: exact below [`SUB`] ns, then [`SUB`] buckets per power
/// of two.
#[derive(Debug, Clone)]
pub(super) struct Histogram {
    counts: Vec<u64>,
    samples: u64,
    sum_ns: u128,
    max_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self { counts: vec![0; BUCKETS], samples: 0, sum_ns: 0, max_ns: 0 }
    }
}

fn bucket_of(v: u64) -> usize {
    if v < SUB {
        return usize::try_from(v).unwrap_or(0);
    }
    let shift = 63 - v.leading_zeros() - SUB_BITS;
    let index = (u64::from(shift) + 1) * SUB + ((v >> shift) - SUB);
    usize::try_from(index).unwrap_or(BUCKETS - 1).min(BUCKETS - 1)
}

/// The smallest and largest value of bucket `i`.
fn bucket_bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < SUB {
        return (i, i);
    }
    let shift = i / SUB - 1;
    let low = (SUB + i % SUB) << shift;
    (low, low + ((1u64 << shift) - 1))
}

impl Histogram {
    pub(super) fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[bucket_of(ns)] += 1;
        self.samples += 1;
        self.sum_ns += u128::from(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// The nearest-rank `p` percentile (0 to 100), as the middle of its bucket (never above
    /// the largest value seen), in ns.
    pub(super) fn percentile_ns(&self, p: f64) -> Option<u64> {
        let rank = crate::stats::nearest_rank(self.samples, p)?;
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (low, high) = bucket_bounds(i);
                return Some((low + (high - low) / 2).min(self.max_ns));
            }
        }
        Some(self.max_ns)
    }

    /// Percentiles and mean in microseconds.
    #[allow(clippy::cast_precision_loss)]
    pub(super) fn summary(&self) -> Latency {
        let us = |ns: Option<u64>| ns.map(|n| n as f64 / 1e3);
        Latency {
            samples: self.samples,
            p50_us: us(self.percentile_ns(50.0)),
            p99_us: us(self.percentile_ns(99.0)),
            mean_us: (self.samples > 0).then(|| self.sum_ns as f64 / self.samples as f64 / 1e3),
            max_us: us((self.samples > 0).then_some(self.max_ns)),
        }
    }
}

/// Which tier served a GET, by index into [`Seen::latency`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    Memory = 0,
    File = 1,
    Cold = 2,
    Miss = 3,
}

#[derive(Debug, Default)]
struct Seen {
    memory_hits: u64,
    file_hits: u64,
    cold_hits: u64,
    latency: [Histogram; 4],
}

/// The layer, timed per GET and tier (see the module documentation).
pub(super) struct Timed {
    layer: ColdTiered,
    seen: Mutex<Seen>,
    setup: ColdSetup,
}

impl std::fmt::Debug for Timed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timed").field("layer", &self.layer).finish_non_exhaustive()
    }
}

/// Opens a tiered store of `file` under `memory` with a cold tier below as `setup` says.
pub(super) fn open(
    file: FileStoreConfig,
    memory: MemoryTier,
    setup: &ColdSetup,
) -> Result<Timed, String> {
    let root = file.root.display().to_string();
    let upper = TieredStore::open(file, memory, Arc::new(MonotonicClock::default()))
        .map_err(|e| format!("open a tiered store in {root}: {e}"))?;
    let config =
        ColdConfig { prefix: setup.prefix.clone(), retention_s: 0, ..ColdConfig::default() };
    let (cold, _) = ColdTier::open(setup.objects.open()?, config, Arc::new(UnixClock))
        .map_err(|e| format!("open the cold tier under {}: {e}", setup.prefix))?;
    let layer_config = ColdLayerConfig {
        refill: RefillBudget::default(),
        drain_interval_ms: setup.drain_interval_ms,
        reclaim_interval_s: 0,
    };
    let sink = Arc::new(ColdSink::new(SinkLimits::default()));
    let layer = ColdTiered::new(Arc::new(upper), Arc::new(cold), sink, layer_config)
        .map_err(|e| format!("start the cold tier's drain thread: {e}"))?;
    Ok(Timed { layer, seen: Mutex::default(), setup: setup.clone() })
}

fn lock(m: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Timed {
    /// Notes one GET that took `took`.
    fn note(&self, took: Duration) {
        let cold = self.layer.counters().cold_hits;
        let upper = self.layer.upper().counters();
        let mut s = lock(&self.seen);
        let served = if cold > s.cold_hits {
            Served::Cold
        } else if upper.file_hits > s.file_hits {
            Served::File
        } else if upper.memory_hits > s.memory_hits {
            Served::Memory
        } else {
            Served::Miss
        };
        s.cold_hits = cold;
        s.file_hits = upper.file_hits;
        s.memory_hits = upper.memory_hits;
        s.latency[served as usize].record(took);
    }

    /// The tiered store's counters, for the memory and file tiers' share.
    pub(super) fn upper_counts(&self) -> super::tiers::TierCounts {
        let c = self.layer.upper().counters();
        super::tiers::TierCounts {
            memory_hits: c.memory_hits,
            file_hits: c.file_hits,
            promotions: c.promotions,
        }
    }

    /// What the cold tier did, as shares of `refs` block references.
    #[allow(clippy::cast_precision_loss)]
    pub(super) fn cold_hits(&self, refs: u64) -> ColdHits {
        let c = self.layer.counters();
        let stats = self.layer.cold().stats();
        let sink = self.layer.sink().counters();
        let s = lock(&self.seen);
        ColdHits {
            simulated: self.setup.objects.simulated(),
            cold_hits: c.cold_hits,
            cold_ratio: crate::stats::share(c.cold_hits, refs),
            refill: s.latency[Served::Cold as usize].summary(),
            memory_get: s.latency[Served::Memory as usize].summary(),
            file_get: s.latency[Served::File as usize].summary(),
            miss_get: s.latency[Served::Miss as usize].summary(),
            demoted: c.demoted,
            demote_refused: c.demote_refused,
            demote_unreadable: c.demote_unreadable,
            refilled_up: c.refilled_up,
            packs_stored: stats.packs_stored,
            bytes_up: stats.bytes_up,
            bytes_down: stats.bytes_down,
            refill_misses: RefillMisses::of(&stats.refill_misses),
            sink_jobs_failed: sink.jobs_failed,
            sink_jobs_retried: sink.jobs_retried,
        }
    }

    /// Stops the drain thread (one last round within [`CLOSE_WITHIN`]) and, on S3 unless told
    /// to keep them, deletes the objects this store wrote. The number deleted, or why not.
    pub(super) fn finish(self) -> Result<usize, String> {
        self.layer.close(CLOSE_WITHIN);
        if self.setup.keep || self.setup.objects.simulated() {
            return Ok(0);
        }
        let objects = Arc::clone(self.layer.cold().objects());
        let folder = format!("{}/", self.setup.prefix);
        drop(self);
        let names = objects
            .list(&folder)
            .map_err(|e| format!("list the bench's objects under {folder}: {e}"))?;
        for (name, _) in &names {
            objects.delete(name).map_err(|e| format!("delete {name}: {e}"))?;
        }
        Ok(names.len())
    }
}

impl StoreLayer for Timed {
    type Inner = ColdTiered;

    fn inner(&self) -> &ColdTiered {
        &self.layer
    }
}

impl Store for Timed {
    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let start = Instant::now();
        let got = Store::get_into(&self.layer, caller, key, dst);
        self.note(start.elapsed());
        got
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        Store::put(&self.layer, caller, key, src, request)
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        Store::lookup(&self.layer, caller, key)
    }

    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        Store::lookup_batch(&self.layer, caller, keys)
    }

    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        Store::locate(&self.layer, caller, keys)
    }

    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        Store::get_one(&self.layer, caller, key, capacity, to)
    }
    gpucache_dataplane::forward_store!(
        fences, reports, info, reserve, write, commit, abort, invalidate, scope_keys
    );
}

#[cfg(test)]
mod tests {
    use gpucache_dataplane::caller::Rights;
    use gpucache_dataplane::identity::TenantId;
    use gpucache_storage::evict::PolicyKind;
    use gpucache_storage::file::Durability;

    use super::super::{Trace, limits_for, replay};
    use super::*;

    #[test]
    fn every_value_lies_in_its_bucket_and_percentiles_are_close() {
        let mut v = 0u64;
        while v < u64::MAX / 3 {
            let (low, high) = bucket_bounds(bucket_of(v));
            assert!(low <= v && v <= high, "{v} not in [{low}, {high}]");
            v = v * 3 / 2 + 1;
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        let mut h = Histogram::default();
        assert_eq!(h.percentile_ns(50.0), None);
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let close = |got: Option<u64>, want: f64| {
            #[allow(clippy::cast_precision_loss)]
            let got = got.unwrap_or(0) as f64;
            assert!((got - want).abs() <= want * 0.035, "{got} against {want}");
        };
        close(h.percentile_ns(50.0), 500_000.0);
        close(h.percentile_ns(99.0), 990_000.0);
        assert_eq!(h.percentile_ns(100.0), Some(1_000_000), "never above the largest");
        let s = h.summary();
        assert_eq!(s.samples, 1000);
        assert!(s.mean_us.is_some_and(|m| (m - 500.5).abs() < 1e-9), "{s:?}");
    }

    #[test]
    fn blocks_the_file_tier_evicted_come_back_from_the_cold_tier_byte_for_byte() {
        const BLOCK: u64 = 256;
        let caller = Caller::new(
            TenantId::parse(super::super::replay::TENANT).unwrap_or_else(|e| panic!("{e}")),
            Rights::READ_WRITE,
        );
        let first = Trace::from_ids("cold", [vec![1], vec![2], vec![3], vec![4]]);
        let again = Trace::from_ids("cold", [vec![1], vec![2]]);
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut file = FileStoreConfig::new(dir.path());
        file.durability = Durability::None;
        file.limits = limits_for(BLOCK, 2, first.unique_blocks());
        file.policy = PolicyKind::Fifo;
        let setup = ColdSetup {
            objects: ColdObjectsArg::Memory { bytes_max: 1 << 20 },
            prefix: "t/cold".into(),
            // No drain thread: the test drains by hand, so what is stored is known.
            drain_interval_ms: 0,
            keep: false,
        };
        let store = open(file, MemoryTier::new(BLOCK, PolicyKind::Fifo), &setup)
            .unwrap_or_else(|e| panic!("{e}"));
        let r = replay(&[&store], &caller, &first, "t", 256, &mut |_| {}).remove(0);
        assert_eq!((r.hits, r.puts_committed), (0, 4), "{r:?}");
        // Room for two blocks: 1 and 2 went down to the sink.
        store.layer.sink().drain(store.layer.cold()).unwrap_or_else(|e| panic!("{e}"));
        let r = replay(&[&store], &caller, &again, "t", 256, &mut |_| {}).remove(0);
        assert_eq!(r.hits, 2, "{r:?}");
        assert!(r.clean(), "{r:?}");
        assert_eq!(r.verified_get_bytes, 2 * BLOCK);
        let c = store.cold_hits(r.refs);
        assert!(c.simulated);
        assert_eq!((c.cold_hits, c.refill.samples, c.refilled_up), (2, 2, 2), "{c:?}");
        assert!((c.cold_ratio - 1.0).abs() < 1e-12, "{c:?}");
        assert_eq!(c.miss_get.samples, 4, "the first replay's four misses");
        assert_eq!(c.memory_get.samples + c.file_get.samples, 0, "{c:?}");
        assert_eq!(c.refill_misses.faults(), 0, "{c:?}");
        assert!(c.demoted >= 2 && c.packs_stored == 1, "{c:?}");
        let upper = store.upper_counts().since(&super::super::tiers::TierCounts::default(), 2);
        assert_eq!((upper.memory_hits, upper.file_hits), (0, 0));
        assert_eq!(store.finish(), Ok(0), "a simulation has nothing to delete");
    }
}
