//! A simulated faulty disk: wraps a real engine and, driven by a seeded generator, injects
//! short, failed and torn writes, read errors, flipped bits and dropped syncs, and models what a
//! crash loses. It is a test instrument and says so ([`FaultyEngine::describe`]).
//!
//! # Determinism
//!
//! One generator ([`SplitMix64`] seeded with [`FaultConfig::seed`]) behind a mutex decides every
//! fault. Each call takes all of its draws in one critical section before doing any I/O, so the
//! same seed and the same sequence of calls (as serialized by that mutex) give the same faults,
//! the same prefixes, the same flipped bits and the same crash garbage. Calls with empty buffers
//! and calls made while injection is paused ([`FaultyEngine::set_enabled`]) take no draws.
//!
//! # Faults
//!
//! A write takes one uniform draw and compares it with the cumulative probabilities in the order
//! ENOSPC, EIO, short write, torn write (so if they sum past 1 the later kinds get what is left):
//!
//! * ENOSPC: nothing is written; `Err(ENOSPC)`.
//! * EIO: a random prefix (possibly empty) is written; `Err(EIO)`.
//! * short write: a random strict prefix is written; `Err(WriteZero)` ("injected short write").
//! * torn write: a random strict prefix is written; `Ok(())`. Only a checksum can tell.
//!
//! For a file opened with `O_DIRECT` (seen with `fcntl(F_GETFL)`), prefixes are rounded down to
//! [`DIRECT_ALIGN`], i.e. tearing happens at sector granularity and the prefix write stays valid.
//!
//! A read takes one draw against EIO then bit flip: EIO fails without reading; a bit flip reads,
//! then inverts one random bit of the buffer and returns `Ok`. A batch read takes the draws of
//! its requests in request order (exactly those of the same reads made one by one), in one
//! critical section, then hands the requests that drew no EIO to the inner engine's batch read
//! together, and flips a request's bit as soon as the inner engine has read it (before the
//! caller sees it). A sync takes one draw: a dropped sync returns `Ok`
//! without syncing.
//!
//! Namespace faults are switches, not draws: [`FaultyEngine::fail_unlinks`] makes every
//! `remove_file` fail with a chosen errno (removing nothing), and [`FaultyEngine::fail_dir_syncs`]
//! does the same for `sync_dir`. They model a device that turned read-only or a permission that
//! was lost, take no draws, and so leave the seeded schedule of the other faults unchanged;
//! pausing injection does not pause them. The crash model covers file contents only: an unlink
//! is never undone by [`FaultyEngine::crash`].
//!
//! # Crash model
//!
//! The layer keeps a model of the page cache: for every file written through it (identified by
//! `(dev, ino)`, held open by a `try_clone` of the caller's handle) the byte ranges written since
//! that file's last real sync. [`FaultyEngine::crash`] overwrites each such range with seeded
//! garbage through the inner engine and forgets them: data whose sync was dropped, or never
//! requested, is gone "after the crash", while data covered by a real sync is untouched. A write
//! that failed in the inner engine counts as written (its range is indeterminate anyway). The
//! model does not shrink files that unsynced writes extended; it garbles those bytes in place.
//! `crash` is meant to be called while no other call is in flight.
//!
//! Tracking is bounded by [`TRACKED_FILES_MAX`] files and [`TRACKED_RANGES_MAX`] disjoint ranges
//! per file. When a bound would be exceeded the layer performs a *simulated writeback*: it really
//! syncs one file (the least recently written one, or the file with too many ranges) through the
//! inner engine and forgets its ranges, as a kernel may write dirty pages back at any moment. This
//! never garbles bytes a real sync covered (merging ranges would), at the cost of losing less than
//! a worst-case crash could. Writebacks are counted in [`FaultCounts::writebacks`].

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use gpucache_dataplane::rng::SplitMix64;

use super::contract::{AlignedBuf, BatchRead, DIRECT_ALIGN, IoEngine, Staging};

/// Most files whose unsynced ranges are tracked at once.
pub const TRACKED_FILES_MAX: usize = 256;

/// Most disjoint unsynced ranges tracked per file.
pub const TRACKED_RANGES_MAX: usize = 1024;

/// Bytes of garbage generated per write while simulating a crash.
const CRASH_PIECE_BYTES: usize = 1 << 20;

/// Per-call fault probabilities (each in `0.0..=1.0`; other values are clamped, NaN is 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultConfig {
    pub seed: u64,
    /// Write a strict prefix, then fail with `WriteZero`.
    pub short_write: f64,
    /// Write a prefix (possibly empty), then fail with `EIO`.
    pub write_eio: f64,
    /// Write nothing and fail with `ENOSPC`.
    pub write_enospc: f64,
    /// Write a strict prefix and report success.
    pub torn_write: f64,
    /// Fail a read with `EIO`.
    pub read_eio: f64,
    /// Flip one bit of a successful read.
    pub read_bit_flip: f64,
    /// Report a sync as done without doing it.
    pub dropped_sync: f64,
}

impl FaultConfig {
    /// No faults; the crash model still works.
    pub fn none(seed: u64) -> Self {
        Self {
            seed,
            short_write: 0.0,
            write_eio: 0.0,
            write_enospc: 0.0,
            torn_write: 0.0,
            read_eio: 0.0,
            read_bit_flip: 0.0,
            dropped_sync: 0.0,
        }
    }

    fn clamped(self) -> Self {
        let p = |x: f64| if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) };
        Self {
            seed: self.seed,
            short_write: p(self.short_write),
            write_eio: p(self.write_eio),
            write_enospc: p(self.write_enospc),
            torn_write: p(self.torn_write),
            read_eio: p(self.read_eio),
            read_bit_flip: p(self.read_bit_flip),
            dropped_sync: p(self.dropped_sync),
        }
    }
}

/// How many of each fault were injected, plus crash-model events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub short_writes: u64,
    pub write_eio: u64,
    pub write_enospc: u64,
    pub torn_writes: u64,
    pub read_eio: u64,
    pub read_bit_flips: u64,
    pub dropped_syncs: u64,
    /// Calls to [`FaultyEngine::crash`].
    pub crashes: u64,
    /// Real syncs the layer did on its own to keep its tracking bounded.
    pub writebacks: u64,
    /// Unlinks failed on purpose ([`FaultyEngine::fail_unlinks`]).
    pub unlink_errors: u64,
    /// Directory syncs failed on purpose ([`FaultyEngine::fail_dir_syncs`]).
    pub dir_sync_errors: u64,
}

impl FaultCounts {
    /// Injected faults of every kind (not crashes or writebacks).
    pub fn total(&self) -> u64 {
        self.short_writes
            + self.write_eio
            + self.write_enospc
            + self.torn_writes
            + self.read_eio
            + self.read_bit_flips
            + self.dropped_syncs
            + self.unlink_errors
            + self.dir_sync_errors
    }
}

/// What a simulated crash destroyed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashReport {
    pub files: usize,
    pub ranges: usize,
    pub bytes: u64,
}

/// The seeded faulty-disk layer; see the [module documentation](self).
pub struct FaultyEngine<E: IoEngine> {
    inner: E,
    config: FaultConfig,
    enabled: AtomicBool,
    /// The errno every unlink fails with; 0 for none.
    unlink_errno: AtomicI32,
    /// The errno every directory sync fails with; 0 for none.
    dir_sync_errno: AtomicI32,
    state: Mutex<State>,
}

struct State {
    rng: SplitMix64,
    counts: FaultCounts,
    files: HashMap<(u64, u64), Tracked>,
    /// Bumped on every tracked write; orders files for eviction and for crash garbage.
    clock: u64,
}

struct Tracked {
    /// A duplicate of the caller's handle, so garbage can be written after the caller closed it.
    file: File,
    direct: bool,
    /// Sorted, disjoint, non-adjacent `start..end` ranges written since the last real sync.
    ranges: Vec<(u64, u64)>,
    /// `clock` when tracking of this file began (crash order) and when it was last written.
    first: u64,
    last: u64,
}

enum WriteFault {
    Enospc,
    Eio(usize),
    Short(usize),
    Torn(usize),
}

enum ReadFault {
    Eio,
    BitFlip(u64),
}

impl<E: IoEngine> FaultyEngine<E> {
    pub fn new(inner: E, config: FaultConfig) -> Self {
        let config = config.clamped();
        Self {
            inner,
            config,
            enabled: AtomicBool::new(true),
            unlink_errno: AtomicI32::new(0),
            dir_sync_errno: AtomicI32::new(0),
            state: Mutex::new(State {
                rng: SplitMix64::new(config.seed),
                counts: FaultCounts::default(),
                files: HashMap::new(),
                clock: 0,
            }),
        }
    }

    /// Says what this engine is: a simulation, with its seed.
    pub fn describe(&self) -> String {
        format!("simulated faulty disk (seed {}) over {}", self.config.seed, self.inner.name())
    }

    pub fn config(&self) -> FaultConfig {
        self.config
    }

    pub fn inner(&self) -> &E {
        &self.inner
    }

    /// Pauses (`false`) or resumes (`true`) fault injection. Tracking for the crash model goes
    /// on while paused.
    pub fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::SeqCst);
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    /// Makes every later unlink fail with `errno` (e.g. `libc::EROFS`, `libc::EACCES`) and
    /// remove nothing, or (`None`) lets unlinks through again.
    pub fn fail_unlinks(&self, errno: Option<i32>) {
        self.unlink_errno.store(errno.unwrap_or(0), Ordering::SeqCst);
    }

    /// Makes every later directory sync fail with `errno`, or (`None`) lets them through again.
    pub fn fail_dir_syncs(&self, errno: Option<i32>) {
        self.dir_sync_errno.store(errno.unwrap_or(0), Ordering::SeqCst);
    }

    /// The errno `switch` holds, counted in `count` when one is set.
    fn switched(&self, switch: &AtomicI32, count: fn(&mut FaultCounts) -> &mut u64) -> Option<i32> {
        let errno = switch.load(Ordering::SeqCst);
        (errno != 0).then(|| {
            *count(&mut self.lock().counts) += 1;
            errno
        })
    }

    pub fn counts(&self) -> FaultCounts {
        self.lock().counts
    }

    /// Bytes written since their file's last real sync (what a crash now would garble).
    pub fn unsynced_bytes(&self) -> u64 {
        self.lock().files.values().flat_map(|t| t.ranges.iter()).map(|(s, e)| e - s).sum()
    }

    /// Simulates a crash: every range written since its file's last real sync is overwritten with
    /// seeded garbage through the inner engine, and the tracking is cleared. Call it while no
    /// other call is in flight. Returns the first write error after trying every range.
    pub fn crash(&self) -> io::Result<CrashReport> {
        let (mut files, seed) = {
            let mut state = self.lock();
            state.counts.crashes += 1;
            let seed = state.rng.next_u64();
            let files: Vec<Tracked> = state.files.drain().map(|(_, t)| t).collect();
            (files, seed)
        };
        // A deterministic order (HashMap order and inode numbers are not).
        files.sort_by_key(|t| t.first);
        let mut garbage = SplitMix64::new(seed);
        let mut piece = AlignedBuf::zeroed(CRASH_PIECE_BYTES)?;
        let align = wide(DIRECT_ALIGN);
        let mut report = CrashReport::default();
        let mut first_error = None;
        for tracked in &files {
            report.files += 1;
            for &(start, end) in &tracked.ranges {
                let (start, end) = if tracked.direct {
                    (start.next_multiple_of(align), end - end % align)
                } else {
                    (start, end)
                };
                let mut at = start;
                while at < end {
                    let n = usize::try_from(end - at).unwrap_or(usize::MAX).min(CRASH_PIECE_BYTES);
                    garbage.fill_bytes(&mut piece[..n]);
                    if let Err(e) = self.inner.write_all_at(&tracked.file, at, &piece[..n]) {
                        first_error.get_or_insert(e);
                        break;
                    }
                    at += wide(n);
                }
                report.ranges += 1;
                report.bytes += end.saturating_sub(start);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counters and ranges stay meaningful after a panic elsewhere.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn draw_write(&self, len: usize) -> Option<WriteFault> {
        if !self.is_enabled() {
            return None;
        }
        let c = &self.config;
        let mut state = self.lock();
        let u = state.rng.unit();
        let mut edge = c.write_enospc;
        if u < edge {
            state.counts.write_enospc += 1;
            return Some(WriteFault::Enospc);
        }
        edge += c.write_eio;
        if u < edge {
            state.counts.write_eio += 1;
            return Some(WriteFault::Eio(state.rng.index(len)));
        }
        edge += c.short_write;
        if u < edge {
            state.counts.short_writes += 1;
            return Some(WriteFault::Short(state.rng.index(len)));
        }
        edge += c.torn_write;
        if u < edge {
            state.counts.torn_writes += 1;
            return Some(WriteFault::Torn(state.rng.index(len)));
        }
        None
    }

    fn draw_read(&self, len: usize) -> Option<ReadFault> {
        if !self.is_enabled() {
            return None;
        }
        self.draw_read_locked(&mut self.lock(), len)
    }

    fn draw_read_locked(&self, state: &mut State, len: usize) -> Option<ReadFault> {
        let c = &self.config;
        let u = state.rng.unit();
        if u < c.read_eio {
            state.counts.read_eio += 1;
            return Some(ReadFault::Eio);
        }
        if u < c.read_eio + c.read_bit_flip {
            state.counts.read_bit_flips += 1;
            let bits = wide(len).saturating_mul(8);
            return Some(ReadFault::BitFlip(state.rng.next_u64() % bits));
        }
        None
    }

    fn draw_dropped_sync(&self) -> bool {
        if !self.is_enabled() {
            return false;
        }
        let mut state = self.lock();
        let dropped = state.rng.unit() < self.config.dropped_sync;
        if dropped {
            state.counts.dropped_syncs += 1;
        }
        dropped
    }

    /// Writes `data[..prefix]` (rounded down to [`DIRECT_ALIGN`] for O_DIRECT files) and records
    /// it as unsynced.
    fn write_prefix(&self, file: &File, offset: u64, data: &[u8], prefix: usize) -> io::Result<()> {
        let prefix = if is_direct(file)? { prefix - prefix % DIRECT_ALIGN } else { prefix };
        if prefix == 0 {
            return Ok(());
        }
        let result = self.inner.write_all_at(file, offset, &data[..prefix]);
        self.track(file, offset, prefix)?;
        result
    }

    /// Records `offset..offset + len` of `file` as written and not yet synced.
    fn track(&self, file: &File, offset: u64, len: usize) -> io::Result<()> {
        let key = file_key(file)?;
        let end = offset.saturating_add(wide(len));
        let known = self.lock().files.contains_key(&key);
        // Duplicate the handle outside the lock; only needed for a file not yet tracked.
        let fresh = if known { None } else { Some((file.try_clone()?, is_direct(file)?)) };

        let mut evicted = Vec::new();
        {
            let mut state = self.lock();
            state.clock += 1;
            let now = state.clock;
            if !state.files.contains_key(&key) {
                if state.files.len() >= TRACKED_FILES_MAX
                    && let Some(oldest) =
                        state.files.iter().min_by_key(|(_, t)| t.last).map(|(k, _)| *k)
                    && let Some(t) = state.files.remove(&oldest)
                {
                    evicted.push(t);
                }
                // `fresh` is None only if another call started tracking this file meanwhile and
                // a crash or sync removed it again; duplicate the handle under the lock then.
                let (handle, direct) = match fresh {
                    Some(f) => f,
                    None => (file.try_clone()?, is_direct(file)?),
                };
                state.files.insert(
                    key,
                    Tracked { file: handle, direct, ranges: Vec::new(), first: now, last: now },
                );
            }
            if let Some(t) = state.files.get_mut(&key) {
                t.last = now;
                add_range(&mut t.ranges, offset, end);
                if t.ranges.len() > TRACKED_RANGES_MAX
                    && let Some(t) = state.files.remove(&key)
                {
                    evicted.push(t);
                }
            }
            state.counts.writebacks += wide(evicted.len());
        }
        for t in evicted {
            if let Err(e) = self.inner.sync(&t.file) {
                tracing::warn!(error = %e, "faulty engine: simulated writeback sync failed; forgetting the file's unsynced ranges anyway");
            }
        }
        Ok(())
    }
}

impl<E: IoEngine> IoEngine for FaultyEngine<E> {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn write_all_at(&self, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return self.inner.write_all_at(file, offset, data);
        }
        match self.draw_write(data.len()) {
            None => {
                let result = self.inner.write_all_at(file, offset, data);
                self.track(file, offset, data.len())?;
                result
            }
            Some(WriteFault::Enospc) => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
            Some(WriteFault::Eio(prefix)) => {
                self.write_prefix(file, offset, data, prefix)?;
                Err(io::Error::from_raw_os_error(libc::EIO))
            }
            Some(WriteFault::Short(prefix)) => {
                self.write_prefix(file, offset, data, prefix)?;
                Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("injected short write ({prefix} of {} bytes)", data.len()),
                ))
            }
            Some(WriteFault::Torn(prefix)) => self.write_prefix(file, offset, data, prefix),
        }
    }

    fn read_exact_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if buf.is_empty() {
            return self.inner.read_exact_at(file, offset, buf);
        }
        match self.draw_read(buf.len()) {
            None => self.inner.read_exact_at(file, offset, buf),
            Some(ReadFault::Eio) => Err(io::Error::from_raw_os_error(libc::EIO)),
            Some(ReadFault::BitFlip(bit)) => {
                self.inner.read_exact_at(file, offset, buf)?;
                flip(buf, bit);
                Ok(())
            }
        }
    }

    fn read_batch_then(
        &self,
        reads: &mut [BatchRead<'_>],
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Vec<io::Result<()>> {
        // The draws of the same reads made one by one (none for an empty buffer or while
        // paused), taken together.
        let faults: Vec<Option<ReadFault>> = if self.is_enabled() {
            let mut state = self.lock();
            reads
                .iter()
                .map(|r| {
                    if r.buf.is_empty() {
                        None
                    } else {
                        self.draw_read_locked(&mut state, r.buf.len())
                    }
                })
                .collect()
        } else {
            reads.iter().map(|_| None).collect()
        };
        let mut results: Vec<Option<io::Result<()>>> = reads.iter().map(|_| None).collect();
        let mut passed = Vec::with_capacity(reads.len());
        let mut indices = Vec::with_capacity(reads.len());
        for (i, (r, fault)) in reads.iter_mut().zip(&faults).enumerate() {
            match fault {
                Some(ReadFault::Eio) => {
                    results[i] = Some(Err(io::Error::from_raw_os_error(libc::EIO)));
                }
                _ => {
                    passed.push(BatchRead { file: r.file, offset: r.offset, buf: &mut *r.buf });
                    indices.push(i);
                }
            }
        }
        // A flipped bit is flipped before the caller sees the buffer.
        let mut flip_then = |j: usize, buf: &mut [u8]| {
            let Some(&i) = indices.get(j) else { return };
            if let Some(Some(ReadFault::BitFlip(bit))) = faults.get(i) {
                flip(buf, *bit);
            }
            done(i, buf);
        };
        let inner = self.inner.read_batch_then(&mut passed, &mut flip_then);
        for (&i, result) in indices.iter().zip(inner) {
            results[i] = Some(result);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(io::Error::other("faulty engine: the inner engine left a read unanswered"))
                })
            })
            .collect()
    }

    fn sync(&self, file: &File) -> io::Result<()> {
        if self.draw_dropped_sync() {
            return Ok(());
        }
        let key = file_key(file)?;
        // Ranges written from here on are not covered by this sync; take the ones that are, and
        // put them back if the sync fails.
        let covered = self.lock().files.get_mut(&key).map(|t| std::mem::take(&mut t.ranges));
        let result = self.inner.sync(file);
        let mut state = self.lock();
        match (&result, covered) {
            (Err(_), Some(ranges)) => {
                if let Some(t) = state.files.get_mut(&key) {
                    for (s, e) in ranges {
                        add_range(&mut t.ranges, s, e);
                    }
                }
            }
            (Ok(()), _) => {
                if state.files.get(&key).is_some_and(|t| t.ranges.is_empty()) {
                    state.files.remove(&key);
                }
            }
            (Err(_), None) => {}
        }
        result
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        match self.switched(&self.unlink_errno, |c| &mut c.unlink_errors) {
            Some(errno) => Err(io::Error::from_raw_os_error(errno)),
            None => self.inner.remove_file(path),
        }
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        match self.switched(&self.dir_sync_errno, |c| &mut c.dir_sync_errors) {
            Some(errno) => Err(io::Error::from_raw_os_error(errno)),
            None => self.inner.sync_dir(dir),
        }
    }

    fn staging(&self, len: usize) -> io::Result<Staging> {
        self.inner.staging(len)
    }

    fn staging_for_read(&self, len: usize) -> io::Result<Staging> {
        self.inner.staging_for_read(len)
    }
}

impl<E: IoEngine> fmt::Debug for FaultyEngine<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyEngine")
            .field("describe", &self.describe())
            .field("enabled", &self.is_enabled())
            .field("counts", &self.counts())
            .field("inner", &self.inner)
            .finish()
    }
}

fn wide(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Inverts bit `bit` of `buf` (nothing when it lies past the end).
fn flip(buf: &mut [u8], bit: u64) {
    let byte = usize::try_from(bit / 8).unwrap_or(usize::MAX);
    let shift = u32::try_from(bit % 8).unwrap_or(0);
    if let Some(b) = buf.get_mut(byte) {
        *b ^= 1u8 << shift;
    }
}

fn file_key(file: &File) -> io::Result<(u64, u64)> {
    let meta = file.metadata()?;
    Ok((meta.dev(), meta.ino()))
}

fn is_direct(file: &File) -> io::Result<bool> {
    // SAFETY: F_GETFL on a descriptor the caller keeps open; reads flags, touches no memory.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(flags & libc::O_DIRECT != 0)
}

/// Adds `start..end` to sorted, disjoint, non-adjacent `ranges`, merging what it touches.
fn add_range(ranges: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    if start >= end {
        return;
    }
    let first = ranges.partition_point(|r| r.1 < start);
    let mut last = first;
    let (mut s, mut e) = (start, end);
    while last < ranges.len() && ranges[last].0 <= e {
        s = s.min(ranges[last].0);
        e = e.max(ranges[last].1);
        last += 1;
    }
    ranges.splice(first..last, [(s, e)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_overlapping_and_adjacent() {
        let mut r = Vec::new();
        add_range(&mut r, 10, 20);
        add_range(&mut r, 30, 40);
        add_range(&mut r, 50, 60);
        assert_eq!(r, vec![(10, 20), (30, 40), (50, 60)]);
        add_range(&mut r, 20, 30);
        assert_eq!(r, vec![(10, 40), (50, 60)]);
        add_range(&mut r, 0, 5);
        add_range(&mut r, 35, 55);
        assert_eq!(r, vec![(0, 5), (10, 60)]);
        add_range(&mut r, 7, 7);
        assert_eq!(r, vec![(0, 5), (10, 60)]);
        add_range(&mut r, 0, 100);
        assert_eq!(r, vec![(0, 100)]);
    }
}
