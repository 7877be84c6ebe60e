//! The store conformance suite, unchanged, through [`NixlClient`]: every GET and PUT moves its
//! payload over NIXL (READ of a staged server slot, WRITE into a leased one) against a server
//! with [`NixlStaging`] over a MemoryStore, both in this process with their own agents.
//!
//! Every subject gets a fresh MemoryStore and a fresh server, but the NIXL side is reused: a
//! test thread keeps one spare pair (the server's staging, the client with its agent and pool)
//! and hands it to its next subject. Creating two agents, their UCX workers and their
//! registrations and exchanging metadata costs about a quarter of a second, and the model
//! properties build one subject per generated case; that, not the transfers, is what made the
//! suite take minutes. A spare comes back only when its server has shut down (so no late
//! connection close can settle the next server's stages) and both pools are clean; a pair with
//! open stages or quarantined slots is fenced and dropped, and the next subject builds its own.
//!
//! Run it with `cargo test -p gpucache-nic --features nixl --test nixl_conformance` (NIXL on
//! `LD_LIBRARY_PATH`, `UCX_MODULES=^ib`). Without NIXL the subjects cannot be built: it panics
//! with the reason.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::Subject;
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_nic::nixl::{
    NixlClient, NixlClientConfig, NixlStaging, NixlStagingConfig, unique_agent_name,
};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::host::pool::{HugePagePolicy, Lock};
use gpucache_wire::staging::{BlockStaging, StagingLimits};

const SLOT_BYTES: usize = 1 << 20;

/// The reusable NIXL side of a subject.
struct Spare {
    staging: Arc<NixlStaging>,
    client: NixlClient,
}

thread_local! {
    /// At most one spare per test thread.
    static SPARE: RefCell<Option<Spare>> = const { RefCell::new(None) };
}

fn control() -> Caller {
    Caller::new(tenant(0), Rights::ALL)
}

fn control_config(addr: SocketAddr) -> ClientConfig {
    let mut config = ClientConfig::new(addr, control());
    config.deadline = Duration::from_secs(10);
    config
}

fn fresh_spare(addr: SocketAddr) -> (Spare, bool) {
    let huge = HugePagePolicy::default().lock(Lock::Off);
    let staging = NixlStagingConfig {
        agent_name: unique_agent_name("svc"),
        slot_bytes: SLOT_BYTES,
        slots: 16,
        limits: StagingLimits::default(),
        huge_pages: huge,
    }
    .build()
    .expect("staging (NIXL must be available)");
    let client = NixlClient::new(
        TcpStore::new(control_config(addr)),
        NixlClientConfig {
            agent_name: unique_agent_name("cli"),
            slot_bytes: SLOT_BYTES,
            slots: 4,
            deadline: Duration::from_secs(5),
            huge_pages: huge,
        },
    )
    .expect("client");
    (Spare { staging: Arc::new(staging), client }, true)
}

/// Gives the spare back when the subject ends: its server is shut down first, then anything
/// left quarantined on either side is fenced.
struct Lent {
    server: Option<Server>,
    client: Option<Arc<NixlClient>>,
    staging: Arc<NixlStaging>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        let (Some(server), Some(client)) = (self.server.take(), self.client.take()) else {
            return;
        };
        // The subject's store (the other reference) is dropped before its corruption hook.
        let Ok(client) = Arc::try_unwrap(client) else { return };
        // Close the control connection before the server stops; connect nowhere until reused.
        let idle: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let client = client.reconnect(TcpStore::new(control_config(idle)));
        if server.shutdown() != 0 {
            return;
        }
        let staged = self.staging.stats();
        let mut fenced = false;
        if staged.open != 0 || staged.quarantined_slots != 0 {
            if self.staging.fence().is_err() {
                return;
            }
            fenced = true;
        }
        if client.abandoned() != 0 || client.region_counts().quarantined != 0 {
            if client.fence().is_err() {
                return;
            }
            fenced = true;
        }
        let spare = Spare { staging: Arc::clone(&self.staging), client };
        if !fenced {
            SPARE.with(|s| *s.borrow_mut() = Some(spare));
        }
        // A fenced pair is dropped: a fresh one costs less to reason about than a re-attach.
    }
}

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    let object_bytes_max = limits.object_bytes_max;
    let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
    let unbound: SocketAddr = "127.0.0.1:1".parse().expect("addr");
    let (spare, new) = match SPARE.with(|s| s.borrow_mut().take()) {
        Some(spare) => (spare, false),
        None => fresh_spare(unbound),
    };
    let tenants = (0..3).map(|t| Caller::new(tenant(t), Rights::ALL)).collect();
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let mut config = ServerConfig::new(addr, tenants);
    config.staging = Some(Arc::clone(&spare.staging) as Arc<dyn BlockStaging>);
    // As `gpucache serve` does: the LIMITS answer states the store's largest block.
    config.object_bytes_max = Some(object_bytes_max);
    let server = Server::start(config, Arc::clone(&store) as Arc<dyn Store>).expect("server");
    let nixl = spare.client.reconnect(TcpStore::new(control_config(server.local_addr())));
    if new {
        nixl.attach(&control()).expect("attach");
    }
    let nixl = Arc::new(nixl);
    let lent =
        Lent { server: Some(server), client: Some(Arc::clone(&nixl)), staging: spare.staging };
    let corrupt = move |key: &gpucache_dataplane::PhysicalKey| {
        let _lent = &lent;
        store.corrupt_for_test(key, 17)
    };
    Subject { store: Box::new(nixl), corrupt: Box::new(corrupt), evicted: None }
}

gpucache_dataplane::conformance_suite!(make);
