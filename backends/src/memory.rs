//! MemoryStore: the in-process reference implementation of the store contract.
//!
//! Host DRAM behind one mutex. It refuses admission instead of evicting, guarantees that every
//! failed call has stopped touching the caller's buffers, and copies payload only in `write` and
//! `get_into`. Every other backend is checked against the same conformance suite it passes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::identity::ChainHash;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::lifecycle::{BlockState, Lifecycle, Transition};
use gpucache_dataplane::limits::{
    IdempotencyTable, Ledger, LimitsError, Replay, RequestId, ResourceLimits,
};
use gpucache_dataplane::registry::{
    AttestOutcome, Attestation, Completion, Epoch, EpochSource, MemoryKind, QuarantineCause,
    RegionId, RegionTable,
};
use gpucache_dataplane::store::{
    Abort, Committed, FullPolicy, Get, Implementation, Invalidate, Lookup, MissReason, Reclaimed,
    Reservation, Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats, WrittenRanges,
    authorize,
};

#[derive(Debug)]
struct Block {
    key: PhysicalKey,
    life: Lifecycle,
    bytes: Vec<u8>,
    written: WrittenRanges,
    checksum: Option<Checksum>,
    request: Option<RequestId>,
    shape: KeyDigest,
}

impl Block {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }
}

/// Most bytes of freed payload buffers kept for reuse (also capped at a quarter of
/// `retained_bytes_max`).
pub const SPARE_BYTES_MAX: u64 = 256 << 20;

/// Freed payload buffers kept for reuse, so that a steady PUT stream does not fault fresh pages
/// in for every block. A reused buffer still holds old bytes; that is safe because a commit
/// requires every byte to have been written, and only committed blocks are read. Buffers of
/// quarantined regions never come here before their reclaim proof.
#[derive(Debug, Default)]
struct SpareBuffers {
    by_len: HashMap<usize, Vec<Vec<u8>>>,
    bytes: u64,
    bytes_max: u64,
}

impl SpareBuffers {
    fn take(&mut self, len: usize) -> Vec<u8> {
        if let Some(list) = self.by_len.get_mut(&len)
            && let Some(buf) = list.pop()
        {
            self.bytes -= len as u64;
            return buf;
        }
        vec![0; len]
    }

    fn give(&mut self, buf: Vec<u8>) {
        let len = buf.len() as u64;
        if self.bytes + len <= self.bytes_max {
            self.bytes += len;
            self.by_len.entry(buf.len()).or_default().push(buf);
        }
    }
}

#[derive(Debug)]
struct Inner {
    spare: SpareBuffers,
    ledger: Ledger,
    idempotency: IdempotencyTable,
    regions: RegionTable,
    blocks: HashMap<RegionId, Block>,
    /// Physical key -> the live (not quarantined, not absent) block under it.
    exact: HashMap<KeyDigest, RegionId>,
    /// Logical key -> committed blocks under it (for incompatible misses).
    logical: HashMap<KeyDigest, Vec<RegionId>>,
    /// (shape, last chain link) -> committed blocks (for prefix hits).
    prefix: HashMap<(KeyDigest, ChainHash), Vec<RegionId>>,
    committed_blocks: u64,
    corrupt_dropped: u64,
}

/// The in-process reference store.
#[derive(Debug)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    clock: Arc<dyn Clock>,
}

impl MemoryStore {
    /// A store with the given limits and clock, on a local epoch counter.
    pub fn new(limits: ResourceLimits, clock: Arc<dyn Clock>) -> Result<Self, LimitsError> {
        Self::with_epochs(limits, clock, Box::new(gpucache_dataplane::registry::LocalEpochs))
    }

    /// A store whose epochs come from `epochs`.
    pub fn with_epochs(
        limits: ResourceLimits,
        clock: Arc<dyn Clock>,
        epochs: Box<dyn EpochSource>,
    ) -> Result<Self, LimitsError> {
        let ledger = Ledger::new(limits.clone())?;
        let regions_max = usize::try_from(limits.registrations_max).unwrap_or(usize::MAX);
        Ok(Self {
            inner: Mutex::new(Inner {
                spare: SpareBuffers {
                    bytes_max: SPARE_BYTES_MAX.min(limits.retained_bytes_max / 4),
                    ..SpareBuffers::default()
                },
                idempotency: IdempotencyTable::new(&limits),
                ledger,
                regions: RegionTable::new(regions_max, Epoch(1), 1, epochs),
                blocks: HashMap::new(),
                exact: HashMap::new(),
                logical: HashMap::new(),
                prefix: HashMap::new(),
                committed_blocks: 0,
                corrupt_dropped: 0,
            }),
            clock,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Poisoning means a bug panicked halfway through changing the maps; serving from them
        // could produce a wrong hit, so the store stops instead.
        match self.inner.lock() {
            Ok(guard) => guard,
            Err(_) => panic!("MemoryStore state is unusable: a thread panicked while changing it"),
        }
    }

    /// Damages one payload byte (at `at` modulo the length) of the committed block under
    /// `key`, for corruption tests. Returns whether a committed block was there.
    #[cfg(any(test, feature = "testing"))]
    pub fn corrupt_for_test(&self, key: &PhysicalKey, at: usize) -> bool {
        let mut inner = self.lock();
        let Some(id) = inner.find_exact(key) else { return false };
        match inner.blocks.get_mut(&id) {
            Some(b) if b.life.state() == BlockState::Committed && !b.bytes.is_empty() => {
                // Adding (rather than toggling) keeps repeated damage from undoing itself.
                let i = at % b.bytes.len();
                b.bytes[i] = b.bytes[i].wrapping_add(1);
                true
            }
            _ => false,
        }
    }
}

fn drop_index(index: &mut HashMap<KeyDigest, Vec<RegionId>>, key: KeyDigest, id: RegionId) {
    if let Some(v) = index.get_mut(&key) {
        v.retain(|r| *r != id);
        if v.is_empty() {
            index.remove(&key);
        }
    }
}

impl Inner {
    /// The live block under exactly `key`: the digest finds it, the full key must match.
    fn find_exact(&self, key: &PhysicalKey) -> Option<RegionId> {
        let id = *self.exact.get(&key.digest())?;
        (self.blocks.get(&id)?.key == *key).then_some(id)
    }

    fn unindex_committed(&mut self, id: RegionId) {
        let Some(b) = self.blocks.get(&id) else { return };
        let digest = b.key.digest();
        let logical = b.key.logical_digest();
        let link = b.key.identity().chain().last().copied();
        let shape = b.shape;
        if self.exact.get(&digest) == Some(&id) {
            self.exact.remove(&digest);
        }
        drop_index(&mut self.logical, logical, id);
        if let Some(link) = link
            && let Some(v) = self.prefix.get_mut(&(shape, link))
        {
            v.retain(|r| *r != id);
            if v.is_empty() {
                self.prefix.remove(&(shape, link));
            }
        }
    }

    /// COMMITTED -> EVICTING -> ABSENT, releasing the region and every charge.
    fn evict(&mut self, id: RegionId) -> Result<(), StoreError> {
        self.unindex_committed(id);
        let Some(mut b) = self.blocks.remove(&id) else { return Ok(()) };
        b.life.apply(Transition::Evict)?;
        b.life.apply(Transition::Release)?;
        self.regions.release_held(id)?;
        self.ledger.release_block(b.key.tenant(), b.len());
        self.committed_blocks -= 1;
        self.spare.give(b.bytes);
        Ok(())
    }

    /// An open reservation's outcome is unknown: RESERVED/WRITING -> QUARANTINED. The region
    /// and its retained bytes stay charged; the key is free for a new writer.
    fn quarantine_open(&mut self, id: RegionId) -> Result<(), StoreError> {
        let Some(b) = self.blocks.get_mut(&id) else { return Ok(()) };
        if !matches!(b.life.state(), BlockState::Reserved | BlockState::Writing) {
            return Ok(());
        }
        b.life.apply(Transition::Quarantine)?;
        let (tenant, len, request, digest) =
            (b.key.tenant().clone(), b.len(), b.request, b.key.digest());
        self.ledger.finish_write(&tenant, len);
        if let Some(r) = request {
            self.idempotency.forget(&tenant, r);
        }
        if self.exact.get(&digest) == Some(&id) {
            self.exact.remove(&digest);
        }
        Ok(())
    }

    /// QUARANTINED -> ABSENT with a proof from the registry.
    fn reclaim(
        &mut self,
        proof: gpucache_dataplane::lifecycle::ReclaimProof,
    ) -> Result<u64, StoreError> {
        let id = proof.region();
        let Some(mut b) = self.blocks.remove(&id) else { return Ok(0) };
        b.life.apply(Transition::Reclaim(proof))?;
        let len = b.len();
        self.ledger.release_block(b.key.tenant(), len);
        self.spare.give(b.bytes);
        Ok(len)
    }

    fn open_block(&mut self, caller: &Caller, r: &Reservation) -> Result<&mut Block, StoreError> {
        let current = self.regions.epoch();
        let b = self
            .blocks
            .get_mut(&r.region)
            .ok_or(StoreError::UnknownReservation { region: r.region })?;
        authorize(caller, &b.key, Right::Write)?;
        match b.life.state() {
            BlockState::Reserved | BlockState::Writing => {}
            BlockState::Quarantined => {
                return Err(StoreError::ReservationQuarantined { region: r.region });
            }
            _ => return Err(StoreError::UnknownReservation { region: r.region }),
        }
        if r.epoch != current {
            return Err(StoreError::Registry(
                gpucache_dataplane::registry::RegistryError::StaleEpoch { given: r.epoch, current },
            ));
        }
        Ok(b)
    }

    fn miss_reason(&self, key: &PhysicalKey) -> MissReason {
        if self.logical.contains_key(&key.logical_digest()) {
            MissReason::Incompatible
        } else {
            MissReason::Absent
        }
    }
}

impl Store for MemoryStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "memory",
            implementation: Implementation::Real,
            failures_retire: true,
            full_policy: FullPolicy::Refuse,
        }
    }

    fn epoch(&self) -> Epoch {
        self.lock().regions.epoch()
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        authorize(caller, key, Right::Read)?;
        let inner = self.lock();
        if let Some(id) = inner.find_exact(key) {
            let b = &inner.blocks[&id];
            return Ok(match b.life.state() {
                BlockState::Committed => Lookup::Hit { len: b.len() },
                s => Lookup::Miss(MissReason::NotReadable(s)),
            });
        }
        let chain = key.identity().chain();
        if chain.len() > 1 {
            let shape = key.shape_digest();
            for link in chain[..chain.len() - 1].iter().rev() {
                let Some(candidates) = inner.prefix.get(&(shape, *link)) else { continue };
                for id in candidates {
                    let b = &inner.blocks[id];
                    let stored = b.key.identity();
                    if b.life.state() == BlockState::Committed
                        && stored.same_shape(key.identity())
                        && stored.chain_is_strict_prefix_of(key.identity())
                    {
                        return Ok(Lookup::PrefixHit {
                            key: Box::new(b.key.clone()),
                            len: b.len(),
                        });
                    }
                }
            }
        }
        Ok(Lookup::Miss(inner.miss_reason(key)))
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        authorize(caller, key, Right::Read)?;
        let mut inner = self.lock();
        let Some(id) = inner.find_exact(key) else {
            return Ok(Get::Miss(inner.miss_reason(key)));
        };
        let b = &inner.blocks[&id];
        if b.life.state() != BlockState::Committed {
            return Ok(Get::Miss(MissReason::NotReadable(b.life.state())));
        }
        let len = b.bytes.len();
        if dst.len() < len {
            return Err(StoreError::BufferTooSmall {
                needed: len as u64,
                provided: dst.len() as u64,
            });
        }
        let Some(stored) = b.checksum else {
            return Err(StoreError::Backend {
                operation: "get",
                detail: "committed block without a checksum".into(),
                retirement: Retirement::Retired,
            });
        };
        dst[..len].copy_from_slice(&b.bytes);
        // Verify what the caller received, not what we hold.
        if Checksum::of(&dst[..len]) != stored {
            dst[..len].fill(0);
            inner.corrupt_dropped += 1;
            inner.evict(id)?;
            return Ok(Get::Miss(MissReason::Corrupt));
        }
        Ok(Get::Hit { len: len as u64, checksum: stored })
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        authorize(caller, key, Right::Write)?;
        if len == 0 {
            return Err(StoreError::EmptyObject);
        }
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        let tenant = key.tenant().clone();
        if let Some(r) = request {
            match inner.idempotency.check(&tenant, r, key.digest(), now)? {
                Some(Replay::Committed) => return Ok(Reserve::AlreadyCommitted),
                Some(Replay::InProgress) => return Ok(Reserve::Busy),
                None => {}
            }
        }
        if let Some(id) = inner.exact.get(&key.digest()) {
            let b = &inner.blocks[id];
            // A different key under the same digest (a BLAKE3 collision) is never overwritten.
            return Ok(match b.life.state() {
                BlockState::Committed if b.key == *key => Reserve::AlreadyCommitted,
                _ => Reserve::Busy,
            });
        }
        if let Err(refusal) = inner.ledger.check_block(&tenant, len) {
            return Ok(Reserve::Refused(refusal));
        }
        if request.is_some()
            && let Err(refusal) = inner.idempotency.check_capacity()
        {
            return Ok(Reserve::Refused(refusal));
        }
        let bytes = usize::try_from(len).map_err(|_| StoreError::Backend {
            operation: "reserve",
            detail: format!("{len} bytes do not fit this address space"),
            retirement: Retirement::Retired,
        })?;
        let lease = now.saturating_add(inner.ledger.limits().write_lease_ms);
        let region = inner.regions.lend(&tenant, MemoryKind::Host, len, Some(lease))?;
        let mut life = Lifecycle::new(region);
        life.apply(Transition::Reserve)?;
        if let Err(refusal) = inner.ledger.admit_block(&tenant, len) {
            // check_block passed under the same lock, so this cannot happen; undo anyway.
            let _ = inner.regions.complete(region, Completion::Retired);
            return Ok(Reserve::Refused(refusal));
        }
        if let Some(r) = request
            && let Err(refusal) = inner.idempotency.insert_pending(&tenant, r, key.digest())
        {
            inner.ledger.finish_write(&tenant, len);
            inner.ledger.release_block(&tenant, len);
            let _ = inner.regions.complete(region, Completion::Retired);
            return Ok(Reserve::Refused(refusal));
        }
        inner.exact.insert(key.digest(), region);
        let buffer = inner.spare.take(bytes);
        inner.blocks.insert(
            region,
            Block {
                key: key.clone(),
                life,
                bytes: buffer,
                written: WrittenRanges::default(),
                checksum: None,
                request,
                shape: key.shape_digest(),
            },
        );
        let epoch = inner.regions.epoch();
        Ok(Reserve::Reserved(Reservation { region, epoch, len, request }))
    }

    fn write(
        &self,
        caller: &Caller,
        r: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let b = inner.open_block(caller, r)?;
        let len = src.len() as u64;
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= b.len())
            .ok_or(StoreError::WriteOutOfBounds { offset, len, capacity: b.len() })?;
        b.written.add(offset, end)?;
        if b.life.state() == BlockState::Reserved {
            b.life.apply(Transition::BeginWrite)?;
        }
        // Both bounds were checked against the block length, a usize, above.
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        b.bytes[start..start + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn commit(&self, caller: &Caller, r: &Reservation) -> Result<Committed, StoreError> {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        let b = inner.open_block(caller, r)?;
        let written = b.written.covered();
        if written != b.len() {
            return Err(StoreError::Incomplete { written, expected: b.len() });
        }
        let checksum = Checksum::of(&b.bytes);
        b.life.apply(Transition::Commit)?;
        b.checksum = Some(checksum);
        let (tenant, len, request) = (b.key.tenant().clone(), b.len(), b.request);
        let logical = b.key.logical_digest();
        let link = b.key.identity().chain().last().copied();
        let shape = b.shape;
        inner.regions.settle(r.region)?;
        inner.ledger.finish_write(&tenant, len);
        if let Some(req) = request {
            inner.idempotency.commit(&tenant, req, now);
        }
        inner.logical.entry(logical).or_default().push(r.region);
        if let Some(link) = link {
            inner.prefix.entry((shape, link)).or_default().push(r.region);
        }
        inner.committed_blocks += 1;
        Ok(Committed { checksum })
    }

    fn abort(
        &self,
        caller: &Caller,
        r: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        let mut inner = self.lock();
        let b = inner
            .blocks
            .get(&r.region)
            .ok_or(StoreError::UnknownReservation { region: r.region })?;
        authorize(caller, &b.key, Right::Write)?;
        match b.life.state() {
            BlockState::Quarantined => return Ok(Abort::Quarantined),
            BlockState::Reserved | BlockState::Writing => {}
            _ => return Err(StoreError::UnknownReservation { region: r.region }),
        }
        match outcome {
            Retirement::Unknown => {
                inner.regions.complete(r.region, Completion::Unknown)?;
                inner.quarantine_open(r.region)?;
                Ok(Abort::Quarantined)
            }
            Retirement::Retired => {
                let Some(mut b) = inner.blocks.remove(&r.region) else {
                    return Err(StoreError::UnknownReservation { region: r.region });
                };
                b.life.apply(Transition::Abort)?;
                inner.regions.complete(r.region, Completion::Retired)?;
                let (tenant, len) = (b.key.tenant().clone(), b.len());
                inner.ledger.finish_write(&tenant, len);
                inner.ledger.release_block(&tenant, len);
                if let Some(req) = b.request {
                    inner.idempotency.forget(&tenant, req);
                }
                if inner.exact.get(&b.key.digest()) == Some(&r.region) {
                    inner.exact.remove(&b.key.digest());
                }
                inner.spare.give(b.bytes);
                Ok(Abort::Released)
            }
        }
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        authorize(caller, key, Right::Write)?;
        let mut inner = self.lock();
        let Some(id) = inner.find_exact(key) else {
            return Ok(Invalidate::Absent);
        };
        if inner.blocks[&id].life.state() != BlockState::Committed {
            return Ok(Invalidate::Busy);
        }
        inner.evict(id)?;
        Ok(Invalidate::Removed)
    }

    fn expire_leases(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        let expired = inner.regions.expire_leases(now);
        for id in &expired {
            inner.quarantine_open(*id)?;
        }
        Ok(expired.len())
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        let mut inner = self.lock();
        match inner.regions.attest(caller, region, Attestation::Drained)? {
            AttestOutcome::Reclaimed(proof) => {
                let bytes = inner.reclaim(proof)?;
                Ok(Reclaimed { region, bytes })
            }
            AttestOutcome::StillQuarantined => Err(StoreError::Backend {
                operation: "attest",
                detail: "a drained attestation left the region quarantined".into(),
                retirement: Retirement::Unknown,
            }),
        }
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        let mut inner = self.lock();
        let epoch = inner.regions.bump_epoch()?;
        // Writers from older epochs may still be mid-transfer: their reservations are fenced
        // off and quarantined until reclaim_fenced.
        let open: Vec<RegionId> = inner
            .blocks
            .iter()
            .filter(|(_, b)| matches!(b.life.state(), BlockState::Reserved | BlockState::Writing))
            .map(|(id, _)| *id)
            .collect();
        for id in open {
            inner.regions.quarantine(id, QuarantineCause::Fenced)?;
            inner.quarantine_open(id)?;
        }
        Ok(epoch)
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        let mut inner = self.lock();
        let proofs = inner.regions.reclaim_fenced(epoch)?;
        let n = proofs.len();
        for proof in proofs {
            inner.quarantine_open(proof.region())?;
            inner.reclaim(proof)?;
        }
        Ok(n)
    }

    fn stats(&self) -> StoreStats {
        let inner = self.lock();
        StoreStats {
            usage: inner.ledger.usage(),
            regions: inner.regions.counts(),
            committed_blocks: inner.committed_blocks,
            corrupt_dropped: inner.corrupt_dropped,
            evictions: 0,
        }
    }
}
