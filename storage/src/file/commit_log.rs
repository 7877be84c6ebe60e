//! The commit log of [`Durability::Logged`](super::Durability::Logged): durable small PUTs at
//! the cost of one shared `fdatasync` of a file that already exists, instead of a flush of a
//! new block file and of its directory each.
//!
//! A logged PUT writes its block file as `Durability::None` does (temporary name, rename, no
//! flush) and appends the same bytes (the block header, then the payload) to the log. It is
//! acknowledged once a group flush of the log covers that record: concurrent PUTs share one
//! `fdatasync` ([`GroupSync`]). Removing a block appends a *gone* record; an invalidation waits
//! for the flush that covers it, as it would for a directory sync.
//!
//! The log is a series of segments `log/<n>.log`, each written full of zeros and flushed before
//! it is used ([`LOG_SEGMENT_BYTES`]), so that an append changes neither the file's size nor its
//! extents and its flush writes data only: no journal commit of the file system, which would
//! carry (and make wait) every block file created meanwhile. A thread of the log's own prepares
//! the next segment while the current one fills, and retires full ones: once a `syncfs` has made
//! every block file written before a full segment durable, the segment is deleted. A store that
//! closes retires its last segment the same way.
//!
//! At open, [`replay`] reads what segments are left, in order, after the block files were
//! scanned: a put record whose block file is missing or damaged (the file's bytes were still in
//! the page cache when the power went) writes the file again from the record; a gone record
//! removes the block again. A record cut short, or one whose checks fail, ends its segment: it
//! was never acknowledged. The recovered files are flushed before the segments are deleted.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use gpucache_dataplane::checksum::Checksum;

use super::layout::{self, BlockHeader};
use super::sync::{GroupSync, syncfs};

/// The log's directory under the store root.
pub const LOG_DIR: &str = "log";
/// Default bytes of one log segment (preallocated); `FileStoreConfig::log_segment_bytes`.
pub const LOG_SEGMENT_BYTES: u64 = 64 << 20;
/// Fewest bytes a log segment may have.
pub const LOG_SEGMENT_BYTES_MIN: u64 = 1 << 20;
/// Largest payload a logged PUT puts in the log; a larger block is flushed on its own, as
/// under `PerBlock` (its data costs more than the flushes it would save).
pub const LOG_BLOCK_BYTES_MAX: u64 = 4 << 20;
/// Jobs (segments to prepare or to retire) queued for the log's thread at most; an append that
/// rotates while the queue is full waits up to [`SPARE_WAIT`], then fails.
const RETIRING_MAX: usize = 4;
/// Bytes of a record's frame: magic, kind, padding, body length, commit sequence, check.
const FRAME_BYTES: usize = 32;
const RECORD_MAGIC: [u8; 4] = *b"GPCL";
const PUT: u8 = 1;
const GONE: u8 = 2;
/// Records start at multiples of this.
const RECORD_ALIGN: u64 = 8;

fn frame(kind: u8, body_len: u64, seq: u64) -> [u8; FRAME_BYTES] {
    let mut f = [0u8; FRAME_BYTES];
    f[..4].copy_from_slice(&RECORD_MAGIC);
    f[4] = kind;
    f[8..16].copy_from_slice(&body_len.to_le_bytes());
    f[16..24].copy_from_slice(&seq.to_le_bytes());
    let check = Checksum::of(&f[..24]).0;
    f[24..32].copy_from_slice(&check.to_le_bytes());
    f
}

/// A whole frame's kind, body length and sequence; `None` when it is not one.
fn parse_frame(f: &[u8]) -> Option<(u8, u64, u64)> {
    let word = |at: usize| u64::from_le_bytes(f[at..at + 8].try_into().unwrap_or_default());
    let valid = f.len() >= FRAME_BYTES
        && f[..4] == RECORD_MAGIC
        && matches!(f[4], PUT | GONE)
        && word(24) == Checksum::of(&f[..24]).0;
    valid.then(|| (f[4], word(8), word(16)))
}

fn record_len(body_len: u64) -> u64 {
    (FRAME_BYTES as u64 + body_len).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
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

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The segment appends go to.
#[derive(Debug)]
struct Active {
    file: Arc<File>,
    number: u64,
    at: u64,
}

/// The commit log of a running store (see the module documentation).
pub(super) struct CommitLog {
    dir: PathBuf,
    segment_bytes: u64,
    active: Arc<Mutex<Active>>,
    group: GroupSync,
    spare: SpareSlot,
    jobs: Option<SyncSender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CommitLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitLog").field("dir", &self.dir).finish_non_exhaustive()
    }
}

/// Makes segment `number` under `dir`: `bytes` of zeros written and flushed, and its name
/// durable.
fn new_segment(dir: &Path, number: u64, bytes: u64) -> io::Result<File> {
    let path = segment_path(dir, number);
    let made = (|| {
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        let zeros = vec![0u8; ZERO_CHUNK_BYTES];
        let mut at = 0;
        while at < bytes {
            let n = usize::try_from((bytes - at).min(ZERO_CHUNK_BYTES as u64)).unwrap_or(0);
            file.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        file.sync_all()?;
        sync_dir(dir)?;
        Ok(file)
    })();
    if made.is_err() {
        let _ = fs::remove_file(&path);
    }
    made
}

/// What the log's thread does.
enum Job {
    /// Make segment `n` and leave it in the spare slot.
    Prepare(u64),
    /// Delete a full segment once the block files it covers are durable.
    Retire(PathBuf),
}

/// The segment the log's thread prepared, or why it could not.
type SpareSlot = Arc<(Mutex<Option<(u64, io::Result<File>)>>, Condvar)>;

/// How often a full job queue is looked at again.
const QUEUE_POLL: Duration = Duration::from_millis(5);
/// How long a rotation waits for the prepared segment before it makes one itself, and for room
/// in the job queue before the append fails.
const SPARE_WAIT: Duration = Duration::from_secs(30);
/// Zeros written per call when a segment is made.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

impl CommitLog {
    /// Starts a log under `root` whose first segment is `first` (after every number a replay
    /// saw), in segments of `segment_bytes`, with group flushes that give up after `deadline`.
    pub(super) fn open(
        root: &Path,
        first: u64,
        segment_bytes: u64,
        deadline: Duration,
    ) -> io::Result<Self> {
        let dir = root.join(LOG_DIR);
        fs::create_dir_all(&dir)?;
        sync_dir(root)?;
        let file = Arc::new(new_segment(&dir, first, segment_bytes)?);
        let active = Arc::new(Mutex::new(Active { file, number: first, at: 0 }));
        let flushed = Arc::clone(&active);
        let group = GroupSync::new(
            Box::new(move || {
                let file = Arc::clone(&flushed.lock().unwrap_or_else(PoisonError::into_inner).file);
                file.sync_data()
            }),
            deadline,
        );
        let (jobs, queue) = sync_channel::<Job>(RETIRING_MAX);
        let spare: SpareSlot = Arc::default();
        let fs_handle = File::open(root)?;
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
                    Job::Retire(segment) => {
                        // Every block file written before the segment filled is durable after
                        // this; then nothing in the segment is needed any more.
                        let retired = syncfs(&fs_handle)
                            .and_then(|()| fs::remove_file(&segment))
                            .and_then(|()| sync_dir(&log_dir));
                        if let Err(e) = retired {
                            tracing::warn!(segment = %segment.display(), error = %e,
                                "could not retire a commit-log segment; the next open replays it");
                        }
                    }
                }
            }
        })?;
        let log = Self {
            dir,
            segment_bytes,
            active,
            group,
            spare,
            jobs: Some(jobs),
            worker: Some(worker),
        };
        log.queue(Job::Prepare(first + 1))?;
        Ok(log)
    }

    /// Whether the put record of a block with a `header_len`-byte header and a
    /// `payload_len`-byte payload goes in the log: at most [`LOG_BLOCK_BYTES_MAX`] of payload,
    /// and a record that fits a segment.
    pub(super) fn takes(&self, header_len: usize, payload_len: usize) -> bool {
        let body = (header_len + payload_len) as u64;
        payload_len as u64 <= LOG_BLOCK_BYTES_MAX && record_len(body) <= self.segment_bytes
    }

    /// Appends the put record of a block: its header bytes (`header`, as the block file starts)
    /// and its payload. Durable once [`Self::barrier`] returns.
    pub(super) fn put(&self, seq: u64, header: &[u8], payload: &[u8]) -> io::Result<()> {
        self.append(PUT, seq, &[header, payload])
    }

    /// Appends the gone record of the block committed under `seq`.
    pub(super) fn gone(&self, seq: u64) -> io::Result<()> {
        self.append(GONE, seq, &[])
    }

    /// Returns once every record this thread appended before the call is durable.
    pub(super) fn barrier(&self) -> io::Result<()> {
        self.group.barrier()
    }

    fn append(&self, kind: u8, seq: u64, body: &[&[u8]]) -> io::Result<()> {
        let body_len: u64 = body.iter().map(|b| b.len() as u64).sum();
        let len = record_len(body_len);
        if len > self.segment_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a {len}-byte log record is larger than a segment"),
            ));
        }
        let mut active = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        if active.at + len > self.segment_bytes {
            self.rotate(&mut active)?;
        }
        let mut at = active.at;
        active.file.write_all_at(&frame(kind, body_len, seq), at)?;
        at += FRAME_BYTES as u64;
        for part in body {
            active.file.write_all_at(part, at)?;
            at += part.len() as u64;
        }
        active.at += len;
        Ok(())
    }

    /// Replaces the full active segment by the next one (the one the log's thread prepared,
    /// or one made here when it could not): the full one is flushed first (a record in it may
    /// not be covered by a later group flush, which flushes the new one) and handed to the
    /// thread to retire.
    fn rotate(&self, active: &mut Active) -> io::Result<()> {
        active.file.sync_data()?;
        let number = active.number + 1;
        let file = match self.take_spare(number) {
            Some(Ok(file)) => file,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the commit log could not prepare a segment; making it now");
                new_segment(&self.dir, number, self.segment_bytes)?
            }
            None => new_segment(&self.dir, number, self.segment_bytes)?,
        };
        let old = segment_path(&self.dir, active.number);
        *active = Active { file: Arc::new(file), number, at: 0 };
        // A job that cannot be queued in time fails this append (nothing is acknowledged): the
        // full segment then stays until the next open replays and removes it, and the next
        // rotation makes its segment itself.
        self.queue(Job::Prepare(number + 1))?;
        self.queue(Job::Retire(old))
    }

    /// Hands `job` to the log's thread, waiting up to [`SPARE_WAIT`] while [`RETIRING_MAX`]
    /// jobs are queued already.
    fn queue(&self, job: Job) -> io::Result<()> {
        let Some(jobs) = &self.jobs else { return Ok(()) };
        let deadline = std::time::Instant::now() + SPARE_WAIT;
        let mut job = job;
        loop {
            match jobs.try_send(job) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => {
                    return Err(io::Error::other("the commit log's thread is gone"));
                }
                Err(TrySendError::Full(back)) => job = back,
            }
            if std::time::Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the commit log's thread is behind (segments wait for their syncfs)",
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
        let deadline = std::time::Instant::now() + SPARE_WAIT;
        loop {
            match slot.take() {
                Some((n, made)) if n == number => return Some(made),
                // Another number is of no use: the log moved on without it.
                Some(_) | None => {}
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            slot = ready.wait_timeout(slot, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Drop for CommitLog {
    /// Retires the last segment too, so that the next open has nothing to replay, and removes
    /// the prepared one.
    fn drop(&mut self) {
        let number = self.active.lock().unwrap_or_else(PoisonError::into_inner).number;
        if let Some(jobs) = self.jobs.take() {
            let _ = jobs.send(Job::Retire(segment_path(&self.dir, number)));
        }
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        let spare = self.spare.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some((n, Ok(_))) = spare {
            let _ = fs::remove_file(segment_path(&self.dir, n));
        }
    }
}

/// What the replay of a commit log at open did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Segments read (and removed).
    pub segments: u64,
    /// Block files written again from their put records.
    pub recovered: u64,
    /// Blocks removed again by their gone records.
    pub removed: u64,
    /// The number a new log's first segment takes: after every one seen.
    pub next_segment: u64,
}

/// Writes the block file of a put record under `root` (temporary name, rename); its path.
fn write_block(root: &Path, header: &BlockHeader, body: &[u8]) -> io::Result<PathBuf> {
    let path = layout::block_path(root, &header.key, header.seq);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let tmp = root.join("tmp").join(format!("replay-{}.tmp", header.seq));
    let file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
    file.write_all_at(body, 0)?;
    file.set_len(header.file_len())?;
    drop(file);
    fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Applies the log segments left under `root` to `found`, the block files a scan found (sorted
/// by sequence on return), then makes the result durable and removes the segments.
pub(super) fn replay(root: &Path, found: &mut Vec<(BlockHeader, PathBuf)>) -> io::Result<Replayed> {
    let dir = root.join(LOG_DIR);
    let segments = segments(&dir)?;
    let mut done = Replayed { next_segment: 1, ..Replayed::default() };
    if segments.is_empty() {
        return Ok(done);
    }
    // Where each key's newest block is in `found`, and where each sequence is.
    let mut by_digest: HashMap<[u8; 32], usize> =
        found.iter().enumerate().map(|(i, (h, _))| (h.key.digest().0, i)).collect();
    let mut gone: Vec<bool> = vec![false; found.len()];
    for (number, path) in &segments {
        done.segments += 1;
        done.next_segment = done.next_segment.max(number + 1);
        let bytes = fs::read(path)?;
        let mut at = 0usize;
        while let Some((kind, body_len, seq)) = bytes.get(at..).and_then(parse_frame) {
            let start = at + FRAME_BYTES;
            let Some(body) = usize::try_from(body_len)
                .ok()
                .and_then(|n| start.checked_add(n))
                .and_then(|end| bytes.get(start..end))
            else {
                break;
            };
            if kind == PUT {
                // A record whose header or payload does not check was cut short: the end.
                let Ok(header) = layout::decode_header(body) else { break };
                let payload = usize::try_from(header.header_len)
                    .ok()
                    .and_then(|h| body.get(h..))
                    .filter(|p| p.len() as u64 == header.payload_len);
                if !payload.is_some_and(|p| Checksum::of(p) == header.checksum) || header.seq != seq
                {
                    break;
                }
                let digest = header.key.digest().0;
                let newer_on_disk =
                    by_digest.get(&digest).is_some_and(|&i| found[i].0.seq >= seq && !gone[i]);
                if !newer_on_disk {
                    let path = write_block(root, &header, body)?;
                    if let Some(&i) = by_digest.get(&digest)
                        && !gone[i]
                    {
                        let _ = fs::remove_file(&found[i].1);
                        gone[i] = true;
                    }
                    by_digest.insert(digest, found.len());
                    found.push((header, path));
                    gone.push(false);
                    done.recovered += 1;
                }
            } else if let Some(i) = found.iter().position(|(h, _)| h.seq == seq)
                && !gone[i]
            {
                let _ = fs::remove_file(&found[i].1);
                gone[i] = true;
                done.removed += 1;
            }
            at += usize::try_from(record_len(body_len)).unwrap_or(usize::MAX);
        }
    }
    let mut keep = gone.into_iter().map(|g| !g);
    found.retain(|_| keep.next().unwrap_or(true));
    found.sort_by_key(|(h, _)| h.seq);
    // What was written or removed again is durable before the log that could redo it goes.
    syncfs(&File::open(root)?)?;
    for (_, path) in &segments {
        fs::remove_file(path)?;
    }
    sync_dir(&dir)?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_damage_is_refused() {
        let f = frame(PUT, 70_000, 42);
        assert_eq!(parse_frame(&f), Some((PUT, 70_000, 42)));
        for i in [0, 4, 9, 17, 30] {
            let mut bad = f;
            bad[i] ^= 1;
            assert_eq!(parse_frame(&bad), None, "byte {i}");
        }
        assert_eq!(parse_frame(&[0u8; FRAME_BYTES]), None, "a preallocated zero tail");
        assert_eq!(record_len(0), 32);
        assert_eq!(record_len(1), 40);
    }
}
