//! The block catalog every store in this crate keeps: lifecycle, indexes, admission, request
//! ids, regions, eviction order and read pins, generic over where a block's payload lives.
//!
//! It owns no payload I/O. A store takes its lock, asks the catalog what to do, moves bytes
//! (under the lock for memory, outside it for files), and reports back. Whenever a block leaves
//! the catalog its payload is handed back to the store to dispose of (reuse a buffer, unlink a
//! file) — never silently dropped while something might still read it.

use std::collections::hash_map::Entry as Slot;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher as _;
use std::sync::{Mutex, PoisonError};

use crate::evict::{BlockFacts, EvictionPolicy, Removal};
use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::ChainHash;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::lifecycle::{BlockState, Lifecycle, ReclaimProof, Transition};
use gpucache_dataplane::limits::{
    IdempotencyTable, Ledger, LimitsError, Refusal, Replay, RequestId, ResourceLimits,
};
use gpucache_dataplane::registry::{
    AttestOutcome, Attestation, Completion, Epoch, EpochSource, MemoryKind, QuarantineCause,
    RegionId, RegionTable, RegistryError,
};
use gpucache_dataplane::store::{
    Abort, Committed, CorruptDrops, CorruptPhase, CorruptReason, FullPolicy, Get, Invalidate,
    Lookup, MissReason, PurgeScope, Reclaimed, Reservation, Reserve, Retirement, StoreError,
    StoreStats, WrittenRanges, authorize,
};

/// One block and the payload the store keeps for it.
#[derive(Debug)]
pub(crate) struct Entry<P> {
    pub(crate) key: PhysicalKey,
    pub(crate) life: Lifecycle,
    pub(crate) len: u64,
    pub(crate) written: WrittenRanges,
    pub(crate) checksum: Option<Checksum>,
    pub(crate) request: Option<RequestId>,
    /// Commit order; the eviction age. Zero until committed.
    pub(crate) seq: u64,
    /// Readers copying the payload right now; a pinned block is never evicted by quota and its
    /// payload is released only after the last reader leaves.
    pub(crate) readers: u32,
    /// The store is making the commit durable; no other writer call may touch the block.
    pub(crate) committing: bool,
    pub(crate) payload: P,
}

/// What a read found.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadPin {
    pub(crate) region: RegionId,
    pub(crate) len: u64,
    pub(crate) checksum: Checksum,
}

impl ReadPin {
    /// Bytes of the caller's buffer the read fills.
    pub(crate) fn len_bytes(&self) -> usize {
        usize::try_from(self.len).unwrap_or(usize::MAX)
    }

    /// Whether the bytes the caller received are the committed ones: the read side of the
    /// checksum recorded at commit, computed over the caller's buffer, not the store's copy.
    pub(crate) fn delivered_intact(&self, delivered: &[u8]) -> bool {
        self.intact_by(Checksum::of(delivered))
    }

    /// Whether bytes whose checksum is `delivered` (computed over the caller's buffer, as
    /// [`Checksum::copy_of`] does while it copies) are the committed ones.
    pub(crate) fn intact_by(&self, delivered: Checksum) -> bool {
        delivered == self.checksum
    }

    /// The answer to the read once [`Catalog::unpin_read`] has settled it.
    pub(crate) fn answer(&self, corrupt: bool) -> Get {
        if corrupt {
            Get::Miss(MissReason::Corrupt)
        } else {
            Get::Hit { len: self.len, checksum: self.checksum }
        }
    }
}

/// Why [`Catalog::restore_all`] left a block out.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The limits could not hold it.
    Limits(Refusal),
    /// A newer version of its key (or another block with its commit sequence) came first.
    Older,
}

/// A committed block loaded from durable storage at open.
#[derive(Debug)]
pub(crate) struct Restored<P> {
    pub(crate) key: PhysicalKey,
    pub(crate) len: u64,
    pub(crate) checksum: Checksum,
    pub(crate) seq: u64,
    pub(crate) payload: P,
}

#[derive(Debug)]
pub(crate) struct Catalog<P> {
    policy: FullPolicy,
    kind: MemoryKind,
    ledger: Ledger,
    idempotency: IdempotencyTable,
    regions: RegionTable,
    blocks: HashMap<RegionId, Entry<P>, ByRegion>,
    /// Physical key -> the live (open or committed) block under it.
    exact: HashMap<KeyDigest, RegionId, ByDigest>,
    /// Logical key -> committed blocks under it (for incompatible misses).
    logical: HashMap<KeyDigest, Ids, ByDigest>,
    /// (shape, last chain link), as a keyed 64-bit name ([`Self::prefix_name`]) -> committed
    /// blocks (for prefix hits). A lookup checks each candidate's shape and chain, so two pairs
    /// that share a name only make one more candidate to check.
    prefix: HashMap<u64, Ids, ByRegion>,
    /// The keys of [`Self::prefix_name`].
    prefix_keys: ByDigest,
    /// Committed blocks by commit order, oldest first.
    age: BTreeMap<u64, RegionId>,
    next_seq: u64,
    corrupt_dropped: CorruptDrops,
    evictions: u64,
    /// The order in which committed blocks give way when a quota is full.
    eviction: Box<dyn EvictionPolicy>,
    /// Keys of evicted blocks, oldest first, once someone asked for them (at most
    /// [`EVICTION_LOG_MAX`]).
    eviction_log: Option<std::collections::VecDeque<PhysicalKey>>,
    /// Evicted blocks with a handle on their payloads, for a store whose evictions go down to
    /// a lower tier: how to take the handle, and the blocks not taken yet (at most
    /// [`EVICTION_LOG_MAX`]; the oldest goes first, counted in `handed_down_dropped`).
    handed_down: Option<HandDown<P>>,
    handed_down_dropped: u64,
}

/// How to take a handle on a payload, and the evicted blocks not collected yet.
type HandDown<P> = (fn(&mut P) -> P, std::collections::VecDeque<HandedDown<P>>);

/// An evicted block for the tier below: its key, checksum, length and payload.
#[derive(Debug)]
pub(crate) struct HandedDown<P> {
    pub(crate) key: PhysicalKey,
    pub(crate) checksum: Checksum,
    pub(crate) len: u64,
    pub(crate) payload: P,
}

/// Most evictions a watched catalog remembers between two looks.
const EVICTION_LOG_MAX: usize = 4096;
/// Blocks a restart restores from which [`Catalog::restore_all`] builds two of its indexes on a
/// thread of their own (below it, a thread costs more than it saves).
const RESTORE_THREAD_MIN: usize = 16 * 1024;

/// A stable 64-bit fingerprint of a block's place in its chain: tenant, shape and one link.
fn chain_name(key: &PhysicalKey, link: &ChainHash) -> u64 {
    let tenant = key.tenant().as_str().as_bytes();
    let len = tenant.len() + 64;
    // On the stack for a tenant name of up to 64 bytes: an open computes this for every block.
    let mut stack = [0u8; 128];
    let mut heap = Vec::new();
    let bytes = if len <= stack.len() {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap[..]
    };
    bytes[..tenant.len()].copy_from_slice(tenant);
    bytes[tenant.len()..tenant.len() + 32].copy_from_slice(&key.shape_digest().0);
    bytes[tenant.len() + 32..].copy_from_slice(&link.0);
    Checksum::of(bytes).0
}

/// Hashes the region ids that key the catalog's block table. The catalog hands them out in
/// sequence itself (no caller chooses one), so the id's own bits spread the blocks: consecutive
/// ids take consecutive buckets, so an open that restores a million blocks fills the table front
/// to back instead of touching it all over, and the top bits the table compares first come from
/// the id's low bits, so neighbours differ there too.
#[derive(Debug, Default, Clone, Copy)]
struct RegionHasher(u64);

impl std::hash::Hasher for RegionHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 << 57)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type ByRegion = std::hash::BuildHasherDefault<RegionHasher>;

/// Hashes the BLAKE3 digests (of keys, shapes, chain links) that key the catalog's indexes.
/// Their bits are already uniform and a caller cannot choose them, so a multiply-and-fold per
/// eight bytes, keyed with this map's own random words, spreads them as well as SipHash does, at
/// a fraction of its cost (an open restores a million blocks into three such maps).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ByDigest {
    keys: [u64; 2],
}

impl Default for ByDigest {
    fn default() -> Self {
        let random = std::collections::hash_map::RandomState::new();
        Self { keys: [random.hash_one(1u8), random.hash_one(2u8) | 1] }
    }
}

impl std::hash::BuildHasher for ByDigest {
    type Hasher = DigestHasher;

    fn build_hasher(&self) -> DigestHasher {
        DigestHasher { state: self.keys[0], key: self.keys[1] }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct DigestHasher {
    state: u64,
    key: u64,
}

impl DigestHasher {
    /// Takes `word` in: the full 128-bit product with the key, its halves folded together.
    #[allow(clippy::cast_possible_truncation)] // the low half is wanted
    fn fold(&mut self, word: u64) {
        let product = u128::from(self.state ^ word) * u128::from(self.key);
        self.state = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.fold(u64::from_le_bytes(w.try_into().unwrap_or_default()));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.fold(u64::from_le_bytes(last));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.fold(n as u64);
    }
}

/// What the eviction policy is told of a committed block.
fn facts<P>(id: RegionId, b: &Entry<P>) -> BlockFacts {
    let chain = b.key.identity().chain();
    let name = match chain.last() {
        Some(link) => chain_name(&b.key, link),
        None => Checksum::of(&b.key.digest().0).0,
    };
    let parent = chain.len().checked_sub(2).map(|i| chain_name(&b.key, &chain[i]));
    BlockFacts {
        id: id.0,
        name,
        parent,
        depth: u32::try_from(chain.len()).unwrap_or(u32::MAX),
        partial: b.key.identity().valid_tokens() < b.key.identity().block_tokens(),
        tenant: Checksum::of(b.key.tenant().as_str().as_bytes()).0,
        len: b.len,
        seq: b.seq,
        request: b.request.map(|r| r.0),
    }
}

/// The blocks one logical or prefix index key names: nearly always one, held without an
/// allocation of its own.
#[derive(Debug)]
enum Ids {
    One(RegionId),
    Many(Vec<RegionId>),
}

impl Ids {
    fn as_slice(&self) -> &[RegionId] {
        match self {
            Ids::One(id) => std::slice::from_ref(id),
            Ids::Many(ids) => ids,
        }
    }

    /// Removes `id`; whether none is left.
    fn remove(&mut self, id: RegionId) -> bool {
        match self {
            Ids::One(only) => *only == id,
            Ids::Many(ids) => {
                ids.retain(|r| *r != id);
                ids.is_empty()
            }
        }
    }
}

fn add_to<K: std::hash::Hash + Eq, S: std::hash::BuildHasher>(
    index: &mut HashMap<K, Ids, S>,
    key: K,
    id: RegionId,
) {
    match index.entry(key) {
        Slot::Occupied(mut held) => match held.get_mut() {
            Ids::One(first) => {
                let first = *first;
                *held.get_mut() = Ids::Many(vec![first, id]);
            }
            Ids::Many(ids) => ids.push(id),
        },
        Slot::Vacant(slot) => {
            slot.insert(Ids::One(id));
        }
    }
}

/// The prefix index's name for `shape` and `link` under `keys` (see [`Catalog::prefix_name`]).
fn prefix_name(keys: &ByDigest, shape: KeyDigest, link: &ChainHash) -> u64 {
    keys.hash_one((shape, link))
}

/// Enters restored blocks in the index by logical key and the index by prefix (as
/// [`Catalog::prefix_name`] names its entries).
fn index_restored(
    logical: &mut HashMap<KeyDigest, Ids, ByDigest>,
    prefix: &mut HashMap<u64, Ids, ByRegion>,
    prefix_keys: &ByDigest,
    keys: &[(RegionId, PhysicalKey)],
) {
    for (id, key) in keys {
        add_to(logical, key.logical_digest(), *id);
        if let Some(link) = key.identity().chain().last() {
            add_to(prefix, prefix_name(prefix_keys, key.shape_digest(), link), *id);
        }
    }
}

fn drop_from<K: std::hash::Hash + Eq, S: std::hash::BuildHasher>(
    index: &mut HashMap<K, Ids, S>,
    key: K,
    id: RegionId,
) {
    if let Some(ids) = index.get_mut(&key)
        && ids.remove(id)
    {
        index.remove(&key);
    }
}

impl<P> Catalog<P> {
    pub(crate) fn new(
        limits: ResourceLimits,
        policy: FullPolicy,
        kind: MemoryKind,
        epoch: Epoch,
        first_region: u64,
        epochs: Box<dyn EpochSource>,
        eviction: Box<dyn EvictionPolicy>,
    ) -> Result<Self, LimitsError> {
        let ledger = Ledger::new(limits.clone())?;
        let regions_max = usize::try_from(limits.registrations_max).unwrap_or(usize::MAX);
        Ok(Self {
            policy,
            kind,
            idempotency: IdempotencyTable::new(&limits),
            ledger,
            regions: RegionTable::new(regions_max, epoch, first_region, epochs),
            blocks: HashMap::default(),
            exact: HashMap::default(),
            logical: HashMap::default(),
            prefix: HashMap::default(),
            prefix_keys: ByDigest::default(),
            age: BTreeMap::new(),
            next_seq: 1,
            corrupt_dropped: CorruptDrops::default(),
            evictions: 0,
            eviction,
            eviction_log: None,
            handed_down: None,
            handed_down_dropped: 0,
        })
    }

    pub(crate) fn epoch(&self) -> Epoch {
        self.regions.epoch()
    }

    /// The prefix index's name for blocks of `shape` whose chain ends in `link`: keyed with
    /// this catalog's own random words, so no caller can pick two pairs that share it.
    fn prefix_name(&self, shape: KeyDigest, link: &ChainHash) -> u64 {
        prefix_name(&self.prefix_keys, shape, link)
    }

    pub(crate) fn entry(&self, id: RegionId) -> Option<&Entry<P>> {
        self.blocks.get(&id)
    }

    pub(crate) fn entry_mut(&mut self, id: RegionId) -> Option<&mut Entry<P>> {
        self.blocks.get_mut(&id)
    }

    /// The committed blocks, oldest commit first.
    pub(crate) fn by_age(&self) -> impl Iterator<Item = &Entry<P>> {
        self.age.values().filter_map(|id| self.blocks.get(id))
    }

    /// Every block the catalog holds, in no order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &Entry<P>> {
        self.blocks.values()
    }

    /// Up to `max` keys of committed blocks in `scope`, in no order (the caller needs the
    /// read right on the scope's tenant). Walks the catalog once.
    pub(crate) fn scope_keys(
        &self,
        caller: &Caller,
        scope: &PurgeScope,
        max: usize,
    ) -> Result<Vec<PhysicalKey>, StoreError> {
        authorize(caller, scope.sample(), Right::Read)?;
        Ok(self
            .blocks
            .values()
            .filter(|b| b.life.state() == BlockState::Committed && scope.contains(&b.key))
            .take(max)
            .map(|b| b.key.clone())
            .collect())
    }

    pub(crate) fn stats(&self) -> StoreStats {
        StoreStats {
            usage: self.ledger.usage(),
            regions: self.regions.counts(),
            committed_blocks: self.age.len() as u64,
            corrupt_dropped: self.corrupt_dropped,
            evictions: self.evictions,
        }
    }

    /// The live block under exactly `key`: the digest finds it, the full key must match.
    pub(crate) fn find_exact(&self, key: &PhysicalKey) -> Option<RegionId> {
        let id = *self.exact.get(&key.digest())?;
        (self.blocks.get(&id)?.key == *key).then_some(id)
    }

    /// The checksum of the committed block under exactly `key`, when there is one: which
    /// version of a key is there now (a key may be written again after it left).
    pub(crate) fn committed_checksum(&self, key: &PhysicalKey) -> Option<Checksum> {
        let b = &self.blocks[&self.find_exact(key)?];
        (b.life.state() == BlockState::Committed).then_some(b.checksum).flatten()
    }

    fn miss_reason(&self, key: &PhysicalKey) -> MissReason {
        if self.logical.contains_key(&key.logical_digest()) {
            MissReason::Incompatible
        } else {
            MissReason::Absent
        }
    }

    // ------------------------------------------------------------------ reads

    pub(crate) fn lookup(&self, key: &PhysicalKey) -> Lookup {
        if let Some(id) = self.find_exact(key) {
            let b = &self.blocks[&id];
            return match b.life.state() {
                BlockState::Committed => Lookup::Hit { len: b.len },
                s => Lookup::Miss(MissReason::NotReadable(s)),
            };
        }
        let chain = key.identity().chain();
        if chain.len() > 1 {
            let shape = key.shape_digest();
            for link in chain[..chain.len() - 1].iter().rev() {
                let name = self.prefix_name(shape, link);
                let Some(candidates) = self.prefix.get(&name) else { continue };
                for id in candidates.as_slice() {
                    let b = &self.blocks[id];
                    let stored = b.key.identity();
                    if b.life.state() == BlockState::Committed
                        && stored.same_shape(key.identity())
                        && stored.chain_is_strict_prefix_of(key.identity())
                    {
                        return Lookup::PrefixHit { key: Box::new(b.key.clone()), len: b.len };
                    }
                }
            }
        }
        Lookup::Miss(self.miss_reason(key))
    }

    /// Pins the committed block under `key` for a read into `capacity` bytes.
    pub(crate) fn pin_read(
        &mut self,
        key: &PhysicalKey,
        capacity: usize,
    ) -> Result<Result<ReadPin, MissReason>, StoreError> {
        let Some(id) = self.find_exact(key) else { return Ok(Err(self.miss_reason(key))) };
        let b = self.blocks.get_mut(&id).ok_or(StoreError::UnknownReservation { region: id })?;
        if b.life.state() != BlockState::Committed {
            return Ok(Err(MissReason::NotReadable(b.life.state())));
        }
        if (capacity as u64) < b.len {
            return Err(StoreError::BufferTooSmall { needed: b.len, provided: capacity as u64 });
        }
        let Some(checksum) = b.checksum else {
            return Err(StoreError::Backend {
                operation: "get",
                detail: "committed block without a checksum".into(),
                retirement: Retirement::Retired,
            });
        };
        b.readers += 1;
        self.eviction.hit(id.0);
        Ok(Ok(ReadPin { region: id, len: b.len, checksum }))
    }

    /// Ends a read. A read that found the block damaged (`damage` says how) drops it; the
    /// payloads of blocks that leave the catalog come back.
    pub(crate) fn unpin_read(&mut self, id: RegionId, damage: Option<CorruptReason>) -> Vec<P> {
        let mut released = Vec::new();
        let Some(b) = self.blocks.get_mut(&id) else { return released };
        debug_assert!(b.readers > 0, "unpin without pin");
        b.readers = b.readers.saturating_sub(1);
        let (state, readers) = (b.life.state(), b.readers);
        if let Some(reason) = damage
            && state == BlockState::Committed
        {
            self.corrupt_dropped.add(CorruptPhase::Get, reason, 1);
            self.start_evict(id, Removal::Dropped, &mut released);
        } else if state == BlockState::Evicting && readers == 0 {
            self.finish_evict(id, &mut released);
        }
        released
    }

    // ------------------------------------------------------------------ eviction

    fn unindex_committed(&mut self, id: RegionId, why: Removal) {
        let Some(b) = self.blocks.get(&id) else { return };
        let (digest, logical, shape) =
            (b.key.digest(), b.key.logical_digest(), b.key.shape_digest());
        let link = b.key.identity().chain().last().copied();
        let seq = b.seq;
        if self.exact.get(&digest) == Some(&id) {
            self.exact.remove(&digest);
        }
        drop_from(&mut self.logical, logical, id);
        if let Some(link) = link {
            let name = self.prefix_name(shape, &link);
            drop_from(&mut self.prefix, name, id);
        }
        if self.age.remove(&seq).is_some() {
            self.eviction.remove(id.0, why);
        }
    }

    /// COMMITTED -> EVICTING, and -> ABSENT at once when nobody is reading.
    fn start_evict(&mut self, id: RegionId, why: Removal, released: &mut Vec<P>) {
        self.unindex_committed(id, why);
        let Some(b) = self.blocks.get_mut(&id) else { return };
        if b.life.apply(Transition::Evict).is_err() {
            return;
        }
        if b.readers == 0 {
            self.finish_evict(id, released);
        }
    }

    fn finish_evict(&mut self, id: RegionId, released: &mut Vec<P>) {
        let Some(mut b) = self.blocks.remove(&id) else { return };
        let released_ok = b.life.apply(Transition::Release).is_ok();
        debug_assert!(released_ok, "finish_evict of a block that was not evicting");
        let _ = self.regions.release_held(id);
        self.ledger.release_block(b.key.tenant(), b.len);
        released.push(b.payload);
    }

    /// The first committed block in the policy's order that nobody is reading, of `tenant`
    /// when given.
    fn victim(&mut self, tenant: Option<&gpucache_dataplane::TenantId>) -> Option<RegionId> {
        let blocks = &self.blocks;
        self.eviction
            .victim(&mut |id| {
                blocks.get(&RegionId(id)).is_some_and(|b| {
                    b.readers == 0
                        && b.life.state() == BlockState::Committed
                        && tenant.is_none_or(|t| b.key.tenant() == t)
                })
            })
            .map(RegionId)
    }

    /// Admission for a new block, evicting oldest unpinned committed blocks first when the
    /// policy says so and only a retained-byte quota stands in the way.
    fn admit(&mut self, key: &PhysicalKey, len: u64, released: &mut Vec<P>) -> Result<(), Refusal> {
        let tenant = key.tenant().clone();
        loop {
            let refusal = match self.ledger.check_block(&tenant, len) {
                Ok(()) => return Ok(()),
                Err(r) => r,
            };
            let evicts = self.policy != FullPolicy::Refuse;
            let victim = match &refusal {
                Refusal::RetainedBytes { .. } if evicts => self.victim(None),
                Refusal::TenantRetainedBytes { .. } if evicts => self.victim(Some(&tenant)),
                _ => None,
            };
            let Some(victim) = victim else { return Err(refusal) };
            self.evictions += 1;
            if let (Some(log), Some(b)) = (self.eviction_log.as_mut(), self.blocks.get(&victim)) {
                if log.len() == EVICTION_LOG_MAX {
                    log.pop_front();
                }
                log.push_back(b.key.clone());
            }
            self.hand_down(victim, released);
            self.start_evict(victim, Removal::Evicted, released);
        }
    }

    /// Keeps a handle on the payload of `victim`, about to be evicted, when evictions are
    /// handed down. `take` may leave a stand-in in the entry (a file store keeps the file for
    /// the tier below instead of removing it). The oldest waiting block, when too many wait,
    /// is let go with `released`.
    fn hand_down(&mut self, victim: RegionId, released: &mut Vec<P>) {
        let Some((take, queue)) = self.handed_down.as_mut() else { return };
        let Some(b) = self.blocks.get_mut(&victim) else { return };
        let Some(checksum) = b.checksum else { return };
        if queue.len() == EVICTION_LOG_MAX {
            if let Some(old) = queue.pop_front() {
                released.push(old.payload);
            }
            self.handed_down_dropped += 1;
        }
        let payload = take(&mut b.payload);
        queue.push_back(HandedDown { key: b.key.clone(), checksum, len: b.len, payload });
    }

    /// From now on, keeps each evicted block's payload (a handle `take` makes) until
    /// [`Self::take_handed_down`] collects it.
    pub(crate) fn hand_down_evictions(&mut self, take: fn(&mut P) -> P) {
        self.handed_down.get_or_insert_with(|| (take, std::collections::VecDeque::new()));
    }

    /// The evicted blocks since the last call, oldest first.
    pub(crate) fn take_handed_down(&mut self) -> Vec<HandedDown<P>> {
        self.handed_down.as_mut().map(|(_, q)| q.drain(..).collect()).unwrap_or_default()
    }

    /// Evicted blocks whose payloads were let go before anyone collected them.
    pub(crate) fn handed_down_dropped(&self) -> u64 {
        self.handed_down_dropped
    }

    // ------------------------------------------------------------------ writes

    /// Starts a create-only PUT. `make` builds the payload holder for a new block.
    pub(crate) fn reserve(
        &mut self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
        now_ms: u64,
        make: impl FnOnce(u64) -> Result<P, StoreError>,
    ) -> Result<(Reserve, Vec<P>), StoreError> {
        authorize(caller, key, Right::Write)?;
        if len == 0 {
            return Err(StoreError::EmptyObject);
        }
        let mut released = Vec::new();
        let tenant = key.tenant().clone();
        if let Some(r) = request {
            match self.idempotency.check(&tenant, r, key.digest(), now_ms)? {
                Some(Replay::Committed) => return Ok((Reserve::AlreadyCommitted, released)),
                Some(Replay::InProgress) => return Ok((Reserve::Busy, released)),
                None => {}
            }
        }
        if let Some(id) = self.exact.get(&key.digest()) {
            let b = &self.blocks[id];
            // A different key under the same digest (a BLAKE3 collision) is never overwritten.
            return Ok((
                match b.life.state() {
                    BlockState::Committed if b.key == *key => Reserve::AlreadyCommitted,
                    _ => Reserve::Busy,
                },
                released,
            ));
        }
        if let Err(refusal) = self.admit(key, len, &mut released) {
            return Ok((Reserve::Refused(refusal), released));
        }
        if request.is_some()
            && let Err(refusal) = self.idempotency.check_capacity()
        {
            return Ok((Reserve::Refused(refusal), released));
        }
        let payload = make(len)?;
        let lease = now_ms.saturating_add(self.ledger.limits().write_lease_ms);
        let region = self.regions.lend(&tenant, self.kind, len, Some(lease))?;
        let mut life = Lifecycle::new(region);
        life.apply(Transition::Reserve)?;
        self.ledger.admit_block(&tenant, len).map_err(|r| StoreError::Backend {
            operation: "reserve",
            detail: format!("admission changed under the lock: {r}"),
            retirement: Retirement::Retired,
        })?;
        if let Some(r) = request {
            // Capacity was checked above under the same lock.
            let _ = self.idempotency.insert_pending(&tenant, r, key.digest());
        }
        self.exact.insert(key.digest(), region);
        self.blocks.insert(
            region,
            Entry {
                key: key.clone(),
                life,
                len,
                written: WrittenRanges::default(),
                checksum: None,
                request,
                seq: 0,
                readers: 0,
                committing: false,
                payload,
            },
        );
        let epoch = self.regions.epoch();
        Ok((Reserve::Reserved(Reservation { region, epoch, len, request }), released))
    }

    /// The open, current-epoch block of a reservation.
    fn open_entry(
        &mut self,
        caller: &Caller,
        r: &Reservation,
    ) -> Result<&mut Entry<P>, StoreError> {
        let current = self.regions.epoch();
        let b = self
            .blocks
            .get_mut(&r.region)
            .ok_or(StoreError::UnknownReservation { region: r.region })?;
        authorize(caller, &b.key, Right::Write)?;
        match b.life.state() {
            BlockState::Reserved | BlockState::Writing if !b.committing => {}
            BlockState::Quarantined => {
                return Err(StoreError::ReservationQuarantined { region: r.region });
            }
            _ => return Err(StoreError::UnknownReservation { region: r.region }),
        }
        if r.epoch != current {
            return Err(StoreError::Registry(RegistryError::StaleEpoch {
                given: r.epoch,
                current,
            }));
        }
        Ok(b)
    }

    /// Records a write of `len` bytes at `offset` and returns the block to copy into.
    pub(crate) fn write_into(
        &mut self,
        caller: &Caller,
        r: &Reservation,
        offset: u64,
        len: u64,
    ) -> Result<&mut Entry<P>, StoreError> {
        let b = self.open_entry(caller, r)?;
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= b.len)
            .ok_or(StoreError::WriteOutOfBounds { offset, len, capacity: b.len })?;
        b.written.add(offset, end)?;
        if b.life.state() == BlockState::Reserved {
            b.life.apply(Transition::BeginWrite)?;
        }
        Ok(b)
    }

    /// Checks that a reservation is fully written and marks it committing; the store then makes
    /// it durable and calls [`Self::finish_commit`] or [`Self::fail_commit`].
    pub(crate) fn start_commit(
        &mut self,
        caller: &Caller,
        r: &Reservation,
    ) -> Result<&mut Entry<P>, StoreError> {
        let b = self.open_entry(caller, r)?;
        let written = b.written.covered();
        if written != b.len {
            return Err(StoreError::Incomplete { written, expected: b.len });
        }
        if b.life.state() == BlockState::Reserved {
            b.life.apply(Transition::BeginWrite)?;
        }
        b.committing = true;
        Ok(b)
    }

    /// Takes the next commit sequence number (a store that names files by it takes it before
    /// writing).
    pub(crate) fn next_seq_reserve(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// The block's bytes are stored with `checksum`; it is the next block in commit order.
    pub(crate) fn finish_commit(
        &mut self,
        id: RegionId,
        checksum: Checksum,
        now_ms: u64,
    ) -> Result<Committed, StoreError> {
        let seq = self.next_seq_reserve();
        self.finish_commit_at(id, checksum, seq, now_ms)
    }

    /// The block's bytes are stored (durably, for a durable store) with `checksum` under the
    /// commit sequence `seq` taken earlier.
    pub(crate) fn finish_commit_at(
        &mut self,
        id: RegionId,
        checksum: Checksum,
        seq: u64,
        now_ms: u64,
    ) -> Result<Committed, StoreError> {
        let b = self.blocks.get_mut(&id).ok_or(StoreError::UnknownReservation { region: id })?;
        b.life.apply(Transition::Commit)?;
        b.committing = false;
        b.checksum = Some(checksum);
        b.seq = seq;
        let (tenant, len, request) = (b.key.tenant().clone(), b.len, b.request);
        let (logical, shape) = (b.key.logical_digest(), b.key.shape_digest());
        let link = b.key.identity().chain().last().copied();
        self.regions.settle(id)?;
        self.ledger.finish_write(&tenant, len);
        if let Some(req) = request {
            self.idempotency.commit(&tenant, req, now_ms);
        }
        add_to(&mut self.logical, logical, id);
        if let Some(link) = link {
            let name = self.prefix_name(shape, &link);
            add_to(&mut self.prefix, name, id);
        }
        self.age.insert(seq, id);
        let facts = facts(id, &self.blocks[&id]);
        self.eviction.insert(&facts);
        Ok(Committed { checksum })
    }

    /// Making the commit durable failed: the commit is abandoned and its request id forgotten,
    /// so a replay cannot report success. `Unknown` quarantines the block's region.
    pub(crate) fn fail_commit(&mut self, id: RegionId, outcome: Retirement) -> Vec<P> {
        if let Some(b) = self.blocks.get_mut(&id) {
            b.committing = false;
        }
        let mut released = Vec::new();
        let _ = self.end_open(id, outcome, &mut released);
        released
    }

    /// Ends an open reservation without commit.
    fn end_open(
        &mut self,
        id: RegionId,
        outcome: Retirement,
        released: &mut Vec<P>,
    ) -> Result<Abort, StoreError> {
        match outcome {
            Retirement::Unknown => {
                self.regions.complete(id, Completion::Unknown)?;
                self.quarantine_open(id)?;
                Ok(Abort::Quarantined)
            }
            Retirement::Retired => {
                let Some(mut b) = self.blocks.remove(&id) else {
                    return Err(StoreError::UnknownReservation { region: id });
                };
                b.life.apply(Transition::Abort)?;
                self.regions.complete(id, Completion::Retired)?;
                let tenant = b.key.tenant().clone();
                self.ledger.finish_write(&tenant, b.len);
                self.ledger.release_block(&tenant, b.len);
                if let Some(req) = b.request {
                    self.idempotency.forget(&tenant, req);
                }
                if self.exact.get(&b.key.digest()) == Some(&id) {
                    self.exact.remove(&b.key.digest());
                }
                released.push(b.payload);
                Ok(Abort::Released)
            }
        }
    }

    pub(crate) fn abort(
        &mut self,
        caller: &Caller,
        r: Reservation,
        outcome: Retirement,
    ) -> Result<(Abort, Vec<P>), StoreError> {
        let b = self
            .blocks
            .get(&r.region)
            .ok_or(StoreError::UnknownReservation { region: r.region })?;
        authorize(caller, &b.key, Right::Write)?;
        match b.life.state() {
            BlockState::Quarantined => return Ok((Abort::Quarantined, Vec::new())),
            BlockState::Reserved | BlockState::Writing if !b.committing => {}
            _ => return Err(StoreError::UnknownReservation { region: r.region }),
        }
        let mut released = Vec::new();
        let a = self.end_open(r.region, outcome, &mut released)?;
        Ok((a, released))
    }

    /// RESERVED/WRITING -> QUARANTINED. The region and its retained bytes stay charged; the key
    /// is free for a new writer.
    fn quarantine_open(&mut self, id: RegionId) -> Result<(), StoreError> {
        let Some(b) = self.blocks.get_mut(&id) else { return Ok(()) };
        if !matches!(b.life.state(), BlockState::Reserved | BlockState::Writing) {
            return Ok(());
        }
        b.life.apply(Transition::Quarantine)?;
        b.committing = false;
        let (tenant, len, request, digest) =
            (b.key.tenant().clone(), b.len, b.request, b.key.digest());
        self.ledger.finish_write(&tenant, len);
        if let Some(r) = request {
            self.idempotency.forget(&tenant, r);
        }
        if self.exact.get(&digest) == Some(&id) {
            self.exact.remove(&digest);
        }
        Ok(())
    }

    pub(crate) fn invalidate(
        &mut self,
        caller: &Caller,
        key: &PhysicalKey,
    ) -> Result<(Invalidate, Vec<P>), StoreError> {
        let id = match self.removable(caller, key)? {
            Ok(id) => id,
            Err(answer) => return Ok((answer, Vec::new())),
        };
        Ok((Invalidate::Removed, self.remove_committed(id)))
    }

    /// The committed block an invalidation of `key` would remove, or the answer when there is
    /// none (`Absent`, or `Busy` while a writer holds the key). Changes nothing: a store that
    /// must make the removal durable first does so, then calls [`Self::remove_committed`].
    pub(crate) fn removable(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
    ) -> Result<Result<RegionId, Invalidate>, StoreError> {
        authorize(caller, key, Right::Write)?;
        let Some(id) = self.find_exact(key) else { return Ok(Err(Invalidate::Absent)) };
        if self.blocks[&id].life.state() != BlockState::Committed {
            return Ok(Err(Invalidate::Busy));
        }
        Ok(Ok(id))
    }

    /// Takes the committed block `id` out of the indexes (COMMITTED -> EVICTING, and ABSENT once
    /// no reader holds it); nothing when it is no longer committed.
    pub(crate) fn remove_committed(&mut self, id: RegionId) -> Vec<P> {
        let mut released = Vec::new();
        if self.blocks.get(&id).is_some_and(|b| b.life.state() == BlockState::Committed) {
            self.start_evict(id, Removal::Invalidated, &mut released);
        }
        released
    }

    /// Counts `n` damaged blocks found in `phase` for `reason` (by the store itself, such as the
    /// files a FileStore's open removed).
    pub(crate) fn count_corrupt(&mut self, phase: CorruptPhase, reason: CorruptReason, n: u64) {
        self.corrupt_dropped.add(phase, reason, n);
    }

    // ------------------------------------------------------------------ quarantine and fences

    pub(crate) fn expire_leases(&mut self, now_ms: u64) -> Result<usize, StoreError> {
        let expired = self.regions.expire_leases(now_ms);
        for id in &expired {
            self.quarantine_open(*id)?;
        }
        Ok(expired.len())
    }

    fn reclaim(&mut self, proof: ReclaimProof, released: &mut Vec<P>) -> Result<u64, StoreError> {
        let id = proof.region();
        self.quarantine_open(id)?;
        let Some(mut b) = self.blocks.remove(&id) else { return Ok(0) };
        b.life.apply(Transition::Reclaim(proof))?;
        self.ledger.release_block(b.key.tenant(), b.len);
        let len = b.len;
        released.push(b.payload);
        Ok(len)
    }

    pub(crate) fn attest_drained(
        &mut self,
        caller: &Caller,
        region: RegionId,
    ) -> Result<(Reclaimed, Vec<P>), StoreError> {
        let mut released = Vec::new();
        match self.regions.attest(caller, region, Attestation::Drained)? {
            AttestOutcome::Reclaimed(proof) => {
                let bytes = self.reclaim(proof, &mut released)?;
                Ok((Reclaimed { region, bytes }, released))
            }
            AttestOutcome::StillQuarantined => Err(StoreError::Backend {
                operation: "attest",
                detail: "a drained attestation left the region quarantined".into(),
                retirement: Retirement::Unknown,
            }),
        }
    }

    /// Advances the epoch and quarantines every open reservation of older epochs: their
    /// writers may still be mid-transfer.
    pub(crate) fn bump_epoch(&mut self) -> Result<Epoch, StoreError> {
        let epoch = self.regions.bump_epoch()?;
        let open: Vec<RegionId> = self
            .blocks
            .iter()
            .filter(|(_, b)| matches!(b.life.state(), BlockState::Reserved | BlockState::Writing))
            .map(|(id, _)| *id)
            .collect();
        for id in open {
            self.regions.quarantine(id, QuarantineCause::Fenced)?;
            self.quarantine_open(id)?;
        }
        Ok(epoch)
    }

    pub(crate) fn reclaim_fenced(&mut self, epoch: Epoch) -> Result<(usize, Vec<P>), StoreError> {
        let proofs = self.regions.reclaim_fenced(epoch)?;
        let n = proofs.len();
        let mut released = Vec::new();
        for proof in proofs {
            self.reclaim(proof, &mut released)?;
        }
        Ok((n, released))
    }

    // ------------------------------------------------------------------ restart

    /// Loads the blocks committed before a restart (`blocks`, oldest commit first). They are
    /// admitted newest first, so that limits tighter than what was kept leave out the oldest,
    /// as eviction would have; the eviction policy then learns them oldest first. `kept` is
    /// given the region each admitted block now has, its length and its payload. The refused come back,
    /// newest first, for the caller to discard: those over the limits, and an older version of
    /// a key (or another block of the same commit) whose newer one was admitted.
    pub(crate) fn restore_all(
        &mut self,
        blocks: Vec<Restored<P>>,
        mut kept: impl FnMut(RegionId, u64, &mut P),
    ) -> Vec<(Refused, P)> {
        let n = blocks.len();
        // Sized once: growing them on the way would move every entry again and again.
        self.blocks.reserve(n);
        self.exact.reserve(n);
        self.logical.reserve(n);
        self.prefix.reserve(n);
        let mut admitted = Vec::with_capacity(n);
        let mut refused = Vec::new();
        let mut newer_seq = None;
        for block in blocks.into_iter().rev() {
            // The commit order is built below, in one pass: two blocks with one sequence are
            // next to each other here.
            if newer_seq == Some(block.seq) || self.age.contains_key(&block.seq) {
                refused.push((Refused::Older, block.payload));
                continue;
            }
            newer_seq = Some(block.seq);
            match self.admit_restored(block, &mut kept) {
                Ok(entry) => admitted.push(entry),
                Err(r) => refused.push(r),
            }
        }
        // The rest enters each block once in five large tables, at random: the indexes by
        // logical key and by prefix are built on a second thread while this one enters the
        // blocks, the commit order and the policy (which learns them oldest first).
        let keys: Vec<(RegionId, PhysicalKey)> =
            admitted.iter().map(|(id, entry)| (*id, entry.key.clone())).collect();
        let (logical, prefix) = (&mut self.logical, &mut self.prefix);
        // Taken by whichever thread gets to it first: the helper, or this one when no helper
        // could start.
        let indexes = Mutex::new(Some((logical, prefix, keys)));
        let prefix_keys = &self.prefix_keys;
        let index = || {
            let work = indexes.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some((logical, prefix, keys)) = work {
                index_restored(logical, prefix, prefix_keys, &keys);
            }
        };
        let (table, age, eviction) = (&mut self.blocks, &mut self.age, &mut self.eviction);
        std::thread::scope(|s| {
            let helper = (n >= RESTORE_THREAD_MIN)
                .then(|| {
                    std::thread::Builder::new()
                        .name("gpucache-restore".into())
                        .spawn_scoped(s, index)
                        .ok()
                })
                .flatten();
            for (id, entry) in admitted.into_iter().rev() {
                let facts = facts(id, &entry);
                age.insert(entry.seq, id);
                eviction.insert(&facts);
                table.insert(id, entry);
            }
            if let Some(Err(panic)) = helper.map(std::thread::ScopedJoinHandle::join) {
                std::panic::resume_unwind(panic);
            }
            index();
        });
        refused
    }

    /// Admits one restored block (see [`Self::restore_all`], which enters it in the block
    /// table, the commit order and the indexes): its region and its entry.
    fn admit_restored(
        &mut self,
        block: Restored<P>,
        kept: &mut impl FnMut(RegionId, u64, &mut P),
    ) -> Result<(RegionId, Entry<P>), (Refused, P)> {
        let Restored { key, len, checksum, seq, mut payload } = block;
        let Slot::Vacant(exact) = self.exact.entry(key.digest()) else {
            return Err((Refused::Older, payload));
        };
        let tenant = key.tenant();
        if let Err(r) = self.ledger.admit_block(tenant, len) {
            return Err((Refused::Limits(r), payload));
        }
        self.ledger.finish_write(tenant, len);
        let region = match self.regions.hold(tenant, self.kind, len) {
            Ok(r) => r,
            Err(_) => {
                self.ledger.release_block(tenant, len);
                let current = u32::try_from(self.regions.len()).unwrap_or(u32::MAX);
                let r = Refusal::Registrations { current, max: current };
                return Err((Refused::Limits(r), payload));
            }
        };
        let mut life = Lifecycle::new(region);
        for t in [Transition::Reserve, Transition::BeginWrite, Transition::Commit] {
            let _ = life.apply(t);
        }
        exact.insert(region);
        self.next_seq = self.next_seq.max(seq + 1);
        kept(region, len, &mut payload);
        let entry = Entry {
            key,
            life,
            len,
            written: WrittenRanges::default(),
            checksum: Some(checksum),
            request: None,
            seq,
            readers: 0,
            committing: false,
            payload,
        };
        Ok((region, entry))
    }

    /// The keys evicted since the last call, oldest first; the first call starts the log.
    pub(crate) fn take_evicted(&mut self) -> Vec<PhysicalKey> {
        self.eviction_log.get_or_insert_default().drain(..).collect()
    }

    /// Damages nothing; finds the committed payload under `key` for fault injection.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn committed_payload_mut(&mut self, key: &PhysicalKey) -> Option<&mut P> {
        let id = self.find_exact(key)?;
        let b = self.blocks.get_mut(&id)?;
        (b.life.state() == BlockState::Committed).then_some(&mut b.payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::registry::LocalEpochs;
    use gpucache_dataplane::testing::fixture::{caller, key};

    fn catalog(retained: u64) -> Catalog<u32> {
        let limits = ResourceLimits {
            object_bytes_max: 100,
            retained_bytes_max: retained,
            tenant_retained_bytes_max: retained,
            ..ResourceLimits::default()
        };
        Catalog::new(
            limits,
            FullPolicy::EvictOldest,
            MemoryKind::Host,
            Epoch(1),
            1,
            Box::new(LocalEpochs),
            crate::evict::PolicyKind::Fifo.build(retained),
        )
        .unwrap()
    }

    fn commit(c: &mut Catalog<u32>, link: u8, tag: u32) -> RegionId {
        let k = key(0, &[link], KvDtype::F16, 16);
        let (answer, _) = c.reserve(&caller(0), &k, 100, None, 0, |_| Ok(tag)).unwrap();
        let Reserve::Reserved(r) = answer else { panic!("not reserved: {answer:?}") };
        c.write_into(&caller(0), &r, 0, 100).unwrap();
        c.start_commit(&caller(0), &r).unwrap();
        c.finish_commit(r.region, Checksum(u64::from(tag)), 0).unwrap();
        r.region
    }

    /// Restored blocks come oldest first: the newest are admitted while the limits hold them,
    /// an older version of an admitted key is refused as such, and the policy learns the
    /// admitted ones oldest first.
    #[test]
    fn a_restore_keeps_the_newest_within_the_limits_and_refuses_older_versions() {
        let mut c = catalog(200);
        let k = |link: u8| key(0, &[link], KvDtype::F16, 16);
        let block = |link: u8, seq: u64| Restored {
            key: k(link),
            len: 100,
            checksum: Checksum(seq),
            seq,
            payload: u32::try_from(seq).unwrap(),
        };
        let blocks = vec![block(1, 1), block(2, 2), block(2, 3), block(3, 4)];
        let mut kept = Vec::new();
        let refused = c.restore_all(blocks, |id, len, payload| kept.push((id, len, *payload)));
        let payloads: Vec<u32> = kept.iter().map(|(_, _, p)| *p).collect();
        assert_eq!(payloads, [4, 3], "newest first");
        assert!(matches!(refused[0], (Refused::Older, 2)), "{refused:?}");
        assert!(matches!(refused[1], (Refused::Limits(_), 1)), "{refused:?}");
        assert_eq!(refused.len(), 2);
        assert_eq!(c.committed_checksum(&k(2)), Some(Checksum(3)));
        assert_eq!(c.committed_checksum(&k(3)), Some(Checksum(4)));
        assert_eq!(c.committed_checksum(&k(1)), None);
        let seqs: Vec<u64> = c.by_age().map(|b| b.seq).collect();
        assert_eq!(seqs, [3, 4]);
        // FIFO: the oldest restored block gives way first.
        assert_eq!(c.victim(None), Some(kept[1].0));
        assert_eq!(c.stats().committed_blocks, 2);
    }

    /// A restore large enough to build its logical and prefix indexes on a second thread finds
    /// every block as the inline one does: by its key, as the prefix of a longer chain, and as
    /// an incompatible miss for another form of its logical key.
    #[test]
    fn a_large_restore_indexes_every_block_for_exact_prefix_and_logical_lookups() {
        let n = RESTORE_THREAD_MIN + 1000;
        let mut c = catalog(100 * n as u64);
        let chain = |i: usize| {
            let [.., a, b] = i.to_be_bytes();
            [a, b]
        };
        let blocks: Vec<Restored<u32>> = (0..n)
            .map(|i| Restored {
                key: key(0, &chain(i), KvDtype::F16, 16),
                len: 100,
                checksum: Checksum(i as u64),
                seq: i as u64 + 1,
                payload: u32::try_from(i).unwrap(),
            })
            .collect();
        let refused = c.restore_all(blocks, |_, _, _| {});
        assert!(refused.is_empty());
        assert_eq!(c.stats().committed_blocks, n as u64);
        for i in (0..n).step_by(97).chain([0, n - 1]) {
            let [a, b] = chain(i);
            let exact = key(0, &[a, b], KvDtype::F16, 16);
            assert_eq!(c.lookup(&exact), Lookup::Hit { len: 100 }, "block {i}");
            let longer = key(0, &[a, b, 7], KvDtype::F16, 16);
            assert_eq!(
                c.lookup(&longer),
                Lookup::PrefixHit { key: Box::new(exact), len: 100 },
                "block {i} as a prefix"
            );
            let other_form = key(0, &[a, b], KvDtype::Bf16, 16);
            assert_eq!(c.lookup(&other_form), Lookup::Miss(MissReason::Incompatible), "block {i}");
        }
        let absent = key(0, &[255, 255, 255], KvDtype::F16, 16);
        assert_eq!(c.lookup(&absent), Lookup::Miss(MissReason::Absent));
    }

    #[test]
    fn pinned_blocks_are_never_quota_victims() {
        let mut c = catalog(200);
        commit(&mut c, 1, 1);
        commit(&mut c, 2, 2);
        let oldest = key(0, &[1], KvDtype::F16, 16);
        let pin = c.pin_read(&oldest, 100).unwrap().unwrap();
        // The oldest block is being read: the next-oldest goes instead.
        let third = key(0, &[3], KvDtype::F16, 16);
        let (answer, released) = c.reserve(&caller(0), &third, 100, None, 0, |_| Ok(3)).unwrap();
        assert!(matches!(answer, Reserve::Reserved(_)), "{answer:?}");
        assert_eq!(released, vec![2]);
        assert_eq!(c.lookup(&oldest), Lookup::Hit { len: 100 });
        // With every committed block pinned, a full store refuses instead of evicting.
        let Reserve::Reserved(r) = answer else { unreachable!() };
        let _ = c.abort(&caller(0), r, Retirement::Retired).unwrap();
        let mut c2 = catalog(100);
        commit(&mut c2, 1, 1);
        let _pin2 = c2.pin_read(&oldest, 100).unwrap().unwrap();
        let (answer, released) = c2.reserve(&caller(0), &third, 100, None, 0, |_| Ok(3)).unwrap();
        assert!(matches!(answer, Reserve::Refused(Refusal::RetainedBytes { .. })), "{answer:?}");
        assert!(released.is_empty());
        assert!(c.unpin_read(pin.region, None).is_empty());
    }

    #[test]
    fn invalidating_a_block_being_read_releases_it_after_the_read() {
        let mut c = catalog(1000);
        let region = commit(&mut c, 1, 7);
        let k = key(0, &[1], KvDtype::F16, 16);
        let pin = c.pin_read(&k, 100).unwrap().unwrap();
        let (answer, released) = c.invalidate(&caller(0), &k).unwrap();
        assert_eq!(answer, Invalidate::Removed);
        assert!(released.is_empty(), "the payload left while a reader held it");
        assert_eq!(c.lookup(&k), Lookup::Miss(MissReason::Absent));
        assert_eq!(c.entry(region).map(|b| b.life.state()), Some(BlockState::Evicting));
        assert_eq!(c.stats().usage.retained_bytes, 100, "an evicting block stays charged");
        assert_eq!(c.unpin_read(pin.region, None), vec![7]);
        assert_eq!(c.stats().usage.retained_bytes, 0);
        // A new block under the same key can be written while the old one drains.
        let pin2 = commit(&mut c, 1, 8);
        assert!(pin2 > region);
    }
}
