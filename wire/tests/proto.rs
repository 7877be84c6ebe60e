//! The GPCW wire codec (`gpucache_wire`): exact round trips of every message
//! and every store value and error, the incremental frame decoder under arbitrary chunking,
//! truncation, corruption, oversize lengths, unknown versions, ops, kinds and flags, garbage
//! between frames, and the strictness of every body decoder.

use std::collections::HashSet;

use gpucache_dataplane::caller::Right;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::key::{KEY_BYTES_MAX, PhysicalKey};
use gpucache_dataplane::lifecycle::{BlockState, IllegalTransition};
use gpucache_dataplane::limits::{Refusal, ReplayConflict, RequestId, Usage};
use gpucache_dataplane::registry::{Epoch, EpochError, RegionCounts, RegionId, RegistryError};
use gpucache_dataplane::shard::{
    FenceRefusal, FillLease, FillNotice, FillStart, FillTicket, NodeId, NotAdmitting,
};
use gpucache_dataplane::store::{
    Abort, BatchPut, Committed, CorruptDrops, CorruptPhase, CorruptReason, FullPolicy, Get,
    Implementation, Invalidate, Located, Lookup, MissReason, PurgeScope, Purged, Put, Reclaimed,
    Reservation, Reserve, Retirement, StorageEffect, StoreCondition, StoreError, StoreStats, Tier,
};
use gpucache_dataplane::testing::fixture;
use gpucache_wire::staging::{StageId, StagedGet, StagedSlot, StagingFailure, StagingStats};
use gpucache_wire::{
    AuthFailure, BATCH_ITEMS_MAX, BODY_BYTES_MAX, DATAPLANE_TEXT, FLAG_SEALED, FLAG_SOLE_HIT,
    FLAG_TRAILER, Fetched, FetchedRef, FillRefused, Frame, FrameDecoder, FrameError, FrameHeader,
    GetItem, HEADER_BYTES, HelloAuth, HelloSession, InflightScope, Kind, MAGIC, NodeStatus, Op,
    PAYLOAD_BYTES_MAX, PutItem, REMOTE_DETAIL, REMOTE_TEXT, RemoteInfo, Request, Response,
    SEAL_BYTES, SOLE_HIT_TAIL_BYTES, SealAlgorithm, SealKey, ServerLimits, SharedGetItem,
    SharedPutItem, TEXT_BYTES_MAX, VERSION, WHAT_TEXT, WireError, begin_get_response,
    decode_get_response, decode_put_request, decode_write_request, encode_put_request,
    finish_get_response, get_hit_frame_parts, header_checksum, intern, offset, put_request_parts,
    sole_hit, write_request_parts,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

// ---------------------------------------------------------------------------------------------
// Helpers

fn tenant_named(name: &str) -> TenantId {
    TenantId::parse(name).unwrap_or_else(|e| panic!("test tenant {name:?}: {e}"))
}

fn sample_key(tenant: usize, chain: &[u8]) -> PhysicalKey {
    fixture::key(tenant, chain, KvDtype::F16, 16)
}

fn request_frame(req: &Request, id: u64) -> Vec<u8> {
    req.to_frame_bytes(id).unwrap_or_else(|e| panic!("encode {req:?}: {e}"))
}

fn response_frame(resp: &Response, id: u64) -> Vec<u8> {
    resp.to_frame_bytes(id).unwrap_or_else(|e| panic!("encode {resp:?}: {e}"))
}

/// Feeds `bytes` in chunks whose sizes cycle through `chunks`, collecting every outcome until
/// the input is used up or the stream fails.
fn decode_chunked(bytes: &[u8], chunks: &[usize]) -> Vec<Result<Frame, FrameError>> {
    let mut dec = FrameDecoder::new();
    let mut out = Vec::new();
    let mut at = 0;
    let mut sizes = chunks.iter().copied().cycle();
    while at < bytes.len() {
        let size = sizes.next().unwrap_or(1).max(1);
        let mut chunk = &bytes[at..bytes.len().min(at + size)];
        at += chunk.len();
        loop {
            match dec.feed(&mut chunk) {
                Ok(Some(frame)) => out.push(Ok(frame)),
                Ok(None) => break,
                Err(e) => {
                    let fatal = e.resync_impossible();
                    out.push(Err(e));
                    if fatal {
                        return out;
                    }
                }
            }
        }
    }
    out
}

/// Decodes exactly one frame from `bytes` fed whole.
fn decode_one(bytes: &[u8]) -> Result<Frame, FrameError> {
    let mut dec = FrameDecoder::new();
    let mut input = bytes;
    let result = dec.feed(&mut input);
    let frame = match result {
        Ok(Some(frame)) => frame,
        Ok(None) => panic!("a whole frame needs more bytes"),
        Err(e) => return Err(e),
    };
    assert!(input.is_empty(), "{} bytes left after one frame", input.len());
    Ok(frame)
}

/// A frame with an arbitrary header (valid checksums unless the caller breaks them).
fn raw_frame(header: FrameHeader, body: &[u8]) -> Vec<u8> {
    let mut out = header.to_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

fn valid_header(kind: Kind, op: Op, id: u64, body: &[u8]) -> FrameHeader {
    FrameHeader::new(kind, op, id, body)
}

fn reservation(region: u64, epoch: u64, len: u64, request: Option<u64>) -> Reservation {
    Reservation {
        region: RegionId(region),
        epoch: Epoch(epoch),
        len,
        request: request.map(RequestId),
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies

fn tenant() -> impl Strategy<Value = TenantId> {
    prop_oneof![
        (0usize..3).prop_map(fixture::tenant),
        "[A-Za-z0-9._:/@+-]{1,24}".prop_map(|s| tenant_named(&s)),
    ]
}

fn key() -> impl Strategy<Value = PhysicalKey> {
    (0usize..3, vec(any::<u8>(), 1..5), select(KvDtype::ALL.to_vec()), 1u32..=16)
        .prop_map(|(t, chain, dtype, valid)| fixture::key(t, &chain, dtype, valid))
}

fn request_id() -> impl Strategy<Value = Option<RequestId>> {
    proptest::option::of(any::<u64>().prop_map(RequestId))
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "\\PC{0,40}", "[a-z ]{0,12}"]
}

fn static_text() -> impl Strategy<Value = &'static str> {
    select(DATAPLANE_TEXT.to_vec())
}

fn what() -> impl Strategy<Value = &'static str> {
    select(WHAT_TEXT.to_vec())
}

fn retirement() -> impl Strategy<Value = Retirement> {
    prop_oneof![Just(Retirement::Retired), Just(Retirement::Unknown)]
}

fn block_state() -> impl Strategy<Value = BlockState> {
    select(vec![
        BlockState::Absent,
        BlockState::Reserved,
        BlockState::Writing,
        BlockState::Committed,
        BlockState::Evicting,
        BlockState::Quarantined,
    ])
}

fn miss() -> impl Strategy<Value = MissReason> {
    prop_oneof![
        Just(MissReason::Absent),
        Just(MissReason::Incompatible),
        block_state().prop_map(MissReason::NotReadable),
        Just(MissReason::Corrupt),
    ]
}

fn refusal() -> impl Strategy<Value = Refusal> {
    let n = any::<u64>;
    let m = any::<u32>;
    prop_oneof![
        (n(), n()).prop_map(|(bytes, max)| Refusal::ObjectTooLarge { bytes, max }),
        (m(), m()).prop_map(|(current, max)| Refusal::InflightRequests { current, max }),
        (m(), m()).prop_map(|(current, max)| Refusal::Registrations { current, max }),
        (m(), m()).prop_map(|(current, max)| Refusal::Tenants { current, max }),
        (n(), n(), n()).prop_map(|(current, requested, max)| Refusal::RetainedBytes {
            current,
            requested,
            max
        }),
        (tenant(), n(), n(), n()).prop_map(|(tenant, current, requested, max)| {
            Refusal::TenantRetainedBytes { tenant, current, requested, max }
        }),
        (tenant(), n(), n(), n()).prop_map(|(tenant, current, requested, max)| {
            Refusal::TenantInflightBytes { tenant, current, requested, max }
        }),
        (m(), m()).prop_map(|(entries, max)| Refusal::IdempotencyTable { entries, max }),
        (n(), n()).prop_map(|(free_bytes, requested)| Refusal::DiskFull { free_bytes, requested }),
    ]
}

fn registry_error() -> impl Strategy<Value = RegistryError> {
    let n = any::<u64>;
    let size = || any::<usize>();
    prop_oneof![
        (size(), size()).prop_map(|(regions, max)| RegistryError::Full { regions, max }),
        n().prop_map(|r| RegistryError::Unknown(RegionId(r))),
        (n(), static_text(), static_text()).prop_map(|(r, state, operation)| {
            RegistryError::WrongState { region: RegionId(r), state, operation }
        }),
        (n(), tenant(), tenant()).prop_map(|(r, caller, owner)| RegistryError::NotAuthorized {
            region: RegionId(r),
            caller,
            owner
        }),
        (n(), n())
            .prop_map(|(g, c)| RegistryError::StaleEpoch { given: Epoch(g), current: Epoch(c) }),
        text().prop_map(|detail| RegistryError::Epoch(EpochError::Unavailable { detail })),
        n().prop_map(|at| RegistryError::Epoch(EpochError::Exhausted { at: Epoch(at) })),
        Just(RegistryError::IdsExhausted),
    ]
}

fn store_error() -> impl Strategy<Value = StoreError> {
    let n = any::<u64>;
    prop_oneof![
        (tenant(), tenant()).prop_map(|(caller, owner)| StoreError::WrongTenant { caller, owner }),
        (tenant(), select(vec![Right::Read, Right::Write, Right::Admin]))
            .prop_map(|(tenant, right)| StoreError::Forbidden { tenant, right }),
        Just(StoreError::EmptyObject),
        n().prop_map(|r| StoreError::UnknownReservation { region: RegionId(r) }),
        n().prop_map(|r| StoreError::ReservationQuarantined { region: RegionId(r) }),
        (n(), n(), n()).prop_map(|(offset, len, capacity)| StoreError::WriteOutOfBounds {
            offset,
            len,
            capacity
        }),
        (n(), n()).prop_map(|(written, expected)| StoreError::Incomplete { written, expected }),
        (n(), n()).prop_map(|(needed, provided)| StoreError::BufferTooSmall { needed, provided }),
        (tenant(), n()).prop_map(|(tenant, r)| StoreError::Replay(ReplayConflict {
            tenant,
            request: RequestId(r)
        })),
        registry_error().prop_map(StoreError::Registry),
        (n(), block_state(), static_text(), static_text()).prop_map(
            |(r, from, transition, detail)| StoreError::Lifecycle(IllegalTransition {
                region: RegionId(r),
                from,
                transition,
                detail
            })
        ),
        (static_text(), text(), retirement()).prop_map(|(operation, detail, retirement)| {
            StoreError::Backend { operation, detail, retirement }
        }),
        (
            (static_text(), static_text(), text()),
            (io_kind(), text()),
            (select(vec![StorageEffect::Unchanged, StorageEffect::NotDurable]), retirement())
        )
            .prop_map(|((operation, step, path), (kind, detail), (effect, retirement))| {
                StoreError::Storage {
                    operation,
                    step,
                    path: path.into(),
                    kind,
                    detail,
                    effect,
                    retirement,
                }
            }),
        (static_text(), io_kind(), text(), retirement()).prop_map(
            |(operation, kind, detail, retirement)| StoreError::Io {
                operation,
                kind,
                detail,
                retirement
            }
        ),
        fence_refusal().prop_map(StoreError::Fenced),
    ]
}

/// Every io error kind a storage or I/O error carries by tag, in tag order (PROTOCOL.md,
/// `io_kind`).
const IO_KINDS: [std::io::ErrorKind; 35] = {
    use std::io::ErrorKind as K;
    [
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

fn io_kind() -> impl Strategy<Value = std::io::ErrorKind> {
    select(IO_KINDS.to_vec())
}

fn corrupt_drops() -> impl Strategy<Value = CorruptDrops> {
    vec((0..CorruptPhase::ALL.len(), 0..CorruptReason::ALL.len(), any::<u64>()), 0..20).prop_map(
        |entries| {
            let mut drops = CorruptDrops::default();
            for (p, r, n) in entries {
                drops.add(CorruptPhase::ALL[p], CorruptReason::ALL[r], n);
            }
            drops
        },
    )
}

fn wire_error() -> impl Strategy<Value = WireError> {
    let n = any::<u64>;
    let b = any::<u8>;
    prop_oneof![
        (b(), b())
            .prop_map(|(found, supported)| WireError::UnsupportedVersion { found, supported }),
        any::<[u8; 4]>().prop_map(|found| WireError::BadMagic { found }),
        (any::<u32>(), any::<u32>())
            .prop_map(|(found, computed)| WireError::HeaderChecksum { found, computed }),
        (n(), n()).prop_map(|(len, max)| WireError::TooLarge { len, max }),
        b().prop_map(|kind| WireError::UnknownKind { kind }),
        b().prop_map(|op| WireError::UnknownOp { op }),
        b().prop_map(|flags| WireError::UnsupportedFlags { flags }),
        (n(), n()).prop_map(|(found, computed)| WireError::BodyChecksum { found, computed }),
        what().prop_map(|what| WireError::Truncated { what }),
        n().prop_map(|count| WireError::TrailingBytes { count }),
        (what(), b()).prop_map(|(what, tag)| WireError::UnknownTag { what, tag }),
        (what(), n(), n()).prop_map(|(what, count, max)| WireError::TooMany { what, count, max }),
        (any::<u32>(), text()).prop_map(|(index, detail)| WireError::BadKey { index, detail }),
        what().prop_map(|what| WireError::Malformed { what }),
        (select(vec![Kind::Request, Kind::Response]), select(vec![Kind::Request, Kind::Response]))
            .prop_map(|(expected, found)| WireError::WrongKind { expected, found }),
        (n(), n()).prop_map(|(len, max)| WireError::ResponseTooLarge { len, max }),
        Just(WireError::NotAuthenticated),
        Just(WireError::AlreadyAuthenticated),
        (any::<u32>(), any::<u32>())
            .prop_map(|(connections, max)| WireError::Busy { connections, max }),
        Just(WireError::ShuttingDown),
        text().prop_map(|detail| WireError::Internal { detail }),
        select(AuthFailure::ALL.to_vec()).prop_map(|reason| WireError::AuthFailed { reason }),
        Just(WireError::Unsealed),
        Just(WireError::SealMismatch),
        n().prop_map(|request_id| WireError::Replayed { request_id }),
        text().prop_map(|detail| WireError::SharedMemory { detail }),
        fence_refusal().prop_map(WireError::Fenced),
    ]
}

fn fence_refusal() -> impl Strategy<Value = FenceRefusal> {
    let n = any::<u64>;
    prop_oneof![
        (n(), n()).prop_map(|(sent, current)| FenceRefusal::StaleEpoch { sent, current }),
        (n(), n()).prop_map(|(sent, current)| FenceRefusal::NodeBehind { sent, current }),
        select(NotAdmitting::ALL.to_vec()).prop_map(FenceRefusal::NotAdmitting),
    ]
}

fn fill_ticket() -> impl Strategy<Value = FillTicket> {
    (any::<u64>(), any::<u64>()).prop_map(|(fill, e)| FillTicket { fill, epoch: Epoch(e) })
}

fn fill_lease() -> impl Strategy<Value = FillLease> {
    (fill_ticket(), any::<u64>())
        .prop_map(|(ticket, deadline_ms)| FillLease { ticket, deadline_ms })
}

fn fill_notice() -> impl Strategy<Value = FillNotice> {
    select(vec![FillNotice::Pending, FillNotice::Finished, FillNotice::Failed, FillNotice::Fenced])
}

fn fill_begun() -> impl Strategy<Value = Result<FillStart, FillRefused>> {
    prop_oneof![
        fill_lease().prop_map(|l| Ok(FillStart::Lead(l))),
        fill_ticket().prop_map(|t| Ok(FillStart::Join(t))),
        (any::<u64>(), any::<u64>())
            .prop_map(|(asked, current)| Err(FillRefused::Epoch { asked, current })),
        Just(Err(FillRefused::Draining)),
        any::<u64>().prop_map(|max| Err(FillRefused::TooMany { max })),
        text().prop_map(|detail| Err(FillRefused::Credits { detail })),
        text().prop_map(|detail| Err(FillRefused::Forbidden { detail })),
    ]
}

fn node_status() -> impl Strategy<Value = Option<NodeStatus>> {
    proptest::option::of(
        (any::<u64>(), any::<u64>(), proptest::option::of(select(NotAdmitting::ALL.to_vec())))
            .prop_map(|(node, epoch, not_admitting)| NodeStatus {
                node: NodeId(node),
                epoch,
                not_admitting,
            }),
    )
}

fn reservation_strategy() -> impl Strategy<Value = Reservation> {
    (any::<u64>(), any::<u64>(), any::<u64>(), proptest::option::of(any::<u64>()))
        .prop_map(|(r, e, len, req)| reservation(r, e, len, req))
}

fn data() -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..96)
}

fn seal_algorithm() -> impl Strategy<Value = SealAlgorithm> {
    select(SealAlgorithm::ALL.to_vec())
}

fn hello_auth() -> impl Strategy<Value = HelloAuth> {
    (text(), any::<[u8; 16]>(), any::<[u8; 16]>(), any::<u64>(), seal_algorithm()).prop_map(
        |(key_id, fingerprint, client_nonce, timestamp_ms, seal)| HelloAuth {
            key_id,
            fingerprint,
            client_nonce,
            timestamp_ms,
            seal,
        },
    )
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (tenant(), text(), 0u8..8, proptest::option::of(hello_auth())).prop_map(
            |(tenant, client_name, bits, auth)| Request::Hello {
                tenant,
                client_name,
                rights: gpucache_dataplane::caller::Rights {
                    read: bits & 1 != 0,
                    write: bits & 2 != 0,
                    admin: bits & 4 != 0
                },
                auth,
            }
        ),
        Just(()).prop_map(|()| Request::Info),
        Just(()).prop_map(|()| Request::Epoch),
        Just(()).prop_map(|()| Request::Stats),
        vec(key(), 0..8).prop_map(|keys| Request::Lookup { keys }),
        vec(key(), 0..8).prop_map(|keys| Request::Locate { keys }),
        any::<u64>().prop_map(|epoch| Request::Cluster { epoch }),
        key().prop_map(|key| Request::FillBegin { key: Box::new(key) }),
        (fill_lease(), any::<bool>())
            .prop_map(|(lease, stored)| Request::FillFinish { lease, stored }),
        (fill_ticket(), any::<u64>())
            .prop_map(|(ticket, wait_ms)| Request::FillWait { ticket, wait_ms }),
        (key(), "[a-z-]{0,16}").prop_map(|(key, prefix)| Request::Purge {
            scope: Box::new(PurgeScope::new(key, &prefix).unwrap_or_else(|e| panic!("{e}")))
        }),
        vec((key(), 0u64..=PAYLOAD_BYTES_MAX / 8), 0..8).prop_map(|items| Request::Get {
            items: items.into_iter().map(|(key, capacity)| GetItem { key, capacity }).collect()
        }),
        vec((key(), request_id(), data()), 0..8).prop_map(|items| Request::Put {
            items: items
                .into_iter()
                .map(|(key, request, data)| PutItem { key, request, data })
                .collect()
        }),
        vec(key(), 0..8).prop_map(|keys| Request::Invalidate { keys }),
        (key(), any::<u64>(), request_id()).prop_map(|(key, len, request)| Request::Reserve {
            key: Box::new(key),
            len,
            request
        }),
        (reservation_strategy(), any::<u64>(), data()).prop_map(|(reservation, offset, data)| {
            Request::Write { reservation, offset, data }
        }),
        reservation_strategy().prop_map(|reservation| Request::Commit { reservation }),
        (reservation_strategy(), retirement())
            .prop_map(|(reservation, outcome)| Request::Abort { reservation, outcome }),
        Just(()).prop_map(|()| Request::ExpireLeases),
        any::<u64>().prop_map(|r| Request::Attest { region: RegionId(r) }),
        Just(()).prop_map(|()| Request::BumpEpoch),
        any::<u64>().prop_map(|e| Request::ReclaimFenced { epoch: Epoch(e) }),
        any::<u64>().prop_map(|len| Request::ShmAttach { len }),
        vec((key(), any::<u64>(), any::<u64>()), 0..8).prop_map(|items| Request::GetShared {
            items: items
                .into_iter()
                .map(|(key, offset, capacity)| SharedGetItem { key, offset, capacity })
                .collect()
        }),
        vec((key(), request_id(), any::<u64>(), any::<u64>(), any::<u64>()), 0..8).prop_map(
            |items| Request::PutShared {
                items: items
                    .into_iter()
                    .map(|(key, request, offset, len, c)| SharedPutItem {
                        key,
                        request,
                        offset,
                        len,
                        checksum: Checksum(c),
                    })
                    .collect()
            }
        ),
    ]
}

fn result<T: std::fmt::Debug>(
    ok: impl Strategy<Value = T>,
) -> impl Strategy<Value = Result<T, StoreError>> {
    prop_oneof![ok.prop_map(Ok), store_error().prop_map(Err)]
}

fn lookup() -> impl Strategy<Value = Lookup> {
    prop_oneof![
        any::<u64>().prop_map(|len| Lookup::Hit { len }),
        (key(), any::<u64>()).prop_map(|(key, len)| Lookup::PrefixHit { key: Box::new(key), len }),
        miss().prop_map(Lookup::Miss),
    ]
}

/// A found block names its tier or none; a miss never names one.
fn located() -> impl Strategy<Value = Located> {
    let tier = prop_oneof![
        Just(None),
        Just(Some(Tier::Memory)),
        Just(Some(Tier::File)),
        Just(Some(Tier::Cold))
    ];
    (lookup(), tier).prop_map(|(lookup, tier)| {
        let tier = tier.filter(|_| !matches!(lookup, Lookup::Miss(_)));
        Located { lookup, tier }
    })
}

#[test]
fn a_located_miss_that_names_a_tier_is_malformed() {
    let good = Response::Locate(vec![Ok(Located {
        lookup: Lookup::Hit { len: 9 },
        tier: Some(Tier::File),
    })]);
    let mut body = body_of_response(&good);
    assert_eq!(Response::decode_body(Op::Locate, &body), Ok(good));
    // The same item as a miss (tag 2, reason absent) that names the memory tier.
    let miss = Response::Locate(vec![Ok(Located {
        lookup: Lookup::Miss(MissReason::Absent),
        tier: None,
    })]);
    body = body_of_response(&miss);
    let last = body.len() - 1;
    assert_eq!(body[last], 0, "the tier is the item's last byte");
    body[last] = 1;
    assert_eq!(
        Response::decode_body(Op::Locate, &body),
        Err(WireError::Malformed { what: "tier" })
    );
    body[last] = 9;
    assert_eq!(
        Response::decode_body(Op::Locate, &body),
        Err(WireError::UnknownTag { what: "tier", tag: 9 })
    );
}

fn fetched() -> impl Strategy<Value = Fetched> {
    prop_oneof![
        data().prop_map(|data| Fetched::Hit { checksum: Checksum::of(&data), data }),
        miss().prop_map(Fetched::Miss),
    ]
}

fn put_outcome() -> impl Strategy<Value = Put> {
    prop_oneof![
        any::<u64>().prop_map(|c| Put::Committed(Checksum(c))),
        Just(Put::AlreadyCommitted),
        Just(Put::Busy),
        refusal().prop_map(Put::Refused),
    ]
}

fn reserve_outcome() -> impl Strategy<Value = Reserve> {
    prop_oneof![
        reservation_strategy().prop_map(Reserve::Reserved),
        Just(()).prop_map(|()| Reserve::AlreadyCommitted),
        Just(()).prop_map(|()| Reserve::Busy),
        refusal().prop_map(Reserve::Refused),
    ]
}

fn stats() -> impl Strategy<Value = StoreStats> {
    (
        (any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>()),
        (any::<usize>(), any::<usize>(), any::<usize>(), any::<u64>()),
        (any::<u64>(), corrupt_drops(), any::<u64>()),
    )
        .prop_map(|(u, r, c)| StoreStats {
            usage: Usage {
                inflight_requests: u.0,
                registrations: u.1,
                retained_bytes: u.2,
                tenants: u.3,
            },
            regions: RegionCounts {
                lent: r.0,
                held: r.1,
                quarantined: r.2,
                quarantined_bytes: r.3,
            },
            committed_blocks: c.0,
            corrupt_dropped: c.1,
            evictions: c.2,
        })
}

fn info() -> impl Strategy<Value = RemoteInfo> {
    (
        text(),
        prop_oneof![
            Just(Implementation::Real),
            any::<u64>().prop_map(|seed| Implementation::Simulated { seed })
        ],
        any::<bool>(),
        select(vec![FullPolicy::Refuse, FullPolicy::EvictOldest]),
    )
        .prop_map(|(name, implementation, failures_retire, full_policy)| RemoteInfo {
            name,
            implementation,
            failures_retire,
            full_policy,
        })
}

fn response() -> impl Strategy<Value = Response> {
    let invalidate = select(vec![Invalidate::Removed, Invalidate::Absent, Invalidate::Busy]);
    let abort = select(vec![Abort::Released, Abort::Quarantined]);
    prop_oneof![
        (
            any::<u8>(),
            text(),
            proptest::option::of(
                (any::<[u8; 16]>(), seal_algorithm())
                    .prop_map(|(server_nonce, seal)| HelloSession { server_nonce, seal })
            ),
            proptest::option::of(text().prop_filter("non-empty", |t| !t.is_empty()))
        )
            .prop_map(|(version, server, session, local)| Response::Hello {
                version,
                server,
                session,
                local
            }),
        info().prop_map(Response::Info),
        any::<u64>().prop_map(|e| Response::Epoch(Epoch(e))),
        stats().prop_map(Response::Stats),
        vec(result(lookup()), 0..8).prop_map(Response::Lookup),
        vec(result(located()), 0..8).prop_map(Response::Locate),
        node_status().prop_map(Response::Cluster),
        fill_begun().prop_map(Response::FillBegin),
        fill_notice().prop_map(Response::FillFinish),
        fill_notice().prop_map(Response::FillWait),
        result(
            (any::<u64>(), any::<u64>(), any::<bool>())
                .prop_map(|(removed, busy, more)| { Purged { removed, busy, more } })
        )
        .prop_map(Response::Purge),
        vec(result(fetched()), 0..8).prop_map(Response::Get),
        vec(result(put_outcome()), 0..8).prop_map(Response::Put),
        vec(result(invalidate), 0..8).prop_map(Response::Invalidate),
        result(reserve_outcome()).prop_map(Response::Reserve),
        result(Just(())).prop_map(Response::Write),
        result(any::<u64>().prop_map(|c| Committed { checksum: Checksum(c) }))
            .prop_map(Response::Commit),
        result(abort).prop_map(Response::Abort),
        result(any::<u64>()).prop_map(Response::ExpireLeases),
        result(
            (any::<u64>(), any::<u64>())
                .prop_map(|(r, bytes)| Reclaimed { region: RegionId(r), bytes })
        )
        .prop_map(Response::Attest),
        result(any::<u64>().prop_map(Epoch)).prop_map(Response::BumpEpoch),
        result(any::<u64>()).prop_map(Response::ReclaimFenced),
        any::<u64>().prop_map(Response::ShmAttach),
        vec(result(got()), 0..8).prop_map(Response::GetShared),
        vec(result(put_outcome()), 0..8).prop_map(Response::PutShared),
        wire_error().prop_map(Response::Error),
    ]
}

fn got() -> impl Strategy<Value = Get> {
    prop_oneof![
        (any::<u64>(), any::<u64>()).prop_map(|(len, c)| Get::Hit { len, checksum: Checksum(c) }),
        miss().prop_map(Get::Miss),
    ]
}

fn chunks() -> impl Strategy<Value = Vec<usize>> {
    vec(prop_oneof![1usize..8, 8usize..100, 100usize..5000], 1..12)
}

// ---------------------------------------------------------------------------------------------
// Round trips

/// Decodes `bytes` the way the server and client read sockets: header bytes through `push`
/// in chunks, the rest of each body straight into [`FrameDecoder::body_window`] at most
/// `window` bytes at a time, and every frame's body handed back with `recycle`.
fn decode_windowed(bytes: &[u8], chunks: &[usize], window: usize) -> Vec<Frame> {
    let mut dec = FrameDecoder::new();
    let mut out = Vec::new();
    let mut at = 0;
    let mut sizes = chunks.iter().copied().cycle();
    while at < bytes.len() {
        if let Some(w) = dec.body_window() {
            let n = w.len().min(window.max(1)).min(bytes.len() - at);
            w[..n].copy_from_slice(&bytes[at..at + n]);
            at += n;
            dec.commit_body(n);
        } else {
            let size = sizes.next().unwrap_or(1).max(1);
            let chunk = &bytes[at..bytes.len().min(at + size)];
            let used = dec.push(chunk);
            at += used;
        }
        while let Some(frame) = dec.next_frame().unwrap_or_else(|e| panic!("valid stream: {e}")) {
            out.push(frame.clone());
            dec.recycle(frame.body);
        }
    }
    out
}

#[test]
fn large_bodies_read_through_windows_reuse_one_buffer_and_grow_with_the_bytes() {
    let sizes = [300_000usize, 1 << 20, 10, 2 << 20, 1 << 20];
    let mut stream = Vec::new();
    let mut expected = Vec::new();
    for (i, n) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..*n).map(|b| u8::try_from((b + i) % 251).unwrap_or(0)).collect();
        let req =
            Request::Put { items: vec![PutItem { key: sample_key(0, &[1]), request: None, data }] };
        req.encode_frame(i as u64 + 1, &mut stream).unwrap_or_else(|e| panic!("{e}"));
        expected.push(req);
    }
    for window in [1usize << 10, 64 << 10, 1 << 20, usize::MAX] {
        let frames = decode_windowed(&stream, &[7, 64, 4096], window);
        let back: Vec<Request> = frames
            .iter()
            .map(|f| Request::from_frame(f).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        assert_eq!(back, expected, "window {window}");
    }
    // A header announcing 2 MiB with only 100 body bytes behind it: the buffer follows the
    // bytes (one 64 KiB step), not the announcement.
    let mut dec = FrameDecoder::new();
    let third = request_frame(&expected[3], 9);
    assert_eq!(dec.push(&third[..HEADER_BYTES + 100]), HEADER_BYTES + 100);
    assert!(dec.buffer_capacity() <= 64 << 10, "{}", dec.buffer_capacity());
    let window = dec.body_window().map_or(0, |w| w.len());
    assert!(window <= 128 << 10, "window {window} runs ahead of the bytes");
}

#[test]
fn get_answers_checksum_their_trailer_and_leave_payloads_to_their_own_checksums() {
    let data = vec![5u8; 10_000];
    let answer = Response::Get(vec![
        Ok(Fetched::Hit { checksum: Checksum::of(&data), data: data.clone() }),
        Ok(Fetched::Miss(MissReason::Absent)),
    ]);
    let bytes = response_frame(&answer, 4);
    assert_eq!(bytes[offset::FLAGS], FLAG_TRAILER, "GET answers carry a trailer");
    let frame = decode_one(&bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(frame.to_bytes().unwrap_or_default(), bytes, "re-encodes exactly");

    // A flipped payload byte passes the frame checksum (which covers only the trailer) and is
    // caught by the payload's own checksum, which every receiver checks before using it.
    let mut flipped = bytes.clone();
    flipped[HEADER_BYTES + 10] ^= 1;
    let frame = decode_one(&flipped).unwrap_or_else(|e| panic!("{e}"));
    let answers = decode_get_response(&frame.body).unwrap_or_else(|e| panic!("{e}"));
    let Ok(FetchedRef::Hit { checksum, data: got }) = &answers[0] else { panic!("{answers:?}") };
    assert_ne!(Checksum::of(got), *checksum);

    // A flipped trailer byte fails the frame.
    let mut flipped = bytes.clone();
    let at = flipped.len() - 6;
    flipped[at] ^= 1;
    assert!(matches!(
        decode_one(&flipped),
        Err(FrameError { error: WireError::BodyChecksum { .. }, request_id: Some(4) })
    ));
    // A trailer length that points outside the body is malformed, for that frame only.
    let body = [9u32.to_le_bytes(), 100u32.to_le_bytes()].concat();
    let mut header = valid_header(Kind::Response, Op::Get, 6, &body);
    header.flags = FLAG_TRAILER;
    let outcome = decode_one(&raw_frame(header, &body));
    assert!(
        matches!(&outcome, Err(FrameError { error: WireError::Malformed { what: "trailer" }, .. })),
        "{outcome:?}"
    );
    // The flag on anything but a GET answer is refused.
    let body = [1u8, 2, 3, 4];
    let mut header = valid_header(Kind::Request, Op::Get, 7, &body);
    header.flags = FLAG_TRAILER;
    assert!(matches!(
        decode_one(&raw_frame(header, &body)),
        Err(FrameError { error: WireError::UnsupportedFlags { flags: FLAG_TRAILER }, .. })
    ));
}

/// A GET answer that is exactly one hit says so in its header (FLAG_SOLE_HIT), so that a
/// receiver can take the payload straight into its destination; a decoder fed that way ends
/// with the trailer it needs, and refuses a body that does not match the flag.
#[test]
fn a_sole_hit_says_so_and_its_payload_can_bypass_the_decoder() {
    let data: Vec<u8> = (0..70_000u32).map(|i| i.to_le_bytes()[0] ^ 0x3c).collect();
    let hit = Ok(Fetched::Hit { checksum: Checksum::of(&data), data: data.clone() });
    let one = response_frame(&Response::Get(vec![hit.clone()]), 9);
    assert_eq!(one[offset::FLAGS], FLAG_TRAILER | FLAG_SOLE_HIT);
    for other in [
        Response::Get(vec![hit.clone(), Ok(Fetched::Miss(MissReason::Absent))]),
        Response::Get(vec![Ok(Fetched::Miss(MissReason::Absent))]),
        Response::Get(vec![]),
    ] {
        assert_eq!(response_frame(&other, 9)[offset::FLAGS], FLAG_TRAILER, "{other:?}");
    }
    // The receiver takes the header and a first piece through the decoder, the rest of the
    // payload itself, and the tail through the decoder again.
    let mut dec = FrameDecoder::new();
    let first = HEADER_BYTES + 1000;
    assert_eq!(dec.push(&one[..first]), first);
    let (payload, so_far) = dec.sole_hit_payload().unwrap_or_else(|| panic!("no sole hit"));
    assert_eq!((payload, so_far), (data.len(), &data[..1000]));
    let mut mine = data[..1000].to_vec();
    mine.extend_from_slice(&one[first..HEADER_BYTES + data.len()]);
    dec.skip_body(data.len() - 1000);
    assert!(dec.sole_hit_payload().is_some_and(|(_, got)| got.len() == data.len()));
    let tail = &one[HEADER_BYTES + data.len()..];
    assert_eq!(tail.len(), SOLE_HIT_TAIL_BYTES);
    assert_eq!(dec.push(tail), tail.len());
    let frame =
        dec.next_frame().unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(|| panic!("no frame"));
    assert_eq!(sole_hit(&frame.body), Some((Checksum::of(&data), data.len())));
    assert_eq!(mine, data);
    // The flag on a body that is not one hit, or on anything but a GET answer, is refused.
    let two = response_frame(&Response::Get(vec![hit.clone(), hit]), 10);
    let mut header = valid_header(Kind::Response, Op::Get, 10, &two[HEADER_BYTES..]);
    assert_eq!(header.flags, FLAG_TRAILER);
    header.flags = FLAG_TRAILER | FLAG_SOLE_HIT;
    let outcome = decode_one(&raw_frame(header, &two[HEADER_BYTES..]));
    assert!(
        matches!(&outcome, Err(FrameError { error: WireError::Malformed { what: "trailer" }, .. })),
        "{outcome:?}"
    );
    let body = request_frame(&Request::Epoch, 11)[HEADER_BYTES..].to_vec();
    let mut header = valid_header(Kind::Response, Op::Put, 11, &body);
    header.flags = FLAG_TRAILER | FLAG_SOLE_HIT;
    assert!(matches!(
        decode_one(&raw_frame(header, &body)),
        Err(FrameError { error: WireError::UnsupportedFlags { .. }, .. })
    ));
}

fn get_items() -> impl Strategy<Value = Vec<(GetItem, Result<Get, StoreError>, Vec<u8>)>> {
    let outcome = prop_oneof![
        data().prop_map(|d| (Ok(Get::Hit { len: d.len() as u64, checksum: Checksum::of(&d) }), d)),
        miss().prop_map(|m| (Ok(Get::Miss(m)), Vec::new())),
        store_error().prop_map(|e| (Err(e), Vec::new())),
    ];
    vec((key(), 0u64..128, outcome), 0..6).prop_map(|items| {
        items
            .into_iter()
            .map(|(key, extra, (got, data))| {
                let capacity = data.len() as u64 + extra;
                (GetItem { key, capacity }, got, data)
            })
            .collect()
    })
}

/// A GET response built as a server builds it: the frame laid out, each block read into its
/// destination by `fetch` (one batch), then finished.
fn encode_get_response(
    id: u64,
    seal: Option<&SealKey>,
    items: &[GetItem],
    out: &mut Vec<u8>,
    fetch: impl FnOnce(
        &mut [gpucache_dataplane::store::BatchGet<'_>],
    ) -> gpucache_dataplane::store::BatchAnswers<Get>,
) -> Result<(), WireError> {
    let slots = begin_get_response(items, out)?;
    let mut batch: Vec<gpucache_dataplane::store::BatchGet<'_>> = items
        .iter()
        .zip(slots)
        .map(|(item, dst)| gpucache_dataplane::store::BatchGet { key: &item.key, dst })
        .collect();
    let answers = fetch(&mut batch);
    drop(batch);
    finish_get_response(id, seal, items, answers, out)
}

/// A GET answer reuses its buffer without zeroing it: the store sees the bytes of the frame
/// written there before (and overwrites what it delivers), and what it did not write never
/// reaches the frame; a store's batch that leaves items unanswered, or reports a hit longer
/// than its destination, answers those items with errors.
#[test]
fn get_answers_reuse_their_buffer_and_send_only_what_the_store_wrote() {
    let k = |i: u8| fixture::key(0, &[i], KvDtype::F16, 16);
    let gets: Vec<GetItem> = (0..4).map(|i| GetItem { key: k(i), capacity: 64 }).collect();
    let mut out = vec![0xEE; 1024];
    let mut seen = Vec::new();
    encode_get_response(7, None, &gets, &mut out, |batch| {
        seen = batch.iter().map(|item| item.dst.iter().all(|&b| b == 0xEE)).collect();
        batch[1].dst[..3].copy_from_slice(b"abc");
        vec![
            Ok(Get::Miss(MissReason::Absent)),
            Ok(Get::Hit { len: 3, checksum: Checksum::of(b"abc") }),
            Ok(Get::Hit { len: 65, checksum: Checksum(1) }),
        ]
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(seen, [true; 4], "the destinations were zeroed first");
    let frame = decode_one(&out).unwrap_or_else(|e| panic!("{e}"));
    let answers = decode_get_response(&frame.body).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(answers.len(), 4);
    assert_eq!(answers[0], Ok(FetchedRef::Miss(MissReason::Absent)));
    assert_eq!(answers[1], Ok(FetchedRef::Hit { checksum: Checksum::of(b"abc"), data: b"abc" }));
    for (i, answer) in answers.iter().enumerate().skip(2) {
        let Err(e) = answer else { panic!("item {i}: {answer:?}") };
        assert_eq!(e.retirement(), Retirement::Retired, "item {i}: {e}");
    }
    // Capacities over the payload limit are refused before anything is allocated.
    let huge = vec![GetItem { key: k(9), capacity: gpucache_wire::PAYLOAD_BYTES_MAX + 1 }];
    let mut out = vec![1u8; 16];
    assert!(encode_get_response(8, None, &huge, &mut out, |_| Vec::new()).is_err());
    assert!(out.is_empty());
}

/// Finishing a response of hits appends its trailer without growing the buffer that was laid
/// out for it: a grown buffer doubles, and past what a connection keeps between responses (as
/// a 4 MiB hit's did) every GET would map and zero a fresh one.
#[test]
fn a_hit_response_fits_the_buffer_laid_out_for_it() {
    let k = |i: u8| fixture::key(0, &[i], KvDtype::F16, 16);
    for (items, capacity) in [(1u8, 4u64 << 20), (1, 64 << 10), (8, 1 << 20), (32, 4096)] {
        let gets: Vec<GetItem> = (0..items).map(|i| GetItem { key: k(i), capacity }).collect();
        let mut out = Vec::new();
        encode_get_response(3, None, &gets, &mut out, |batch| {
            batch
                .iter_mut()
                .map(|item| {
                    item.dst.fill(7);
                    Ok(Get::Hit { len: capacity, checksum: Checksum::of(item.dst) })
                })
                .collect()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            out.capacity() < out.len() + 4096,
            "{items} x {capacity}: the trailer grew the buffer to {} for a {}-byte frame",
            out.capacity(),
            out.len()
        );
        let frame = decode_one(&out).unwrap_or_else(|e| panic!("{e}"));
        let answers = decode_get_response(&frame.body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(answers.len(), usize::from(items));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Reading bodies straight into the decoder's window (with recycled buffers) gives exactly
    /// the frames that pushing the same bytes gives.
    #[test]
    fn windowed_reads_decode_like_pushes(
        reqs in vec(request(), 1..6),
        sizes in chunks(),
        window in 1usize..200_000,
    ) {
        let mut stream = Vec::new();
        for (i, req) in reqs.iter().enumerate() {
            req.encode_frame(u64::try_from(i).unwrap_or(0) + 1, &mut stream)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let pushed: Vec<Frame> = decode_chunked(&stream, &sizes)
            .into_iter()
            .map(|o| o.unwrap_or_else(|e| panic!("{e}")))
            .collect();
        prop_assert_eq!(decode_windowed(&stream, &sizes, window), pushed);
    }

    /// The in-place GET encoder writes the bytes `Response::Get` writes, whatever the buffer
    /// it reuses held before (none of those bytes leak into the frame), and the borrowed
    /// decoder reads back what the owned one does.
    #[test]
    fn in_place_get_answers_match_the_owned_encoding(
        items in get_items(),
        id in any::<u64>(),
        stale in 0usize..2048,
    ) {
        let owned = Response::Get(
            items
                .iter()
                .map(|(_, got, data)| match got {
                    Ok(Get::Hit { checksum, .. }) => {
                        Ok(Fetched::Hit { checksum: *checksum, data: data.clone() })
                    }
                    Ok(Get::Miss(m)) => Ok(Fetched::Miss(*m)),
                    Err(e) => Err(e.clone()),
                })
                .collect(),
        );
        let gets: Vec<GetItem> = items.iter().map(|(g, _, _)| g.clone()).collect();
        let mut in_place = vec![0xA5; stale];
        let mut fetches = 0;
        encode_get_response(id, None, &gets, &mut in_place, |batch| {
            fetches += 1;
            assert_eq!(batch.len(), items.len());
            batch
                .iter_mut()
                .zip(&items)
                .map(|(item, (get, got, data))| {
                    assert_eq!((item.key, item.dst.len() as u64), (&get.key, get.capacity));
                    item.dst[..data.len()].copy_from_slice(data);
                    got.clone()
                })
                .collect()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(fetches, 1);
        prop_assert_eq!(&in_place, &response_frame(&owned, id));
        let frame = decode_one(&in_place).unwrap_or_else(|e| panic!("{e}"));
        let borrowed = decode_get_response(&frame.body).unwrap_or_else(|e| panic!("{e}"));
        let Ok(Response::Get(answers)) = Response::from_frame(&frame) else {
            panic!("not a GET answer")
        };
        prop_assert_eq!(borrowed.len(), answers.len());
        for (b, a) in borrowed.iter().zip(&answers) {
            let same = match (b, a) {
                (Ok(FetchedRef::Hit { checksum: c1, data: d1 }), Ok(Fetched::Hit { checksum: c2, data: d2 })) => {
                    c1 == c2 && *d1 == &d2[..]
                }
                (Ok(FetchedRef::Miss(m1)), Ok(Fetched::Miss(m2))) => m1 == m2,
                (Err(e1), Err(e2)) => e1 == e2,
                _ => false,
            };
            prop_assert!(same, "{b:?} vs {a:?}");
        }
    }

    /// A GET answer sent in parts around a payload that is not copied (a lent block) is the
    /// same frame, byte for byte, as the one encoded in place.
    #[test]
    fn get_hit_parts_around_the_payload_are_the_encoded_answer(
        data in vec(any::<u8>(), 0..5000),
        id in any::<u64>(),
    ) {
        let checksum = Checksum::of(&data);
        let owned = Response::Get(vec![Ok(Fetched::Hit { checksum, data: data.clone() })]);
        let (mut head, mut tail) = (vec![1, 2, 3], vec![4]);
        get_hit_frame_parts(id, data.len(), checksum, &mut head, &mut tail)
            .unwrap_or_else(|e| panic!("{e}"));
        let sent = [&head[..], &data[..], &tail[..]].concat();
        prop_assert_eq!(&sent, &response_frame(&owned, id));
        let frame = decode_one(&sent).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(Response::from_frame(&frame), Ok(owned));
    }

    /// A WRITE sent in parts (header and fields, then the data from where it lies) is the
    /// same bytes as `Request::Write`, and its borrowed decode gives back every field.
    #[test]
    fn write_requests_in_parts_match_the_owned_encoding(
        region in any::<u64>(),
        epoch in any::<u64>(),
        len in any::<u64>(),
        request in request_id(),
        offset in any::<u64>(),
        data in vec(any::<u8>(), 0..300),
        id in any::<u64>(),
    ) {
        let reservation = Reservation { region: RegionId(region), epoch: Epoch(epoch), len, request };
        let owned = Request::Write {
            reservation: Reservation { region: RegionId(region), epoch: Epoch(epoch), len, request },
            offset,
            data: data.clone(),
        };
        let mut parts = Vec::new();
        write_request_parts(id, &reservation, offset, &data, &mut parts).unwrap_or_else(|e| panic!("{e}"));
        let mut gathered = parts.clone();
        gathered.extend_from_slice(&data);
        prop_assert_eq!(&gathered, &request_frame(&owned, id));
        let frame = decode_one(&gathered).unwrap_or_else(|e| panic!("{e}"));
        let (r, at, bytes) = decode_write_request(&frame.body).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!((r.region, r.epoch, r.len, r.request), (RegionId(region), Epoch(epoch), len, request));
        prop_assert_eq!(at, offset);
        prop_assert_eq!(bytes, &data[..]);
        // One byte of the data changed on the way: the frame checksum refuses the frame.
        if !data.is_empty() {
            let last = gathered.len() - 1;
            gathered[last] ^= 1;
            prop_assert!(decode_one(&gathered).is_err());
        }
    }

    /// The borrowed PUT encoder and decoder agree byte for byte with `Request::Put`.
    #[test]
    fn borrowed_put_requests_match_the_owned_encoding(
        items in vec((key(), request_id(), data()), 0..6),
        id in any::<u64>(),
    ) {
        let owned = Request::Put {
            items: items
                .iter()
                .map(|(key, request, data)| PutItem { key: key.clone(), request: *request, data: data.clone() })
                .collect(),
        };
        let slices: Vec<BatchPut<'_>> =
            items.iter().map(|(key, request, src)| BatchPut { key, src, request: *request }).collect();
        let mut borrowed = Vec::new();
        encode_put_request(id, None, &slices, None, &mut borrowed).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(&borrowed, &request_frame(&owned, id));
        // The caller's own (right) checksums give the same bytes without hashing.
        let sums: Vec<Checksum> = items.iter().map(|(_, _, d)| Checksum::of(d)).collect();
        let mut given = Vec::new();
        encode_put_request(id, None, &slices, Some(&sums), &mut given).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(&given, &borrowed);
        // Sent in parts around payloads that are not copied: the same bytes again.
        let mut parts = Vec::new();
        put_request_parts(id, &slices, &sums, &mut parts).unwrap_or_else(|e| panic!("{e}"));
        let mut gathered = parts[..HEADER_BYTES].to_vec();
        slices.iter().for_each(|i| gathered.extend_from_slice(i.src));
        gathered.extend_from_slice(&parts[HEADER_BYTES..]);
        prop_assert_eq!(&gathered, &borrowed);
        let frame = decode_one(&borrowed).unwrap_or_else(|e| panic!("{e}"));
        let refs = decode_put_request(&frame.body).unwrap_or_else(|e| panic!("{e}"));
        let back: Vec<_> = refs.iter().map(|p| (p.key.clone(), p.request, p.data.to_vec())).collect();
        prop_assert_eq!(back, items.clone());
        prop_assert!(refs.iter().zip(&sums).all(|(p, s)| p.checksum == *s));
    }

    /// A PUT sent under a checksum its bytes do not have still decodes (the frame checksum
    /// covers only the trailer); the borrowed decode carries the writer's checksum for the
    /// store to compare, and the owned decode refuses it.
    #[test]
    fn a_put_under_a_wrong_checksum_reaches_the_store_only_as_a_mismatch(
        items in vec((key(), request_id(), data()), 1..6),
        wrong in any::<usize>(),
        id in any::<u64>(),
    ) {
        let slices: Vec<BatchPut<'_>> =
            items.iter().map(|(key, request, src)| BatchPut { key, src, request: *request }).collect();
        let mut sums: Vec<Checksum> = items.iter().map(|(_, _, d)| Checksum::of(d)).collect();
        let at = wrong % sums.len();
        sums[at] = Checksum(sums[at].0 ^ 1);
        let mut bytes = Vec::new();
        encode_put_request(id, None, &slices, Some(&sums), &mut bytes).unwrap_or_else(|e| panic!("{e}"));
        let frame = decode_one(&bytes).unwrap_or_else(|e| panic!("{e}"));
        let refs = decode_put_request(&frame.body).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(refs[at].checksum, sums[at]);
        prop_assert_ne!(Checksum::of(refs[at].data), refs[at].checksum);
        let owned = Request::from_frame(&frame);
        prop_assert!(matches!(owned, Err(WireError::BodyChecksum { .. })), "{:?}", owned);
    }

    #[test]
    fn request_round_trips_byte_exact(req in request(), id in any::<u64>(), sizes in chunks()) {
        let bytes = request_frame(&req, id);
        let outcomes = decode_chunked(&bytes, &sizes);
        prop_assert_eq!(outcomes.len(), 1);
        let frame = outcomes.into_iter().next().and_then(Result::ok);
        let frame = frame.unwrap_or_else(|| panic!("no frame for {req:?}"));
        prop_assert_eq!(frame.kind, Kind::Request);
        prop_assert_eq!(frame.op, req.op());
        prop_assert_eq!(frame.request_id, id);
        let back = Request::from_frame(&frame);
        prop_assert_eq!(back.as_ref(), Ok(&req));
        if let Ok(back) = back {
            prop_assert_eq!(request_frame(&back, id), bytes.clone());
        }
        prop_assert_eq!(frame.to_bytes(), Ok(bytes));
    }

    #[test]
    fn response_round_trips_byte_exact(resp in response(), id in any::<u64>(), sizes in chunks()) {
        let bytes = response_frame(&resp, id);
        let outcomes = decode_chunked(&bytes, &sizes);
        prop_assert_eq!(outcomes.len(), 1);
        let frame = outcomes.into_iter().next().and_then(Result::ok);
        let frame = frame.unwrap_or_else(|| panic!("no frame for {resp:?}"));
        prop_assert_eq!(frame.kind, Kind::Response);
        prop_assert_eq!(frame.op, resp.op());
        prop_assert_eq!(frame.request_id, id);
        let back = Response::from_frame(&frame);
        prop_assert_eq!(back.as_ref(), Ok(&resp));
        if let Ok(back) = back {
            prop_assert_eq!(response_frame(&back, id), bytes);
        }
    }

    #[test]
    fn a_stream_of_frames_decodes_in_order(
        reqs in vec(request(), 1..6),
        resps in vec(response(), 1..6),
        sizes in chunks(),
    ) {
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        for (i, req) in reqs.iter().enumerate() {
            let id = u64::try_from(i).unwrap_or(0);
            req.encode_frame(id, &mut stream).unwrap_or_else(|e| panic!("{e}"));
            expected.push((Kind::Request, req.op(), id));
        }
        for (i, resp) in resps.iter().enumerate() {
            let id = 1000 + u64::try_from(i).unwrap_or(0);
            resp.encode_frame(id, &mut stream).unwrap_or_else(|e| panic!("{e}"));
            expected.push((Kind::Response, resp.op(), id));
        }
        let outcomes = decode_chunked(&stream, &sizes);
        let frames: Vec<Frame> = outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|e| panic!("valid stream failed: {e}")))
            .collect();
        let got: Vec<_> = frames.iter().map(|f| (f.kind, f.op, f.request_id)).collect();
        prop_assert_eq!(got, expected);
        for (frame, req) in frames.iter().zip(&reqs) {
            let back = Request::from_frame(frame);
            prop_assert_eq!(back.as_ref(), Ok(req));
        }
        for (frame, resp) in frames.iter().skip(reqs.len()).zip(&resps) {
            let back = Response::from_frame(frame);
            prop_assert_eq!(back.as_ref(), Ok(resp));
        }
    }

    /// Frames, then garbage that is not a frame, then more frames: the frames before the garbage
    /// decode, the garbage fails the stream for good, nothing after it is decoded.
    #[test]
    fn garbage_between_frames_fails_the_stream(
        before in vec(request(), 1..3),
        garbage in vec(any::<u8>(), 1..80),
        after in request(),
        sizes in chunks(),
    ) {
        let mut stream = Vec::new();
        for (i, req) in before.iter().enumerate() {
            req.encode_frame(u64::try_from(i).unwrap_or(0), &mut stream)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        stream.extend_from_slice(&garbage);
        let tail = request_frame(&after, 99);
        stream.extend_from_slice(&tail);

        let outcomes = decode_chunked(&stream, &sizes);
        prop_assert_eq!(outcomes.len(), before.len() + 1, "outcomes: {:?}", outcomes);
        for (outcome, req) in outcomes.iter().zip(&before) {
            let frame = outcome.as_ref().unwrap_or_else(|e| panic!("frame before garbage: {e}"));
            let back = Request::from_frame(frame);
            prop_assert_eq!(back.as_ref(), Ok(req));
        }
        let last = outcomes.last().and_then(|o| o.as_ref().err());
        let last = last.unwrap_or_else(|| panic!("garbage was not refused"));
        prop_assert!(last.resync_impossible(), "garbage error {last} lets the stream continue");

        // The decoder stays failed: it takes no more bytes and repeats its error.
        let mut dec = FrameDecoder::new();
        let mut input = stream.as_slice();
        let mut first_error = None;
        while first_error.is_none() {
            match dec.feed(&mut input) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => first_error = Some(e),
            }
        }
        let first_error = first_error.unwrap_or_else(|| panic!("no error on a second pass"));
        prop_assert!(dec.is_failed());
        prop_assert_eq!(dec.push(&tail), 0);
        prop_assert_eq!(dec.next_frame(), Err(first_error));
        prop_assert_eq!(dec.buffer_capacity(), 0);
    }

    /// Arbitrary bytes never panic the decoder or the message decoders behind it.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..400), sizes in chunks()) {
        for frame in decode_chunked(&bytes, &sizes).into_iter().flatten() {
            let _ = Request::from_frame(&frame);
            let _ = Response::from_frame(&frame);
        }
    }

    /// Arbitrary bodies under every op never panic the message decoders, and whatever they
    /// accept encodes back to exactly the same body.
    #[test]
    fn arbitrary_bodies_never_panic(op in select(Op::ALL.to_vec()), body in vec(any::<u8>(), 0..200)) {
        if let Ok(req) = Request::decode_body(op, &body) {
            let mut again = Vec::new();
            prop_assert_eq!(req.encode_body(&mut again), Ok(()));
            prop_assert_eq!(again, body.clone());
        }
        if let Ok(resp) = Response::decode_body(op, &body) {
            let mut again = Vec::new();
            prop_assert_eq!(resp.encode_body(&mut again), Ok(()));
            let back = Response::decode_body(op, &again);
            prop_assert_eq!(back.as_ref(), Ok(&resp));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Representative messages (one of every op, with batches and every nested error kind)

fn sample_requests() -> Vec<Request> {
    let k1 = sample_key(0, &[1]);
    let k2 = sample_key(1, &[1, 2, 3]);
    vec![
        Request::Locate { keys: vec![k1.clone(), k2.clone()] },
        Request::Cluster { epoch: 7 },
        Request::FillBegin { key: Box::new(k1.clone()) },
        Request::FillFinish {
            lease: FillLease { ticket: FillTicket { fill: 3, epoch: Epoch(2) }, deadline_ms: 9 },
            stored: true,
        },
        Request::FillWait { ticket: FillTicket { fill: 3, epoch: Epoch(2) }, wait_ms: 500 },
        Request::Purge {
            scope: Box::new(
                PurgeScope::new(k2.clone(), "sglang-").unwrap_or_else(|e| panic!("{e}")),
            ),
        },
        Request::Hello {
            tenant: fixture::tenant(0),
            client_name: "vllm-worker-3".into(),
            rights: gpucache_dataplane::caller::Rights::READ_WRITE,
            auth: None,
        },
        Request::Hello {
            tenant: fixture::tenant(1),
            client_name: "vllm-worker-4".into(),
            rights: gpucache_dataplane::caller::Rights::READ_ONLY,
            auth: Some(HelloAuth {
                key_id: "k2026-11".into(),
                fingerprint: [7; 16],
                client_nonce: [9; 16],
                timestamp_ms: 1_790_000_000_000,
                seal: SealAlgorithm::Blake3,
            }),
        },
        Request::Info,
        Request::Epoch,
        Request::Stats,
        Request::Lookup { keys: vec![k1.clone(), k2.clone()] },
        Request::Get {
            items: vec![
                GetItem { key: k1.clone(), capacity: 4096 },
                GetItem { key: k2.clone(), capacity: 0 },
            ],
        },
        Request::Put {
            items: vec![
                PutItem { key: k1.clone(), request: Some(RequestId(7)), data: vec![1, 2, 3] },
                PutItem { key: k2.clone(), request: None, data: vec![] },
            ],
        },
        Request::Invalidate { keys: vec![k2.clone()] },
        Request::Reserve { key: Box::new(k1.clone()), len: 1 << 20, request: Some(RequestId(9)) },
        Request::Write { reservation: reservation(5, 2, 8, Some(9)), offset: 4, data: vec![9; 4] },
        Request::Commit { reservation: reservation(5, 2, 8, None) },
        Request::Abort { reservation: reservation(5, 2, 8, None), outcome: Retirement::Unknown },
        Request::ExpireLeases,
        Request::Attest { region: RegionId(77) },
        Request::BumpEpoch,
        Request::ReclaimFenced { epoch: Epoch(3) },
        Request::ShmAttach { len: 1 << 30 },
        Request::GetShared {
            items: vec![SharedGetItem { key: k1.clone(), offset: 4096, capacity: 1 << 20 }],
        },
        Request::PutShared {
            items: vec![SharedPutItem {
                key: k2.clone(),
                request: Some(RequestId(4)),
                offset: 0,
                len: 10,
                checksum: Checksum(5),
            }],
        },
        Request::NixlAttach { metadata: vec![1, 2, 3] },
        Request::StageGet { items: vec![GetItem { key: k1.clone(), capacity: 4096 }] },
        Request::ReservePut {
            key: Box::new(k2.clone()),
            len: 4096,
            checksum: Checksum(11),
            request: Some(RequestId(12)),
        },
        Request::CommitPut { stage: StageId(13) },
        Request::Release { stages: vec![StageId(1), StageId(2)] },
        Request::StageStats,
        Request::Limits,
        Request::Condition,
    ]
}

fn sample_responses() -> Vec<Response> {
    let t = fixture::tenant(2);
    vec![
        Response::Hello { version: VERSION, server: "gpucache".into(), session: None, local: None },
        Response::Hello {
            version: VERSION,
            server: "gpucache".into(),
            session: Some(HelloSession { server_nonce: [3; 16], seal: SealAlgorithm::HmacSha256 }),
            local: Some("/run/gpucache/gpucache.sock".into()),
        },
        Response::Info(RemoteInfo {
            name: "file".into(),
            implementation: Implementation::Simulated { seed: 5 },
            failures_retire: false,
            full_policy: FullPolicy::EvictOldest,
        }),
        Response::Epoch(Epoch(4)),
        Response::Stats(StoreStats { committed_blocks: 3, ..StoreStats::default() }),
        Response::Locate(vec![
            Ok(Located { lookup: Lookup::Hit { len: 10 }, tier: Some(Tier::Memory) }),
            Ok(Located {
                lookup: Lookup::PrefixHit { key: Box::new(sample_key(0, &[1])), len: 3 },
                tier: Some(Tier::File),
            }),
            Ok(Located { lookup: Lookup::Hit { len: 4 }, tier: None }),
            Ok(Located { lookup: Lookup::Miss(MissReason::Absent), tier: None }),
        ]),
        Response::Lookup(vec![
            Ok(Lookup::Hit { len: 10 }),
            Ok(Lookup::PrefixHit { key: Box::new(sample_key(0, &[1])), len: 3 }),
            Ok(Lookup::Miss(MissReason::NotReadable(BlockState::Writing))),
            Err(StoreError::WrongTenant { caller: t.clone(), owner: fixture::tenant(0) }),
        ]),
        Response::Get(vec![
            Ok(Fetched::Hit { checksum: Checksum::of(b"abc"), data: b"abc".to_vec() }),
            Ok(Fetched::Miss(MissReason::Corrupt)),
            Err(StoreError::BufferTooSmall { needed: 10, provided: 2 }),
        ]),
        Response::Put(vec![
            Ok(Put::Committed(Checksum(1))),
            Ok(Put::Refused(Refusal::DiskFull { free_bytes: 1, requested: 2 })),
            Err(StoreError::Replay(ReplayConflict { tenant: t.clone(), request: RequestId(3) })),
        ]),
        Response::Invalidate(vec![Ok(Invalidate::Busy)]),
        Response::Reserve(Ok(Reserve::Reserved(reservation(1, 1, 1, Some(2))))),
        Response::Write(Err(StoreError::Registry(RegistryError::WrongState {
            region: RegionId(1),
            state: "quarantined",
            operation: "settle",
        }))),
        Response::Commit(Err(StoreError::Lifecycle(IllegalTransition {
            region: RegionId(2),
            from: BlockState::Committed,
            transition: "commit",
            detail: "",
        }))),
        Response::Abort(Ok(Abort::Quarantined)),
        Response::ExpireLeases(Ok(2)),
        Response::Attest(Err(StoreError::Backend {
            operation: "attest",
            detail: "a drained attestation left the region quarantined".into(),
            retirement: Retirement::Unknown,
        })),
        Response::BumpEpoch(Err(StoreError::Registry(RegistryError::Epoch(
            EpochError::Unavailable { detail: "etcd down".into() },
        )))),
        Response::ReclaimFenced(Ok(0)),
        Response::ShmAttach(1 << 30),
        Response::GetShared(vec![
            Ok(Get::Hit { len: 3, checksum: Checksum(8) }),
            Ok(Get::Miss(MissReason::Corrupt)),
        ]),
        Response::PutShared(vec![Ok(Put::AlreadyCommitted)]),
        Response::NixlAttach(vec![9; 40]),
        Response::StageGet(vec![
            Ok(StagedGet::Staged {
                slot: StagedSlot { stage: StageId(4), descriptor: vec![7; 50], lease_ms: 30_000 },
                len: 4096,
                checksum: Checksum(5),
            }),
            Ok(StagedGet::Miss(MissReason::Absent)),
            Err(StoreError::WrongTenant { caller: t.clone(), owner: fixture::tenant(0) }),
        ]),
        Response::ReservePut(Ok(StagedSlot {
            stage: StageId(6),
            descriptor: vec![1],
            lease_ms: 5,
        })),
        Response::CommitPut(Ok(Put::Committed(Checksum(3)))),
        Response::Release(vec![true, false]),
        Response::StageStats(StagingStats {
            staged: 3,
            free_slots: 2,
            slot_bytes: 1 << 20,
            ..StagingStats::default()
        }),
        Response::Error(WireError::Staging {
            reason: StagingFailure::OverBudget,
            detail: "the connection holds 2 open stages".into(),
        }),
        Response::Error(WireError::UnsupportedVersion { found: 1, supported: VERSION }),
        Response::Limits(ServerLimits { object_bytes_max: Some(64 << 20) }),
        Response::Limits(ServerLimits { object_bytes_max: None }),
        Response::Condition(StoreCondition::default()),
        Response::Condition(StoreCondition {
            io_failure: Some(None),
            free_bytes: Some(12 << 30),
            block_overhead_bytes: 1 << 20,
        }),
        Response::Condition(StoreCondition {
            io_failure: Some(Some("write of blocks/ab/1: No space left on device".into())),
            free_bytes: Some(0),
            block_overhead_bytes: 1 << 20,
        }),
        Response::Error(WireError::UnknownTenant { tenant: t.clone() }),
        Response::Error(WireError::Overloaded {
            scope: InflightScope::Peer,
            requested: 64 << 20,
            in_flight: 1 << 30,
            max: 1 << 30,
        }),
        Response::Cluster(None),
        Response::FillBegin(Ok(FillStart::Join(FillTicket { fill: 3, epoch: Epoch(2) }))),
        Response::FillBegin(Err(FillRefused::Epoch { asked: 1, current: 2 })),
        Response::FillFinish(FillNotice::Finished),
        Response::FillWait(FillNotice::Fenced),
        Response::Purge(Ok(Purged { removed: 12, busy: 1, more: true })),
        Response::Cluster(Some(NodeStatus {
            node: NodeId(3),
            epoch: 9,
            not_admitting: Some(NotAdmitting::Draining),
        })),
        Response::Error(WireError::Fenced(FenceRefusal::StaleEpoch { sent: 2, current: 5 })),
        Response::Error(WireError::Fenced(FenceRefusal::NotAdmitting(NotAdmitting::NotOwner))),
    ]
}

fn sample_frames() -> Vec<Vec<u8>> {
    let mut frames: Vec<Vec<u8>> = sample_requests()
        .iter()
        .enumerate()
        .map(|(i, r)| request_frame(r, 100 + i as u64))
        .collect();
    frames.extend(sample_responses().iter().enumerate().map(|(i, r)| response_frame(r, i as u64)));
    frames
}

#[test]
fn samples_cover_every_op_and_round_trip() {
    let req_ops: HashSet<Op> = sample_requests().iter().map(Request::op).collect();
    let resp_ops: HashSet<Op> = sample_responses().iter().map(Response::op).collect();
    assert_eq!(req_ops.len(), Op::ALL.len() - 1, "every request op but ERROR");
    assert_eq!(resp_ops.len(), Op::ALL.len(), "every response op");
    for req in sample_requests() {
        let frame = decode_one(&request_frame(&req, 1)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Request::from_frame(&frame), Ok(req));
    }
    for resp in sample_responses() {
        let frame = decode_one(&response_frame(&resp, 1)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Response::from_frame(&frame), Ok(resp));
    }
}

// ---------------------------------------------------------------------------------------------
// Truncation and corruption

#[test]
fn every_truncated_frame_needs_more_bytes() {
    for bytes in sample_frames() {
        for cut in 0..bytes.len() {
            let mut dec = FrameDecoder::new();
            let used = dec.push(&bytes[..cut]);
            assert_eq!(used, cut, "a partial frame is taken whole");
            assert_eq!(dec.next_frame(), Ok(None), "prefix of {cut} of {} bytes", bytes.len());
            assert!(!dec.is_failed());
            assert_eq!(dec.is_idle(), cut == 0);
            // The rest completes exactly the original frame.
            let used = dec.push(&bytes[cut..]);
            assert_eq!(used, bytes.len() - cut);
            let frame = dec.next_frame().unwrap_or_else(|e| panic!("{e}"));
            let frame = frame.unwrap_or_else(|| panic!("complete frame not ready"));
            assert_eq!(frame.to_bytes(), Ok(bytes.clone()));
            assert!(dec.is_idle());
        }
    }
}

#[test]
fn every_truncated_body_is_refused() {
    for req in sample_requests() {
        let mut body = Vec::new();
        req.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
        // A PUT ends with its trailer's length, as a GET answer does (below).
        let trailer = req.op() == Op::Put;
        for cut in 0..body.len() {
            let result = Request::decode_body(req.op(), &body[..cut]);
            assert!(
                matches!(result, Err(WireError::Truncated { .. })) || (trailer && result.is_err()),
                "{:?} cut at {cut}: {result:?}",
                req.op()
            );
        }
        body.push(0);
        let result = Request::decode_body(req.op(), &body);
        assert!(
            result == Err(WireError::TrailingBytes { count: 1 }) || (trailer && result.is_err()),
            "{:?}: {result:?}",
            req.op()
        );
    }
    for resp in sample_responses() {
        let mut body = Vec::new();
        resp.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
        // A GET answer ends with its trailer's length, so a cut (or extra bytes) moves that
        // length: refused as a malformed trailer or as whatever it then points at.
        let trailer = resp.op() == Op::Get;
        for cut in 0..body.len() {
            let result = Response::decode_body(resp.op(), &body[..cut]);
            assert!(
                matches!(result, Err(WireError::Truncated { .. })) || (trailer && result.is_err()),
                "{:?} cut at {cut}: {result:?}",
                resp.op()
            );
        }
        body.extend_from_slice(&[1, 2]);
        let result = Response::decode_body(resp.op(), &body);
        assert!(
            result == Err(WireError::TrailingBytes { count: 2 }) || (trailer && result.is_err()),
            "{:?}: {result:?}",
            resp.op()
        );
    }
}

#[test]
fn every_header_corruption_fails_the_stream() {
    let req = Request::Lookup { keys: vec![sample_key(0, &[1, 2])] };
    let bytes = request_frame(&req, 0x0102_0304_0506_0708);
    for at in 0..HEADER_BYTES {
        for flip in 1..=255u8 {
            let mut bad = bytes.clone();
            bad[at] ^= flip;
            let err = match decode_one(&bad) {
                Err(e) => e,
                Ok(frame) => panic!("byte {at} ^ {flip:#x} decoded as {frame:?}"),
            };
            assert!(err.resync_impossible(), "byte {at} ^ {flip:#x}: {err}");
            assert_eq!(err.request_id, None, "an untrusted header names no request");
            match at {
                0..4 => assert!(matches!(err.error, WireError::BadMagic { .. }), "{err}"),
                4 => assert_eq!(
                    err.error,
                    WireError::UnsupportedVersion { found: VERSION ^ flip, supported: VERSION }
                ),
                _ => assert!(matches!(err.error, WireError::HeaderChecksum { .. }), "{err}"),
            }
        }
    }
}

#[test]
fn body_corruption_fails_only_that_frame() {
    let req = Request::Reserve { key: Box::new(sample_key(1, &[4])), len: 40, request: None };
    let bytes = request_frame(&req, 42);
    let next = request_frame(&Request::Epoch, 43);
    for at in HEADER_BYTES..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut stream = bytes.clone();
            stream[at] ^= flip;
            stream.extend_from_slice(&next);
            let outcomes = decode_chunked(&stream, &[7, 1, 300]);
            assert_eq!(outcomes.len(), 2, "byte {at}");
            let err = outcomes[0].as_ref().err().unwrap_or_else(|| panic!("byte {at} accepted"));
            assert!(matches!(err.error, WireError::BodyChecksum { .. }), "{err}");
            assert!(!err.resync_impossible());
            assert_eq!(err.request_id, Some(42));
            let frame = outcomes[1].as_ref().unwrap_or_else(|e| panic!("next frame: {e}"));
            assert_eq!(Request::from_frame(frame), Ok(Request::Epoch));
        }
    }
}

/// A PUT's frame checksum covers its trailer; a damaged payload byte reaches the store as a
/// payload that does not match its item's checksum (which the store refuses), and a damaged
/// trailer byte fails the frame alone.
#[test]
fn put_corruption_is_caught_by_the_frame_or_by_the_item_checksum() {
    let data = vec![0x5a; 40];
    let req = Request::Put {
        items: vec![PutItem { key: sample_key(1, &[4]), request: None, data: data.clone() }],
    };
    let bytes = request_frame(&req, 42);
    let next = request_frame(&Request::Epoch, 43);
    let payload = HEADER_BYTES..HEADER_BYTES + data.len();
    for at in HEADER_BYTES..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut stream = bytes.clone();
            stream[at] ^= flip;
            stream.extend_from_slice(&next);
            let outcomes = decode_chunked(&stream, &[7, 1, 300]);
            assert_eq!(outcomes.len(), 2, "byte {at}");
            if payload.contains(&at) {
                let frame = outcomes[0].as_ref().unwrap_or_else(|e| panic!("byte {at}: {e}"));
                let refs = decode_put_request(&frame.body).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(refs[0].checksum, Checksum::of(&data), "byte {at}");
                assert_ne!(Checksum::of(refs[0].data), refs[0].checksum, "byte {at}");
            } else {
                let err =
                    outcomes[0].as_ref().err().unwrap_or_else(|| panic!("byte {at} accepted"));
                assert!(
                    matches!(
                        err.error,
                        WireError::BodyChecksum { .. } | WireError::Malformed { .. }
                    ),
                    "byte {at}: {err}"
                );
                assert!(!err.resync_impossible());
                assert_eq!(err.request_id, Some(42));
            }
            let frame = outcomes[1].as_ref().unwrap_or_else(|e| panic!("next frame: {e}"));
            assert_eq!(Request::from_frame(frame), Ok(Request::Epoch));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Lengths and allocation

#[test]
fn oversize_body_len_is_refused_before_allocating() {
    for body_len in [u32::try_from(BODY_BYTES_MAX).unwrap_or(u32::MAX) + 1, u32::MAX] {
        let mut header = valid_header(Kind::Request, Op::Put, 5, &[]);
        header.body_len = body_len;
        let bytes = header.to_bytes();
        let mut dec = FrameDecoder::new();
        assert_eq!(dec.push(&bytes), HEADER_BYTES);
        assert_eq!(dec.buffer_capacity(), 0);
        let err = dec.next_frame().err().unwrap_or_else(|| panic!("{body_len} accepted"));
        assert_eq!(
            err.error,
            WireError::TooLarge { len: u64::from(body_len), max: BODY_BYTES_MAX as u64 }
        );
        assert_eq!(err.request_id, Some(5));
        assert!(err.resync_impossible());
        assert_eq!(dec.push(&[0; 4096]), 0, "a failed decoder takes nothing");
        assert_eq!(dec.buffer_capacity(), 0);
    }
}

#[test]
fn body_buffer_grows_with_the_bytes_received() {
    let len = BODY_BYTES_MAX;
    let mut header = valid_header(Kind::Request, Op::Put, 1, &[]);
    header.body_len = u32::try_from(len).unwrap_or(u32::MAX);
    let mut dec = FrameDecoder::new();
    assert_eq!(dec.push(&header.to_bytes()), HEADER_BYTES);
    assert!(
        dec.buffer_capacity() <= 64 << 10,
        "capacity {} before any body",
        dec.buffer_capacity()
    );
    let chunk = vec![0u8; 4096];
    let mut received = 0usize;
    while received < 2 << 20 {
        assert_eq!(dec.push(&chunk), chunk.len());
        received += chunk.len();
        let cap = dec.buffer_capacity();
        assert!(cap <= (2 * received).max(64 << 10), "capacity {cap} after {received} bytes");
        assert!(cap <= len);
        assert_eq!(dec.next_frame(), Ok(None));
    }
}

#[test]
fn a_full_size_body_is_accepted_and_one_byte_more_is_not() {
    // A WRITE whose data fills the body limit exactly.
    let fixed = 8 * 3 + 1 + 8 + 4; // reservation, offset, data length
    let data = vec![7u8; BODY_BYTES_MAX - fixed];
    let req = Request::Write { reservation: reservation(1, 1, 1, None), offset: 0, data };
    let bytes = request_frame(&req, 1);
    assert_eq!(bytes.len(), HEADER_BYTES + BODY_BYTES_MAX);
    let frame = decode_one(&bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(frame.body.capacity(), BODY_BYTES_MAX, "the buffer never exceeds the body");
    assert_eq!(Request::from_frame(&frame), Ok(req));

    let data = vec![7u8; BODY_BYTES_MAX - fixed + 1];
    let req = Request::Write { reservation: reservation(1, 1, 1, None), offset: 0, data };
    let mut out = vec![0xee];
    assert_eq!(
        req.encode_frame(1, &mut out),
        Err(WireError::TooLarge { len: BODY_BYTES_MAX as u64 + 1, max: BODY_BYTES_MAX as u64 })
    );
    assert_eq!(out, vec![0xee], "a refused encoding appends nothing");
}

// ---------------------------------------------------------------------------------------------
// Header fields

#[test]
fn unknown_versions_are_refused_after_five_bytes() {
    for version in [0u8, 1, 3, 0x7f, 0xff] {
        let mut header = valid_header(Kind::Request, Op::Epoch, 3, &[]);
        header.version = version;
        let bytes = header.to_bytes();
        let mut dec = FrameDecoder::new();
        assert_eq!(dec.push(&bytes[..4]), 4);
        assert_eq!(dec.next_frame(), Ok(None));
        assert_eq!(dec.push(&bytes[4..5]), 1);
        let err = dec.next_frame().err().unwrap_or_else(|| panic!("version {version} accepted"));
        assert_eq!(err.error, WireError::UnsupportedVersion { found: version, supported: VERSION });
        assert_eq!(err.request_id, None);
        assert!(err.resync_impossible());
        // The answer the server sends before closing.
        let reply = Response::Error(err.error.clone());
        let frame = decode_one(&response_frame(&reply, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Response::from_frame(&frame), Ok(reply));
    }
}

#[test]
fn unknown_ops_fail_only_their_frame() {
    let body = [1u8, 2, 3, 4, 5];
    let next = request_frame(&Request::Stats, 8);
    for (kind, op) in [(1u8, 0u8), (1, 34), (1, 200), (1, Op::Error.code()), (2, 0), (2, 254)] {
        let mut header = valid_header(Kind::Request, Op::Epoch, 7, &body);
        header.kind = kind;
        header.op = op;
        let mut stream = raw_frame(header, &body);
        stream.extend_from_slice(&next);
        let outcomes = decode_chunked(&stream, &[3]);
        assert_eq!(outcomes.len(), 2);
        assert_eq!(
            outcomes[0],
            Err(FrameError { error: WireError::UnknownOp { op }, request_id: Some(7) })
        );
        assert!(!WireError::UnknownOp { op }.closes_connection());
        let frame = outcomes[1].as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Request::from_frame(frame), Ok(Request::Stats));
    }
    // Every known op is accepted in a response, ERROR too.
    for op in Op::ALL {
        let header = valid_header(Kind::Response, op, 1, &[]);
        let frame = decode_one(&raw_frame(header, &[])).unwrap_or_else(|e| panic!("{op}: {e}"));
        assert_eq!(frame.op, op);
        assert_eq!(Op::from_code(op.code()), Some(op));
    }
}

#[test]
fn unknown_kinds_fail_only_their_frame() {
    for kind in [0u8, 3, 0xff] {
        let mut header = valid_header(Kind::Request, Op::Info, 11, &[0; 9]);
        header.kind = kind;
        let mut stream = raw_frame(header, &[0; 9]);
        stream.extend_from_slice(&request_frame(&Request::Info, 12));
        let outcomes = decode_chunked(&stream, &[64, 1]);
        assert_eq!(
            outcomes[0],
            Err(FrameError { error: WireError::UnknownKind { kind }, request_id: Some(11) })
        );
        assert!(outcomes[1].is_ok());
    }
}

#[test]
fn undefined_flags_and_a_stray_seal_are_refused() {
    for flags in [0x02, 0x80, 0xff] {
        let mut header = valid_header(Kind::Request, Op::Info, 1, &[]);
        header.flags = flags;
        let err = decode_one(&raw_frame(header, &[])).err();
        assert_eq!(
            err,
            Some(FrameError { error: WireError::UnsupportedFlags { flags }, request_id: Some(1) })
        );
    }
    let mut header = valid_header(Kind::Request, Op::Info, 2, &[]);
    header.seal = [0; SEAL_BYTES];
    header.seal[SEAL_BYTES - 1] = 1;
    let err = decode_one(&raw_frame(header, &[])).err();
    let err = err.unwrap_or_else(|| panic!("a nonzero seal slot was accepted unsealed"));
    assert!(matches!(err.error, WireError::Malformed { what: "seal slot" }), "{err}");
    assert!(!err.resync_impossible());
}

#[test]
fn sealed_frames_carry_their_seal_and_verify_only_under_their_key() {
    let key = SealKey::new(SealAlgorithm::Blake3, &[4; 32]);
    let other = SealKey::new(SealAlgorithm::Blake3, &[5; 32]);
    let request = Request::Lookup { keys: vec![sample_key(0, &[1, 2])] };
    let mut bytes = Vec::new();
    request.encode_sealed_frame(9, Some(&key), &mut bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(bytes[offset::FLAGS], FLAG_SEALED);
    let frame = decode_one(&bytes).unwrap_or_else(|e| panic!("{e}"));
    assert!(frame.seal.is_some());
    assert_eq!(frame.verify_seal(&key), Ok(()));
    assert_eq!(frame.verify_seal(&other), Err(WireError::SealMismatch));
    assert_eq!(frame.to_bytes().unwrap_or_default(), bytes, "a sealed frame re-encodes exactly");
    // The seal covers the header: the same body under another request id does not verify.
    let mut moved = frame.clone();
    moved.request_id = 10;
    assert_eq!(moved.verify_seal(&key), Err(WireError::SealMismatch));
    // ...and the kind: a request's seal does not verify as a response's.
    let mut flipped = frame.clone();
    flipped.kind = Kind::Response;
    assert_eq!(flipped.verify_seal(&key), Err(WireError::SealMismatch));
    // ...and the body.
    let mut tampered = frame;
    if let Some(b) = tampered.body.last_mut() {
        *b ^= 1;
    }
    assert_eq!(tampered.verify_seal(&key), Err(WireError::SealMismatch));
    let plain = decode_one(&request.to_frame_bytes(9).unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(plain.seal, None);
    assert_eq!(plain.verify_seal(&key), Err(WireError::Unsealed));
}

#[test]
fn header_layout_is_as_documented() {
    let header = FrameHeader {
        magic: MAGIC,
        version: VERSION,
        kind: Kind::Response.code(),
        op: Op::Put.code(),
        flags: 0,
        request_id: 0x1122_3344_5566_7788,
        body_len: 0x0a0b_0c0d,
        body_checksum: 0x99aa_bbcc_ddee_ff00,
        seal: [0x33; SEAL_BYTES],
    };
    let b = header.to_bytes();
    assert_eq!(&b[offset::MAGIC..4], b"GPCW");
    assert_eq!(b[offset::VERSION], 2);
    assert_eq!(b[offset::KIND], 2);
    assert_eq!(b[offset::OP], 7);
    assert_eq!(b[offset::FLAGS], 0);
    assert_eq!(
        b[offset::REQUEST_ID..offset::REQUEST_ID + 8],
        0x1122_3344_5566_7788u64.to_le_bytes()
    );
    assert_eq!(b[offset::BODY_LEN..offset::BODY_LEN + 4], 0x0a0b_0c0du32.to_le_bytes());
    assert_eq!(
        b[offset::BODY_CHECKSUM..offset::BODY_CHECKSUM + 8],
        0x99aa_bbcc_ddee_ff00u64.to_le_bytes()
    );
    assert_eq!(b[offset::SEAL..offset::SEAL + SEAL_BYTES], [0x33; SEAL_BYTES]);
    assert_eq!(offset::HEADER_CHECKSUM + 4, HEADER_BYTES);
    let sum = header_checksum(&b[..offset::HEADER_CHECKSUM]);
    assert_eq!(b[offset::HEADER_CHECKSUM..], sum.to_le_bytes());
    assert_eq!(FrameHeader::from_bytes(&b), header);
    let full = Checksum::of(&b[..offset::HEADER_CHECKSUM]).0;
    assert_eq!(u64::from(sum), full & 0xffff_ffff, "low 32 bits of XXH3-64");
}

/// Pins the exact bytes of two small frames: any change to the wire format shows up here.
#[test]
fn golden_frames() {
    let epoch = request_frame(&Request::Epoch, 7);
    let hex: String = epoch.iter().map(|b| format!("{b:02x}")).collect();
    let body_sum = Checksum::of(&[]).0.to_le_bytes();
    let mut expected = b"GPCW".to_vec();
    expected.extend_from_slice(&[2, 1, 3, 0]);
    expected.extend_from_slice(&7u64.to_le_bytes());
    expected.extend_from_slice(&0u32.to_le_bytes());
    expected.extend_from_slice(&body_sum);
    expected.extend_from_slice(&[0; SEAL_BYTES]);
    let sum = header_checksum(&expected);
    expected.extend_from_slice(&sum.to_le_bytes());
    assert_eq!(epoch, expected, "{hex}");
    assert_eq!(Checksum::of(&[]).0, 0x2d06_8005_38d3_94c2, "XXH3-64 of the empty string");

    let hello = Request::Hello {
        tenant: tenant_named("acme"),
        client_name: "w1".into(),
        rights: gpucache_dataplane::caller::Rights::ALL,
        auth: None,
    };
    let mut body = Vec::new();
    hello.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(body, [4, 0, 0, 0, b'a', b'c', b'm', b'e', 2, 0, 0, 0, b'w', b'1', 0b111, 0]);

    let reply = Response::Put(vec![
        Ok(Put::Busy),
        Err(StoreError::Backend {
            operation: "write",
            detail: "x".into(),
            retirement: Retirement::Unknown,
        }),
    ]);
    let mut body = Vec::new();
    reply.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    let expected: &[u8] = &[
        2, 0, 0, 0, // count
        0, 2, // Ok(Busy)
        1, 11, 5, 0, 0, 0, b'w', b'r', b'i', b't', b'e', 1, 0, 0, 0, b'x', 1, // Err(Backend)
    ];
    assert_eq!(body, expected);
}

#[test]
fn wrong_kind_is_typed() {
    let frame = decode_one(&request_frame(&Request::Info, 1)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        Response::from_frame(&frame),
        Err(WireError::WrongKind { expected: Kind::Response, found: Kind::Request })
    );
    let frame = decode_one(&response_frame(&Response::Epoch(Epoch(1)), 1))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        Request::from_frame(&frame),
        Err(WireError::WrongKind { expected: Kind::Request, found: Kind::Response })
    );
}

#[test]
fn feed_hands_out_frames_one_at_a_time() {
    let mut stream = request_frame(&Request::Info, 1);
    stream.extend_from_slice(&request_frame(&Request::Stats, 2));
    stream.extend_from_slice(&request_frame(&Request::Epoch, 3)[..10]);
    let mut dec = FrameDecoder::new();
    let mut input = stream.as_slice();
    let ids: Vec<u64> =
        std::iter::from_fn(|| dec.feed(&mut input).ok().flatten()).map(|f| f.request_id).collect();
    assert_eq!(ids, [1, 2]);
    assert!(input.is_empty());
    assert!(!dec.is_idle(), "ten bytes of the third frame are buffered");
    // push stops at the end of a frame until it is taken.
    let two = [request_frame(&Request::Info, 4), request_frame(&Request::Info, 5)].concat();
    let mut dec = FrameDecoder::new();
    let first = dec.push(&two);
    assert_eq!(first, two.len() / 2);
    assert_eq!(dec.push(&two[first..]), 0);
    assert_eq!(dec.next_frame().ok().flatten().map(|f| f.request_id), Some(4));
    assert_eq!(dec.push(&two[first..]), two.len() / 2);
    assert_eq!(dec.next_frame().ok().flatten().map(|f| f.request_id), Some(5));
    assert_eq!(dec.next_frame(), Ok(None));
}

// ---------------------------------------------------------------------------------------------
// Body strictness

fn body_of(req: &Request) -> Vec<u8> {
    let mut body = Vec::new();
    req.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    body
}

fn body_of_response(resp: &Response) -> Vec<u8> {
    let mut body = Vec::new();
    resp.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    body
}

#[test]
fn batch_counts_over_the_limit_are_refused_both_ways() {
    let key = sample_key(0, &[1]);
    let over = BATCH_ITEMS_MAX + 1;
    let req = Request::Lookup { keys: vec![key.clone(); over] };
    let mut out = vec![1, 2];
    assert_eq!(
        req.encode_frame(1, &mut out),
        Err(WireError::TooMany { what: "batch", count: over as u64, max: BATCH_ITEMS_MAX as u64 })
    );
    assert_eq!(out, [1, 2]);
    let resp = Response::Invalidate(vec![Ok(Invalidate::Absent); over]);
    assert!(matches!(resp.to_frame_bytes(1), Err(WireError::TooMany { what: "batch", .. })));

    let at_limit = Request::Lookup { keys: vec![key; BATCH_ITEMS_MAX] };
    let frame = decode_one(&request_frame(&at_limit, 1)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(Request::from_frame(&frame), Ok(at_limit));

    // A declared count over the limit is refused before anything is read or allocated.
    let body = u32::MAX.to_le_bytes();
    for op in [Op::Lookup, Op::Get, Op::Put, Op::Invalidate] {
        // A PUT's count is in its trailer, at the end of the body.
        let request =
            if op == Op::Put { [body, 4u32.to_le_bytes()].concat() } else { body.to_vec() };
        assert!(matches!(
            Request::decode_body(op, &request),
            Err(WireError::TooMany { what: "batch", count: 0xffff_ffff, .. })
        ));
        // A GET answer's count is in its trailer, at the end of the body.
        let answer =
            if op == Op::Get { [body, 4u32.to_le_bytes()].concat() } else { body.to_vec() };
        assert!(matches!(
            Response::decode_body(op, &answer),
            Err(WireError::TooMany { what: "batch", .. })
        ));
    }
    // A count within the limit but with fewer items than it declares is a truncation.
    assert_eq!(
        Request::decode_body(Op::Lookup, &5u32.to_le_bytes()),
        Err(WireError::Truncated { what: "key" })
    );
}

#[test]
fn get_capacities_are_bounded_both_ways() {
    let key = sample_key(0, &[1]);
    let half = PAYLOAD_BYTES_MAX / 2;
    let ok = Request::Get {
        items: vec![
            GetItem { key: key.clone(), capacity: half },
            GetItem { key: key.clone(), capacity: half },
        ],
    };
    assert!(ok.to_frame_bytes(1).is_ok());
    let over = Request::Get {
        items: vec![
            GetItem { key: key.clone(), capacity: half },
            GetItem { key: key.clone(), capacity: half + 1 },
        ],
    };
    let expected = WireError::TooMany {
        what: "get capacity bytes",
        count: PAYLOAD_BYTES_MAX + 1,
        max: PAYLOAD_BYTES_MAX,
    };
    assert_eq!(over.to_frame_bytes(1), Err(expected.clone()));
    // The same body built by hand is refused by the decoder.
    let mut body = body_of(&ok);
    let last = body.len() - 8;
    body[last..].copy_from_slice(&(half + 1).to_le_bytes());
    assert_eq!(Request::decode_body(Op::Get, &body), Err(expected));
    let single = Request::Get { items: vec![GetItem { key, capacity: u64::MAX }] };
    assert!(matches!(single.to_frame_bytes(1), Err(WireError::TooMany { .. })));
}

#[test]
fn a_bad_key_is_a_typed_malformed_body() {
    let keys = vec![sample_key(0, &[1]), sample_key(0, &[2]), sample_key(0, &[3])];
    let body = body_of(&Request::Lookup { keys: keys.clone() });
    let key_len = keys[0].encoded().len();
    // Break the magic of the third key: count (4), then (len 4 + key) per key.
    let third = 4 + 2 * (4 + key_len) + 4;
    let mut bad = body.clone();
    bad[third] = b'X';
    match Request::decode_body(Op::Lookup, &bad) {
        Err(WireError::BadKey { index: 2, detail }) => {
            assert!(detail.contains("magic"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    // A key length past the end of the body is a truncation, found before allocating.
    let mut huge = 1u32.to_le_bytes().to_vec();
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(Request::decode_body(Op::Lookup, &huge), Err(WireError::Truncated { what: "key" }));
    // A key over KEY_BYTES_MAX is refused by length, before the key decoder runs.
    let long = KEY_BYTES_MAX + 1;
    let mut body = 1u32.to_le_bytes().to_vec();
    body.extend_from_slice(&u32::try_from(long).unwrap_or(0).to_le_bytes());
    body.resize(body.len() + long, 0);
    assert_eq!(
        Request::decode_body(Op::Invalidate, &body),
        Err(WireError::TooMany {
            what: "key bytes",
            count: long as u64,
            max: KEY_BYTES_MAX as u64
        })
    );
    // A PrefixHit key in a response is checked the same way.
    let resp = Response::Lookup(vec![
        Ok(Lookup::Miss(MissReason::Absent)),
        Ok(Lookup::PrefixHit { key: Box::new(keys[0].clone()), len: 1 }),
    ]);
    let mut body = Vec::new();
    resp.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    let key_at = 4 + 3 + 2 + 4; // count, Ok Miss Absent, Ok PrefixHit, key length
    body[key_at + 4] = 0; // key version
    assert!(matches!(
        Response::decode_body(Op::Lookup, &body),
        Err(WireError::BadKey { index: 1, .. })
    ));
}

#[test]
fn bad_names_text_and_tags_are_typed() {
    // Tenant names must be valid TenantIds.
    let mut body = 3u32.to_le_bytes().to_vec();
    body.extend_from_slice(b"a b");
    body.extend_from_slice(&0u32.to_le_bytes());
    assert_eq!(
        Request::decode_body(Op::Hello, &body),
        Err(WireError::Malformed { what: "tenant" })
    );
    // Text must be UTF-8.
    let mut body = body_of(&Request::Hello {
        tenant: tenant_named("t"),
        client_name: "ab".into(),
        rights: gpucache_dataplane::caller::Rights::READ_ONLY,
        auth: None,
    });
    // The last text byte sits before the one-byte rights field and the credentials tag.
    let n = body.len();
    body[n - 3] = 0xff;
    assert_eq!(Request::decode_body(Op::Hello, &body), Err(WireError::Malformed { what: "text" }));
    // Unknown credentials tags are refused.
    body[n - 3] = b'b';
    body[n - 1] = 2;
    assert_eq!(
        Request::decode_body(Op::Hello, &body),
        Err(WireError::UnknownTag { what: "hello credentials", tag: 2 })
    );
    // Unknown rights bits are malformed.
    body[n - 1] = 0;
    body[n - 2] = 0b1000;
    assert_eq!(
        Request::decode_body(Op::Hello, &body),
        Err(WireError::Malformed { what: "rights" })
    );
    // Text is bounded.
    let mut body = 1u32.to_le_bytes().to_vec();
    body.push(b't');
    let long = TEXT_BYTES_MAX + 1;
    body.extend_from_slice(&u32::try_from(long).unwrap_or(0).to_le_bytes());
    body.extend_from_slice(&vec![b'a'; long]);
    assert_eq!(
        Request::decode_body(Op::Hello, &body),
        Err(WireError::TooMany { what: "text", count: long as u64, max: TEXT_BYTES_MAX as u64 })
    );
    // Unknown tags at every level.
    let mut abort = vec![0u8; 26]; // reservation (3 x u64, no request id), then the outcome
    abort[25] = 2;
    let result = Request::decode_body(Op::Abort, &abort);
    assert_eq!(result, Err(WireError::UnknownTag { what: "retirement", tag: 2 }));
    let cases: [(Op, &[u8], &str); 14] = [
        (Op::Invalidate, &[1, 0, 0, 0, 7], "result"),
        (Op::Invalidate, &[1, 0, 0, 0, 0, 3], "invalidate answer"),
        (Op::Write, &[1, 15], "store error"),
        (Op::Write, &[1, 14, 7], "cluster refusal"),
        (Op::Write, &[1, 9, 7], "registry error"),
        (Op::Info, &[0, 0, 0, 0, 2], "implementation"),
        (Op::Error, &[30], "wire error"),
        (Op::Error, &[29, 3], "cluster refusal"),
        (Op::Error, &[29, 2, 6], "not-admitting reason"),
        (Op::Cluster, &[2], "node status"),
        (Op::Error, &[26, 8], "staging failure"),
        (Op::Error, &[28, 3], "in-flight scope"),
        (Op::Error, &[21, 8], "auth failure"),
        (Op::Hello, &[2, 0, 0, 0, 0, 9], "hello credentials"),
    ];
    for (op, body, what) in cases {
        let result = Response::decode_body(op, body);
        assert!(
            matches!(result, Err(WireError::UnknownTag { what: w, .. }) if w == what),
            "{op}: {result:?}"
        );
    }
    // Bools are 0 or 1.
    let info = Response::Info(RemoteInfo {
        name: String::new(),
        implementation: Implementation::Real,
        failures_retire: true,
        full_policy: FullPolicy::Refuse,
    });
    let mut body = Vec::new();
    info.encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    body[5] = 2; // name length (4), implementation (1), then failures_retire
    assert_eq!(
        Response::decode_body(Op::Info, &body),
        Err(WireError::UnknownTag { what: "bool", tag: 2 })
    );
}

#[test]
fn long_text_is_clipped_at_a_character_boundary() {
    let detail = "é".repeat(TEXT_BYTES_MAX); // two bytes each
    let resp = Response::Write(Err(StoreError::Backend {
        operation: "write",
        detail: detail.clone(),
        retirement: Retirement::Unknown,
    }));
    let frame = decode_one(&response_frame(&resp, 1)).unwrap_or_else(|e| panic!("{e}"));
    match Response::from_frame(&frame) {
        Ok(Response::Write(Err(StoreError::Backend { detail: got, retirement, .. }))) => {
            assert_eq!(got.len(), TEXT_BYTES_MAX);
            assert!(detail.starts_with(&got));
            assert_eq!(retirement, Retirement::Unknown);
        }
        other => panic!("{other:?}"),
    }
    let odd = format!("a{}", "é".repeat(TEXT_BYTES_MAX));
    let resp = Response::Error(WireError::Internal { detail: odd });
    let frame = decode_one(&response_frame(&resp, 1)).unwrap_or_else(|e| panic!("{e}"));
    match Response::from_frame(&frame) {
        Ok(Response::Error(WireError::Internal { detail })) => {
            assert_eq!(detail.len(), TEXT_BYTES_MAX - 1)
        }
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Static strings and retirement

#[test]
fn static_strings_in_use_are_known() {
    // Every `&'static str` the dataplane and the backends put into a StoreError today.
    let in_use = [
        // StoreError::Backend.operation
        "write",
        "commit",
        "get",
        "reserve",
        "attest",
        // StoreError::Storage.operation and .step
        "invalidate",
        "unlink",
        "directory sync",
        "group flush",
        "block read",
        "block write",
        // RegistryError::WrongState.operation and .state
        "settle",
        "complete",
        "release",
        "be attested",
        "lent",
        "held",
        "quarantined",
        // IllegalTransition.transition and .detail
        "reserve",
        "begin_write",
        "commit",
        "abort",
        "quarantine",
        "evict",
        "release",
        "reclaim",
        "",
        " (the proof names another region)",
    ];
    for s in in_use {
        assert_eq!(intern(s), Some(s), "{s:?} is not in DATAPLANE_TEXT");
    }
    for s in WHAT_TEXT {
        assert_eq!(intern(s), Some(*s));
    }
    let distinct: HashSet<&str> = DATAPLANE_TEXT.iter().chain(WHAT_TEXT).copied().collect();
    assert_eq!(distinct.len(), DATAPLANE_TEXT.len() + WHAT_TEXT.len(), "duplicate table entry");
}

fn round_trip_error(e: StoreError) -> StoreError {
    let resp = Response::Write(Err(e));
    let frame = decode_one(&response_frame(&resp, 1)).unwrap_or_else(|e| panic!("{e}"));
    match Response::from_frame(&frame) {
        Ok(Response::Write(Err(e))) => e,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_storage_error_keeps_its_kind_path_and_effect_across_the_wire() {
    let path = std::path::Path::new("/store/blocks/ab/ab12-7.blk");
    let e = StoreError::storage(
        "invalidate",
        "unlink",
        path,
        &std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem),
        StorageEffect::Unchanged,
    );
    assert_eq!(round_trip_error(e.clone()), e);
    assert!(e.to_string().contains("ab12-7.blk"), "{e}");
    // A kind without a tag travels as Other; its message is still in the detail.
    let odd = StoreError::storage(
        "invalidate",
        "directory sync",
        path,
        &std::io::Error::from(std::io::ErrorKind::Deadlock),
        StorageEffect::NotDurable,
    );
    match round_trip_error(odd.clone()) {
        StoreError::Storage { kind, detail, effect, step, .. } => {
            assert_eq!(kind, std::io::ErrorKind::Other);
            assert_eq!(effect, StorageEffect::NotDurable);
            assert_eq!(step, "directory sync");
            let StoreError::Storage { detail: sent, .. } = odd else { unreachable!() };
            assert_eq!(detail, sent);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_io_error_keeps_its_kind_across_the_wire() {
    for kind in IO_KINDS {
        let e = StoreError::io("get", "transport", &std::io::Error::from(kind));
        assert_eq!(round_trip_error(e.clone()), e, "{kind:?}");
        let stored = StoreError::storage(
            "get",
            "block read",
            std::path::Path::new("/store/blocks/ab/ab12-7.blk"),
            &std::io::Error::from(kind),
            StorageEffect::Unchanged,
        );
        assert_eq!(round_trip_error(stored.clone()), stored, "{kind:?}");
    }
    // The tag is the kind's place in the table: pinned, because peers must agree on it.
    let e = StoreError::Io {
        operation: "put",
        kind: std::io::ErrorKind::ConnectionReset,
        detail: "d".into(),
        retirement: Retirement::Unknown,
    };
    let mut body = Vec::new();
    Response::Write(Err(e)).encode_body(&mut body).unwrap_or_else(|e| panic!("{e}"));
    let mut expected = vec![1, 13];
    expected.extend_from_slice(&3u32.to_le_bytes());
    expected.extend_from_slice(b"put");
    expected.push(25);
    expected.extend_from_slice(&1u32.to_le_bytes());
    expected.extend_from_slice(b"d");
    expected.push(1);
    assert_eq!(body, expected);
    // A kind without a tag travels as Other, with the system's message in the detail.
    let odd = StoreError::io(
        "get",
        "sidecar socket",
        &std::io::Error::from(std::io::ErrorKind::Deadlock),
    );
    match round_trip_error(odd.clone()) {
        StoreError::Io { kind, detail, retirement, .. } => {
            assert_eq!(kind, std::io::ErrorKind::Other);
            assert_eq!(retirement, Retirement::Retired);
            let StoreError::Io { detail: sent, .. } = odd else { unreachable!() };
            assert_eq!(detail, sent);
        }
        other => panic!("{other:?}"),
    }
    // An io kind tag past the table is refused.
    let mut bad = expected.clone();
    bad[2 + 4 + 3] = u8::try_from(IO_KINDS.len()).unwrap();
    assert!(matches!(
        Response::decode_body(Op::Write, &bad),
        Err(WireError::UnknownTag { what: "io error kind", .. })
    ));
}

#[test]
fn corrupt_drop_counts_cross_the_wire_by_phase_and_reason() {
    let mut drops = CorruptDrops::default();
    drops.add(CorruptPhase::Open, CorruptReason::Header, 2);
    drops.add(CorruptPhase::Get, CorruptReason::Checksum, 5);
    let stats = StoreStats { corrupt_dropped: drops, ..StoreStats::default() };
    let frame = decode_one(&response_frame(&Response::Stats(stats), 1)).expect("frame");
    match Response::from_frame(&frame) {
        Ok(Response::Stats(back)) => {
            assert_eq!(back, stats);
            assert_eq!(back.corrupt_dropped.total(), 7);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_static_strings_decode_to_remote() {
    let e = round_trip_error(StoreError::Backend {
        operation: "frobnicate",
        detail: "d".into(),
        retirement: Retirement::Unknown,
    });
    assert_eq!(
        e,
        StoreError::Backend {
            operation: REMOTE_TEXT,
            detail: "d".into(),
            retirement: Retirement::Unknown
        }
    );
    let e = round_trip_error(StoreError::Lifecycle(IllegalTransition {
        region: RegionId(1),
        from: BlockState::Absent,
        transition: "teleport",
        detail: " (because)",
    }));
    assert_eq!(
        e,
        StoreError::Lifecycle(IllegalTransition {
            region: RegionId(1),
            from: BlockState::Absent,
            transition: REMOTE_TEXT,
            detail: REMOTE_DETAIL,
        })
    );
    let e = round_trip_error(StoreError::Registry(RegistryError::WrongState {
        region: RegionId(1),
        state: "molten",
        operation: "settle",
    }));
    assert_eq!(
        e,
        StoreError::Registry(RegistryError::WrongState {
            region: RegionId(1),
            state: REMOTE_TEXT,
            operation: "settle",
        })
    );
}

#[test]
fn backend_retirement_survives_exactly() {
    for retirement in [Retirement::Retired, Retirement::Unknown] {
        for operation in ["reserve", "commit", "get"] {
            let e = StoreError::Backend { operation, detail: "io".into(), retirement };
            let back = round_trip_error(e.clone());
            assert_eq!(back.retirement(), retirement);
            assert_eq!(back, e);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Messages

fn every_store_error() -> Vec<StoreError> {
    let t = fixture::tenant(0);
    let u = fixture::tenant(1);
    vec![
        StoreError::WrongTenant { caller: t.clone(), owner: u.clone() },
        StoreError::Forbidden { tenant: t.clone(), right: Right::Admin },
        StoreError::EmptyObject,
        StoreError::UnknownReservation { region: RegionId(1) },
        StoreError::ReservationQuarantined { region: RegionId(1) },
        StoreError::WriteOutOfBounds { offset: 1, len: 2, capacity: 3 },
        StoreError::Incomplete { written: 1, expected: 2 },
        StoreError::BufferTooSmall { needed: 2, provided: 1 },
        StoreError::Replay(ReplayConflict { tenant: t.clone(), request: RequestId(1) }),
        StoreError::Registry(RegistryError::Full { regions: 1, max: 1 }),
        StoreError::Registry(RegistryError::Unknown(RegionId(1))),
        StoreError::Registry(RegistryError::WrongState {
            region: RegionId(1),
            state: "held",
            operation: "complete",
        }),
        StoreError::Registry(RegistryError::NotAuthorized {
            region: RegionId(1),
            caller: t.clone(),
            owner: u,
        }),
        StoreError::Registry(RegistryError::StaleEpoch { given: Epoch(1), current: Epoch(2) }),
        StoreError::Registry(RegistryError::Epoch(EpochError::Unavailable { detail: "x".into() })),
        StoreError::Registry(RegistryError::Epoch(EpochError::Exhausted { at: Epoch(9) })),
        StoreError::Registry(RegistryError::IdsExhausted),
        StoreError::Lifecycle(IllegalTransition {
            region: RegionId(1),
            from: BlockState::Quarantined,
            transition: "reclaim",
            detail: " (the proof names another region)",
        }),
        StoreError::Backend {
            operation: "get",
            detail: "x".into(),
            retirement: Retirement::Retired,
        },
    ]
}

fn every_refusal() -> Vec<Refusal> {
    let t = fixture::tenant(0);
    vec![
        Refusal::ObjectTooLarge { bytes: 2, max: 1 },
        Refusal::InflightRequests { current: 1, max: 1 },
        Refusal::Registrations { current: 1, max: 1 },
        Refusal::Tenants { current: 1, max: 1 },
        Refusal::RetainedBytes { current: 1, requested: 1, max: 1 },
        Refusal::TenantRetainedBytes { tenant: t.clone(), current: 1, requested: 1, max: 1 },
        Refusal::TenantInflightBytes { tenant: t, current: 1, requested: 1, max: 1 },
        Refusal::IdempotencyTable { entries: 1, max: 1 },
        Refusal::DiskFull { free_bytes: 1, requested: 2 },
    ]
}

fn every_wire_error() -> Vec<WireError> {
    vec![
        WireError::UnsupportedVersion { found: 1, supported: 2 },
        WireError::BadMagic { found: *b"HTTP" },
        WireError::HeaderChecksum { found: 1, computed: 2 },
        WireError::TooLarge { len: 2, max: 1 },
        WireError::UnknownKind { kind: 9 },
        WireError::UnknownOp { op: 9 },
        WireError::UnsupportedFlags { flags: 1 },
        WireError::BodyChecksum { found: 1, computed: 2 },
        WireError::Truncated { what: "key" },
        WireError::TrailingBytes { count: 1 },
        WireError::UnknownTag { what: "refusal", tag: 9 },
        WireError::TooMany { what: "batch", count: 2, max: 1 },
        WireError::BadKey { index: 0, detail: "bad magic".into() },
        WireError::Malformed { what: "tenant" },
        WireError::WrongKind { expected: Kind::Request, found: Kind::Response },
        WireError::ResponseTooLarge { len: 2, max: 1 },
        WireError::NotAuthenticated,
        WireError::AlreadyAuthenticated,
        WireError::Busy { connections: 1, max: 1 },
        WireError::ShuttingDown,
        WireError::Internal { detail: "bug".into() },
        WireError::AuthFailed { reason: AuthFailure::KeyExpired },
        WireError::Unsealed,
        WireError::SealMismatch,
        WireError::Replayed { request_id: 1 },
        WireError::SharedMemory { detail: "no segment".into() },
        WireError::UnknownTenant { tenant: fixture::tenant(1) },
        WireError::Overloaded { scope: InflightScope::Tenant, requested: 3, in_flight: 2, max: 4 },
        WireError::Fenced(FenceRefusal::NodeBehind { sent: 4, current: 3 }),
    ]
}

fn assert_displays_distinct<T: std::fmt::Display>(label: &str, values: &[T]) {
    let mut seen = HashSet::new();
    for v in values {
        let text = v.to_string();
        assert!(!text.trim().is_empty(), "{label}: empty Display");
        assert!(seen.insert(text.clone()), "{label}: {text:?} shown twice");
    }
}

#[test]
fn every_error_displays_distinctly() {
    assert_displays_distinct("StoreError", &every_store_error());
    assert_displays_distinct("Refusal", &every_refusal());
    assert_displays_distinct("WireError", &every_wire_error());
    let frame_errors: Vec<FrameError> = every_wire_error()
        .into_iter()
        .map(|error| FrameError { error, request_id: None })
        .collect();
    assert_displays_distinct("FrameError", &frame_errors);
}

#[test]
fn every_variant_round_trips() {
    for e in every_store_error() {
        assert_eq!(round_trip_error(e.clone()), e);
    }
    let resp = Response::Put(every_refusal().into_iter().map(|r| Ok(Put::Refused(r))).collect());
    let frame = decode_one(&response_frame(&resp, 1)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(Response::from_frame(&frame), Ok(resp));
    for e in every_wire_error() {
        let resp = Response::Error(e);
        let frame = decode_one(&response_frame(&resp, 1)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Response::from_frame(&frame), Ok(resp));
    }
}

#[test]
fn which_errors_close_the_connection() {
    let closing: Vec<WireError> =
        every_wire_error().into_iter().filter(WireError::closes_connection).collect();
    assert_eq!(
        closing,
        vec![
            WireError::UnsupportedVersion { found: 1, supported: 2 },
            WireError::BadMagic { found: *b"HTTP" },
            WireError::HeaderChecksum { found: 1, computed: 2 },
            WireError::TooLarge { len: 2, max: 1 },
            WireError::Busy { connections: 1, max: 1 },
            WireError::ShuttingDown,
            WireError::AuthFailed { reason: AuthFailure::KeyExpired },
            WireError::Unsealed,
            WireError::SealMismatch,
            WireError::Overloaded {
                scope: InflightScope::Tenant,
                requested: 3,
                in_flight: 2,
                max: 4
            },
        ]
    );
}

#[test]
fn remote_info_carries_the_store_info() {
    let info = gpucache_dataplane::store::StoreInfo {
        name: "memory",
        implementation: Implementation::Real,
        failures_retire: true,
        full_policy: FullPolicy::Refuse,
    };
    let remote = RemoteInfo::from(info);
    assert_eq!(remote.name, "memory");
    assert!(remote.failures_retire);
}
