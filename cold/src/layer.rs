//! [`ColdTiered`]: the cold tier as the bottom tier of a [`TieredStore`].
//!
//! The tiered store (memory over file) keeps the books as before; this layer adds a tier
//! below it:
//!
//! - **Down.** The file tier hands every block it evicts to this layer, file and all; after
//!   each call that may have evicted, the layer reads each such block (checked against its
//!   checksum), offers it to the sink and lets the file go. A drain thread stores the sink's
//!   jobs every `drain_interval_ms`, and reclaims expired packs every `reclaim_interval_s`.
//!   A block the sink refuses (full, retired tenant) is dropped: a clean miss later.
//! - **Up.** A GET the upper tiers miss as absent asks the cold tier, within the refill
//!   budget, for the caller's own key (the service authenticated the caller; the tier checks
//!   the key is the caller's before any download). A hit is copied to the caller and admitted
//!   to the upper tiers (best effort); every other answer stays a miss, and a failing object
//!   store changes nothing in the upper tiers.
//! - **Lookups** say hit for a block only the cold tier's index holds (no object store call),
//!   and LOCATE names its tier `cold`: engines ask before they read. The GET may still miss.
//! - **Invalidation** reaches all three: the upper tiers, the sink's open pack, and the cold
//!   tier, which records it in the bucket so a restart does not bring the block back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{
    BatchAnswers, BatchGet, BatchPut, Committed, Delivery, Get, GetTo, GotOne, Implementation,
    Invalidate, Located, Lookup, MissReason, Put, Reservation, Reserve, Store, StoreError,
    StoreInfo, StoreLayer, Tier,
};
use gpucache_storage::tiered::TieredStore;

use crate::sink::ColdSink;
use crate::tier::{ColdTier, RefillBudget, Refilled};

pub const DRAIN_INTERVAL_MS_DEFAULT: u64 = 200;
pub const RECLAIM_INTERVAL_S_DEFAULT: u64 = 600;
/// How long dropping the layer gives the sink to store what it holds (the service closes it
/// first, with its own bound).
pub const DROP_CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// How the layer runs its cold tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColdLayerConfig {
    pub refill: RefillBudget,
    /// Pause between drain rounds; zero runs no drain thread (a test drains by hand).
    pub drain_interval_ms: u64,
    /// Pause between reclaims; zero reclaims only by hand.
    pub reclaim_interval_s: u64,
}

impl Default for ColdLayerConfig {
    fn default() -> Self {
        Self {
            refill: RefillBudget::default(),
            drain_interval_ms: DRAIN_INTERVAL_MS_DEFAULT,
            reclaim_interval_s: RECLAIM_INTERVAL_S_DEFAULT,
        }
    }
}

/// What the layer moved between the tiers, since it opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ColdLayerCounters {
    /// File-tier evictions the sink took.
    pub demoted: u64,
    /// File-tier evictions the cold tier held already (a block refilled and evicted again):
    /// not stored twice.
    pub demote_already_cold: u64,
    /// File-tier evictions the sink refused (full, retired tenant): dropped.
    pub demote_refused: u64,
    /// File-tier evictions whose file could not be read back or no longer matched: dropped.
    pub demote_unreadable: u64,
    /// GET hits served from the cold tier.
    pub cold_hits: u64,
    /// Cold hits copied into the upper tiers.
    pub refilled_up: u64,
}

#[derive(Debug, Default)]
struct Counters {
    demoted: AtomicU64,
    demote_already_cold: AtomicU64,
    demote_refused: AtomicU64,
    demote_unreadable: AtomicU64,
    cold_hits: AtomicU64,
    refilled_up: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Drainer {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

/// The tiered store with the cold tier below (see the module documentation).
pub struct ColdTiered {
    upper: Arc<TieredStore>,
    cold: Arc<ColdTier>,
    sink: Arc<ColdSink>,
    config: ColdLayerConfig,
    counters: Counters,
    drainer: Mutex<Option<Drainer>>,
}

impl std::fmt::Debug for ColdTiered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColdTiered").field("cold", &self.cold).finish_non_exhaustive()
    }
}

/// The caller the layer acts as for a block's own tenant when it moves the block up.
fn owner(key: &PhysicalKey) -> Caller {
    Caller::new(key.tenant().clone(), Rights::READ_WRITE)
}

impl ColdTiered {
    /// Puts `cold` below `upper`, whose file tier hands its evictions down from now on, and
    /// starts the drain thread when the configuration asks for one.
    pub fn new(
        upper: Arc<TieredStore>,
        cold: Arc<ColdTier>,
        sink: Arc<ColdSink>,
        config: ColdLayerConfig,
    ) -> std::io::Result<Self> {
        upper.hand_down_file_evictions();
        let layer = Self {
            upper,
            cold,
            sink,
            config,
            counters: Counters::default(),
            drainer: Mutex::new(None),
        };
        if config.drain_interval_ms > 0 {
            let (stop, stopped) = mpsc::channel();
            let (sink, cold) = (Arc::clone(&layer.sink), Arc::clone(&layer.cold));
            let interval = Duration::from_millis(config.drain_interval_ms);
            let reclaim = Duration::from_secs(config.reclaim_interval_s);
            let thread = std::thread::Builder::new()
                .name("gpucache-cold-sink".into())
                .spawn(move || drain_loop(&sink, &cold, &stopped, interval, reclaim))?;
            *layer.drainer.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(Drainer { stop, thread });
        }
        Ok(layer)
    }

    pub fn upper(&self) -> &Arc<TieredStore> {
        &self.upper
    }
    pub fn cold(&self) -> &Arc<ColdTier> {
        &self.cold
    }
    pub fn sink(&self) -> &Arc<ColdSink> {
        &self.sink
    }

    pub fn counters(&self) -> ColdLayerCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ColdLayerCounters {
            demoted: get(&c.demoted),
            demote_already_cold: get(&c.demote_already_cold),
            demote_refused: get(&c.demote_refused),
            demote_unreadable: get(&c.demote_unreadable),
            cold_hits: get(&c.cold_hits),
            refilled_up: get(&c.refilled_up),
        }
    }

    /// Offers the sink every block the file tier evicted since the last call.
    fn demote(&self) {
        for evicted in self.upper.take_file_evictions() {
            // A key's bytes do not change while it is stored (an invalidation makes the cold
            // tier forget it first), so a block the cold tier holds needs no second copy.
            if self.cold.contains(&evicted.key) {
                bump(&self.counters.demote_already_cold);
                continue;
            }
            match evicted.read() {
                Ok(bytes) => {
                    match self.sink.offer(&self.cold, &evicted.key, &bytes, evicted.checksum) {
                        Ok(()) => bump(&self.counters.demoted),
                        Err(e) => {
                            bump(&self.counters.demote_refused);
                            tracing::debug!(error = %e, "cold sink refused an evicted block");
                        }
                    }
                }
                Err(e) => {
                    bump(&self.counters.demote_unreadable);
                    tracing::warn!(error = %e, "an evicted block could not be read for the cold tier");
                }
            }
        }
    }

    /// The cold tier's answer for `keys`, which the upper tiers missed as absent: each hit
    /// copied into its buffer (or a refusal when it does not fit) and moved up.
    fn refill_into(
        &self,
        caller: &Caller,
        items: &mut [(&PhysicalKey, &mut [u8])],
    ) -> Vec<Option<Result<Get, StoreError>>> {
        let keys: Vec<&PhysicalKey> = items.iter().map(|(k, _)| *k).collect();
        let answers = self.cold.refill(caller, &keys, self.config.refill);
        let mut out = Vec::with_capacity(items.len());
        for ((key, dst), answer) in items.iter_mut().zip(answers) {
            let Ok(Refilled::Hit { bytes, checksum }) = answer else {
                out.push(None);
                continue;
            };
            let Some(slot) = dst.get_mut(..bytes.len()) else {
                out.push(Some(Err(StoreError::BufferTooSmall {
                    needed: bytes.len() as u64,
                    provided: dst.len() as u64,
                })));
                continue;
            };
            slot.copy_from_slice(&bytes);
            bump(&self.counters.cold_hits);
            if matches!(self.upper.put(&owner(key), key, &bytes, None), Ok(Put::Committed(_))) {
                bump(&self.counters.refilled_up);
            }
            out.push(Some(Ok(Get::Hit { len: bytes.len() as u64, checksum })));
        }
        self.demote();
        out
    }

    /// Whether a lookup's miss may be the cold tier's hit: only an absent block, and only one
    /// the index holds for the caller's own, unretired tenant.
    fn cold_holds(&self, caller: &Caller, key: &PhysicalKey) -> bool {
        key.tenant() == &caller.tenant
            && caller.rights.read
            && !self.cold.is_retired(key.tenant())
            && self.cold.contains(key)
    }

    /// Stops the drain thread and drains the sink until it is empty, a round stores nothing,
    /// or `within` has passed (no job is started after that; one under way finishes within
    /// the object store's request timeout).
    pub fn close(&self, within: Duration) {
        let drainer = self.drainer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(d) = drainer {
            let _ = d.stop.send(());
            let _ = d.thread.join();
        }
        self.demote();
        self.sink.seal_open(&self.cold);
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let report = self.sink.drain_round_until(&self.cold, Some(deadline));
            if report.pending == 0 || report.stored == 0 {
                break;
            }
        }
    }
}

fn drain_loop(
    sink: &ColdSink,
    cold: &ColdTier,
    stopped: &mpsc::Receiver<()>,
    interval: Duration,
    reclaim: Duration,
) {
    let mut reclaimed = Instant::now();
    loop {
        match stopped.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let report = sink.drain_round(cold);
        if let Some((job, e)) = &report.first_error {
            tracing::warn!(job, error = %e, stored = report.stored, retried = report.retried, failed = report.failed, "cold sink drain round met a failure");
        }
        if !reclaim.is_zero() && reclaimed.elapsed() >= reclaim {
            reclaimed = Instant::now();
            let r = cold.reclaim();
            if r.manifests > 0 || !r.failed.is_empty() {
                tracing::info!(
                    manifests = r.manifests,
                    packs = r.packs,
                    failed = r.failed.len(),
                    "cold tier reclaimed expired packs"
                );
            }
        }
    }
}

impl Drop for ColdTiered {
    fn drop(&mut self) {
        self.close(DROP_CLOSE_WITHIN);
    }
}

impl StoreLayer for ColdTiered {
    type Inner = TieredStore;

    fn inner(&self) -> &TieredStore {
        &self.upper
    }
}

impl Store for ColdTiered {
    fn info(&self) -> StoreInfo {
        StoreInfo { name: "tiered+cold", implementation: Implementation::Real, ..self.upper.info() }
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let got = self.upper.get_into(caller, key, dst)?;
        if got != Get::Miss(MissReason::Absent) {
            return Ok(got);
        }
        let mut items = [(key, dst)];
        match self.refill_into(caller, &mut items).pop().flatten() {
            Some(answer) => answer,
            None => Ok(got),
        }
    }

    /// The tiers above lend or copy; a block none of them holds is refilled from the cold tier
    /// into the caller's buffer.
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        let got = self.upper.get_one(caller, key, capacity, to)?;
        if got.get != Get::Miss(MissReason::Absent) {
            return Ok(got);
        }
        let mut items = [(key, to.buffer())];
        match self.refill_into(caller, &mut items).pop().flatten() {
            Some(answer) => answer.map(|get| GotOne {
                get,
                delivery: Delivery::Copied,
                tier: matches!(get, Get::Hit { .. }).then_some(Tier::Cold),
            }),
            None => Ok(got),
        }
    }

    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let mut answers = self.upper.get_batch(caller, items);
        let absent: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| matches!(a, Ok(Get::Miss(MissReason::Absent))))
            .map(|(i, _)| i)
            .collect();
        if absent.is_empty() {
            return answers;
        }
        let mut wanted: Vec<(&PhysicalKey, &mut [u8])> = Vec::with_capacity(absent.len());
        let mut next = absent.iter().peekable();
        for (i, item) in items.iter_mut().enumerate() {
            if next.peek() == Some(&&i) {
                next.next();
                wanted.push((item.key, &mut *item.dst));
            }
        }
        for (i, refilled) in absent.into_iter().zip(self.refill_into(caller, &mut wanted)) {
            if let Some(answer) = refilled {
                answers[i] = answer;
            }
        }
        answers
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        let answer = self.upper.reserve(caller, key, len, request);
        self.demote();
        answer
    }

    fn commit(&self, caller: &Caller, r: &Reservation) -> Result<Committed, StoreError> {
        let answer = self.upper.commit(caller, r);
        self.demote();
        answer
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        let answer = self.upper.put(caller, key, src, request);
        self.demote();
        answer
    }

    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        let answers = self.upper.put_batch(caller, items);
        self.demote();
        answers
    }

    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        let answers = self.upper.put_batch_checked(caller, items, expected);
        self.demote();
        answers
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        let mut answers = Store::lookup_batch(self, caller, &[key]);
        answers.pop().unwrap_or(Ok(Lookup::Miss(MissReason::Absent)))
    }

    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        Store::locate(self, caller, keys)
            .into_iter()
            .map(|a| a.map(|located| located.lookup))
            .collect()
    }

    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        let answers = self.upper.locate(caller, keys);
        answers
            .into_iter()
            .zip(keys)
            .map(|(answer, key)| match answer {
                Ok(Located { lookup: Lookup::Miss(MissReason::Absent), .. })
                    if self.cold_holds(caller, key) =>
                {
                    match self.cold.len_of(key) {
                        Some(len) => {
                            Ok(Located { lookup: Lookup::Hit { len }, tier: Some(Tier::Cold) })
                        }
                        None => {
                            Ok(Located { lookup: Lookup::Miss(MissReason::Absent), tier: None })
                        }
                    }
                }
                other => other,
            })
            .collect()
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let answer = self.upper.invalidate(caller, key)?;
        let in_sink = self.sink.forget(key);
        let in_cold = self.cold.contains(key);
        if (in_sink || in_cold || self.sink.may_hold(key))
            && let Err(e) = self.cold.forget(key)
        {
            // The index forgot it; only a restart before the marker lands could bring the
            // block back (its bytes are still the key's own).
            tracing::warn!(error = %e, "the cold tier could not record an invalidation in the bucket");
        }
        // A block only the sink holds is invisible to lookups, so not one this call removed;
        // one the cold tier's index held was visible (as a lookup hit).
        if answer == Invalidate::Absent && in_cold {
            return Ok(Invalidate::Removed);
        }
        Ok(answer)
    }

    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        keys.iter().map(|key| Store::invalidate(self, caller, key)).collect()
    }
    gpucache_dataplane::forward_store!(fences, reports, write, abort, scope_keys);
}
