//! NIC registration sits on the pool's own memory: [`NicSlots`] over a [`HugePagePool`]
//! registers each slot at its real address and length with the simulated NIC, so a slot's keys
//! cover exactly that slot, transfers move the pool's bytes, and dropping the slots takes the
//! registrations away before the memory.
//!
//! The registration conformance suite over these slots, on every huge-page tier, runs in
//! `tests/tests/pool_nic.rs`.

use gpucache_dataplane::registry::{LocalEpochs, MemoryKind, PoolMemory, RegisteredPool};
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_nic::sim::{Side, SimEndpoint, SimNic, SimNicConfig};
use gpucache_nic::slots::{NicSlots, local_key};
use gpucache_nic::transfer::{TransferLimits, TransferOutcome, Transfers};
use gpucache_nic::verbs::{
    Access, CompletionStatus, NicEndpoint, Opcode, RemoteSlice, WorkRequest, WorkRequestId,
};
use gpucache_storage::host::pool::{HugePagePolicy, HugePagePool, Tier};

const SLOTS: usize = 4;
/// Not a divisor of the page size, so slots straddle pages.
const SLOT_BYTES: usize = 3000;

fn pool_memory(tier: Tier) -> HugePagePool {
    HugePagePool::new(SLOTS, SLOT_BYTES, HugePagePolicy::only(tier)).unwrap()
}

fn sim() -> SimNic {
    SimNicConfig::new(0xB00F).build().unwrap()
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| seed.wrapping_add(i.to_le_bytes()[0])).collect()
}

fn poll_one(ep: &mut SimEndpoint) -> CompletionStatus {
    let mut out = Vec::new();
    assert_eq!(ep.poll(&mut out, 1), 1, "the simulation completes every post at the next poll");
    out[0].status
}

#[test]
fn slots_are_registered_at_the_pools_own_addresses() {
    for tier in [Tier::Plain, Tier::Transparent] {
        let nic = sim();
        let slots = NicSlots::on(nic.endpoint(Side::A), pool_memory(tier));
        let mut pool = RegisteredPool::new(slots, Box::new(LocalEpochs));
        assert_eq!(pool.memory().kind(), MemoryKind::NicRegistered { transport: "sim" });
        assert_eq!(pool.memory().memory().backing().tier, tier);
        let leases = pool.checkout(&tenant(0), SLOTS, None).unwrap();
        assert_eq!(pool.memory().registrations(), SLOTS as u64);
        for l in &leases {
            let region = pool.memory().region(l.slot).expect("a bound slot is registered");
            assert_eq!(region.len_bytes, SLOT_BYTES as u64, "the key covers one slot");
            assert_eq!(local_key(l.binding), region.lkey);
            let want = pool.memory().memory().slot(l.slot).unwrap().as_ptr();
            let lent = pool.slot_bytes_mut(l).unwrap().as_ptr();
            assert_eq!(lent, want, "the lent bytes are the pool's mapping, not a copy");
        }
    }
}

#[test]
fn a_slots_key_does_not_cover_its_neighbour() {
    let nic = sim();
    let mut ep = nic.endpoint(Side::A);
    let mut peer = nic.endpoint(Side::B);
    let remote = peer.register(SLOT_BYTES as u64, Access::REMOTE_READ_WRITE).unwrap();
    let slots = NicSlots::on(ep.clone(), pool_memory(Tier::Plain));
    let mut pool = RegisteredPool::new(slots, Box::new(LocalEpochs));
    let leases = pool.checkout(&tenant(0), 2, None).unwrap();
    let at = RemoteSlice { rkey: remote.rkey, offset_bytes: 0, len_bytes: 16 };
    let mut post = |pool: &mut RegisteredPool<_>, key_of: usize, bytes_of: usize, id: u64| {
        let request = WorkRequest {
            id: WorkRequestId(id),
            opcode: Opcode::Write,
            lkey: local_key(leases[key_of].binding),
            remote: at,
        };
        let bytes: &mut [u8] = pool.slot_bytes_mut(&leases[bytes_of]).unwrap();
        ep.post(request, &mut bytes[..16]).unwrap();
        poll_one(&mut ep)
    };
    assert_eq!(post(&mut pool, 0, 0, 1), CompletionStatus::Success);
    assert_eq!(post(&mut pool, 0, 1, 2), CompletionStatus::LocalProtectionError);
    assert_eq!(post(&mut pool, 1, 0, 3), CompletionStatus::LocalProtectionError);
    assert_eq!(post(&mut pool, 1, 1, 4), CompletionStatus::Success);
    // A heap buffer of the right length is not the slot either.
    let request = WorkRequest {
        id: WorkRequestId(5),
        opcode: Opcode::Write,
        lkey: local_key(leases[0].binding),
        remote: at,
    };
    ep.post(request, &mut [0u8; 16]).unwrap();
    assert_eq!(poll_one(&mut ep), CompletionStatus::LocalProtectionError);
}

#[test]
fn transfers_move_the_pools_bytes() {
    let nic = sim();
    let mut ep = nic.endpoint(Side::A);
    let mut peer = nic.endpoint(Side::B);
    let remote = peer.register(SLOT_BYTES as u64, Access::REMOTE_READ_WRITE).unwrap();
    let slots = NicSlots::on(ep.clone(), pool_memory(Tier::Transparent));
    let mut pool = RegisteredPool::new(slots, Box::new(LocalEpochs));
    let mut xfer = Transfers::new(TransferLimits::default());
    let leases = pool.checkout(&tenant(0), 2, None).unwrap();
    let block = pattern(7, SLOT_BYTES);
    pool.slot_bytes_mut(&leases[0]).unwrap().copy_from_slice(&block);
    let at = RemoteSlice { rkey: remote.rkey, offset_bytes: 0, len_bytes: SLOT_BYTES as u64 };
    let done = TransferOutcome::Done { len_bytes: SLOT_BYTES as u64 };
    assert_eq!(xfer.run(&mut pool, &mut ep, &leases[0], Opcode::Write, at).unwrap(), done);
    assert_eq!(peer.host_read(remote.lkey).unwrap(), block);
    assert_eq!(xfer.run(&mut pool, &mut ep, &leases[1], Opcode::Read, at).unwrap(), done);
    assert_eq!(pool.memory().memory().slot(leases[1].slot).unwrap(), &block[..]);
}

#[test]
fn a_peer_reaches_exactly_the_slot_its_key_names() {
    let nic = sim();
    let mut a = nic.endpoint(Side::A);
    let b = nic.endpoint(Side::B);
    let exposed = NicSlots::on(b, pool_memory(Tier::Plain)).with_access(Access::REMOTE_READ_WRITE);
    let mut pool = RegisteredPool::new(exposed, Box::new(LocalEpochs));
    let leases = pool.checkout(&tenant(0), 2, None).unwrap();
    let target = pool.memory().region(leases[0].slot).unwrap();
    let neighbour = leases[1].slot;
    let mut source = vec![0u8; 2 * SLOT_BYTES];
    let local = a.register(source.len() as u64, Access::LOCAL).unwrap();
    let mut write = |offset_bytes: u64, bytes: &mut [u8], id: u64| {
        let remote = RemoteSlice { rkey: target.rkey, offset_bytes, len_bytes: bytes.len() as u64 };
        let request =
            WorkRequest { id: WorkRequestId(id), opcode: Opcode::Write, lkey: local.lkey, remote };
        a.post(request, bytes).unwrap();
        poll_one(&mut a)
    };
    let block = pattern(3, SLOT_BYTES);
    source[..SLOT_BYTES].copy_from_slice(&block);
    assert_eq!(write(0, &mut source[..SLOT_BYTES], 1), CompletionStatus::Success);
    assert_eq!(pool.memory().memory().slot(leases[0].slot).unwrap(), &block[..]);
    // One byte past the slot is outside the key, even though the neighbour's bytes follow.
    let last = (SLOT_BYTES - 1) as u64;
    assert_eq!(write(last, &mut source[..2], 2), CompletionStatus::RemoteAccessError);
    assert_eq!(write(0, &mut source[..SLOT_BYTES + 1], 3), CompletionStatus::RemoteAccessError);
    let untouched = pool.memory().memory().slot(neighbour).unwrap();
    assert!(untouched.iter().all(|b| *b == 0), "a write leaked into the neighbouring slot");

    // Dropping the slots deregisters them before the memory goes: the key is dead.
    drop(pool);
    assert_eq!(write(0, &mut source[..16], 4), CompletionStatus::RemoteAccessError);
}

#[test]
fn a_failed_batch_leaves_no_registration_behind() {
    let nic = SimNicConfig { regions_max: std::num::NonZeroUsize::new(3).unwrap(), ..sim_config() }
        .build()
        .unwrap();
    let ep = nic.endpoint(Side::A);
    let slots = NicSlots::on(ep.clone(), pool_memory(Tier::Plain));
    let mut pool = RegisteredPool::new(slots, Box::new(LocalEpochs));
    assert!(pool.checkout(&tenant(0), 4, None).is_err(), "the fourth registration is refused");
    assert_eq!(pool.bound_free_slots(), 0);
    assert_eq!(pool.checkout(&tenant(0), 3, None).unwrap().len(), 3, "the three were undone");
}

fn sim_config() -> SimNicConfig {
    SimNicConfig::new(0xB00F)
}
