//! The lifecycle state machine, limits, the region table and every error's message.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small, bounded values

use gpucache_dataplane::caller::{Caller, Right, Rights};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::KeyDigest;
use gpucache_dataplane::lifecycle::{BlockState, IllegalTransition, Lifecycle, Transition};
use gpucache_dataplane::limits::{
    IdempotencyTable, Ledger, LimitsError, Refusal, Replay, ReplayConflict, RequestId,
    ResourceLimits,
};
use gpucache_dataplane::registry::{
    AttestOutcome, Attestation, BindError, Completion, Epoch, EpochError, MemoryKind, PoolError,
    RegionId, RegionTable, RegistryError,
};
use gpucache_dataplane::store::{Retirement, StoreError, WRITE_PIECES_MAX, WrittenRanges};
use proptest::prelude::*;

fn tenant(s: &str) -> TenantId {
    TenantId::parse(s).unwrap()
}

const STATES: [BlockState; 6] = [
    BlockState::Absent,
    BlockState::Reserved,
    BlockState::Writing,
    BlockState::Committed,
    BlockState::Evicting,
    BlockState::Quarantined,
];

/// Drives a fresh lifecycle to `target` along legal edges.
fn at(target: BlockState) -> Lifecycle {
    let mut l = Lifecycle::new(RegionId(1));
    let path: &[fn() -> Transition] = match target {
        BlockState::Absent => &[],
        BlockState::Reserved => &[|| Transition::Reserve],
        BlockState::Writing => &[|| Transition::Reserve, || Transition::BeginWrite],
        BlockState::Committed => {
            &[|| Transition::Reserve, || Transition::BeginWrite, || Transition::Commit]
        }
        BlockState::Evicting => &[
            || Transition::Reserve,
            || Transition::BeginWrite,
            || Transition::Commit,
            || Transition::Evict,
        ],
        BlockState::Quarantined => &[|| Transition::Reserve, || Transition::Quarantine],
    };
    for t in path {
        l.apply(t()).unwrap();
    }
    assert_eq!(l.state(), target);
    l
}

#[test]
fn lifecycle_allows_exactly_the_documented_edges() {
    use BlockState::*;
    let legal: &[(BlockState, &str, BlockState)] = &[
        (Absent, "reserve", Reserved),
        (Reserved, "begin_write", Writing),
        (Reserved, "abort", Absent),
        (Reserved, "quarantine", Quarantined),
        (Writing, "commit", Committed),
        (Writing, "abort", Absent),
        (Writing, "quarantine", Quarantined),
        (Committed, "evict", Evicting),
        (Evicting, "release", Absent),
        (Evicting, "quarantine", Quarantined),
    ];
    type Named = (&'static str, fn() -> Transition);
    let transitions: [Named; 7] = [
        ("reserve", || Transition::Reserve),
        ("begin_write", || Transition::BeginWrite),
        ("commit", || Transition::Commit),
        ("abort", || Transition::Abort),
        ("quarantine", || Transition::Quarantine),
        ("evict", || Transition::Evict),
        ("release", || Transition::Release),
    ];
    for from in STATES {
        for (name, make) in transitions {
            let mut l = at(from);
            let want =
                legal.iter().find(|(f, n, _)| *f == from && *n == name).map(|(_, _, to)| *to);
            match (l.apply(make()), want) {
                (Ok(to), Some(w)) => assert_eq!(to, w, "{from} --{name}-->"),
                (Err(e), None) => {
                    assert_eq!(
                        e,
                        IllegalTransition {
                            region: RegionId(1),
                            from,
                            transition: name,
                            detail: ""
                        }
                    );
                    assert_eq!(l.state(), from, "an illegal transition changed the state");
                }
                (got, want) => panic!("{from} --{name}--> gave {got:?}, expected {want:?}"),
            }
        }
    }
    assert!(STATES.iter().all(|s| s.is_readable() == (*s == Committed)));
}

#[test]
fn only_a_matching_registry_proof_leaves_quarantine() {
    let owner = Caller::new(tenant("a"), Rights::READ_WRITE);
    let mut table = RegionTable::local(8);
    let r1 = table.lend(&owner.tenant, MemoryKind::Host, 10, None).unwrap();
    let r2 = table.lend(&owner.tenant, MemoryKind::Host, 10, None).unwrap();
    table.complete(r1, Completion::Unknown).unwrap();
    table.complete(r2, Completion::Unknown).unwrap();
    let mut block = Lifecycle::new(r1);
    block.apply(Transition::Reserve).unwrap();
    block.apply(Transition::Quarantine).unwrap();
    let AttestOutcome::Reclaimed(wrong) = table.attest(&owner, r2, Attestation::Drained).unwrap()
    else {
        panic!("drained attestation did not reclaim")
    };
    let e = block.apply(Transition::Reclaim(wrong)).unwrap_err();
    assert_eq!(e.detail, " (the proof names another region)");
    assert_eq!(block.state(), BlockState::Quarantined);
    assert_eq!(
        table.attest(&owner, r1, Attestation::KnownIdle).unwrap(),
        AttestOutcome::StillQuarantined
    );
    let AttestOutcome::Reclaimed(right) = table.attest(&owner, r1, Attestation::Drained).unwrap()
    else {
        panic!("drained attestation did not reclaim")
    };
    assert_eq!(block.apply(Transition::Reclaim(right)).unwrap(), BlockState::Absent);
}

#[test]
fn region_table_rules() {
    let t = tenant("a");
    let mut table =
        RegionTable::new(2, Epoch(7), 100, Box::new(gpucache_dataplane::registry::LocalEpochs));
    let a = table.lend(&t, MemoryKind::Gpu { device: 0 }, 1, Some(50)).unwrap();
    assert_eq!(a, RegionId(100), "a restarted owner continues above its old ids");
    let b = table.lend(&t, MemoryKind::DpuSlab, 1, None).unwrap();
    assert_eq!(
        table.lend(&t, MemoryKind::Host, 1, None),
        Err(RegistryError::Full { regions: 2, max: 2 })
    );
    table.settle(b).unwrap();
    assert!(matches!(
        table.complete(b, Completion::Unknown),
        Err(RegistryError::WrongState { .. })
    ));
    assert_eq!(table.expire_leases(49), vec![]);
    assert_eq!(table.expire_leases(50), vec![a]);
    let e = table.bump_epoch().unwrap();
    assert_eq!(e, Epoch(8));
    let proofs = table.reclaim_fenced(e).unwrap();
    assert_eq!(proofs.len(), 1, "held regions survive the fence");
    assert_eq!(proofs[0].region(), a);
    table.release_held(b).unwrap();
    assert!(table.is_empty());
    assert_eq!(table.lend(&t, MemoryKind::Host, 1, None).unwrap(), RegionId(102));
}

#[test]
fn limits_validate() {
    assert!(ResourceLimits::default().validate().is_ok());
    let zero = ResourceLimits { registrations_max: 0, ..ResourceLimits::default() };
    assert_eq!(zero.validate(), Err(LimitsError::Zero { name: "registrations_max" }));
    let inverted = ResourceLimits {
        tenant_retained_bytes_max: 10,
        retained_bytes_max: 5,
        object_bytes_max: 1,
        ..ResourceLimits::default()
    };
    assert_eq!(
        inverted.validate(),
        Err(LimitsError::Inconsistent {
            smaller: "tenant_retained_bytes_max",
            smaller_value: 10,
            larger: "retained_bytes_max",
            larger_value: 5
        })
    );
    assert!(Ledger::new(zero).is_err());
}

#[test]
fn ledger_charges_and_releases_in_pairs() {
    let limits = ResourceLimits { inflight_requests_max: 2, ..ResourceLimits::default() };
    let mut l = Ledger::new(limits).unwrap();
    let a = tenant("a");
    l.admit_block(&a, 100).unwrap();
    l.begin_request().unwrap();
    assert_eq!(l.begin_request(), Err(Refusal::InflightRequests { current: 2, max: 2 }));
    l.end_request();
    l.finish_write(&a, 100);
    assert_eq!(l.tenant(&a).inflight_bytes, 0);
    assert_eq!(l.tenant(&a).retained_bytes, 100);
    assert_eq!(l.usage().tenants, 1);
    l.release_block(&a, 100);
    assert_eq!(l.usage(), Default::default());
}

#[test]
fn idempotency_table_expires_and_caps() {
    let limits = ResourceLimits {
        idempotency_entries_max: 2,
        idempotency_ttl_ms: 10,
        ..ResourceLimits::default()
    };
    let mut t = IdempotencyTable::new(&limits);
    let a = tenant("a");
    let k1 = KeyDigest::of(b"1");
    let k2 = KeyDigest::of(b"2");
    assert_eq!(t.check(&a, RequestId(1), k1, 0), Ok(None));
    t.insert_pending(&a, RequestId(1), k1).unwrap();
    assert_eq!(t.check(&a, RequestId(1), k1, 0), Ok(Some(Replay::InProgress)));
    assert_eq!(
        t.check(&a, RequestId(1), k2, 0),
        Err(ReplayConflict { tenant: a.clone(), request: RequestId(1) })
    );
    t.commit(&a, RequestId(1), 5);
    t.insert_pending(&a, RequestId(2), k2).unwrap();
    assert_eq!(
        t.insert_pending(&a, RequestId(3), k2),
        Err(Refusal::IdempotencyTable { entries: 2, max: 2 })
    );
    assert_eq!(t.check(&a, RequestId(1), k1, 14), Ok(Some(Replay::Committed)));
    assert_eq!(
        t.check(&a, RequestId(1), k1, 15),
        Ok(None),
        "committed entries expire after the ttl"
    );
    assert_eq!(t.len(), 1, "pending entries never expire");
    t.forget(&a, RequestId(2));
    assert!(t.is_empty());
}

#[test]
fn every_error_message_carries_its_facts() {
    let a = tenant("a");
    let b = tenant("b");
    let texts: Vec<(String, &str)> = vec![
        (Refusal::ObjectTooLarge { bytes: 9, max: 8 }.to_string(), "object_bytes_max 8"),
        (
            Refusal::InflightRequests { current: 3, max: 3 }.to_string(),
            "inflight_requests_max is 3",
        ),
        (Refusal::Registrations { current: 4, max: 4 }.to_string(), "registrations_max is 4"),
        (Refusal::Tenants { current: 2, max: 2 }.to_string(), "tenants_max is 2"),
        (
            Refusal::RetainedBytes { current: 1, requested: 2, max: 2 }.to_string(),
            "retained_bytes_max 2",
        ),
        (
            Refusal::TenantRetainedBytes { tenant: a.clone(), current: 1, requested: 2, max: 2 }
                .to_string(),
            "tenant a retains 1",
        ),
        (
            Refusal::TenantInflightBytes { tenant: a.clone(), current: 1, requested: 2, max: 2 }
                .to_string(),
            "tenant_inflight_bytes_max is 2",
        ),
        (
            Refusal::IdempotencyTable { entries: 5, max: 5 }.to_string(),
            "idempotency_entries_max is 5",
        ),
        (
            Refusal::DiskFull { free_bytes: 3, requested: 4 }.to_string(),
            "3 bytes free, 4 requested",
        ),
        (LimitsError::Zero { name: "tenants_max" }.to_string(), "tenants_max is zero"),
        (
            LimitsError::Inconsistent {
                smaller: "x",
                smaller_value: 2,
                larger: "y",
                larger_value: 1,
            }
            .to_string(),
            "x (2) exceeds y (1)",
        ),
        (RegistryError::Full { regions: 2, max: 2 }.to_string(), "limit is 2"),
        (RegistryError::Unknown(RegionId(5)).to_string(), "r5"),
        (
            RegistryError::WrongState { region: RegionId(5), state: "held", operation: "settle" }
                .to_string(),
            "held",
        ),
        (
            RegistryError::NotAuthorized {
                region: RegionId(5),
                caller: b.clone(),
                owner: a.clone(),
            }
            .to_string(),
            "tenant b may not attest",
        ),
        (
            RegistryError::StaleEpoch { given: Epoch(1), current: Epoch(2) }.to_string(),
            "current epoch is e2",
        ),
        (
            RegistryError::Epoch(EpochError::Unavailable { detail: "down".into() }).to_string(),
            "down",
        ),
        (
            RegistryError::Epoch(EpochError::Exhausted { at: Epoch(u64::MAX) }).to_string(),
            "exhausted",
        ),
        (RegistryError::IdsExhausted.to_string(), "id space"),
        (
            PoolError::Exhausted { requested: 3, free: 1, total: 4 }.to_string(),
            "3 slots refused: 1 free of 4",
        ),
        (
            PoolError::Bind(BindError {
                slot: 2,
                kind: MemoryKind::NicRegistered { transport: "verbs" },
                detail: "EPERM".into(),
            })
            .to_string(),
            "EPERM",
        ),
        (
            IllegalTransition {
                region: RegionId(3),
                from: BlockState::Committed,
                transition: "commit",
                detail: "",
            }
            .to_string(),
            "cannot commit from COMMITTED",
        ),
        (ReplayConflict { tenant: a.clone(), request: RequestId(4) }.to_string(), "already used"),
        (
            StoreError::WrongTenant { caller: b.clone(), owner: a.clone() }.to_string(),
            "tenant b may not use a key of tenant a",
        ),
        (
            StoreError::Forbidden { tenant: a.clone(), right: Right::Admin }.to_string(),
            "lacks the admin right",
        ),
        (StoreError::EmptyObject.to_string(), "at least one byte"),
        (StoreError::UnknownReservation { region: RegionId(9) }.to_string(), "r9 is not open"),
        (StoreError::ReservationQuarantined { region: RegionId(9) }.to_string(), "quarantined"),
        (
            StoreError::WriteOutOfBounds { offset: 1, len: 2, capacity: 2 }.to_string(),
            "2-byte reservation",
        ),
        (StoreError::Incomplete { written: 1, expected: 2 }.to_string(), "1 of 2 bytes"),
        (StoreError::BufferTooSmall { needed: 5, provided: 4 }.to_string(), "holds 4 bytes"),
        (
            StoreError::Replay(ReplayConflict { tenant: a.clone(), request: RequestId(1) })
                .to_string(),
            "request id",
        ),
        (StoreError::Registry(RegistryError::IdsExhausted).to_string(), "id space"),
        (
            StoreError::Lifecycle(IllegalTransition {
                region: RegionId(1),
                from: BlockState::Absent,
                transition: "evict",
                detail: "",
            })
            .to_string(),
            "ABSENT",
        ),
        (
            StoreError::Backend {
                operation: "get",
                detail: "EIO".into(),
                retirement: Retirement::Unknown,
            }
            .to_string(),
            "get failed in the backend: EIO",
        ),
        (
            StoreError::io(
                "put",
                "transport",
                &std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            )
            .to_string(),
            "put failed in the backend: transport: connection refused",
        ),
    ];
    for (text, needle) in texts {
        assert!(text.contains(needle), "{text:?} lacks {needle:?}");
    }
    assert_eq!(
        StoreError::Backend {
            operation: "x",
            detail: String::new(),
            retirement: Retirement::Unknown
        }
        .retirement(),
        Retirement::Unknown
    );
    assert_eq!(StoreError::EmptyObject.retirement(), Retirement::Retired);
}

/// An error built from a system I/O error keeps its kind; the store's own refusals have none.
#[test]
fn io_failures_keep_their_kind() {
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    let e = StoreError::io("get", "transport", &refused);
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::ConnectionRefused));
    assert_eq!(e.retirement(), Retirement::Retired);
    assert!(e.is_backend_failure());
    let unknown = StoreError::Io {
        operation: "get",
        kind: std::io::ErrorKind::BrokenPipe,
        detail: "sidecar socket: broken pipe".into(),
        retirement: Retirement::Unknown,
    };
    assert_eq!(unknown.retirement(), Retirement::Unknown);
    let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
    let storage = StoreError::storage(
        "get",
        "block read",
        std::path::Path::new("/cache/b.blk"),
        &denied,
        gpucache_dataplane::store::StorageEffect::Unchanged,
    );
    assert_eq!(storage.io_kind(), Some(std::io::ErrorKind::PermissionDenied));
    assert!(storage.is_backend_failure());
    let backend = StoreError::Backend {
        operation: "get",
        detail: "x".into(),
        retirement: Retirement::Retired,
    };
    assert_eq!(backend.io_kind(), None);
    assert!(backend.is_backend_failure());
    assert_eq!(StoreError::EmptyObject.io_kind(), None);
    assert!(!StoreError::EmptyObject.is_backend_failure());
}

#[test]
fn written_ranges_are_bounded() {
    let mut w = WrittenRanges::default();
    for i in 0..WRITE_PIECES_MAX as u64 {
        w.add(i * 2, i * 2 + 1).unwrap();
    }
    let before = w.clone();
    assert!(w.add(u64::MAX - 1, u64::MAX).is_err());
    assert_eq!(w, before, "a refused piece changed the record");
    w.add(0, 2 * WRITE_PIECES_MAX as u64).unwrap();
    assert_eq!(w.covered(), 2 * WRITE_PIECES_MAX as u64);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn written_ranges_match_a_bitmap(pieces in proptest::collection::vec((0u64..200, 0u64..60), 0..40)) {
        let mut w = WrittenRanges::default();
        let mut bits = [false; 260];
        for (start, len) in pieces {
            w.add(start, start + len).unwrap();
            for b in &mut bits[start as usize..(start + len) as usize] {
                *b = true;
            }
            prop_assert_eq!(w.covered(), bits.iter().filter(|b| **b).count() as u64);
        }
    }
}
