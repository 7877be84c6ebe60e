//! Encodings of the store's values and errors, and of [`WireError`].
//!
//! Every enum is a one-byte tag (numbered from 0 in declaration order) followed by its fields
//! in declaration order; `docs/PROTOCOL.md` lists them. The dataplane's error enums are
//! `#[non_exhaustive]`: a variant this build does not know (a newer dataplane) is sent as a
//! `StoreError::Backend` with operation `"remote"`, its message as detail, and the original
//! error's retirement, so the retirement contract survives even then. An unknown `Refusal` is
//! sent the same way with operation `"admission"` and `Retirement::Retired` (a refusal touched
//! nothing).

use gpucache_dataplane::caller::Right;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::lifecycle::{BlockState, IllegalTransition};
use gpucache_dataplane::limits::{Refusal, ReplayConflict, RequestId, Usage};
use gpucache_dataplane::registry::{Epoch, EpochError, RegionCounts, RegionId, RegistryError};
use gpucache_dataplane::shard::{FenceRefusal, NotAdmitting};
use gpucache_dataplane::store::{
    Abort, CorruptDrops, CorruptPhase, CorruptReason, FullPolicy, Implementation, Invalidate,
    Located, Lookup, MissReason, Put, Reclaimed, Reservation, Reserve, Retirement, StorageEffect,
    StoreError, StoreStats, Tier,
};

use super::codec::{Reader, Writer, wide};
use super::error::{AuthFailure, InflightScope};
use super::text::{self, REMOTE_DETAIL, REMOTE_TEXT};
use super::{Kind, WireError};
use crate::staging::StagingFailure;

/// A value this build cannot put on the wire as itself (an unknown variant of a
/// `#[non_exhaustive]` dataplane enum); carries its message.
pub(super) struct Unrepresentable(String);

type Encoded = Result<(), Unrepresentable>;

// ---------------------------------------------------------------------------------------------
// Small enums

pub(super) fn put_right(w: &mut Writer<'_>, r: Right) {
    w.u8(match r {
        Right::Read => 0,
        Right::Write => 1,
        Right::Admin => 2,
    });
}

pub(super) fn get_right(r: &mut Reader<'_>) -> Result<Right, WireError> {
    match r.u8(text::RIGHT)? {
        0 => Ok(Right::Read),
        1 => Ok(Right::Write),
        2 => Ok(Right::Admin),
        tag => Err(WireError::UnknownTag { what: text::RIGHT, tag }),
    }
}

pub(super) fn put_retirement(w: &mut Writer<'_>, r: Retirement) {
    w.u8(match r {
        Retirement::Retired => 0,
        Retirement::Unknown => 1,
    });
}

pub(super) fn get_retirement(r: &mut Reader<'_>) -> Result<Retirement, WireError> {
    match r.u8(text::RETIREMENT)? {
        0 => Ok(Retirement::Retired),
        1 => Ok(Retirement::Unknown),
        tag => Err(WireError::UnknownTag { what: text::RETIREMENT, tag }),
    }
}

const BLOCK_STATES: [BlockState; 6] = [
    BlockState::Absent,
    BlockState::Reserved,
    BlockState::Writing,
    BlockState::Committed,
    BlockState::Evicting,
    BlockState::Quarantined,
];

fn put_block_state(w: &mut Writer<'_>, s: BlockState) {
    w.u8(match s {
        BlockState::Absent => 0,
        BlockState::Reserved => 1,
        BlockState::Writing => 2,
        BlockState::Committed => 3,
        BlockState::Evicting => 4,
        BlockState::Quarantined => 5,
    });
}

fn get_block_state(r: &mut Reader<'_>) -> Result<BlockState, WireError> {
    let tag = r.u8(text::BLOCK_STATE)?;
    BLOCK_STATES
        .get(usize::from(tag))
        .copied()
        .ok_or(WireError::UnknownTag { what: text::BLOCK_STATE, tag })
}

pub(super) fn put_miss(w: &mut Writer<'_>, m: MissReason) {
    match m {
        MissReason::Absent => w.u8(0),
        MissReason::Incompatible => w.u8(1),
        MissReason::NotReadable(state) => {
            w.u8(2);
            put_block_state(w, state);
        }
        MissReason::Corrupt => w.u8(3),
    }
}

pub(super) fn get_miss(r: &mut Reader<'_>) -> Result<MissReason, WireError> {
    match r.u8(text::MISS_REASON)? {
        0 => Ok(MissReason::Absent),
        1 => Ok(MissReason::Incompatible),
        2 => Ok(MissReason::NotReadable(get_block_state(r)?)),
        3 => Ok(MissReason::Corrupt),
        tag => Err(WireError::UnknownTag { what: text::MISS_REASON, tag }),
    }
}

pub(super) fn put_request_id(w: &mut Writer<'_>, id: Option<RequestId>) {
    w.option_u64(id.map(|r| r.0));
}

pub(super) fn get_request_id(r: &mut Reader<'_>) -> Result<Option<RequestId>, WireError> {
    Ok(r.option_u64(text::INTEGER)?.map(RequestId))
}

// ---------------------------------------------------------------------------------------------
// Answers

pub(super) fn put_lookup(w: &mut Writer<'_>, l: &Lookup) -> Encoded {
    match l {
        Lookup::Hit { len } => {
            w.u8(0);
            w.u64(*len);
        }
        Lookup::PrefixHit { key, len } => {
            w.u8(1);
            w.key(key);
            w.u64(*len);
        }
        Lookup::Miss(m) => {
            w.u8(2);
            put_miss(w, *m);
        }
    }
    Ok(())
}

pub(super) fn get_lookup(r: &mut Reader<'_>, index: usize) -> Result<Lookup, WireError> {
    match r.u8(text::LOOKUP)? {
        0 => Ok(Lookup::Hit { len: r.u64(text::INTEGER)? }),
        1 => {
            let key = Box::new(r.key(index)?);
            Ok(Lookup::PrefixHit { key, len: r.u64(text::INTEGER)? })
        }
        2 => Ok(Lookup::Miss(get_miss(r)?)),
        tag => Err(WireError::UnknownTag { what: text::LOOKUP, tag }),
    }
}

/// A [`Located`]: its lookup, then the tier (0 none, 1 memory, 2 file, 3 cold).
pub(super) fn put_located(w: &mut Writer<'_>, l: &Located) -> Encoded {
    put_lookup(w, &l.lookup)?;
    w.u8(match l.tier {
        None => 0,
        Some(Tier::Memory) => 1,
        Some(Tier::File) => 2,
        Some(Tier::Cold) => 3,
    });
    Ok(())
}

pub(super) fn get_located(r: &mut Reader<'_>, index: usize) -> Result<Located, WireError> {
    let lookup = get_lookup(r, index)?;
    let tier = match r.u8(text::TIER)? {
        0 => None,
        1 => Some(Tier::Memory),
        2 => Some(Tier::File),
        3 => Some(Tier::Cold),
        tag => return Err(WireError::UnknownTag { what: text::TIER, tag }),
    };
    if tier.is_some() && matches!(lookup, Lookup::Miss(_)) {
        return Err(WireError::Malformed { what: text::TIER });
    }
    Ok(Located { lookup, tier })
}

pub(super) fn put_reservation(w: &mut Writer<'_>, res: &Reservation) {
    w.u64(res.region.0);
    w.u64(res.epoch.0);
    w.u64(res.len);
    put_request_id(w, res.request);
}

pub(super) fn get_reservation(r: &mut Reader<'_>) -> Result<Reservation, WireError> {
    Ok(Reservation {
        region: RegionId(r.u64(text::INTEGER)?),
        epoch: Epoch(r.u64(text::INTEGER)?),
        len: r.u64(text::INTEGER)?,
        request: get_request_id(r)?,
    })
}

pub(super) fn put_put(w: &mut Writer<'_>, p: &Put) -> Encoded {
    match p {
        Put::Committed(c) => {
            w.u8(0);
            w.u64(c.0);
        }
        Put::AlreadyCommitted => w.u8(1),
        Put::Busy => w.u8(2),
        Put::Refused(refusal) => {
            w.u8(3);
            put_refusal(w, refusal)?;
        }
    }
    Ok(())
}

pub(super) fn get_put(r: &mut Reader<'_>) -> Result<Put, WireError> {
    match r.u8(text::PUT)? {
        0 => Ok(Put::Committed(Checksum(r.u64(text::INTEGER)?))),
        1 => Ok(Put::AlreadyCommitted),
        2 => Ok(Put::Busy),
        3 => Ok(Put::Refused(get_refusal(r)?)),
        tag => Err(WireError::UnknownTag { what: text::PUT, tag }),
    }
}

pub(super) fn put_reserve(w: &mut Writer<'_>, res: &Reserve) -> Encoded {
    match res {
        Reserve::Reserved(reservation) => {
            w.u8(0);
            put_reservation(w, reservation);
        }
        Reserve::AlreadyCommitted => w.u8(1),
        Reserve::Busy => w.u8(2),
        Reserve::Refused(refusal) => {
            w.u8(3);
            put_refusal(w, refusal)?;
        }
    }
    Ok(())
}

pub(super) fn get_reserve(r: &mut Reader<'_>) -> Result<Reserve, WireError> {
    match r.u8(text::RESERVE)? {
        0 => Ok(Reserve::Reserved(get_reservation(r)?)),
        1 => Ok(Reserve::AlreadyCommitted),
        2 => Ok(Reserve::Busy),
        3 => Ok(Reserve::Refused(get_refusal(r)?)),
        tag => Err(WireError::UnknownTag { what: text::RESERVE, tag }),
    }
}

pub(super) fn put_invalidate(w: &mut Writer<'_>, i: &Invalidate) -> Encoded {
    w.u8(match i {
        Invalidate::Removed => 0,
        Invalidate::Absent => 1,
        Invalidate::Busy => 2,
    });
    Ok(())
}

pub(super) fn get_invalidate(r: &mut Reader<'_>) -> Result<Invalidate, WireError> {
    match r.u8(text::INVALIDATE)? {
        0 => Ok(Invalidate::Removed),
        1 => Ok(Invalidate::Absent),
        2 => Ok(Invalidate::Busy),
        tag => Err(WireError::UnknownTag { what: text::INVALIDATE, tag }),
    }
}

pub(super) fn put_abort(w: &mut Writer<'_>, a: &Abort) -> Encoded {
    w.u8(match a {
        Abort::Released => 0,
        Abort::Quarantined => 1,
    });
    Ok(())
}

pub(super) fn get_abort(r: &mut Reader<'_>) -> Result<Abort, WireError> {
    match r.u8(text::ABORT)? {
        0 => Ok(Abort::Released),
        1 => Ok(Abort::Quarantined),
        tag => Err(WireError::UnknownTag { what: text::ABORT, tag }),
    }
}

pub(super) fn put_implementation(w: &mut Writer<'_>, i: Implementation) {
    match i {
        Implementation::Real => w.u8(0),
        Implementation::Simulated { seed } => {
            w.u8(1);
            w.u64(seed);
        }
    }
}

pub(super) fn get_implementation(r: &mut Reader<'_>) -> Result<Implementation, WireError> {
    match r.u8(text::IMPLEMENTATION)? {
        0 => Ok(Implementation::Real),
        1 => Ok(Implementation::Simulated { seed: r.u64(text::INTEGER)? }),
        tag => Err(WireError::UnknownTag { what: text::IMPLEMENTATION, tag }),
    }
}

pub(super) fn put_full_policy(w: &mut Writer<'_>, p: FullPolicy) {
    w.u8(match p {
        FullPolicy::Refuse => 0,
        FullPolicy::EvictOldest => 1,
        FullPolicy::Evict => 2,
    });
}

pub(super) fn get_full_policy(r: &mut Reader<'_>) -> Result<FullPolicy, WireError> {
    match r.u8(text::FULL_POLICY)? {
        0 => Ok(FullPolicy::Refuse),
        1 => Ok(FullPolicy::EvictOldest),
        2 => Ok(FullPolicy::Evict),
        tag => Err(WireError::UnknownTag { what: text::FULL_POLICY, tag }),
    }
}

pub(super) fn put_stats(w: &mut Writer<'_>, s: &StoreStats) {
    let Usage { inflight_requests, registrations, retained_bytes, tenants } = s.usage;
    w.u32(inflight_requests);
    w.u32(registrations);
    w.u64(retained_bytes);
    w.u32(tenants);
    let RegionCounts { lent, held, quarantined, quarantined_bytes } = s.regions;
    w.u64(wide(lent));
    w.u64(wide(held));
    w.u64(wide(quarantined));
    w.u64(quarantined_bytes);
    w.u64(s.committed_blocks);
    put_corrupt_drops(w, &s.corrupt_dropped);
    w.u64(s.evictions);
}

/// `u8` n, then n × (`phase: u8`, `reason: u8`, `count: u64`): the nonzero counts, each pair at
/// most once.
fn put_corrupt_drops(w: &mut Writer<'_>, drops: &CorruptDrops) {
    let nonzero: Vec<_> = drops.iter().filter(|(_, _, n)| *n > 0).collect();
    w.u8(u8::try_from(nonzero.len()).unwrap_or(u8::MAX));
    for (phase, reason, n) in nonzero {
        w.u8(corrupt_phase_tag(phase));
        w.u8(corrupt_reason_tag(reason));
        w.u64(n);
    }
}

fn corrupt_phase_tag(p: CorruptPhase) -> u8 {
    match p {
        CorruptPhase::Open => 0,
        CorruptPhase::Get => 1,
    }
}

fn corrupt_reason_tag(r: CorruptReason) -> u8 {
    match r {
        CorruptReason::Header => 0,
        CorruptReason::Truncated => 1,
        CorruptReason::Checksum => 2,
        CorruptReason::Identity => 3,
        CorruptReason::Missing => 4,
        CorruptReason::Unreadable => 5,
        CorruptReason::Foreign => 6,
    }
}

fn get_corrupt_drops(r: &mut Reader<'_>) -> Result<CorruptDrops, WireError> {
    let pairs = CorruptPhase::ALL.len() * CorruptReason::ALL.len();
    let n = r.u8(text::CORRUPT_DROPS)?;
    if usize::from(n) > pairs {
        return Err(WireError::TooMany {
            what: text::CORRUPT_DROPS,
            count: n.into(),
            max: wide(pairs),
        });
    }
    let mut drops = CorruptDrops::default();
    for _ in 0..n {
        let tag = r.u8(text::CORRUPT_PHASE)?;
        let phase = CorruptPhase::ALL
            .into_iter()
            .find(|p| corrupt_phase_tag(*p) == tag)
            .ok_or(WireError::UnknownTag { what: text::CORRUPT_PHASE, tag })?;
        let tag = r.u8(text::CORRUPT_REASON)?;
        let reason = CorruptReason::ALL
            .into_iter()
            .find(|x| corrupt_reason_tag(*x) == tag)
            .ok_or(WireError::UnknownTag { what: text::CORRUPT_REASON, tag })?;
        let count = r.u64(text::INTEGER)?;
        if count == 0 || drops.get(phase, reason) != 0 {
            return Err(WireError::Malformed { what: text::CORRUPT_DROPS });
        }
        drops.add(phase, reason, count);
    }
    Ok(drops)
}

fn get_region_count(r: &mut Reader<'_>) -> Result<usize, WireError> {
    usize::try_from(r.u64(text::REGION_COUNT)?)
        .map_err(|_| WireError::Malformed { what: text::REGION_COUNT })
}

pub(super) fn get_stats(r: &mut Reader<'_>) -> Result<StoreStats, WireError> {
    let usage = Usage {
        inflight_requests: r.u32(text::INTEGER)?,
        registrations: r.u32(text::INTEGER)?,
        retained_bytes: r.u64(text::INTEGER)?,
        tenants: r.u32(text::INTEGER)?,
    };
    let regions = RegionCounts {
        lent: get_region_count(r)?,
        held: get_region_count(r)?,
        quarantined: get_region_count(r)?,
        quarantined_bytes: r.u64(text::INTEGER)?,
    };
    Ok(StoreStats {
        usage,
        regions,
        committed_blocks: r.u64(text::INTEGER)?,
        corrupt_dropped: get_corrupt_drops(r)?,
        evictions: r.u64(text::INTEGER)?,
    })
}

pub(super) fn put_reclaimed(w: &mut Writer<'_>, rec: &Reclaimed) -> Encoded {
    w.u64(rec.region.0);
    w.u64(rec.bytes);
    Ok(())
}

pub(super) fn get_reclaimed(r: &mut Reader<'_>) -> Result<Reclaimed, WireError> {
    Ok(Reclaimed { region: RegionId(r.u64(text::INTEGER)?), bytes: r.u64(text::INTEGER)? })
}

// ---------------------------------------------------------------------------------------------
// Results

/// `0` then the value, or `1` then the error. A value that cannot be sent as itself becomes an
/// `Err(Backend { operation: "admission", .. })` that keeps `Retirement::Retired`.
pub(super) fn put_result<T>(
    w: &mut Writer<'_>,
    result: &Result<T, StoreError>,
    ok: impl FnOnce(&mut Writer<'_>, &T) -> Encoded,
) {
    let mark = w.mark();
    match result {
        Ok(value) => {
            w.u8(0);
            if let Err(Unrepresentable(detail)) = ok(w, value) {
                w.rewind(mark);
                w.u8(1);
                put_backend(w, "admission", &detail, Retirement::Retired);
            }
        }
        Err(e) => {
            w.u8(1);
            put_store_error(w, e);
        }
    }
}

pub(super) fn get_result<T>(
    r: &mut Reader<'_>,
    ok: impl FnOnce(&mut Reader<'_>) -> Result<T, WireError>,
) -> Result<Result<T, StoreError>, WireError> {
    match r.u8(text::RESULT)? {
        0 => ok(r).map(Ok),
        1 => get_store_error(r).map(Err),
        tag => Err(WireError::UnknownTag { what: text::RESULT, tag }),
    }
}

// ---------------------------------------------------------------------------------------------
// Refusal

pub(super) fn put_refusal(w: &mut Writer<'_>, refusal: &Refusal) -> Encoded {
    match refusal {
        Refusal::ObjectTooLarge { bytes, max } => {
            w.u8(0);
            w.u64(*bytes);
            w.u64(*max);
        }
        Refusal::InflightRequests { current, max } => {
            w.u8(1);
            w.u32(*current);
            w.u32(*max);
        }
        Refusal::Registrations { current, max } => {
            w.u8(2);
            w.u32(*current);
            w.u32(*max);
        }
        Refusal::Tenants { current, max } => {
            w.u8(3);
            w.u32(*current);
            w.u32(*max);
        }
        Refusal::RetainedBytes { current, requested, max } => {
            w.u8(4);
            w.u64(*current);
            w.u64(*requested);
            w.u64(*max);
        }
        Refusal::TenantRetainedBytes { tenant, current, requested, max } => {
            w.u8(5);
            w.tenant(tenant);
            w.u64(*current);
            w.u64(*requested);
            w.u64(*max);
        }
        Refusal::TenantInflightBytes { tenant, current, requested, max } => {
            w.u8(6);
            w.tenant(tenant);
            w.u64(*current);
            w.u64(*requested);
            w.u64(*max);
        }
        Refusal::IdempotencyTable { entries, max } => {
            w.u8(7);
            w.u32(*entries);
            w.u32(*max);
        }
        Refusal::DiskFull { free_bytes, requested } => {
            w.u8(8);
            w.u64(*free_bytes);
            w.u64(*requested);
        }
        other => return Err(Unrepresentable(other.to_string())),
    }
    Ok(())
}

pub(super) fn get_refusal(r: &mut Reader<'_>) -> Result<Refusal, WireError> {
    const N: &str = text::INTEGER;
    Ok(match r.u8(text::REFUSAL)? {
        0 => Refusal::ObjectTooLarge { bytes: r.u64(N)?, max: r.u64(N)? },
        1 => Refusal::InflightRequests { current: r.u32(N)?, max: r.u32(N)? },
        2 => Refusal::Registrations { current: r.u32(N)?, max: r.u32(N)? },
        3 => Refusal::Tenants { current: r.u32(N)?, max: r.u32(N)? },
        4 => Refusal::RetainedBytes { current: r.u64(N)?, requested: r.u64(N)?, max: r.u64(N)? },
        5 => Refusal::TenantRetainedBytes {
            tenant: r.tenant()?,
            current: r.u64(N)?,
            requested: r.u64(N)?,
            max: r.u64(N)?,
        },
        6 => Refusal::TenantInflightBytes {
            tenant: r.tenant()?,
            current: r.u64(N)?,
            requested: r.u64(N)?,
            max: r.u64(N)?,
        },
        7 => Refusal::IdempotencyTable { entries: r.u32(N)?, max: r.u32(N)? },
        8 => Refusal::DiskFull { free_bytes: r.u64(N)?, requested: r.u64(N)? },
        tag => return Err(WireError::UnknownTag { what: text::REFUSAL, tag }),
    })
}

// ---------------------------------------------------------------------------------------------
// StoreError and what it nests

fn put_backend(w: &mut Writer<'_>, operation: &str, detail: &str, retirement: Retirement) {
    w.u8(11);
    w.text(operation);
    w.text(detail);
    put_retirement(w, retirement);
}

/// Writes `e`; an error this build cannot send as itself goes as a `Backend` error with the
/// same message and retirement.
pub(super) fn put_store_error(w: &mut Writer<'_>, e: &StoreError) {
    let mark = w.mark();
    if put_store_error_exact(w, e).is_err() {
        w.rewind(mark);
        put_backend(w, REMOTE_TEXT, &e.to_string(), e.retirement());
    }
}

fn put_store_error_exact(w: &mut Writer<'_>, e: &StoreError) -> Encoded {
    match e {
        StoreError::WrongTenant { caller, owner } => {
            w.u8(0);
            w.tenant(caller);
            w.tenant(owner);
        }
        StoreError::Forbidden { tenant, right } => {
            w.u8(1);
            w.tenant(tenant);
            put_right(w, *right);
        }
        StoreError::EmptyObject => w.u8(2),
        StoreError::UnknownReservation { region } => {
            w.u8(3);
            w.u64(region.0);
        }
        StoreError::ReservationQuarantined { region } => {
            w.u8(4);
            w.u64(region.0);
        }
        StoreError::WriteOutOfBounds { offset, len, capacity } => {
            w.u8(5);
            w.u64(*offset);
            w.u64(*len);
            w.u64(*capacity);
        }
        StoreError::Incomplete { written, expected } => {
            w.u8(6);
            w.u64(*written);
            w.u64(*expected);
        }
        StoreError::BufferTooSmall { needed, provided } => {
            w.u8(7);
            w.u64(*needed);
            w.u64(*provided);
        }
        StoreError::Replay(ReplayConflict { tenant, request }) => {
            w.u8(8);
            w.tenant(tenant);
            w.u64(request.0);
        }
        StoreError::Registry(registry) => {
            w.u8(9);
            put_registry_error(w, registry)?;
        }
        StoreError::Lifecycle(IllegalTransition { region, from, transition, detail }) => {
            w.u8(10);
            w.u64(region.0);
            put_block_state(w, *from);
            w.text(transition);
            w.text(detail);
        }
        StoreError::Backend { operation, detail, retirement } => {
            put_backend(w, operation, detail, *retirement);
        }
        StoreError::Storage { operation, step, path, kind, detail, effect, retirement } => {
            w.u8(12);
            w.text(operation);
            w.text(step);
            w.text(&path.to_string_lossy());
            w.u8(io_kind_tag(*kind));
            w.text(detail);
            w.u8(match effect {
                StorageEffect::Unchanged => 0,
                StorageEffect::NotDurable => 1,
            });
            put_retirement(w, *retirement);
        }
        StoreError::Io { operation, kind, detail, retirement } => {
            w.u8(13);
            w.text(operation);
            w.u8(io_kind_tag(*kind));
            w.text(detail);
            put_retirement(w, *retirement);
        }
        StoreError::Fenced(refusal) => {
            w.u8(14);
            put_fence_refusal(w, refusal);
        }
        other => return Err(Unrepresentable(other.to_string())),
    }
    Ok(())
}

/// The `std::io::ErrorKind`s a storage or I/O error carries by tag (its index here); any other
/// kind travels as `Other` (tag 0), its message still in the error's detail. New kinds are only
/// ever appended, so a tag keeps its meaning.
pub(super) const IO_KINDS: &[std::io::ErrorKind] = {
    use std::io::ErrorKind as K;
    &[
        K::Other,
        K::NotFound,
        K::PermissionDenied,
        K::ReadOnlyFilesystem,
        K::StorageFull,
        K::QuotaExceeded,
        K::FileTooLarge,
        K::ResourceBusy,
        K::TimedOut,
        K::Interrupted,
        K::UnexpectedEof,
        K::WriteZero,
        K::InvalidInput,
        K::InvalidData,
        K::AlreadyExists,
        K::NotADirectory,
        K::IsADirectory,
        K::DirectoryNotEmpty,
        K::CrossesDevices,
        K::TooManyLinks,
        K::InvalidFilename,
        K::StaleNetworkFileHandle,
        K::Unsupported,
        K::OutOfMemory,
        K::ConnectionRefused,
        K::ConnectionReset,
        K::ConnectionAborted,
        K::NotConnected,
        K::BrokenPipe,
        K::AddrInUse,
        K::AddrNotAvailable,
        K::HostUnreachable,
        K::NetworkUnreachable,
        K::NetworkDown,
        K::WouldBlock,
    ]
};

fn io_kind_tag(kind: std::io::ErrorKind) -> u8 {
    IO_KINDS.iter().position(|k| *k == kind).and_then(|i| u8::try_from(i).ok()).unwrap_or(0)
}

fn get_io_kind(r: &mut Reader<'_>) -> Result<std::io::ErrorKind, WireError> {
    let tag = r.u8(text::IO_KIND)?;
    IO_KINDS
        .get(usize::from(tag))
        .copied()
        .ok_or(WireError::UnknownTag { what: text::IO_KIND, tag })
}

fn put_registry_error(w: &mut Writer<'_>, e: &RegistryError) -> Encoded {
    match e {
        RegistryError::Full { regions, max } => {
            w.u8(0);
            w.u64(wide(*regions));
            w.u64(wide(*max));
        }
        RegistryError::Unknown(region) => {
            w.u8(1);
            w.u64(region.0);
        }
        RegistryError::WrongState { region, state, operation } => {
            w.u8(2);
            w.u64(region.0);
            w.text(state);
            w.text(operation);
        }
        RegistryError::NotAuthorized { region, caller, owner } => {
            w.u8(3);
            w.u64(region.0);
            w.tenant(caller);
            w.tenant(owner);
        }
        RegistryError::StaleEpoch { given, current } => {
            w.u8(4);
            w.u64(given.0);
            w.u64(current.0);
        }
        RegistryError::Epoch(epoch) => {
            w.u8(5);
            match epoch {
                EpochError::Unavailable { detail } => {
                    w.u8(0);
                    w.text(detail);
                }
                EpochError::Exhausted { at } => {
                    w.u8(1);
                    w.u64(at.0);
                }
                other => return Err(Unrepresentable(other.to_string())),
            }
        }
        RegistryError::IdsExhausted => w.u8(6),
        other => return Err(Unrepresentable(other.to_string())),
    }
    Ok(())
}

fn get_size(r: &mut Reader<'_>) -> Result<usize, WireError> {
    usize::try_from(r.u64(text::INTEGER)?)
        .map_err(|_| WireError::Malformed { what: text::REGION_COUNT })
}

pub(super) fn get_store_error(r: &mut Reader<'_>) -> Result<StoreError, WireError> {
    const N: &str = text::INTEGER;
    Ok(match r.u8(text::STORE_ERROR)? {
        0 => StoreError::WrongTenant { caller: r.tenant()?, owner: r.tenant()? },
        1 => StoreError::Forbidden { tenant: r.tenant()?, right: get_right(r)? },
        2 => StoreError::EmptyObject,
        3 => StoreError::UnknownReservation { region: RegionId(r.u64(N)?) },
        4 => StoreError::ReservationQuarantined { region: RegionId(r.u64(N)?) },
        5 => {
            StoreError::WriteOutOfBounds { offset: r.u64(N)?, len: r.u64(N)?, capacity: r.u64(N)? }
        }
        6 => StoreError::Incomplete { written: r.u64(N)?, expected: r.u64(N)? },
        7 => StoreError::BufferTooSmall { needed: r.u64(N)?, provided: r.u64(N)? },
        8 => StoreError::Replay(ReplayConflict {
            tenant: r.tenant()?,
            request: RequestId(r.u64(N)?),
        }),
        9 => StoreError::Registry(get_registry_error(r)?),
        10 => StoreError::Lifecycle(IllegalTransition {
            region: RegionId(r.u64(N)?),
            from: get_block_state(r)?,
            transition: r.static_text(text::TEXT, REMOTE_TEXT)?,
            detail: r.static_text(text::TEXT, REMOTE_DETAIL)?,
        }),
        11 => StoreError::Backend {
            operation: r.static_text(text::TEXT, REMOTE_TEXT)?,
            detail: r.text(text::TEXT)?,
            retirement: get_retirement(r)?,
        },
        12 => StoreError::Storage {
            operation: r.static_text(text::TEXT, REMOTE_TEXT)?,
            step: r.static_text(text::TEXT, REMOTE_TEXT)?,
            path: r.text(text::TEXT)?.into(),
            kind: get_io_kind(r)?,
            detail: r.text(text::TEXT)?,
            effect: match r.u8(text::STORAGE_EFFECT)? {
                0 => StorageEffect::Unchanged,
                1 => StorageEffect::NotDurable,
                tag => return Err(WireError::UnknownTag { what: text::STORAGE_EFFECT, tag }),
            },
            retirement: get_retirement(r)?,
        },
        13 => StoreError::Io {
            operation: r.static_text(text::TEXT, REMOTE_TEXT)?,
            kind: get_io_kind(r)?,
            detail: r.text(text::TEXT)?,
            retirement: get_retirement(r)?,
        },
        14 => StoreError::Fenced(get_fence_refusal(r)?),
        tag => return Err(WireError::UnknownTag { what: text::STORE_ERROR, tag }),
    })
}

fn get_registry_error(r: &mut Reader<'_>) -> Result<RegistryError, WireError> {
    const N: &str = text::INTEGER;
    Ok(match r.u8(text::REGISTRY_ERROR)? {
        0 => RegistryError::Full { regions: get_size(r)?, max: get_size(r)? },
        1 => RegistryError::Unknown(RegionId(r.u64(N)?)),
        2 => RegistryError::WrongState {
            region: RegionId(r.u64(N)?),
            state: r.static_text(text::TEXT, REMOTE_TEXT)?,
            operation: r.static_text(text::TEXT, REMOTE_TEXT)?,
        },
        3 => RegistryError::NotAuthorized {
            region: RegionId(r.u64(N)?),
            caller: r.tenant()?,
            owner: r.tenant()?,
        },
        4 => RegistryError::StaleEpoch { given: Epoch(r.u64(N)?), current: Epoch(r.u64(N)?) },
        5 => RegistryError::Epoch(match r.u8(text::EPOCH_ERROR)? {
            0 => EpochError::Unavailable { detail: r.text(text::TEXT)? },
            1 => EpochError::Exhausted { at: Epoch(r.u64(N)?) },
            tag => return Err(WireError::UnknownTag { what: text::EPOCH_ERROR, tag }),
        }),
        6 => RegistryError::IdsExhausted,
        tag => return Err(WireError::UnknownTag { what: text::REGISTRY_ERROR, tag }),
    })
}

// ---------------------------------------------------------------------------------------------
// WireError

fn put_kind(w: &mut Writer<'_>, k: Kind) {
    w.u8(k.code());
}

fn get_kind(r: &mut Reader<'_>) -> Result<Kind, WireError> {
    let tag = r.u8(text::KIND)?;
    Kind::from_code(tag).ok_or(WireError::UnknownTag { what: text::KIND, tag })
}

pub(super) fn put_wire_error(w: &mut Writer<'_>, e: &WireError) {
    match e {
        WireError::UnsupportedVersion { found, supported } => {
            w.u8(0);
            w.u8(*found);
            w.u8(*supported);
        }
        WireError::BadMagic { found } => {
            w.u8(1);
            for b in found {
                w.u8(*b);
            }
        }
        WireError::HeaderChecksum { found, computed } => {
            w.u8(2);
            w.u32(*found);
            w.u32(*computed);
        }
        WireError::TooLarge { len, max } => {
            w.u8(3);
            w.u64(*len);
            w.u64(*max);
        }
        WireError::UnknownKind { kind } => {
            w.u8(4);
            w.u8(*kind);
        }
        WireError::UnknownOp { op } => {
            w.u8(5);
            w.u8(*op);
        }
        WireError::UnsupportedFlags { flags } => {
            w.u8(6);
            w.u8(*flags);
        }
        WireError::BodyChecksum { found, computed } => {
            w.u8(7);
            w.u64(*found);
            w.u64(*computed);
        }
        WireError::Truncated { what } => {
            w.u8(8);
            w.text(what);
        }
        WireError::TrailingBytes { count } => {
            w.u8(9);
            w.u64(*count);
        }
        WireError::UnknownTag { what, tag } => {
            w.u8(10);
            w.text(what);
            w.u8(*tag);
        }
        WireError::TooMany { what, count, max } => {
            w.u8(11);
            w.text(what);
            w.u64(*count);
            w.u64(*max);
        }
        WireError::BadKey { index, detail } => {
            w.u8(12);
            w.u32(*index);
            w.text(detail);
        }
        WireError::Malformed { what } => {
            w.u8(13);
            w.text(what);
        }
        WireError::WrongKind { expected, found } => {
            w.u8(14);
            put_kind(w, *expected);
            put_kind(w, *found);
        }
        WireError::ResponseTooLarge { len, max } => {
            w.u8(15);
            w.u64(*len);
            w.u64(*max);
        }
        WireError::NotAuthenticated => w.u8(16),
        WireError::AlreadyAuthenticated => w.u8(17),
        WireError::Busy { connections, max } => {
            w.u8(18);
            w.u32(*connections);
            w.u32(*max);
        }
        WireError::ShuttingDown => w.u8(19),
        WireError::Internal { detail } => {
            w.u8(20);
            w.text(detail);
        }
        WireError::AuthFailed { reason } => {
            w.u8(21);
            w.u8(reason.code());
        }
        WireError::Unsealed => w.u8(22),
        WireError::SealMismatch => w.u8(23),
        WireError::Replayed { request_id } => {
            w.u8(24);
            w.u64(*request_id);
        }
        WireError::SharedMemory { detail } => {
            w.u8(25);
            w.text(detail);
        }
        WireError::Staging { reason, detail } => {
            w.u8(26);
            w.u8(reason.code());
            w.text(detail);
        }
        WireError::UnknownTenant { tenant } => {
            w.u8(27);
            w.tenant(tenant);
        }
        WireError::Overloaded { scope, requested, in_flight, max } => {
            w.u8(28);
            w.u8(scope.code());
            w.u64(*requested);
            w.u64(*in_flight);
            w.u64(*max);
        }
        WireError::Fenced(refusal) => {
            w.u8(29);
            put_fence_refusal(w, refusal);
        }
    }
}

/// A [`FenceRefusal`]: 0 stale epoch, 1 node behind (each with the epoch sent, then the
/// node's), 2 not admitting (with its reason's code).
fn put_fence_refusal(w: &mut Writer<'_>, refusal: &FenceRefusal) {
    match refusal {
        FenceRefusal::StaleEpoch { sent, current } => {
            w.u8(0);
            w.u64(*sent);
            w.u64(*current);
        }
        FenceRefusal::NodeBehind { sent, current } => {
            w.u8(1);
            w.u64(*sent);
            w.u64(*current);
        }
        FenceRefusal::NotAdmitting(reason) => {
            w.u8(2);
            w.u8(reason.code());
        }
    }
}

fn get_fence_refusal(r: &mut Reader<'_>) -> Result<FenceRefusal, WireError> {
    const N: &str = text::INTEGER;
    Ok(match r.u8(text::FENCE_REFUSAL)? {
        0 => FenceRefusal::StaleEpoch { sent: r.u64(N)?, current: r.u64(N)? },
        1 => FenceRefusal::NodeBehind { sent: r.u64(N)?, current: r.u64(N)? },
        2 => {
            let tag = r.u8(text::NOT_ADMITTING)?;
            FenceRefusal::NotAdmitting(
                NotAdmitting::from_code(tag)
                    .ok_or(WireError::UnknownTag { what: text::NOT_ADMITTING, tag })?,
            )
        }
        tag => return Err(WireError::UnknownTag { what: text::FENCE_REFUSAL, tag }),
    })
}

pub(super) fn get_wire_error(r: &mut Reader<'_>) -> Result<WireError, WireError> {
    const N: &str = text::INTEGER;
    Ok(match r.u8(text::WIRE_ERROR)? {
        0 => WireError::UnsupportedVersion { found: r.u8(N)?, supported: r.u8(N)? },
        1 => WireError::BadMagic { found: r.magic()? },
        2 => WireError::HeaderChecksum { found: r.u32(N)?, computed: r.u32(N)? },
        3 => WireError::TooLarge { len: r.u64(N)?, max: r.u64(N)? },
        4 => WireError::UnknownKind { kind: r.u8(N)? },
        5 => WireError::UnknownOp { op: r.u8(N)? },
        6 => WireError::UnsupportedFlags { flags: r.u8(N)? },
        7 => WireError::BodyChecksum { found: r.u64(N)?, computed: r.u64(N)? },
        8 => WireError::Truncated { what: r.static_text(text::TEXT, REMOTE_TEXT)? },
        9 => WireError::TrailingBytes { count: r.u64(N)? },
        10 => {
            WireError::UnknownTag { what: r.static_text(text::TEXT, REMOTE_TEXT)?, tag: r.u8(N)? }
        }
        11 => WireError::TooMany {
            what: r.static_text(text::TEXT, REMOTE_TEXT)?,
            count: r.u64(N)?,
            max: r.u64(N)?,
        },
        12 => WireError::BadKey { index: r.u32(N)?, detail: r.text(text::TEXT)? },
        13 => WireError::Malformed { what: r.static_text(text::TEXT, REMOTE_TEXT)? },
        14 => WireError::WrongKind { expected: get_kind(r)?, found: get_kind(r)? },
        15 => WireError::ResponseTooLarge { len: r.u64(N)?, max: r.u64(N)? },
        16 => WireError::NotAuthenticated,
        17 => WireError::AlreadyAuthenticated,
        18 => WireError::Busy { connections: r.u32(N)?, max: r.u32(N)? },
        19 => WireError::ShuttingDown,
        20 => WireError::Internal { detail: r.text(text::TEXT)? },
        21 => {
            let tag = r.u8(text::AUTH_FAILURE)?;
            let reason = AuthFailure::from_code(tag)
                .ok_or(WireError::UnknownTag { what: text::AUTH_FAILURE, tag })?;
            WireError::AuthFailed { reason }
        }
        22 => WireError::Unsealed,
        23 => WireError::SealMismatch,
        24 => WireError::Replayed { request_id: r.u64(N)? },
        25 => WireError::SharedMemory { detail: r.text(text::TEXT)? },
        26 => {
            let tag = r.u8(text::STAGING_FAILURE)?;
            let reason = StagingFailure::from_code(tag)
                .ok_or(WireError::UnknownTag { what: text::STAGING_FAILURE, tag })?;
            WireError::Staging { reason, detail: r.text(text::TEXT)? }
        }
        27 => WireError::UnknownTenant { tenant: r.tenant()? },
        28 => {
            let tag = r.u8(text::INFLIGHT_SCOPE)?;
            let scope = InflightScope::from_code(tag)
                .ok_or(WireError::UnknownTag { what: text::INFLIGHT_SCOPE, tag })?;
            WireError::Overloaded {
                scope,
                requested: r.u64(N)?,
                in_flight: r.u64(N)?,
                max: r.u64(N)?,
            }
        }
        29 => WireError::Fenced(get_fence_refusal(r)?),
        tag => return Err(WireError::UnknownTag { what: text::WIRE_ERROR, tag }),
    })
}
