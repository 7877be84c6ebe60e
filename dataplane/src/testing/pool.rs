//! Registration conformance for any [`PoolMemory`]: every pool kind (host, huge pages,
//! NIC-registered, GPU, DPU slab) runs these rules through [`RegisteredPool`].

use crate::caller::{Caller, Rights};
use crate::registry::{
    AttestOutcome, Attestation, BindError, Binding, CompleteOutcome, Completion, Epoch, EpochError,
    EpochSource, LocalEpochs, MemoryKind, PoolError, PoolMemory, RegionId, RegisteredPool,
    RegistryError,
};

use super::fixture::tenant;

/// An epoch authority that is down: every advance fails.
#[derive(Debug, Default, Clone)]
pub struct UnavailableEpochs;

impl EpochSource for UnavailableEpochs {
    fn advance(&mut self, _current: Epoch) -> Result<Epoch, EpochError> {
        Err(EpochError::Unavailable { detail: "epoch authority unreachable (test)".into() })
    }
}

/// Wraps any memory and fails its `fail_at`-th bind (counting from 1), recording unbinds.
#[derive(Debug)]
pub struct FlakyBinds<M> {
    pub inner: M,
    pub fail_at: u64,
    pub binds: u64,
    pub unbinds: u64,
}

impl<M: PoolMemory> PoolMemory for FlakyBinds<M> {
    fn kind(&self) -> MemoryKind {
        self.inner.kind()
    }
    fn slot_count(&self) -> usize {
        self.inner.slot_count()
    }
    fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes()
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        self.binds += 1;
        if self.binds == self.fail_at {
            return Err(BindError {
                slot,
                kind: self.inner.kind(),
                detail: "injected bind failure".into(),
            });
        }
        self.inner.bind(slot)
    }
    fn unbind(&mut self, slot: usize, binding: Binding) {
        self.unbinds += 1;
        self.inner.unbind(slot, binding);
    }
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        self.inner.host_bytes_mut(slot)
    }
}

/// Expands to one `#[test]` per registration rule for the memory built by `$make`
/// (an expression of type `fn() -> M` giving at least four slots).
///
/// With `skip_unless = $ready` (an expression of type `fn() -> Result<(), String>`), each test
/// first asks `$ready` whether this machine can provide the memory (reserved huge pages, a
/// device) and, when it cannot, says why on stderr and passes without running.
#[macro_export]
macro_rules! pool_conformance_suite {
    ($make:expr, skip_unless = $ready:expr) => {
        $crate::pool_conformance_suite!(@tests $make, $ready;
            bound_slots_are_preferred, batch_checkout_is_all_or_nothing,
            failed_bind_changes_nothing, unknown_completion_quarantines,
            expiry_idle_and_late_completions_never_free, attestation_needs_owner_or_admin,
            fence_then_reclaim_returns_slots, failed_epoch_keeps_slots_out,
            region_ids_are_never_recycled
        );
    };
    ($make:expr) => {
        $crate::pool_conformance_suite!(@tests $make, || Ok::<(), String>(());
            bound_slots_are_preferred, batch_checkout_is_all_or_nothing,
            failed_bind_changes_nothing, unknown_completion_quarantines,
            expiry_idle_and_late_completions_never_free, attestation_needs_owner_or_admin,
            fence_then_reclaim_returns_slots, failed_epoch_keeps_slots_out,
            region_ids_are_never_recycled
        );
    };
    (@tests $make:expr, $ready:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                if let Err(why) = ($ready)() {
                    eprintln!("{} skipped: {why}", stringify!($name));
                    return;
                }
                $crate::testing::pool::$name(&$make);
            }
        )*
    };
}

fn pool<M: PoolMemory>(make: &dyn Fn() -> M) -> RegisteredPool<M> {
    let memory = make();
    assert!(memory.slot_count() >= 4, "pool conformance needs at least four slots");
    RegisteredPool::new(memory, Box::new(LocalEpochs))
}

fn owner() -> Caller {
    Caller::new(tenant(0), Rights::READ_WRITE)
}

pub fn bound_slots_are_preferred<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let first = p.checkout(&tenant(0), 2, None).unwrap();
    let slots: Vec<usize> = first.iter().map(|l| l.slot).collect();
    for l in &first {
        assert_eq!(p.complete(l.region, Completion::Retired).unwrap(), CompleteOutcome::Freed);
    }
    assert_eq!(p.bound_free_slots(), 2);
    let again = p.checkout(&tenant(0), 2, None).unwrap();
    let mut reused: Vec<usize> = again.iter().map(|l| l.slot).collect();
    reused.sort_unstable();
    let mut want = slots.clone();
    want.sort_unstable();
    assert_eq!(reused, want, "checkout must prefer already-bound slots");
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(a.binding, b.binding, "a reused slot keeps its binding");
    }
}

pub fn batch_checkout_is_all_or_nothing<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let total = p.free_slots();
    let held = p.checkout(&tenant(0), total - 1, None).unwrap();
    let e = p.checkout(&tenant(0), 2, None).unwrap_err();
    assert_eq!(e, PoolError::Exhausted { requested: 2, free: 1, total });
    assert_eq!(p.free_slots(), 1, "a refused batch changed the pool");
    assert_eq!(p.table().len(), held.len());
    assert_eq!(p.checkout(&tenant(0), 1, None).unwrap().len(), 1);
}

pub fn failed_bind_changes_nothing<M: PoolMemory>(make: &dyn Fn() -> M) {
    let inner = make();
    let mut p = RegisteredPool::new(
        FlakyBinds { inner, fail_at: 3, binds: 0, unbinds: 0 },
        Box::new(LocalEpochs),
    );
    let free = p.free_slots();
    let next = p.table().next_id();
    assert!(matches!(p.checkout(&tenant(0), 3, None), Err(PoolError::Bind(_))));
    assert_eq!(p.free_slots(), free);
    assert_eq!(p.bound_free_slots(), 0, "binds made for a failed batch must be undone");
    assert_eq!(p.memory().unbinds, 2);
    assert_eq!(p.table().next_id(), next, "a failed batch registered regions");
    assert_eq!(p.checkout(&tenant(0), 3, None).unwrap().len(), 3);
}

pub fn unknown_completion_quarantines<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let free = p.free_slots();
    let lease = p.checkout(&tenant(0), 1, None).unwrap()[0];
    assert_eq!(
        p.complete(lease.region, Completion::Unknown).unwrap(),
        CompleteOutcome::Quarantined
    );
    assert_eq!(p.free_slots(), free - 1, "a quarantined slot went back to the pool");
    assert!(p.slot_bytes_mut(&lease).is_none(), "a quarantined slot's bytes stay out of reach");
    assert_eq!(p.table().counts().quarantined, 1);
}

pub fn expiry_idle_and_late_completions_never_free<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let free = p.free_slots();
    let lease = p.checkout(&tenant(0), 1, Some(100)).unwrap()[0];
    assert!(p.expire_leases(99).is_empty());
    assert_eq!(p.expire_leases(100), vec![lease.region]);
    assert_eq!(p.free_slots(), free - 1, "lease expiry freed a slot");
    assert_eq!(
        p.attest(&owner(), lease.region, Attestation::KnownIdle).unwrap(),
        AttestOutcome::StillQuarantined
    );
    assert_eq!(
        p.complete(lease.region, Completion::Retired).unwrap(),
        CompleteOutcome::StillQuarantined
    );
    assert_eq!(p.free_slots(), free - 1, "known-idle or a late completion freed a slot");
    assert!(matches!(
        p.attest(&owner(), lease.region, Attestation::Drained).unwrap(),
        AttestOutcome::Reclaimed(_)
    ));
    assert_eq!(p.free_slots(), free);
}

pub fn attestation_needs_owner_or_admin<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let lease = p.checkout(&tenant(0), 1, None).unwrap()[0];
    // A slot still lent cannot be attested away: its agent must complete it.
    assert!(matches!(
        p.attest(&owner(), lease.region, Attestation::Drained),
        Err(PoolError::Registry(RegistryError::WrongState { .. }))
    ));
    p.complete(lease.region, Completion::Unknown).unwrap();
    let stranger = Caller::new(tenant(1), Rights::READ_WRITE);
    assert!(matches!(
        p.attest(&stranger, lease.region, Attestation::Drained),
        Err(PoolError::Registry(RegistryError::NotAuthorized { .. }))
    ));
    let admin = Caller::new(tenant(1), Rights::ALL);
    match p.attest(&admin, lease.region, Attestation::Drained).unwrap() {
        AttestOutcome::Reclaimed(proof) => assert_eq!(proof.region(), lease.region),
        other => panic!("admin attestation did not reclaim: {other:?}"),
    }
}

pub fn fence_then_reclaim_returns_slots<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let free = p.free_slots();
    let out = p.checkout(&tenant(0), 2, None).unwrap();
    p.complete(out[0].region, Completion::Unknown).unwrap();
    let e1 = p.epoch();
    assert!(p.reclaim_fenced(e1).unwrap().is_empty(), "reclaim without a bump freed slots");
    let e2 = p.bump_epoch().unwrap();
    assert!(e2 > e1);
    let newer = p.checkout(&tenant(0), 1, None).unwrap()[0];
    assert_eq!(newer.epoch, e2);
    assert!(matches!(
        p.reclaim_fenced(e1),
        Err(PoolError::Registry(RegistryError::StaleEpoch { .. }))
    ));
    let proofs = p.reclaim_fenced(e2).unwrap();
    let mut regions: Vec<RegionId> = proofs.iter().map(|pr| pr.region()).collect();
    regions.sort_unstable();
    assert_eq!(
        regions,
        vec![out[0].region, out[1].region],
        "both the quarantined and the lent slot"
    );
    assert_eq!(p.free_slots(), free - 1, "the slot checked out under the new epoch stays out");
    assert!(p.slot_bytes_mut(&out[1]).is_none(), "a fenced lease must not reach the slot");
}

pub fn failed_epoch_keeps_slots_out<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = RegisteredPool::new(make(), Box::new(UnavailableEpochs));
    let free = p.free_slots();
    let lease = p.checkout(&tenant(0), 1, None).unwrap()[0];
    p.complete(lease.region, Completion::Unknown).unwrap();
    let e = p.epoch();
    assert!(matches!(p.bump_epoch(), Err(PoolError::Registry(RegistryError::Epoch(_)))));
    assert_eq!(p.epoch(), e, "a failed bump moved the epoch");
    assert!(p.reclaim_fenced(e).unwrap().is_empty());
    assert_eq!(p.free_slots(), free - 1, "slots came back without a fence");
}

pub fn region_ids_are_never_recycled<M: PoolMemory>(make: &dyn Fn() -> M) {
    let mut p = pool(make);
    let mut seen = std::collections::BTreeSet::new();
    for round in 0..20 {
        let out = p.checkout(&tenant(0), 2, None).unwrap();
        for l in &out {
            assert!(seen.insert(l.region), "region id {} reused in round {round}", l.region);
        }
        p.complete(out[0].region, Completion::Retired).unwrap();
        p.complete(out[1].region, Completion::Unknown).unwrap();
        p.attest(&owner(), out[1].region, Attestation::Drained).unwrap();
    }
}
