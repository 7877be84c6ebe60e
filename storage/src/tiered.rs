//! A DRAM tier over the FileStore: one store whose hot blocks are served from memory.
//!
//! The file tier keeps the books. Every answer the contract defines (admission, reservations,
//! request ids, epochs, quarantine, usage, evictions) comes from it, so the tiered store passes
//! the conformance suite exactly as a FileStore does, and a restart reloads what the file tier
//! wrote. How a PUT reaches the file tier is the [`WriteMode`]:
//!
//! - **Through** (the default): the file tier commits the block (durably, as `durability` says)
//!   before the memory tier takes a copy, so an acknowledged block is never only in memory.
//!   Evicting a block from memory drops a copy the file tier still holds.
//! - **Back**: the file tier admits and records the block without writing it
//!   ([`FileStore::commit_deferred`]), the memory tier takes the bytes, and the PUT is
//!   acknowledged. The block's file is written when the memory tier evicts it (a demotion:
//!   the evicted bytes go down instead of being dropped), when it has waited
//!   [`WriteBackWindow::dirty_age_max_ms`] (the flusher thread writes it), or when the store
//!   flushes (on drop). A block the memory tier cannot take, or one that would take the bytes
//!   waiting past [`WriteBackWindow::dirty_bytes_max`], is written at once. A crash loses the
//!   blocks not written yet (clean misses after the restart, never torn ones: a block file is
//!   written under a temporary name and renamed whole); the file tier's write-back journal
//!   lets the next open count them ([`TierCounters::write_back_lost`]).
//!
//! The memory tier is a [`MemoryStore`] that evicts by its own policy within its own capacity,
//! carving blocks out of one mapping advised for transparent huge pages. A GET tries it first
//! and falls back to the file tier; a block found only in the file tier is promoted (copied up)
//! when `promote` is on. A block the file tier gives up (evicted or invalidated) leaves the
//! memory tier too, under the same lock stripe as any copy up, so memory never serves a block
//! the file tier no longer has for longer than the call that removed it.
//!
//! Integrity is each tier's own: a copy in memory is checked against its checksum on every
//! read like any MemoryStore block, and a damaged copy is dropped and the file tier asked (a
//! block not written yet is then gone, and counted among the store's corrupt drops).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use gpucache_dataplane::BlockState;
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{LimitsError, RequestId, ResourceLimits};
use gpucache_dataplane::registry::LocalEpochs;
/// Which tier served a hit, or holds a block.
pub use gpucache_dataplane::store::Tier;
use gpucache_dataplane::store::{
    BatchAnswers, BatchGet, BatchPut, CorruptPhase, CorruptReason, Delivery, Get, GetTo, GotOne,
    Implementation, Invalidate, Located, Lookup, MissReason, PurgeScope, Put, Reserve, Retirement,
    Store, StoreError, StoreInfo, StoreLayer, put_damaged,
};

use crate::evict::PolicyKind;
use crate::file::{FileStore, FileStoreConfig, FileStoreError};
use crate::host::arena::PayloadArena;
use crate::memory::{MemoryOptions, MemoryStore};

/// Lock stripes that order copies up against removals of the same key.
const STRIPES: usize = 64;

/// Most file-tier evictions a watched store remembers for a test between two looks.
const TEST_LOG_MAX: usize = 4096;

/// Default for [`WriteBackWindow::dirty_bytes_max`].
pub const WRITE_BACK_DIRTY_BYTES_DEFAULT: u64 = 256 << 20;
/// Default for [`WriteBackWindow::dirty_age_max_ms`].
pub const WRITE_BACK_DIRTY_AGE_DEFAULT_MS: u64 = 5_000;
/// Acknowledged blocks the write-back queue keeps in order at most; a PUT past it is written
/// at once.
pub const WRITE_BACK_QUEUE_MAX: usize = 1 << 20;
/// Longest pause of the write-back flusher between two looks at the oldest waiting block.
const FLUSH_TICK_MAX_MS: u64 = 1_000;

/// What write-back may hold acknowledged and not yet on disk: what a crash can lose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteBackWindow {
    /// Payload bytes of acknowledged blocks without a file, at most. A PUT that would pass it
    /// is written at once, as under write-through (concurrent PUTs may each pass the check, so
    /// the bound can be passed by at most one block per PUT in flight).
    pub dirty_bytes_max: u64,
    /// How long an acknowledged block waits for its file at most, give or take a flusher tick
    /// (a quarter of it, at most a second) and the time to write the blocks before it.
    pub dirty_age_max_ms: u64,
}

impl Default for WriteBackWindow {
    fn default() -> Self {
        Self {
            dirty_bytes_max: WRITE_BACK_DIRTY_BYTES_DEFAULT,
            dirty_age_max_ms: WRITE_BACK_DIRTY_AGE_DEFAULT_MS,
        }
    }
}

/// How a PUT reaches the file tier (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WriteMode {
    /// Written to the file tier before the PUT is acknowledged.
    #[default]
    Through,
    /// Written to the file tier when the memory tier evicts the block, or at a flush.
    Back,
}

impl WriteMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Through => "through",
            Self::Back => "back",
        }
    }
}

impl std::fmt::Display for WriteMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A write mode name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown write mode {0:?}: expected \"through\" or \"back\"")]
pub struct UnknownWriteMode(pub String);

impl std::str::FromStr for WriteMode {
    type Err = UnknownWriteMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "through" => Ok(Self::Through),
            "back" => Ok(Self::Back),
            other => Err(UnknownWriteMode(other.to_owned())),
        }
    }
}

/// How the memory tier's blocks are backed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TierMemory {
    /// One mapping of the tier's capacity, advised for transparent huge pages, whose pages
    /// fault in as blocks first land on them (blocks of a size it has no piece for go to the
    /// heap).
    #[default]
    Mapped,
    /// A huge-page pool of the tier's capacity: reserved 1 GiB or 2 MiB hugetlb pages where
    /// the machine has them, else transparent huge pages, else plain pages, every page made
    /// resident when the store opens (no fault on the write path; the whole capacity is held
    /// from the start).
    HugePages,
    /// The heap only.
    Heap,
}

/// The memory tier of a [`TieredStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryTier {
    /// Bytes of blocks the tier holds at most.
    pub capacity_bytes: u64,
    pub policy: PolicyKind,
    /// Copy a block up when a GET finds it only in the file tier.
    pub promote: bool,
    pub write: WriteMode,
    /// What write-back may hold unwritten (unused under write-through).
    pub window: WriteBackWindow,
    pub backing: TierMemory,
}

impl MemoryTier {
    /// A write-through tier of `capacity_bytes` on a mapping, promoting file-tier hits.
    pub fn new(capacity_bytes: u64, policy: PolicyKind) -> Self {
        Self {
            capacity_bytes,
            policy,
            promote: true,
            write: WriteMode::Through,
            window: WriteBackWindow::default(),
            backing: TierMemory::Mapped,
        }
    }
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
    #[error("memory tier: mapping {bytes} bytes: {source}")]
    Map { bytes: u64, source: std::io::Error },
    #[error("memory tier: a huge-page pool of {bytes} bytes: {source}")]
    HugePages { bytes: u64, source: crate::host::pool::PoolMemoryError },
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
    /// Blocks the memory tier's policy gave up that the file tier keeps (written down then,
    /// under write-back, or already there).
    pub demotions: u64,
    /// Blocks whose file was written after their PUT was acknowledged (write-back: at a
    /// demotion, a flush, or when memory could not take them).
    pub written_back: u64,
    /// Acknowledged blocks lost before they were written (write-back: the write failed, the
    /// memory copy was found damaged or let go, or, counted at the open, the process stopped
    /// before their files were written).
    pub write_back_lost: u64,
    /// Acknowledged blocks without a file now (write-back), and their payload bytes.
    pub dirty_blocks: u64,
    pub dirty_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    memory_hits: AtomicU64,
    file_hits: AtomicU64,
    misses: AtomicU64,
    promotions: AtomicU64,
    written_up: AtomicU64,
    dropped_with_file: AtomicU64,
    written_back: AtomicU64,
    write_back_lost: AtomicU64,
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
    write: WriteMode,
    window: WriteBackWindow,
    /// Write-back: blocks acknowledged without a file, oldest first (some since written by a
    /// demotion, or gone; the flusher passes over those).
    dirty: Mutex<VecDeque<Dirty>>,
    clock: Arc<dyn Clock>,
    stripes: Vec<Mutex<()>>,
    counters: Counters,
    /// File-tier evictions, kept for a test when it asks for them.
    test_log: Mutex<Option<VecDeque<PhysicalKey>>>,
}

/// A block acknowledged under write-back, when, and which version.
#[derive(Debug)]
struct Dirty {
    at_ms: u64,
    key: PhysicalKey,
    checksum: Checksum,
    len: usize,
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
        let bytes = memory.capacity_bytes;
        let arena = match memory.backing {
            TierMemory::Heap => None,
            TierMemory::Mapped => Some(
                PayloadArena::on_first_use(bytes)
                    .map_err(|source| TieredError::Map { bytes, source })?,
            ),
            TierMemory::HugePages => Some(
                PayloadArena::on_huge_pages(bytes)
                    .map_err(|source| TieredError::HugePages { bytes, source })?,
            ),
        };
        if let Some(tier) = arena.as_ref().and_then(|a| a.page_tier()) {
            tracing::info!(bytes, pages = %tier, "memory tier on a huge-page pool");
        }
        let options = MemoryOptions {
            eviction: Some(memory.policy),
            arena,
            hand_down: memory.write == WriteMode::Back,
        };
        let memory_store =
            MemoryStore::with_options(limits, Arc::clone(&clock), Box::new(LocalEpochs), options)?;
        let file_store = file.open(Arc::clone(&clock))?;
        file_store.take_evicted();
        Ok(Self {
            memory: memory_store,
            file: file_store,
            promote: memory.promote,
            write: memory.write,
            window: memory.window,
            dirty: Mutex::new(VecDeque::new()),
            clock,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            counters: Counters::default(),
            test_log: Mutex::new(None),
        })
    }

    /// Keeps every block the file tier evicts from now on, file and all, for the tier below
    /// ([`Self::take_file_evictions`]).
    pub fn hand_down_file_evictions(&self) {
        self.file.hand_down_evictions();
    }

    /// The blocks the file tier evicted since the last call, for the tier below, when it was
    /// told to hand them down.
    pub fn take_file_evictions(&self) -> Vec<crate::file::handdown::EvictedFile> {
        self.file.take_handed_down()
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
        let (dirty_blocks, dirty_bytes) = self.file.deferred_totals();
        TierCounters {
            memory_hits: get(&c.memory_hits),
            file_hits: get(&c.file_hits),
            misses: get(&c.misses),
            promotions: get(&c.promotions),
            written_up: get(&c.written_up),
            dropped_with_file: get(&c.dropped_with_file),
            demotions: self.memory.stats().evictions,
            written_back: get(&c.written_back),
            // Evicted blocks whose bytes the memory tier let go before they were collected
            // (more than 4,096 waiting) were lost too, and so were those the open found.
            write_back_lost: get(&c.write_back_lost)
                + self.memory.handed_down_dropped()
                + self.file.open_report().write_back_lost.blocks,
            dirty_blocks,
            dirty_bytes,
        }
    }

    /// Write-back's bounds.
    pub fn write_back_window(&self) -> WriteBackWindow {
        self.window
    }

    /// Write-back: starts the thread that writes the files of blocks acknowledged more than
    /// [`WriteBackWindow::dirty_age_max_ms`] ago ([`Self::flush_aged`]), every quarter of that
    /// age (at most every second). It holds the store weakly and ends once the store is
    /// dropped. Nothing to start under write-through.
    pub fn start_flusher(self: &Arc<Self>) -> std::io::Result<()> {
        if self.write != WriteMode::Back {
            return Ok(());
        }
        let store = Arc::downgrade(self);
        let tick = std::time::Duration::from_millis(
            (self.window.dirty_age_max_ms / 4).clamp(1, FLUSH_TICK_MAX_MS),
        );
        std::thread::Builder::new().name("gpucache-write-back".into()).spawn(move || {
            loop {
                std::thread::park_timeout(tick);
                let Some(store) = store.upgrade() else { return };
                store.flush_aged();
            }
        })?;
        Ok(())
    }

    /// Write-back: writes the file of every block acknowledged at least
    /// [`WriteBackWindow::dirty_age_max_ms`] ago (by the store's clock) that still waits for
    /// one; returns how many were written.
    pub fn flush_aged(&self) -> usize {
        if self.write != WriteMode::Back {
            return 0;
        }
        self.demote_evicted();
        let now = self.clock.now_ms();
        let age = self.window.dirty_age_max_ms;
        let mut buf = Vec::new();
        let mut written = 0;
        loop {
            let next = {
                let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
                match dirty.front() {
                    Some(d) if now.saturating_sub(d.at_ms) >= age => dirty.pop_front(),
                    _ => None,
                }
            };
            let Some(d) = next else { break };
            if self.file.is_deferred(&d.key)
                && self.write_from_memory(&d.key, d.checksum, d.len, &mut buf)
            {
                written += 1;
            }
        }
        written
    }

    /// Write-back: writes the file of `key`'s block (`checksum`, `len` bytes) from its copy
    /// in memory; whether it was written. A block memory no longer holds, or that no longer
    /// waits, is left as it is.
    fn write_from_memory(
        &self,
        key: &PhysicalKey,
        checksum: Checksum,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> bool {
        let _order = self.stripe(key);
        buf.resize(len, 0);
        let held = self.memory.get_into(&owner(key), key, buf);
        if !matches!(held, Ok(Get::Hit { checksum: c, .. }) if c == checksum) {
            return false;
        }
        match self.file.write_deferred(key, checksum, buf) {
            Ok(true) => {
                bump(&self.counters.written_back);
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!(error = %e, "write-back of a block failed; it stays in memory");
                false
            }
        }
    }

    pub fn write_mode(&self) -> WriteMode {
        self.write
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
    /// checksum, and an older copy must never shadow it. The bytes were hashed in the pass that
    /// wrote or read them in the file tier, so memory takes them as verified, without hashing
    /// them again.
    fn copy_up(&self, key: &PhysicalKey, bytes: &[u8], checksum: Checksum) -> bool {
        let _order = self.stripe(key);
        let caller = owner(key);
        if self.file.committed_checksum(key) != Some(checksum) {
            return false;
        }
        // Best effort: a memory tier that is full of blocks being read, or refuses the size,
        // leaves the block in the file tier only.
        matches!(self.memory.put_verified(&caller, key, bytes, checksum), Ok(Put::Committed(_)))
    }

    fn write_up(&self, key: &PhysicalKey, bytes: &[u8], checksum: Checksum) {
        if self.copy_up(key, bytes, checksum) {
            bump(&self.counters.written_up);
        }
        self.demote_evicted();
    }

    /// Write-back: writes down every block the memory tier evicted since the last call, whose
    /// file the file tier still waits for. Called after each call that may have made the
    /// memory tier evict, holding no stripe (it takes each block's own).
    fn demote_evicted(&self) {
        if self.write != WriteMode::Back {
            return;
        }
        for block in self.memory.take_handed_down() {
            let _order = self.stripe(&block.key);
            match self.file.write_deferred(&block.key, block.checksum, block.bytes()) {
                Ok(true) => bump(&self.counters.written_back),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "write-back of an evicted block failed; the block is dropped");
                    if self.file.forget_deferred(&block.key, block.checksum, None) {
                        bump(&self.counters.write_back_lost);
                    }
                }
            }
        }
    }

    /// Write-back: a PUT whose block the file tier records and the memory tier holds (or the
    /// file tier writes at once, when memory cannot take it).
    fn put_back(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
        expected: Option<Checksum>,
    ) -> Result<Put, StoreError> {
        let waiting = self.file.deferred_totals().1;
        let queued = self.dirty.lock().unwrap_or_else(|p| p.into_inner()).len();
        if waiting.saturating_add(src.len() as u64) > self.window.dirty_bytes_max
            || queued >= WRITE_BACK_QUEUE_MAX
        {
            return self.put_through(caller, key, src, request, expected);
        }
        let answer = {
            let _order = self.stripe(key);
            match self.file.commit_deferred(caller, key, src, request, expected) {
                Ok(Put::Committed(checksum)) => self.hold(key, src, checksum).map(|deferred| {
                    if deferred {
                        let at_ms = self.clock.now_ms();
                        let d = Dirty { at_ms, key: key.clone(), checksum, len: src.len() };
                        self.dirty.lock().unwrap_or_else(|p| p.into_inner()).push_back(d);
                    }
                    Put::Committed(checksum)
                }),
                other => other,
            }
        };
        self.follow_file_evictions();
        self.demote_evicted();
        answer
    }

    /// Write-through of one PUT (and a write-back PUT over its window): the file tier commits
    /// the block, compared with `expected` when given, then memory takes a copy.
    fn put_through(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
        expected: Option<Checksum>,
    ) -> Result<Put, StoreError> {
        let answer = self.file.put_expecting(caller, key, src, request, expected);
        self.follow_file_evictions();
        if let Ok(Put::Committed(checksum)) = answer {
            self.write_up(key, src, checksum);
        }
        answer
    }

    /// Write-back, holding `key`'s stripe: memory takes the bytes of the block the file tier
    /// just recorded. Memory full of blocks being read, or holding an older version not dropped
    /// yet, leaves the block to be written now, as under write-through; a block whose write
    /// fails leaves the books, and the PUT fails with the write's error. Whether the block
    /// waits for its file (memory took it).
    fn hold(&self, key: &PhysicalKey, src: &[u8], checksum: Checksum) -> Result<bool, StoreError> {
        // The file tier hashed `src` as it recorded it: memory takes the bytes as verified.
        if matches!(
            self.memory.put_verified(&owner(key), key, src, checksum),
            Ok(Put::Committed(_))
        ) {
            bump(&self.counters.written_up);
            return Ok(true);
        }
        match self.file.write_deferred(key, checksum, src) {
            Ok(written) => {
                if written {
                    bump(&self.counters.written_back);
                }
                Ok(false)
            }
            Err(e) => {
                self.file.forget_deferred(key, checksum, None);
                Err(e)
            }
        }
    }

    /// Write-back: a memory copy found damaged was the only one of a block not written yet.
    /// The block leaves the file tier's books, counted as a corrupt drop.
    /// Whether it was (the answer is then a corrupt miss, as the file tier's own would be).
    fn lost_damaged(&self, key: &PhysicalKey) -> bool {
        if self.write != WriteMode::Back {
            return false;
        }
        let _order = self.stripe(key);
        // `forget_deferred` takes only a block still waiting for its file.
        let lost = self.file.committed_checksum(key).is_some_and(|checksum| {
            self.memory.committed_checksum(key).is_none()
                && self.file.forget_deferred(
                    key,
                    checksum,
                    Some((CorruptPhase::Get, CorruptReason::Checksum)),
                )
        });
        if lost {
            bump(&self.counters.write_back_lost);
            bump(&self.counters.misses);
        }
        lost
    }

    /// Write-back: writes every block not written yet from its memory copy; returns how many
    /// were written. Meant for when no other call runs (the store's drop calls it): a block a
    /// concurrent PUT is committing may be left unwritten.
    pub fn flush(&self) -> usize {
        if self.write != WriteMode::Back {
            return 0;
        }
        self.demote_evicted();
        let (mut written, mut left) = (0, 0);
        let mut buf = Vec::new();
        for (key, checksum, len) in self.file.deferred_blocks() {
            let Ok(len) = usize::try_from(len) else { continue };
            if self.write_from_memory(&key, checksum, len, &mut buf) {
                written += 1;
            } else if self.file.is_deferred(&key) {
                left += 1;
            }
        }
        self.dirty.lock().unwrap_or_else(|p| p.into_inner()).clear();
        if left > 0 {
            tracing::warn!(left, "write-back flush: blocks not written, which a restart will miss");
        }
        written
    }

    /// [`Store::lookup_batch`], and which tier holds each block found (for a prefix hit, the
    /// block it names). Lookups are not reads: no policy hears of them.
    pub fn lookup_with_tiers(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
    ) -> BatchAnswers<Located> {
        let answers = self.file.lookup_batch(caller, keys);
        answers
            .into_iter()
            .zip(keys)
            .map(|(answer, key)| {
                answer.map(|lookup| {
                    let found = match &lookup {
                        Lookup::Hit { .. } => Some(*key),
                        Lookup::PrefixHit { key, .. } => Some(&**key),
                        Lookup::Miss(_) => None,
                    };
                    let tier = found.map(|k| {
                        let file = self.file.committed_checksum(k);
                        if file.is_some() && self.memory.committed_checksum(k) == file {
                            Tier::Memory
                        } else {
                            Tier::File
                        }
                    });
                    Located { lookup, tier }
                })
            })
            .collect()
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
                self.demote_evicted();
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
        self.drop_stale(key);
        false
    }

    /// Drops the memory copy of `key`, which the file tier no longer backs.
    fn drop_stale(&self, key: &PhysicalKey) {
        let _order = self.stripe(key);
        if let Ok(Invalidate::Removed) = self.memory.invalidate(&owner(key), key) {
            bump(&self.counters.dropped_with_file);
        }
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
        let got = self.file.get_into(caller, key, dst);
        let (got, tier) = self.file_answer(key, &answer, got, dst);
        got.map(|g| (g, tier))
    }

    /// A GET's answer from the file tier after the memory tier answered `upper`: a damaged
    /// only copy is a corrupt miss (see [`Self::lost_damaged`]); a hit is counted and promoted.
    fn file_answer(
        &self,
        key: &PhysicalKey,
        upper: &Result<Get, StoreError>,
        got: Result<Get, StoreError>,
        dst: &[u8],
    ) -> TieredGet {
        match got {
            Ok(g) if was_damaged(upper, &g) && self.lost_damaged(key) => {
                (Ok(Get::Miss(MissReason::Corrupt)), None)
            }
            Ok(g) => {
                self.note_file_answer(key, &g, dst);
                let tier = matches!(g, Get::Hit { .. }).then_some(Tier::File);
                (Ok(g), tier)
            }
            Err(e) => (Err(e), None),
        }
    }

    /// [`Store::get_batch`], and which tier served each hit.
    pub fn get_batch_with_tiers(
        &self,
        caller: &Caller,
        items: &mut [BatchGet<'_>],
    ) -> Vec<TieredGet> {
        let first = self.memory.get_batch(caller, items);
        let mut answers: Vec<Option<TieredGet>> = Vec::with_capacity(items.len());
        let mut rest: Vec<(usize, Result<Get, StoreError>)> = Vec::new();
        for (i, (a, item)) in first.into_iter().zip(items.iter()).enumerate() {
            match a {
                hit if self.memory_hit_stands(item.key, &hit) => {
                    bump(&self.counters.memory_hits);
                    answers.push(Some((hit, Some(Tier::Memory))));
                }
                other => {
                    answers.push(None);
                    rest.push((i, other));
                }
            }
        }
        let damaged = |u: &Result<Get, StoreError>| matches!(u, Ok(Get::Miss(MissReason::Corrupt)));
        if self.write == WriteMode::Back && rest.iter().any(|(_, u)| damaged(u)) {
            // A damaged copy may have been a block's only one, and dropping it changes what
            // the file tier answers for the items after it (the same key, or another form of
            // its logical key): those items are asked one at a time, in order.
            for (i, upper) in &rest {
                let item = &mut items[*i];
                let got = self.file.get_into(caller, item.key, item.dst);
                answers[*i] = Some(self.file_answer(item.key, upper, got, item.dst));
            }
        } else if !rest.is_empty() {
            let mut lower: Vec<BatchGet<'_>> = Vec::with_capacity(rest.len());
            let mut left = rest.iter().map(|(i, _)| *i).peekable();
            for (i, item) in items.iter_mut().enumerate() {
                if left.peek() == Some(&i) {
                    left.next();
                    lower.push(BatchGet { key: item.key, dst: &mut *item.dst });
                }
            }
            let got = self.file.get_batch(caller, &mut lower);
            for (((i, upper), item), a) in rest.iter().zip(&lower).zip(got) {
                answers[*i] = Some(self.file_answer(item.key, upper, a, item.dst));
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

/// Whether the memory tier found its copy damaged (`upper`) where the file tier holds no bytes
/// of the block yet (`lower`): under write-back, that copy was the only one.
fn was_damaged(upper: &Result<Get, StoreError>, lower: &Get) -> bool {
    matches!(upper, Ok(Get::Miss(MissReason::Corrupt)))
        && matches!(lower, Get::Miss(MissReason::NotReadable(BlockState::Writing)))
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
}

impl Store for TieredStore {
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

    /// Each tier asked once: memory lends a hit on the version the file tier's catalog holds
    /// now (a copy of another version is dropped, never sent); on anything else the file tier
    /// reads the block into the caller's buffer and a hit is promoted. A key written again
    /// between the version check and the send is the one case served from the older copy.
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        let upper = match self.file.committed_checksum(key) {
            Some(version) => {
                let send = &mut |bytes: &[u8], sum| to.lend(bytes, sum);
                self.memory.lend(caller, key, capacity, Some(version), send)
            }
            None => Ok(Some(Get::Miss(MissReason::Absent))),
        };
        let upper = match upper {
            Ok(Some(hit @ Get::Hit { .. })) => {
                bump(&self.counters.memory_hits);
                return Ok(GotOne { get: hit, delivery: Delivery::Lent, tier: Some(Tier::Memory) });
            }
            Ok(Some(other)) => Ok(other),
            Ok(None) => {
                self.drop_stale(key);
                Ok(Get::Miss(MissReason::Absent))
            }
            Err(e) => Err(e),
        };
        let dst = to.buffer();
        let got = self.file.get_into(caller, key, dst);
        let (got, tier) = self.file_answer(key, &upper, got, dst);
        got.map(|get| GotOne { get, delivery: Delivery::Copied, tier })
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
        match self.write {
            WriteMode::Back => self.put_back(caller, key, src, request, None),
            WriteMode::Through => self.put_through(caller, key, src, request, None),
        }
    }

    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        if self.write == WriteMode::Back {
            return items
                .iter()
                .map(|i| self.put_back(caller, i.key, i.src, i.request, None))
                .collect();
        }
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
        if self.write == WriteMode::Back {
            return items
                .iter()
                .enumerate()
                .map(|(i, item)| match expected.get(i) {
                    Some(&sum) => {
                        self.put_back(caller, item.key, item.src, item.request, Some(sum))
                    }
                    None => Err(put_damaged(Checksum::of(item.src), None)),
                })
                .collect();
        }
        let answers = self.file.put_batch_checked(caller, items, expected);
        self.follow_file_evictions();
        self.write_up_committed(items, &answers);
        answers
    }

    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.file.lookup_batch(caller, keys)
    }

    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        self.lookup_with_tiers(caller, keys)
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let _order = self.stripe(key);
        let answer = self.file.invalidate(caller, key)?;
        // Whatever the file tier answered, memory keeps no copy the file tier does not hold.
        let _ = self.memory.invalidate(&owner(key), key);
        Ok(answer)
    }

    /// The file tier's keys of the scope, then memory's that the file tier did not list (a
    /// block not written back yet).
    fn scope_keys(
        &self,
        caller: &Caller,
        scope: &PurgeScope,
        max: usize,
    ) -> Result<Vec<PhysicalKey>, StoreError> {
        let mut keys = self.file.scope_keys(caller, scope, max)?;
        if keys.len() < max {
            // By digest: a key's digest names its full encoding.
            let listed: std::collections::HashSet<_> = keys.iter().map(|k| k.digest()).collect();
            let more = self.memory.scope_keys(caller, scope, max)?;
            let room = max - keys.len();
            keys.extend(more.into_iter().filter(|k| !listed.contains(&k.digest())).take(room));
        }
        Ok(keys)
    }
    gpucache_dataplane::forward_store!(fences, reports, lookup, write, commit, abort);
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

/// Write-back: blocks not written yet are written as the store closes.
impl Drop for TieredStore {
    fn drop(&mut self) {
        let written = self.flush();
        if written > 0 {
            tracing::info!(written, "tiered store closed: blocks held only in memory written down");
        }
    }
}
