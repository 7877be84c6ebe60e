//! The conformance suite, unchanged, through the TCP client against a running server (over a
//! MemoryStore and over a FileStore). Each subject runs its own server on a loopback port.

use std::net::SocketAddr;
use std::sync::Arc;

use gpucache_backends::MemoryStore;
use gpucache_backends::file::engine::EngineChoice;
use gpucache_backends::file::{Durability, FileStoreConfig};
use gpucache_backends::tcp::{ClientConfig, Server, ServerConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::Subject;
use gpucache_dataplane::testing::fixture::tenant;

/// Serves `store` and returns a subject whose store is a client of it; the server lives as long
/// as the subject's corruption hook.
fn served(
    store: Arc<dyn Store>,
    corrupt: Box<dyn Fn(&gpucache_dataplane::PhysicalKey) -> bool + Send + Sync>,
) -> Subject {
    let tenants = (0..3).map(|t| Caller::new(tenant(t), Rights::ALL)).collect();
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let server = Server::start(ServerConfig::new(addr, tenants), store).expect("server starts");
    let client =
        TcpStore::new(ClientConfig::new(server.local_addr(), Caller::new(tenant(0), Rights::ALL)));
    Subject {
        store: Box::new(client),
        corrupt: Box::new(move |key| {
            let _serving = &server;
            corrupt(key)
        }),
    }
}

mod memory {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
        let hook = Arc::clone(&store);
        served(store, Box::new(move |key| hook.corrupt_for_test(key, 17)))
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod file {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }
            .expect("temp dir");
        let mut config = FileStoreConfig::new(dir.path());
        config.engine = EngineChoice::Psync;
        config.durability = Durability::None;
        config.limits = limits;
        let store = Arc::new(config.open(Arc::new(clock)).expect("file store opens"));
        let hook = Arc::clone(&store);
        served(
            store,
            Box::new(move |key| {
                let _keep = &dir;
                hook.corrupt_for_test(key, 17)
            }),
        )
    }
    gpucache_dataplane::conformance_suite!(make);
}
