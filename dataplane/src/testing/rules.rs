//! One targeted test per contract rule. Each builds a fresh store through the backend's
//! factory and fails with a message naming the rule.

use crate::BlockState;
use crate::caller::{Caller, Rights};
use crate::checksum::Checksum;
use crate::clock::ManualClock;
use crate::identity::KvDtype;
use crate::limits::{Refusal, RequestId, ResourceLimits};
use crate::registry::{Epoch, RegionId, RegistryError};
use crate::store::{
    Abort, CorruptPhase, CorruptReason, FullPolicy, Get, Invalidate, Lookup, MissReason, Put,
    Reservation, Reserve, Retirement, StoreError,
};

use super::fixture::{admin, caller, key, payload, tenant};
use super::subject::{MakeSubject, Subject};

fn roomy() -> ResourceLimits {
    ResourceLimits {
        object_bytes_max: 1 << 20,
        retained_bytes_max: 64 << 20,
        tenant_retained_bytes_max: 32 << 20,
        tenant_inflight_bytes_max: 16 << 20,
        write_lease_ms: 1000,
        idempotency_ttl_ms: 5000,
        ..ResourceLimits::default()
    }
}

fn fresh(make: &MakeSubject, limits: ResourceLimits) -> (Subject, ManualClock) {
    let clock = ManualClock::default();
    (make(limits, clock.clone()), clock)
}

fn reserved(r: Result<Reserve, StoreError>) -> Reservation {
    match r {
        Ok(Reserve::Reserved(r)) => r,
        other => panic!("expected a reservation, got {other:?}"),
    }
}

/// Runs the rule called `name`.
pub fn run(name: &str, make: &MakeSubject) {
    match name {
        "exact_hit_needs_committed_physical_key" => exact_hit_needs_committed_physical_key(make),
        "same_logical_other_physical_is_incompatible" => {
            same_logical_other_physical_is_incompatible(make)
        }
        "prefix_hit_is_whole_block_and_needs_equal_shape" => {
            prefix_hit_is_whole_block_and_needs_equal_shape(make)
        }
        "lookup_and_get_refuse_other_tenants" => lookup_and_get_refuse_other_tenants(make),
        "rights_are_enforced" => rights_are_enforced(make),
        "only_committed_is_readable" => only_committed_is_readable(make),
        "corrupt_block_is_a_miss_and_dropped" => corrupt_block_is_a_miss_and_dropped(make),
        "get_into_small_buffer_fails_retired" => get_into_small_buffer_fails_retired(make),
        "put_is_create_only" => put_is_create_only(make),
        "request_replay_is_idempotent" => request_replay_is_idempotent(make),
        "request_ids_expire_and_are_capped" => request_ids_expire_and_are_capped(make),
        "abort_retired_frees_everything" => abort_retired_frees_everything(make),
        "unknown_outcome_quarantines_and_stays_charged" => {
            unknown_outcome_quarantines_and_stays_charged(make)
        }
        "lease_expiry_quarantines_never_frees" => lease_expiry_quarantines_never_frees(make),
        "attestation_needs_owner_or_admin" => attestation_needs_owner_or_admin(make),
        "fence_reclaims_only_older_epochs" => fence_reclaims_only_older_epochs(make),
        "stale_reservations_refuse_writes_after_bump" => {
            stale_reservations_refuse_writes_after_bump(make)
        }
        "region_ids_never_recycled" => region_ids_never_recycled(make),
        "refusals_carry_numbers" => refusals_carry_numbers(make),
        "full_store_follows_its_policy" => full_store_follows_its_policy(make),
        "registrations_count_committed_and_quarantined" => {
            registrations_count_committed_and_quarantined(make)
        }
        "incomplete_commit_is_refused" => incomplete_commit_is_refused(make),
        "write_bounds_are_checked" => write_bounds_are_checked(make),
        "failures_report_retirement" => failures_report_retirement(make),
        other => panic!("no conformance rule named {other}"),
    }
}

pub fn exact_hit_needs_committed_physical_key(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1, 2], KvDtype::F16, 16);
    let data = payload(1, 4096);
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Miss(MissReason::Absent));
    assert_eq!(
        s.store.put(&caller(0), &k, &data, None).unwrap(),
        Put::Committed(Checksum::of(&data))
    );
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Hit { len: 4096 });
    let mut buf = vec![0; 4096];
    assert_eq!(
        s.store.get_into(&caller(0), &k, &mut buf).unwrap(),
        Get::Hit { len: 4096, checksum: Checksum::of(&data) }
    );
    assert_eq!(buf, data, "exact hit must return the committed bytes");
}

pub fn same_logical_other_physical_is_incompatible(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let stored = key(0, &[1, 2], KvDtype::F16, 16);
    s.store.put(&caller(0), &stored, &payload(2, 100), None).unwrap();
    for other in [key(0, &[1, 2], KvDtype::Bf16, 16), key(0, &[1, 2], KvDtype::F16, 8)] {
        assert_eq!(stored.logical(), other.logical());
        assert_eq!(
            s.store.lookup(&caller(0), &other).unwrap(),
            Lookup::Miss(MissReason::Incompatible)
        );
        let mut buf = vec![0xAB; 100];
        assert_eq!(
            s.store.get_into(&caller(0), &other, &mut buf).unwrap(),
            Get::Miss(MissReason::Incompatible)
        );
        assert!(buf.iter().all(|b| *b == 0xAB), "a miss must not write the destination");
    }
}

pub fn prefix_hit_is_whole_block_and_needs_equal_shape(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let short = key(0, &[1, 2], KvDtype::F16, 16);
    let data = payload(3, 777);
    s.store.put(&caller(0), &short, &data, None).unwrap();
    // A longer request over the same prefix, even with a different valid length, finds it.
    for longer in [key(0, &[1, 2, 3], KvDtype::F16, 16), key(0, &[1, 2, 3, 4], KvDtype::F16, 5)] {
        assert_eq!(
            s.store.lookup(&caller(0), &longer).unwrap(),
            Lookup::PrefixHit { key: Box::new(short.clone()), len: 777 }
        );
        // Get is exact only: the longer key itself is absent.
        let mut buf = vec![0; 1024];
        assert_eq!(
            s.store.get_into(&caller(0), &longer, &mut buf).unwrap(),
            Get::Miss(MissReason::Absent)
        );
    }
    // The whole block is served under its own key, never sliced.
    let mut buf = vec![0; 1024];
    assert_eq!(
        s.store.get_into(&caller(0), &short, &mut buf).unwrap(),
        Get::Hit { len: 777, checksum: Checksum::of(&data) }
    );
    assert_eq!(&buf[..777], &data[..]);
    // Another dtype, another chain, a shorter request or another tenant never prefix-hit.
    for k in [
        key(0, &[1, 2, 3], KvDtype::Bf16, 16),
        key(0, &[1, 9, 3], KvDtype::F16, 16),
        key(0, &[1], KvDtype::F16, 16),
    ] {
        assert_eq!(
            s.store.lookup(&caller(0), &k).unwrap(),
            Lookup::Miss(MissReason::Absent),
            "{k:?}"
        );
    }
    assert_eq!(
        s.store.lookup(&caller(1), &key(1, &[1, 2, 3], KvDtype::F16, 16)).unwrap(),
        Lookup::Miss(MissReason::Absent)
    );
    // The longest committed prefix wins.
    let mid = key(0, &[1, 2, 3], KvDtype::F16, 16);
    s.store.put(&caller(0), &mid, &payload(4, 10), None).unwrap();
    assert_eq!(
        s.store.lookup(&caller(0), &key(0, &[1, 2, 3, 4], KvDtype::F16, 16)).unwrap(),
        Lookup::PrefixHit { key: Box::new(mid), len: 10 }
    );
}

pub fn lookup_and_get_refuse_other_tenants(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    s.store.put(&caller(0), &k, &payload(5, 64), None).unwrap();
    let wrong = StoreError::WrongTenant { caller: tenant(1), owner: tenant(0) };
    assert_eq!(s.store.lookup(&caller(1), &k), Err(wrong.clone()));
    let mut buf = vec![0x11; 64];
    assert_eq!(s.store.get_into(&caller(1), &k, &mut buf), Err(wrong.clone()));
    assert!(buf.iter().all(|b| *b == 0x11));
    assert_eq!(s.store.invalidate(&caller(1), &k), Err(wrong.clone()));
    assert_eq!(s.store.put(&caller(1), &k, &payload(6, 64), None), Err(wrong.clone()));
    // Admin rights do not open another tenant's data.
    assert_eq!(
        s.store.lookup(&admin(1), &k),
        Err(StoreError::WrongTenant { caller: tenant(1), owner: tenant(0) })
    );
    // The owner still reads its own bytes.
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Hit { len: 64 });
}

pub fn rights_are_enforced(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let reader = Caller::new(tenant(0), Rights::READ_ONLY);
    let err = s.store.put(&reader, &k, &payload(7, 8), None).unwrap_err();
    assert!(matches!(err, StoreError::Forbidden { right: crate::Right::Write, .. }), "{err}");
    let writer = Caller::new(tenant(0), Rights { read: false, write: true, admin: false });
    s.store.put(&writer, &k, &payload(7, 8), None).unwrap();
    let err = s.store.lookup(&writer, &k).unwrap_err();
    assert!(matches!(err, StoreError::Forbidden { right: crate::Right::Read, .. }), "{err}");
}

pub fn only_committed_is_readable(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let data = payload(8, 512);
    let r = reserved(s.store.reserve(&caller(0), &k, 512, None));
    let mut buf = vec![0; 512];
    assert_eq!(
        s.store.lookup(&caller(0), &k).unwrap(),
        Lookup::Miss(MissReason::NotReadable(BlockState::Reserved))
    );
    s.store.write(&caller(0), &r, 0, &data[..256]).unwrap();
    assert_eq!(
        s.store.get_into(&caller(0), &k, &mut buf).unwrap(),
        Get::Miss(MissReason::NotReadable(BlockState::Writing))
    );
    assert!(buf.iter().all(|b| *b == 0), "a partial write leaked into a read");
    s.store.write(&caller(0), &r, 256, &data[256..]).unwrap();
    s.store.commit(&caller(0), &r).unwrap();
    assert!(matches!(
        s.store.get_into(&caller(0), &k, &mut buf).unwrap(),
        Get::Hit { len: 512, .. }
    ));
    assert_eq!(buf, data);
    assert_eq!(s.store.invalidate(&caller(0), &k).unwrap(), Invalidate::Removed);
    assert_eq!(s.store.get_into(&caller(0), &k, &mut buf).unwrap(), Get::Miss(MissReason::Absent));
}

pub fn corrupt_block_is_a_miss_and_dropped(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    s.store.put(&caller(0), &k, &payload(9, 4096), None).unwrap();
    let before = s.store.stats().usage;
    assert!((s.corrupt)(&k), "the harness could not corrupt a committed block");
    let mut buf = vec![0x5A; 4096];
    assert_eq!(s.store.get_into(&caller(0), &k, &mut buf).unwrap(), Get::Miss(MissReason::Corrupt));
    assert!(buf.iter().all(|b| *b == 0), "corrupt bytes reached the caller's buffer");
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Miss(MissReason::Absent));
    let after = s.store.stats();
    assert_eq!(after.usage.retained_bytes, before.retained_bytes - 4096);
    assert_eq!(after.corrupt_dropped.total(), 1);
    assert_eq!(after.corrupt_dropped.get(CorruptPhase::Get, CorruptReason::Checksum), 1);
    // The engine recomputes and writes it again.
    assert!(matches!(
        s.store.put(&caller(0), &k, &payload(9, 4096), None).unwrap(),
        Put::Committed(_)
    ));
}

pub fn get_into_small_buffer_fails_retired(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    s.store.put(&caller(0), &k, &payload(10, 300), None).unwrap();
    let mut buf = vec![0x33; 299];
    let e = s.store.get_into(&caller(0), &k, &mut buf).unwrap_err();
    assert_eq!(e, StoreError::BufferTooSmall { needed: 300, provided: 299 });
    assert_eq!(e.retirement(), Retirement::Retired);
    assert!(buf.iter().all(|b| *b == 0x33), "a failed get wrote payload");
}

pub fn put_is_create_only(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let first = payload(11, 128);
    s.store.put(&caller(0), &k, &first, None).unwrap();
    assert_eq!(
        s.store.put(&caller(0), &k, &payload(12, 128), None).unwrap(),
        Put::AlreadyCommitted
    );
    let mut buf = vec![0; 128];
    s.store.get_into(&caller(0), &k, &mut buf).unwrap();
    assert_eq!(buf, first, "a second put replaced the first value");
    let r = reserved(s.store.reserve(&caller(0), &key(0, &[2], KvDtype::F16, 16), 8, None));
    assert_eq!(
        s.store.reserve(&caller(0), &key(0, &[2], KvDtype::F16, 16), 8, None).unwrap(),
        Reserve::Busy
    );
    s.store.abort(&caller(0), r, Retirement::Retired).unwrap();
}

pub fn request_replay_is_idempotent(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k, 16, Some(RequestId(7))));
    assert_eq!(s.store.reserve(&caller(0), &k, 16, Some(RequestId(7))).unwrap(), Reserve::Busy);
    s.store.write(&caller(0), &r, 0, &payload(13, 16)).unwrap();
    s.store.commit(&caller(0), &r).unwrap();
    // A replay after an invalidation still reports the first success, and writes nothing.
    s.store.invalidate(&caller(0), &k).unwrap();
    assert_eq!(
        s.store.put(&caller(0), &k, &payload(14, 16), Some(RequestId(7))).unwrap(),
        Put::AlreadyCommitted
    );
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Miss(MissReason::Absent));
    // The same id for another key is a conflict.
    let e = s
        .store
        .put(&caller(0), &key(0, &[2], KvDtype::F16, 16), &payload(15, 16), Some(RequestId(7)))
        .unwrap_err();
    assert!(matches!(e, StoreError::Replay(_)), "{e}");
    // Another tenant's id space is separate.
    assert!(matches!(
        s.store
            .put(&caller(1), &key(1, &[2], KvDtype::F16, 16), &payload(15, 16), Some(RequestId(7)))
            .unwrap(),
        Put::Committed(_)
    ));
    // An aborted request is forgotten: its replay writes.
    let k3 = key(0, &[3], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k3, 16, Some(RequestId(8))));
    s.store.abort(&caller(0), r, Retirement::Retired).unwrap();
    assert!(matches!(
        s.store.put(&caller(0), &k3, &payload(16, 16), Some(RequestId(8))).unwrap(),
        Put::Committed(_)
    ));
}

pub fn request_ids_expire_and_are_capped(make: &MakeSubject) {
    let limits = ResourceLimits { idempotency_entries_max: 2, idempotency_ttl_ms: 100, ..roomy() };
    let (s, clock) = fresh(make, limits);
    for (i, link) in [1u8, 2].into_iter().enumerate() {
        let k = key(0, &[link], KvDtype::F16, 16);
        s.store.put(&caller(0), &k, &payload(17, 8), Some(RequestId(i as u64))).unwrap();
    }
    let k3 = key(0, &[3], KvDtype::F16, 16);
    assert_eq!(
        s.store.put(&caller(0), &k3, &payload(17, 8), Some(RequestId(9))).unwrap(),
        Put::Refused(Refusal::IdempotencyTable { entries: 2, max: 2 })
    );
    // Without a request id the table is not involved.
    assert!(matches!(
        s.store.put(&caller(0), &k3, &payload(17, 8), None).unwrap(),
        Put::Committed(_)
    ));
    clock.advance_ms(100);
    let k4 = key(0, &[4], KvDtype::F16, 16);
    assert!(matches!(
        s.store.put(&caller(0), &k4, &payload(17, 8), Some(RequestId(9))).unwrap(),
        Put::Committed(_)
    ));
    // Request 0 expired: reusing it for another key is no longer a conflict.
    let k5 = key(0, &[5], KvDtype::F16, 16);
    assert!(matches!(
        s.store.put(&caller(0), &k5, &payload(17, 8), Some(RequestId(0))).unwrap(),
        Put::Committed(_)
    ));
}

pub fn abort_retired_frees_everything(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let empty = s.store.stats().usage;
    let k = key(0, &[1], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k, 1000, None));
    s.store.write(&caller(0), &r, 0, &payload(18, 500)).unwrap();
    assert_eq!(s.store.stats().usage.retained_bytes, empty.retained_bytes + 1000);
    assert_eq!(s.store.abort(&caller(0), r, Retirement::Retired).unwrap(), Abort::Released);
    assert_eq!(s.store.stats().usage, empty);
    assert_eq!(s.store.stats().regions.quarantined, 0);
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Miss(MissReason::Absent));
}

pub fn unknown_outcome_quarantines_and_stays_charged(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k, 1000, None));
    let region = r.region;
    assert_eq!(s.store.abort(&caller(0), r, Retirement::Unknown).unwrap(), Abort::Quarantined);
    let st = s.store.stats();
    assert_eq!(st.regions.quarantined, 1);
    assert_eq!(st.regions.quarantined_bytes, 1000);
    assert_eq!(st.usage.retained_bytes, 1000, "a quarantined region must stay charged");
    assert_eq!(st.usage.inflight_requests, 0);
    // The key is free for a recompute; the quarantined region is not.
    assert!(matches!(
        s.store.put(&caller(0), &k, &payload(19, 1000), None).unwrap(),
        Put::Committed(_)
    ));
    assert_eq!(s.store.stats().regions.quarantined, 1);
    assert_eq!(s.store.attest_drained(&caller(0), region).unwrap().bytes, 1000);
    assert_eq!(s.store.stats().regions.quarantined, 0);
    assert_eq!(s.store.stats().usage.retained_bytes, 1000);
}

pub fn lease_expiry_quarantines_never_frees(make: &MakeSubject) {
    let (s, clock) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k, 64, None));
    clock.advance_ms(999);
    assert_eq!(s.store.expire_leases().unwrap(), 0);
    clock.advance_ms(1);
    assert_eq!(s.store.expire_leases().unwrap(), 1);
    assert_eq!(s.store.stats().regions.quarantined, 1);
    assert_eq!(
        s.store.write(&caller(0), &r, 0, &payload(20, 64)),
        Err(StoreError::ReservationQuarantined { region: r.region })
    );
    // Time passing, more expiry passes and a late retired abort free nothing.
    clock.advance_ms(1_000_000);
    assert_eq!(s.store.expire_leases().unwrap(), 0);
    let region = r.region;
    assert_eq!(s.store.abort(&caller(0), r, Retirement::Retired).unwrap(), Abort::Quarantined);
    assert_eq!(s.store.stats().regions.quarantined, 1);
    assert_eq!(s.store.stats().usage.retained_bytes, 64);
    assert_eq!(s.store.attest_drained(&caller(0), region).unwrap().bytes, 64);
    assert_eq!(s.store.stats().usage.retained_bytes, 0);
}

pub fn attestation_needs_owner_or_admin(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let r = reserved(s.store.reserve(&caller(0), &key(0, &[1], KvDtype::F16, 16), 64, None));
    let region = r.region;
    s.store.abort(&caller(0), r, Retirement::Unknown).unwrap();
    let e = s.store.attest_drained(&caller(1), region).unwrap_err();
    assert!(matches!(e, StoreError::Registry(RegistryError::NotAuthorized { .. })), "{e}");
    assert_eq!(s.store.stats().regions.quarantined, 1);
    assert_eq!(s.store.attest_drained(&admin(1), region).unwrap().region, region);
    assert_eq!(s.store.stats().regions.quarantined, 0);
    // Twice is an unknown region, not a double free.
    let e = s.store.attest_drained(&admin(1), region).unwrap_err();
    assert_eq!(e, StoreError::Registry(RegistryError::Unknown(region)));
    // A committed block's region cannot be attested away.
    let k = key(0, &[2], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k, 8, None));
    s.store.write(&caller(0), &r, 0, &payload(21, 8)).unwrap();
    s.store.commit(&caller(0), &r).unwrap();
    let e = s.store.attest_drained(&caller(0), r.region).unwrap_err();
    assert!(matches!(e, StoreError::Registry(RegistryError::WrongState { .. })), "{e}");
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Hit { len: 8 });
}

pub fn fence_reclaims_only_older_epochs(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    assert_eq!(s.store.epoch(), Epoch(1));
    let committed = key(0, &[9], KvDtype::F16, 16);
    s.store.put(&caller(0), &committed, &payload(22, 32), None).unwrap();
    let old = reserved(s.store.reserve(&caller(0), &key(0, &[1], KvDtype::F16, 16), 64, None));
    let e1 = s.store.epoch();
    // Without a bump, the current epoch reclaims nothing (the fence is not up).
    s.store.abort(&caller(0), old, Retirement::Unknown).unwrap();
    assert_eq!(s.store.reclaim_fenced(e1).unwrap(), 0);
    assert_eq!(s.store.stats().regions.quarantined, 1);
    let e2 = s.store.bump_epoch().unwrap();
    assert!(e2 > e1);
    // A region quarantined in the new epoch is not covered by this fence.
    let newer = reserved(s.store.reserve(&caller(0), &key(0, &[2], KvDtype::F16, 16), 64, None));
    assert_eq!(newer.epoch, e2);
    s.store.abort(&caller(0), newer, Retirement::Unknown).unwrap();
    assert_eq!(
        s.store.reclaim_fenced(e1),
        Err(StoreError::Registry(RegistryError::StaleEpoch { given: e1, current: e2 }))
    );
    assert_eq!(s.store.reclaim_fenced(e2).unwrap(), 1);
    assert_eq!(s.store.stats().regions.quarantined, 1);
    // Committed blocks survive every fence.
    assert_eq!(s.store.lookup(&caller(0), &committed).unwrap(), Lookup::Hit { len: 32 });
    let e3 = s.store.bump_epoch().unwrap();
    assert_eq!(s.store.reclaim_fenced(e3).unwrap(), 1);
    assert_eq!(s.store.stats().regions.quarantined, 0);
    assert_eq!(s.store.stats().usage.retained_bytes, 32);
}

pub fn stale_reservations_refuse_writes_after_bump(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &k, 64, None));
    s.store.write(&caller(0), &r, 0, &payload(23, 32)).unwrap();
    let e = s.store.bump_epoch().unwrap();
    assert_eq!(
        s.store.write(&caller(0), &r, 32, &payload(23, 32)),
        Err(StoreError::ReservationQuarantined { region: r.region })
    );
    assert_eq!(
        s.store.commit(&caller(0), &r),
        Err(StoreError::ReservationQuarantined { region: r.region })
    );
    // The key is free again under the new epoch.
    let again = reserved(s.store.reserve(&caller(0), &k, 64, None));
    assert_eq!(again.epoch, e);
    s.store.abort(&caller(0), again, Retirement::Retired).unwrap();
    assert_eq!(s.store.reclaim_fenced(e).unwrap(), 1);
    assert_eq!(
        s.store.write(&caller(0), &r, 0, &payload(23, 1)),
        Err(StoreError::UnknownReservation { region: r.region })
    );
}

pub fn region_ids_never_recycled(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let mut last = RegionId(0);
    for i in 0..50u8 {
        let k = key(0, &[i % 3], KvDtype::F16, 16);
        let r = reserved(s.store.reserve(&caller(0), &k, 8, None));
        assert!(r.region > last, "region id {} reused or went backwards after {}", r.region, last);
        last = r.region;
        let outcome = if i % 2 == 0 { Retirement::Retired } else { Retirement::Unknown };
        let region = r.region;
        s.store.abort(&caller(0), r, outcome).unwrap();
        if outcome == Retirement::Unknown {
            s.store.attest_drained(&caller(0), region).unwrap();
        }
    }
}

pub fn refusals_carry_numbers(make: &MakeSubject) {
    let limits = ResourceLimits {
        object_bytes_max: 1000,
        inflight_requests_max: 2,
        registrations_max: 3,
        tenant_inflight_bytes_max: 1500,
        retained_bytes_max: 2500,
        tenant_retained_bytes_max: 2000,
        tenants_max: 2,
        ..roomy()
    };
    let (s, _) = fresh(make, limits);
    let refuses = s.store.info().full_policy == FullPolicy::Refuse;
    let put = |t: usize, link: u8, len: usize| {
        s.store
            .put(&caller(t), &key(t, &[link], KvDtype::F16, 16), &payload(24, len), None)
            .unwrap()
    };
    assert_eq!(put(0, 1, 1001), Put::Refused(Refusal::ObjectTooLarge { bytes: 1001, max: 1000 }));
    let a = reserved(s.store.reserve(&caller(0), &key(0, &[2], KvDtype::F16, 16), 800, None));
    assert_eq!(
        s.store.reserve(&caller(0), &key(0, &[3], KvDtype::F16, 16), 800, None).unwrap(),
        Reserve::Refused(Refusal::TenantInflightBytes {
            tenant: tenant(0),
            current: 800,
            requested: 800,
            max: 1500
        })
    );
    let b = reserved(s.store.reserve(&caller(1), &key(1, &[2], KvDtype::F16, 16), 100, None));
    assert_eq!(put(0, 4, 10), Put::Refused(Refusal::InflightRequests { current: 2, max: 2 }));
    s.store.abort(&caller(1), b, Retirement::Retired).unwrap();
    s.store.write(&caller(0), &a, 0, &payload(24, 800)).unwrap();
    s.store.commit(&caller(0), &a).unwrap();
    assert_eq!(put(0, 5, 1000), Put::Committed(Checksum::of(&payload(24, 1000))));
    if refuses {
        assert_eq!(
            put(0, 6, 300),
            Put::Refused(Refusal::TenantRetainedBytes {
                tenant: tenant(0),
                current: 1800,
                requested: 300,
                max: 2000
            })
        );
    }
    assert_eq!(put(2, 1, 500), Put::Committed(Checksum::of(&payload(24, 500))));
    assert_eq!(put(1, 1, 10), Put::Refused(Refusal::Registrations { current: 3, max: 3 }));
    s.store.invalidate(&caller(2), &key(2, &[1], KvDtype::F16, 16)).unwrap();
    if refuses {
        assert_eq!(
            put(1, 1, 800),
            Put::Refused(Refusal::RetainedBytes { current: 1800, requested: 800, max: 2500 })
        );
    }
    s.store.put(&caller(1), &key(1, &[1], KvDtype::F16, 16), &payload(24, 10), None).unwrap();
    s.store.invalidate(&caller(0), &key(0, &[5], KvDtype::F16, 16)).unwrap();
    assert_eq!(put(2, 1, 10), Put::Refused(Refusal::Tenants { current: 2, max: 2 }));
}

pub fn full_store_follows_its_policy(make: &MakeSubject) {
    let limits = ResourceLimits {
        object_bytes_max: 1000,
        retained_bytes_max: 3300,
        tenant_retained_bytes_max: 2000,
        ..roomy()
    };
    let (s, _) = fresh(make, limits);
    let k = |t: usize, link: u8| key(t, &[link], KvDtype::F16, 16);
    let put = |t: usize, link: u8, len: usize| {
        s.store.put(&caller(t), &k(t, link), &payload(u64::from(link), len), None).unwrap()
    };
    let present = |t: usize, link: u8| {
        s.store.lookup(&caller(t), &k(t, link)).unwrap() != Lookup::Miss(MissReason::Absent)
    };
    assert!(matches!(put(1, 10, 300), Put::Committed(_)));
    let q = reserved(s.store.reserve(&caller(1), &k(1, 11), 500, None));
    s.store.abort(&caller(1), q, Retirement::Unknown).unwrap();
    assert!(matches!(put(0, 1, 1000), Put::Committed(_)));
    assert!(matches!(put(0, 2, 1000), Put::Committed(_)));
    // Tenant 0 is at its quota.
    let tenant_full = put(0, 3, 500);
    if s.store.info().full_policy == FullPolicy::Refuse {
        assert_eq!(
            tenant_full,
            Put::Refused(Refusal::TenantRetainedBytes {
                tenant: tenant(0),
                current: 2000,
                requested: 500,
                max: 2000
            })
        );
        assert_eq!(s.store.stats().evictions, 0);
        return;
    }
    // Its own oldest block goes; tenant 1's older block does not.
    assert!(matches!(tenant_full, Put::Committed(_)), "{tenant_full:?}");
    assert!(!present(0, 1) && present(0, 2) && present(1, 10));
    assert_eq!(s.store.stats().evictions, 1);
    assert!(matches!(put(1, 12, 1000), Put::Committed(_)));
    // The global quota evicts the oldest blocks of anyone (1/10, then 0/2); tenant 1's own
    // quota then takes its oldest committed block (1/12). The quarantined region stays.
    assert!(matches!(put(1, 13, 600), Put::Committed(_)));
    assert!(!present(1, 10) && !present(0, 2) && !present(1, 12));
    assert!(present(0, 3) && present(1, 13));
    let st = s.store.stats();
    assert_eq!(st.evictions, 4);
    assert_eq!(st.regions.quarantined, 1, "a quarantined region was evicted");
    assert_eq!(st.usage.retained_bytes, 500 + 500 + 600);
}

pub fn registrations_count_committed_and_quarantined(make: &MakeSubject) {
    let limits = ResourceLimits { registrations_max: 2, ..roomy() };
    let (s, _) = fresh(make, limits);
    s.store.put(&caller(0), &key(0, &[1], KvDtype::F16, 16), &payload(25, 8), None).unwrap();
    let r = reserved(s.store.reserve(&caller(0), &key(0, &[2], KvDtype::F16, 16), 8, None));
    let region = r.region;
    s.store.abort(&caller(0), r, Retirement::Unknown).unwrap();
    assert_eq!(
        s.store.put(&caller(0), &key(0, &[3], KvDtype::F16, 16), &payload(25, 8), None).unwrap(),
        Put::Refused(Refusal::Registrations { current: 2, max: 2 })
    );
    s.store.attest_drained(&caller(0), region).unwrap();
    assert!(matches!(
        s.store.put(&caller(0), &key(0, &[3], KvDtype::F16, 16), &payload(25, 8), None).unwrap(),
        Put::Committed(_)
    ));
}

pub fn incomplete_commit_is_refused(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let data = payload(26, 100);
    let r = reserved(s.store.reserve(&caller(0), &k, 100, None));
    assert_eq!(
        s.store.commit(&caller(0), &r),
        Err(StoreError::Incomplete { written: 0, expected: 100 })
    );
    s.store.write(&caller(0), &r, 60, &data[60..]).unwrap();
    s.store.write(&caller(0), &r, 10, &data[10..70]).unwrap();
    assert_eq!(
        s.store.commit(&caller(0), &r),
        Err(StoreError::Incomplete { written: 90, expected: 100 })
    );
    s.store.write(&caller(0), &r, 0, &data[..10]).unwrap();
    s.store.commit(&caller(0), &r).unwrap();
    let mut buf = vec![0; 100];
    s.store.get_into(&caller(0), &k, &mut buf).unwrap();
    assert_eq!(buf, data, "out-of-order pieces must assemble exactly");
    assert_eq!(
        s.store.commit(&caller(0), &r),
        Err(StoreError::UnknownReservation { region: r.region })
    );
}

pub fn write_bounds_are_checked(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let r = reserved(s.store.reserve(&caller(0), &key(0, &[1], KvDtype::F16, 16), 100, None));
    assert_eq!(
        s.store.write(&caller(0), &r, 90, &[0; 11]),
        Err(StoreError::WriteOutOfBounds { offset: 90, len: 11, capacity: 100 })
    );
    assert_eq!(
        s.store.write(&caller(0), &r, u64::MAX, &[0; 2]),
        Err(StoreError::WriteOutOfBounds { offset: u64::MAX, len: 2, capacity: 100 })
    );
    assert_eq!(
        s.store.reserve(&caller(0), &key(0, &[2], KvDtype::F16, 16), 0, None),
        Err(StoreError::EmptyObject)
    );
    let e = s.store.write(&caller(1), &r, 0, &[0; 1]).unwrap_err();
    assert!(matches!(e, StoreError::WrongTenant { .. }), "{e}");
}

pub fn failures_report_retirement(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let info = s.store.info();
    assert_eq!(s.store.failures_retire(), info.failures_retire);
    let k = key(0, &[1], KvDtype::F16, 16);
    let errors = [
        s.store.lookup(&caller(1), &k).unwrap_err(),
        s.store.reserve(&caller(0), &k, 0, None).unwrap_err(),
        s.store.reclaim_fenced(Epoch(0)).unwrap_err(),
    ];
    for e in errors {
        if info.failures_retire {
            assert_eq!(e.retirement(), Retirement::Retired, "{e}");
        }
    }
}
