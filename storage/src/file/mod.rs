//! FileStore: committed blocks as ordinary files, written through an I/O engine (io_uring or
//! pread/pwrite), durable before a PUT is acknowledged, reloaded at restart without reading
//! payloads, and never served unless the bytes the caller received match their checksum.
//!
//! The catalog (lifecycle, indexes, admission, eviction) lives under one mutex; payload I/O
//! happens outside it. Layout and file format: [`layout`] and ADR 0008. Durability policies:
//! [`Durability`] and ADR 0009.

mod block_log;
mod deferred;
pub mod engine;
mod fsck;
pub mod handdown;
mod journal;
pub mod layout;
mod log_index;
mod open_files;
mod reads;
mod removals;
mod room;
mod sync;

use std::collections::{BTreeMap, HashMap, hash_map};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::limits::{LimitsError, Refusal, RequestId, ResourceLimits};
use gpucache_dataplane::registry::{Epoch, EpochError, EpochSource, MemoryKind, RegionId};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, CorruptDrops, CorruptPhase, CorruptReason,
    FullPolicy, Get, GetTo, GotOne, Implementation, Invalidate, Lookup, PurgeScope, Put, Reclaimed,
    Reservation, Reserve, Retirement, StorageEffect, Store, StoreCondition, StoreError, StoreInfo,
    StoreStats, authorize, put_damaged,
};

use crate::catalog::{ByDigest, Catalog, Refused, Restored};
use crate::evict::PolicyKind;
use block_log::{BlockLog, Found, LogSlot};
pub use block_log::{
    COMPACT_LIVE_PERCENT, LOG_BLOCK_BYTES_MAX, LOG_DIR, LOG_SEGMENT_BYTES, LOG_SEGMENT_BYTES_MIN,
    LogOpened, LogUsage,
};
use engine::{EngineChoice, EngineConfig, IoEngine, IoSide};
pub use fsck::{FsckReport, fsck};
pub use journal::{JOURNAL_BYTES_MAX, JOURNAL_FILE, Lost as WriteBackLost};
pub use layout::BlockFileError;
pub use open_files::OpenFilesStats;
use open_files::{OpenFiles, OpenId};
use room::{DiskRoom, free_bytes};
use sync::sync_dir;

/// Most blocks of a batch read pinned and read together; a longer batch runs in several windows.
pub const BATCH_WINDOW_ITEMS: usize = 256;

/// Most payload bytes of a batch read pinned and read together (the window closes once they
/// are reached).
pub const BATCH_WINDOW_BYTES: u64 = 64 << 20;

/// The piece a buffered one-key read reads and hashes at a time: small enough to be still in
/// the second-level cache when it is hashed, large enough that the calls cost little.
pub const READ_HASH_PIECE_BYTES: usize = 128 << 10;

/// Default for [`FileStoreConfig::open_files_max`]: block files kept open for reads. Well under
/// the usual descriptor limit of a process, with room for a server's sockets.
pub const OPEN_FILES_MAX: usize = 256;

/// When a PUT's bytes and metadata count as durable, and so when it is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync the block file, rename it into place, fsync its directory; then acknowledge.
    /// Survives power loss. Costs two flushes per block.
    PerBlock,
    /// Write and rename, then wait for one shared `syncfs` that covers every commit waiting at
    /// that moment. Survives power loss; concurrent commits share the flush.
    GroupCommit,
    /// Acknowledge after the rename, with no flush. Survives a process crash (the page cache
    /// holds the bytes) but not power loss or a kernel crash: recently acknowledged blocks can
    /// vanish (clean misses, never wrong bytes, because every read is checksummed).
    None,
}

/// Where committed blocks live on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A file per block under `blocks/<xx>/` (ADR 0008).
    Files,
    /// Blocks up to [`LOG_BLOCK_BYTES_MAX`] as records in append-only segments under `log/`
    /// (ADR 0026); larger ones in files. A PUT creates no file; under `PerBlock` and
    /// `GroupCommit` it is acknowledged once a flush of the log shared by every commit waiting
    /// then covers it.
    Log,
}

/// How to open a FileStore. [`FileStoreConfig::open`] validates it and returns a running store.
#[derive(Debug, Clone)]
pub struct FileStoreConfig {
    pub root: PathBuf,
    pub engine: EngineChoice,
    pub engine_config: EngineConfig,
    /// Open block files with O_DIRECT (aligned staging buffers, registered with io_uring).
    pub direct_io: bool,
    pub durability: Durability,
    pub limits: ResourceLimits,
    /// How long a commit waits for a group flush before it is abandoned.
    pub group_commit_deadline_ms: u64,
    /// Most block files kept open for reads (least recently used go first); at least 1.
    pub open_files_max: usize,
    /// Which committed blocks give way first when a retained-byte quota is full.
    pub policy: PolicyKind,
    /// Where blocks live: a file each, or the block log.
    pub layout: Layout,
    /// Bytes of one block-log segment under [`Layout::Log`]; at least
    /// [`LOG_SEGMENT_BYTES_MIN`]. A store makes its segments no larger than a sixteenth of
    /// `limits.retained_bytes_max` and an eighth of the device's free space at open (but at least
    /// the minimum).
    pub log_segment_bytes: u64,
}

impl FileStoreConfig {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            engine: EngineChoice::Auto,
            engine_config: EngineConfig::default(),
            direct_io: false,
            durability: Durability::PerBlock,
            limits: ResourceLimits::default(),
            group_commit_deadline_ms: 10_000,
            open_files_max: OPEN_FILES_MAX,
            policy: PolicyKind::Fifo,
            layout: Layout::Files,
            log_segment_bytes: LOG_SEGMENT_BYTES,
        }
    }

    /// Opens (or creates) the store with the engine this config selects.
    pub fn open(self, clock: Arc<dyn Clock>) -> Result<FileStore, FileStoreError> {
        let mut engine_config = self.engine_config;
        if !self.direct_io {
            // Staging memory serves O_DIRECT only; a buffered store registers none.
            engine_config.staging_bytes = 0;
        }
        let (engine, reason) = engine::build_explained(self.engine, engine_config)
            .map_err(|e| FileStoreError::Engine(e.to_string()))?;
        let mut store = FileStore::open_with_engine(self, engine, clock)?;
        store.engine_reason = reason;
        Ok(store)
    }
}

/// Why a FileStore could not open.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileStoreError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path} is in use by another process (lock held)")]
    Locked { path: PathBuf },
    #[error("invalid limits: {0}")]
    Limits(#[from] LimitsError),
    #[error("I/O engine unavailable: {0}")]
    Engine(String),
    #[error("invalid configuration: {0}")]
    Config(String),
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> FileStoreError + '_ {
    move |source| FileStoreError::Io { path: path.to_owned(), source }
}

/// What opening found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    pub epoch: u64,
    pub loaded: u64,
    pub loaded_bytes: u64,
    /// Files skipped (and removed), by reason.
    pub skipped: BTreeMap<String, u64>,
    /// The damaged block files among them, by [`CorruptReason`] (phase `Open`); the store's
    /// [`StoreStats::corrupt_dropped`] starts from these.
    pub corrupt: CorruptDrops,
    /// Unfinished writes from before the restart, removed.
    pub tmp_removed: u64,
    /// Blocks acknowledged under write-back before the restart whose files were never written
    /// (from the write-back journal).
    pub write_back_lost: WriteBackLost,
    /// What the block log held (`Layout::Log`).
    pub log: LogOpened,
    pub elapsed_ms: u64,
}

/// Where a block's payload is.
#[derive(Debug)]
enum FilePayload {
    /// Being written through `Store::write`: bytes held until commit.
    Staged(Vec<u8>),
    /// Committed: the block's region (which names its kept descriptor), the file and the
    /// payload's offset in it (`header_len`: after the header in a block file, the payload's
    /// place in a log segment). `removing` while an invalidation is removing it (the block
    /// stays readable until the removal is durable). `slot` names its record when the block
    /// lives in the block log; the blocks of one segment share its path.
    Stored {
        region: RegionId,
        path: Arc<Path>,
        header_len: u64,
        removing: bool,
        slot: Option<LogSlot>,
    },
    /// Committed with its bytes held by the tier above, not written yet (see [`deferred`]):
    /// the epoch its file header will carry, and whether a write of it is under way; its
    /// commit sequence and length, for the write-back journal and tally. Never on disk, so a
    /// restart does not find it.
    Deferred { epoch: u64, writing: bool, seq: u64, len: u64 },
}

/// Persists the epoch in the store record before it takes effect, so that a restart never
/// reuses one.
#[derive(Debug)]
struct PersistedEpochs {
    root: PathBuf,
}

impl EpochSource for PersistedEpochs {
    fn advance(&mut self, current: Epoch) -> Result<Epoch, EpochError> {
        let next = current.0.checked_add(1).ok_or(EpochError::Exhausted { at: current })?;
        write_store_record(&self.root, next)
            .map_err(|e| EpochError::Unavailable { detail: format!("store record: {e}") })?;
        Ok(Epoch(next))
    }
}

/// The store record is kept in two files, written one after the other, so that damage to one
/// (or a crash while replacing it) never loses the epoch.
const STORE_RECORDS: [&str; 2] = ["STORE", "STORE.2"];

/// How far the epoch jumps when both store records are unreadable: far enough that no epoch
/// (and so no region id) of the lost history is reused.
const EPOCH_JUMP_AFTER_LOSS: u64 = 1 << 20;

fn write_store_record(root: &Path, epoch: u64) -> io::Result<()> {
    for name in STORE_RECORDS {
        let tmp = root.join(format!("{name}.tmp"));
        fs::write(&tmp, layout::encode_store_record(epoch))?;
        File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, root.join(name))?;
        sync_dir(root)?;
    }
    Ok(())
}

/// The newest epoch either store record holds.
fn read_store_record(root: &Path) -> Option<u64> {
    STORE_RECORDS
        .iter()
        .filter_map(|name| {
            fs::read(root.join(name)).ok().and_then(|b| layout::decode_store_record(&b))
        })
        .max()
}

/// Free space kept beyond a block's own bytes when admitting it (directory growth, metadata).
const DISK_SLACK_BYTES: u64 = 1 << 20;

/// How long opening waits for the store's lock before it answers [`FileStoreError::Locked`]. A
/// lock is also held, briefly, by a child process of the previous holder between its fork and
/// its exec (the descriptor is close-on-exec, but the child holds the lock until then), so a
/// store closed and reopened at once may find it held for a moment.
const LOCK_PATIENCE_MS: u64 = 2_000;
/// Pause between two attempts at the lock.
const LOCK_RETRY_MS: u64 = 5;

/// Takes the exclusive lock on `lock`, trying again until `patience` has passed.
fn lock_within(lock: &File, patience: Duration) -> bool {
    let deadline = Instant::now() + patience;
    loop {
        // SAFETY: flock on an fd we own; no memory is shared with the kernel.
        let taken = unsafe {
            libc::flock(std::os::fd::AsRawFd::as_raw_fd(lock), libc::LOCK_EX | libc::LOCK_NB)
        } == 0;
        if taken {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(LOCK_RETRY_MS));
    }
}

/// Region ids of one run start at `epoch << 32`, so a restarted store never reuses an id.
const REGION_ID_EPOCH_SHIFT: u32 = 32;

/// A durable store of block files.
#[derive(Debug)]
pub struct FileStore {
    root: PathBuf,
    engine: Arc<dyn IoEngine>,
    /// Why this engine runs (configured, probed, or why io_uring could not).
    engine_reason: String,
    /// The latest engine call's outcome, for [`Store::condition`].
    io_watch: Arc<engine::IoWatch>,
    direct_io: bool,
    durability: Durability,
    layout: Layout,
    full_policy: FullPolicy,
    catalog: Mutex<Catalog<FilePayload>>,
    clock: Arc<dyn Clock>,
    group: sync::GroupSync,
    report: OpenReport,
    /// Block files and log segments kept open for reads.
    files: Arc<OpenFiles>,
    /// Which `blocks/<xx>` directories are known to exist (created on first use).
    subdirs: [AtomicBool; 256],
    /// The free space a reservation is admitted against.
    room: DiskRoom,
    /// Which acknowledged blocks wait for their files, for the next open after a crash.
    journal: journal::Journal,
    /// Committed blocks waiting for their files, and their payload bytes.
    deferred: [AtomicU64; 2],
    /// The block log, under `Layout::Log`.
    log: Option<Arc<BlockLog>>,
    _lock: File,
}

/// A PUT whose commit has started under the catalog lock: its region, and the commit
/// sequence and epoch its file is written under.
struct Started {
    region: RegionId,
    seq_epoch: (u64, u64),
}

/// A PUT admitted by [`FileStore::admit_put`]: its region, the checksum of its bytes, and the
/// commit sequence and epoch its file is written under.
struct AdmittedPut {
    region: RegionId,
    checksum: Checksum,
    seq_epoch: (u64, u64),
}

/// What a store with eviction policy `policy` reports: FIFO is the oldest-first order the
/// conformance model predicts exactly.
fn full_policy_of(policy: PolicyKind) -> FullPolicy {
    match policy {
        PolicyKind::Fifo => FullPolicy::EvictOldest,
        _ => FullPolicy::Evict,
    }
}

impl FileStore {
    /// Opens (or creates) the store under `config.root` with a given engine (tests pass a
    /// faulty one).
    pub fn open_with_engine(
        config: FileStoreConfig,
        engine: Arc<dyn IoEngine>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, FileStoreError> {
        let started = Instant::now();
        config.limits.validate()?;
        let open_files_max = NonZeroUsize::new(config.open_files_max)
            .ok_or_else(|| FileStoreError::Config("open_files_max must be at least 1".into()))?;
        if config.log_segment_bytes < LOG_SEGMENT_BYTES_MIN {
            return Err(FileStoreError::Config(format!(
                "log_segment_bytes must be at least {LOG_SEGMENT_BYTES_MIN}"
            )));
        }
        if config.layout == Layout::Log && config.direct_io {
            return Err(FileStoreError::Config(
                "direct_io needs layout files: log records are not aligned for O_DIRECT".into(),
            ));
        }
        let watched = engine::Watched::new(engine);
        let io_watch = watched.watch();
        let engine: Arc<dyn IoEngine> = Arc::new(watched);
        let root = config.root.clone();
        for dir in [root.clone(), root.join("tmp"), root.join("blocks")] {
            fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        }
        let lock_path = root.join("LOCK");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_at(&lock_path))?;
        if !lock_within(&lock, Duration::from_millis(LOCK_PATIENCE_MS)) {
            return Err(FileStoreError::Locked { path: lock_path });
        }

        let mut report = OpenReport::default();
        let tmp_dir = root.join("tmp");
        for entry in fs::read_dir(&tmp_dir).map_err(io_at(&tmp_dir))? {
            let path = entry.map_err(io_at(&tmp_dir))?.path();
            fs::remove_file(&path).map_err(io_at(&path))?;
            report.tmp_removed += 1;
        }
        // A small store, or one on a nearly full device, keeps small segments: what a new one
        // preallocates is at most a sixteenth of the bytes the store may retain and an eighth of
        // the device's free space.
        let segment_bytes = config
            .log_segment_bytes
            .min(config.limits.retained_bytes_max / 16)
            .min(free_bytes(&root).unwrap_or(u64::MAX) / 8)
            .max(LOG_SEGMENT_BYTES_MIN);
        // The log's next segment is zeroed meanwhile, for a store that appends to a log.
        let premade = (config.layout == Layout::Log)
            .then(|| block_log::Premade::start(tmp_dir.join("segment.new"), segment_bytes));

        let recorded = read_store_record(&root);
        let (files_found, files_epoch) = scan_blocks(&root, &mut report)?;
        let log_dir = root.join(LOG_DIR);
        let mut scanned = match recorded.and_then(|epoch| log_index::load(&root, epoch)) {
            Some(indexed) => indexed,
            None => block_log::scan(&root).map_err(io_at(&log_dir))?,
        };
        report.log = scanned.opened();
        if scanned.indexed {
            // Written for this epoch only; the open below moves past it anyway.
            log_index::remove(&root).map_err(io_at(&log_dir))?;
        }
        let logged = std::mem::take(&mut scanned.blocks);
        let (found, max_epoch) =
            newest_per_key(&root, files_found, files_epoch, logged, scanned.indexed)
                .map_err(io_at(&log_dir))?;
        if report.log.torn > 0 {
            tracing::warn!(
                root = %root.display(), segments = report.log.torn,
                "block log segments end in a record cut short (never acknowledged)"
            );
        }
        if root.join(JOURNAL_FILE).exists() {
            let on_disk = found.iter().map(|f| f.header.seq).collect();
            report.write_back_lost = journal::recover(&root, &on_disk).map_err(io_at(&root))?;
            if report.write_back_lost.blocks > 0 {
                tracing::warn!(
                    root = %root.display(), blocks = report.write_back_lost.blocks,
                    bytes = report.write_back_lost.bytes,
                    "acknowledged write-back blocks were lost: the process stopped before their files were written"
                );
            }
        }
        let epoch = match recorded {
            Some(e) => e.max(max_epoch) + 1,
            None if max_epoch > 0 => {
                tracing::error!(
                    root = %root.display(), newest_block_epoch = max_epoch,
                    "both store records are unreadable; jumping the epoch so no old epoch or region id is reused"
                );
                max_epoch + EPOCH_JUMP_AFTER_LOSS
            }
            None => 1,
        };
        write_store_record(&root, epoch).map_err(io_at(&root))?;
        report.epoch = epoch;

        let mut catalog = Catalog::new(
            config.limits.clone(),
            full_policy_of(config.policy),
            MemoryKind::Storage,
            Epoch(epoch),
            epoch << REGION_ID_EPOCH_SHIFT,
            Box::new(PersistedEpochs { root: root.clone() }),
            config.policy.build(config.limits.retained_bytes_max),
        )?;
        for (phase, reason, n) in report.corrupt.iter() {
            catalog.count_corrupt(phase, reason, n);
        }
        let files = Arc::new(OpenFiles::new(open_files_max));
        let deadline = Duration::from_millis(config.group_commit_deadline_ms);
        // A store that has segments reads them whatever its layout says new blocks go to.
        let log = (config.layout == Layout::Log || !scanned.segments.is_empty())
            .then(|| {
                BlockLog::open(
                    &root,
                    &scanned,
                    segment_bytes,
                    deadline,
                    Arc::clone(&files),
                    premade,
                )
                .map(Arc::new)
            })
            .transpose()
            .map_err(io_at(&log_dir))?;
        let restored = found
            .into_iter()
            .map(|Found { header, path, payload_at, slot }| Restored {
                key: header.key,
                len: header.payload_len,
                checksum: header.checksum,
                seq: header.seq,
                payload: FilePayload::Stored {
                    // The catalog names the region; set as it admits the block.
                    region: RegionId(0),
                    path,
                    header_len: payload_at,
                    removing: false,
                    slot,
                },
            })
            .collect();
        // Live records per segment: (records, bytes).
        let mut live: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        // Newest first: when the limits are tighter than what is on disk, the oldest blocks are
        // the ones left out, as eviction would have chosen.
        let refused = catalog.restore_all(restored, |id, len, payload| {
            if let FilePayload::Stored { region, slot, .. } = payload {
                *region = id;
                if let Some(slot) = slot {
                    let (records, bytes) = live.entry(slot.segment).or_default();
                    *records += 1;
                    *bytes += slot.bytes;
                }
            }
            report.loaded += 1;
            report.loaded_bytes += len;
        });
        if let Some(log) = &log {
            log.restored(&live);
        }
        for (why, payload) in refused {
            if let Refused::Limits(refusal) = why {
                tracing::warn!(%refusal, "oldest blocks over the configured limits; removed");
                *report.skipped.entry("over limits".into()).or_default() += 1;
            }
            if let FilePayload::Stored { slot: Some(slot), .. } = &payload {
                block_log::kill_at(&root, *slot).map_err(io_at(&log_dir))?;
            }
            dispose(vec![payload]);
        }
        if let Some(log) = &log {
            log.drop_empty().map_err(io_at(&log_dir))?;
        }
        report.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        tracing::info!(
            root = %root.display(), engine = engine.name(), epoch, loaded = report.loaded,
            skipped = report.skipped.values().sum::<u64>(), "file store opened"
        );
        let group = sync::GroupSync::filesystem(&root, deadline).map_err(io_at(&root))?;
        Ok(Self {
            room: DiskRoom::new(&root),
            journal: journal::Journal::new(&root),
            deferred: Default::default(),
            log,
            root,
            engine,
            engine_reason: "given by the caller".to_owned(),
            io_watch,
            direct_io: config.direct_io,
            durability: config.durability,
            layout: config.layout,
            full_policy: full_policy_of(config.policy),
            catalog: Mutex::new(catalog),
            clock,
            group,
            report,
            files,
            subdirs: std::array::from_fn(|_| AtomicBool::new(false)),
            _lock: lock,
        })
    }

    /// What opening found.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// The engine in use ("uring", "psync", or a test wrapper).
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Why [`FileStore::engine_name`] runs: "configured", "probed", or why io_uring could not
    /// ("io_uring unavailable: ..."); "given by the caller" for [`FileStore::open_with_engine`].
    pub fn engine_reason(&self) -> &str {
        &self.engine_reason
    }

    /// The directory the store keeps its files under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The block files kept open for reads: how many, the limit, and how often they served.
    pub fn open_files(&self) -> OpenFilesStats {
        self.files.stats()
    }

    /// What the block log holds now (segments, their bytes, and the live blocks and bytes in
    /// them); `None` when the store has no log.
    pub fn log_usage(&self) -> Option<LogUsage> {
        self.log.as_ref().map(|log| log.usage())
    }

    /// Where the committed block under exactly `key` keeps its payload: its file and the
    /// payload's offset in that file (for tools that read the store's own files, such as the
    /// benchmark's fio runs). `None` when no committed block is there.
    pub fn block_location(&self, key: &PhysicalKey) -> Option<(PathBuf, u64)> {
        let catalog = self.lock();
        let b = catalog.entry(catalog.find_exact(key)?)?;
        match &b.payload {
            FilePayload::Stored { path, header_len, .. }
                if b.life.state() == gpucache_dataplane::BlockState::Committed =>
            {
                Some((path.to_path_buf(), *header_len))
            }
            _ => None,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Catalog<FilePayload>> {
        match self.catalog.lock() {
            Ok(guard) => guard,
            Err(_) => panic!("FileStore catalog is unusable: a thread panicked while changing it"),
        }
    }

    /// Creates a new block file to write (reads go through [`Self::files`]).
    fn create_file(&self, path: &Path) -> io::Result<File> {
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        if self.direct_io {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path)
    }

    /// Writes a whole block file at `tmp`: header, payload, padding.
    fn write_block_file(&self, tmp: &Path, header: &[u8], payload: &[u8]) -> io::Result<File> {
        let file = self.create_file(tmp)?;
        let header_len = header.len();
        let total = header_len + engine::round_up(payload.len(), engine::DIRECT_ALIGN);
        if self.direct_io {
            let mut staging = self.engine.staging(total)?;
            staging[..header_len].copy_from_slice(header);
            staging[header_len..header_len + payload.len()].copy_from_slice(payload);
            staging[header_len + payload.len()..total].fill(0);
            self.engine.write_all_at(&file, 0, &staging[..total])?;
        } else {
            self.engine.write_all_at(&file, 0, header)?;
            self.engine.write_all_at(&file, header_len as u64, payload)?;
            file.set_len(total as u64)?;
        }
        Ok(file)
    }

    /// Makes a block durable under the configured policy and puts it in place: a record in the
    /// block log when the layout keeps it there, a block file otherwise. Returns the file that
    /// holds it, where its payload starts there, its checksum and its log record.
    fn persist(
        &self,
        key: &PhysicalKey,
        region: RegionId,
        (seq, epoch): (u64, u64),
        payload: &[u8],
        checksum: Checksum,
    ) -> io::Result<(Arc<Path>, u64, Checksum, Option<LogSlot>)> {
        let mut header = vec![0u8; layout::header_len_for(key.encoded().len())];
        layout::encode_header(&mut header, key, payload.len() as u64, checksum, seq, epoch);
        if self.layout == Layout::Log
            && let Some(log) =
                self.log.as_ref().filter(|log| log.takes(header.len(), payload.len()))
        {
            let result = log.append(seq, &header, payload).and_then(|(slot, at)| {
                if self.durability != Durability::None
                    && let Err(e) = log.barrier()
                {
                    // Never acknowledged: the record goes (its state byte may not reach the
                    // disk, and an open then finds a block nobody was told about, never a
                    // wrong one).
                    let _ = log.kill(slot);
                    return Err(e);
                }
                Ok((slot, at))
            });
            self.io_watch.record(IoSide::Write, &result);
            let (slot, at) = result?;
            return Ok((log.path_of(slot.segment).into(), at, checksum, Some(slot)));
        }
        let tmp = layout::tmp_path(&self.root, region.0);
        let final_path = layout::block_path(&self.root, key, seq);
        let result = (|| {
            let file = self.write_block_file(&tmp, &header, payload)?;
            if self.durability == Durability::PerBlock {
                self.engine.sync(&file)?;
            }
            drop(file);
            self.ensure_subdir(&final_path, key)?;
            fs::rename(&tmp, &final_path)?;
            match self.durability {
                Durability::PerBlock => sync_dir(final_path.parent().unwrap_or(&self.root))?,
                Durability::GroupCommit => self.group.barrier()?,
                Durability::None => {}
            }
            Ok(())
        })();
        // The steps outside the engine (the create, the rename, the directory sync) fail on a
        // medium that stopped taking writes first: readiness must see them too.
        self.io_watch.record(IoSide::Write, &result);
        match result {
            Ok(()) => Ok((final_path.into(), header.len() as u64, checksum, None)),
            Err(e) => {
                // Nothing of a failed commit may survive to be found at the next open.
                let _ = fs::remove_file(&tmp);
                let _ = fs::remove_file(&final_path);
                Err(e)
            }
        }
    }

    /// Creates the block's `blocks/<xx>` directory the first time it is needed (durably under
    /// `PerBlock`; the group flush covers it under `GroupCommit`).
    fn ensure_subdir(&self, final_path: &Path, key: &PhysicalKey) -> io::Result<()> {
        let slot = &self.subdirs[usize::from(key.digest().0[0])];
        if slot.load(Ordering::Acquire) {
            return Ok(());
        }
        let dir = final_path.parent().unwrap_or(&self.root);
        fs::create_dir_all(dir)?;
        if self.durability == Durability::PerBlock {
            sync_dir(&self.root.join("blocks"))?;
        }
        slot.store(true, Ordering::Release);
        Ok(())
    }

    /// Writes the block whose commit has started (under `seq`, the commit sequence that names
    /// its file, and `epoch`, which goes into its header) and publishes it under a second and
    /// last catalog lock. `payload` was hashed once, to `checksum`, by the caller.
    fn commit_payload(
        &self,
        region: RegionId,
        key: &PhysicalKey,
        payload: &[u8],
        checksum: Checksum,
        (seq, epoch): (u64, u64),
    ) -> Result<Committed, StoreError> {
        match self.persist(key, region, (seq, epoch), payload, checksum) {
            Ok((path, header_len, checksum, slot)) => {
                let now = self.clock.now_ms();
                let mut catalog = self.lock();
                match catalog.finish_commit_at(region, checksum, seq, now) {
                    Ok(c) => {
                        if let Some(b) = catalog.entry_mut(region) {
                            b.payload = FilePayload::Stored {
                                region,
                                path,
                                header_len,
                                removing: false,
                                slot,
                            };
                        }
                        Ok(c)
                    }
                    Err(e) => {
                        drop(catalog);
                        self.release(&path, slot);
                        Err(e)
                    }
                }
            }
            Err(e) => {
                // The engine call returned, so it no longer touches the payload: retired.
                let released = self.lock().fail_commit(region, Retirement::Retired);
                self.dispose(released);
                // A failed commit leaves no file behind (`persist` removes both names).
                let path = layout::block_path(&self.root, key, seq);
                Err(StoreError::storage(
                    "commit",
                    "block write",
                    &path,
                    &e,
                    StorageEffect::Unchanged,
                ))
            }
        }
    }

    /// The checksum of the committed block under `key`, without reading it: which version of
    /// the key the store holds now.
    pub fn committed_checksum(&self, key: &PhysicalKey) -> Option<Checksum> {
        self.lock().committed_checksum(key)
    }

    /// The keys this store evicted to make room since the last call, oldest first (at most
    /// the last 4,096). The first call starts the record: a store nobody asks keeps none.
    pub fn take_evicted(&self) -> Vec<PhysicalKey> {
        self.lock().take_evicted()
    }

    /// Damages one payload byte of the committed block under `key` on disk, for corruption
    /// tests. Returns whether a committed block was there.
    #[cfg(any(test, feature = "testing"))]
    pub fn corrupt_for_test(&self, key: &PhysicalKey, at: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let (path, header_len, len) = {
            let mut catalog = self.lock();
            let Some(id) = catalog.find_exact(key) else { return false };
            let len = catalog.entry(id).map(|b| b.len).unwrap_or(0);
            match catalog.committed_payload_mut(key) {
                Some(FilePayload::Stored { path, header_len, .. }) => {
                    (path.clone(), *header_len, len)
                }
                _ => return false,
            }
        };
        let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else { return false };
        let offset = header_len + at % len.max(1);
        let mut byte = [0u8];
        if file.read_exact_at(&mut byte, offset).is_err() {
            return false;
        }
        byte[0] = byte[0].wrapping_add(1);
        file.write_all_at(&byte, offset).is_ok()
    }
}

impl FileStore {
    /// Closes the kept descriptors of blocks that left the catalog and removes their files or
    /// log records.
    fn dispose(&self, released: Vec<FilePayload>) {
        for p in released {
            match p {
                // An invalidation removing the block did so before it left the catalog.
                FilePayload::Stored { removing: true, region, slot: None, .. } => {
                    self.files.forget(region);
                }
                FilePayload::Stored { removing: true, .. } => {}
                FilePayload::Stored { region, path, slot, .. } => {
                    if slot.is_none() {
                        self.files.forget(region);
                    }
                    self.release(&path, slot);
                }
                FilePayload::Deferred { seq, len, .. } => self.deferred_settled(seq, len),
                FilePayload::Staged(_) => {}
            }
        }
    }

    /// Removes a block that is no longer wanted, without waiting for the removal to be
    /// durable: its log record marked removed, or its file unlinked.
    fn release(&self, path: &Path, slot: Option<LogSlot>) {
        match (slot, &self.log) {
            (Some(slot), Some(log)) => {
                if let Err(e) = log.kill(slot) {
                    tracing::warn!(
                        segment = %path.display(), record = slot.record, error = %e,
                        "could not mark a removed block's log record; the next open finds it"
                    );
                }
            }
            _ => remove_block_file(path),
        }
    }
}

impl FileStore {
    /// After the block log rotated: moves the live blocks of its emptiest sealed segment, when
    /// they fill less than [`block_log::COMPACT_LIVE_PERCENT`] of it, to the head of the log, so
    /// that the segment goes. Runs on the thread of the PUT that found it due (at most one
    /// segment per rotation). A block being read or removed stays where it is; each moved block
    /// is durable in its new place (under the durable policies) before its old record is marked
    /// removed, and a block that changed meanwhile keeps its old place.
    fn compact_log(&self) {
        let Some(log) = &self.log else { return };
        let Some((victim, file)) = log.compaction_due() else { return };
        // The victim's own records (read without the lock), each kept only while the catalog
        // still holds that very record for its key.
        let records = match block_log::live_records(&self.root, victim) {
            Ok(records) => records,
            Err(e) => {
                tracing::warn!(segment = victim, error = %e, "could not read a segment to compact");
                return;
            }
        };
        let movable: Vec<(RegionId, LogSlot, u64, Checksum)> = {
            let catalog = self.lock();
            records
                .iter()
                .filter_map(|f| {
                    let region = catalog.find_exact(&f.header.key)?;
                    let b = catalog.entry(region)?;
                    let committed = b.life.state() == gpucache_dataplane::BlockState::Committed;
                    match &b.payload {
                        FilePayload::Stored { slot: Some(slot), removing: false, .. }
                            if Some(*slot) == f.slot && b.readers == 0 && committed =>
                        {
                            Some((region, *slot, b.seq, b.checksum?))
                        }
                        _ => None,
                    }
                })
                .collect()
        };
        let mut moved = Vec::with_capacity(movable.len());
        for (region, old, seq, checksum) in movable {
            let copied = BlockLog::read_body(&file, old).and_then(|body| {
                let header = layout::decode_header(&body)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let (head, payload) =
                    body.split_at(usize::try_from(header.header_len).unwrap_or(0));
                // Damage is never copied: the block stays, and a read finds it.
                if header.seq != seq || Checksum::of(payload) != checksum {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "damaged record"));
                }
                log.append(seq, head, payload)
            });
            match copied {
                Ok((new, payload_at)) => moved.push((region, old, new, payload_at)),
                Err(e) => {
                    tracing::warn!(segment = victim, record = old.record, error = %e,
                        "a block stays in the segment being compacted");
                }
            }
        }
        let durable = self.durability == Durability::None || log.barrier().is_ok();
        let mut bytes = 0;
        let mut stale = Vec::new();
        {
            let mut catalog = self.lock();
            for (region, old, new, payload_at) in moved {
                let entry = catalog.entry_mut(region).filter(|b| b.readers == 0);
                match entry.map(|b| &mut b.payload) {
                    Some(FilePayload::Stored {
                        slot, path, header_len, removing: false, ..
                    }) if durable && *slot == Some(old) => {
                        *slot = Some(new);
                        *path = log.path_of(new.segment).into();
                        *header_len = payload_at;
                        bytes += new.bytes;
                        stale.push(old);
                    }
                    _ => stale.push(new),
                }
            }
        }
        for slot in stale {
            if let Err(e) = log.kill(slot) {
                tracing::warn!(segment = slot.segment, record = slot.record, error = %e,
                    "could not mark a compacted record; the next open resolves it by sequence");
            }
        }
        log.compacted(bytes);
    }
}

impl Drop for FileStore {
    /// A clean close flushes the block log and leaves its index, so that the next open reads
    /// one file instead of every record's head.
    fn drop(&mut self) {
        if let Some(log) = &self.log
            && let Err(e) = self.write_log_index(log)
        {
            tracing::warn!(root = %self.root.display(), error = %e,
                "could not write the block log's index; the next open reads every record");
        }
    }
}

impl FileStore {
    fn write_log_index(&self, log: &BlockLog) -> io::Result<()> {
        log.barrier()?;
        let catalog = self.lock();
        // Oldest commit first, one per key, as the index is read.
        let entries = catalog.by_age().filter_map(|b| match &b.payload {
            FilePayload::Stored { slot: Some(slot), header_len, removing: false, .. }
                if b.life.state() == gpucache_dataplane::BlockState::Committed =>
            {
                Some(log_index::Entry {
                    slot: *slot,
                    payload_at: *header_len,
                    payload_len: b.len,
                    checksum: b.checksum?,
                    seq: b.seq,
                    key: &b.key,
                })
            }
            _ => None,
        });
        log_index::write(&self.root, catalog.epoch().0, entries)
    }
}

/// Removes the files of blocks that left the catalog (no log records: an open that refuses a
/// logged block marks its record itself).
fn dispose(released: Vec<FilePayload>) {
    for p in released {
        if let FilePayload::Stored { path, slot: None, .. } = p {
            remove_block_file(&path);
        }
    }
}

/// Removes a block file that left the catalog (an absent one is already gone).
fn remove_block_file(path: &Path) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "could not remove an evicted block file");
    }
}

/// Threads reading block headers at open. Cold opens wait on the device, so more readers than
/// cores keep it busy; each thread owns a disjoint set of `blocks/<xx>` directories.
const SCAN_THREADS: usize = 8;

/// What one scanning thread found.
#[derive(Default)]
struct ScanPart {
    headers: Vec<(layout::BlockHeader, PathBuf)>,
    skipped: BTreeMap<String, u64>,
    corrupt: CorruptDrops,
    error: Option<FileStoreError>,
}

fn skip_label(reason: &BlockFileError) -> &'static str {
    match reason {
        BlockFileError::Io(_) => "io error",
        BlockFileError::Foreign { .. } | BlockFileError::Name => "foreign",
        BlockFileError::Size { .. } | BlockFileError::Short { .. } => "truncated",
        _ => "corrupt",
    }
}

/// What kind of damage a block file that fails its checks at open has. The name is checked
/// first, so a file with a block's name and a foreign magic is a damaged header.
fn corrupt_reason(reason: &BlockFileError) -> CorruptReason {
    match reason {
        BlockFileError::Name => CorruptReason::Foreign,
        BlockFileError::Io(_) => CorruptReason::Unreadable,
        BlockFileError::Short { .. } | BlockFileError::Size { .. } => CorruptReason::Truncated,
        BlockFileError::NameMismatch => CorruptReason::Identity,
        BlockFileError::PayloadChecksum => CorruptReason::Checksum,
        BlockFileError::Foreign { .. }
        | BlockFileError::Format { .. }
        | BlockFileError::HeaderLength { .. }
        | BlockFileError::HeaderChecksum
        | BlockFileError::Key(_)
        | BlockFileError::PayloadLength { .. } => CorruptReason::Header,
    }
}

fn scan_dir(sub: &Path, part: &mut ScanPart) -> Result<(), FileStoreError> {
    for entry in fs::read_dir(sub).map_err(io_at(sub))? {
        let path = entry.map_err(io_at(sub))?.path();
        if !path.is_file() {
            tracing::warn!(path = %path.display(), "not a regular file in a block directory; left alone");
            *part.skipped.entry("foreign".into()).or_default() += 1;
            continue;
        }
        match layout::read_header(&path) {
            Ok(h) => part.headers.push((h, path)),
            Err(reason) => {
                let kind = corrupt_reason(&reason);
                tracing::warn!(
                    path = %path.display(), reason = kind.name(), detail = %reason,
                    "damaged block file found at open; removed"
                );
                *part.skipped.entry(skip_label(&reason).into()).or_default() += 1;
                part.corrupt.add(CorruptPhase::Open, kind, 1);
                let _ = fs::remove_file(&path);
            }
        }
    }
    Ok(())
}

/// Reads every block header under `root/blocks` (in parallel), keeping the newest file per key;
/// damaged files are removed and counted by reason. Returns the headers with their paths, oldest
/// commit first, and the largest epoch any header carries.
fn scan_blocks(
    root: &Path,
    report: &mut OpenReport,
) -> Result<(Vec<(layout::BlockHeader, PathBuf)>, u64), FileStoreError> {
    let blocks = root.join("blocks");
    let mut subdirs = Vec::new();
    for sub in fs::read_dir(&blocks).map_err(io_at(&blocks))? {
        let sub = sub.map_err(io_at(&blocks))?.path();
        if sub.is_dir() {
            subdirs.push(sub);
        }
    }
    let parts: Vec<ScanPart> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..SCAN_THREADS.min(subdirs.len().max(1)))
            .map(|t| {
                let subdirs = &subdirs;
                scope.spawn(move || {
                    let mut part = ScanPart::default();
                    for sub in subdirs.iter().skip(t).step_by(SCAN_THREADS) {
                        if let Err(e) = scan_dir(sub, &mut part) {
                            part.error = Some(e);
                            break;
                        }
                    }
                    part
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join().unwrap_or_else(|_| ScanPart {
                    error: Some(FileStoreError::Io {
                        path: blocks.clone(),
                        source: io::Error::other("a header-scanning thread panicked"),
                    }),
                    ..ScanPart::default()
                })
            })
            .collect()
    });
    let mut by_digest: BTreeMap<[u8; 32], (layout::BlockHeader, PathBuf)> = BTreeMap::new();
    let mut max_epoch = 0;
    for part in parts {
        if let Some(e) = part.error {
            return Err(e);
        }
        for (label, n) in part.skipped {
            *report.skipped.entry(label).or_default() += n;
        }
        for (phase, reason, n) in part.corrupt.iter() {
            report.corrupt.add(phase, reason, n);
        }
        for (h, path) in part.headers {
            max_epoch = max_epoch.max(h.epoch);
            let digest = h.key.digest().0;
            // An older file of the same key can outlive its eviction by a crash before the
            // unlink; the newest commit wins.
            let newer = by_digest.get(&digest).is_none_or(|(old, _)| old.seq < h.seq);
            if newer {
                if let Some((_, old_path)) = by_digest.insert(digest, (h, path)) {
                    let _ = fs::remove_file(old_path);
                }
            } else {
                let _ = fs::remove_file(&path);
            }
        }
    }
    let mut found: Vec<(layout::BlockHeader, PathBuf)> = by_digest.into_values().collect();
    found.sort_by_key(|(h, _)| h.seq);
    Ok((found, max_epoch))
}

/// The newest version of each key among the block files (`files`, newest per key already) and
/// the block log's records (`logged`; one per key and oldest commit first when `from_index`),
/// oldest commit first, and the largest epoch any of them carries. An older version loses its
/// file, or has its record marked removed.
fn newest_per_key(
    root: &Path,
    files: Vec<(layout::BlockHeader, PathBuf)>,
    files_epoch: u64,
    logged: Vec<Found>,
    from_index: bool,
) -> io::Result<(Vec<Found>, u64)> {
    let max_epoch = logged.iter().map(|f| f.header.epoch).fold(files_epoch, u64::max);
    if from_index && files.is_empty() {
        return Ok((logged, max_epoch));
    }
    let mut found = Vec::with_capacity(files.len() + logged.len());
    for (header, path) in files {
        let payload_at = header.header_len;
        found.push(Found { header, path: path.into(), payload_at, slot: None });
    }
    found.extend(logged);
    // Where the newest version of each key seen so far is in `found`; of two versions with the
    // same commit sequence (a compaction's copy and its original), the one found later wins.
    let mut newest: HashMap<KeyDigest, usize, ByDigest> =
        HashMap::with_capacity_and_hasher(found.len(), ByDigest::default());
    let mut older = Vec::new();
    for (i, f) in found.iter().enumerate() {
        match newest.entry(f.header.key.digest()) {
            hash_map::Entry::Vacant(slot) => {
                slot.insert(i);
            }
            hash_map::Entry::Occupied(held) if found[*held.get()].header.seq > f.header.seq => {
                older.push(i);
            }
            hash_map::Entry::Occupied(mut held) => older.push(held.insert(i)),
        }
    }
    drop(newest);
    if !older.is_empty() {
        let mut gone = vec![false; found.len()];
        for i in older {
            gone[i] = true;
            match found[i].slot {
                Some(slot) => block_log::kill_at(root, slot)?,
                None => remove_block_file(&found[i].path),
            }
        }
        let mut at = 0;
        found.retain(|_| {
            at += 1;
            !gone[at - 1]
        });
    }
    // Mostly in order already (the log appends in commit order): a stable sort runs through it.
    found.sort_by_key(|f| f.header.seq);
    Ok((found, max_epoch))
}

impl FileStore {
    /// [`Store::put`], the block compared with `expected` (the writer's checksum) before any
    /// of it is reserved when there is one: [`Self::admit_put`], the write without the lock,
    /// and a second lock that publishes the block.
    pub(crate) fn put_expecting(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
        expected: Option<Checksum>,
    ) -> Result<Put, StoreError> {
        let answer = match self.admit_put(caller, key, src, request, expected)? {
            Err(answer) => Ok(answer),
            Ok(admitted) => self
                .commit_payload(admitted.region, key, src, admitted.checksum, admitted.seq_epoch)
                .map(|c| Put::Committed(c.checksum))
                .or_else(|e| self.refused_if_full(e, key, src.len() as u64)),
        };
        self.compact_log();
        answer
    }

    /// The first half of a PUT of `src`, whose bytes come from the caller's buffer (never
    /// staged): one catalog lock for the reservation, the free space (from [`DiskRoom`]), the
    /// start of the commit and the sequence that names the block's file; then, without the
    /// lock, the bytes are hashed once and compared with `expected` (a mismatch ends the
    /// commit under a second lock). The answer instead when there is nothing to write, which
    /// hashes nothing: a PUT of a block already held costs no pass over its bytes.
    fn admit_put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
        expected: Option<Checksum>,
    ) -> Result<Result<AdmittedPut, Put>, StoreError> {
        let mut released = Vec::new();
        let len = src.len() as u64;
        let admitted =
            self.admit_locked(&mut self.lock(), caller, key, len, request, &mut released);
        self.dispose(released);
        let Started { region, seq_epoch } = match admitted? {
            Ok(admitted) => admitted,
            Err(answer) => return Ok(Err(answer)),
        };
        let checksum = Checksum::of(src);
        if let Some(e) = expected.filter(|&e| e != checksum) {
            let released = self.lock().fail_commit(region, Retirement::Retired);
            self.dispose(released);
            return Err(put_damaged(checksum, Some(e)));
        }
        Ok(Ok(AdmittedPut { region, checksum, seq_epoch }))
    }

    /// [`Self::admit_put`]'s part under the catalog lock: the region and the file's sequence
    /// and epoch. What the catalog gives up on the way (evicted blocks, an ended reservation)
    /// goes to `released`, to be disposed of after the lock.
    fn admit_locked(
        &self,
        catalog: &mut Catalog<FilePayload>,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
        released: &mut Vec<FilePayload>,
    ) -> Result<Result<Started, Put>, StoreError> {
        let now = self.clock.now_ms();
        let (answer, freed) = catalog
            .reserve(caller, key, len, request, now, |_| Ok(FilePayload::Staged(Vec::new())))?;
        released.extend(freed);
        let r = match answer.into_reservation() {
            Ok(r) => r,
            Err(answer) => return Ok(Err(answer)),
        };
        if let Err(refused) = self.admit_room(key, len) {
            let (_, freed) = catalog.abort(caller, r, Retirement::Retired)?;
            released.extend(freed);
            return Ok(Err(Put::Refused(refused)));
        }
        let started = match catalog.write_into(caller, &r, 0, len) {
            Ok(_) => catalog.start_commit(caller, &r).map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = started {
            // Nothing was written: end the reservation as the default `put` would.
            if let Ok((_, freed)) = catalog.abort(caller, r, e.retirement()) {
                released.extend(freed);
            }
            return Err(e);
        }
        Ok(Ok(Started {
            region: r.region,
            seq_epoch: (catalog.next_seq_reserve(), catalog.epoch().0),
        }))
    }

    /// Whether a block of `len` payload bytes under `key` fits on the device, from the store's
    /// own account of free space; the refusal when it does not. [`Self::refused_if_full`]
    /// answers the same for a write that meets a device other writers filled since.
    fn admit_room(&self, key: &PhysicalKey, len: u64) -> Result<(), Refusal> {
        let needed = self.room_needed(key, len);
        self.room
            .admit(&self.root, needed)
            .map_err(|free_bytes| Refusal::DiskFull { free_bytes, requested: needed })
    }

    /// Bytes of free space a block of `len` payload bytes under `key` is admitted with: its
    /// header, the slack the store keeps, and under the log room for its next segment (as
    /// readiness counts it).
    fn room_needed(&self, key: &PhysicalKey, len: u64) -> u64 {
        let segment = self.log.as_ref().map_or(0, |log| log.segment_bytes());
        len + layout::header_len_for(key.encoded().len()) as u64 + DISK_SLACK_BYTES + segment
    }

    /// A commit that failed with a full device (the block log could not make its next segment,
    /// or a write met a device other writers filled since the count that admitted it) is a
    /// refusal for the disk when a fresh count confirms there is no room, as the admission
    /// would have answered; any other failure stays one.
    fn refused_if_full(
        &self,
        e: StoreError,
        key: &PhysicalKey,
        len: u64,
    ) -> Result<Put, StoreError> {
        if e.io_kind() != Some(io::ErrorKind::StorageFull) {
            return Err(e);
        }
        let requested = self.room_needed(key, len);
        match free_bytes(&self.root) {
            Some(free_bytes) if free_bytes < requested => {
                Ok(Put::Refused(Refusal::DiskFull { free_bytes, requested }))
            }
            _ => Err(e),
        }
    }

    /// How many times the store asked the kernel for its free space since it opened.
    pub fn free_space_counts(&self) -> u64 {
        self.room.counts()
    }
}

impl Store for FileStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "file",
            implementation: Implementation::Real,
            failures_retire: true,
            full_policy: self.full_policy,
        }
    }

    fn epoch(&self) -> Epoch {
        self.lock().epoch()
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        authorize(caller, key, Right::Read)?;
        Ok(self.lock().lookup(key))
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        self.read_one(caller, key, dst)
    }

    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        self.lend_one(caller, key, capacity, to)
    }

    /// Pins a window of blocks under one lock, reads them with one engine batch (io_uring keeps
    /// up to its queue depth in flight), settles them under one lock; see [`reads`].
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        self.get_many(caller, items)
    }

    // `put_batch` keeps the default, one `put` after another. Each PUT's answer depends on
    // what the PUTs before it left committed: admission counts the bytes open reservations hold
    // against the tenant's in-flight limit, eviction chooses among committed blocks only (an
    // earlier item's block may be the oldest one by then), and a second PUT of a key or request
    // id answers `AlreadyCommitted` only once the first has committed. Reserving a batch
    // together and writing its files in flight would change those answers, and overlapping the
    // fsync/rename/directory-sync steps of several blocks would need all of that first; exact
    // per-key answers keep the PUTs in turn.

    /// One catalog lock per [`BATCH_WINDOW_ITEMS`] keys (lookups change nothing, so any order
    /// of them answers alike).
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        let mut answers = Vec::with_capacity(keys.len());
        for window in keys.chunks(BATCH_WINDOW_ITEMS) {
            let allowed: Vec<Result<(), StoreError>> =
                window.iter().map(|k| authorize(caller, k, Right::Read)).collect();
            let catalog = self.lock();
            answers.extend(window.iter().zip(allowed).map(|(k, a)| a.map(|()| catalog.lookup(k))));
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
        let now = self.clock.now_ms();
        let (answer, released) = self
            .lock()
            .reserve(caller, key, len, request, now, |_| Ok(FilePayload::Staged(Vec::new())))?;
        self.dispose(released);
        if let Reserve::Reserved(r) = &answer {
            // A full device is a refusal before any byte is written, not a failed commit.
            if let Err(refused) = self.admit_room(key, len) {
                let r = Reservation {
                    region: r.region,
                    epoch: r.epoch,
                    len: r.len,
                    request: r.request,
                };
                let (_, released) = self.lock().abort(caller, r, Retirement::Retired)?;
                self.dispose(released);
                return Ok(Reserve::Refused(refused));
            }
        }
        Ok(answer)
    }

    fn write(
        &self,
        caller: &Caller,
        r: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        let mut catalog = self.lock();
        let b = catalog.write_into(caller, r, offset, src.len() as u64)?;
        let len = usize::try_from(b.len).unwrap_or(usize::MAX);
        if let FilePayload::Staged(buf) = &mut b.payload {
            if buf.len() != len {
                buf.resize(len, 0);
            }
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            buf[start..start + src.len()].copy_from_slice(src);
        }
        Ok(())
    }

    /// The staged bytes are taken out, and the commit's file sequence drawn, under one lock.
    fn commit(&self, caller: &Caller, r: &Reservation) -> Result<Committed, StoreError> {
        let (key, staged, seq_epoch) = {
            let mut catalog = self.lock();
            let b = catalog.start_commit(caller, r)?;
            let staged = match &mut b.payload {
                FilePayload::Staged(buf) => std::mem::take(buf),
                FilePayload::Stored { .. } | FilePayload::Deferred { .. } => Vec::new(),
            };
            let key = b.key.clone();
            (key, staged, (catalog.next_seq_reserve(), catalog.epoch().0))
        };
        let checksum = Checksum::of(&staged);
        let committed = self.commit_payload(r.region, &key, &staged, checksum, seq_epoch);
        self.compact_log();
        committed
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        self.put_expecting(caller, key, src, request, None)
    }

    /// Each PUT in order, hashed once, in the pass that writes its header, and compared with
    /// the writer's checksum before the block is committed.
    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match expected.get(i) {
                Some(&sum) => {
                    self.put_expecting(caller, item.key, item.src, item.request, Some(sum))
                }
                None => Err(put_damaged(Checksum::of(item.src), None)),
            })
            .collect()
    }

    fn abort(
        &self,
        caller: &Caller,
        r: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        let (answer, released) = self.lock().abort(caller, r, outcome)?;
        self.dispose(released);
        Ok(answer)
    }

    /// The block leaves the catalog only once its file is gone as durably as a commit is
    /// made (ADR 0009); until then it stays readable. A removal that cannot be done is an error
    /// and changes nothing, so an acknowledged invalidation never comes back at the next open.
    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let (id, path, slot) = {
            let mut catalog = self.lock();
            let id = match catalog.removable(caller, key)? {
                Ok(id) => id,
                Err(answer) => return Ok(answer),
            };
            match catalog.entry_mut(id).map(|b| &mut b.payload) {
                Some(FilePayload::Stored { path, removing: removing @ false, slot, .. }) => {
                    *removing = true;
                    (id, path.clone(), *slot)
                }
                // No file to remove: the block leaves the catalog now.
                Some(FilePayload::Deferred { writing: false, .. }) => {
                    let released = catalog.remove_committed(id);
                    drop(catalog);
                    self.dispose(released);
                    return Ok(Invalidate::Removed);
                }
                // Another invalidation is removing it, or its deferred write is under way.
                _ => return Ok(Invalidate::Busy),
            }
        };
        let removed = self.remove_durably(&path, slot);
        let released = {
            let mut catalog = self.lock();
            match &removed {
                Err(StoreError::Storage { effect: StorageEffect::Unchanged, .. }) => {
                    if let Some(FilePayload::Stored { removing, .. }) =
                        catalog.entry_mut(id).map(|b| &mut b.payload)
                    {
                        *removing = false;
                    }
                    Vec::new()
                }
                // The file is gone (durably, or at least from the namespace): so is the block.
                _ => catalog.remove_committed(id),
            }
        };
        self.dispose(released);
        match removed {
            Ok(()) => Ok(Invalidate::Removed),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "invalidation not acknowledged");
                Err(e)
            }
        }
    }

    /// One lock to start a window of invalidations, every unlink, one sync per directory (or
    /// one group flush), one lock to finish; see [`removals`].
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        self.invalidate_many(caller, keys)
    }

    fn scope_keys(
        &self,
        caller: &Caller,
        scope: &PurgeScope,
        max: usize,
    ) -> Result<Vec<PhysicalKey>, StoreError> {
        self.lock().scope_keys(caller, scope, max)
    }

    fn expire_leases(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_ms();
        self.lock().expire_leases(now)
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        let (answer, released) = self.lock().attest_drained(caller, region)?;
        self.dispose(released);
        Ok(answer)
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        self.lock().bump_epoch()
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        let (n, released) = self.lock().reclaim_fenced(epoch)?;
        self.dispose(released);
        Ok(n)
    }

    fn stats(&self) -> StoreStats {
        self.lock().stats()
    }

    fn condition(&self) -> StoreCondition {
        StoreCondition {
            io_failure: Some(self.io_watch.failure()),
            free_bytes: free_bytes(&self.root),
            // Under the log a PUT may also need the log's next segment made.
            block_overhead_bytes: layout::header_len_for(gpucache_dataplane::key::KEY_BYTES_MAX)
                as u64
                + DISK_SLACK_BYTES
                + self.log.as_ref().map_or(0, |log| log.segment_bytes()),
        }
    }
}

impl FileStore {
    /// Removes an invalidated block (its file unlinked, or its log record marked), then makes
    /// that durable under the store's policy (see [`Self::sync_removals`]). A file already gone
    /// counts as unlinked.
    fn remove_durably(&self, path: &Path, slot: Option<LogSlot>) -> Result<(), StoreError> {
        self.unlink_block(path, slot)?;
        self.sync_removals(path.parent().unwrap_or(&self.root))
    }

    /// Reads the payload of `region`'s block file (its kept descriptor, or `path` opened) into
    /// `dst`; under O_DIRECT through aligned staging, unless `dst` is aligned for it already.
    /// The caller holds a read pin on `region`.
    fn read_payload(
        &self,
        open_as: OpenId,
        path: &Path,
        header_len: u64,
        dst: &mut [u8],
    ) -> io::Result<()> {
        let file = self.files.get(open_as, path, self.direct_io)?;
        if self.direct_io && !engine::direct_ready(dst) {
            let padded = engine::round_up(dst.len(), engine::DIRECT_ALIGN);
            let mut staging = self.engine.staging_for_read(padded)?;
            self.engine.read_exact_at(&file, header_len, &mut staging[..padded])?;
            dst.copy_from_slice(&staging[..dst.len()]);
            Ok(())
        } else {
            // Buffered, or a destination O_DIRECT can fill as it is: no staging, no copy.
            self.engine.read_exact_at(&file, header_len, dst)
        }
    }
}
