//! The conformance suite, unchanged, through the TCP client against a running server (over a
//! MemoryStore and over a FileStore), and through the same-host path (Unix socket and shared
//! segment). Each subject runs its own server on a loopback port.

use std::net::SocketAddr;
use std::sync::Arc;

use gpucache_backends::MemoryStore;
use gpucache_backends::file::engine::EngineChoice;
use gpucache_backends::file::{Durability, FileStoreConfig};
use gpucache_backends::tcp::{ClientConfig, LocalConfig, Server, ServerConfig, TcpStore};
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
    serve(store, corrupt, false)
}

/// [`served`], with the client on the same-host path: every GET and PUT goes through a segment
/// shared with the server (bounce buffers: the suite's buffers are ordinary vectors).
fn served_shared(
    store: Arc<dyn Store>,
    corrupt: Box<dyn Fn(&gpucache_dataplane::PhysicalKey) -> bool + Send + Sync>,
) -> Subject {
    serve(store, corrupt, true)
}

fn serve(
    store: Arc<dyn Store>,
    corrupt: Box<dyn Fn(&gpucache_dataplane::PhysicalKey) -> bool + Send + Sync>,
    shared: bool,
) -> Subject {
    let tenants = (0..3).map(|t| Caller::new(tenant(t), Rights::ALL)).collect();
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let dir = tempfile::tempdir().expect("socket dir");
    let mut config = ServerConfig::new(addr, tenants);
    if shared {
        config.local = Some(dir.path().join("gpucache.sock"));
    }
    let server = Server::start(config, store).expect("server starts");
    let mut client = ClientConfig::new(server.local_addr(), Caller::new(tenant(0), Rights::ALL));
    if let Some(path) = server.local_path() {
        let mut local = LocalConfig::new(path);
        local.segment_bytes = gpucache_backends::shm::SEGMENT_BYTES_MIN;
        client.local = Some(local);
    }
    Subject {
        store: Box::new(TcpStore::new(client)),
        corrupt: Box::new(move |key| {
            let _serving = (&server, &dir);
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

mod memory_shared {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
        let hook = Arc::clone(&store);
        served_shared(store, Box::new(move |key| hook.corrupt_for_test(key, 17)))
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
