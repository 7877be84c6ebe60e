//! The store trait every backend implements, and the values it answers with.
//!
//! Expected outcomes are values: a miss (with its reason), a prefix hit, an idempotent replay, a
//! busy key and an admission refusal all come back as `Ok`. `Err` is for calls that failed, and
//! every error states whether the store has stopped touching the caller's buffers
//! ([`Retirement`]); [`Store::failures_retire`] is the store-wide guarantee behind it.
//!
//! A PUT is create-only: [`Store::reserve`], then [`Store::write`] (any number of pieces), then
//! [`Store::commit`], or [`Store::abort`]. [`Store::put`] does all three.
//!
//! Engines restore and save prefixes many blocks at a time, so the contract is batch-first:
//! [`Store::lookup_batch`], [`Store::get_batch`], [`Store::put_batch`] and
//! [`Store::invalidate_batch`] answer per key, in order, each answer exactly what the single-key
//! call would have answered for that key (one key's error never fails its neighbours, and each
//! error carries its own [`Retirement`]). The defaults call the single-key operations one by one;
//! a store that can do better (one lock, I/O in flight together, one network exchange) overrides
//! them.

use crate::caller::{Caller, Right};
use crate::checksum::Checksum;
use crate::identity::TenantId;
use crate::key::PhysicalKey;
use crate::lifecycle::{BlockState, IllegalTransition};
use crate::limits::{Refusal, ReplayConflict, RequestId, Usage};
use crate::registry::{Epoch, RegionCounts, RegionId, RegistryError};

/// Whether a failed call has stopped touching the caller's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retirement {
    /// Proven: the buffers may be reused or freed.
    Retired,
    /// Not proven: the buffers must be quarantined until an attestation or a fence.
    Unknown,
}

/// Why a lookup or read found nothing usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    /// No block under this logical key.
    Absent,
    /// The logical prefix exists, but only in another physical form (dtype, layout, shard...).
    Incompatible,
    /// The block exists but is not readable yet or any more (reserved, writing, evicting).
    NotReadable(BlockState),
    /// The stored bytes no longer match their checksum; the block was dropped.
    Corrupt,
}

/// Answer to [`Store::lookup`]. Never carries payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The exact physical key is committed.
    Hit {
        len: u64,
    },
    /// A committed block whose chain is a strict prefix of the request's, with every
    /// byte-affecting field equal. Read it whole under `key`; it is never sliced.
    PrefixHit {
        key: Box<PhysicalKey>,
        len: u64,
    },
    Miss(MissReason),
}

/// Which tier of a store made of tiers holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Host memory over the tier below.
    Memory,
    /// Block files.
    File,
    /// Packs on an object store, below the file tier.
    Cold,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::File => "file",
            Self::Cold => "cold",
        }
    }
}

/// Answer to [`Store::locate`]: the lookup, and the tier that holds the block it found (the
/// block a prefix hit names). `None` for a miss, and for a store of one tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub lookup: Lookup,
    pub tier: Option<Tier>,
}

/// Answer to [`Store::get_into`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Get {
    /// `len` payload bytes were written to the front of the destination and verified.
    Hit { len: u64, checksum: Checksum },
    /// Nothing usable; the destination holds no payload (a corrupt read is zeroed).
    Miss(MissReason),
}

/// One key of a [`Store::get_batch`]: the block to read and the caller-owned buffer it lands in.
#[derive(Debug)]
pub struct BatchGet<'a> {
    pub key: &'a PhysicalKey,
    pub dst: &'a mut [u8],
}

/// One block of a [`Store::put_batch`].
#[derive(Debug, Clone, Copy)]
pub struct BatchPut<'a> {
    pub key: &'a PhysicalKey,
    pub src: &'a [u8],
    pub request: Option<RequestId>,
}

/// Where a store sends a lent block: given its bytes and committed checksum, it returns the
/// checksum it computed over those bytes, or none when it did not hash them.
pub type LendTo<'a> = dyn FnMut(&[u8], Checksum) -> Option<Checksum> + 'a;

/// Where [`Store::get_one`] delivers a block: lent, or copied into a buffer the caller lays
/// out only when the store asks for it.
pub trait GetTo {
    /// Sends a lent block, as [`LendTo`] does.
    fn lend(&mut self, bytes: &[u8], checksum: Checksum) -> Option<Checksum>;

    /// The buffer a copied block lands in, of the GET's capacity.
    fn buffer(&mut self) -> &mut [u8];
}

/// How [`Store::get_one`] delivered a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The store's own bytes went to the sender; the destination buffer holds nothing.
    Lent,
    /// The bytes were copied into the front of the destination buffer and verified there.
    Copied,
}

/// Answer to [`Store::get_one`]: what the GET found, how a hit was delivered (a miss is
/// [`Delivery::Copied`] with nothing copied), and which tier held a hit (`None` for a store of
/// one tier, and for a miss).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GotOne {
    pub get: Get,
    pub delivery: Delivery,
    pub tier: Option<Tier>,
}

impl GotOne {
    /// A GET answered by copying (or missing) in a store of one tier.
    pub fn copied(get: Get) -> Self {
        Self { get, delivery: Delivery::Copied, tier: None }
    }
}

/// The answers of a batch call: one per item, in the items' order.
pub type BatchAnswers<T> = Vec<Result<T, StoreError>>;

/// A writer's handle to a reserved block.
#[derive(Debug, PartialEq, Eq)]
pub struct Reservation {
    pub region: RegionId,
    pub epoch: Epoch,
    pub len: u64,
    pub request: Option<RequestId>,
}

/// Answer to [`Store::reserve`].
#[derive(Debug, PartialEq, Eq)]
pub enum Reserve {
    /// Write `len` bytes, then commit or abort.
    Reserved(Reservation),
    /// Create-only: a committed block (or this same request, replayed) already holds the key.
    /// This is success for the caller.
    AlreadyCommitted,
    /// Another writer holds the key right now.
    Busy,
    /// Admission refused; nothing was charged.
    Refused(Refusal),
}

impl Reserve {
    /// The reservation to write into, or the final answer of a PUT that writes nothing.
    pub fn into_reservation(self) -> Result<Reservation, Put> {
        match self {
            Reserve::Reserved(r) => Ok(r),
            Reserve::AlreadyCommitted => Err(Put::AlreadyCommitted),
            Reserve::Busy => Err(Put::Busy),
            Reserve::Refused(r) => Err(Put::Refused(r)),
        }
    }
}

/// Answer to [`Store::commit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    pub checksum: Checksum,
}

/// Answer to [`Store::put`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Put {
    Committed(Checksum),
    AlreadyCommitted,
    Busy,
    Refused(Refusal),
}

/// Answer to [`Store::abort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abort {
    /// The reservation is gone and its charges released.
    Released,
    /// The outcome was unknown: the region is quarantined and still charged.
    Quarantined,
}

/// Answer to [`Store::invalidate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalidate {
    Removed,
    Absent,
    /// A writer holds the key; it must commit or abort first.
    Busy,
}

/// Answer to [`Store::attest_drained`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reclaimed {
    pub region: RegionId,
    pub bytes: u64,
}

/// What kind of implementation a store is; simulations say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implementation {
    Real,
    Simulated { seed: u64 },
}

/// What a store does when a retained-byte quota would be exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullPolicy {
    /// Refuse admission (MemoryStore).
    Refuse,
    /// Evict the tenant's (or, for the global quota, anyone's) oldest unpinned committed
    /// blocks first (FileStore).
    EvictOldest,
    /// Evict the tenant's (or, for the global quota, anyone's) unpinned committed blocks in the
    /// order of the store's eviction policy (recency, frequency, chain position).
    Evict,
}

/// Static facts about a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreInfo {
    pub name: &'static str,
    pub implementation: Implementation,
    pub failures_retire: bool,
    pub full_policy: FullPolicy,
}

/// A store's own view of whether it can serve ([`Store::condition`]). `None` means the store does
/// not track that fact (a memory store has no disk; a remote store answers for its server).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreCondition {
    /// The most recent I/O failure of the store's medium, when no I/O has succeeded since
    /// (`Some(None)`: the last I/O succeeded, or none happened yet).
    pub io_failure: Option<Option<String>>,
    /// Bytes free for new blocks on the store's medium (a file system's available space).
    pub free_bytes: Option<u64>,
    /// The most a block needs on the medium beyond its payload (header, the space the store
    /// keeps free, a new segment of a block log), so that `free_bytes` can be compared with a
    /// payload size.
    pub block_overhead_bytes: u64,
}

/// When a store found a damaged block and dropped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CorruptPhase {
    /// While opening: the scan of stored blocks at a restart.
    Open,
    /// While a read verified what it delivered.
    Get,
}

impl CorruptPhase {
    pub const ALL: [Self; 2] = [Self::Open, Self::Get];

    /// A stable lower-case name (a metric label).
    pub fn name(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Get => "get",
        }
    }
}

/// What was wrong with a dropped block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CorruptReason {
    /// Its header is damaged: bad magic, format, length or checksum, or a key that does not
    /// decode.
    Header,
    /// It is shorter (or longer) than its header says, or a read of it ended early.
    Truncated,
    /// Its payload failed its checksum.
    Checksum,
    /// Its header names another block than the one it is stored as.
    Identity,
    /// It was gone when it was read.
    Missing,
    /// It could not be read at all (an I/O error).
    Unreadable,
    /// It is not a block at all: something the store never writes, found where blocks live.
    Foreign,
}

impl CorruptReason {
    pub const ALL: [Self; 7] = [
        Self::Header,
        Self::Truncated,
        Self::Checksum,
        Self::Identity,
        Self::Missing,
        Self::Unreadable,
        Self::Foreign,
    ];

    /// A stable lower-case name (a metric label).
    pub fn name(self) -> &'static str {
        match self {
            Self::Header => "header",
            Self::Truncated => "truncated",
            Self::Checksum => "checksum",
            Self::Identity => "identity",
            Self::Missing => "missing",
            Self::Unreadable => "unreadable",
            Self::Foreign => "foreign",
        }
    }
}

/// Damaged blocks a store dropped, counted by phase and reason. Bounded: one counter per pair
/// of [`CorruptPhase`] and [`CorruptReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CorruptDrops {
    counts: [[u64; CorruptReason::ALL.len()]; CorruptPhase::ALL.len()],
}

impl CorruptDrops {
    /// Blocks dropped in `phase` for `reason`.
    pub fn get(&self, phase: CorruptPhase, reason: CorruptReason) -> u64 {
        self.counts[phase as usize][reason as usize]
    }

    /// Counts `n` more blocks dropped in `phase` for `reason` (saturating).
    pub fn add(&mut self, phase: CorruptPhase, reason: CorruptReason, n: u64) {
        let c = &mut self.counts[phase as usize][reason as usize];
        *c = c.saturating_add(n);
    }

    /// Blocks dropped in `phase`, whatever the reason.
    pub fn in_phase(&self, phase: CorruptPhase) -> u64 {
        self.counts[phase as usize].iter().fold(0, |a, n| a.saturating_add(*n))
    }

    /// Blocks dropped in every phase for every reason.
    pub fn total(&self) -> u64 {
        CorruptPhase::ALL.iter().fold(0, |a, p| a.saturating_add(self.in_phase(*p)))
    }

    /// Every (phase, reason, count), zeros included, in declaration order.
    pub fn iter(&self) -> impl Iterator<Item = (CorruptPhase, CorruptReason, u64)> + use<> {
        let drops = *self;
        CorruptPhase::ALL
            .into_iter()
            .flat_map(move |p| CorruptReason::ALL.into_iter().map(move |r| (p, r, drops.get(p, r))))
    }
}

/// Counters and gauges a store reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub usage: Usage,
    pub regions: RegionCounts,
    pub committed_blocks: u64,
    /// Damaged blocks dropped, by phase and reason ([`CorruptDrops::total`] for all of them).
    pub corrupt_dropped: CorruptDrops,
    pub evictions: u64,
}

/// What a failed file-system step left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageEffect {
    /// Nothing changed: the store holds what it held before the call.
    Unchanged,
    /// The change was made but could not be made durable: a power loss or kernel crash may
    /// undo it.
    NotDurable,
}

impl std::fmt::Display for StorageEffect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Unchanged => "nothing was changed",
            Self::NotDurable => "the change was made but is not durable (a power loss may undo it)",
        })
    }
}

/// Why a store call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("tenant {caller} may not use a key of tenant {owner}")]
    WrongTenant { caller: TenantId, owner: TenantId },
    #[error("tenant {tenant} lacks the {right} right")]
    Forbidden { tenant: TenantId, right: Right },
    #[error("a block must hold at least one byte")]
    EmptyObject,
    #[error("reservation {region} is not open (committed, aborted, reclaimed or never made)")]
    UnknownReservation { region: RegionId },
    #[error("reservation {region} was quarantined and accepts no more writes")]
    ReservationQuarantined { region: RegionId },
    #[error("write of {len} bytes at offset {offset} does not fit a {capacity}-byte reservation")]
    WriteOutOfBounds { offset: u64, len: u64, capacity: u64 },
    #[error("commit with {written} of {expected} bytes written")]
    Incomplete { written: u64, expected: u64 },
    #[error("destination holds {provided} bytes, the block has {needed}")]
    BufferTooSmall { needed: u64, provided: u64 },
    #[error(transparent)]
    Replay(#[from] ReplayConflict),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Lifecycle(#[from] IllegalTransition),
    /// A node of a cluster refused the request under its view (an older or newer epoch than
    /// the client routed by, or a node that admits nothing now). Nothing was served: the
    /// client refreshes its view on [`FenceRefusal::StaleEpoch`](crate::shard::FenceRefusal) and
    /// takes a miss otherwise.
    #[error("cluster: {0}")]
    Fenced(#[from] crate::shard::FenceRefusal),
    #[error("{operation} failed in the backend: {detail}")]
    Backend { operation: &'static str, detail: String, retirement: Retirement },
    /// A file-system step of a durable store failed (a read-only or full device, a permission
    /// lost): `kind` for programs, `detail` (the system's message) for people, `effect` for what
    /// the call left behind.
    #[error("{operation} failed: {step} of {} failed: {detail}; {effect}", .path.display())]
    Storage {
        operation: &'static str,
        step: &'static str,
        path: std::path::PathBuf,
        kind: std::io::ErrorKind,
        detail: String,
        effect: StorageEffect,
        retirement: Retirement,
    },
    /// A system I/O call of the backend failed outside a file-system step: a socket to a
    /// server or a sidecar, a shared-memory segment. `kind` for programs, `detail` (the
    /// system's message, with what was being done) for people.
    #[error("{operation} failed in the backend: {detail}")]
    Io { operation: &'static str, kind: std::io::ErrorKind, detail: String, retirement: Retirement },
}

impl StoreError {
    /// Whether the store has stopped touching the caller's buffers. Everything but a failure
    /// of the backend ([`is_backend_failure`](Self::is_backend_failure)) is refused before any
    /// buffer is touched.
    pub fn retirement(&self) -> Retirement {
        match self {
            Self::Backend { retirement, .. }
            | Self::Storage { retirement, .. }
            | Self::Io { retirement, .. } => *retirement,
            _ => Retirement::Retired,
        }
    }

    /// Whether the backend failed (`Backend`, `Storage`, `Io`), as opposed to the store
    /// refusing the call (rights, tenant, sizes, reservation and lifecycle rules).
    pub fn is_backend_failure(&self) -> bool {
        matches!(self, Self::Backend { .. } | Self::Storage { .. } | Self::Io { .. })
    }

    /// The system's error kind, when the failure came from a system I/O call.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            Self::Storage { kind, .. } | Self::Io { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// An I/O failure of `operation` from the system's error, described as `context: error`;
    /// the backend no longer touches the caller's buffers.
    pub fn io(
        operation: &'static str,
        context: impl std::fmt::Display,
        error: &std::io::Error,
    ) -> Self {
        Self::Io {
            operation,
            kind: error.kind(),
            detail: format!("{context}: {error}"),
            retirement: Retirement::Retired,
        }
    }

    /// A storage failure of `operation` at `step` on `path`, from the system's error.
    pub fn storage(
        operation: &'static str,
        step: &'static str,
        path: &std::path::Path,
        error: &std::io::Error,
        effect: StorageEffect,
    ) -> Self {
        Self::Storage {
            operation,
            step,
            path: path.to_owned(),
            kind: error.kind(),
            detail: error.to_string(),
            effect,
            retirement: Retirement::Retired,
        }
    }
}

/// Checks that `caller` may use `key` with `right`.
pub fn authorize(caller: &Caller, key: &PhysicalKey, right: Right) -> Result<(), StoreError> {
    if !caller.rights.has(right) {
        return Err(StoreError::Forbidden { tenant: caller.tenant.clone(), right });
    }
    if key.tenant() != &caller.tenant {
        return Err(StoreError::WrongTenant {
            caller: caller.tenant.clone(),
            owner: key.tenant().clone(),
        });
    }
    Ok(())
}

/// Most blocks one PURGE removes: a store lists at most this many keys of the scope per call,
/// and the caller asks again while [`Purged::more`] says some may remain.
pub const PURGE_BLOCKS_MAX: usize = 1 << 16;
/// Longest layout-name prefix a [`PurgeScope`] may carry (a layout name's own limit).
pub const PURGE_LAYOUT_PREFIX_BYTES_MAX: usize = crate::identity::NAME_BYTES_MAX;

/// The blocks one purge removes: every key of the tenant of `sample` that shares its model
/// fields (trust domain, model revision, model config digest, tokenizer revision and adapter)
/// and whose layout name begins with `layout_prefix`, whatever its shard (TP/PP rank and
/// size), dtype, quantization, layout version, block size, chain and the other per-block
/// fields. That is one engine connector's namespace over all its ranks and instances: the
/// fields a rank or a pool changes are the ones left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PurgeScope {
    sample: PhysicalKey,
    layout_prefix: String,
}

/// Why a [`PurgeScope`] cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a purge layout prefix is {len} bytes, the limit is {max}")]
pub struct PurgeScopeError {
    pub len: usize,
    pub max: usize,
}

impl PurgeScope {
    /// The scope of `sample`'s model fields and layout names that begin with `layout_prefix`
    /// (empty: every layout).
    pub fn new(sample: PhysicalKey, layout_prefix: &str) -> Result<Self, PurgeScopeError> {
        if layout_prefix.len() > PURGE_LAYOUT_PREFIX_BYTES_MAX {
            return Err(PurgeScopeError {
                len: layout_prefix.len(),
                max: PURGE_LAYOUT_PREFIX_BYTES_MAX,
            });
        }
        Ok(Self { sample, layout_prefix: layout_prefix.to_owned() })
    }

    /// The key whose model fields name the scope.
    pub fn sample(&self) -> &PhysicalKey {
        &self.sample
    }

    pub fn layout_prefix(&self) -> &str {
        &self.layout_prefix
    }

    /// The tenant that owns every key of the scope.
    pub fn tenant(&self) -> &TenantId {
        self.sample.tenant()
    }

    /// Whether `key` lies in the scope.
    pub fn contains(&self, key: &PhysicalKey) -> bool {
        let (a, b) = (self.sample.identity(), key.identity());
        a.tenant() == b.tenant()
            && a.model_config() == b.model_config()
            && a.model_revision() == b.model_revision()
            && a.trust_domain() == b.trust_domain()
            && a.tokenizer_revision() == b.tokenizer_revision()
            && a.adapter() == b.adapter()
            && b.layout().name.as_str().starts_with(&self.layout_prefix)
    }
}

/// What one purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Blocks removed.
    pub removed: u64,
    /// Blocks of the scope left in place because a reader or writer held them.
    pub busy: u64,
    /// The store listed [`PURGE_BLOCKS_MAX`] keys: more of the scope may remain.
    pub more: bool,
}

/// Removes the committed blocks of `scope` from `store`, at most [`PURGE_BLOCKS_MAX`] of them:
/// the caller needs the write right on the scope's tenant. The store lists the keys
/// ([`Store::scope_keys`]) and removes each as [`Store::invalidate_batch`] would, so a block a
/// reader or writer holds now stays (counted in [`Purged::busy`]). A key that failed to go
/// fails the purge with its error only when nothing was removed.
pub fn purge<S: Store + ?Sized>(
    store: &S,
    caller: &Caller,
    scope: &PurgeScope,
) -> Result<Purged, StoreError> {
    authorize(caller, scope.sample(), Right::Write)?;
    let keys = store.scope_keys(caller, scope, PURGE_BLOCKS_MAX)?;
    let refs: Vec<&PhysicalKey> = keys.iter().take(PURGE_BLOCKS_MAX).collect();
    let mut done = Purged { more: keys.len() >= PURGE_BLOCKS_MAX, ..Purged::default() };
    let mut first_error = None;
    for answer in store.invalidate_batch(caller, &refs) {
        match answer {
            Ok(Invalidate::Removed) => done.removed += 1,
            Ok(Invalidate::Absent) => {}
            Ok(Invalidate::Busy) => done.busy += 1,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if done.removed == 0 => Err(e),
        _ => Ok(done),
    }
}

/// The data-plane store contract. Implementations are shared across threads.
pub trait Store: Send + Sync {
    fn info(&self) -> StoreInfo;

    /// Whether every failed call guarantees it has stopped touching the caller's buffers.
    fn failures_retire(&self) -> bool {
        self.info().failures_retire
    }

    /// The current fencing epoch.
    fn epoch(&self) -> Epoch;

    /// Says whether `key` (or a strict prefix of its chain) is readable. Never returns payload.
    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError>;

    /// Copies the committed block under exactly `key` into the front of `dst` and verifies its
    /// checksum there.
    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError>;

    /// Starts a create-only PUT of `len` bytes.
    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError>;

    /// Writes `src` at `offset` of an open reservation.
    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError>;

    /// Makes a fully written reservation readable. The handle is dead afterwards.
    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError>;

    /// Ends a reservation without committing. `Unknown` quarantines its region.
    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError>;

    /// Removes the committed block under `key`. A durable store answers `Removed` only once
    /// the removal is as durable as its commits are; when it cannot remove the block it answers
    /// an error and the block stays readable (a removal that happened but could not be made
    /// durable is an error too, with [`StorageEffect::NotDurable`]).
    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError>;

    /// Quarantines every reservation whose write lease has run out (never frees it).
    fn expire_leases(&self) -> Result<usize, StoreError>;

    /// Reclaims a quarantined region on the word of its owner tenant or an admin.
    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError>;

    /// Advances the fencing epoch; open reservations from older epochs stop accepting writes.
    fn bump_epoch(&self) -> Result<Epoch, StoreError>;

    /// Reclaims every reservation and quarantined region from epochs before `epoch`, which must
    /// be the current epoch. Returns how many regions came back.
    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError>;

    fn stats(&self) -> StoreStats;

    /// What the store knows of its own ability to serve, for a readiness probe. Cheap: it reads
    /// what the store already tracks (and at most one `statvfs`), never the data path. A store
    /// that tracks nothing answers [`StoreCondition::default`] (nothing known).
    fn condition(&self) -> StoreCondition {
        StoreCondition::default()
    }

    /// Reserve, write and commit in one call; a failed write or commit aborts the reservation
    /// (quarantining it when the failure did not retire).
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        put_reserved(self, caller, key, src.len() as u64, request, |r| {
            self.write(caller, r, 0, src).and_then(|()| self.commit(caller, r))
        })
    }

    /// [`Store::lookup`] for each key, in order.
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        keys.iter().map(|key| self.lookup(caller, key)).collect()
    }

    /// [`Store::get_into`] for each item, into the item's own buffer, in order. A failed item's
    /// buffer is retired or not exactly as its error says; the other items are unaffected.
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        items.iter_mut().map(|item| self.get_into(caller, item.key, item.dst)).collect()
    }

    /// [`Store::put`] for each item, in order. Items are independent: a refused, busy or failed
    /// item leaves the others' answers unchanged (two items under one key behave as two PUTs
    /// in item order: the second answers `AlreadyCommitted`).
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        items.iter().map(|item| self.put(caller, item.key, item.src, item.request)).collect()
    }

    /// [`Store::put_batch`] for items whose bytes must hash to `expected` (one checksum per
    /// item, the writer's own, sent with the bytes): an item whose bytes do not, or that has no
    /// expected checksum, is refused with [`put_damaged`] and nothing is stored or reserved for
    /// it; the other items are answered as `put_batch` answers them. A store that hashes the
    /// bytes as it copies them overrides this to compare before it commits, so the bytes are
    /// hashed once; this default hashes each item before the batch.
    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        put_batch_verified(items, expected, |sound| self.put_batch(caller, sound))
    }

    /// One GET, asking each tier once, that lends the block where the store can and copies it
    /// where it cannot. A store that keeps the block in memory it can lend pins it (at most
    /// `capacity` bytes, as `get_into` with a buffer of that size) and calls [`GetTo::lend`]
    /// with its bytes and committed checksum, holding the pin (not a lock) while it runs, so it
    /// should not wait long. The sender hashes the bytes (it sends them only when they match)
    /// and returns that checksum, or none when it did not hash them; the store checks it, or
    /// hashes the bytes itself when there is none, and a block whose bytes do not match is
    /// dropped and answered as `get_into` answers it. Otherwise the block is read into
    /// [`GetTo::buffer`] as `get_into` reads it. This default copies: `get_into`.
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        let _ = capacity;
        self.get_into(caller, key, to.buffer()).map(GotOne::copied)
    }

    /// [`Store::invalidate`] for each key, in order.
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        keys.iter().map(|key| self.invalidate(caller, key)).collect()
    }

    /// [`Store::lookup_batch`], with the tier that holds each block found. A lookup, not a
    /// read: no eviction policy hears of it. This default, for a store of one tier, names none.
    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        untiered(self.lookup_batch(caller, keys))
    }

    /// Up to `max` keys of committed blocks in `scope` (the caller needs the read right on
    /// the scope's tenant), in no order: what [`purge`] removes. This default, for a store
    /// that keeps no index it can walk, refuses.
    fn scope_keys(
        &self,
        caller: &Caller,
        scope: &PurgeScope,
        max: usize,
    ) -> Result<Vec<PhysicalKey>, StoreError> {
        let _ = (caller, scope, max);
        Err(StoreError::Backend {
            operation: "purge",
            detail: format!("the {} store cannot list the keys of a namespace", self.info().name),
            retirement: Retirement::Retired,
        })
    }
}

/// Lookups of a store of one tier, as [`Store::locate`] answers them.
pub fn untiered(lookups: BatchAnswers<Lookup>) -> BatchAnswers<Located> {
    lookups.into_iter().map(|a| a.map(|lookup| Located { lookup, tier: None })).collect()
}

/// The shape every PUT shares: reserve `len` bytes under `key` (an answer other than a
/// reservation is the PUT's answer), then `fill` and commit the reservation; when that fails,
/// abort it with the error's retirement. Stores that override [`Store::put`] to fill their
/// reservation another way pass that way as `fill`.
pub fn put_reserved<S: Store + ?Sized>(
    store: &S,
    caller: &Caller,
    key: &PhysicalKey,
    len: u64,
    request: Option<RequestId>,
    fill: impl FnOnce(&Reservation) -> Result<Committed, StoreError>,
) -> Result<Put, StoreError> {
    let reservation = match store.reserve(caller, key, len, request)?.into_reservation() {
        Ok(r) => r,
        Err(answer) => return Ok(answer),
    };
    match fill(&reservation) {
        Ok(c) => Ok(Put::Committed(c.checksum)),
        Err(e) => {
            // The reservation may already be gone (fenced, quarantined); the first error is the
            // one the caller needs.
            let _ = store.abort(caller, reservation, e.retirement());
            Err(e)
        }
    }
}

/// The refusal of a PUT whose bytes hash to `computed` where the writer said `expected` (they
/// changed on the way, or while they were copied); nothing was stored.
pub fn put_damaged(computed: Checksum, expected: Option<Checksum>) -> StoreError {
    let detail = match expected {
        Some(e) => format!(
            "the bytes hash to {:016x} but the writer sent {:016x}: they changed on the way or \
             while they were copied; nothing was stored",
            computed.0, e.0
        ),
        None => "no checksum came with the bytes; nothing was stored".into(),
    };
    StoreError::Backend { operation: "put", detail, retirement: Retirement::Retired }
}

/// [`Store::put_batch_checked`] for a store that cannot compare as it copies: hashes each
/// item first, then hands the sound ones to `put` as one batch, and merges the answers back in
/// item order.
pub fn put_batch_verified<'a>(
    items: &[BatchPut<'a>],
    expected: &[Checksum],
    put: impl FnOnce(&[BatchPut<'a>]) -> BatchAnswers<Put>,
) -> BatchAnswers<Put> {
    let checks: Vec<Result<(), StoreError>> = items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let computed = Checksum::of(item.src);
            match expected.get(i) {
                Some(&e) if e == computed => Ok(()),
                e => Err(put_damaged(computed, e.copied())),
            }
        })
        .collect();
    let sound: Vec<BatchPut<'a>> = items
        .iter()
        .zip(&checks)
        .filter(|(_, c)| c.is_ok())
        .map(|(item, _)| BatchPut { key: item.key, src: item.src, request: item.request })
        .collect();
    let mut answers = put(&sound).into_iter();
    checks
        .into_iter()
        .map(|check| match check {
            Err(e) => Err(e),
            Ok(()) => answers.next().unwrap_or_else(|| {
                Err(StoreError::Backend {
                    operation: "put",
                    detail: "the store left this item of the batch unanswered".into(),
                    retirement: Retirement::Unknown,
                })
            }),
        })
        .collect()
}

/// Which byte ranges of a reservation have been written, merged; bounded so that a writer
/// cannot grow it without limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WrittenRanges {
    /// Sorted, disjoint, non-adjacent `[start, end)` ranges.
    ranges: Vec<(u64, u64)>,
}

/// Most disjoint written pieces one reservation may have before a write is refused.
pub const WRITE_PIECES_MAX: usize = 4096;

impl WrittenRanges {
    /// Records `[start, end)`; refuses (changing nothing) when it would exceed
    /// [`WRITE_PIECES_MAX`] disjoint pieces.
    pub fn add(&mut self, start: u64, end: u64) -> Result<(), StoreError> {
        if start >= end {
            return Ok(());
        }
        let mut merged = Vec::with_capacity(self.ranges.len() + 1);
        let (mut s, mut e) = (start, end);
        let mut placed = false;
        for &(a, b) in &self.ranges {
            if b < s {
                merged.push((a, b));
            } else if e < a {
                if !placed {
                    merged.push((s, e));
                    placed = true;
                }
                merged.push((a, b));
            } else {
                s = s.min(a);
                e = e.max(b);
            }
        }
        if !placed {
            merged.push((s, e));
        }
        if merged.len() > WRITE_PIECES_MAX {
            return Err(StoreError::Backend {
                operation: "write",
                detail: format!("more than {WRITE_PIECES_MAX} disjoint pieces"),
                retirement: Retirement::Retired,
            });
        }
        self.ranges = merged;
        Ok(())
    }

    /// Bytes written so far.
    pub fn covered(&self) -> u64 {
        self.ranges.iter().map(|(a, b)| b - a).sum()
    }
}

/// A store that wraps another and changes only some of its calls: a metrics layer, a transport
/// that moves payloads another way, a test hook. A layer names its inner store here and
/// implements [`Store`] itself: it writes the calls it changes, and lists in
/// [`forward_store!`] the calls that go to the inner store unchanged.
///
/// A call it neither writes nor lists keeps the [`Store`] default, which is made of the
/// layer's own calls: `put` is the layer's reserve, write and commit; a batch call is the
/// layer's single-key call per item; `get_one` is the layer's `get_into`. So a layer that
/// changes `get_into` or `reserve` also changes what `get_batch` or `put` does and is never
/// bypassed. A layer that keeps the inner store's answers (a metrics layer, a test hook) lists
/// those calls too, keeping the inner store's own `put`, batch and lending paths.
pub trait StoreLayer: Send + Sync {
    type Inner: Store + ?Sized;

    /// The store this layer wraps.
    fn inner(&self) -> &Self::Inner;
}

/// Writes, inside an `impl Store for` a [`StoreLayer`], each named [`Store`] call as a call of
/// the same name on the layer's inner store: `forward_store!(fences, lookup, stats);`. Every
/// call of the contract can be named, and two groups: `fences` (`epoch`, `expire_leases`,
/// `attest_drained`, `bump_epoch`, `reclaim_fenced`) and `reports` (`stats`, `condition`). The
/// signatures are the trait's, spelled out once here.
#[macro_export]
macro_rules! forward_store {
    ($($call:ident),+ $(,)?) => {
        $($crate::forward_store!(@ $call);)+
    };
    // The fencing calls: the epoch, leases, attestations and fences.
    (@ fences) => {
        $crate::forward_store!(epoch, expire_leases, attest_drained, bump_epoch, reclaim_fenced);
    };
    // What the store reports of itself.
    (@ reports) => {
        $crate::forward_store!(stats, condition);
    };
    (@ info) => {
        fn info(&self) -> $crate::store::StoreInfo {
            $crate::store::StoreLayer::inner(self).info()
        }
    };
    (@ failures_retire) => {
        fn failures_retire(&self) -> bool {
            $crate::store::StoreLayer::inner(self).failures_retire()
        }
    };
    (@ epoch) => {
        fn epoch(&self) -> $crate::Epoch {
            $crate::store::StoreLayer::inner(self).epoch()
        }
    };
    (@ lookup) => {
        fn lookup(
            &self,
            caller: &$crate::Caller,
            key: &$crate::PhysicalKey,
        ) -> Result<$crate::store::Lookup, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).lookup(caller, key)
        }
    };
    (@ get_into) => {
        fn get_into(
            &self,
            caller: &$crate::Caller,
            key: &$crate::PhysicalKey,
            dst: &mut [u8],
        ) -> Result<$crate::store::Get, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).get_into(caller, key, dst)
        }
    };
    (@ reserve) => {
        fn reserve(
            &self,
            caller: &$crate::Caller,
            key: &$crate::PhysicalKey,
            len: u64,
            request: Option<$crate::RequestId>,
        ) -> Result<$crate::store::Reserve, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).reserve(caller, key, len, request)
        }
    };
    (@ write) => {
        fn write(
            &self,
            caller: &$crate::Caller,
            r: &$crate::store::Reservation,
            offset: u64,
            src: &[u8],
        ) -> Result<(), $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).write(caller, r, offset, src)
        }
    };
    (@ commit) => {
        fn commit(
            &self,
            caller: &$crate::Caller,
            r: &$crate::store::Reservation,
        ) -> Result<$crate::store::Committed, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).commit(caller, r)
        }
    };
    (@ abort) => {
        fn abort(
            &self,
            caller: &$crate::Caller,
            r: $crate::store::Reservation,
            outcome: $crate::store::Retirement,
        ) -> Result<$crate::store::Abort, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).abort(caller, r, outcome)
        }
    };
    (@ invalidate) => {
        fn invalidate(
            &self,
            caller: &$crate::Caller,
            key: &$crate::PhysicalKey,
        ) -> Result<$crate::store::Invalidate, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).invalidate(caller, key)
        }
    };
    (@ expire_leases) => {
        fn expire_leases(&self) -> Result<usize, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).expire_leases()
        }
    };
    (@ attest_drained) => {
        fn attest_drained(
            &self,
            caller: &$crate::Caller,
            region: $crate::RegionId,
        ) -> Result<$crate::store::Reclaimed, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).attest_drained(caller, region)
        }
    };
    (@ bump_epoch) => {
        fn bump_epoch(&self) -> Result<$crate::Epoch, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).bump_epoch()
        }
    };
    (@ reclaim_fenced) => {
        fn reclaim_fenced(&self, epoch: $crate::Epoch) -> Result<usize, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).reclaim_fenced(epoch)
        }
    };
    (@ stats) => {
        fn stats(&self) -> $crate::store::StoreStats {
            $crate::store::StoreLayer::inner(self).stats()
        }
    };
    (@ condition) => {
        fn condition(&self) -> $crate::store::StoreCondition {
            $crate::store::StoreLayer::inner(self).condition()
        }
    };
    (@ put) => {
        fn put(
            &self,
            caller: &$crate::Caller,
            key: &$crate::PhysicalKey,
            src: &[u8],
            request: Option<$crate::RequestId>,
        ) -> Result<$crate::store::Put, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).put(caller, key, src, request)
        }
    };
    (@ lookup_batch) => {
        fn lookup_batch(
            &self,
            caller: &$crate::Caller,
            keys: &[&$crate::PhysicalKey],
        ) -> $crate::store::BatchAnswers<$crate::store::Lookup> {
            $crate::store::StoreLayer::inner(self).lookup_batch(caller, keys)
        }
    };
    (@ get_batch) => {
        fn get_batch(
            &self,
            caller: &$crate::Caller,
            items: &mut [$crate::store::BatchGet<'_>],
        ) -> $crate::store::BatchAnswers<$crate::store::Get> {
            $crate::store::StoreLayer::inner(self).get_batch(caller, items)
        }
    };
    (@ put_batch) => {
        fn put_batch(
            &self,
            caller: &$crate::Caller,
            items: &[$crate::store::BatchPut<'_>],
        ) -> $crate::store::BatchAnswers<$crate::store::Put> {
            $crate::store::StoreLayer::inner(self).put_batch(caller, items)
        }
    };
    (@ put_batch_checked) => {
        fn put_batch_checked(
            &self,
            caller: &$crate::Caller,
            items: &[$crate::store::BatchPut<'_>],
            expected: &[$crate::Checksum],
        ) -> $crate::store::BatchAnswers<$crate::store::Put> {
            $crate::store::StoreLayer::inner(self).put_batch_checked(caller, items, expected)
        }
    };
    (@ get_one) => {
        fn get_one(
            &self,
            caller: &$crate::Caller,
            key: &$crate::PhysicalKey,
            capacity: usize,
            to: &mut dyn $crate::store::GetTo,
        ) -> Result<$crate::store::GotOne, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).get_one(caller, key, capacity, to)
        }
    };
    (@ invalidate_batch) => {
        fn invalidate_batch(
            &self,
            caller: &$crate::Caller,
            keys: &[&$crate::PhysicalKey],
        ) -> $crate::store::BatchAnswers<$crate::store::Invalidate> {
            $crate::store::StoreLayer::inner(self).invalidate_batch(caller, keys)
        }
    };
    (@ locate) => {
        fn locate(
            &self,
            caller: &$crate::Caller,
            keys: &[&$crate::PhysicalKey],
        ) -> $crate::store::BatchAnswers<$crate::store::Located> {
            $crate::store::StoreLayer::inner(self).locate(caller, keys)
        }
    };
    (@ scope_keys) => {
        fn scope_keys(
            &self,
            caller: &$crate::Caller,
            scope: &$crate::store::PurgeScope,
            max: usize,
        ) -> Result<Vec<$crate::PhysicalKey>, $crate::store::StoreError> {
            $crate::store::StoreLayer::inner(self).scope_keys(caller, scope, max)
        }
    };
}

/// A shared store is its inner store: servers, executors and tests hold stores behind `Arc`.
impl<S: Store + ?Sized> StoreLayer for std::sync::Arc<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        self
    }
}

/// Every call, the batch and lending calls included, is the inner store's.
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    crate::forward_store!(
        fences,
        reports,
        info,
        failures_retire,
        lookup,
        get_into,
        reserve,
        write,
        commit,
        abort,
        invalidate,
        put,
        lookup_batch,
        get_batch,
        put_batch,
        put_batch_checked,
        get_one,
        invalidate_batch,
        locate,
        scope_keys
    );
}
