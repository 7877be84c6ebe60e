//! 32 clients, two tenants, mixed operations against a FileStore behind the native server for
//! GPUCACHE_SOAK_SECONDS (60 by default): every GET returns the exact bytes of a committed PUT
//! or a miss, no tenant ever reads another's block, and no error other than a typed refusal or
//! the expected cross-tenant refusal ever comes back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Lookup, Put, Store, StoreError};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};

const CLIENTS: usize = 32;
const KEYS_PER_TENANT: u8 = 64;

fn soak_seconds() -> u64 {
    std::env::var("GPUCACHE_SOAK_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(60)
}

fn len_of(tenant: usize, k: u8) -> usize {
    1 + (usize::from(k) * 4099 + tenant * 17) % (192 << 10)
}

/// The one payload a key of a tenant ever holds (create-only): any hit must be exactly this.
fn value(tenant: usize, k: u8) -> Vec<u8> {
    payload(u64::from(k) << 8 | tenant as u64, len_of(tenant, k))
}

#[derive(Default)]
struct Counts {
    ops: AtomicU64,
    hits: AtomicU64,
    refusals: AtomicU64,
    cross_refused: AtomicU64,
}

#[test]
fn thirty_two_clients_two_tenants_mixed_operations() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = FileStoreConfig::new(dir.path());
    config.engine = EngineChoice::Auto;
    config.durability = Durability::None;
    // Small enough that the run evicts: eviction races reads, which must stay exact or miss.
    config.limits = ResourceLimits {
        object_bytes_max: 1 << 20,
        retained_bytes_max: 8 << 20,
        tenant_retained_bytes_max: 6 << 20,
        ..ResourceLimits::default()
    };
    let store = Arc::new(config.open(Arc::new(MonotonicClock::default())).expect("store"));
    let tenants = vec![
        Caller::new(tenant(0), Rights::READ_WRITE),
        Caller::new(tenant(1), Rights::READ_WRITE),
    ];
    let server = Server::start(
        ServerConfig::new("127.0.0.1:0".parse().expect("addr"), tenants),
        store.clone(),
    )
    .expect("server");
    let addr = server.local_addr();
    let counts = Arc::new(Counts::default());
    let until = Instant::now() + Duration::from_secs(soak_seconds());
    let workers: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let counts = Arc::clone(&counts);
            std::thread::spawn(move || {
                let me = c % 2;
                let caller = Caller::new(tenant(me), Rights::READ_WRITE);
                let client = TcpStore::new(ClientConfig::new(addr, caller.clone()));
                let mut rng = SplitMix64::new(c as u64 + 1);
                let mut buf = vec![0u8; 192 << 10];
                while Instant::now() < until {
                    let x = rng.next_u64();
                    let k = u8::try_from(x % u64::from(KEYS_PER_TENANT)).unwrap_or(0);
                    // One operation in sixteen deliberately names the other tenant's key.
                    let owner = if (x >> 20).is_multiple_of(16) { 1 - me } else { me };
                    let pk = key(owner, &[k], KvDtype::F16, 16);
                    let result: Result<(), StoreError> = match (x >> 8) % 8 {
                        0..=2 => client.put(&caller, &pk, &value(owner, k), None).map(|p| {
                            if let Put::Refused(_) = p {
                                counts.refusals.fetch_add(1, Ordering::Relaxed);
                            }
                        }),
                        3..=5 => client.get_into(&caller, &pk, &mut buf).map(|g| {
                            if let Get::Hit { len, .. } = g {
                                let want = value(owner, k);
                                assert_eq!(owner, me, "tenant {me} read tenant {owner}'s block");
                                assert_eq!(usize::try_from(len).unwrap_or(0), want.len());
                                assert!(
                                    buf[..want.len()] == want[..],
                                    "a hit returned bytes no PUT wrote"
                                );
                                counts.hits.fetch_add(1, Ordering::Relaxed);
                            }
                        }),
                        6 => client.lookup(&caller, &pk).map(|l| {
                            if let Lookup::Hit { len } = l {
                                assert_eq!(usize::try_from(len).unwrap_or(0), len_of(owner, k));
                            }
                        }),
                        _ => client.invalidate(&caller, &pk).map(|_| ()),
                    };
                    match result {
                        Ok(()) => {}
                        Err(StoreError::WrongTenant { .. }) if owner != me => {
                            counts.cross_refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("client {c}: unexpected error {e}"),
                    }
                    counts.ops.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a client failed");
    }
    let ops = counts.ops.load(Ordering::Relaxed);
    let hits = counts.hits.load(Ordering::Relaxed);
    let cross = counts.cross_refused.load(Ordering::Relaxed);
    eprintln!(
        "soak: {ops} operations, {hits} verified hits, {} refusals, {cross} cross-tenant refusals, {} evictions",
        counts.refusals.load(Ordering::Relaxed),
        store.stats().evictions
    );
    assert!(hits > 0 && cross > 0, "the workload did not exercise hits and cross-tenant attempts");
    assert_eq!(store.stats().usage.inflight_requests, 0, "requests still in flight after the run");
    assert_eq!(server.shutdown(), 0);
}
