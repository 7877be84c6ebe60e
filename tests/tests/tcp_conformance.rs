//! The conformance suite, unchanged, through the TCP client against a running server (over a
//! MemoryStore and over a FileStore, with open tenants; over a MemoryStore with every tenant
//! sealed with HMAC-SHA-256; and over a MemoryStore on the same-host path, Unix socket and shared
//! segment, sealed with keyed BLAKE3). Each subject runs its own server.

use std::net::SocketAddr;
use std::sync::Arc;

use gpucache_client::{ClientConfig, Credentials, LocalConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::Subject;
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_service::auth::{Secret, TenantKey, TenantKeys};
use gpucache_service::{Server, ServerConfig, TenantAuth};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_wire::SealAlgorithm;

/// Serves `store` and returns a subject whose store is a client of it; the server lives as long
/// as the subject's corruption hook.
fn served(
    store: Arc<dyn Store>,
    corrupt: Box<dyn Fn(&gpucache_dataplane::PhysicalKey) -> bool + Send + Sync>,
) -> Subject {
    served_with(store, corrupt, None, false)
}

/// [`served`], with every tenant sealed under `seal` when it is given, and the client on the
/// same-host path when `shared` (every GET and PUT then goes through the shared segment, by
/// bounce buffers: the suite's buffers are ordinary vectors).
fn served_with(
    store: Arc<dyn Store>,
    corrupt: Box<dyn Fn(&gpucache_dataplane::PhysicalKey) -> bool + Send + Sync>,
    seal: Option<SealAlgorithm>,
    shared: bool,
) -> Subject {
    let tenants = (0..3).map(|t| Caller::new(tenant(t), Rights::ALL)).collect();
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let dir = tempfile::tempdir().expect("socket dir");
    let mut config = ServerConfig::new(addr, tenants);
    if shared {
        config.local = Some(dir.path().join("gpucache.sock"));
    }
    let secret =
        |t: usize| Secret::new(vec![0x40 + u8::try_from(t).unwrap_or(0); 32]).expect("secret");
    if seal.is_some() {
        for t in 0..3 {
            let key = TenantKey { id: format!("k{t}"), secret: secret(t), not_after_s: None };
            let keys = TenantKeys::fixed(vec![key]).expect("keys");
            config.auth.insert(tenant(t), TenantAuth::new(keys));
        }
    }
    let server = Server::start(config, store).expect("server starts");
    let mut client = ClientConfig::new(server.local_addr(), Caller::new(tenant(0), Rights::ALL));
    if let Some(alg) = seal {
        for t in 0..3 {
            let credentials =
                Credentials { seal: alg, ..Credentials::new(format!("k{t}"), secret(t)) };
            client = client.with_credentials(tenant(t), credentials);
        }
    }
    if let Some(path) = server.local_path() {
        let mut local = LocalConfig::new(path);
        local.segment_bytes = gpucache_storage::host::segment::SEGMENT_BYTES_MIN;
        client.local = Some(local);
    }
    let client = TcpStore::new(client);
    Subject {
        store: Box::new(client),
        corrupt: Box::new(move |key| {
            let _serving = (&server, &dir);
            corrupt(key)
        }),
        evicted: None,
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

mod shared_sealed_blake3 {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
        let hook = Arc::clone(&store);
        let corrupt =
            Box::new(move |key: &gpucache_dataplane::PhysicalKey| hook.corrupt_for_test(key, 17));
        served_with(store, corrupt, Some(SealAlgorithm::Blake3), true)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod sealed_hmac {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
        let hook = Arc::clone(&store);
        let corrupt =
            Box::new(move |key: &gpucache_dataplane::PhysicalKey| hook.corrupt_for_test(key, 17));
        served_with(store, corrupt, Some(SealAlgorithm::HmacSha256), false)
    }
    gpucache_dataplane::conformance_suite!(make);
}
