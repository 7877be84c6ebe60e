//! The store conformance suite, unchanged, through [`NixlClient`]: every GET and PUT moves its
//! payload over NIXL (READ of a staged server slot, WRITE into a leased one) against a server
//! with [`NixlStaging`] over a MemoryStore, both in this process with their own agents.
//!
//! Each subject builds two agents and a server, so the suite takes minutes; scripts/test.sh
//! leaves it out of its NIXL step. Run it with
//! `cargo test -p gpucache-nic --features nixl --test nixl_conformance` (NIXL on
//! `LD_LIBRARY_PATH`, `UCX_MODULES=^ib`). Without NIXL the subjects cannot be built: it panics
//! with the reason.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpucache_backends::MemoryStore;
use gpucache_backends::pool::{HugePagePolicy, Lock};
use gpucache_backends::tcp::staging::{BlockStaging, StagingLimits};
use gpucache_backends::tcp::{ClientConfig, Server, ServerConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::Subject;
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_nic::nixl::{NixlClient, NixlClientConfig, NixlStagingConfig};

const SLOT_BYTES: usize = 1 << 20;

fn unique(name: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    let huge = HugePagePolicy::default().lock(Lock::Off);
    let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
    let staging = NixlStagingConfig {
        agent_name: unique("svc"),
        slot_bytes: SLOT_BYTES,
        slots: 16,
        limits: StagingLimits::default(),
        huge_pages: huge,
    }
    .build()
    .expect("staging (NIXL must be available)");
    let tenants = (0..3).map(|t| Caller::new(tenant(t), Rights::ALL)).collect();
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let mut config = ServerConfig::new(addr, tenants);
    config.staging = Some(Arc::new(staging) as Arc<dyn BlockStaging>);
    let server = Server::start(config, Arc::clone(&store) as Arc<dyn Store>).expect("server");
    let control = Caller::new(tenant(0), Rights::ALL);
    let mut client = ClientConfig::new(server.local_addr(), control.clone());
    client.deadline = Duration::from_secs(10);
    let nixl = NixlClient::new(
        TcpStore::new(client),
        NixlClientConfig {
            agent_name: unique("cli"),
            slot_bytes: SLOT_BYTES,
            slots: 4,
            deadline: Duration::from_secs(5),
            huge_pages: huge,
        },
    )
    .expect("client");
    nixl.attach(&control).expect("attach");
    let corrupt = move |key: &gpucache_dataplane::PhysicalKey| {
        let _serving = &server;
        store.corrupt_for_test(key, 17)
    };
    Subject { store: Box::new(nixl), corrupt: Box::new(corrupt) }
}

gpucache_dataplane::conformance_suite!(make);
