//! Threads hammer one store with puts, gets, lookups and invalidations, one key at a time and in
//! batches, over a small key space. Every key has one deterministic payload, so any hit must be
//! exactly those bytes; usage must return to zero once everything is invalidated.

use std::sync::Arc;
use std::thread;

use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{BatchGet, BatchPut, Get, Put, Store};
use gpucache_dataplane::testing::fixture::{caller, key, payload};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};

const THREADS: usize = 4;
const OPS_PER_THREAD: u64 = 3000;
const KEYS: u8 = 24;
/// Most keys in one batch call of the workload.
const BATCH_KEYS_MAX: usize = 4;

fn len_of(k: u8) -> usize {
    1 + usize::from(k) * 997
}

fn hammer(store: Arc<dyn Store>) {
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = Arc::clone(&store);
            thread::spawn(move || {
                let mut rng = SplitMix64::new(t as u64 + 1);
                let mut buf = vec![0u8; len_of(KEYS)];
                let mut batch_bufs = vec![vec![0u8; len_of(KEYS)]; BATCH_KEYS_MAX];
                let mut hits = 0u64;
                for _ in 0..OPS_PER_THREAD {
                    let x = rng.next_u64();
                    let k = u8::try_from(x % u64::from(KEYS)).unwrap_or(0);
                    let pk = key(0, &[k], KvDtype::F16, 16);
                    let want = payload(u64::from(k), len_of(k));
                    // A batch's keys: `k` and up to three more, repeats allowed.
                    let n = 1 + (x >> 16) % BATCH_KEYS_MAX as u64;
                    let ks: Vec<u8> = (0..n)
                        .map(|i| u8::try_from((x >> (24 + 5 * i)) % u64::from(KEYS)).unwrap_or(0))
                        .collect();
                    let pks: Vec<_> = ks.iter().map(|k| key(0, &[*k], KvDtype::F16, 16)).collect();
                    let refs: Vec<_> = pks.iter().collect();
                    match (x >> 8) % 8 {
                        0 => match store.put(&caller(0), &pk, &want, None).unwrap() {
                            Put::Committed(_) | Put::AlreadyCommitted | Put::Busy => {}
                            Put::Refused(r) => panic!("unexpected refusal {r}"),
                        },
                        1 => {
                            store.invalidate(&caller(0), &pk).unwrap();
                        }
                        2 => {
                            store.lookup(&caller(0), &pk).unwrap();
                        }
                        4 => {
                            let wants: Vec<_> =
                                ks.iter().map(|k| payload(u64::from(*k), len_of(*k))).collect();
                            let items: Vec<_> = pks
                                .iter()
                                .zip(&wants)
                                .map(|(key, src)| BatchPut { key, src, request: None })
                                .collect();
                            for answer in store.put_batch(&caller(0), &items) {
                                match answer.unwrap() {
                                    Put::Committed(_) | Put::AlreadyCommitted | Put::Busy => {}
                                    Put::Refused(r) => panic!("unexpected refusal {r}"),
                                }
                            }
                        }
                        5 => {
                            let answers = store.invalidate_batch(&caller(0), &refs);
                            assert_eq!(answers.len(), refs.len());
                            for answer in answers {
                                answer.unwrap();
                            }
                        }
                        6 => {
                            let answers = store.lookup_batch(&caller(0), &refs);
                            assert_eq!(answers.len(), refs.len());
                            for answer in answers {
                                answer.unwrap();
                            }
                        }
                        7 => {
                            let mut items: Vec<_> = pks
                                .iter()
                                .zip(batch_bufs.iter_mut())
                                .map(|(key, dst)| {
                                    dst.fill(0xEE);
                                    BatchGet { key, dst }
                                })
                                .collect();
                            let answers = store.get_batch(&caller(0), &mut items);
                            drop(items);
                            assert_eq!(answers.len(), ks.len());
                            for ((k, answer), dst) in ks.iter().zip(answers).zip(&batch_bufs) {
                                if let Get::Hit { len, .. } = answer.unwrap() {
                                    let want = payload(u64::from(*k), len_of(*k));
                                    assert_eq!(len, want.len() as u64);
                                    assert!(
                                        dst[..want.len()] == want[..],
                                        "key {k}: a batch hit returned other bytes"
                                    );
                                    hits += 1;
                                }
                            }
                        }
                        _ => {
                            buf.fill(0xEE);
                            if let Get::Hit { len, .. } =
                                store.get_into(&caller(0), &pk, &mut buf).unwrap()
                            {
                                assert_eq!(len, want.len() as u64);
                                assert!(
                                    buf[..want.len()] == want[..],
                                    "key {k}: a hit returned other bytes"
                                );
                                hits += 1;
                            }
                        }
                    }
                }
                hits
            })
        })
        .collect();
    let hits: u64 = workers.into_iter().map(|w| w.join().expect("worker panicked")).sum();
    assert!(hits > 0, "the workload never read a committed block");
    for k in 0..KEYS {
        store.invalidate(&caller(0), &key(0, &[k], KvDtype::F16, 16)).unwrap();
    }
    let st = store.stats();
    assert_eq!(st.usage.retained_bytes, 0, "bytes still charged after invalidating everything");
    assert_eq!(st.usage.inflight_requests, 0);
    assert_eq!(st.committed_blocks, 0);
}

#[test]
fn memory_store_under_concurrency() {
    let store =
        MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default())).unwrap();
    hammer(Arc::new(store));
}

#[test]
fn file_store_under_concurrency() {
    for engine in [EngineChoice::Psync, EngineChoice::Uring] {
        let dir = tempfile::tempdir().unwrap();
        let mut config = FileStoreConfig::new(dir.path());
        config.engine = engine;
        config.durability = Durability::None;
        config.engine_config.staging_bytes = 0;
        let store = config.open(Arc::new(MonotonicClock::default())).unwrap();
        hammer(Arc::new(store));
    }
}

#[test]
fn file_store_group_commit_under_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = FileStoreConfig::new(dir.path());
    config.engine = EngineChoice::Psync;
    config.durability = Durability::GroupCommit;
    let store = Arc::new(config.open(Arc::new(MonotonicClock::default())).unwrap());
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = Arc::clone(&store);
            thread::spawn(move || {
                for i in 0..40u8 {
                    let pk = key(0, &[u8::try_from(t).unwrap_or(0), i], KvDtype::F16, 16);
                    assert!(matches!(
                        store.put(&caller(0), &pk, &payload(u64::from(i), 4096), None).unwrap(),
                        Put::Committed(_)
                    ));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker panicked");
    }
    assert_eq!(store.stats().committed_blocks, 4 * 40);
}
