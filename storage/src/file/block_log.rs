//! The block log of [`Layout::Log`](super::Layout::Log): small blocks live in append-only
//! segment files instead of a file each, so that a PUT creates no inode and renames nothing, and
//! a durable PUT costs a share of one `fdatasync` of a file that already exists.
//!
//! A segment `log/<n>.log` is made full of zeros and flushed before it is used
//! ([`LOG_SEGMENT_BYTES`]), so an append changes neither the file's size nor its extents and its
//! flush writes data only. A thread of the log's own prepares the next segment while the current
//! one fills, and deletes segments that no block lives in any more.
//!
//! Each block is one record: a 32-byte frame (magic, kind, a state byte, body length, commit
//! sequence, a check of the frame without its state byte), then the block's header and payload
//! exactly as a block file holds them, so the header's checksum covers the payload. A PUT is
//! acknowledged once its record and every record reserved before it in its segment are written
//! (durability `none`), and once a flush of the log shared by every commit waiting then covers
//! it (`group`, `per-block`). Appends reserve their space in turn but write at once, so a small
//! record can finish while a large one before it is still being written; waiting for the earlier
//! ones keeps every acknowledged record before the first gap an open can find. Removing a block (eviction,
//! invalidation, a newer version of its key) writes the record's state byte in place: a one-byte
//! write, never torn, that the frame's check leaves out. A segment whose every record is dead,
//! and that is no longer appended to, is deleted.
//!
//! At open, [`scan`] reads the frame and header of every record of every segment (not the
//! payloads: a read checks those, as it checks a block file's). The first record whose frame or
//! header does not check ends its segment: it was never acknowledged, and nothing after it was
//! either.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::KeyDecoder;

use super::layout::{self, BlockHeader};
use super::open_files::OpenFiles;
use super::sync::{GroupSync, sync_dir};

/// The log's directory under the store root.
pub const LOG_DIR: &str = "log";
/// Default bytes of one log segment (preallocated); `FileStoreConfig::log_segment_bytes`.
pub const LOG_SEGMENT_BYTES: u64 = 64 << 20;
/// Fewest bytes a log segment may have.
pub const LOG_SEGMENT_BYTES_MIN: u64 = 1 << 20;
/// Largest payload kept in the log; a larger block gets a file of its own, whose one write
/// costs less than the segment space it would hold.
pub const LOG_BLOCK_BYTES_MAX: u64 = 4 << 20;
/// Jobs (segments to prepare or to delete) queued for the log's thread at most; an append that
/// rotates while the queue is full waits up to [`SPARE_WAIT`], then fails.
const JOBS_MAX: usize = 8;
/// Bytes of a record's frame: magic, kind, state, padding, body length, commit sequence, check.
const FRAME_BYTES: usize = 32;
const RECORD_MAGIC: [u8; 4] = *b"GPCL";
/// The kind of a block record.
const BLOCK: u8 = 1;
/// Where a frame's state byte is: zero while the block lives, [`DEAD`] once it is removed.
const STATE_AT: usize = 5;
const DEAD: u8 = 0xDE;
/// Records start at multiples of this.
const RECORD_ALIGN: u64 = 8;
/// A sealed segment whose live records fill less than this percentage of it is compacted (its live
/// blocks appended again, then the segment deleted) after a rotation; one per rotation.
pub const COMPACT_LIVE_PERCENT: u64 = 50;

/// Where a block's record is: its segment, the offset of its frame, and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogSlot {
    pub segment: u64,
    pub record: u64,
    pub bytes: u64,
}

fn frame_check(f: &[u8]) -> u64 {
    let mut covered = [0u8; 24];
    covered.copy_from_slice(&f[..24]);
    covered[STATE_AT] = 0;
    Checksum::of(&covered).0
}

fn frame(body_len: u64, seq: u64) -> [u8; FRAME_BYTES] {
    let mut f = [0u8; FRAME_BYTES];
    f[..4].copy_from_slice(&RECORD_MAGIC);
    f[4] = BLOCK;
    f[8..16].copy_from_slice(&body_len.to_le_bytes());
    f[16..24].copy_from_slice(&seq.to_le_bytes());
    let check = frame_check(&f);
    f[24..32].copy_from_slice(&check.to_le_bytes());
    f
}

/// A whole frame's body length, sequence and whether its block was removed; `None` when it is
/// not a frame (a zero tail, or a record cut short).
fn parse_frame(f: &[u8]) -> Option<(u64, u64, bool)> {
    let word = |at: usize| u64::from_le_bytes(f[at..at + 8].try_into().unwrap_or_default());
    let valid = f.len() >= FRAME_BYTES
        && f[..4] == RECORD_MAGIC
        && f[4] == BLOCK
        && matches!(f[STATE_AT], 0 | DEAD)
        && word(24) == frame_check(f);
    valid.then(|| (word(8), word(16), f[STATE_AT] == DEAD))
}

fn record_len(body_len: u64) -> u64 {
    (FRAME_BYTES as u64 + body_len).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

pub(crate) fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:016}.log"))
}

/// The segments under `dir`, oldest first.
fn segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    match fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries {
                let path = entry?.path();
                let number = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".log"))
                    .and_then(|n| n.parse::<u64>().ok());
                if let Some(number) = number {
                    found.push((number, path));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    found.sort();
    Ok(found)
}

/// Makes segment `number` under `dir`: `bytes` of zeros written and flushed, and its name
/// durable.
fn new_segment(dir: &Path, number: u64, bytes: u64) -> io::Result<File> {
    let file = zeroed_file(&segment_path(dir, number), bytes)?;
    sync_dir(dir)?;
    Ok(file)
}

/// A new file of `bytes` zeros at `path`, flushed; nothing is left at `path` when it fails.
fn zeroed_file(path: &Path, bytes: u64) -> io::Result<File> {
    let made = (|| {
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        let zeros = vec![0u8; ZERO_CHUNK_BYTES];
        let mut at = 0;
        let mut before: Option<(u64, usize)> = None;
        while at < bytes {
            let n = usize::try_from((bytes - at).min(ZERO_CHUNK_BYTES as u64)).unwrap_or(0);
            file.write_all_at(&zeros[..n], at)?;
            // A chunk at a time to the device: this chunk's write starts now and the one before
            // it is waited for, so that a PUT's flush of the active segment meanwhile never waits
            // behind a whole new segment (the flush below makes it durable either way).
            start_writeback(&file, at, n, false);
            if let Some((at, n)) = before {
                start_writeback(&file, at, n, true);
            }
            before = Some((at, n));
            at += n as u64;
        }
        file.sync_all()?;
        Ok(file)
    })();
    if made.is_err() {
        let _ = fs::remove_file(path);
    }
    made
}

/// Starts writing `n` bytes of `file` at `at` to the device (`sync_file_range`), and with
/// `wait` waits for them to be written. Best effort: the caller's flush is what counts.
fn start_writeback(file: &File, at: u64, n: usize, wait: bool) {
    use std::os::fd::AsRawFd as _;
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    let (Ok(at), Ok(n)) = (i64::try_from(at), i64::try_from(n)) else { return };
    // SAFETY: sync_file_range(2) on a descriptor we own; it reads no memory of ours.
    let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), at, n, flags) };
}

/// The log's first segment of an open, zeroed on a thread of its own while the open reads the
/// store (under the store's `tmp` directory, which every open empties first), then named into
/// the log by [`BlockLog::open`].
pub(crate) struct Premade {
    path: PathBuf,
    bytes: u64,
    made: Option<std::thread::JoinHandle<io::Result<File>>>,
}

impl Premade {
    /// Starts zeroing a segment of `bytes` at `path` (a fresh name in the store's `tmp`).
    pub(crate) fn start(path: PathBuf, bytes: u64) -> Self {
        let at = path.clone();
        let made = std::thread::Builder::new()
            .name("gpucache-segment".into())
            .spawn(move || zeroed_file(&at, bytes))
            .ok();
        Self { path, bytes, made }
    }

    /// The segment, named segment `number` in `dir`, when it was made whole at `bytes`; `None`
    /// otherwise (nothing of it is left then, and the caller makes one itself).
    fn take(mut self, dir: &Path, number: u64, bytes: u64) -> Option<File> {
        // A failed zeroing left nothing behind.
        let file = self.made.take()?.join().ok()?.ok()?;
        let target = segment_path(dir, number);
        if self.bytes != bytes || fs::rename(&self.path, &target).is_err() {
            let _ = fs::remove_file(&self.path);
            return None;
        }
        if sync_dir(dir).is_err() {
            let _ = fs::remove_file(&target);
            return None;
        }
        Some(file)
    }
}

impl Drop for Premade {
    /// A premade segment the open did not take (it failed first) is waited for and removed.
    fn drop(&mut self) {
        if let Some(made) = self.made.take() {
            let _ = made.join();
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// One segment of a running log.
#[derive(Debug)]
struct Segment {
    file: Arc<File>,
    /// Records in it whose blocks live.
    live: u64,
    /// Bytes of those records.
    live_bytes: u64,
    /// The first record of it whose write failed. An open ends the segment there, so no later
    /// record of it may be acknowledged.
    failed_at: Option<u64>,
}

impl Segment {
    fn new(file: Arc<File>) -> Self {
        Self { file, live: 0, live_bytes: 0, failed_at: None }
    }
}

/// Every segment that holds a live block or is appended to, and the ones whose state bytes
/// changed since the last flush.
#[derive(Debug, Default)]
struct Segments {
    by_number: BTreeMap<u64, Segment>,
    /// The segment appends go to, and where the next record starts in it.
    active: u64,
    at: u64,
    /// Sealed segments written since the last flush (a record appended before a rotation, a
    /// removal's state byte): the next group flush covers them.
    unflushed: BTreeMap<u64, Arc<File>>,
    /// Rotations since the store last looked for a segment to compact.
    rotated: bool,
    /// The segment the log's thread was asked to make and the log has not taken yet.
    preparing: Option<u64>,
    /// Segments compacted, and the bytes of live records they moved.
    compactions: u64,
    moved_bytes: u64,
    /// Slots (segment, record) reserved and not yet written: one per append under way, so at
    /// most as many as threads appending.
    unwritten: BTreeSet<(u64, u64)>,
}

/// What the log's thread does.
enum Job {
    /// Make segment `n` and leave it in the spare slot.
    Prepare(u64),
    /// Delete a segment no block lives in.
    Delete(PathBuf),
}

/// The segment the log's thread prepared, or why it could not.
type SpareSlot = Arc<(Mutex<Option<(u64, io::Result<File>)>>, Condvar)>;

/// How often a full job queue is looked at again.
const QUEUE_POLL: Duration = Duration::from_millis(5);
/// How long a rotation waits for the prepared segment before it makes one itself, and for room
/// in the job queue before the append fails.
const SPARE_WAIT: Duration = Duration::from_secs(30);
/// How long an append whose record is written waits for the records reserved before it in its
/// segment (each is one write of at most [`LOG_BLOCK_BYTES_MAX`] bytes into the page cache).
const EARLIER_WAIT: Duration = Duration::from_secs(30);
/// Zeros written per call when a segment is made.
const ZERO_CHUNK_BYTES: usize = 256 << 10;

/// How many bytes and blocks a log holds, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogUsage {
    pub segments: u64,
    pub segment_bytes: u64,
    pub live_blocks: u64,
    pub live_bytes: u64,
    /// Segments compacted since the store opened, and the bytes of live records they moved.
    pub compactions: u64,
    pub moved_bytes: u64,
}

/// The block log of a running store (see the module documentation).
pub(crate) struct BlockLog {
    dir: PathBuf,
    segment_bytes: u64,
    segments: Arc<Mutex<Segments>>,
    /// Signalled, with `segments` locked, each time a reserved slot is written or fails.
    written: Condvar,
    group: GroupSync,
    spare: SpareSlot,
    files: Arc<OpenFiles>,
    jobs: Option<SyncSender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for BlockLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockLog").field("dir", &self.dir).finish_non_exhaustive()
    }
}

fn lock(segments: &Mutex<Segments>) -> MutexGuard<'_, Segments> {
    segments.lock().unwrap_or_else(PoisonError::into_inner)
}

impl BlockLog {
    /// Starts the log under `root`: the segments `scanned` found (each starts with no live
    /// block; [`Self::restored`] counts them back) and a new active segment after them, in
    /// segments of `segment_bytes`, with group flushes that give up after `deadline`. Kept
    /// descriptors of deleted segments are dropped from `files`.
    pub(crate) fn open(
        root: &Path,
        scanned: &Scanned,
        segment_bytes: u64,
        deadline: Duration,
        files: Arc<OpenFiles>,
        premade: Option<Premade>,
    ) -> io::Result<Self> {
        let dir = root.join(LOG_DIR);
        fs::create_dir_all(&dir)?;
        sync_dir(root)?;
        let mut by_number = BTreeMap::new();
        for &number in &scanned.segments {
            let file =
                OpenOptions::new().read(true).write(true).open(segment_path(&dir, number))?;
            by_number.insert(number, Segment::new(Arc::new(file)));
        }
        let first = scanned.next_segment;
        let file = match premade.and_then(|p| p.take(&dir, first, segment_bytes)) {
            Some(file) => file,
            None => new_segment(&dir, first, segment_bytes)?,
        };
        let file = Arc::new(file);
        by_number.insert(first, Segment::new(file));
        let segments = Arc::new(Mutex::new(Segments {
            by_number,
            active: first,
            at: 0,
            unflushed: BTreeMap::new(),
            // Segments found at open may be mostly dead: the first PUT looks.
            rotated: true,
            preparing: Some(first + 1),
            compactions: 0,
            moved_bytes: 0,
            unwritten: BTreeSet::new(),
        }));
        let flushed = Arc::clone(&segments);
        let group = GroupSync::new(
            Box::new(move || {
                // The active segment and every sealed one written since the last flush.
                let (active, sealed) = {
                    let mut s = lock(&flushed);
                    let active = s.by_number.get(&s.active).map(|seg| Arc::clone(&seg.file));
                    (active, std::mem::take(&mut s.unflushed))
                };
                for (n, file) in &sealed {
                    if let Err(e) = file.sync_data() {
                        // Flushed again next time: a later barrier may not skip them.
                        let mut s = lock(&flushed);
                        for (n, file) in sealed.iter().filter(|(m, _)| *m >= n) {
                            s.unflushed.insert(*n, Arc::clone(file));
                        }
                        return Err(e);
                    }
                }
                active.map_or(Ok(()), |f| f.sync_data())
            }),
            deadline,
        );
        let (jobs, queue) = sync_channel::<Job>(JOBS_MAX);
        let spare: SpareSlot = Arc::default();
        let (log_dir, prepared) = (dir.clone(), Arc::clone(&spare));
        let worker = std::thread::Builder::new().name("gpucache-log".into()).spawn(move || {
            for job in queue {
                match job {
                    Job::Prepare(n) => {
                        let made = new_segment(&log_dir, n, segment_bytes);
                        let (slot, ready) = &*prepared;
                        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some((n, made));
                        ready.notify_all();
                    }
                    Job::Delete(segment) => {
                        if let Err(e) = fs::remove_file(&segment)
                            && e.kind() != io::ErrorKind::NotFound
                        {
                            tracing::warn!(segment = %segment.display(), error = %e,
                                "could not delete an empty log segment; the next open does");
                        }
                    }
                }
            }
        })?;
        let log = Self {
            dir,
            segment_bytes,
            segments,
            written: Condvar::new(),
            group,
            spare,
            files,
            jobs: Some(jobs),
            worker: Some(worker),
        };
        log.queue(Job::Prepare(first + 1))?;
        Ok(log)
    }

    /// Bytes of each new segment.
    pub(crate) fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// The path of segment `number`.
    pub(crate) fn path_of(&self, number: u64) -> PathBuf {
        segment_path(&self.dir, number)
    }

    /// Whether a block with a `header_len`-byte header and a `payload_len`-byte payload lives in
    /// the log: at most [`LOG_BLOCK_BYTES_MAX`] of payload, and a record that fits a segment.
    pub(crate) fn takes(&self, header_len: usize, payload_len: usize) -> bool {
        let body = (header_len + payload_len) as u64;
        payload_len as u64 <= LOG_BLOCK_BYTES_MAX && record_len(body) <= self.segment_bytes
    }

    /// Counts the blocks the open restored as living in their segments: `live` holds, per
    /// segment, how many records and bytes.
    pub(crate) fn restored(&self, live: &BTreeMap<u64, (u64, u64)>) {
        let mut s = lock(&self.segments);
        for (n, (records, bytes)) in live {
            if let Some(seg) = s.by_number.get_mut(n) {
                seg.live += records;
                seg.live_bytes += bytes;
            }
        }
    }

    /// Deletes every segment the open found with no live block in it.
    pub(crate) fn drop_empty(&self) -> io::Result<()> {
        let empty: Vec<u64> = {
            let mut s = lock(&self.segments);
            let active = s.active;
            let empty: Vec<u64> = s
                .by_number
                .iter()
                .filter(|(n, seg)| **n != active && seg.live == 0)
                .map(|(n, _)| *n)
                .collect();
            for n in &empty {
                s.by_number.remove(n);
            }
            empty
        };
        for n in empty {
            self.files.forget_segment(n);
            self.queue(Job::Delete(self.path_of(n)))?;
        }
        Ok(())
    }

    /// Appends the record of a block (`header` as a block file starts, then `payload`): where
    /// it is, and the offset of its payload in the segment. Returns once the record and every
    /// record reserved before it in its segment are written; durable once [`Self::barrier`]
    /// returns.
    pub(crate) fn append(
        &self,
        seq: u64,
        header: &[u8],
        payload: &[u8],
    ) -> io::Result<(LogSlot, u64)> {
        let body_len = (header.len() + payload.len()) as u64;
        let (file, slot) = self.reserve(record_len(body_len))?;
        // The space is this record's: the write needs no lock.
        let mut head = Vec::with_capacity(FRAME_BYTES + header.len());
        head.extend_from_slice(&frame(body_len, seq));
        head.extend_from_slice(header);
        // The payload first: a process killed between the two writes leaves no frame, so no
        // record that would read as damaged.
        let written = file
            .write_all_at(payload, slot.record + head.len() as u64)
            .and_then(|()| file.write_all_at(&head, slot.record));
        self.settle(slot, written)?;
        Ok((slot, slot.record + head.len() as u64))
    }

    /// Reserves `len` bytes at the head of the log for a record, rotating to a new segment when
    /// the active one has no room; the slot counts as live and unwritten.
    fn reserve(&self, len: u64) -> io::Result<(Arc<File>, LogSlot)> {
        if len > self.segment_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a {len}-byte log record is larger than a segment"),
            ));
        }
        let mut s = lock(&self.segments);
        if s.at + len > self.segment_bytes {
            self.rotate(&mut s)?;
        }
        let slot = LogSlot { segment: s.active, record: s.at, bytes: len };
        let Some(seg) = s.by_number.get_mut(&slot.segment) else {
            return Err(io::Error::other("the active log segment is missing"));
        };
        seg.live += 1;
        seg.live_bytes += len;
        let file = Arc::clone(&seg.file);
        s.at += len;
        s.unwritten.insert((slot.segment, slot.record));
        Ok((file, slot))
    }

    /// Ends the write of the record at `slot`: `Ok` once it and every record reserved before it
    /// in its segment are written. A failed write, or an earlier record of the segment that
    /// failed or was not written in time, fails it and gives the slot back as dead: an open ends
    /// the segment at the first record that does not check, so this one would not be found.
    fn settle(&self, slot: LogSlot, written: io::Result<()>) -> io::Result<()> {
        let mut s = lock(&self.segments);
        s.unwritten.remove(&(slot.segment, slot.record));
        self.written.notify_all();
        let outcome = match written {
            Err(e) => {
                // Later records go to the next segment, where nothing hides them.
                if s.active == slot.segment {
                    s.at = self.segment_bytes;
                }
                if let Some(seg) = s.by_number.get_mut(&slot.segment) {
                    seg.failed_at = Some(seg.failed_at.map_or(slot.record, |f| f.min(slot.record)));
                }
                Err(e)
            }
            Ok(()) => {
                let deadline = Instant::now() + EARLIER_WAIT;
                let earlier = (slot.segment, 0)..(slot.segment, slot.record);
                while s.unwritten.range(earlier.clone()).next().is_some() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    s = self
                        .written
                        .wait_timeout(s, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                let failed_before = s
                    .by_number
                    .get(&slot.segment)
                    .is_none_or(|seg| seg.failed_at.is_some_and(|f| f < slot.record));
                if s.unwritten.range(earlier).next().is_some() {
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "an earlier record of log segment {} was not written in {EARLIER_WAIT:?}",
                            slot.segment
                        ),
                    ))
                } else if failed_before {
                    Err(io::Error::other(format!(
                        "an earlier record of log segment {} could not be written",
                        slot.segment
                    )))
                } else {
                    Ok(())
                }
            }
        };
        drop(s);
        if outcome.is_err() {
            let _ = self.kill(slot);
        }
        outcome
    }

    /// Returns once every record appended and every removal written before the call is
    /// durable.
    pub(crate) fn barrier(&self) -> io::Result<()> {
        self.group.barrier()
    }

    /// Marks the block at `slot` removed: its state byte written in place, made durable by the
    /// next [`Self::barrier`]. A segment left with no live block, and not appended to, is
    /// deleted.
    pub(crate) fn kill(&self, slot: LogSlot) -> io::Result<()> {
        let file = {
            let s = lock(&self.segments);
            match s.by_number.get(&slot.segment) {
                Some(seg) => Arc::clone(&seg.file),
                None => return Ok(()),
            }
        };
        file.write_all_at(&[DEAD], slot.record + STATE_AT as u64)?;
        let emptied = {
            let mut s = lock(&self.segments);
            let active = s.active;
            let Some(seg) = s.by_number.get_mut(&slot.segment) else { return Ok(()) };
            seg.live = seg.live.saturating_sub(1);
            seg.live_bytes = seg.live_bytes.saturating_sub(slot.bytes);
            if seg.live == 0 && slot.segment != active {
                s.by_number.remove(&slot.segment);
                s.unflushed.remove(&slot.segment);
                true
            } else {
                if slot.segment != active {
                    s.unflushed.insert(slot.segment, file);
                }
                false
            }
        };
        if emptied {
            self.files.forget_segment(slot.segment);
            self.queue(Job::Delete(self.path_of(slot.segment)))?;
        }
        Ok(())
    }

    /// What the log holds now.
    pub(crate) fn usage(&self) -> LogUsage {
        let s = lock(&self.segments);
        LogUsage {
            segments: s.by_number.len() as u64,
            segment_bytes: s.by_number.len() as u64 * self.segment_bytes,
            live_blocks: s.by_number.values().map(|seg| seg.live).sum(),
            live_bytes: s.by_number.values().map(|seg| seg.live_bytes).sum(),
            compactions: s.compactions,
            moved_bytes: s.moved_bytes,
        }
    }

    /// After a rotation (once per rotation): the sealed segment with the fewest live bytes, when
    /// they fill less than [`COMPACT_LIVE_PERCENT`] of it, and its file.
    pub(crate) fn compaction_due(&self) -> Option<(u64, Arc<File>)> {
        let mut s = lock(&self.segments);
        if !std::mem::take(&mut s.rotated) {
            return None;
        }
        let active = s.active;
        let limit = self.segment_bytes / 100 * COMPACT_LIVE_PERCENT;
        s.by_number
            .iter()
            .filter(|(n, seg)| **n != active && seg.live > 0 && seg.live_bytes < limit)
            .min_by_key(|(_, seg)| seg.live_bytes)
            .map(|(n, seg)| (*n, Arc::clone(&seg.file)))
    }

    /// Counts a compaction that moved `bytes` of live records.
    pub(crate) fn compacted(&self, bytes: u64) {
        let mut s = lock(&self.segments);
        s.compactions += 1;
        s.moved_bytes += bytes;
    }

    /// The header and payload of the record at `slot` in `file`, read for a compaction.
    pub(crate) fn read_body(file: &File, slot: LogSlot) -> io::Result<Vec<u8>> {
        let mut frame = [0u8; FRAME_BYTES];
        file.read_exact_at(&mut frame, slot.record)?;
        let (body_len, _, _) = parse_frame(&frame)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a damaged log frame"))?;
        let len = usize::try_from(body_len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a log record too long"))?;
        let mut body = vec![0u8; len];
        file.read_exact_at(&mut body, slot.record + FRAME_BYTES as u64)?;
        Ok(body)
    }

    /// Replaces the full active segment by the next one (the one the log's thread prepared, or
    /// one made here when it could not). The full one joins the segments the next flush covers,
    /// or is deleted when no block lives in it any more.
    fn rotate(&self, s: &mut Segments) -> io::Result<()> {
        let number = s.active + 1;
        // Waits for the log's thread only when it was asked for this segment and has not
        // answered yet; after a failed try (a full disk) each append tries again at once.
        let spare = if s.preparing.take() == Some(number) { self.take_spare(number) } else { None };
        let file = match spare {
            Some(Ok(file)) => file,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the block log could not prepare a segment; making it now");
                new_segment(&self.dir, number, self.segment_bytes)?
            }
            None => new_segment(&self.dir, number, self.segment_bytes)?,
        };
        let old = s.active;
        s.by_number.insert(number, Segment::new(Arc::new(file)));
        s.active = number;
        s.at = 0;
        s.rotated = true;
        let old_empty = s.by_number.get(&old).is_some_and(|seg| seg.live == 0);
        if old_empty {
            s.by_number.remove(&old);
            self.files.forget_segment(old);
            self.queue(Job::Delete(self.path_of(old)))?;
        } else if let Some(seg) = s.by_number.get(&old) {
            s.unflushed.insert(old, Arc::clone(&seg.file));
        }
        // A job that cannot be queued in time fails this append (nothing is acknowledged); the
        // next rotation makes its segment itself.
        self.queue(Job::Prepare(number + 1))?;
        s.preparing = Some(number + 1);
        Ok(())
    }

    /// Hands `job` to the log's thread, waiting up to [`SPARE_WAIT`] while [`JOBS_MAX`] jobs
    /// are queued already.
    fn queue(&self, job: Job) -> io::Result<()> {
        let Some(jobs) = &self.jobs else { return Ok(()) };
        let deadline = Instant::now() + SPARE_WAIT;
        let mut job = job;
        loop {
            match jobs.try_send(job) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => {
                    return Err(io::Error::other("the block log's thread is gone"));
                }
                Err(TrySendError::Full(back)) => job = back,
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the block log's thread is behind (segments wait to be made or deleted)",
                ));
            }
            std::thread::park_timeout(QUEUE_POLL);
        }
    }

    /// The prepared segment `number`, waiting for it up to [`SPARE_WAIT`]; `None` when it did
    /// not come (an attempt that failed comes as its error).
    fn take_spare(&self, number: u64) -> Option<io::Result<File>> {
        let (slot, ready) = &*self.spare;
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        let deadline = Instant::now() + SPARE_WAIT;
        loop {
            match slot.take() {
                Some((n, made)) if n == number => return Some(made),
                // Another number is of no use: the log moved on without it.
                Some(_) | None => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            slot = ready.wait_timeout(slot, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Drop for BlockLog {
    /// Stops the log's thread once its jobs are done, and removes the prepared segment.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        let spare = self.spare.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some((n, Ok(_))) = spare {
            let _ = fs::remove_file(segment_path(&self.dir, n));
        }
    }
}

/// What an open found in the block log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogOpened {
    /// Segments found.
    pub segments: u64,
    /// Live block records found (an older version of a key among them is removed at open).
    pub blocks: u64,
    /// Records of removed blocks passed over.
    pub dead: u64,
    /// Segments whose records ended in a record cut short or damaged (never acknowledged).
    pub torn: u64,
    /// Whether the live records came from the index a clean close wrote (then no record was
    /// read, and `dead` and `torn` are not counted).
    pub indexed: bool,
}

impl Scanned {
    pub(crate) fn opened(&self) -> LogOpened {
        LogOpened {
            segments: self.segments.len() as u64,
            blocks: self.blocks.len() as u64,
            dead: self.dead,
            torn: self.torn,
            indexed: self.indexed,
        }
    }
}

/// A committed block found at open: its header, the file that holds it (a log segment, or a
/// block file), where its payload starts there, and its record when it is in the log.
#[derive(Debug)]
pub(crate) struct Found {
    pub header: BlockHeader,
    /// The segment or block file; the records of one segment share it.
    pub path: Arc<Path>,
    /// Offset of the payload in the file.
    pub payload_at: u64,
    /// Where its record is: `None` for a block file.
    pub slot: Option<LogSlot>,
}

/// What [`scan`] found under a store's log directory.
#[derive(Debug, Default)]
pub(crate) struct Scanned {
    /// Every live block record, oldest segment first.
    pub blocks: Vec<Found>,
    /// Every segment, oldest first.
    pub segments: Vec<u64>,
    /// Records whose block was removed.
    pub dead: u64,
    /// Segments whose records ended before a zero tail (a record cut short or damaged).
    pub torn: u64,
    /// Whether `blocks` came from the index of a clean close: then they are one per key, oldest
    /// commit first.
    pub indexed: bool,
    /// The number a new segment takes: after every one seen.
    pub next_segment: u64,
}

/// Bytes read at once while scanning a segment: one read covers many small records' frames and
/// headers.
const SCAN_READ_BYTES: usize = 1 << 20;

/// The segments under `root`'s log directory, oldest first, and the number a new one takes.
pub(crate) fn segment_numbers(root: &Path) -> io::Result<(Vec<u64>, u64)> {
    let found = segments(&root.join(LOG_DIR))?;
    let next = found.last().map_or(1, |(n, _)| n + 1);
    Ok((found.into_iter().map(|(n, _)| n).collect(), next))
}

/// The live records of the block log under `root`, from the frames and headers of every
/// segment.
pub(crate) fn scan(root: &Path) -> io::Result<Scanned> {
    let dir = root.join(LOG_DIR);
    let found = segments(&dir)?;
    let mut done = Scanned {
        segments: found.iter().map(|(n, _)| *n).collect(),
        next_segment: found.last().map_or(1, |(n, _)| n + 1),
        ..Scanned::default()
    };
    for (number, path) in found {
        scan_segment(number, &path, &mut done)?;
    }
    Ok(done)
}

/// The live records of segment `number` of the log under `root`, read as an open reads them
/// (for a compaction, which moves them).
pub(crate) fn live_records(root: &Path, number: u64) -> io::Result<Vec<Found>> {
    let mut done = Scanned::default();
    scan_segment(number, &segment_path(&root.join(LOG_DIR), number), &mut done)?;
    Ok(done.blocks)
}

/// Reads the frames and headers of segment `number` at `path` into `done`, up to its first
/// record that does not check.
fn scan_segment(number: u64, path: &Path, done: &mut Scanned) -> io::Result<()> {
    let file = File::open(path)?;
    let shared: Arc<Path> = path.into();
    let size = file.metadata()?.len();
    let mut keys = KeyDecoder::new();
    let mut window =
        Window { file: &file, size, start: 0, bytes: Vec::new(), ahead: SCAN_READ_BYTES };
    let mut at = 0u64;
    // A frame and the smallest header (4 KiB): one read for most records.
    let head_len = FRAME_BYTES + layout::header_len_for(0);
    while let Some(head) = window.get(at, head_len)? {
        let Some((body_len, seq, dead)) = parse_frame(head) else {
            if head.iter().any(|&b| b != 0) {
                done.torn += 1;
            }
            break;
        };
        let len = record_len(body_len);
        if at + len > size {
            done.torn += 1;
            break;
        }
        if !dead {
            let header_len = layout::declared_header_len(&head[FRAME_BYTES..]).ok();
            let header = match header_len {
                Some(n) => window
                    .get(at + FRAME_BYTES as u64, n)?
                    .and_then(|bytes| layout::decode_header_with(bytes, &mut keys).ok()),
                None => None,
            };
            // A header that does not check, or that does not fit its record, was cut short.
            let Some(header) = header.filter(|h| {
                h.seq == seq && h.header_len.checked_add(h.payload_len) == Some(body_len)
            }) else {
                done.torn += 1;
                break;
            };
            let payload_at = at + FRAME_BYTES as u64 + header.header_len;
            done.blocks.push(Found {
                header,
                path: Arc::clone(&shared),
                payload_at,
                slot: Some(LogSlot { segment: number, record: at, bytes: len }),
            });
        } else {
            done.dead += 1;
        }
        // Read ahead past small records only: a larger one's payload is not read.
        window.ahead = if len <= SCAN_AHEAD_RECORD_MAX { SCAN_READ_BYTES } else { 0 };
        at += len;
    }
    Ok(())
}

/// Records up to this many bytes are read whole while scanning (many of them per read); the
/// frame and header of a larger one are read alone.
const SCAN_AHEAD_RECORD_MAX: u64 = 16 << 10;

/// A read-ahead window over a segment.
struct Window<'a> {
    file: &'a File,
    size: u64,
    start: u64,
    bytes: Vec<u8>,
    /// Bytes a read that misses the window reads at least.
    ahead: usize,
}

impl Window<'_> {
    /// `len` bytes at `at`, reading ahead when they are not in the window; `None` past the end.
    fn get(&mut self, at: u64, len: usize) -> io::Result<Option<&[u8]>> {
        if at + len as u64 > self.size {
            return Ok(None);
        }
        let inside = at >= self.start && at + len as u64 <= self.start + self.bytes.len() as u64;
        if !inside {
            let want =
                usize::try_from((self.size - at).min(self.ahead.max(len) as u64)).unwrap_or(len);
            self.bytes.resize(want, 0);
            self.file.read_exact_at(&mut self.bytes, at)?;
            self.start = at;
        }
        let from = usize::try_from(at - self.start).unwrap_or(0);
        Ok(self.bytes.get(from..from + len))
    }
}

/// Marks the record at `slot` under `root` removed, for an open that found it stale (an older
/// version of a key) before the log runs.
pub(crate) fn kill_at(root: &Path, slot: LogSlot) -> io::Result<()> {
    let path = segment_path(&root.join(LOG_DIR), slot.segment);
    OpenOptions::new().write(true).open(path)?.write_all_at(&[DEAD], slot.record + STATE_AT as u64)
}

#[cfg(test)]
mod tests {
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::testing::fixture;

    use super::*;

    #[test]
    fn frames_round_trip_the_state_byte_is_outside_the_check_and_damage_is_refused() {
        let f = frame(70_000, 42);
        assert_eq!(parse_frame(&f), Some((70_000, 42, false)));
        let mut dead = f;
        dead[STATE_AT] = DEAD;
        assert_eq!(parse_frame(&dead), Some((70_000, 42, true)));
        for i in [0, 4, 9, 17, 30] {
            let mut bad = f;
            bad[i] ^= 1;
            assert_eq!(parse_frame(&bad), None, "byte {i}");
        }
        let mut other = f;
        other[STATE_AT] = 7;
        assert_eq!(parse_frame(&other), None, "a state byte that is neither live nor dead");
        assert_eq!(parse_frame(&[0u8; FRAME_BYTES]), None, "a preallocated zero tail");
        assert_eq!(record_len(0), 32);
        assert_eq!(record_len(1), 40);
    }

    /// A segment zeroed beforehand becomes the log's first one under the log's own name, with
    /// nothing left in `tmp`; one made for another size, or never taken, is removed.
    #[test]
    fn a_premade_segment_is_named_into_the_log_or_removed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let tmp = root.join("tmp");
        fs::create_dir_all(&tmp).expect("tmp dir");
        let files = Arc::new(OpenFiles::new(std::num::NonZeroUsize::MIN));
        let scanned = Scanned { next_segment: 3, ..Scanned::default() };
        let bytes = LOG_SEGMENT_BYTES_MIN;
        let premade = Premade::start(tmp.join("segment.new"), bytes);
        let log =
            BlockLog::open(root, &scanned, bytes, Duration::from_secs(30), files, Some(premade))
                .expect("open the log");
        let first = segment_path(&root.join(LOG_DIR), 3);
        assert_eq!(fs::metadata(&first).expect("segment 3").len(), bytes);
        assert!(fs::read(&first).expect("read segment 3").iter().all(|&b| b == 0));
        assert_eq!(fs::read_dir(&tmp).expect("tmp").count(), 0, "nothing left in tmp");
        drop(log);

        let log_dir = root.join(LOG_DIR);
        let taken = Premade::start(tmp.join("segment.new"), bytes).take(&log_dir, 5, bytes);
        let taken = taken.expect("a whole premade segment is taken");
        assert_eq!(taken.metadata().expect("its size").len(), bytes);
        assert_eq!(fs::metadata(segment_path(&log_dir, 5)).expect("segment 5").len(), bytes);
        assert_eq!(fs::read_dir(&tmp).expect("tmp").count(), 0);
        let other = Premade::start(tmp.join("segment.new"), 2 * bytes);
        assert!(other.take(&log_dir, 9, bytes).is_none(), "made for another size");
        assert!(!segment_path(&log_dir, 9).exists());
        let unused = Premade::start(tmp.join("segment.new"), bytes);
        drop(unused);
        assert_eq!(fs::read_dir(&tmp).expect("tmp").count(), 0, "removed when not taken");
    }

    fn open_log(root: &Path) -> BlockLog {
        let files = Arc::new(OpenFiles::new(std::num::NonZeroUsize::new(8).expect("nonzero")));
        let scanned = Scanned { next_segment: 1, ..Scanned::default() };
        BlockLog::open(root, &scanned, LOG_SEGMENT_BYTES_MIN, Duration::from_secs(30), files, None)
            .expect("open the log")
    }

    /// The header of a block of `payload_len` bytes at commit `seq`.
    fn header(seq: u64, payload: &[u8]) -> Vec<u8> {
        let key = fixture::key(0, &[u8::try_from(seq).expect("small")], KvDtype::F16, 16);
        let mut header = vec![0u8; layout::header_len_for(key.encoded().len())];
        layout::encode_header(
            &mut header,
            &key,
            payload.len() as u64,
            Checksum::of(payload),
            seq,
            1,
        );
        header
    }

    /// Writes the record `append` would write at `slot`.
    fn write_record(log: &BlockLog, slot: LogSlot, seq: u64, payload: &[u8]) -> io::Result<()> {
        let header = header(seq, payload);
        let body_len = (header.len() + payload.len()) as u64;
        let file = Arc::clone(&lock(&log.segments).by_number[&slot.segment].file);
        let mut head = frame(body_len, seq).to_vec();
        head.extend_from_slice(&header);
        file.write_all_at(&head, slot.record)?;
        file.write_all_at(payload, slot.record + head.len() as u64)
    }

    /// Returns once a record after `slot` in its segment is reserved and written, while `slot`
    /// is not.
    fn await_written_after(log: &BlockLog, slot: LogSlot) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let waiting = |s: &Segments| {
            s.at <= slot.record + slot.bytes
                || !s.unwritten.iter().eq([&(slot.segment, slot.record)])
        };
        while waiting(&lock(&log.segments)) {
            assert!(Instant::now() < deadline, "no append reserved its slot");
            std::thread::yield_now();
        }
    }

    fn record_for(seq: u64, payload: &[u8]) -> u64 {
        record_len((header(seq, payload).len() + payload.len()) as u64)
    }

    /// Reserves a 70 KB record, lets another thread append a small one after it and write it,
    /// then ends the first with `first` (given the log and its slot): the first's slot, what
    /// `first` returned and what the later append returned.
    fn behind_a_reserved_record(
        log: &BlockLog,
        first: impl FnOnce(&BlockLog, LogSlot) -> io::Result<()>,
    ) -> (LogSlot, io::Result<()>, io::Result<(LogSlot, u64)>) {
        let small = vec![2u8; 300];
        let (_, a) = log.reserve(record_for(1, &[1u8; 70_000])).expect("reserve");
        std::thread::scope(|s| {
            let later = s.spawn(|| log.append(2, &header(2, &small), &small));
            await_written_after(log, a);
            let settled = first(log, a);
            (a, settled, later.join().expect("join"))
        })
    }

    /// A record written after an earlier one of its segment was reserved is acknowledged only
    /// once that one is written, and found by an open then.
    #[test]
    fn an_append_waits_for_the_records_reserved_before_it_in_its_segment() {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = open_log(dir.path());
        let (a, settled, later) = behind_a_reserved_record(&log, |log, a| {
            let written = write_record(log, a, 1, &[1u8; 70_000]);
            log.settle(a, written)
        });
        settled.expect("the first record settles");
        let (b, _) = later.expect("the later append");
        assert_eq!((b.segment, b.record), (a.segment, a.bytes));
        let found = scan(dir.path()).expect("scan");
        assert_eq!(found.blocks.len(), 2, "{found:?}");
        assert_eq!(found.torn, 0);
    }

    /// When a record reserved earlier in the segment fails to be written, every record after
    /// it in that segment fails too (an open would stop at the gap), and appends go on in the
    /// next segment.
    #[test]
    fn an_append_behind_a_failed_record_of_its_segment_fails_and_the_next_goes_elsewhere() {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = open_log(dir.path());
        let (a, settled, later) = behind_a_reserved_record(&log, |log, a| {
            log.settle(a, Err(io::Error::other("injected: the disk went away")))
        });
        assert!(settled.is_err());
        assert!(later.is_err(), "acknowledged behind a gap: {later:?}");
        let small = vec![3u8; 300];
        let (c, _) = log.append(3, &header(3, &small), &small).expect("a new append");
        assert_ne!(c.segment, a.segment, "appended behind the failed record");
        let usage = log.usage();
        assert_eq!(usage.live_blocks, 1, "{usage:?}");
        let found = scan(dir.path()).expect("scan");
        let seqs: Vec<u64> = found.blocks.iter().map(|f| f.header.seq).collect();
        assert_eq!(seqs, [3], "{found:?}");
    }
}
