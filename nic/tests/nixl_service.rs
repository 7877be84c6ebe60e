//! The GPCW stage ops over NIXL in one process: a server with [`NixlStaging`] over a
//! MemoryStore, a [`NixlClient`] with its own agent. Blocks move both ways with byte checks,
//! NIXL and plain TCP see the same store, and every refusal is typed.
//!
//! Needs `libnixl_capi.so` (docs/HARDWARE.md); skips without it, fails under
//! `GPUCACHE_REQUIRE_NIXL=1`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Get, MissReason, Put, Store, StoreError};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};
use gpucache_nic::nixl::{
    NixlClient, NixlClientConfig, NixlStaging, NixlStagingConfig, unique_agent_name, usable_or_skip,
};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::host::pool::{HugePagePolicy, Lock};
use gpucache_wire::staging::{BlockStaging, StagingFailure, StagingLimits};

const SLOT_BYTES: usize = 4 << 20;
const SIZES: [usize; 3] = [64 << 10, 1 << 20, 4 << 20];

fn huge() -> HugePagePolicy {
    HugePagePolicy::default().lock(Lock::Off)
}

struct Rig {
    server: Server,
    staging: Arc<NixlStaging>,
    store: Arc<dyn Store>,
}

fn rig(store: Arc<dyn Store>, slots: usize, slot_bytes: usize, limits: StagingLimits) -> Rig {
    let staging = NixlStagingConfig {
        agent_name: unique_agent_name("svc"),
        slot_bytes,
        slots,
        limits,
        huge_pages: huge(),
    }
    .build()
    .expect("staging");
    let staging = Arc::new(staging);
    let tenants = (0..3).map(|t| Caller::new(tenant(t), Rights::ALL)).collect();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut config = ServerConfig::new(addr, tenants);
    config.staging = Some(Arc::clone(&staging) as Arc<dyn BlockStaging>);
    let server = Server::start(config, Arc::clone(&store)).expect("server");
    Rig { server, staging, store }
}

fn memory_store() -> Arc<dyn Store> {
    let limits = ResourceLimits::default();
    Arc::new(MemoryStore::new(limits, Arc::new(ManualClock::default())).expect("limits"))
}

fn tcp(addr: SocketAddr) -> TcpStore {
    let mut config = ClientConfig::new(addr, Caller::new(tenant(0), Rights::ALL));
    config.deadline = Duration::from_secs(10);
    TcpStore::new(config)
}

fn client(addr: SocketAddr, slots: usize, slot_bytes: usize) -> NixlClient {
    let config = NixlClientConfig {
        agent_name: unique_agent_name("cli"),
        slot_bytes,
        slots,
        deadline: Duration::from_secs(5),
        huge_pages: huge(),
    };
    let client = NixlClient::new(tcp(addr), config).expect("client");
    client.attach(&Caller::new(tenant(0), Rights::ALL)).expect("attach");
    client
}

#[test]
fn blocks_move_both_ways_over_nixl_and_match_plain_tcp() {
    if !usable_or_skip() {
        return;
    }
    let rig = rig(memory_store(), 4, SLOT_BYTES, StagingLimits::default());
    let nixl = client(rig.server.local_addr(), 2, SLOT_BYTES);
    let plain = tcp(rig.server.local_addr());
    let who = Caller::new(tenant(0), Rights::ALL);
    for (i, len) in (0u8..).zip(SIZES) {
        // NIXL PUT, NIXL GET and plain GET.
        let k = key(0, &[i, 1], KvDtype::Bf16, 16);
        let data = payload(100 + u64::from(i), len);
        assert_eq!(nixl.put(&who, &k, &data, None).unwrap(), Put::Committed(Checksum::of(&data)));
        let mut back = vec![0u8; len];
        let got = nixl.get(&who, &k, &mut back).unwrap();
        assert_eq!(got, Get::Hit { len: len as u64, checksum: Checksum::of(&data) });
        assert!(back == data, "NIXL GET of {len} bytes differs");
        let mut over_tcp = vec![0u8; len];
        assert!(matches!(plain.get_into(&who, &k, &mut over_tcp).unwrap(), Get::Hit { .. }));
        assert!(over_tcp == data, "plain GET of a NIXL PUT of {len} bytes differs");
        // Plain PUT, NIXL GET.
        let k2 = key(0, &[i, 2], KvDtype::Bf16, 16);
        let data2 = payload(200 + u64::from(i), len);
        plain.put(&who, &k2, &data2, None).unwrap();
        let mut back2 = vec![0u8; len];
        assert!(matches!(nixl.get(&who, &k2, &mut back2).unwrap(), Get::Hit { .. }));
        assert!(back2 == data2, "NIXL GET of a plain PUT of {len} bytes differs");
    }
    let missing = key(0, b"absent", KvDtype::Bf16, 16);
    assert_eq!(nixl.get(&who, &missing, &mut [0u8; 16]).unwrap(), Get::Miss(MissReason::Absent));
    let c = nixl.counters();
    assert_eq!((c.puts, c.hits, c.checksum_mismatches, c.unknown), (3, 6, 0, 0));
    assert_eq!(c.transfers.done, 9);
    let s = rig.staging.stats();
    assert_eq!((s.staged, s.committed, s.open, s.quarantined), (9, 3, 0, 0));
    assert_eq!(s.free_slots, 4, "every stage was settled");
    assert_eq!(plain.stage_stats().unwrap(), s, "STAGE_STATS answers the same counters");
    assert_eq!(nixl.free_slots(), 2);
}

#[test]
fn refusals_are_typed_and_leave_nothing_behind() {
    if !usable_or_skip() {
        return;
    }
    let limits = StagingLimits { per_connection_max: 2, staged_max: 3, stage_lease_ms: 60_000 };
    let rig = rig(memory_store(), 4, 1 << 20, limits);
    let plain = tcp(rig.server.local_addr());
    let who = Caller::new(tenant(0), Rights::ALL);

    // A server without staging refuses NIXL_ATTACH with its reason.
    let bare = Server::start(
        ServerConfig::new("127.0.0.1:0".parse().unwrap(), vec![who.clone()]),
        memory_store(),
    )
    .unwrap();
    let err = tcp(bare.local_addr()).nixl_attach(&who, b"metadata").unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::NotEnabled), "{err}");

    // Wrong tenant: the key's tenant is checked before a slot is leased.
    let theirs = key(1, b"other", KvDtype::Bf16, 16);
    let err = plain.reserve_put(&who, &theirs, 10, Checksum::of(b"0123456789"), None).unwrap_err();
    assert!(
        matches!(
            err,
            gpucache_wire::staging::StageCallError::Store(StoreError::WrongTenant { .. })
        ),
        "{err}"
    );
    let item = gpucache_wire::GetItem { key: theirs.clone(), capacity: 16 };
    let err = plain.stage_get(&who, &[item]).unwrap();
    assert!(matches!(err[0], Err(StoreError::WrongTenant { .. })), "{err:?}");
    assert_eq!(rig.staging.stats().open, 0);

    // Too large for a slot.
    let k = key(0, b"big", KvDtype::Bf16, 16);
    let err = plain.reserve_put(&who, &k, (1 << 20) + 1, Checksum(0), None).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::TooLarge), "{err}");

    // A commit whose slot does not hash to the announced checksum: typed, nothing stored,
    // slot back.
    let staged = plain.reserve_put(&who, &k, 4096, Checksum(0x1234), None).unwrap();
    let free_before = rig.staging.stats().free_slots;
    let err = plain.commit_put(&who, staged.stage).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::ChecksumMismatch), "{err}");
    assert_eq!(rig.staging.stats().free_slots, free_before + 1);
    assert!(matches!(
        rig.store.lookup(&who, &k).unwrap(),
        gpucache_dataplane::store::Lookup::Miss(_)
    ));
    // Committing it again: it is gone.
    let err = plain.commit_put(&who, staged.stage).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::UnknownStage), "{err}");

    // Per-connection budget: two stages open, a third refused.
    let a = plain.reserve_put(&who, &k, 16, Checksum(1), None).unwrap();
    let b = plain.reserve_put(&who, &k, 16, Checksum(2), None).unwrap();
    let err = plain.reserve_put(&who, &k, 16, Checksum(3), None).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::OverBudget), "{err}");
    // Another tenant cannot release them.
    let other = Caller::new(tenant(1), Rights::ALL);
    assert_eq!(plain.release_stages(&other, &[a.stage, b.stage]).unwrap(), vec![false, false]);
    assert_eq!(plain.release_stages(&who, &[a.stage, b.stage]).unwrap(), vec![true, true]);
    assert_eq!(rig.staging.stats().open, 0);
    assert_eq!(rig.staging.stats().free_slots, 4);
    let _ = bare.shutdown();
}

#[test]
fn an_expired_put_stage_is_quarantined_until_the_fence() {
    if !usable_or_skip() {
        return;
    }
    // A lease of 1 ms: the admin op sees it expired on the server's clock at once.
    let limits = StagingLimits { stage_lease_ms: 1, ..StagingLimits::default() };
    let rig = rig(memory_store(), 2, 1 << 20, limits);
    let admin = tcp(rig.server.local_addr());
    let who = Caller::new(tenant(0), Rights::ALL);
    let k = key(0, b"late", KvDtype::Bf16, 16);
    let staged = admin.reserve_put(&who, &k, 64, Checksum(7), None).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while rig.staging.stats().quarantined_slots == 0 {
        admin.expire_leases().unwrap();
        assert!(std::time::Instant::now() < deadline, "the stage never expired");
        std::thread::yield_now();
    }
    // Neither RELEASE nor COMMIT gives the slot back.
    let err = admin.commit_put(&who, staged.stage).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::Memory), "{err}");
    let s = rig.staging.stats();
    assert_eq!((s.quarantined_slots, s.free_slots, s.committed), (1, 1, 0));
    let epoch = admin.bump_epoch().unwrap();
    admin.reclaim_fenced(epoch).unwrap();
    let s = rig.staging.stats();
    assert_eq!((s.quarantined_slots, s.free_slots, s.fenced), (0, 2, 1));
}

/// A connection that closes with a GET and a PUT stage open: both slots are quarantined (the
/// peer may still be reading the one and writing the other), nothing is stored, and only the
/// fence returns them.
#[test]
fn stages_open_at_close_are_quarantined_until_the_fence() {
    if !usable_or_skip() {
        return;
    }
    use gpucache_wire::staging::{PutIntent, StageOwner, StagedGet};
    let rig = rig(memory_store(), 3, 1 << 20, StagingLimits::default());
    let owner = StageOwner { connection: 77, tenant: tenant(0) };
    let data = payload(5, 4096);
    let mut fill = |slot: &mut [u8]| {
        slot[..data.len()].copy_from_slice(&data);
        Ok(Get::Hit { len: data.len() as u64, checksum: Checksum::of(&data) })
    };
    let staged = rig.staging.stage_get(&owner, 0, &mut [&mut fill]).unwrap();
    assert!(matches!(staged[..], [Ok(StagedGet::Staged { .. })]), "{staged:?}");
    let k = key(0, b"open-at-close", KvDtype::Bf16, 16);
    let intent = PutIntent { key: k.clone(), len: 64, checksum: Checksum(1), request: None };
    rig.staging.reserve_put(&owner, 0, intent).unwrap();
    assert_eq!((rig.staging.stats().open, rig.staging.stats().free_slots), (2, 1));

    rig.staging.connection_closed(owner.connection);
    let s = rig.staging.stats();
    assert_eq!((s.open, s.quarantined_slots, s.free_slots, s.released), (0, 2, 1, 0));
    assert!(matches!(
        rig.store.lookup(&Caller::new(tenant(0), Rights::ALL), &k).unwrap(),
        gpucache_dataplane::store::Lookup::Miss(_)
    ));
    assert_eq!(rig.staging.fence().unwrap(), 2);
    let s = rig.staging.stats();
    assert_eq!((s.quarantined_slots, s.free_slots), (0, 3));
}

#[test]
fn a_fence_reregisters_staging_and_stale_peers_must_reattach() {
    if !usable_or_skip() {
        return;
    }
    let rig = rig(memory_store(), 4, 1 << 20, StagingLimits::default());
    let addr = rig.server.local_addr();
    let nixl = client(addr, 2, 1 << 20);
    let admin = tcp(addr);
    let who = Caller::new(tenant(0), Rights::ALL);
    let k1 = key(0, b"before", KvDtype::Bf16, 16);
    let data = payload(31, 200_000);
    nixl.put(&who, &k1, &data, None).unwrap();

    // A second peer attaches on its own connection and opens a PUT stage.
    let mut stale_agent = gpucache_nic::nixl::NixlAgent::new(&unique_agent_name("stale")).unwrap();
    stale_agent.enable(gpucache_nic::nixl::NixlBackend::Ucx).unwrap();
    let stale = tcp(addr);
    stale.nixl_attach(&who, &stale_agent.local_metadata().unwrap()).unwrap();
    let k2 = key(0, b"stale", KvDtype::Bf16, 16);
    let open = stale.reserve_put(&who, &k2, 64, Checksum::of(&[9u8; 64]), None).unwrap();
    assert_eq!(rig.staging.registration(), 1);

    // The fence, as an operator runs it.
    let epoch = admin.bump_epoch().unwrap();
    admin.reclaim_fenced(epoch).unwrap();
    assert_eq!(rig.staging.registration(), 2, "the fence registers the staging memory anew");
    assert_eq!(rig.staging.stats().free_slots, 4);

    // The stale connection: its stage ended, and new stage ops are refused, typed, until it
    // attaches again; the server's metadata it gets then is new.
    let err = stale.commit_put(&who, open.stage).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::UnknownStage), "{err}");
    let err = stale.reserve_put(&who, &k2, 64, Checksum(1), None).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::Reattach), "{err}");
    let item = gpucache_wire::GetItem { key: k1.clone(), capacity: 1 << 20 };
    let err = stale.stage_get(&who, std::slice::from_ref(&item)).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::Reattach), "{err}");
    assert_eq!(rig.staging.stats().open, 0, "a refused stale op leases nothing");
    stale.nixl_attach(&who, &stale_agent.local_metadata().unwrap()).unwrap();
    let again = stale.reserve_put(&who, &k2, 64, Checksum(1), None).unwrap();
    assert_eq!(stale.release_stages(&who, &[again.stage]).unwrap(), vec![true]);

    // The NIXL client re-attaches once by itself and its GET and PUT work.
    let mut back = vec![0u8; data.len()];
    assert!(matches!(nixl.get(&who, &k1, &mut back).unwrap(), Get::Hit { .. }));
    assert!(back == data);
    assert_eq!(nixl.counters().reattached, 1);
    let k3 = key(0, b"after", KvDtype::Bf16, 16);
    let data3 = payload(32, 100_000);
    assert_eq!(nixl.put(&who, &k3, &data3, None).unwrap(), Put::Committed(Checksum::of(&data3)));
    assert_eq!(nixl.counters().reattached, 1, "one re-attach serves every later op");

    // The client's own fence re-registers its pool; its next op attaches again by itself.
    assert_eq!(nixl.fence().unwrap(), 0);
    let mut back3 = vec![0u8; data3.len()];
    assert!(matches!(nixl.get(&who, &k3, &mut back3).unwrap(), Get::Hit { .. }));
    assert!(back3 == data3);
    let c = nixl.counters();
    assert_eq!((c.reattached, c.unknown, c.checksum_mismatches), (2, 0, 0));
}
