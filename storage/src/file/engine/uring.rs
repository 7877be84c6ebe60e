//! The io_uring engine: positional reads and writes split into chunks and submitted in batches
//! on a ring taken from a small per-engine pool, with a registered staging arena for O_DIRECT.
//!
//! # Calls and rings
//!
//! A call takes a ring from the pool (creating one lazily, up to [`RINGS_MAX`]; waiting at most
//! [`RING_WAIT`] for one to come back, then `TimedOut`), splits every request of the call (one
//! for `read_exact_at`/`write_all_at`, many for [`IoEngine::read_batch`]) into chunks of
//! `chunk_bytes`, keeps at most `queue_depth` chunks in flight over all requests together, and
//! reaps completions until every chunk is done. Chunks are queued in request order, so a batch
//! of small reads has up to `queue_depth` of its requests in flight at once. A short completion
//! resubmits the rest of its chunk. Each SQE's `user_data` holds the chunk's index in the call
//! in its high 32 bits and the bytes of that chunk already done in its low 32 bits, so a
//! completion says exactly which range of which request it covered.
//! [`UringEngine::max_in_flight`] records the deepest a call went.
//!
//! # Retirement
//!
//! A call never returns while the kernel may still touch the memory of any of its requests:
//!
//! * When a chunk fails, that request fails: none of its chunks is queued any more, while the
//!   other requests go on. The call keeps reaping until every SQE it submitted has completed,
//!   and only then returns the answers, each request with its own first error. The ring is
//!   healthy afterwards and goes back to the pool.
//! * When `io_uring_enter` itself fails with an error that is not transient (not `EINTR`,
//!   `EAGAIN` or `EBUSY`), the ring is treated as broken. SQEs still sitting in the submission
//!   queue were never consumed by the kernel; nothing enters this ring again (no SQPOLL), so they
//!   never run. For the SQEs the kernel did consume, the call waits for their completions (with
//!   `io_uring_enter(GETEVENTS)` and, should that fail too, by polling the completion queue with
//!   short sleeps, which lets the kernel run completion task work on the way back to user space),
//!   logging every [`RETIRE_LOG_EVERY`] while it waits. Only then is the ring dropped (never
//!   returned to the pool) and the call answers: requests that had finished before the failure
//!   succeed, every other one fails with the ring's error.
//!
//! The call waits rather than cancels: a cancelled request still posts a completion that has to
//! be reaped before its memory is free, a regular-file read or write already handed to the block
//! layer is not cancellable anyway, and a ring whose `io_uring_enter` fails cannot be relied on
//! to take the cancel requests either.
//!
//! We deliberately rely on nothing from closing a ring: closing the io_uring fd starts an
//! asynchronous teardown in the kernel (cancel what can be cancelled, wait for the rest from a
//! workqueue) and returns without waiting for in-flight reads and writes, so dropping a ring with
//! requests in flight would not make the caller's buffers safe to reuse.
//!
//! # Staging arena
//!
//! One [`AlignedBuf`] of `staging_bytes` rounded down to whole slots of [`SLOT_BYTES`] (at most
//! [`ARENA_BYTES_MAX`], the kernel's limit for one registered buffer) is registered with every ring
//! as fixed buffer 0. [`IoEngine::staging`] hands out one slot at a time, zeroed like an owned
//! buffer ([`IoEngine::staging_for_read`] leaves what the slot's last user wrote, for a read that
//! overwrites it all); the slot goes back to the free list when dropped and keeps the arena
//! alive meanwhile.
//! Transfers whose memory lies inside the arena use `ReadFixed`/`WriteFixed`; others use plain
//! `Read`/`Write`. If registering the arena with a ring fails (for example `RLIMIT_MEMLOCK`), that
//! ring uses plain opcodes for everything and the slots are still handed out as aligned memory.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use io_uring::{EnterFlags, IoUring, Probe, opcode, squeue, types};

use super::contract::{
    AlignedBuf, BatchRead, DIRECT_ALIGN, EngineConfig, IoEngine, RegisteredSlot, Staging, round_up,
};

/// Most rings one engine keeps; calls beyond this many at once wait for a ring.
pub const RINGS_MAX: usize = 8;

/// How long a call waits for a ring before failing with `TimedOut`.
pub const RING_WAIT: Duration = Duration::from_secs(5);

/// Bytes of one staging slot: a 4 MiB block with its header fits with ample room, and so does an
/// 8 MiB block with a header of up to 64 KiB. A multiple of [`DIRECT_ALIGN`].
pub const SLOT_BYTES: usize = (8 << 20) + (64 << 10);

/// Largest staging arena: the kernel refuses a single registered buffer over 1 GiB.
pub const ARENA_BYTES_MAX: usize = 1 << 30;

/// Largest ring (and in-flight depth) an engine asks for.
const QUEUE_DEPTH_MAX: u32 = 4096;

/// Largest chunk: keeps one SQE's length well inside `u32` and the kernel's per-call cap.
const CHUNK_BYTES_MAX: usize = 1 << 30;

/// Transient `io_uring_enter` failures (`EAGAIN`, `EBUSY`) tolerated in a row before the ring is
/// treated as broken.
const TRANSIENT_RETRIES: u32 = 1000;

/// Pause between retries of a transient `io_uring_enter` failure, and between completion-queue
/// polls while retiring a broken ring.
const RETRY_PAUSE: Duration = Duration::from_millis(1);

/// How often a call retiring a broken ring logs that it is still waiting.
pub const RETIRE_LOG_EVERY: Duration = Duration::from_secs(5);

const _: () = assert!(SLOT_BYTES.is_multiple_of(DIRECT_ALIGN));

/// io_uring engine; see the [module documentation](self).
pub struct UringEngine {
    // Field order matters: the rings (registered with the arena) drop before the engine's handle
    // on the arena. Slots still handed out keep the arena alive on their own.
    pool: Pool,
    arena: Option<Arc<Arena>>,
    depth: u32,
    chunk: usize,
    config: EngineConfig,
    /// See [`UringEngine::max_in_flight`].
    max_in_flight: AtomicU32,
}

impl UringEngine {
    /// Probes io_uring (a ring of `queue_depth` entries that supports `Read`, `Write`,
    /// `ReadFixed`, `WriteFixed` and `Fsync`) and builds the engine with up to [`RINGS_MAX`] rings.
    /// Fails with `Unsupported` when io_uring cannot be used here.
    pub fn new(config: EngineConfig) -> io::Result<Self> {
        Self::with_limits(config, RINGS_MAX, RING_WAIT)
    }

    /// As [`new`](Self::new) with at most `rings` rings (clamped to `1..=RINGS_MAX`) and `wait` as
    /// the deadline for taking one.
    pub fn with_limits(config: EngineConfig, rings: usize, wait: Duration) -> io::Result<Self> {
        let depth = config.queue_depth.clamp(1, QUEUE_DEPTH_MAX);
        let chunk = round_up(config.chunk_bytes.max(1), DIRECT_ALIGN).min(CHUNK_BYTES_MAX);

        let probe_ring =
            IoUring::new(depth).map_err(|e| unsupported(format!("io_uring unavailable: {e}")))?;
        let mut probe = Probe::new();
        probe_ring
            .submitter()
            .register_probe(&mut probe)
            .map_err(|e| unsupported(format!("io_uring opcode probe failed: {e}")))?;
        let wanted = [
            ("Read", opcode::Read::CODE),
            ("Write", opcode::Write::CODE),
            ("ReadFixed", opcode::ReadFixed::CODE),
            ("WriteFixed", opcode::WriteFixed::CODE),
            ("Fsync", opcode::Fsync::CODE),
        ];
        let missing: Vec<&str> = wanted
            .iter()
            .filter(|(_, code)| !probe.is_supported(*code))
            .map(|(name, _)| *name)
            .collect();
        if !missing.is_empty() {
            return Err(unsupported(format!("io_uring lacks opcodes: {}", missing.join(", "))));
        }

        let slots = (config.staging_bytes / SLOT_BYTES).min(ARENA_BYTES_MAX / SLOT_BYTES);
        let arena = if slots == 0 { None } else { Some(Arc::new(Arena::new(slots)?)) };
        let first = Ring::adopt(probe_ring, arena.as_deref());

        let rings = rings.clamp(1, RINGS_MAX);
        Ok(Self {
            pool: Pool::new(first, rings, wait),
            arena,
            depth,
            chunk,
            config,
            max_in_flight: AtomicU32::new(0),
        })
    }

    /// The configuration the engine was built with (before clamping).
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Rings currently open (idle or in use).
    pub fn rings_open(&self) -> usize {
        self.pool.lock().open
    }

    /// Staging slots: (free now, total).
    pub fn staging_slots(&self) -> (usize, usize) {
        match &self.arena {
            Some(arena) => (lock(&arena.free).len(), arena.slots),
            None => (0, 0),
        }
    }

    fn open_ring(&self) -> io::Result<Ring> {
        let ring = IoUring::new(self.depth)?;
        Ok(Ring::adopt(ring, self.arena.as_deref()))
    }

    fn take(&self) -> io::Result<Lease<'_>> {
        self.pool.take(|| self.open_ring())
    }

    /// Moves bytes between memory and files for every request (all reads or all writes),
    /// keeping up to `queue_depth` chunks in flight over all of them, and answers per request,
    /// in order. Each request's `base..base + len` must stay valid (and, for reads, exclusively
    /// borrowed and disjoint from the others) for the whole call.
    fn transfer(
        &self,
        requests: &[Request<'_>],
        write: bool,
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Vec<io::Result<()>> {
        let mut plan = Plan::new(requests, self.chunk, self.depth, write);
        if !plan.has_work() {
            return plan.into_results();
        }
        let mut lease = match self.take() {
            Ok(lease) => lease,
            Err(e) => {
                plan.fail_all(&e);
                return plan.into_results();
            }
        };
        let ring = match lease.ring_mut() {
            Ok(ring) => ring,
            Err(e) => {
                plan.fail_all(&e);
                return plan.into_results();
            }
        };
        if ring.fixed {
            plan.use_fixed(self.arena.as_deref());
        }
        let outcome = plan.run(&mut ring.ring, done);
        self.max_in_flight.fetch_max(plan.high_water, Ordering::Relaxed);
        if outcome.is_err() {
            // Every unfinished request carries the ring's error; the ring is not reused.
            lease.discard();
        }
        plan.into_results()
    }

    /// One request's transfer.
    fn transfer_one(&self, request: Request<'_>, write: bool) -> io::Result<()> {
        self.transfer(&[request], write, &mut |_, _| {})
            .pop()
            .unwrap_or_else(|| Err(io::Error::other("io_uring engine: no answer for a request")))
    }

    /// Most SQEs one call has had in flight at once since the engine was built (or since
    /// [`UringEngine::reset_max_in_flight`]): above 1 only when a call had several chunks or
    /// several requests of a batch submitted before it reaped the first completion.
    pub fn max_in_flight(&self) -> u32 {
        self.max_in_flight.load(Ordering::Relaxed)
    }

    /// Starts [`UringEngine::max_in_flight`] over from 0.
    pub fn reset_max_in_flight(&self) {
        self.max_in_flight.store(0, Ordering::Relaxed);
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn write_all_at(&self, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        // The kernel only reads through this pointer (Write/WriteFixed).
        let base = data.as_ptr().cast_mut();
        self.transfer_one(Request { file, offset, base, len: data.len() }, true)
    }

    fn read_exact_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.transfer_one(Request { file, offset, base: buf.as_mut_ptr(), len: buf.len() }, false)
    }

    fn read_batch_then(
        &self,
        reads: &mut [BatchRead<'_>],
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Vec<io::Result<()>> {
        // Each buffer is a distinct `&mut` borrow held for the whole call: disjoint and valid.
        let requests: Vec<Request<'_>> = reads
            .iter_mut()
            .map(|r| Request {
                file: r.file,
                offset: r.offset,
                base: r.buf.as_mut_ptr(),
                len: r.buf.len(),
            })
            .collect();
        self.transfer(&requests, false, done)
    }

    fn sync(&self, file: &File) -> io::Result<()> {
        let mut lease = self.take()?;
        let ring = lease.ring_mut()?;
        match sync_on(&mut ring.ring, types::Fd(file.as_raw_fd())) {
            Ok(()) => Ok(()),
            Err(Failure::Io(e)) => Err(e),
            Err(Failure::Ring(e)) => {
                lease.discard();
                Err(e)
            }
        }
    }

    fn staging(&self, len: usize) -> io::Result<Staging> {
        let mut staging = self.staging_for_read(len)?;
        if let Staging::Registered(slot) = &mut staging {
            slot.bytes_mut().fill(0);
        }
        Ok(staging)
    }

    /// A registered slot as its last user left it (an owned buffer, zeroed, when none is free).
    fn staging_for_read(&self, len: usize) -> io::Result<Staging> {
        let want = round_up(len.max(1), DIRECT_ALIGN);
        if let Some(arena) = &self.arena
            && want <= SLOT_BYTES
            && let Some(index) = lock(&arena.free).pop()
        {
            let slot = ArenaSlot { arena: Arc::clone(arena), index, len: want };
            return Ok(Staging::Registered(Box::new(slot)));
        }
        Ok(Staging::Owned(AlignedBuf::zeroed(len)?))
    }
}

impl fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringEngine")
            .field("queue_depth", &self.depth)
            .field("chunk_bytes", &self.chunk)
            .field("rings_open", &self.rings_open())
            .field("staging_slots", &self.staging_slots())
            .finish()
    }
}

fn unsupported(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, msg)
}

/// `usize` to `u64` (lossless on every target Rust supports; saturates otherwise).
fn wide(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data (free lists, pool counters) stays consistent across a panic.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------
// One transfer

/// Why a call failed: an I/O error the ring survived, or a ring that must not be reused.
enum Failure {
    Io(io::Error),
    Ring(io::Error),
}

const LOW_BITS: u64 = 0xffff_ffff;

/// One request of a call: `len` bytes between `base` and `file` at `offset`.
#[derive(Clone, Copy)]
struct Request<'a> {
    file: &'a File,
    offset: u64,
    base: *mut u8,
    len: usize,
}

/// A request as the plan runs it, with its outcome so far.
struct Segment {
    fd: types::Fd,
    offset: u64,
    base: *mut u8,
    len: usize,
    /// The memory lies inside the registered arena (and the ring has it registered).
    fixed: bool,
    /// Chunks of this request not yet fully transferred.
    left: u32,
    /// The request's first error; no more of its chunks are queued once it is set.
    error: Option<io::Error>,
    /// A finished read was handed to the call's `done` (see [`Plan::run`]).
    delivered: bool,
}

/// Bytes `start..end` of segment `segment`: what one SQE (or its resubmitted rest) moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    segment: u32,
    start: usize,
    end: usize,
}

/// Every chunk of every request of one call, and their progress. A token (an SQE's
/// `user_data`) is the chunk's index in `spans` in its high 32 bits and the bytes of that chunk
/// already done in its low 32 bits.
struct Plan {
    segments: Vec<Segment>,
    spans: Vec<Span>,
    depth: u32,
    write: bool,
    /// Most SQEs this call has had in flight at once.
    high_water: u32,
}

/// What a completion left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Completed {
    /// The chunk was short: submit this token for its rest.
    Rest(u64),
    /// The last chunk of this request is done.
    Finished(usize),
}

/// The same error again (an `io::Error` is not `Clone`): the OS code when there is one.
fn copy_error(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

impl Plan {
    /// Splits each request into chunks of `chunk` bytes. A request that cannot run (its range
    /// overflows) starts failed; an empty one has no chunk and succeeds.
    fn new(requests: &[Request<'_>], chunk: usize, depth: u32, write: bool) -> Self {
        let mut segments = Vec::with_capacity(requests.len());
        let mut spans = Vec::new();
        for (index, r) in requests.iter().enumerate() {
            let mut segment = Segment {
                fd: types::Fd(r.file.as_raw_fd()),
                offset: r.offset,
                base: r.base,
                len: r.len,
                fixed: false,
                left: 0,
                error: None,
                delivered: false,
            };
            let chunks = r.len.div_ceil(chunk);
            match (u32::try_from(index), u32::try_from(chunks)) {
                _ if r.offset.checked_add(wide(r.len)).is_none() => {
                    segment.error = Some(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "offset + length overflows",
                    ));
                }
                (Ok(index), Ok(chunks)) => {
                    segment.left = chunks;
                    let mut start = 0;
                    while start < r.len {
                        let end = start.saturating_add(chunk).min(r.len);
                        spans.push(Span { segment: index, start, end });
                        start = end;
                    }
                }
                _ => {
                    segment.error = Some(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "transfer too large for one call",
                    ));
                }
            }
            segments.push(segment);
        }
        let mut plan = Self { segments, spans, depth, write, high_water: 0 };
        if u32::try_from(plan.spans.len()).is_err() {
            plan.fail_all(&io::Error::new(
                io::ErrorKind::InvalidInput,
                "too many chunks for one call",
            ));
        }
        plan
    }

    /// Whether the call has any I/O to do.
    fn has_work(&self) -> bool {
        self.segments.iter().any(|s| s.left > 0 && s.error.is_none())
    }

    /// Fails every request not finished yet with `e` (the call could not run, or its ring broke).
    fn fail_all(&mut self, e: &io::Error) {
        for s in &mut self.segments {
            if s.left > 0 && s.error.is_none() {
                s.error = Some(copy_error(e));
            }
        }
    }

    /// Marks the requests whose memory lies in the registered arena for `ReadFixed`/`WriteFixed`.
    fn use_fixed(&mut self, arena: Option<&Arena>) {
        let Some(arena) = arena else { return };
        for s in &mut self.segments {
            s.fixed = arena.contains(s.base, s.len);
        }
    }

    fn span(&self, token: u64) -> Option<Span> {
        self.spans.get(usize::try_from(token >> 32).ok()?).copied()
    }

    /// Whether the request a token belongs to has failed (its chunks are no longer queued).
    fn failed(&self, token: u64) -> bool {
        self.span(token)
            .and_then(|span| self.segments.get(usize::try_from(span.segment).ok()?))
            .is_none_or(|s| s.error.is_some())
    }

    /// The SQE for what remains of the chunk named by `token`.
    fn entry(&self, token: u64) -> Option<squeue::Entry> {
        let span = self.span(token)?;
        let segment = self.segments.get(usize::try_from(span.segment).ok()?)?;
        let done = usize::try_from(token & LOW_BITS).ok()?;
        let at = span.start.checked_add(done).filter(|at| *at < span.end)?;
        let n = u32::try_from(span.end - at).ok()?;
        // `at < len`, so this stays inside the request's buffer.
        let ptr = segment.base.wrapping_add(at);
        let file_offset = segment.offset + wide(at);
        let fd = segment.fd;
        let entry = match (self.write, segment.fixed) {
            (true, true) => {
                opcode::WriteFixed::new(fd, ptr.cast_const(), n, 0).offset(file_offset).build()
            }
            (true, false) => {
                opcode::Write::new(fd, ptr.cast_const(), n).offset(file_offset).build()
            }
            (false, true) => opcode::ReadFixed::new(fd, ptr, n, 0).offset(file_offset).build(),
            (false, false) => opcode::Read::new(fd, ptr, n).offset(file_offset).build(),
        };
        Some(entry.user_data(token))
    }

    /// Records a completion of `res` for `token`: the token of the chunk's rest when the
    /// transfer was short, or the request's index once its last chunk is done.
    fn complete(&mut self, token: u64, res: i32) -> Option<Completed> {
        let span = self.span(token)?;
        let write = self.write;
        let segment = self.segments.get_mut(usize::try_from(span.segment).ok()?)?;
        if res < 0 {
            let errno = res.checked_neg().unwrap_or(libc::EIO);
            segment.error.get_or_insert_with(|| io::Error::from_raw_os_error(errno));
            return None;
        }
        let n = usize::try_from(res).unwrap_or(0);
        if n == 0 {
            segment.error.get_or_insert_with(|| {
                if write {
                    io::Error::new(io::ErrorKind::WriteZero, "io_uring write made no progress")
                } else {
                    io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "end of file before the buffer was filled",
                    )
                }
            });
            return None;
        }
        let done = usize::try_from(token & LOW_BITS).unwrap_or(usize::MAX).saturating_add(n);
        if span.start.saturating_add(done) < span.end {
            return Some(Completed::Rest((token & !LOW_BITS) | wide(done)));
        }
        segment.left = segment.left.saturating_sub(1);
        (segment.left == 0 && segment.error.is_none())
            .then(|| usize::try_from(span.segment).ok().map(Completed::Finished))
            .flatten()
    }

    /// Hands request `i`'s buffer to `done` if it is a read that finished without error and
    /// has not been handed over yet.
    fn deliver(&mut self, i: usize, done: &mut dyn FnMut(usize, &mut [u8])) {
        let write = self.write;
        let Some(s) = self.segments.get_mut(i) else { return };
        if write || s.delivered || s.left != 0 || s.error.is_some() {
            return;
        }
        s.delivered = true;
        let buf: &mut [u8] = if s.len == 0 {
            &mut []
        } else {
            // SAFETY: `base..base + len` is the request's read buffer, which the caller lent
            // exclusively (`&mut`) for the whole call. Every chunk of it has completed and none
            // is queued again (`left` is 0), so neither the kernel nor this plan touches it
            // until the call returns, and this is the only reference made to it.
            unsafe { std::slice::from_raw_parts_mut(s.base, s.len) }
        };
        done(i, buf);
    }

    /// Runs every chunk, at most `depth` in flight, and hands each read that finished to
    /// `done` once, after the SQEs queued behind it have been submitted (so that the device
    /// keeps working meanwhile), and every other finished one before returning. `Err` is a
    /// broken ring: every SQE the kernel consumed has been reaped and every unfinished request
    /// carries the error.
    ///
    /// `done` runs while other reads may be in flight, so a panic in it must not unwind past
    /// them: it is caught, nothing more is queued, everything in flight is reaped, and only then
    /// does the panic go on.
    fn run(
        &mut self,
        ring: &mut IoUring,
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), io::Error> {
        let mut panicked = None;
        let outcome = self.run_chunks(ring, done, &mut panicked);
        if panicked.is_none() {
            for i in 0..self.segments.len() {
                if let Err(payload) = self.deliver_caught(i, done) {
                    panicked = Some(payload);
                    break;
                }
            }
        }
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
        outcome
    }

    /// [`Plan::deliver`], with a panic of `done` caught and returned.
    fn deliver_caught(
        &mut self,
        i: usize,
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), Box<dyn std::any::Any + Send>> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.deliver(i, done)))
    }

    fn run_chunks(
        &mut self,
        ring: &mut IoUring,
        done: &mut dyn FnMut(usize, &mut [u8]),
        panicked: &mut Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<(), io::Error> {
        let mut next: usize = 0;
        let mut resubmit: Vec<u64> = Vec::new();
        let mut in_flight: u32 = 0;
        let mut finished: Vec<usize> = Vec::new();

        loop {
            {
                let mut sq = ring.submission();
                while in_flight < self.depth {
                    let token = match resubmit.pop() {
                        Some(token) => token,
                        None if next < self.spans.len() => {
                            next += 1;
                            wide(next - 1) << 32
                        }
                        None => break,
                    };
                    if self.failed(token) {
                        continue;
                    }
                    let Some(entry) = self.entry(token) else {
                        // Cannot happen: every span is non-empty and only unfinished rests are
                        // resubmitted.
                        if let Some(s) = self.span(token).and_then(|span| {
                            self.segments.get_mut(usize::try_from(span.segment).ok()?)
                        }) {
                            s.error.get_or_insert_with(|| {
                                io::Error::other("io_uring engine: bad chunk token")
                            });
                        }
                        continue;
                    };
                    // SAFETY: the entry points into one request's buffer (in bounds by `entry`),
                    // which the caller keeps borrowed for this whole call, and the call does not
                    // return before this SQE's completion has been reaped or the ring retired
                    // (see the module documentation on retirement). The fd is borrowed likewise.
                    if unsafe { sq.push(&entry) }.is_err() {
                        // Cannot happen: the queue has at least `depth` entries and holds only
                        // this call's SQEs.
                        resubmit.push(token);
                        break;
                    }
                    in_flight += 1;
                }
            }
            self.high_water = self.high_water.max(in_flight);
            if in_flight == 0 {
                return Ok(());
            }
            if !finished.is_empty() {
                // The device first gets what was just queued, then the caller its buffers.
                let submitted = submit_queued(ring);
                if let Err(e) = submitted {
                    retire(ring, in_flight);
                    self.fail_all(&e);
                    return Err(e);
                }
                for i in std::mem::take(&mut finished) {
                    if panicked.is_some() {
                        break;
                    }
                    if let Err(payload) = self.deliver_caught(i, done) {
                        // Stop queuing; the loop reaps what is in flight, then `run` rethrows.
                        *panicked = Some(payload);
                        self.fail_all(&io::Error::other("a batch's completion handler panicked"));
                    }
                }
            }
            if let Err(e) = submit_and_wait_one(ring) {
                retire(ring, in_flight);
                self.fail_all(&e);
                return Err(e);
            }
            for cqe in ring.completion() {
                in_flight = in_flight.saturating_sub(1);
                match self.complete(cqe.user_data(), cqe.result()) {
                    Some(Completed::Rest(rest)) => resubmit.push(rest),
                    Some(Completed::Finished(i)) => finished.push(i),
                    None => {}
                }
            }
        }
    }

    /// Each request's answer, in order.
    fn into_results(self) -> Vec<io::Result<()>> {
        self.segments
            .into_iter()
            .map(|s| match s.error {
                Some(e) => Err(e),
                None if s.left == 0 => Ok(()),
                None => Err(io::Error::other("io_uring engine: a request was left unfinished")),
            })
            .collect()
    }
}

fn sync_on(ring: &mut IoUring, fd: types::Fd) -> Result<(), Failure> {
    let entry = opcode::Fsync::new(fd).build().user_data(0);
    // SAFETY: an fsync SQE references no memory; the fd is borrowed for the whole call and the
    // call reaps the completion (or retires the ring) before returning.
    if unsafe { ring.submission().push(&entry) }.is_err() {
        return Err(Failure::Ring(io::Error::other("io_uring submission queue unexpectedly full")));
    }
    loop {
        if let Err(e) = submit_and_wait_one(ring) {
            retire(ring, 1);
            return Err(Failure::Ring(e));
        }
        if let Some(cqe) = ring.completion().next() {
            let res = cqe.result();
            return if res < 0 {
                Err(Failure::Io(io::Error::from_raw_os_error(
                    res.checked_neg().unwrap_or(libc::EIO),
                )))
            } else {
                Ok(())
            };
        }
    }
}

/// Submits everything queued without waiting, riding out `EINTR` and a bounded run of
/// `EAGAIN`/`EBUSY` (after which what stays queued goes with the next wait). An error means
/// the ring is broken.
fn submit_queued(ring: &mut IoUring) -> io::Result<()> {
    let mut transient = 0;
    loop {
        match ring.submit() {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY))
                    && transient < TRANSIENT_RETRIES =>
            {
                transient += 1;
                if !ring.completion().is_empty() {
                    return Ok(());
                }
                std::thread::sleep(RETRY_PAUSE);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Submits everything queued and waits for at least one completion, riding out `EINTR` and a
/// bounded run of `EAGAIN`/`EBUSY`. An error means the ring is broken.
fn submit_and_wait_one(ring: &mut IoUring) -> io::Result<()> {
    let mut transient = 0;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY))
                    && transient < TRANSIENT_RETRIES =>
            {
                transient += 1;
                if !ring.completion().is_empty() {
                    return Ok(());
                }
                std::thread::sleep(RETRY_PAUSE);
            }
            Err(e) => return Err(e),
        }
    }
}

/// After `io_uring_enter` failed: waits until every SQE the kernel consumed has completed, so the
/// caller's memory is no longer in use. `pushed` counts SQEs pushed and not yet reaped.
fn retire(ring: &mut IoUring, pushed: u32) {
    // SQEs still in the submission queue were never consumed; nothing enters this ring again
    // with anything to submit, so they never run.
    let unconsumed = u32::try_from(ring.submission().len()).unwrap_or(u32::MAX);
    let mut waiting = pushed.saturating_sub(unconsumed);
    let started = Instant::now();
    let mut next_log = RETIRE_LOG_EVERY;
    while waiting > 0 {
        for _ in ring.completion() {
            waiting = waiting.saturating_sub(1);
        }
        if waiting == 0 {
            break;
        }
        // SAFETY: submits nothing (to_submit = 0) and passes no argument; only waits for a
        // completion on a ring this call owns.
        let waited = unsafe {
            ring.submitter().enter::<libc::sigset_t>(0, 1, EnterFlags::GETEVENTS.bits(), None)
        };
        if waited.is_err() {
            std::thread::sleep(RETRY_PAUSE);
        }
        if started.elapsed() >= next_log {
            tracing::error!(
                in_flight = waiting,
                waited_s = started.elapsed().as_secs(),
                "io_uring ring failed; still waiting for in-flight requests before releasing the caller's buffer"
            );
            next_log += RETIRE_LOG_EVERY;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rings and the pool

struct Ring {
    ring: IoUring,
    /// The staging arena is registered with this ring as fixed buffer 0.
    fixed: bool,
}

impl Ring {
    fn adopt(ring: IoUring, arena: Option<&Arena>) -> Self {
        let Some(arena) = arena else { return Self { ring, fixed: false } };
        let iov = libc::iovec { iov_base: arena.base().cast(), iov_len: arena.len() };
        // SAFETY: the arena's memory stays allocated for as long as this ring exists: the engine
        // owns its rings (in `pool`) and drops them before its `Arc<Arena>` (field order), and
        // rings never leave the engine. The kernel pins the pages while registered.
        let fixed = match unsafe { ring.submitter().register_buffers(&[iov]) } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "io_uring: cannot register the staging arena; this ring uses unregistered I/O");
                false
            }
        };
        Self { ring, fixed }
    }
}

struct PoolState {
    idle: Vec<Ring>,
    /// Rings in existence: idle plus leased.
    open: usize,
    /// Most rings this pool will open; lowered when opening one fails while others exist.
    cap: usize,
}

struct Pool {
    state: Mutex<PoolState>,
    returned: Condvar,
    wait: Duration,
}

impl Pool {
    fn new(first: Ring, cap: usize, wait: Duration) -> Self {
        Self {
            state: Mutex::new(PoolState { idle: vec![first], open: 1, cap }),
            returned: Condvar::new(),
            wait,
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        lock(&self.state)
    }

    fn take(&self, open: impl Fn() -> io::Result<Ring>) -> io::Result<Lease<'_>> {
        let deadline = Instant::now() + self.wait;
        let mut state = self.lock();
        loop {
            if let Some(ring) = state.idle.pop() {
                return Ok(Lease { pool: self, ring: Some(ring), discard: false });
            }
            if state.open < state.cap {
                state.open += 1;
                drop(state);
                match open() {
                    Ok(ring) => return Ok(Lease { pool: self, ring: Some(ring), discard: false }),
                    Err(e) => {
                        state = self.lock();
                        state.open -= 1;
                        self.returned.notify_one();
                        if state.open == 0 {
                            return Err(e);
                        }
                        tracing::warn!(error = %e, rings = state.open, "io_uring: cannot open another ring; keeping the rings already open");
                        state.cap = state.open;
                        continue;
                    }
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no io_uring ring free within {} ms", self.wait.as_millis()),
                ));
            }
            state = self
                .returned
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A ring on loan from the pool; goes back on drop unless discarded.
struct Lease<'a> {
    pool: &'a Pool,
    ring: Option<Ring>,
    discard: bool,
}

impl Lease<'_> {
    fn ring_mut(&mut self) -> io::Result<&mut Ring> {
        self.ring.as_mut().ok_or_else(|| io::Error::other("io_uring lease without a ring"))
    }

    /// The ring failed: close it instead of returning it to the pool.
    fn discard(&mut self) {
        self.discard = true;
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let Some(ring) = self.ring.take() else { return };
        let mut state = self.pool.lock();
        if self.discard || std::thread::panicking() {
            state.open -= 1;
            drop(state);
            drop(ring);
        } else {
            state.idle.push(ring);
            drop(state);
        }
        self.pool.returned.notify_one();
    }
}

// ---------------------------------------------------------------------------------------------
// Staging arena

struct Arena {
    /// Addressed only through raw pointers (`base`): slots hand out disjoint pieces of it, so it
    /// is never borrowed as one slice.
    mem: AlignedBuf,
    slots: usize,
    free: Mutex<Vec<usize>>,
}

impl Arena {
    fn new(slots: usize) -> io::Result<Self> {
        let mem = AlignedBuf::zeroed(slots * SLOT_BYTES)?;
        // Hand out low slots first.
        Ok(Self { mem, slots, free: Mutex::new((0..slots).rev().collect()) })
    }

    fn base(&self) -> *mut u8 {
        self.mem.ptr.as_ptr()
    }

    fn len(&self) -> usize {
        self.slots * SLOT_BYTES
    }

    fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let start = self.base().addr();
        let p = ptr.addr();
        p >= start && p.checked_add(len).is_some_and(|end| end <= start + self.len())
    }
}

/// One slot of the arena, exclusively owned until dropped.
struct ArenaSlot {
    arena: Arc<Arena>,
    index: usize,
    len: usize,
}

impl ArenaSlot {
    fn ptr(&self) -> *mut u8 {
        self.arena.base().wrapping_add(self.index * SLOT_BYTES)
    }
}

impl RegisteredSlot for ArenaSlot {
    fn bytes(&self) -> &[u8] {
        // SAFETY: slot `index` spans SLOT_BYTES >= len bytes inside the arena's live, initialized
        // allocation (kept alive by `arena`); the free list hands each index to one slot at a
        // time, so no other reference to these bytes exists.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl Drop for ArenaSlot {
    fn drop(&mut self) {
        lock(&self.arena.free).push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(rings: usize, wait: Duration) -> UringEngine {
        let config =
            EngineConfig { queue_depth: 4, chunk_bytes: 64 << 10, staging_bytes: 2 * SLOT_BYTES };
        UringEngine::with_limits(config, rings, wait).expect("io_uring works on this machine")
    }

    #[test]
    fn taking_a_ring_times_out_when_all_are_leased() {
        let e = engine(1, Duration::from_millis(50));
        let held = e.take().expect("first ring");
        let started = Instant::now();
        let err = e.take().err().expect("second take must time out");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(50));
        drop(held);
        assert!(e.take().is_ok());
        assert_eq!(e.rings_open(), 1);
    }

    #[test]
    fn pool_opens_rings_lazily_up_to_the_cap() {
        let e = engine(2, Duration::from_millis(50));
        assert_eq!(e.rings_open(), 1);
        let a = e.take().expect("ring");
        let b = e.take().expect("ring");
        assert_eq!(e.rings_open(), 2);
        assert!(e.take().is_err());
        drop((a, b));
        assert_eq!(e.rings_open(), 2);
    }

    #[test]
    fn discarded_ring_frees_its_place() {
        let e = engine(1, Duration::from_millis(50));
        let mut a = e.take().expect("ring");
        a.discard();
        drop(a);
        assert_eq!(e.rings_open(), 0);
        assert!(e.take().is_ok());
        assert_eq!(e.rings_open(), 1);
    }

    #[test]
    fn staging_slots_come_back_on_drop() {
        let e = engine(1, Duration::from_millis(50));
        assert_eq!(e.staging_slots(), (2, 2));
        let a = e.staging(4096).expect("slot");
        let b = e.staging(SLOT_BYTES).expect("slot");
        let c = e.staging(10).expect("owned");
        assert!(matches!(a, Staging::Registered(_)));
        assert!(matches!(b, Staging::Registered(_)));
        assert!(matches!(c, Staging::Owned(_)));
        assert_eq!(e.staging_slots(), (0, 2));
        drop(a);
        assert_eq!(e.staging_slots(), (1, 2));
        drop(e);
        // The slot outlives the engine and keeps the arena alive.
        assert_eq!(b.len(), SLOT_BYTES);
        assert!(b.iter().all(|x| *x == 0));
    }

    #[test]
    fn rings_register_the_arena_as_fixed_buffer_zero() {
        let e = engine(2, Duration::from_millis(50));
        let mut a = e.take().expect("ring");
        let mut b = e.take().expect("ring");
        // Pinning is charged to RLIMIT_MEMLOCK for processes without CAP_IPC_LOCK; where that
        // limit is below two registrations, rings fall back to unregistered I/O by design.
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the rlimit we pass; geteuid has no preconditions.
        let (got, root) =
            unsafe { (libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit), libc::geteuid() == 0) };
        let roomy = limit.rlim_cur == libc::RLIM_INFINITY || limit.rlim_cur >= wide(4 * SLOT_BYTES);
        if got == 0 && (root || roomy) {
            assert!(a.ring_mut().expect("ring").fixed, "probe ring registered the arena");
            assert!(b.ring_mut().expect("ring").fixed, "lazily opened ring registered the arena");
        }
        let without = UringEngine::with_limits(
            EngineConfig { staging_bytes: SLOT_BYTES - 1, ..EngineConfig::default() },
            1,
            Duration::from_millis(50),
        )
        .expect("io_uring");
        assert!(!without.take().expect("ring").ring_mut().expect("ring").fixed);
    }

    #[test]
    fn retire_waits_only_for_consumed_sqes() {
        let mut ring = IoUring::new(8).expect("io_uring");
        let nop = opcode::Nop::new().build().user_data(1);
        // SAFETY: a NOP references no memory.
        unsafe { ring.submission().push(&nop) }.expect("push");
        ring.submit().expect("submit");
        // Two more never submitted: the kernel never consumes them.
        for _ in 0..2 {
            // SAFETY: as above.
            unsafe { ring.submission().push(&nop) }.expect("push");
        }
        let started = Instant::now();
        retire(&mut ring, 3);
        assert!(started.elapsed() < RETIRE_LOG_EVERY);
        assert_eq!(ring.submission().len(), 2, "unsubmitted SQEs stay unconsumed");
        assert!(ring.completion().next().is_none(), "the one completion was reaped");
    }

    #[test]
    fn tokens_round_trip_chunk_spans() {
        let file = File::open("/dev/null").expect("open /dev/null");
        let request = |len| Request { file: &file, offset: 10, base: std::ptr::null_mut(), len };
        let mut plan = Plan::new(&[request(10_000), request(0), request(4096)], 4096, 2, false);
        let spans: Vec<(u32, usize, usize)> =
            plan.spans.iter().map(|s| (s.segment, s.start, s.end)).collect();
        assert_eq!(spans, [(0, 0, 4096), (0, 4096, 8192), (0, 8192, 10_000), (2, 0, 4096)]);
        assert_eq!(plan.segments.iter().map(|s| s.left).collect::<Vec<_>>(), [3, 0, 1]);
        assert!(plan.entry(2 << 32).is_some());
        assert!(plan.entry((2 << 32) | 1808).is_none(), "a finished chunk has nothing left");
        assert!(plan.entry((2 << 32) | 1807).is_some());
        assert!(plan.entry(4 << 32).is_none(), "no such chunk");
        // A short completion leaves the rest to resubmit; the last piece finishes the chunk.
        assert_eq!(plan.complete(2 << 32, 1000), Some(Completed::Rest((2 << 32) | 1000)));
        assert_eq!(plan.complete((2 << 32) | 1000, 808), None);
        assert_eq!(plan.segments[0].left, 2);
        // The last chunk of a request finishes it.
        assert_eq!(plan.complete(0, 4096), None);
        assert_eq!(plan.complete(1 << 32, 4096), Some(Completed::Finished(0)));
        // A failed chunk fails its request only.
        assert_eq!(plan.complete(3 << 32, -libc::EIO), None);
        assert!(plan.failed(3 << 32) && !plan.failed(0));
        let results = plan.into_results();
        assert!(results[0].is_ok() && results[1].is_ok());
        assert_eq!(results[2].as_ref().err().and_then(io::Error::raw_os_error), Some(libc::EIO));
        let overflow =
            Request { file: &file, offset: u64::MAX, base: std::ptr::null_mut(), len: 1 };
        let plan = Plan::new(&[overflow], 4096, 2, false);
        assert!(!plan.has_work());
        assert_eq!(
            plan.into_results()[0].as_ref().err().map(io::Error::kind),
            Some(io::ErrorKind::InvalidInput)
        );
    }
}
