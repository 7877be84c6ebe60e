//! How a FileStore reads committed blocks: one at a time ([`Store::get_into`]) and many at once
//! ([`Store::get_batch`]), through the same three steps so that both answer alike.
//!
//! 1. Pin: under the catalog lock, each key is authorized and its committed block pinned (a
//!    pinned block is never evicted and its file stays until the last reader leaves).
//! 2. Read and judge, outside the lock: the payload lands in the caller's buffer (under
//!    O_DIRECT through aligned staging, unless that buffer is aligned for it already) and is
//!    checked there against the checksum recorded at commit (a buffered one-key read hashes
//!    each piece as it lands). A mismatch is confirmed on a private copy before the block is called damaged;
//!    a damaged, truncated or missing block is a miss and its buffer is zeroed.
//! 3. Settle: under the lock again, each read is unpinned, damaged blocks are dropped (counted
//!    in the store's corrupt drops, phase `Get`), and the answers are made.
//!
//! A batch runs in windows of at most [`BATCH_WINDOW_ITEMS`] blocks and [`BATCH_WINDOW_BYTES`]
//! payload bytes: one lock to pin the window, one [`IoEngine::read_batch`] for all of its reads
//! (io_uring keeps up to its queue depth of them in flight), one lock to settle it. A window
//! never holds two keys of the same logical block: the later one waits for the next window, so
//! that it sees what a read made after the first would see (the first may drop the block, which
//! also changes the miss reason of the logical key's other physical forms).
//!
//! [`IoEngine::read_batch`]: super::engine::IoEngine::read_batch

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;

use gpucache_dataplane::BlockState;
use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::{Checksum, ChecksumBuilder};
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::store::{
    BatchGet, CorruptReason, Delivery, Get, GetTo, GotOne, MissReason, Retirement, StorageEffect,
    StoreError, authorize,
};
use memmap2::Mmap;

use super::engine::{self, BatchRead, Staging};
use super::open_files::OpenId;
use super::{FilePayload, FileStore};
use crate::catalog::{Catalog, ReadPin};

use super::{BATCH_WINDOW_BYTES, BATCH_WINDOW_ITEMS, READ_HASH_PIECE_BYTES};

/// Most bytes of one staging buffer shared by consecutive O_DIRECT reads of a batch: one
/// registered io_uring slot (the other engines' staging takes any size).
const STAGING_PIECE_BYTES: usize = engine::uring::SLOT_BYTES;

/// Pages whose residency one `mincore` call reports, at most.
const MINCORE_PAGES: usize = 256;

/// Whether every page that `bytes` (inside a map) touches is in memory now.
fn resident(bytes: &[u8]) -> bool {
    // SAFETY: sysconf reads a constant of the system.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let first = bytes.as_ptr() as usize / page * page;
    let end = bytes.as_ptr() as usize + bytes.len();
    let mut vec = [0u8; MINCORE_PAGES];
    let mut at = first;
    while at < end {
        let len = (end - at).min(MINCORE_PAGES * page);
        let pages = len.div_ceil(page);
        // SAFETY: [at, at + len) lies inside one live map (page-aligned start, at most the map's
        // last page), and `vec` has room for one byte per page of it.
        let rc = unsafe { libc::mincore(at as *mut libc::c_void, len, vec.as_mut_ptr()) };
        if rc != 0 || vec[..pages].iter().any(|v| v & 1 == 0) {
            return false;
        }
        at += pages * page;
    }
    true
}

/// A pinned block and where its payload is.
#[derive(Debug)]
pub(super) struct PinnedRead {
    pin: ReadPin,
    /// The file that holds the payload (a block file or a log segment), and its kept
    /// descriptor's name.
    path: Arc<Path>,
    open_as: OpenId,
    header_len: u64,
}

/// What reading a pinned block found.
#[derive(Debug)]
pub(super) struct ReadOutcome {
    /// The read is a miss; the destination was zeroed.
    corrupt: bool,
    /// The block itself is damaged, and goes.
    damage: Option<CorruptReason>,
    /// The read failed; the destination was zeroed.
    failure: Option<io::Error>,
}

/// The same error again (an `io::Error` is not `Clone`): the OS code when there is one.
fn copy_error(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

fn unanswered() -> StoreError {
    StoreError::Backend {
        operation: "get",
        detail: "the batch left an item unanswered".into(),
        retirement: Retirement::Retired,
    }
}

impl FileStore {
    /// Step 1 for one key, under the lock: the pinned block, or the answer when there is none
    /// to read (a miss, or a block whose file is not in place yet or any more). Payloads of
    /// blocks that leave the catalog go to `released`.
    pub(super) fn pin_for_read(
        catalog: &mut Catalog<FilePayload>,
        key: &PhysicalKey,
        capacity: usize,
        released: &mut Vec<FilePayload>,
    ) -> Result<Result<PinnedRead, Get>, StoreError> {
        let pin = match catalog.pin_read(key, capacity)? {
            Ok(pin) => pin,
            Err(miss) => return Ok(Err(Get::Miss(miss))),
        };
        match catalog.entry(pin.region).map(|b| &b.payload) {
            Some(FilePayload::Stored { path, header_len, slot, .. }) => {
                let open_as = match slot {
                    Some(slot) => OpenId::Segment(slot.segment),
                    None => OpenId::Region(pin.region),
                };
                Ok(Ok(PinnedRead { pin, path: Arc::clone(path), open_as, header_len: *header_len }))
            }
            // Committed, but its bytes are with the tier above and not written yet.
            Some(FilePayload::Deferred { .. }) => {
                released.extend(catalog.unpin_read(pin.region, None));
                Ok(Err(Get::Miss(MissReason::NotReadable(BlockState::Writing))))
            }
            _ => {
                released.extend(catalog.unpin_read(pin.region, None));
                Ok(Err(Get::Miss(MissReason::NotReadable(BlockState::Evicting))))
            }
        }
    }

    /// Step 2's verdict on `read`, the outcome of reading `p`'s payload into `dst` (exactly
    /// the payload's length). `intact` is whether `dst` matches the checksum when that was
    /// already checked (as a batch does while its other reads are in flight).
    pub(super) fn judge(
        &self,
        p: &PinnedRead,
        read: io::Result<()>,
        intact: Option<bool>,
        dst: &mut [u8],
    ) -> ReadOutcome {
        let (corrupt, damage, failure) = match read {
            Ok(()) if intact.unwrap_or_else(|| p.pin.delivered_intact(dst)) => (false, None, None),
            Ok(()) => (true, self.damage_confirmed(p), None),
            // A short file is a truncated block, a missing one is gone: a miss, and the block
            // goes.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                (true, Some(CorruptReason::Truncated), None)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                (true, Some(CorruptReason::Missing), None)
            }
            Err(e) => (false, None, Some(e)),
        };
        if corrupt || failure.is_some() {
            dst.fill(0);
        }
        ReadOutcome { corrupt, damage, failure }
    }

    /// Whether `p`'s block is damaged, after bytes of it failed their check: confirmed on a
    /// private copy before the block is dropped, because the caller's buffer may be memory
    /// another process can write (a shared segment), and a read can fail in transit without the
    /// file being damaged.
    fn damage_confirmed(&self, p: &PinnedRead) -> Option<CorruptReason> {
        let mut own = vec![0u8; p.pin.len_bytes()];
        let intact = self.read_payload(p.open_as, &p.path, p.header_len, &mut own).is_ok()
            && p.pin.delivered_intact(&own);
        (!intact).then_some(CorruptReason::Checksum)
    }

    /// Step 3 for every read, under one lock, in order: unpins, drops damaged blocks, answers.
    pub(super) fn settle(
        &self,
        reads: Vec<(PinnedRead, ReadOutcome)>,
    ) -> Vec<Result<Get, StoreError>> {
        let mut released = Vec::new();
        let removing: Vec<bool> = {
            let mut catalog = self.lock();
            reads
                .iter()
                .map(|(p, outcome)| {
                    // A file an invalidation is unlinking right now is not damage: the read is
                    // a miss.
                    let removing = matches!(
                        catalog.entry(p.pin.region).map(|b| &b.payload),
                        Some(FilePayload::Stored { removing: true, .. })
                    );
                    let damage = outcome.damage.filter(|_| !removing);
                    released.extend(catalog.unpin_read(p.pin.region, damage));
                    removing
                })
                .collect()
        };
        self.dispose(released);
        reads
            .into_iter()
            .zip(removing)
            .map(|((p, outcome), removing)| {
                if let Some(reason) = outcome.damage.filter(|_| !removing) {
                    tracing::warn!(
                        path = %p.path.display(), reason = reason.name(),
                        "damaged block found by a read; dropped"
                    );
                }
                if let Some(e) = outcome.failure {
                    return Err(StoreError::storage(
                        "get",
                        "block read",
                        &p.path,
                        &e,
                        StorageEffect::Unchanged,
                    ));
                }
                if outcome.corrupt && removing {
                    return Ok(Get::Miss(MissReason::NotReadable(BlockState::Evicting)));
                }
                Ok(p.pin.answer(outcome.corrupt))
            })
            .collect()
    }

    /// Step 1 for one key: authorized and pinned, or the answer.
    fn pin_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
    ) -> Result<Result<PinnedRead, Get>, StoreError> {
        authorize(caller, key, Right::Read)?;
        let mut released = Vec::new();
        let pinned = Self::pin_for_read(&mut self.lock(), key, capacity, &mut released);
        self.dispose(released);
        pinned
    }

    /// [`Store::get_into`](gpucache_dataplane::store::Store::get_into).
    pub(super) fn read_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        match self.pin_one(caller, key, dst.len())? {
            Ok(p) => self.read_and_settle(p, dst),
            Err(answer) => Ok(answer),
        }
    }

    /// [`Store::get_one`](gpucache_dataplane::store::Store::get_one): a block of the log whose
    /// pages are all in memory is lent from its segment's map, so a warm GET copies nothing
    /// here (the sender hashes the bytes where they lie and sends them only when they match);
    /// any other block is read into the sender's buffer as [`Self::read_one`] reads it.
    pub(super) fn lend_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        let p = match self.pin_one(caller, key, capacity)? {
            Ok(p) => p,
            Err(answer) => return Ok(GotOne::copied(answer)),
        };
        let Some((map, start)) = self.resident_map(&p) else {
            let dst = to.buffer();
            if dst.len() < p.pin.len_bytes() {
                // The sender could not lay out a buffer of the capacity it asked for.
                let failure = io::Error::other("the GET's buffer is smaller than its capacity");
                let outcome = ReadOutcome { corrupt: false, damage: None, failure: Some(failure) };
                let got = self.settle(vec![(p, outcome)]).pop();
                return got.unwrap_or_else(|| Err(unanswered())).map(GotOne::copied);
            }
            return self.read_and_settle(p, dst).map(GotOne::copied);
        };
        let bytes = &map[start..start + p.pin.len_bytes()];
        let sum = to.lend(bytes, p.pin.checksum).unwrap_or_else(|| Checksum::of(bytes));
        let outcome = if p.pin.intact_by(sum) {
            ReadOutcome { corrupt: false, damage: None, failure: None }
        } else {
            ReadOutcome { corrupt: true, damage: self.damage_confirmed(&p), failure: None }
        };
        let got = self.settle(vec![(p, outcome)]).pop().unwrap_or_else(|| Err(unanswered()))?;
        let delivery =
            if matches!(got, Get::Hit { .. }) { Delivery::Lent } else { Delivery::Copied };
        Ok(GotOne { get: got, delivery, tier: None })
    }

    /// The map of `p`'s log segment and where its payload starts there, when the block is in
    /// the log, the store reads through the page cache, and every page of the payload is in
    /// memory now. A page read from the device through a map reports a failure as a signal
    /// that would stop the process, not as an error a read can answer, so a block with any page
    /// out of memory is read with `pread` instead.
    fn resident_map(&self, p: &PinnedRead) -> Option<(Arc<Mmap>, usize)> {
        let OpenId::Segment(number) = p.open_as else { return None };
        if self.direct_io {
            return None;
        }
        let map = self.files.map_segment(number, &p.path).ok()?;
        let start = usize::try_from(p.header_len).ok()?;
        let bytes = map.get(start..start.checked_add(p.pin.len_bytes())?)?;
        resident(bytes).then_some((map, start))
    }

    /// Steps 2 and 3 for one pinned block: read into `dst`, judged, settled.
    fn read_and_settle(&self, p: PinnedRead, dst: &mut [u8]) -> Result<Get, StoreError> {
        let dst = &mut dst[..p.pin.len_bytes()];
        let (read, intact) = if self.direct_io {
            (self.read_payload(p.open_as, &p.path, p.header_len, dst), None)
        } else {
            match self.read_payload_hashed(p.open_as, &p.path, p.header_len, dst) {
                Ok(sum) => (Ok(()), Some(p.pin.intact_by(sum))),
                Err(e) => (Err(e), None),
            }
        };
        let outcome = self.judge(&p, read, intact, dst);
        self.settle(vec![(p, outcome)]).pop().unwrap_or_else(|| Err(unanswered()))
    }

    /// A buffered read of `region`'s payload into `dst`, hashed as it lands: each piece of
    /// [`READ_HASH_PIECE_BYTES`] is hashed right after it is read, while it is still in the
    /// cache, so the check costs no second pass over memory. Returns the checksum of `dst`.
    fn read_payload_hashed(
        &self,
        open_as: OpenId,
        path: &Path,
        header_len: u64,
        dst: &mut [u8],
    ) -> io::Result<Checksum> {
        let file = self.files.get(open_as, path, false)?;
        let mut hasher = ChecksumBuilder::default();
        let mut at = header_len;
        for piece in dst.chunks_mut(READ_HASH_PIECE_BYTES) {
            self.engine.read_exact_at(&file, at, piece)?;
            hasher.update(piece);
            at += piece.len() as u64;
        }
        Ok(hasher.finish())
    }

    /// [`Store::get_batch`](gpucache_dataplane::store::Store::get_batch).
    pub(super) fn get_many(
        &self,
        caller: &Caller,
        items: &mut [BatchGet<'_>],
    ) -> Vec<Result<Get, StoreError>> {
        let mut answers: Vec<Option<Result<Get, StoreError>>> = Vec::with_capacity(items.len());
        answers.resize_with(items.len(), || None);
        let mut start = 0;
        while start < items.len() {
            start = self.get_window(caller, items, start, &mut answers);
        }
        answers.into_iter().map(|a| a.unwrap_or_else(|| Err(unanswered()))).collect()
    }

    /// Answers one window of `items` starting at `start`; returns where the next one starts
    /// (always after `start`).
    fn get_window(
        &self,
        caller: &Caller,
        items: &mut [BatchGet<'_>],
        start: usize,
        answers: &mut [Option<Result<Get, StoreError>>],
    ) -> usize {
        let mut pinned: Vec<(usize, PinnedRead)> = Vec::new();
        let mut logical: HashSet<KeyDigest> = HashSet::new();
        let mut bytes: u64 = 0;
        let mut released = Vec::new();
        let mut next = start;
        {
            let mut catalog = self.lock();
            while next < items.len()
                && pinned.len() < BATCH_WINDOW_ITEMS
                && bytes < BATCH_WINDOW_BYTES
            {
                let item = &items[next];
                let logical_key = item.key.logical_digest();
                if logical.contains(&logical_key) {
                    break;
                }
                let answer = authorize(caller, item.key, Right::Read).and_then(|()| {
                    Self::pin_for_read(&mut catalog, item.key, item.dst.len(), &mut released)
                });
                match answer {
                    Ok(Ok(p)) => {
                        logical.insert(logical_key);
                        bytes = bytes.saturating_add(p.pin.len);
                        pinned.push((next, p));
                    }
                    Ok(Err(answer)) => answers[next] = Some(Ok(answer)),
                    Err(e) => answers[next] = Some(Err(e)),
                }
                next += 1;
            }
        }
        self.dispose(released);
        if pinned.is_empty() {
            return next;
        }
        let reads = self.read_pinned(items, &pinned);
        let mut judged = Vec::with_capacity(pinned.len());
        let mut indices = Vec::with_capacity(pinned.len());
        for ((index, p), (read, intact)) in pinned.into_iter().zip(reads) {
            let dst = &mut items[index].dst[..p.pin.len_bytes()];
            let outcome = self.judge(&p, read, intact, dst);
            judged.push((p, outcome));
            indices.push(index);
        }
        for (index, answer) in indices.into_iter().zip(self.settle(judged)) {
            answers[index] = Some(answer);
        }
        next
    }

    /// Reads every pinned block's payload into the front of its item's buffer with one batch
    /// call to the engine; answers per pinned block, in order, with whether the delivered
    /// bytes match their checksum. A payload lands straight in the caller's buffer when it can
    /// (buffered I/O, or an O_DIRECT read of a buffer aligned for it); the others go through
    /// aligned staging buffers shared by consecutive reads, of up to [`STAGING_PIECE_BYTES`]
    /// (one registered slot each on io_uring), each read padded to [`engine::DIRECT_ALIGN`].
    /// As each read finishes (while the others are still in flight on io_uring) its payload is
    /// copied to the caller's buffer when it was staged, and checked there.
    fn read_pinned(
        &self,
        items: &mut [BatchGet<'_>],
        pinned: &[(usize, PinnedRead)],
    ) -> Vec<(io::Result<()>, Option<bool>)> {
        let files: Vec<io::Result<Arc<File>>> = pinned
            .iter()
            .map(|(_, p)| self.files.get(p.open_as, &p.path, self.direct_io))
            .collect();
        let mut results: Vec<Option<io::Result<()>>> = Vec::with_capacity(pinned.len());
        results.resize_with(pinned.len(), || None);
        let mut intact: Vec<Option<bool>> = vec![None; pinned.len()];
        let len = |k: usize| pinned[k].1.pin.len_bytes();
        let padded = |k: usize| engine::round_up(len(k), engine::DIRECT_ALIGN);
        // Each readable block's destination, lent by `items` one by one (the pinned indices
        // ascend), and whether it can be read straight into it. A failed open is that block's
        // answer.
        let mut dsts: Vec<Option<&mut [u8]>> = Vec::with_capacity(pinned.len());
        let mut straight = Vec::with_capacity(pinned.len());
        let mut staged = Vec::new();
        {
            let mut rest: &mut [BatchGet<'_>] = items;
            let mut base = 0;
            for (k, ((index, _), file)) in pinned.iter().zip(&files).enumerate() {
                let item = std::mem::take(&mut rest)
                    .get_mut(index - base..)
                    .and_then(<[_]>::split_first_mut)
                    .map(|(item, tail)| {
                        rest = tail;
                        base = index + 1;
                        item
                    });
                let dst = item.and_then(|item| item.dst.get_mut(..len(k)));
                match (file, dst) {
                    (Err(e), _) => {
                        results[k] = Some(Err(copy_error(e)));
                        dsts.push(None);
                    }
                    (Ok(_), None) => {
                        results[k] = Some(Err(io::Error::other("a batch item lost its buffer")));
                        dsts.push(None);
                    }
                    (Ok(_), Some(dst)) => {
                        if !self.direct_io || engine::direct_ready(dst) {
                            straight.push(k);
                        } else {
                            staged.push(k);
                        }
                        dsts.push(Some(dst));
                    }
                }
            }
        }
        // The staged blocks, grouped into pieces.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut sum = 0;
        for &k in &staged {
            let n = padded(k);
            if groups.is_empty() || (sum > 0 && sum + n > STAGING_PIECE_BYTES) {
                groups.push(Vec::new());
                sum = 0;
            }
            sum += n;
            if let Some(g) = groups.last_mut() {
                g.push(k);
            }
        }
        let mut pieces: Vec<(Staging, &[usize])> = Vec::with_capacity(groups.len());
        for group in &groups {
            let total = group.iter().map(|&k| padded(k)).sum();
            match self.engine.staging_for_read(total) {
                Ok(staging) => pieces.push((staging, group)),
                Err(e) => {
                    for &k in group {
                        results[k] = Some(Err(copy_error(&e)));
                    }
                }
            }
        }
        // Each staged block's slice of its piece.
        let mut staged_bufs: Vec<Option<&mut [u8]>> = Vec::with_capacity(pinned.len());
        staged_bufs.resize_with(pinned.len(), || None);
        for (staging, group) in &mut pieces {
            let mut rest: &mut [u8] = &mut staging[..];
            for &k in group.iter() {
                let Some((buf, tail)) = std::mem::take(&mut rest).split_at_mut_checked(padded(k))
                else {
                    results[k] = Some(Err(io::Error::other("staging buffer too small")));
                    continue;
                };
                rest = tail;
                staged_bufs[k] = Some(buf);
            }
        }
        // The reads go to the engine in item order, straight and staged alike, so that a batch
        // asks for its blocks in the order the same reads made one by one would.
        let mut reads = Vec::with_capacity(straight.len() + staged.len());
        let mut order = Vec::with_capacity(straight.len() + staged.len());
        // The staged blocks' destinations stay here, to be filled as their reads finish.
        let mut later: Vec<Option<&mut [u8]>> = Vec::with_capacity(pinned.len());
        for (k, (dst, staged_buf)) in dsts.into_iter().zip(staged_bufs).enumerate() {
            let Ok(file) = &files[k] else {
                later.push(None);
                continue;
            };
            let offset = pinned[k].1.header_len;
            match (dst, staged_buf) {
                (Some(dst), _) if straight.binary_search(&k).is_ok() => {
                    reads.push(BatchRead { file, offset, buf: dst });
                    order.push(k);
                    later.push(None);
                }
                (dst, Some(buf)) => {
                    reads.push(BatchRead { file, offset, buf });
                    order.push(k);
                    later.push(dst);
                }
                (dst, None) => later.push(dst),
            }
        }
        let mut finished = |j: usize, buf: &mut [u8]| {
            let Some(&k) = order.get(j) else { return };
            let n = len(k);
            let delivered: &[u8] = match later.get_mut(k) {
                // Staged: the payload goes to the caller's buffer, and is checked there.
                Some(Some(dst)) => match buf.get(..n) {
                    Some(src) => {
                        dst.copy_from_slice(src);
                        dst
                    }
                    None => return,
                },
                _ => match buf.get(..n) {
                    Some(b) => b,
                    None => return,
                },
            };
            intact[k] = Some(pinned[k].1.pin.delivered_intact(delivered));
        };
        let answers = self.engine.read_batch_then(&mut reads, &mut finished);
        for (&k, result) in order.iter().zip(answers) {
            results[k] = Some(result);
        }
        results
            .into_iter()
            .zip(intact)
            .map(|(r, intact)| {
                let r =
                    r.unwrap_or_else(|| Err(io::Error::other("a batch read left a block unread")));
                (r, intact)
            })
            .collect()
    }
}
