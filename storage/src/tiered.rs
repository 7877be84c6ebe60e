//! A DRAM tier over the FileStore: one store whose hot blocks are served from memory.
//!
//! The file tier is the store of record. Every answer that the contract defines (admission,
//! reservations, request ids, epochs, quarantine, usage, evictions) comes from it, so the
//! tiered store passes the conformance suite exactly as a FileStore does, and a restart reloads
//! what the file tier held. A PUT is written through: the file tier commits it (durably, as
//! `durability` says) before the memory tier takes a copy, so an acknowledged block is never
//! only in memory.
//!
//! The memory tier is a [`MemoryStore`] that evicts by its own policy within its own capacity.
//! A GET tries it first and falls back to the file tier; a block found only in the file tier
//! is promoted (copied up) when `promote` is on. Evicting a block from memory drops a copy:
//! the file tier still holds it, so nothing needs writing down. A block the file tier gives up
//! (evicted or invalidated) leaves the memory tier too, under the same lock stripe as any copy
//! up, so memory never serves a block the file tier no longer has for longer than the call
//! that removed it.
//!
//! Integrity is each tier's own: a copy in memory is checked against its checksum on every
//! read like any MemoryStore block, and a damaged copy is dropped and the file tier asked.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{LimitsError, RequestId, ResourceLimits};
use gpucache_dataplane::registry::LocalEpochs;
use gpucache_dataplane::store::{
    BatchAnswers, BatchGet, BatchPut, Get, Implementation, Invalidate, LendTo, Lookup, Put,
    Reserve, Retirement, Store, StoreError, StoreInfo, StoreLayer,
};

use crate::evict::PolicyKind;
use crate::file::{FileStore, FileStoreConfig, FileStoreError};
use crate::memory::{MemoryOptions, MemoryStore};

/// Lock stripes that order copies up against removals of the same key.
const STRIPES: usize = 64;

/// Most file-tier evictions a watched store remembers for a test between two looks.
const TEST_LOG_MAX: usize = 4096;

/// The memory tier of a [`TieredStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryTier {
    /// Bytes of blocks the tier holds at most.
    pub capacity_bytes: u64,
    pub policy: PolicyKind,
    /// Copy a block up when a GET finds it only in the file tier.
    pub promote: bool,
}

/// Which tier served a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Memory,
    File,
}

/// One answer of [`TieredStore::get_batch_with_tiers`].
pub type TieredGet = (Result<Get, StoreError>, Option<Tier>);

/// Why a tiered store could not open.
#[derive(Debug, thiserror::Error)]
pub enum TieredError {
    #[error("file tier: {0}")]
    File(#[from] FileStoreError),
    #[error("memory tier: {0}")]
    Memory(#[from] LimitsError),
}

/// What each tier did, since the store opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// GET hits served by the memory tier.
    pub memory_hits: u64,
    /// GET hits served by the file tier.
    pub file_hits: u64,
    /// GETs neither tier could serve.
    pub misses: u64,
    /// Blocks copied up into memory after a file-tier hit.
    pub promotions: u64,
    /// Blocks copied into memory as they were written.
    pub written_up: u64,
    /// Copies dropped from memory because the file tier gave the block up.
    pub dropped_with_file: u64,
}

#[derive(Debug, Default)]
struct Counters {
    memory_hits: AtomicU64,
    file_hits: AtomicU64,
    misses: AtomicU64,
    promotions: AtomicU64,
    written_up: AtomicU64,
    dropped_with_file: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A memory tier over a file tier (see the module documentation).
#[derive(Debug)]
pub struct TieredStore {
    memory: MemoryStore,
    file: FileStore,
    promote: bool,
    stripes: Vec<Mutex<()>>,
    counters: Counters,
    /// File-tier evictions, kept for a test when it asks for them.
    test_log: Mutex<Option<VecDeque<PhysicalKey>>>,
}

/// The caller the store acts as for a block's own tenant when it moves the block between tiers.
fn owner(key: &PhysicalKey) -> Caller {
    Caller::new(key.tenant().clone(), Rights::READ_WRITE)
}

impl TieredStore {
    /// Opens the file tier as `file` says and puts an empty memory tier over it. The memory
    /// tier takes the file tier's per-request limits and `memory.capacity_bytes` of room.
    pub fn open(
        file: FileStoreConfig,
        memory: MemoryTier,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, TieredError> {
        let limits = memory_limits(&file.limits, memory.capacity_bytes);
        let options = MemoryOptions { eviction: Some(memory.policy), arena: None };
        let memory_store =
            MemoryStore::with_options(limits, Arc::clone(&clock), Box::new(LocalEpochs), options)?;
        let file_store = file.open(clock)?;
        file_store.take_evicted();
        Ok(Self {
            memory: memory_store,
            file: file_store,
            promote: memory.promote,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            counters: Counters::default(),
            test_log: Mutex::new(None),
        })
    }

    /// The file tier, the store of record.
    pub fn file(&self) -> &FileStore {
        &self.file
    }

    /// The memory tier.
    pub fn memory(&self) -> &MemoryStore {
        &self.memory
    }

    pub fn counters(&self) -> TierCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierCounters {
            memory_hits: get(&c.memory_hits),
            file_hits: get(&c.file_hits),
            misses: get(&c.misses),
            promotions: get(&c.promotions),
            written_up: get(&c.written_up),
            dropped_with_file: get(&c.dropped_with_file),
        }
    }

    fn stripe(&self, key: &PhysicalKey) -> MutexGuard<'_, ()> {
        let d = key.digest().0;
        let i = usize::from(d[0]) % self.stripes.len();
        // A poisoned stripe guards no data of its own: the lock only orders calls.
        self.stripes[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes out of memory every block the file tier gave up since the last call.
    fn follow_file_evictions(&self) {
        let evicted = self.file.take_evicted();
        if evicted.is_empty() {
            return;
        }
        for key in &evicted {
            let _order = self.stripe(key);
            if let Ok(Invalidate::Removed) = self.memory.invalidate(&owner(key), key) {
                bump(&self.counters.dropped_with_file);
            }
        }
        let mut log = self.test_log.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(log) = log.as_mut() {
            for key in evicted {
                if log.len() == TEST_LOG_MAX {
                    log.pop_front();
                }
                log.push_back(key);
            }
        }
    }

    /// Copies `bytes` of `key`, whose checksum is `checksum`, into memory while the file tier
    /// holds that very version of the block: a key written again after it left has another
    /// checksum, and an older copy must never shadow it.
    fn copy_up(&self, key: &PhysicalKey, bytes: &[u8], checksum: Checksum) -> bool {
        let _order = self.stripe(key);
        let caller = owner(key);
        if self.file.committed_checksum(key) != Some(checksum) {
            return false;
        }
        // Best effort: a memory tier that is full of blocks being read, or refuses the size,
        // leaves the block in the file tier only.
        matches!(self.memory.put(&caller, key, bytes, None), Ok(Put::Committed(_)))
    }

    fn write_up(&self, key: &PhysicalKey, bytes: &[u8], checksum: Checksum) {
        if self.copy_up(key, bytes, checksum) {
            bump(&self.counters.written_up);
        }
    }

    /// What the file tier answered for a GET the memory tier could not serve.
    fn note_file_answer(&self, key: &PhysicalKey, got: &Get, dst: &[u8]) {
        match got {
            Get::Hit { len, checksum } => {
                bump(&self.counters.file_hits);
                let len = usize::try_from(*len).unwrap_or(usize::MAX);
                if self.promote
                    && let Some(bytes) = dst.get(..len)
                    && self.copy_up(key, bytes, *checksum)
                {
                    bump(&self.counters.promotions);
                }
            }
            Get::Miss(_) => bump(&self.counters.misses),
        }
    }

    /// Whether `answer`, the memory tier's for `key`, is a hit on the version the file tier
    /// holds now. A copy the file tier no longer backs (it gave the block up and the copy has
    /// not been dropped yet, or the key was written again) is dropped here and never served.
    fn memory_hit_stands(&self, key: &PhysicalKey, answer: &Result<Get, StoreError>) -> bool {
        let Ok(Get::Hit { checksum, .. }) = answer else { return false };
        if self.file.committed_checksum(key) == Some(*checksum) {
            return true;
        }
        let _order = self.stripe(key);
        if let Ok(Invalidate::Removed) = self.memory.invalidate(&owner(key), key) {
            bump(&self.counters.dropped_with_file);
        }
        false
    }

    /// [`Store::get_into`], and which tier served a hit (memory first, then the file tier).
    pub fn get_with_tier(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<(Get, Option<Tier>), StoreError> {
        let answer = self.memory.get_into(caller, key, dst);
        if self.memory_hit_stands(key, &answer) {
            bump(&self.counters.memory_hits);
            return answer.map(|hit| (hit, Some(Tier::Memory)));
        }
        let got = self.file.get_into(caller, key, dst)?;
        self.note_file_answer(key, &got, dst);
        let tier = matches!(got, Get::Hit { .. }).then_some(Tier::File);
        Ok((got, tier))
    }

    /// [`Store::get_batch`], and which tier served each hit.
    pub fn get_batch_with_tiers(
        &self,
        caller: &Caller,
        items: &mut [BatchGet<'_>],
    ) -> Vec<TieredGet> {
        let first = self.memory.get_batch(caller, items);
        let mut answers: Vec<Option<TieredGet>> = Vec::with_capacity(items.len());
        let mut rest: Vec<usize> = Vec::new();
        for (i, (a, item)) in first.into_iter().zip(items.iter()).enumerate() {
            match a {
                hit if self.memory_hit_stands(item.key, &hit) => {
                    bump(&self.counters.memory_hits);
                    answers.push(Some((hit, Some(Tier::Memory))));
                }
                _ => {
                    answers.push(None);
                    rest.push(i);
                }
            }
        }
        if !rest.is_empty() {
            let mut lower: Vec<BatchGet<'_>> = Vec::with_capacity(rest.len());
            let mut left = rest.iter().peekable();
            for (i, item) in items.iter_mut().enumerate() {
                if left.peek() == Some(&&i) {
                    left.next();
                    lower.push(BatchGet { key: item.key, dst: &mut *item.dst });
                }
            }
            let got = self.file.get_batch(caller, &mut lower);
            for ((i, item), a) in rest.iter().zip(&lower).zip(got) {
                let tier = match &a {
                    Ok(g) => {
                        self.note_file_answer(item.key, g, item.dst);
                        matches!(g, Get::Hit { .. }).then_some(Tier::File)
                    }
                    Err(_) => None,
                };
                answers[*i] = Some((a, tier));
            }
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    let e = StoreError::Backend {
                        operation: "get",
                        detail: "the tiered store left this item of the batch unanswered".into(),
                        retirement: Retirement::Retired,
                    };
                    (Err(e), None)
                })
            })
            .collect()
    }

    /// The file-tier evictions since the last call, oldest first; the first call starts the
    /// record, so a test calls it once before it drives the store.
    pub fn take_evicted_for_test(&self) -> Vec<PhysicalKey> {
        let mut log = self.test_log.lock().unwrap_or_else(|p| p.into_inner());
        log.get_or_insert_default().drain(..).collect()
    }

    /// Damages the copy in each tier, for corruption tests.
    #[cfg(any(test, feature = "testing"))]
    pub fn corrupt_for_test(&self, key: &PhysicalKey, at: usize) -> bool {
        let in_memory = self.memory.corrupt_for_test(key, at);
        self.file.corrupt_for_test(key, at as u64) || in_memory
    }
}

/// The memory tier's limits: the file tier's, with `capacity` of room.
fn memory_limits(file: &ResourceLimits, capacity: u64) -> ResourceLimits {
    ResourceLimits {
        retained_bytes_max: capacity,
        tenant_retained_bytes_max: file.tenant_retained_bytes_max.min(capacity),
        object_bytes_max: file.object_bytes_max.min(capacity),
        tenant_inflight_bytes_max: file.tenant_inflight_bytes_max.min(capacity),
        // Memory holds copies of the file tier's blocks, so never more of them.
        registrations_max: file.registrations_max,
        ..file.clone()
    }
}

/// A layer over the file tier: every call not written here is the file tier's own (epochs,
/// lookups, reservations, fences, leases, usage).
impl StoreLayer for TieredStore {
    type Inner = FileStore;

    fn inner(&self) -> &FileStore {
        &self.file
    }

    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "tiered",
            implementation: Implementation::Real,
            failures_retire: true,
            full_policy: self.file.info().full_policy,
        }
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        self.get_with_tier(caller, key, dst).map(|(got, _)| got)
    }

    fn get_lent(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        send: &mut LendTo<'_>,
    ) -> Result<Option<Get>, StoreError> {
        // Only a memory hit is lent, and only of a block the file tier holds; anything else is
        // answered by `get_into`, which asks the file tier (a lent read that found its bytes
        // damaged sent nothing). The version is checked before the bytes go out: a key written
        // again between that check and the send is the one case served from the older copy.
        if self.file.committed_checksum(key).is_none() {
            return Ok(None);
        }
        match self.memory.get_lent(caller, key, capacity, send) {
            Ok(Some(hit @ Get::Hit { .. })) => {
                bump(&self.counters.memory_hits);
                Ok(Some(hit))
            }
            _ => Ok(None),
        }
    }

    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        self.get_batch_with_tiers(caller, items).into_iter().map(|(a, _)| a).collect()
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        let answer = self.file.reserve(caller, key, len, request);
        self.follow_file_evictions();
        answer
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        let answer = self.file.put(caller, key, src, request);
        self.follow_file_evictions();
        if let Ok(Put::Committed(checksum)) = answer {
            self.write_up(key, src, checksum);
        }
        answer
    }

    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        let answers = self.file.put_batch(caller, items);
        self.follow_file_evictions();
        self.write_up_committed(items, &answers);
        answers
    }

    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        let answers = self.file.put_batch_checked(caller, items, expected);
        self.follow_file_evictions();
        self.write_up_committed(items, &answers);
        answers
    }

    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.file.lookup_batch(caller, keys)
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let _order = self.stripe(key);
        let answer = self.file.invalidate(caller, key)?;
        // Whatever the file tier answered, memory keeps no copy the file tier does not hold.
        let _ = self.memory.invalidate(&owner(key), key);
        Ok(answer)
    }
}

impl TieredStore {
    fn write_up_committed(&self, items: &[BatchPut<'_>], answers: &BatchAnswers<Put>) {
        for (item, answer) in items.iter().zip(answers) {
            if let Ok(Put::Committed(checksum)) = answer {
                self.write_up(item.key, item.src, *checksum);
            }
        }
    }
}
