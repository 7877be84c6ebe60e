//! The simulated NIC under the registration contract: byte-exact transfers, every injected
//! fault mapped onto retire, quarantine or fence, and a property test against a model.

use std::collections::BTreeSet;
use std::num::{NonZeroU32, NonZeroUsize};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::registry::{
    AttestOutcome, Attestation, CompleteOutcome, HostSlots, LocalEpochs, MemoryKind, PoolMemory,
    RegionId, RegisteredPool, SlotLease,
};
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_dataplane::testing::pool::UnavailableEpochs;
use gpucache_nic::NicError;
use gpucache_nic::sim::{Fault, FaultRates, Side, SimEndpoint, SimNic, SimNicConfig};
use gpucache_nic::slots::NicSlots;
use gpucache_nic::transfer::{TransferLimits, TransferOutcome, Transfers};
use gpucache_nic::verbs::{
    Access, CompletionStatus, Implementation, MemoryRegion, NicEndpoint, Opcode, RemoteKey,
    RemoteSlice,
};
use proptest::prelude::*;

const SLOTS: usize = 4;
const SLOT_BYTES: usize = 1024;
const DEADLINE_POLLS: u32 = 4;

struct Rig {
    nic: SimNic,
    local: SimEndpoint,
    peer: SimEndpoint,
    remote: MemoryRegion,
    pool: RegisteredPool<NicSlots<SimEndpoint>>,
    xfer: Transfers,
}

fn rig_with(config: SimNicConfig) -> Rig {
    let nic = config.build().unwrap();
    let local = nic.endpoint(Side::A);
    let mut peer = nic.endpoint(Side::B);
    let remote = peer.register((SLOTS * SLOT_BYTES) as u64, Access::REMOTE_READ_WRITE).unwrap();
    let pool =
        RegisteredPool::new(NicSlots::new(local.clone(), SLOTS, SLOT_BYTES), Box::new(LocalEpochs));
    let limits = TransferLimits {
        deadline_polls: NonZeroU32::new(DEADLINE_POLLS).unwrap(),
        poll_entries: NonZeroUsize::new(8).unwrap(),
    };
    Rig { nic, local, peer, remote, pool, xfer: Transfers::new(limits) }
}

fn rig(seed: u64) -> Rig {
    rig_with(SimNicConfig::new(seed))
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n).map(|i| seed.wrapping_mul(31).wrapping_add(i as u64 * 7).to_le_bytes()[0]).collect()
}

impl Rig {
    fn lease(&mut self, deadline_ms: Option<u64>) -> SlotLease {
        self.pool.checkout(&tenant(0), 1, deadline_ms).unwrap()[0]
    }
    fn at(&self, index: usize) -> RemoteSlice {
        RemoteSlice {
            rkey: self.remote.rkey,
            offset_bytes: (index * SLOT_BYTES) as u64,
            len_bytes: SLOT_BYTES as u64,
        }
    }
    fn run(&mut self, lease: &SlotLease, op: Opcode, remote: RemoteSlice) -> TransferOutcome {
        let mut ep = self.local.clone();
        self.xfer.run(&mut self.pool, &mut ep, lease, op, remote).unwrap()
    }
    fn fill(&mut self, lease: &SlotLease, bytes: &[u8]) {
        self.pool.slot_bytes_mut(lease).unwrap().copy_from_slice(bytes);
    }
    fn remote_bytes(&self, index: usize) -> Vec<u8> {
        let all = self.peer.host_read(self.remote.lkey).unwrap();
        all[index * SLOT_BYTES..(index + 1) * SLOT_BYTES].to_vec()
    }
    fn fence(&mut self) -> Vec<RegionId> {
        let mut ep = self.local.clone();
        self.xfer.fence(&mut self.pool, &mut ep).unwrap().iter().map(|p| p.region()).collect()
    }
    fn absorb(&mut self) -> usize {
        let mut ep = self.local.clone();
        self.xfer.absorb(&mut self.pool, &mut ep).unwrap()
    }
    fn quarantined(&self) -> usize {
        self.pool.table().counts().quarantined
    }
}

#[test]
fn says_it_is_a_simulation() {
    let r = rig(42);
    assert_eq!(r.local.implementation(), Implementation::Simulated { seed: 42 });
    assert_eq!(r.nic.implementation(), Implementation::Simulated { seed: 42 });
    assert!(format!("{:?}", r.nic).contains("simulated"));
    assert!(format!("{:?}", r.local).contains("simulated"));
    assert_eq!(r.pool.memory().kind(), MemoryKind::NicRegistered { transport: "sim" });
}

#[test]
fn byte_exact_without_faults_for_many_seeds() {
    for seed in 0..64 {
        let mut r = rig(seed);
        for index in 0..SLOTS {
            let lease = r.lease(None);
            let bytes = pattern(seed ^ index as u64, SLOT_BYTES);
            r.fill(&lease, &bytes);
            let at = r.at(index);
            let len = SLOT_BYTES as u64;
            assert_eq!(r.run(&lease, Opcode::Write, at), TransferOutcome::Done { len_bytes: len });
            assert_eq!(r.remote_bytes(index), bytes, "seed {seed}: WRITE not byte-exact");
            r.fill(&lease, &vec![0; SLOT_BYTES]);
            assert_eq!(r.run(&lease, Opcode::Read, at), TransferOutcome::Done { len_bytes: len });
            assert_eq!(r.pool.slot_bytes_mut(&lease).unwrap(), &bytes[..], "seed {seed}: READ");
            assert_eq!(r.xfer.release(&mut r.pool, &lease).unwrap(), CompleteOutcome::Freed);
        }
        assert_eq!(r.pool.free_slots(), SLOTS);
        assert_eq!(r.pool.memory().registrations(), 1, "seed {seed}: binds are kept");
        let s = r.local.stats();
        assert_eq!((s.posted, s.lost, s.duplicated, s.late), (2 * SLOTS as u64, 0, 0, 0));
    }
}

#[test]
fn partial_transfer_lands_at_its_offset() {
    let mut r = rig(1);
    let lease = r.lease(None);
    r.fill(&lease, &pattern(9, SLOT_BYTES));
    let at = RemoteSlice { rkey: r.remote.rkey, offset_bytes: 100, len_bytes: 24 };
    assert_eq!(r.run(&lease, Opcode::Write, at), TransferOutcome::Done { len_bytes: 24 });
    let remote = r.peer.host_read(r.remote.lkey).unwrap();
    assert_eq!(&remote[100..124], &pattern(9, SLOT_BYTES)[..24]);
    assert!(remote[..100].iter().chain(&remote[124..]).all(|b| *b == 0));
}

#[test]
fn lost_completion_quarantines_the_region() {
    let mut r = rig(2);
    let free = r.pool.free_slots();
    let lease = r.lease(None);
    r.local.inject(Fault::Lost).unwrap();
    let at = r.at(0);
    let outcome = r.run(&lease, Opcode::Write, at);
    assert_eq!(outcome, TransferOutcome::Unknown { region: lease.region, polls: DEADLINE_POLLS });
    assert_eq!(r.quarantined(), 1);
    assert_eq!(r.pool.free_slots(), free - 1);
    assert!(r.pool.slot_bytes_mut(&lease).is_none(), "a quarantined slot is never served");
    let mut ep = r.local.clone();
    assert_eq!(
        r.xfer.run(&mut r.pool, &mut ep, &lease, Opcode::Write, at),
        Err(NicError::LeaseNotUsable { region: lease.region })
    );
    assert_eq!(r.xfer.counters().unknown, 1);
    assert_eq!(r.local.stats().lost, 1);
}

#[test]
fn lease_expiry_and_known_idle_do_not_free_only_the_fence_does() {
    let mut r = rig(3);
    let lease = r.lease(Some(100));
    r.local.inject(Fault::Lost).unwrap();
    let at = r.at(0);
    assert!(matches!(r.run(&lease, Opcode::Read, at), TransferOutcome::Unknown { .. }));
    assert!(r.pool.expire_leases(1_000).is_empty(), "already quarantined");
    let owner = Caller::new(tenant(0), Rights::READ_WRITE);
    assert_eq!(
        r.pool.attest(&owner, lease.region, Attestation::KnownIdle).unwrap(),
        AttestOutcome::StillQuarantined
    );
    assert_eq!(r.pool.free_slots(), SLOTS - 1, "expiry or known-idle freed a quarantined slot");
    assert_eq!(r.fence(), vec![lease.region]);
    assert_eq!(r.pool.free_slots(), SLOTS);
    assert_eq!(r.quarantined(), 0);
    assert_eq!(r.xfer.abandoned(), 0);
    let again = r.lease(None);
    assert!(again.region > lease.region, "region ids are never reused");
    assert_eq!(r.run(&again, Opcode::Read, at), TransferOutcome::Done { len_bytes: 1024 });
}

#[test]
fn bump_epoch_then_reclaim_fenced_frees_and_a_failed_epoch_frees_nothing() {
    let mut r = rig(4);
    let lease = r.lease(None);
    r.local.inject(Fault::Lost).unwrap();
    let at = r.at(1);
    r.run(&lease, Opcode::Write, at);
    let e = r.pool.bump_epoch().unwrap();
    let proofs = r.pool.reclaim_fenced(e).unwrap();
    assert_eq!(proofs.iter().map(|p| p.region()).collect::<Vec<_>>(), vec![lease.region]);
    assert_eq!(r.pool.free_slots(), SLOTS);

    // An epoch authority that is down leaves the quarantined slot out.
    let nic = SimNicConfig::new(4).build().unwrap();
    let mut ep = nic.endpoint(Side::A);
    let mut peer = nic.endpoint(Side::B);
    let remote = peer.register(SLOT_BYTES as u64, Access::REMOTE_READ_WRITE).unwrap();
    let mut pool = RegisteredPool::new(
        NicSlots::new(ep.clone(), SLOTS, SLOT_BYTES),
        Box::new(UnavailableEpochs),
    );
    let mut xfer = Transfers::new(TransferLimits::default());
    let lease = pool.checkout(&tenant(0), 1, None).unwrap()[0];
    ep.inject(Fault::Lost).unwrap();
    let at = RemoteSlice { rkey: remote.rkey, offset_bytes: 0, len_bytes: SLOT_BYTES as u64 };
    let outcome = xfer.run(&mut pool, &mut ep, &lease, Opcode::Write, at).unwrap();
    assert!(matches!(outcome, TransferOutcome::Unknown { .. }));
    assert!(matches!(xfer.fence(&mut pool, &mut ep), Err(NicError::Pool(_))));
    assert_eq!(pool.free_slots(), SLOTS - 1, "slots came back without a fence");
}

#[test]
fn late_completion_after_quarantine_changes_nothing() {
    let mut config = SimNicConfig::new(5);
    config.late_polls = NonZeroU32::new(10).unwrap();
    let mut r = rig_with(config);
    let lease = r.lease(None);
    r.local.inject(Fault::Late).unwrap();
    let at = r.at(0);
    assert!(matches!(r.run(&lease, Opcode::Write, at), TransferOutcome::Unknown { .. }));
    let mut arrived = 0;
    for _ in 0..20 {
        arrived += r.absorb();
    }
    assert_eq!(arrived, 1, "the late completion came");
    assert_eq!(r.xfer.counters().late_after_quarantine, 1);
    assert_eq!(r.quarantined(), 1, "a late completion freed a quarantined slot");
    assert_eq!(r.pool.free_slots(), SLOTS - 1);
    assert_eq!(r.fence(), vec![lease.region]);
}

#[test]
fn late_completion_after_a_drained_attestation_reaches_nobody() {
    let mut config = SimNicConfig::new(15);
    config.late_polls = NonZeroU32::new(10).unwrap();
    let mut r = rig_with(config);
    let lease = r.lease(None);
    r.local.inject(Fault::Late).unwrap();
    let at = r.at(0);
    assert!(matches!(r.run(&lease, Opcode::Write, at), TransferOutcome::Unknown { .. }));
    let owner = Caller::new(tenant(0), Rights::READ_WRITE);
    let drained = r.pool.attest(&owner, lease.region, Attestation::Drained).unwrap();
    assert!(matches!(drained, AttestOutcome::Reclaimed(_)));
    let next = r.lease(None);
    assert_eq!(next.slot, lease.slot, "the bound slot is reused");
    assert!(next.region > lease.region);
    for _ in 0..20 {
        r.absorb();
    }
    assert_eq!(r.xfer.counters().late_after_quarantine, 1);
    assert!(r.pool.slot_bytes_mut(&next).is_some(), "the new holder keeps its slot");
    assert_eq!(r.xfer.release(&mut r.pool, &next).unwrap(), CompleteOutcome::Freed);
}

#[test]
fn late_completion_within_the_deadline_is_a_success() {
    let mut config = SimNicConfig::new(6);
    config.late_polls = NonZeroU32::new(DEADLINE_POLLS - 1).unwrap();
    let mut r = rig_with(config);
    let lease = r.lease(None);
    r.local.inject(Fault::Late).unwrap();
    let at = r.at(0);
    assert_eq!(r.run(&lease, Opcode::Write, at), TransferOutcome::Done { len_bytes: 1024 });
    assert_eq!(r.quarantined(), 0);
}

#[test]
fn duplicated_completions_are_ignored_and_counted() {
    let mut r = rig(7);
    let lease = r.lease(None);
    r.local.inject(Fault::Duplicated).unwrap();
    let at = r.at(0);
    assert_eq!(r.run(&lease, Opcode::Write, at), TransferOutcome::Done { len_bytes: 1024 });
    assert_eq!(r.run(&lease, Opcode::Read, at), TransferOutcome::Done { len_bytes: 1024 });
    let c = r.xfer.counters();
    assert_eq!((c.done, c.duplicates_ignored, c.unknown_ids_ignored), (2, 1, 0));
    assert_eq!(r.local.stats().duplicated, 1);
    assert_eq!(r.xfer.release(&mut r.pool, &lease).unwrap(), CompleteOutcome::Freed);
}

#[test]
fn remote_access_errors_are_retired_and_the_slot_is_reusable() {
    let mut r = rig(8);
    let lease = r.lease(None);
    let good = r.at(0);
    r.local.inject(Fault::RemoteAccess).unwrap();
    let bad_key = RemoteSlice { rkey: RemoteKey(r.remote.rkey.0 + 2), ..good };
    let out_of_bounds = RemoteSlice { offset_bytes: (SLOTS * SLOT_BYTES) as u64 - 8, ..good };
    let lkey_as_rkey = RemoteSlice { rkey: RemoteKey(r.remote.lkey.0), ..good };
    let failed = TransferOutcome::Failed { status: CompletionStatus::RemoteAccessError };
    for at in [good, bad_key, out_of_bounds, lkey_as_rkey] {
        assert_eq!(r.run(&lease, Opcode::Write, at), failed, "{at:?}");
    }
    assert_eq!(r.remote_bytes(0), vec![0; SLOT_BYTES], "a refused access moved bytes");
    r.fill(&lease, &pattern(8, SLOT_BYTES));
    assert_eq!(r.run(&lease, Opcode::Write, good), TransferOutcome::Done { len_bytes: 1024 });
    assert_eq!(r.remote_bytes(0), pattern(8, SLOT_BYTES));
    assert_eq!(r.xfer.release(&mut r.pool, &lease).unwrap(), CompleteOutcome::Freed);
    assert_eq!(r.local.stats().remote_access_errors, 4);
    assert_eq!(r.quarantined(), 0);
}

#[test]
fn regions_closed_to_peers_refuse_them() {
    let mut r = rig(9);
    let mut peer = r.peer.clone();
    let read_only = peer.register(64, Access { remote_read: true, remote_write: false }).unwrap();
    let lease = r.lease(None);
    let at = RemoteSlice { rkey: read_only.rkey, offset_bytes: 0, len_bytes: 64 };
    let refused = TransferOutcome::Failed { status: CompletionStatus::RemoteAccessError };
    assert_eq!(r.run(&lease, Opcode::Write, at), refused);
    assert_eq!(r.run(&lease, Opcode::Read, at), TransferOutcome::Done { len_bytes: 64 });
    let local_only = peer.register(64, Access::LOCAL).unwrap();
    let at = RemoteSlice { rkey: local_only.rkey, ..at };
    assert_eq!(r.run(&lease, Opcode::Read, at), refused);
}

#[test]
fn unregistered_local_memory_is_a_local_protection_error() {
    let nic = SimNicConfig::new(10).build().unwrap();
    let mut ep = nic.endpoint(Side::A);
    let mut peer = nic.endpoint(Side::B);
    let remote = peer.register(4096, Access::REMOTE_READ_WRITE).unwrap();
    let mut pool = RegisteredPool::new(HostSlots::new(4, 4096), Box::new(LocalEpochs));
    let lease = pool.checkout(&tenant(0), 1, None).unwrap()[0];
    let mut xfer = Transfers::new(TransferLimits::default());
    let at = RemoteSlice { rkey: remote.rkey, offset_bytes: 0, len_bytes: 4096 };
    let outcome = xfer.run(&mut pool, &mut ep, &lease, Opcode::Write, at).unwrap();
    assert_eq!(outcome, TransferOutcome::Failed { status: CompletionStatus::LocalProtectionError });
    let too_long = RemoteSlice { len_bytes: 4097, ..at };
    assert_eq!(
        xfer.run(&mut pool, &mut ep, &lease, Opcode::Write, too_long),
        Err(NicError::TooLong { len_bytes: 4097, slot_bytes: 4096 })
    );
}

#[test]
fn link_loss_fails_retired_then_flushes_until_the_fence_resets() {
    let mut r = rig(11);
    let a = r.lease(None);
    let b = r.lease(None);
    let at = r.at(0);
    r.local.inject(Fault::LinkLoss).unwrap();
    let status = |s| TransferOutcome::Failed { status: s };
    assert_eq!(r.run(&a, Opcode::Write, at), status(CompletionStatus::RetryExceeded));
    assert!(!r.nic.link_up());
    assert_eq!(r.run(&b, Opcode::Write, at), status(CompletionStatus::Flushed));
    assert_eq!(r.run(&a, Opcode::Read, at), status(CompletionStatus::Flushed));
    assert_eq!(r.quarantined(), 0, "retired failures quarantine nothing");
    assert_eq!(r.xfer.release(&mut r.pool, &a).unwrap(), CompleteOutcome::Freed);
    assert!(r.pool.slot_bytes_mut(&b).is_some(), "the slot is still the caller's to reuse");
    // A fence resets the queue pair; the lent slot from the old epoch comes back too.
    assert_eq!(r.fence(), vec![b.region]);
    assert!(r.nic.link_up());
    let c = r.lease(None);
    assert_eq!(r.run(&c, Opcode::Write, at), TransferOutcome::Done { len_bytes: 1024 });
    let s = r.local.stats();
    assert_eq!((s.retry_exceeded, s.flushed), (1, 2));
}

#[test]
fn queue_full_and_bad_config_are_refused_with_numbers() {
    let mut faults = FaultRates::NONE;
    faults.lost_per_million = 600_000;
    faults.late_per_million = 500_000;
    assert_eq!(
        SimNicConfig::new(0).with_faults(faults).build().unwrap_err(),
        NicError::FaultRatesTooHigh { total_per_million: 1_100_000, max_per_million: 1_000_000 }
    );
    let mut config = SimNicConfig::new(12);
    config.send_queue_depth = NonZeroUsize::new(1).unwrap();
    config.late_polls = NonZeroU32::new(100).unwrap();
    let mut r = rig_with(config);
    let a = r.lease(None);
    let b = r.lease(None);
    let at = r.at(0);
    r.local.inject(Fault::Late).unwrap();
    assert!(matches!(r.run(&a, Opcode::Write, at), TransferOutcome::Unknown { .. }));
    let mut ep = r.local.clone();
    assert_eq!(
        r.xfer.run(&mut r.pool, &mut ep, &b, Opcode::Write, at),
        Err(NicError::QueueFull { outstanding: 1, depth: 1 })
    );
    assert!(r.pool.slot_bytes_mut(&b).is_some(), "a refused post leaves the slot lent");
}

fn seeded_outcomes(seed: u64) -> (Vec<TransferOutcome>, gpucache_nic::sim::SimStats) {
    let faults = FaultRates {
        lost_per_million: 50_000,
        duplicated_per_million: 100_000,
        late_per_million: 100_000,
        remote_access_per_million: 50_000,
        link_loss_per_million: 10_000,
    };
    let mut r = rig_with(SimNicConfig::new(seed).with_faults(faults));
    let mut outcomes = Vec::new();
    for i in 0..200 {
        if r.pool.free_slots() == 0 {
            r.fence();
        }
        let lease = r.lease(None);
        let at = r.at(i % SLOTS);
        let outcome = r.run(&lease, Opcode::Write, at);
        if !matches!(outcome, TransferOutcome::Unknown { .. }) {
            r.xfer.release(&mut r.pool, &lease).unwrap();
        }
        outcomes.push(outcome);
    }
    (outcomes, r.local.stats())
}

#[test]
fn seeded_faults_replay_from_the_seed() {
    for seed in [0, 1, 0xDEAD_BEEF] {
        let first = seeded_outcomes(seed);
        assert_eq!(first, seeded_outcomes(seed), "seed {seed} did not replay");
        let s = first.1;
        assert!(s.lost + s.late + s.duplicated + s.remote_access_errors > 0, "seed {seed}");
    }
    assert_ne!(seeded_outcomes(1).0, seeded_outcomes(2).0);
}

// ---------------------------------------------------------------------------------------------
// Property: random fault plans against a simple model.

#[derive(Debug, Clone, Copy)]
enum Op {
    Transfer { fault: Fault, write: bool },
    Absorb,
    ExpireLeases,
    Fence,
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        4 => Just(Fault::None),
        1 => Just(Fault::Lost),
        1 => Just(Fault::Duplicated),
        1 => Just(Fault::Late),
        1 => Just(Fault::RemoteAccess),
        1 => Just(Fault::LinkLoss),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (fault(), any::<bool>()).prop_map(|(fault, write)| Op::Transfer { fault, write }),
        2 => Just(Op::Absorb),
        1 => Just(Op::ExpireLeases),
        1 => Just(Op::Fence),
    ]
}

/// What the model expects of one transfer.
fn expected(fault: Fault, link_up: &mut bool) -> Option<CompletionStatus> {
    if !*link_up {
        return Some(CompletionStatus::Flushed);
    }
    match fault {
        Fault::None | Fault::Duplicated => Some(CompletionStatus::Success),
        // late_polls is above the deadline, so a late completion is an unknown outcome.
        Fault::Lost | Fault::Late => None,
        Fault::RemoteAccess => Some(CompletionStatus::RemoteAccessError),
        Fault::LinkLoss => {
            *link_up = false;
            Some(CompletionStatus::RetryExceeded)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_fault_plans_follow_the_model(
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut config = SimNicConfig::new(seed);
        config.late_polls = NonZeroU32::new(DEADLINE_POLLS + 2).unwrap();
        let mut r = rig_with(config);
        let mut link_up = true;
        let mut quarantined: BTreeSet<RegionId> = BTreeSet::new();
        let mut seen: BTreeSet<RegionId> = BTreeSet::new();
        let mut last: Option<RegionId> = None;
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Op::Transfer { fault, write } => {
                    if r.pool.free_slots() == 0 {
                        continue;
                    }
                    let lease = r.lease(Some(1));
                    prop_assert!(seen.insert(lease.region), "seed {seed} step {step}: id reused");
                    prop_assert!(last < Some(lease.region), "seed {seed}: ids not monotonic");
                    last = Some(lease.region);
                    let index = lease.slot;
                    let bytes = pattern(seed ^ step as u64, SLOT_BYTES);
                    r.fill(&lease, &bytes);
                    r.local.inject(fault).unwrap();
                    let opcode = if write { Opcode::Write } else { Opcode::Read };
                    let before = r.remote_bytes(index);
                    let at = r.at(index);
                    let got = r.run(&lease, opcode, at);
                    match (expected(fault, &mut link_up), got) {
                        (Some(CompletionStatus::Success), TransferOutcome::Done { len_bytes }) => {
                            prop_assert_eq!(len_bytes, SLOT_BYTES as u64);
                            let want = if write { bytes.clone() } else { before.clone() };
                            prop_assert_eq!(r.remote_bytes(index), want.clone());
                            prop_assert_eq!(r.pool.slot_bytes_mut(&lease).unwrap(), &want[..]);
                        }
                        (Some(status), TransferOutcome::Failed { status: got }) => {
                            prop_assert_eq!(status, got, "seed {}", seed);
                            prop_assert_eq!(r.remote_bytes(index), before, "a failure moved bytes");
                        }
                        (None, TransferOutcome::Unknown { region, .. }) => {
                            prop_assert_eq!(region, lease.region);
                            quarantined.insert(region);
                        }
                        (want, got) => {
                            prop_assert!(false, "seed {seed} step {step}: want {want:?}, got {got:?}");
                        }
                    }
                    if !quarantined.contains(&lease.region) {
                        prop_assert_eq!(
                            r.xfer.release(&mut r.pool, &lease).unwrap(),
                            CompleteOutcome::Freed
                        );
                    }
                }
                Op::Absorb => {
                    r.absorb();
                }
                Op::ExpireLeases => {
                    prop_assert!(r.pool.expire_leases(u64::MAX).is_empty());
                }
                Op::Fence => {
                    let reclaimed: BTreeSet<RegionId> = r.fence().into_iter().collect();
                    prop_assert_eq!(&reclaimed, &quarantined, "seed {}", seed);
                    quarantined.clear();
                    link_up = true;
                }
            }
            prop_assert_eq!(r.quarantined(), quarantined.len(), "seed {} step {}", seed, step);
            prop_assert_eq!(r.pool.free_slots(), SLOTS - quarantined.len());
            prop_assert!(r.xfer.abandoned() <= SLOTS);
            prop_assert_eq!(r.xfer.counters().unknown_ids_ignored, 0);
        }
    }
}

mod conformance {
    use gpucache_nic::sim::{Side, SimEndpoint, SimNicConfig};
    use gpucache_nic::slots::NicSlots;

    fn make() -> NicSlots<SimEndpoint> {
        let nic = SimNicConfig::new(0x5EED).build().expect("a fault-free config is valid");
        NicSlots::new(nic.endpoint(Side::A), 6, 4096)
    }

    gpucache_dataplane::pool_conformance_suite!(make);
}
