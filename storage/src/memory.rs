//! MemoryStore: the in-process reference implementation of the store contract.
//!
//! Host DRAM behind one mutex, over the shared [`crate::catalog`]. It refuses admission
//! instead of evicting, guarantees that every failed call has stopped touching the caller's
//! buffers, and copies payload only in `write` and `get_into`. Every other backend is checked
//! against the same conformance suite it passes.
//!
//! Batch calls take the mutex once for the whole batch where the batch copies nothing
//! (lookups, invalidations), and otherwise once per phase: a batch GET pins every block under
//! one lock, copies and verifies them without it, and unpins them under one more (a damaged
//! block it drops starts a new round for the items after it); a batch PUT
//! commits each block and reserves the next one under the same lock, so that its copies run
//! without the lock while each PUT still sees the ones before it, as single PUTs would.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{LimitsError, RequestId, ResourceLimits};
use gpucache_dataplane::registry::{Epoch, EpochSource, LocalEpochs, MemoryKind, RegionId};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, CorruptReason, Delivery, FullPolicy, Get,
    GetTo, GotOne, Implementation, Invalidate, LendTo, Lookup, MissReason, PurgeScope, Put,
    Reclaimed, Reservation, Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats,
    authorize, put_damaged, put_reserved,
};

use crate::catalog::{Catalog, ReadPin};
use crate::evict::PolicyKind;
use crate::host::arena::{ArenaBuf, ArenaStats, PayloadArena};

/// Most bytes of freed payload buffers kept for reuse (also capped at a quarter of
/// `retained_bytes_max`).
pub const SPARE_BYTES_MAX: u64 = 256 << 20;

/// Freed payload buffers kept for reuse, so that a steady PUT stream does not fault fresh pages
/// in for every block. A reused buffer still holds old bytes; that is safe because a commit
/// requires every byte to have been written, and only committed blocks are read. Buffers of
/// quarantined regions never come here before their reclaim proof.
#[derive(Debug, Default)]
struct SpareBuffers {
    by_len: HashMap<usize, Vec<Bytes>>,
    bytes: u64,
    bytes_max: u64,
    /// Where new blocks go first when the store has one (a freed piece of it returns there,
    /// not here).
    arena: Option<Arc<PayloadArena>>,
}

impl SpareBuffers {
    fn take(&mut self, len: usize) -> Payload {
        if let Some(list) = self.by_len.get_mut(&len)
            && let Some(buf) = list.pop()
        {
            self.bytes -= len as u64;
            return Arc::new(buf);
        }
        if let Some(piece) = self.arena.as_ref().and_then(|a| a.take(len)) {
            return Arc::new(Bytes::Arena(piece));
        }
        Arc::new(Bytes::Heap(fresh_buffer(len)))
    }

    /// Keeps freed buffers for reuse; one a reader still holds is simply dropped (it is freed
    /// when that read finishes).
    fn give(&mut self, buffers: Vec<Payload>) {
        for buf in buffers.into_iter().filter_map(|b| Arc::try_unwrap(b).ok()) {
            let Bytes::Heap(buf) = buf else { continue };
            let len = buf.len() as u64;
            if self.bytes + len <= self.bytes_max {
                self.bytes += len;
                self.by_len.entry(buf.len()).or_default().push(Bytes::Heap(buf));
            }
        }
    }
}

/// Buffers at least this large have their pages faulted in by one `madvise` call when they are
/// allocated, rather than one page fault at a time while the first write copies into them.
const PREFAULT_BYTES_MIN: usize = 256 << 10;

/// A zeroed buffer for a new block. A large one comes from the allocator as untouched mapped
/// pages; `MADV_POPULATE_WRITE` (Linux 5.14) makes them resident in one kernel call, which on
/// this kind of VM costs well under the per-page faults the write would otherwise take. Where
/// the call is not supported the pages simply fault in as before.
fn fresh_buffer(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    if len >= PREFAULT_BYTES_MIN {
        const PAGE: usize = 4096;
        let start = buf.as_mut_ptr() as usize;
        let aligned = start.next_multiple_of(PAGE);
        let end = (start + len) / PAGE * PAGE;
        if end > aligned {
            // SAFETY: `aligned..end` lies inside `buf`'s allocation, which this function owns;
            // MADV_POPULATE_WRITE only makes those pages resident (they stay zero) and changes
            // nothing Rust can observe.
            let _ = unsafe {
                libc::madvise(
                    aligned as *mut libc::c_void,
                    end - aligned,
                    libc::MADV_POPULATE_WRITE,
                )
            };
        }
    }
    buf
}

/// A block's bytes, on the heap or in the store's pre-faulted arena.
#[derive(Debug, Default)]
enum Bytes {
    #[default]
    Empty,
    Heap(Vec<u8>),
    Arena(ArenaBuf),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Empty => &[],
            Self::Heap(v) => v,
            Self::Arena(a) => a,
        }
    }
}

impl std::ops::DerefMut for Bytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Empty => &mut [],
            Self::Heap(v) => v,
            Self::Arena(a) => a,
        }
    }
}

impl Clone for Bytes {
    /// A copy on the heap (an arena piece has one owner).
    fn clone(&self) -> Self {
        match self {
            Self::Empty => Self::Empty,
            other => Self::Heap(other.to_vec()),
        }
    }
}

/// A block's bytes. Shared so that a read can copy (and verify) them after the lock is
/// released: a committed block is never written again, and a pinned one is never freed.
type Payload = Arc<Bytes>;

#[derive(Debug)]
struct Inner {
    catalog: Catalog<Payload>,
    spare: SpareBuffers,
}

impl Inner {
    /// Starts a create-only PUT of `len` bytes, the new block's buffer coming from the spares.
    fn reserve(
        &mut self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
        now_ms: u64,
    ) -> Result<Reserve, StoreError> {
        let Inner { catalog, spare } = self;
        let (answer, released) = catalog.reserve(caller, key, len, request, now_ms, |len| {
            usize::try_from(len).map(|n| spare.take(n)).map_err(|_| StoreError::Backend {
                operation: "reserve",
                detail: format!("{len} bytes do not fit this address space"),
                retirement: Retirement::Retired,
            })
        })?;
        spare.give(released);
        Ok(answer)
    }

    /// Takes the buffer of a reserved block out of the catalog, to be filled without the lock
    /// (nobody else reads or writes a block in that state).
    fn take_buffer(
        &mut self,
        caller: &Caller,
        r: &Reservation,
        len: u64,
    ) -> Result<Payload, StoreError> {
        let b = self.catalog.write_into(caller, r, 0, len)?;
        Ok(std::mem::take(&mut b.payload))
    }

    /// Puts a buffer taken by [`Self::take_buffer`] back and commits its block; `filled` is the
    /// checksum of the filled buffer, none when it could not be filled.
    fn commit_buffer(
        &mut self,
        caller: &Caller,
        r: &Reservation,
        buf: Payload,
        filled: Option<Checksum>,
        now_ms: u64,
    ) -> Result<Committed, StoreError> {
        if let Some(b) = self.catalog.entry_mut(r.region) {
            b.payload = buf;
        }
        let Some(checksum) = filled else {
            return Err(StoreError::Backend {
                operation: "put",
                detail: "the block's buffer is shared while it is being written".into(),
                retirement: Retirement::Retired,
            });
        };
        self.catalog.start_commit(caller, r)?;
        self.catalog.finish_commit(r.region, checksum, now_ms)
    }

    /// Ends a PUT's reservation after `error`, with the error's retirement. The reservation may
    /// already be gone (fenced, quarantined); the error is what the caller needs either way.
    fn abort_after(&mut self, caller: &Caller, r: Reservation, error: &StoreError) {
        if let Ok((_, released)) = self.catalog.abort(caller, r, error.retirement()) {
            self.spare.give(released);
        }
    }
}

/// Copies `src` into the front of a block's buffer and checksums the whole buffer (in the same
/// pass as the copy when `src` fills it, as it does for a PUT); none when the buffer is shared
/// or too short.
fn fill(buf: &mut Payload, src: &[u8]) -> Option<Checksum> {
    Arc::get_mut(buf).and_then(|b| {
        let sum = Checksum::copy_of(b, src)?;
        Some(if b.len() == src.len() { sum } else { Checksum::of(b) })
    })
}

/// Copies a pinned block into the front of `dst` and verifies it there, zeroing what does not
/// verify. Returns whether the read failed its check, and the damage to drop the block for:
/// only when the block's own bytes are damaged, since the caller's buffer may be memory
/// another process can write (a shared segment), which is not the block's fault.
fn deliver(
    pin: &ReadPin,
    payload: Option<&Payload>,
    dst: &mut [u8],
) -> (bool, Option<CorruptReason>) {
    let len = pin.len_bytes();
    let source = payload.and_then(|p| p.get(..len));
    // The copy and the check of what it wrote are one pass over the bytes.
    let corrupt = match source.and_then(|src| Checksum::copy_of(dst, src)) {
        Some(delivered) => !pin.intact_by(delivered),
        None => !pin.delivered_intact(&dst[..len]),
    };
    let damaged = corrupt && !source.is_some_and(|src| pin.delivered_intact(src));
    let reason = if source.is_some() { CorruptReason::Checksum } else { CorruptReason::Truncated };
    if corrupt {
        dst[..len].fill(0);
    }
    (corrupt, damaged.then_some(reason))
}

/// A GET item of a batch after the pinning lock: answered there, or pinned for its copy.
enum Pinned {
    Answered(Result<Get, StoreError>),
    Reading { pin: ReadPin, payload: Option<Payload> },
}

/// The in-process reference store.
#[derive(Debug)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    clock: Arc<dyn Clock>,
    full_policy: FullPolicy,
}

/// How a [`MemoryStore`] is built beyond its limits.
#[derive(Debug, Default)]
pub struct MemoryOptions {
    /// Evict by this policy when full; `None` refuses, as the contract's reference store does.
    pub eviction: Option<PolicyKind>,
    /// Memory new blocks are carved from while it has room (see [`MemoryStore::with_arena`]).
    pub arena: Option<Arc<PayloadArena>>,
    /// Keep every evicted block's bytes until [`MemoryStore::take_handed_down`] collects them,
    /// for a tier below that takes them.
    pub hand_down: bool,
}

/// A block this store evicted, with its bytes, for the tier below.
#[derive(Debug)]
pub struct EvictedBlock {
    pub key: PhysicalKey,
    pub checksum: Checksum,
    payload: Payload,
}

impl EvictedBlock {
    /// The block's payload (never checked since its commit: the tier below checks it when
    /// it reads it).
    pub fn bytes(&self) -> &[u8] {
        &self.payload
    }
}

impl MemoryStore {
    /// A store with the given limits and clock, on a local epoch counter.
    pub fn new(limits: ResourceLimits, clock: Arc<dyn Clock>) -> Result<Self, LimitsError> {
        Self::with_epochs(limits, clock, Box::new(LocalEpochs))
    }

    /// A store whose new blocks go into `arena` while it has room (and to the heap after), so
    /// that writing them faults no page in: an arena of `retained_bytes_max` holds every block
    /// the store may keep.
    pub fn with_arena(
        limits: ResourceLimits,
        clock: Arc<dyn Clock>,
        arena: Arc<PayloadArena>,
    ) -> Result<Self, LimitsError> {
        let options = MemoryOptions { arena: Some(arena), ..MemoryOptions::default() };
        Self::with_options(limits, clock, Box::new(LocalEpochs), options)
    }

    /// What the store's arena holds, when it has one.
    pub fn arena_stats(&self) -> Option<ArenaStats> {
        self.lock().spare.arena.as_ref().map(|a| a.stats())
    }

    /// A store whose epochs come from `epochs`.
    pub fn with_epochs(
        limits: ResourceLimits,
        clock: Arc<dyn Clock>,
        epochs: Box<dyn EpochSource>,
    ) -> Result<Self, LimitsError> {
        Self::with_options(limits, clock, epochs, MemoryOptions::default())
    }

    /// A store that evicts by `policy` when a retained-byte quota is full, instead of refusing:
    /// a cache tier rather than the contract's reference store.
    pub fn evicting(
        limits: ResourceLimits,
        clock: Arc<dyn Clock>,
        policy: PolicyKind,
    ) -> Result<Self, LimitsError> {
        let options = MemoryOptions { eviction: Some(policy), ..MemoryOptions::default() };
        Self::with_options(limits, clock, Box::new(LocalEpochs), options)
    }

    /// A store built as `options` says.
    pub fn with_options(
        limits: ResourceLimits,
        clock: Arc<dyn Clock>,
        epochs: Box<dyn EpochSource>,
        options: MemoryOptions,
    ) -> Result<Self, LimitsError> {
        let spare = SpareBuffers {
            bytes_max: SPARE_BYTES_MAX.min(limits.retained_bytes_max / 4),
            arena: options.arena,
            ..SpareBuffers::default()
        };
        let (full_policy, kind) = match options.eviction {
            None => (FullPolicy::Refuse, PolicyKind::Fifo),
            Some(PolicyKind::Fifo) => (FullPolicy::EvictOldest, PolicyKind::Fifo),
            Some(kind) => (FullPolicy::Evict, kind),
        };
        let eviction = kind.build(limits.retained_bytes_max);
        let mut catalog =
            Catalog::new(limits, full_policy, MemoryKind::Host, Epoch(1), 1, epochs, eviction)?;
        if options.hand_down {
            catalog.hand_down_evictions(|p| Arc::clone(p));
        }
        Ok(Self { inner: Mutex::new(Inner { catalog, spare }), clock, full_policy })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Poisoning means a bug panicked halfway through changing the maps; serving from them
        // could produce a wrong hit, so the store stops instead.
        match self.inner.lock() {
            Ok(guard) => guard,
            Err(_) => panic!("MemoryStore state is unusable: a thread panicked while changing it"),
        }
    }

    /// The keys this store evicted to make room since the last call, oldest first (at most
    /// the last 4,096). The first call starts the record: a store nobody asks keeps none.
    pub fn take_evicted(&self) -> Vec<PhysicalKey> {
        self.lock().catalog.take_evicted()
    }

    /// The blocks evicted since the last call, with their bytes, oldest first, when the store
    /// was built to hand them down ([`MemoryOptions::hand_down`]).
    pub fn take_handed_down(&self) -> Vec<EvictedBlock> {
        let handed = self.lock().catalog.take_handed_down();
        handed
            .into_iter()
            .map(|h| EvictedBlock { key: h.key, checksum: h.checksum, payload: h.payload })
            .collect()
    }

    /// Evicted blocks whose bytes were let go uncollected (more than 4,096 waited).
    pub fn handed_down_dropped(&self) -> u64 {
        self.lock().catalog.handed_down_dropped()
    }

    /// The checksum of the committed block under `key`, without reading it.
    pub fn committed_checksum(&self, key: &PhysicalKey) -> Option<Checksum> {
        self.lock().catalog.committed_checksum(key)
    }

    /// Damages one payload byte (at `at` modulo the length) of the committed block under
    /// `key`, for corruption tests. Returns whether a committed block was there.
    #[cfg(any(test, feature = "testing"))]
    pub fn corrupt_for_test(&self, key: &PhysicalKey, at: usize) -> bool {
        let mut inner = self.lock();
        match inner.catalog.committed_payload_mut(key) {
            Some(bytes) if !bytes.is_empty() => {
                let bytes = Arc::make_mut(bytes);
                // Adding (rather than toggling) keeps repeated damage from undoing itself.
                let i = at % bytes.len();
                bytes[i] = bytes[i].wrapping_add(1);
                true
            }
            _ => false,
        }
    }
}

impl MemoryStore {
    fn fill_and_commit(
        &self,
        caller: &Caller,
        r: &Reservation,
        src: &[u8],
    ) -> Result<Committed, StoreError> {
        let mut buf = self.lock().take_buffer(caller, r, src.len() as u64)?;
        let filled = fill(&mut buf, src);
        let now = self.clock.now_ms();
        self.lock().commit_buffer(caller, r, buf, filled, now)
    }

    /// Pins the block under the lock, then lends its own bytes to `send` without it (no copy on
    /// this side at all) and checks the checksum the sender computed over them. A block whose
    /// bytes no longer match is dropped as `get_into` drops it. With `version`, a block
    /// committed under another checksum is neither lent nor touched: `None`.
    pub fn lend(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        version: Option<Checksum>,
        send: &mut LendTo<'_>,
    ) -> Result<Option<Get>, StoreError> {
        authorize(caller, key, Right::Read)?;
        let (pin, payload) = {
            let mut inner = self.lock();
            let pin = match inner.catalog.pin_read(key, capacity)? {
                Ok(pin) => pin,
                Err(miss) => return Ok(Some(Get::Miss(miss))),
            };
            if version.is_some_and(|v| v != pin.checksum) {
                let released = inner.catalog.unpin_read(pin.region, None);
                inner.spare.give(released);
                return Ok(None);
            }
            let payload = inner.catalog.entry(pin.region).map(|b| Arc::clone(&b.payload));
            (pin, payload)
        };
        let bytes = payload.as_deref().and_then(|p| p.get(..pin.len_bytes()));
        let damage = match (bytes, pin.answer(false)) {
            (Some(bytes), Get::Hit { checksum, .. }) => {
                let intact = match send(bytes, checksum) {
                    Some(sent) => pin.intact_by(sent),
                    None => pin.delivered_intact(bytes),
                };
                (!intact).then_some(CorruptReason::Checksum)
            }
            _ => Some(CorruptReason::Truncated),
        };
        drop(payload);
        let mut inner = self.lock();
        let released = inner.catalog.unpin_read(pin.region, damage);
        inner.spare.give(released);
        Ok(Some(pin.answer(damage.is_some())))
    }

    /// [`Store::put`] of bytes whose checksum `verified` the caller computed in the pass that
    /// produced or read them (the tier below hashed them to write them, or checked them as it
    /// read them): they are copied without being hashed again and committed under `verified`.
    /// Every read checks a block against its committed checksum, so bytes that changed in
    /// between are a corrupt miss, never a wrong hit.
    pub fn put_verified(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        verified: Checksum,
    ) -> Result<Put, StoreError> {
        put_reserved(self, caller, key, src.len() as u64, None, |r| {
            let mut buf = self.lock().take_buffer(caller, r, src.len() as u64)?;
            let filled = Arc::get_mut(&mut buf).filter(|b| b.len() == src.len()).map(|b| {
                b.copy_from_slice(src);
                verified
            });
            let now = self.clock.now_ms();
            self.lock().commit_buffer(caller, r, buf, filled, now)
        })
    }

    /// Starts one PUT of a batch under the held lock: its reservation and its buffer, or the
    /// PUT's final answer when there is nothing to write.
    fn start_put(
        &self,
        inner: &mut Inner,
        caller: &Caller,
        item: &BatchPut<'_>,
    ) -> Result<(Reservation, Payload), Result<Put, StoreError>> {
        let len = item.src.len() as u64;
        let now = self.clock.now_ms();
        let reserve = inner.reserve(caller, item.key, len, item.request, now).map_err(Err)?;
        let r = reserve.into_reservation().map_err(Ok)?;
        match inner.take_buffer(caller, &r, len) {
            Ok(buf) => Ok((r, buf)),
            Err(e) => {
                inner.abort_after(caller, r, &e);
                Err(Err(e))
            }
        }
    }

    /// The batch PUTs: each item reserved and committed under the lock, copied and hashed
    /// (one pass) without it. With `expected`, a block whose bytes do not hash to its item's
    /// checksum is aborted instead of committed, and an item without one is refused unreserved.
    fn put_items(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: Option<&[Checksum]>,
    ) -> BatchAnswers<Put> {
        let mut answers = Vec::with_capacity(items.len());
        let mut inner = self.lock();
        for (i, item) in items.iter().enumerate() {
            let want = expected.map(|e| e.get(i).copied());
            if let Some(None) = want {
                answers.push(Err(put_damaged(Checksum::of(item.src), None)));
                continue;
            }
            let (r, mut buf) = match self.start_put(&mut inner, caller, item) {
                Ok(writing) => writing,
                Err(answer) => {
                    answers.push(answer);
                    continue;
                }
            };
            drop(inner);
            let filled = fill(&mut buf, item.src);
            inner = self.lock();
            let now = self.clock.now_ms();
            let committed = match (filled, want.flatten()) {
                (Some(got), Some(sum)) if got != sum => Err(put_damaged(got, Some(sum))),
                _ => inner.commit_buffer(caller, &r, buf, filled, now),
            };
            answers.push(match committed {
                Ok(c) => Ok(Put::Committed(c.checksum)),
                Err(e) => {
                    inner.abort_after(caller, r, &e);
                    Err(e)
                }
            });
        }
        answers
    }

    /// One round of a batch GET: pins `items` under one lock, copies and verifies them in
    /// order without it, and unpins them under one more. A block found damaged is dropped, and
    /// the items after it may answer differently for that (the same key again, or one whose
    /// miss reason it decided), so the round stops there: pins it took for later items are
    /// released untouched. Appends the answers of the items it settled (at least one) and
    /// returns how many.
    fn get_round(
        &self,
        caller: &Caller,
        items: &mut [BatchGet<'_>],
        answers: &mut BatchAnswers<Get>,
    ) -> usize {
        let pinned: Vec<Pinned> = {
            let mut inner = self.lock();
            items
                .iter()
                .map(|item| {
                    if let Err(e) = authorize(caller, item.key, Right::Read) {
                        return Pinned::Answered(Err(e));
                    }
                    match inner.catalog.pin_read(item.key, item.dst.len()) {
                        Err(e) => Pinned::Answered(Err(e)),
                        Ok(Err(miss)) => Pinned::Answered(Ok(Get::Miss(miss))),
                        Ok(Ok(pin)) => {
                            let payload =
                                inner.catalog.entry(pin.region).map(|b| Arc::clone(&b.payload));
                            Pinned::Reading { pin, payload }
                        }
                    }
                })
                .collect()
        };
        let mut unpins = Vec::with_capacity(pinned.len());
        let mut settled = 0;
        let mut pinned = pinned.into_iter();
        for (item, p) in items.iter_mut().zip(pinned.by_ref()) {
            settled += 1;
            match p {
                Pinned::Answered(answer) => answers.push(answer),
                Pinned::Reading { pin, payload } => {
                    let (corrupt, damage) = deliver(&pin, payload.as_ref(), item.dst);
                    unpins.push((pin.region, damage));
                    answers.push(Ok(pin.answer(corrupt)));
                    if damage.is_some() {
                        break;
                    }
                }
            }
        }
        unpins.extend(pinned.filter_map(|p| match p {
            Pinned::Reading { pin, .. } => Some((pin.region, None)),
            Pinned::Answered(_) => None,
        }));
        // Every payload reference is gone, so blocks freed now give their buffers back.
        let mut inner = self.lock();
        for (region, damage) in unpins {
            let released = inner.catalog.unpin_read(region, damage);
            inner.spare.give(released);
        }
        settled
    }
}

impl Store for MemoryStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "memory",
            implementation: Implementation::Real,
            failures_retire: true,
            full_policy: self.full_policy,
        }
    }

    fn epoch(&self) -> Epoch {
        self.lock().catalog.epoch()
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        authorize(caller, key, Right::Read)?;
        Ok(self.lock().catalog.lookup(key))
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        authorize(caller, key, Right::Read)?;
        let (pin, payload) = {
            let mut inner = self.lock();
            let pin = match inner.catalog.pin_read(key, dst.len())? {
                Ok(pin) => pin,
                Err(miss) => return Ok(Get::Miss(miss)),
            };
            let payload = inner.catalog.entry(pin.region).map(|b| Arc::clone(&b.payload));
            (pin, payload)
        };
        // The copy and its check run without the lock: other callers are not held up by it.
        let (corrupt, damage) = deliver(&pin, payload.as_ref(), dst);
        drop(payload);
        let mut inner = self.lock();
        let released = inner.catalog.unpin_read(pin.region, damage);
        inner.spare.give(released);
        Ok(pin.answer(corrupt))
    }

    /// Lends the block: see [`MemoryStore::lend`]. Memory always lends a hit.
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        let get = self.lend(caller, key, capacity, None, &mut |bytes, sum| to.lend(bytes, sum))?;
        // Without a version to match, `lend` always answers.
        let get = get.unwrap_or(Get::Miss(MissReason::Absent));
        let delivery =
            if matches!(get, Get::Hit { .. }) { Delivery::Lent } else { Delivery::Copied };
        Ok(GotOne { get, delivery, tier: None })
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        let now = self.clock.now_ms();
        self.lock().reserve(caller, key, len, request, now)
    }

    fn write(
        &self,
        caller: &Caller,
        r: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let b = inner.catalog.write_into(caller, r, offset, src.len() as u64)?;
        // write_into checked the range against the block length, a usize.
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        // Only committed blocks are read, so a block being written is never shared.
        let Some(payload) = Arc::get_mut(&mut b.payload) else {
            return Err(StoreError::Backend {
                operation: "write",
                detail: "the block's buffer is shared while it is being written".into(),
                retirement: Retirement::Retired,
            });
        };
        payload[start..start + src.len()].copy_from_slice(src);
        Ok(())
    }

    /// Reserve, then the write and the commit with the copy and the checksum outside the lock:
    /// the block's buffer is taken out of the catalog while the block is being written (nobody
    /// else reads or writes a block in that state), filled and hashed, then put back and
    /// committed. Other callers are not held up by the copy.
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        put_reserved(self, caller, key, src.len() as u64, request, |r| {
            self.fill_and_commit(caller, r, src)
        })
    }

    fn commit(&self, caller: &Caller, r: &Reservation) -> Result<Committed, StoreError> {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        let b = inner.catalog.start_commit(caller, r)?;
        let checksum = Checksum::of(&b.payload);
        inner.catalog.finish_commit(r.region, checksum, now)
    }

    fn abort(
        &self,
        caller: &Caller,
        r: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        let mut inner = self.lock();
        let (answer, released) = inner.catalog.abort(caller, r, outcome)?;
        inner.spare.give(released);
        Ok(answer)
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let mut inner = self.lock();
        let (answer, released) = inner.catalog.invalidate(caller, key)?;
        inner.spare.give(released);
        Ok(answer)
    }

    fn expire_leases(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_ms();
        self.lock().catalog.expire_leases(now)
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        let mut inner = self.lock();
        let (answer, released) = inner.catalog.attest_drained(caller, region)?;
        inner.spare.give(released);
        Ok(answer)
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        self.lock().catalog.bump_epoch()
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        let mut inner = self.lock();
        let (n, released) = inner.catalog.reclaim_fenced(epoch)?;
        inner.spare.give(released);
        Ok(n)
    }

    fn stats(&self) -> StoreStats {
        self.lock().catalog.stats()
    }

    /// Every lookup under one lock.
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        let inner = self.lock();
        keys.iter()
            .map(|key| {
                authorize(caller, key, Right::Read)?;
                Ok(inner.catalog.lookup(key))
            })
            .collect()
    }

    /// Pins under one lock, copies without it, unpins under one more (see
    /// [`MemoryStore::get_round`]); one round more for each damaged block found.
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let mut answers = Vec::with_capacity(items.len());
        let mut rest = items;
        while !rest.is_empty() {
            let settled = self.get_round(caller, rest, &mut answers);
            rest = std::mem::take(&mut rest).get_mut(settled..).unwrap_or_default();
        }
        answers
    }

    /// Each PUT in order, its copy and checksum without the lock; the commit of one PUT and the
    /// reservation of the next share one lock, so a batch of n written blocks takes the lock
    /// n + 1 times and each PUT sees the ones before it committed.
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        self.put_items(caller, items, None)
    }

    /// As [`Self::put_batch`], each block's checksum (computed in the pass that copies it)
    /// compared with the writer's before the block is committed.
    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        self.put_items(caller, items, Some(expected))
    }

    /// Every invalidation under one lock.
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        let mut inner = self.lock();
        keys.iter()
            .map(|key| {
                let (answer, released) = inner.catalog.invalidate(caller, key)?;
                inner.spare.give(released);
                Ok(answer)
            })
            .collect()
    }

    fn scope_keys(
        &self,
        caller: &Caller,
        scope: &PurgeScope,
        max: usize,
    ) -> Result<Vec<PhysicalKey>, StoreError> {
        self.lock().catalog.scope_keys(caller, scope, max)
    }
}
