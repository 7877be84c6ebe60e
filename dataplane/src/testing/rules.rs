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
        "batch_answers_equal_single_key_answers" => batch_answers_equal_single_key_answers(make),
        "batch_put_duplicates_behave_as_sequential_puts" => {
            batch_put_duplicates_behave_as_sequential_puts(make)
        }
        "batch_partial_failure_retires_per_key" => batch_partial_failure_retires_per_key(make),
        "empty_batch_answers_nothing" => empty_batch_answers_nothing(make),
        "corrupt_block_in_batch_is_a_miss_for_that_key_only" => {
            corrupt_block_in_batch_is_a_miss_for_that_key_only(make)
        }
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

// ----------------------------------------------------------------------------- batch rules

/// What a batch GET destination holds before the call, to tell which bytes the store wrote.
const UNTOUCHED: u8 = 0xEE;

/// Two stores built alike by `setup`: one answers a batch, the other the same items one
/// single-key call at a time, so that both can be compared answer by answer and state by state.
fn twins<T>(
    make: &MakeSubject,
    limits: ResourceLimits,
    setup: impl Fn(&Subject) -> T,
) -> ((Subject, T), (Subject, T)) {
    let (a, _) = fresh(make, limits.clone());
    let (b, _) = fresh(make, limits);
    let ta = setup(&a);
    let tb = setup(&b);
    ((a, ta), (b, tb))
}

/// Both stores hold the same counters and answer the same lookups for `keys`.
fn same_state(what: &str, a: &Subject, b: &Subject, keys: &[&crate::key::PhysicalKey]) {
    assert_eq!(a.store.stats(), b.store.stats(), "{what}: the batch left other counters");
    let owner_lookups = |s: &Subject| -> Vec<_> {
        keys.iter()
            .map(|k| s.store.lookup(&Caller::new(k.tenant().clone(), Rights::READ_ONLY), k))
            .collect()
    };
    assert_eq!(owner_lookups(a), owner_lookups(b), "{what}: the batch left other contents");
}

/// Every error of a batch refused the item before touching a buffer.
fn errors_retired<T: std::fmt::Debug>(what: &str, answers: &[Result<T, StoreError>]) {
    for (i, answer) in answers.iter().enumerate() {
        if let Err(e) = answer {
            assert_eq!(
                e.retirement(),
                Retirement::Retired,
                "{what}: item {i} ({e}) did not retire"
            );
        }
    }
}

/// Runs `items` through `get_batch`, each into its own destination of the given size filled
/// with [`UNTOUCHED`]; returns the answers and the destinations.
fn batch_get(
    s: &Subject,
    who: &Caller,
    items: &[(&crate::key::PhysicalKey, usize)],
) -> (Vec<Result<Get, StoreError>>, Vec<Vec<u8>>) {
    let mut dsts: Vec<Vec<u8>> = items.iter().map(|(_, n)| vec![UNTOUCHED; *n]).collect();
    let mut batch: Vec<crate::store::BatchGet<'_>> = items
        .iter()
        .zip(dsts.iter_mut())
        .map(|((key, _), dst)| crate::store::BatchGet { key, dst: dst.as_mut_slice() })
        .collect();
    let answers = s.store.get_batch(who, &mut batch);
    drop(batch);
    assert_eq!(answers.len(), items.len(), "get_batch must answer once per item");
    (answers, dsts)
}

/// The same items through `get_into`, one call each.
fn single_gets(
    s: &Subject,
    who: &Caller,
    items: &[(&crate::key::PhysicalKey, usize)],
) -> (Vec<Result<Get, StoreError>>, Vec<Vec<u8>>) {
    items
        .iter()
        .map(|(key, n)| {
            let mut dst = vec![UNTOUCHED; *n];
            let answer = s.store.get_into(who, key, &mut dst);
            (answer, dst)
        })
        .unzip()
}

/// A hit's destination holds exactly the payload, then untouched bytes; every other answer
/// leaves the destination untouched.
fn destinations_hold_only_hits(
    answers: &[Result<Get, StoreError>],
    dsts: &[Vec<u8>],
    payloads: &[Option<&[u8]>],
) {
    for (i, ((answer, dst), want)) in answers.iter().zip(dsts).zip(payloads).enumerate() {
        match (answer, want) {
            (Ok(Get::Hit { len, checksum }), Some(data)) => {
                assert_eq!(*len, data.len() as u64, "item {i}: hit length");
                assert_eq!(*checksum, Checksum::of(data), "item {i}: hit checksum");
                assert_eq!(
                    &dst[..data.len()],
                    *data,
                    "item {i}: the destination lacks the payload"
                );
                assert!(
                    dst[data.len()..].iter().all(|b| *b == UNTOUCHED),
                    "item {i}: the store wrote past the payload"
                );
            }
            (Ok(Get::Hit { .. }), None) => panic!("item {i}: a hit where none was expected"),
            (_, Some(_)) => panic!("item {i}: expected a hit, got {answer:?}"),
            (_, None) => assert!(
                dst.iter().all(|b| *b == UNTOUCHED),
                "item {i}: {answer:?} wrote into its destination"
            ),
        }
    }
}

fn put_items<'a>(
    items: &'a [(&'a crate::key::PhysicalKey, Vec<u8>, Option<RequestId>)],
) -> Vec<crate::store::BatchPut<'a>> {
    items
        .iter()
        .map(|(key, src, request)| crate::store::BatchPut { key, src, request: *request })
        .collect()
}

fn single_puts(
    s: &Subject,
    who: &Caller,
    items: &[(&crate::key::PhysicalKey, Vec<u8>, Option<RequestId>)],
) -> Vec<Result<Put, StoreError>> {
    items.iter().map(|(key, src, request)| s.store.put(who, key, src, *request)).collect()
}

pub fn batch_answers_equal_single_key_answers(make: &MakeSubject) {
    let hit = key(0, &[1], KvDtype::F16, 16);
    let short = key(0, &[1, 2], KvDtype::F16, 16);
    let longer = key(0, &[1, 2, 3], KvDtype::F16, 16);
    let incompatible = key(0, &[1, 2], KvDtype::Bf16, 16);
    let absent = key(0, &[9], KvDtype::F16, 16);
    let foreign = key(1, &[1], KvDtype::F16, 16);
    let open = key(0, &[5], KvDtype::F16, 16);
    let big = key(0, &[6], KvDtype::F16, 16);
    let (hit_data, short_data) = (payload(40, 100), payload(41, 300));
    let setup = |s: &Subject| {
        s.store.put(&caller(0), &hit, &hit_data, None).unwrap();
        s.store.put(&caller(0), &short, &short_data, None).unwrap();
        s.store.put(&caller(1), &foreign, &payload(42, 64), None).unwrap();
        reserved(s.store.reserve(&caller(0), &open, 64, None))
    };
    let ((a, _open_a), (b, _open_b)) = twins(make, roomy(), setup);
    let wrong = StoreError::WrongTenant { caller: tenant(0), owner: tenant(1) };
    let writer = Caller::new(tenant(0), Rights { read: false, write: true, admin: false });
    let reader = Caller::new(tenant(0), Rights::READ_ONLY);
    let no_read = StoreError::Forbidden { tenant: tenant(0), right: crate::Right::Read };
    let no_write = StoreError::Forbidden { tenant: tenant(0), right: crate::Right::Write };

    // Lookups.
    let keys = [&hit, &longer, &incompatible, &absent, &foreign, &open, &short, &hit];
    let answers = a.store.lookup_batch(&caller(0), &keys);
    assert_eq!(
        answers,
        vec![
            Ok(Lookup::Hit { len: 100 }),
            Ok(Lookup::PrefixHit { key: Box::new(short.clone()), len: 300 }),
            Ok(Lookup::Miss(MissReason::Incompatible)),
            Ok(Lookup::Miss(MissReason::Absent)),
            Err(wrong.clone()),
            Ok(Lookup::Miss(MissReason::NotReadable(BlockState::Reserved))),
            Ok(Lookup::Hit { len: 300 }),
            Ok(Lookup::Hit { len: 100 }),
        ],
        "lookup_batch"
    );
    let single: Vec<_> = keys.iter().map(|k| a.store.lookup(&caller(0), k)).collect();
    assert_eq!(answers, single, "lookup_batch differs from lookup key by key");
    errors_retired("lookup_batch", &answers);
    assert_eq!(
        a.store.lookup_batch(&writer, &[&hit, &absent]),
        vec![Err(no_read.clone()), Err(no_read.clone())],
        "lookup_batch without the read right"
    );

    // Reads, each into its own destination.
    let items = [
        (&hit, 117),
        (&longer, 400),
        (&incompatible, 300),
        (&absent, 64),
        (&foreign, 64),
        (&open, 64),
        (&short, 299),
        (&short, 300),
    ];
    let (answers, dsts) = batch_get(&a, &caller(0), &items);
    assert_eq!(
        answers,
        vec![
            Ok(Get::Hit { len: 100, checksum: Checksum::of(&hit_data) }),
            Ok(Get::Miss(MissReason::Absent)),
            Ok(Get::Miss(MissReason::Incompatible)),
            Ok(Get::Miss(MissReason::Absent)),
            Err(wrong.clone()),
            Ok(Get::Miss(MissReason::NotReadable(BlockState::Reserved))),
            Err(StoreError::BufferTooSmall { needed: 300, provided: 299 }),
            Ok(Get::Hit { len: 300, checksum: Checksum::of(&short_data) }),
        ],
        "get_batch"
    );
    errors_retired("get_batch", &answers);
    let hits: [Option<&[u8]>; 8] =
        [Some(&hit_data), None, None, None, None, None, None, Some(&short_data)];
    destinations_hold_only_hits(&answers, &dsts, &hits);
    let (single, single_dsts) = single_gets(&a, &caller(0), &items);
    assert_eq!(answers, single, "get_batch differs from get_into key by key");
    assert_eq!(dsts, single_dsts, "get_batch destinations differ from get_into's");
    let (answers, dsts) = batch_get(&a, &writer, &[(&hit, 100), (&short, 300)]);
    assert_eq!(answers, vec![Err(no_read.clone()), Err(no_read)], "get_batch without read");
    destinations_hold_only_hits(&answers, &dsts, &[None, None]);

    // Writes: the batch on one store, the same PUTs one by one on its twin.
    let big_len = usize::try_from(roomy().object_bytes_max).unwrap_or(usize::MAX) + 1;
    let absent_data = payload(43, 500);
    let incompatible_data = payload(44, 200);
    let puts = [
        (&hit, payload(45, 100), None),
        (&absent, absent_data.clone(), None),
        (&foreign, payload(46, 64), None),
        (&open, payload(47, 64), None),
        (&incompatible, incompatible_data.clone(), None),
        (&big, payload(48, big_len), None),
    ];
    let answers = a.store.put_batch(&caller(0), &put_items(&puts));
    assert_eq!(
        answers,
        vec![
            Ok(Put::AlreadyCommitted),
            Ok(Put::Committed(Checksum::of(&absent_data))),
            Err(wrong.clone()),
            Ok(Put::Busy),
            Ok(Put::Committed(Checksum::of(&incompatible_data))),
            Ok(Put::Refused(Refusal::ObjectTooLarge {
                bytes: big_len as u64,
                max: roomy().object_bytes_max
            })),
        ],
        "put_batch"
    );
    errors_retired("put_batch", &answers);
    assert_eq!(answers, single_puts(&b, &caller(0), &puts), "put_batch differs from put");
    let all = [&hit, &short, &longer, &incompatible, &absent, &foreign, &open, &big];
    same_state("put_batch", &a, &b, &all);
    let (_, dsts) = batch_get(&a, &caller(0), &[(&hit, 100), (&absent, 500)]);
    assert_eq!(dsts, vec![hit_data.clone(), absent_data], "put_batch stored other bytes");
    let before = a.store.stats();
    let refused = a.store.put_batch(&reader, &put_items(&puts[..2]));
    assert_eq!(refused, vec![Err(no_write.clone()), Err(no_write.clone())], "put_batch read-only");
    assert_eq!(a.store.stats(), before, "a forbidden put_batch changed the store");

    // Invalidations, likewise.
    let keys = [&hit, &hit, &open, &foreign, &longer, &absent];
    let answers = a.store.invalidate_batch(&caller(0), &keys);
    assert_eq!(
        answers,
        vec![
            Ok(Invalidate::Removed),
            Ok(Invalidate::Absent),
            Ok(Invalidate::Busy),
            Err(wrong),
            Ok(Invalidate::Absent),
            Ok(Invalidate::Removed),
        ],
        "invalidate_batch"
    );
    errors_retired("invalidate_batch", &answers);
    let single: Vec<_> = keys.iter().map(|k| b.store.invalidate(&caller(0), k)).collect();
    assert_eq!(answers, single, "invalidate_batch differs from invalidate key by key");
    same_state("invalidate_batch", &a, &b, &all);
    let before = a.store.stats();
    assert_eq!(
        a.store.invalidate_batch(&reader, &[&short, &incompatible]),
        vec![Err(no_write.clone()), Err(no_write)],
        "invalidate_batch without the write right"
    );
    assert_eq!(a.store.stats(), before, "a forbidden invalidate_batch changed the store");
    assert_eq!(a.store.lookup(&caller(0), &short).unwrap(), Lookup::Hit { len: 300 });
}

pub fn batch_put_duplicates_behave_as_sequential_puts(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let (first, second) = (payload(50, 128), payload(51, 128));
    let items = [(&k, first.clone(), None), (&k, second, None)];
    assert_eq!(
        s.store.put_batch(&caller(0), &put_items(&items)),
        vec![Ok(Put::Committed(Checksum::of(&first))), Ok(Put::AlreadyCommitted)],
        "two PUTs of one key in one batch"
    );
    let (_, dsts) = batch_get(&s, &caller(0), &[(&k, 128)]);
    assert_eq!(dsts[0], first, "the second item of the batch replaced the first");
    let st = s.store.stats();
    assert_eq!((st.usage.registrations, st.usage.retained_bytes), (1, 128), "{st:?}");
    assert_eq!(st.usage.inflight_requests, 0);

    // A batch under request ids, replayed whole, answers the first success and writes nothing.
    let (k2, k3) = (key(0, &[2], KvDtype::F16, 16), key(0, &[3], KvDtype::F16, 16));
    let (d2, d3) = (payload(52, 64), payload(53, 32));
    let items = [(&k2, d2.clone(), Some(RequestId(5))), (&k3, d3.clone(), Some(RequestId(6)))];
    assert_eq!(
        s.store.put_batch(&caller(0), &put_items(&items)),
        vec![Ok(Put::Committed(Checksum::of(&d2))), Ok(Put::Committed(Checksum::of(&d3)))]
    );
    let committed = s.store.stats();
    let replay = [(&k2, payload(54, 64), Some(RequestId(5))), (&k3, d3, Some(RequestId(6)))];
    for round in 0..2 {
        assert_eq!(
            s.store.put_batch(&caller(0), &put_items(&replay)),
            vec![Ok(Put::AlreadyCommitted), Ok(Put::AlreadyCommitted)],
            "replay {round} of a committed batch"
        );
        assert_eq!(s.store.stats(), committed, "replay {round} changed the store");
    }
    let (_, dsts) = batch_get(&s, &caller(0), &[(&k2, 64)]);
    assert_eq!(dsts[0], d2, "a replay rewrote the block");
    // After an invalidation the replay still reports the first success and writes nothing.
    s.store.invalidate(&caller(0), &k2).unwrap();
    assert_eq!(
        s.store.put_batch(&caller(0), &put_items(&replay[..1])),
        vec![Ok(Put::AlreadyCommitted)]
    );
    assert_eq!(s.store.lookup(&caller(0), &k2).unwrap(), Lookup::Miss(MissReason::Absent));

    // One request id twice in a batch: for the same key a replay, for another key a conflict.
    let (k4, k5) = (key(0, &[4], KvDtype::F16, 16), key(0, &[5], KvDtype::F16, 16));
    let d4 = payload(55, 16);
    let items = [
        (&k4, d4.clone(), Some(RequestId(9))),
        (&k4, d4.clone(), Some(RequestId(9))),
        (&k5, payload(56, 16), Some(RequestId(9))),
    ];
    let answers = s.store.put_batch(&caller(0), &put_items(&items));
    assert_eq!(answers.len(), 3);
    assert_eq!(answers[0], Ok(Put::Committed(Checksum::of(&d4))));
    assert_eq!(answers[1], Ok(Put::AlreadyCommitted));
    match &answers[2] {
        Err(e @ StoreError::Replay(_)) => assert_eq!(e.retirement(), Retirement::Retired, "{e}"),
        other => panic!("a request id reused for another key in a batch answered {other:?}"),
    }
    assert_eq!(s.store.lookup(&caller(0), &k5).unwrap(), Lookup::Miss(MissReason::Absent));
}

pub fn batch_partial_failure_retires_per_key(make: &MakeSubject) {
    let limits = ResourceLimits { object_bytes_max: 1000, registrations_max: 5, ..roomy() };
    let k = |link: u8| key(0, &[link], KvDtype::F16, 16);
    let foreign = key(1, &[1], KvDtype::F16, 16);
    let setup = |s: &Subject| {
        s.store.put(&caller(1), &foreign, &payload(60, 50), None).unwrap();
        reserved(s.store.reserve(&caller(0), &k(7), 100, None))
    };
    let ((a, open_a), (b, open_b)) = twins(make, limits, setup);
    let (k1, k2, k3, k4, k5, k6, k7) = (k(1), k(2), k(3), k(4), k(5), k(6), k(7));
    let (d1, d4, d5) = (payload(61, 200), payload(62, 300), payload(63, 20));
    let items = [
        (&k1, d1.clone(), None),
        (&k2, payload(64, 1001), None),
        (&k7, payload(65, 100), None),
        (&foreign, payload(66, 10), None),
        (&k3, Vec::new(), None),
        (&k4, d4.clone(), None),
        (&k5, d5.clone(), None),
        (&k6, payload(67, 10), None),
        (&k1, payload(68, 200), None),
    ];
    let answers = a.store.put_batch(&caller(0), &put_items(&items));
    assert_eq!(
        answers,
        vec![
            Ok(Put::Committed(Checksum::of(&d1))),
            Ok(Put::Refused(Refusal::ObjectTooLarge { bytes: 1001, max: 1000 })),
            Ok(Put::Busy),
            Err(StoreError::WrongTenant { caller: tenant(0), owner: tenant(1) }),
            Err(StoreError::EmptyObject),
            Ok(Put::Committed(Checksum::of(&d4))),
            Ok(Put::Committed(Checksum::of(&d5))),
            Ok(Put::Refused(Refusal::Registrations { current: 5, max: 5 })),
            Ok(Put::AlreadyCommitted),
        ],
        "put_batch with failing items"
    );
    errors_retired("put_batch", &answers);
    assert_eq!(answers, single_puts(&b, &caller(0), &items), "put_batch differs from put");
    // Only the committed items and what was there before are charged.
    let st = a.store.stats();
    assert_eq!(
        (st.usage.inflight_requests, st.usage.registrations, st.usage.tenants),
        (1, 5, 2),
        "{st:?}"
    );
    assert_eq!(st.usage.retained_bytes, 50 + 100 + 200 + 300 + 20, "{st:?}");
    assert_eq!((st.regions.quarantined, st.regions.quarantined_bytes), (0, 0), "{st:?}");
    assert_eq!(st.committed_blocks, 4, "{st:?}");
    let all = [&k1, &k2, &k3, &k4, &k5, &k6, &k7, &foreign];
    same_state("put_batch with failing items", &a, &b, &all);

    // Reads with failing items: the hits land, nothing else is written.
    let gets = [(&k1, 200), (&k4, 299), (&foreign, 50), (&k7, 100), (&k2, 64), (&k5, 40)];
    let (answers, dsts) = batch_get(&a, &caller(0), &gets);
    assert_eq!(
        answers,
        vec![
            Ok(Get::Hit { len: 200, checksum: Checksum::of(&d1) }),
            Err(StoreError::BufferTooSmall { needed: 300, provided: 299 }),
            Err(StoreError::WrongTenant { caller: tenant(0), owner: tenant(1) }),
            Ok(Get::Miss(MissReason::NotReadable(BlockState::Reserved))),
            Ok(Get::Miss(MissReason::Absent)),
            Ok(Get::Hit { len: 20, checksum: Checksum::of(&d5) }),
        ],
        "get_batch with failing items"
    );
    errors_retired("get_batch", &answers);
    destinations_hold_only_hits(&answers, &dsts, &[Some(&d1), None, None, None, None, Some(&d5)]);
    let (single, single_dsts) = single_gets(&b, &caller(0), &gets);
    assert_eq!((answers, dsts), (single, single_dsts), "get_batch differs from get_into");
    same_state("get_batch with failing items", &a, &b, &all);

    // A batch of a caller without the right fails every item and charges nothing.
    let reader = Caller::new(tenant(0), Rights::READ_ONLY);
    let before = a.store.stats();
    let answers = a.store.put_batch(&reader, &put_items(&items[5..7]));
    let no_write = StoreError::Forbidden { tenant: tenant(0), right: crate::Right::Write };
    assert_eq!(answers, vec![Err(no_write.clone()), Err(no_write)], "put_batch read-only");
    assert_eq!(a.store.stats(), before, "a forbidden put_batch charged the store");

    // Freeing a registration lets the refused item in, as a single PUT would.
    for (s, open) in [(&a, open_a), (&b, open_b)] {
        assert_eq!(s.store.abort(&caller(0), open, Retirement::Retired).unwrap(), Abort::Released);
    }
    let retry = [(&k6, payload(67, 10), None), (&k7, payload(65, 100), None)];
    let answers = a.store.put_batch(&caller(0), &put_items(&retry));
    assert_eq!(
        answers,
        vec![
            Ok(Put::Committed(Checksum::of(&payload(67, 10)))),
            Ok(Put::Refused(Refusal::Registrations { current: 5, max: 5 })),
        ],
        "put_batch after a registration was freed"
    );
    assert_eq!(answers, single_puts(&b, &caller(0), &retry), "put_batch differs from put");
    same_state("put_batch after an abort", &a, &b, &all);
    assert_eq!(a.store.stats().usage.inflight_requests, 0);
}

pub fn empty_batch_answers_nothing(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let k = key(0, &[1], KvDtype::F16, 16);
    let data = payload(70, 64);
    s.store.put(&caller(0), &k, &data, None).unwrap();
    let open = key(0, &[2], KvDtype::F16, 16);
    let r = reserved(s.store.reserve(&caller(0), &open, 32, None));
    let before = s.store.stats();
    let nobody = Caller::new(tenant(1), Rights { read: false, write: false, admin: false });
    for who in [caller(0), nobody] {
        assert!(s.store.lookup_batch(&who, &[]).is_empty(), "lookup_batch of nothing answered");
        assert!(s.store.get_batch(&who, &mut []).is_empty(), "get_batch of nothing answered");
        assert!(s.store.put_batch(&who, &[]).is_empty(), "put_batch of nothing answered");
        assert!(
            s.store.invalidate_batch(&who, &[]).is_empty(),
            "invalidate_batch of nothing answered"
        );
        assert_eq!(s.store.stats(), before, "an empty batch changed the store");
    }
    assert_eq!(s.store.lookup(&caller(0), &k).unwrap(), Lookup::Hit { len: 64 });
    // The open reservation is untouched: it still takes its bytes and commits.
    s.store.write(&caller(0), &r, 0, &payload(71, 32)).unwrap();
    s.store.commit(&caller(0), &r).unwrap();
    assert_eq!(s.store.lookup(&caller(0), &open).unwrap(), Lookup::Hit { len: 32 });
}

pub fn corrupt_block_in_batch_is_a_miss_for_that_key_only(make: &MakeSubject) {
    let (s, _) = fresh(make, roomy());
    let keys = [1u8, 2, 3].map(|link| key(0, &[link], KvDtype::F16, 16));
    let data = [payload(80, 100), payload(81, 4096), payload(82, 300)];
    for (k, d) in keys.iter().zip(&data) {
        s.store.put(&caller(0), k, d, None).unwrap();
    }
    let before = s.store.stats();
    assert!((s.corrupt)(&keys[1]), "the harness could not corrupt a committed block");
    // The corrupt key comes twice: the read that finds it damaged drops it, so the later item
    // finds nothing, as a single-key read after that one would.
    let items = [(&keys[0], 150), (&keys[1], 4096), (&keys[1], 4096), (&keys[2], 300)];
    let (answers, dsts) = batch_get(&s, &caller(0), &items);
    assert_eq!(
        answers,
        vec![
            Ok(Get::Hit { len: 100, checksum: Checksum::of(&data[0]) }),
            Ok(Get::Miss(MissReason::Corrupt)),
            Ok(Get::Miss(MissReason::Absent)),
            Ok(Get::Hit { len: 300, checksum: Checksum::of(&data[2]) }),
        ],
        "get_batch with one corrupt block"
    );
    assert_eq!(&dsts[0][..100], &data[0][..], "a neighbour of the corrupt block lost its bytes");
    assert!(dsts[0][100..].iter().all(|b| *b == UNTOUCHED), "the store wrote past the payload");
    assert!(dsts[1].iter().all(|b| *b == 0), "corrupt bytes reached the caller's buffer");
    assert!(dsts[2].iter().all(|b| *b == UNTOUCHED), "a miss after the drop wrote its buffer");
    assert_eq!(dsts[3], data[2], "a neighbour of the corrupt block lost its bytes");
    let after = s.store.stats();
    assert_eq!(after.usage.retained_bytes, before.usage.retained_bytes - 4096);
    assert_eq!(after.committed_blocks, before.committed_blocks - 1);
    assert_eq!(after.corrupt_dropped.total(), 1);
    assert_eq!(after.corrupt_dropped.get(CorruptPhase::Get, CorruptReason::Checksum), 1);
    let all: Vec<&crate::key::PhysicalKey> = keys.iter().collect();
    assert_eq!(
        s.store.lookup_batch(&caller(0), &all),
        vec![
            Ok(Lookup::Hit { len: 100 }),
            Ok(Lookup::Miss(MissReason::Absent)),
            Ok(Lookup::Hit { len: 300 })
        ],
        "only the corrupt block was dropped"
    );
    // The dropped key is free for the recomputed block; its neighbours still read.
    let again = [(&keys[1], data[1].clone(), None), (&keys[0], data[0].clone(), None)];
    assert_eq!(
        s.store.put_batch(&caller(0), &put_items(&again)),
        vec![Ok(Put::Committed(Checksum::of(&data[1]))), Ok(Put::AlreadyCommitted)]
    );
    let (answers, dsts) = batch_get(&s, &caller(0), &[(&keys[1], 4096), (&keys[2], 300)]);
    destinations_hold_only_hits(&answers, &dsts, &[Some(&data[1]), Some(&data[2])]);
}
