//! FileStore over the seeded faulty-disk layer (`FaultyEngine`): failed, short and torn writes,
//! read errors and bit flips, dropped syncs followed by a simulated crash, and a mixed-fault
//! model run. A failed PUT is retired, charges nothing and leaves nothing behind; a silent fault
//! is caught by the checksum; no read ever returns bytes other than the committed payload.
//!
//! `GPUCACHE_FAULTS_SEED` replays a run.

mod common;

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{
    Get, Invalidate, Lookup, MissReason, Put, Retirement, StorageEffect, Store, StoreError,
};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::faulty::{FaultConfig, FaultyEngine};
use gpucache_storage::file::engine::psync::PsyncEngine;
use gpucache_storage::file::engine::uring::UringEngine;
use gpucache_storage::file::engine::{EngineConfig, IoEngine};
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig, READ_HASH_PIECE_BYTES};

use common::assert_exact;

const SEED_VAR: &str = "GPUCACHE_FAULTS_SEED";

/// The inner engine of a faulty layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inner {
    Psync,
    Uring,
}

type Faulty = FaultyEngine<Arc<dyn IoEngine>>;

fn faulty(inner: Inner, config: FaultConfig) -> Arc<Faulty> {
    let engine: Arc<dyn IoEngine> = match inner {
        Inner::Psync => Arc::new(PsyncEngine),
        Inner::Uring => Arc::new(
            UringEngine::new(EngineConfig { staging_bytes: 16 << 20, ..EngineConfig::default() })
                .expect("io_uring engine"),
        ),
    };
    Arc::new(FaultyEngine::new(engine, config))
}

fn open_faulty(root: &Path, engine: &Arc<Faulty>, direct: bool) -> FileStore {
    let mut c = FileStoreConfig::new(root);
    c.durability = Durability::PerBlock;
    c.direct_io = direct;
    FileStore::open_with_engine(
        c,
        Arc::clone(engine) as Arc<dyn IoEngine>,
        Arc::new(ManualClock::default()),
    )
    .expect("open over the faulty engine")
}

/// The variants every targeted test runs: (inner engine, O_DIRECT).
const VARIANTS: [(Inner, bool); 3] =
    [(Inner::Psync, false), (Inner::Uring, false), (Inner::Uring, true)];

fn key(space: u8, i: u16) -> PhysicalKey {
    common::block_key(space, 0, i)
}

fn put_ok(store: &FileStore, key: &PhysicalKey, data: &[u8]) {
    match store.put(&caller(0), key, data, None) {
        Ok(Put::Committed(_)) => {}
        other => panic!("put: {other:?}"),
    }
}

/// Commits a few blocks with injection paused; returns them.
fn baseline(
    store: &FileStore,
    engine: &Faulty,
    rng: &mut SplitMix64,
    space: u8,
) -> Vec<(PhysicalKey, Vec<u8>)> {
    engine.set_enabled(false);
    let blocks: Vec<_> = (0..4)
        .map(|i| {
            let k = key(space, i);
            let d = common::payload(
                rng.next_u64(),
                usize::try_from(rng.range(1, 200_000)).expect("fits"),
            );
            put_ok(store, &k, &d);
            (k, d)
        })
        .collect();
    engine.set_enabled(true);
    blocks
}

/// A retired storage error of `operation`: a block file that could not be read (a GET) or
/// written (a commit), which changed nothing, with the system's error kind when `kind` is given.
fn assert_storage_retired(
    e: &StoreError,
    operation: &str,
    kind: Option<io::ErrorKind>,
    what: &str,
) {
    assert_eq!(e.retirement(), Retirement::Retired, "{what}: {e}");
    let step = if operation == "get" { "block read" } else { "block write" };
    assert!(
        matches!(
            e,
            StoreError::Storage { operation: op, step: s, effect: StorageEffect::Unchanged, .. }
                if *op == operation && *s == step
        ),
        "{what}: expected a {operation} storage error at {step}, got {e:?}"
    );
    if let Some(kind) = kind {
        assert_eq!(e.io_kind(), Some(kind), "{what}: {e}");
    }
}

/// The kind the system gives an errno.
fn kind_of(errno: i32) -> io::ErrorKind {
    io::Error::from_raw_os_error(errno).kind()
}

/// EIO on Linux.
const EIO: i32 = 5;

// ---------------------------------------------------------------------------------------------
// Failed writes

#[test]
fn failed_writes_retire_charge_nothing_and_forget_the_request() {
    let seed = common::seed(SEED_VAR);
    type Set = fn(&mut FaultConfig);
    let kinds: [(&str, Set, io::ErrorKind); 3] = [
        ("EIO", |c| c.write_eio = 1.0, kind_of(EIO)),
        ("ENOSPC", |c| c.write_enospc = 1.0, io::ErrorKind::StorageFull),
        ("short write", |c| c.short_write = 1.0, io::ErrorKind::WriteZero),
    ];
    for (k, (name, set, io_kind)) in kinds.iter().enumerate() {
        for (v, &(inner, direct)) in VARIANTS.iter().enumerate() {
            let case = SplitMix64::mix(&[seed, k as u64, v as u64]);
            let what = format!("seed {seed}: {name} on {inner:?} direct={direct}");
            let mut rng = SplitMix64::new(case);
            let mut config = FaultConfig::none(case);
            set(&mut config);
            let engine = faulty(inner, config);
            let dir = tempfile::tempdir().expect("temp dir");
            let root = dir.path();
            let store = open_faulty(root, &engine, direct);
            let before_blocks = baseline(&store, &engine, &mut rng, 0x10);
            let files_before = common::all_block_files(root);
            let before = store.stats();

            for attempt in 0..8u16 {
                let k = key(0x11, attempt);
                let data = common::payload(
                    rng.next_u64(),
                    usize::try_from(rng.range(1, 300_000)).expect("fits"),
                );
                let request = (attempt % 2 == 0).then_some(RequestId(1000 + u64::from(attempt)));
                let err =
                    store.put(&caller(0), &k, &data, request).expect_err("put over a failing disk");
                assert_storage_retired(&err, "commit", Some(*io_kind), &what);
                assert_eq!(store.stats(), before, "{what}: a failed put left charges");
                assert_eq!(
                    store.lookup(&caller(0), &k).expect("lookup"),
                    Lookup::Miss(MissReason::Absent),
                    "{what}"
                );
                assert!(common::tmp_files(root).is_empty(), "{what}: tmp file left");
                assert_eq!(
                    common::all_block_files(root),
                    files_before,
                    "{what}: block files changed"
                );
                if let Some(r) = request {
                    // Still failing: the replay fails again, it is not reported as committed.
                    let again = store
                        .put(&caller(0), &k, &data, Some(r))
                        .expect_err("replay, still failing");
                    assert_storage_retired(&again, "commit", Some(*io_kind), &what);
                    // With the disk healthy, the replay really writes the block.
                    engine.set_enabled(false);
                    assert_eq!(
                        store.put(&caller(0), &k, &data, Some(r)).expect("replay"),
                        Put::Committed(gpucache_dataplane::Checksum::of(&data)),
                        "{what}: the failed request id was remembered"
                    );
                    assert_eq!(
                        store.put(&caller(0), &k, &data, Some(r)).expect("replay"),
                        Put::AlreadyCommitted
                    );
                    assert_exact(&store, &k, &data, &what);
                    assert_eq!(
                        store.invalidate(&caller(0), &k).expect("invalidate"),
                        Invalidate::Removed
                    );
                    engine.set_enabled(true);
                    assert_eq!(store.stats().usage, before.usage, "{what}: usage after cleanup");
                }
            }
            let counts = engine.counts();
            assert!(counts.total() >= 8, "{what}: faults injected: {counts:?}");
            for (k, d) in &before_blocks {
                assert_exact(&store, k, d, &format!("{what}: block committed before the faults"));
            }
            drop(store);
            // Nothing of the failed puts is found at the next open either.
            let store = open_faulty(root, &faulty(Inner::Psync, FaultConfig::none(0)), false);
            let report = store.open_report();
            assert_eq!(report.loaded, before_blocks.len() as u64, "{what}: {report:?}");
            assert!(report.skipped.is_empty() && report.tmp_removed == 0, "{what}: {report:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Silent faults

#[test]
fn torn_writes_are_caught_by_the_checksum() {
    let seed = common::seed(SEED_VAR);
    for (v, &(inner, direct)) in VARIANTS.iter().enumerate() {
        let case = SplitMix64::mix(&[seed, 0x70, v as u64]);
        let what = format!("seed {seed}: torn writes on {inner:?} direct={direct}");
        let mut rng = SplitMix64::new(case);
        let engine = faulty(inner, FaultConfig { torn_write: 1.0, ..FaultConfig::none(case) });
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let store = open_faulty(root, &engine, direct);
        let good = baseline(&store, &engine, &mut rng, 0x20);
        let torn: Vec<(PhysicalKey, Vec<u8>)> = (0..10)
            .map(|i| {
                let k = key(0x21, i);
                // No zero byte: whatever suffix the tear loses, the content changes.
                let d = common::nonzero_payload(
                    rng.next_u64(),
                    usize::try_from(rng.range(1, 300_000)).expect("fits"),
                );
                put_ok(&store, &k, &d);
                (k, d)
            })
            .collect();
        assert!(engine.counts().torn_writes >= 10, "{what}: {:?}", engine.counts());
        // Half are read while the store is open: corrupt, zeroed, dropped.
        for (k, d) in &torn[..5] {
            let (got, buf) = common::get(&store, k, d.len(), 0xEE);
            assert_eq!(got, Get::Miss(MissReason::Corrupt), "{what}: torn block served");
            assert!(buf.iter().all(|b| *b == 0), "{what}: buffer not zeroed");
            assert_eq!(
                store.lookup(&caller(0), k).expect("lookup"),
                Lookup::Miss(MissReason::Absent)
            );
        }
        for (k, d) in &good {
            assert_exact(&store, k, d, &what);
        }
        drop(store);
        // The other half after a restart: skipped (torn header) or loaded and then corrupt.
        let store = open_faulty(root, &faulty(Inner::Psync, FaultConfig::none(0)), false);
        let report = store.open_report().clone();
        assert!(report.loaded >= good.len() as u64, "{what}: {report:?}");
        for (k, d) in &torn[5..] {
            match common::get(&store, k, d.len(), 0xEE) {
                (Get::Miss(MissReason::Absent | MissReason::Corrupt), buf) => {
                    assert!(buf.iter().all(|b| *b == 0 || *b == 0xEE), "{what}: payload leaked");
                }
                (other, _) => panic!("{what}: torn block after restart: {other:?}"),
            }
        }
        for (k, d) in &good {
            assert_exact(&store, k, d, &what);
        }
    }
}

#[test]
fn read_faults_never_serve_wrong_bytes() {
    let seed = common::seed(SEED_VAR);
    for (v, &(inner, direct)) in VARIANTS.iter().enumerate() {
        let case = SplitMix64::mix(&[seed, 0x80, v as u64]);
        let what = format!("seed {seed}: read faults on {inner:?} direct={direct}");
        let mut rng = SplitMix64::new(case);
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();

        // Bit flips: corrupt (or, under O_DIRECT, a flip in the page padding that the caller
        // never sees: the exact bytes).
        let engine = faulty(inner, FaultConfig { read_bit_flip: 1.0, ..FaultConfig::none(case) });
        let store = open_faulty(root, &engine, direct);
        let blocks = baseline(&store, &engine, &mut rng, 0x30);
        let mut corrupt = 0;
        for (k, d) in &blocks {
            let before = store.stats();
            match common::get(&store, k, d.len(), 0xEE) {
                (Get::Miss(MissReason::Corrupt), buf) => {
                    assert!(buf.iter().all(|b| *b == 0), "{what}: buffer not zeroed");
                    // Every read flips, so the private re-read that confirms damage flips too
                    // and the block goes; with O_DIRECT that flip may land in the alignment
                    // padding, and then the re-read proves the block intact and it stays.
                    let dropped =
                        store.stats().corrupt_dropped.total() - before.corrupt_dropped.total();
                    if direct {
                        assert!(dropped <= 1, "{what}: {dropped} blocks dropped by one read");
                    } else {
                        assert_eq!(dropped, 1, "{what}: a damaged block stayed");
                    }
                    corrupt += 1;
                }
                (Get::Hit { .. }, buf) if direct => assert!(buf == *d, "{what}: wrong bytes"),
                (other, _) => panic!("{what}: flipped read answered {other:?}"),
            }
        }
        // One read per GET (a buffered one reads its payload in pieces of
        // READ_HASH_PIECE_BYTES), and one more to confirm each corrupt one.
        let reads: usize = blocks
            .iter()
            .map(|(_, d)| if direct { 1 } else { d.len().div_ceil(READ_HASH_PIECE_BYTES).max(1) })
            .sum();
        assert_eq!(engine.counts().read_bit_flips, (reads + corrupt) as u64, "{what}");
        if !direct {
            assert_eq!(corrupt, blocks.len(), "{what}: every flip is caught");
        }
        drop(store);

        // Read EIO: a retired error, a zeroed buffer, and the block stays.
        let engine = faulty(inner, FaultConfig { read_eio: 1.0, ..FaultConfig::none(case) });
        let store = open_faulty(root, &engine, direct);
        let blocks = baseline(&store, &engine, &mut rng, 0x31);
        for (k, d) in &blocks {
            let mut buf = vec![0xEE; d.len()];
            let err = store.get_into(&caller(0), k, &mut buf).expect_err("read EIO");
            assert_storage_retired(&err, "get", Some(kind_of(EIO)), &what);
            assert!(buf.iter().all(|b| *b == 0), "{what}: buffer not zeroed after EIO");
            assert_eq!(
                store.lookup(&caller(0), k).expect("lookup"),
                Lookup::Hit { len: d.len() as u64 }
            );
        }
        assert_eq!(store.stats().usage.inflight_requests, 0, "{what}: reads left pinned");
        engine.set_enabled(false);
        for (k, d) in &blocks {
            assert_exact(&store, k, d, &format!("{what}: after EIO"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dropped syncs and a crash

#[test]
fn dropped_syncs_lose_blocks_cleanly_in_a_crash() {
    let seed = common::seed(SEED_VAR);
    for (v, &(inner, direct)) in VARIANTS.iter().enumerate() {
        for round in 0..3u64 {
            let case = SplitMix64::mix(&[seed, 0x90, v as u64, round]);
            let what =
                format!("seed {seed}: dropped syncs on {inner:?} direct={direct} round {round}");
            let mut rng = SplitMix64::new(case);
            let engine =
                faulty(inner, FaultConfig { dropped_sync: 0.5, ..FaultConfig::none(case) });
            let dir = tempfile::tempdir().expect("temp dir");
            let root = dir.path();
            let store = open_faulty(root, &engine, direct);
            let blocks: Vec<(PhysicalKey, Vec<u8>)> = (0..16)
                .map(|i| {
                    let k = key(0x40, i);
                    let d = common::payload(
                        rng.next_u64(),
                        usize::try_from(rng.range(1, 200_000)).expect("fits"),
                    );
                    put_ok(&store, &k, &d);
                    (k, d)
                })
                .collect();
            let counts = engine.counts();
            assert_eq!(counts.writebacks, 0, "{what}: {counts:?}");
            drop(store);
            let crash = engine.crash().expect("simulated crash");
            assert_eq!(
                crash.files as u64, counts.dropped_syncs,
                "{what}: unsynced files: {crash:?}"
            );

            let store = open_faulty(root, &faulty(Inner::Psync, FaultConfig::none(0)), false);
            let report = store.open_report().clone();
            let mut hits = 0u64;
            for (k, d) in &blocks {
                match common::get(&store, k, d.len(), 0xEE) {
                    (Get::Hit { .. }, buf) => {
                        assert!(buf == *d, "{what}: other bytes after the crash");
                        hits += 1;
                    }
                    (Get::Miss(MissReason::Absent | MissReason::Corrupt), buf) => {
                        assert!(
                            buf.iter().all(|b| *b == 0 || *b == 0xEE),
                            "{what}: garbage leaked"
                        );
                    }
                    (other, _) => panic!("{what}: {other:?}"),
                }
            }
            // Exactly the blocks whose sync really happened survive; the others' headers are
            // garbage and skipped at open.
            assert_eq!(
                hits,
                blocks.len() as u64 - counts.dropped_syncs,
                "{what}: {report:?} {counts:?}"
            );
            assert_eq!(common::skipped_total(&report), counts.dropped_syncs, "{what}: {report:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mixed faults against a model

/// What the store's catalog holds, per key index.
type Model = HashMap<u16, Vec<u8>>;

fn check_usage(store: &FileStore, model: &Model, what: &str) {
    let stats = store.stats();
    let bytes: u64 = model.values().map(|d| d.len() as u64).sum();
    assert_eq!(stats.usage.retained_bytes, bytes, "{what}: retained bytes");
    assert_eq!(stats.committed_blocks, model.len() as u64, "{what}: committed blocks");
    assert_eq!(u64::from(stats.usage.registrations), model.len() as u64, "{what}: registrations");
    assert_eq!(stats.usage.inflight_requests, 0, "{what}: in-flight requests");
    assert_eq!(stats.regions.quarantined, 0, "{what}: quarantined regions");
}

#[test]
fn mixed_faults_never_serve_other_bytes() {
    const CASES: u64 = 20;
    const OPS: u64 = 50;
    const KEYS: u16 = 12;
    let seed = common::seed(SEED_VAR);
    let mut totals = gpucache_storage::file::engine::faulty::FaultCounts::default();
    for case in 0..CASES {
        let case_seed = SplitMix64::mix(&[seed, 0xA0, case]);
        let mut rng = SplitMix64::new(case_seed);
        let (inner, direct) = VARIANTS[usize::try_from(case % 3).expect("small")];
        let p = 0.05;
        let config = FaultConfig {
            seed: case_seed,
            short_write: p,
            write_eio: p,
            write_enospc: p,
            torn_write: p,
            read_eio: p,
            read_bit_flip: p,
            dropped_sync: p,
        };
        let engine = faulty(inner, config);
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let mut store = open_faulty(root, &engine, direct);
        let mut model = Model::new();
        let mut next_request = 1u64;
        for op in 0..OPS {
            let what = format!("seed {seed}, case {case} ({inner:?} direct={direct}), op {op}");
            let i = u16::try_from(rng.below(u64::from(KEYS))).expect("small");
            let k = key(0x50, i);
            match rng.below(100) {
                0..=39 => {
                    let data = common::payload(
                        rng.next_u64(),
                        usize::try_from(rng.range(1, 100_000)).expect("fits"),
                    );
                    let request = rng.chance(0.5).then(|| {
                        next_request += 1;
                        RequestId(next_request)
                    });
                    match store.put(&caller(0), &k, &data, request) {
                        Ok(Put::Committed(_)) => {
                            assert!(!model.contains_key(&i), "{what}: create-only put overwrote");
                            model.insert(i, data);
                        }
                        Ok(Put::AlreadyCommitted) => {
                            assert!(
                                model.contains_key(&i),
                                "{what}: AlreadyCommitted for an absent key"
                            );
                        }
                        Ok(other) => panic!("{what}: put answered {other:?}"),
                        Err(e) => {
                            assert_storage_retired(&e, "commit", None, &what);
                            assert!(
                                !model.contains_key(&i),
                                "{what}: put of a present key failed: {e}"
                            );
                        }
                    }
                }
                40..=74 => {
                    let cap = model.get(&i).map_or(100_000, Vec::len);
                    let mut buf = vec![0xEE; cap];
                    let dropped_before = store.stats().corrupt_dropped.total();
                    match store.get_into(&caller(0), &k, &mut buf) {
                        Ok(Get::Hit { len, .. }) => {
                            let want = model
                                .get(&i)
                                .unwrap_or_else(|| panic!("{what}: hit on a key never committed"));
                            assert_eq!(len, want.len() as u64, "{what}: hit length");
                            assert!(buf[..want.len()] == want[..], "{what}: hit with other bytes");
                        }
                        Ok(Get::Miss(MissReason::Corrupt)) => {
                            assert!(
                                model.contains_key(&i),
                                "{what}: corrupt miss on an absent key"
                            );
                            assert!(buf.iter().all(|b| *b == 0), "{what}: corrupt read not zeroed");
                            // The block goes only when a private re-read confirms the damage; a
                            // fault in one read alone leaves it (and the next read decides).
                            if store.stats().corrupt_dropped.total() > dropped_before {
                                model.remove(&i);
                            }
                        }
                        Ok(Get::Miss(MissReason::Absent)) => {
                            assert!(!model.contains_key(&i), "{what}: committed block missing");
                            assert!(
                                buf.iter().all(|b| *b == 0xEE),
                                "{what}: a miss wrote the buffer"
                            );
                        }
                        Ok(other) => panic!("{what}: get answered {other:?}"),
                        Err(e) => {
                            assert_storage_retired(&e, "get", None, &what);
                            assert!(model.contains_key(&i), "{what}: read error on an absent key");
                            assert!(buf.iter().all(|b| *b == 0), "{what}: failed read not zeroed");
                        }
                    }
                }
                75..=84 => {
                    let want = model.get(&i).map_or(Lookup::Miss(MissReason::Absent), |d| {
                        Lookup::Hit { len: d.len() as u64 }
                    });
                    assert_eq!(
                        store.lookup(&caller(0), &k).expect("lookup"),
                        want,
                        "{what}: lookup"
                    );
                }
                85..=94 => {
                    let want = if model.remove(&i).is_some() {
                        Invalidate::Removed
                    } else {
                        Invalidate::Absent
                    };
                    assert_eq!(
                        store.invalidate(&caller(0), &k).expect("invalidate"),
                        want,
                        "{what}"
                    );
                }
                _ => {
                    // Restart, half the time through a crash that loses unsynced writes.
                    drop(store);
                    if rng.chance(0.5) {
                        engine.crash().expect("simulated crash");
                    }
                    store = open_faulty(root, &engine, direct);
                    // Blocks may be lost (torn headers, dropped syncs), never gained.
                    for j in 0..KEYS {
                        match store.lookup(&caller(0), &key(0x50, j)).expect("lookup") {
                            Lookup::Hit { len } => {
                                let want = model.get(&j).unwrap_or_else(|| {
                                    panic!("{what}: block {j} appeared at restart")
                                });
                                assert_eq!(len, want.len() as u64, "{what}: block {j} length");
                            }
                            Lookup::Miss(MissReason::Absent) => {
                                model.remove(&j);
                            }
                            other => panic!("{what}: block {j} after restart: {other:?}"),
                        }
                    }
                }
            }
            check_usage(&store, &model, &what);
        }
        let c = engine.counts();
        totals.short_writes += c.short_writes;
        totals.write_eio += c.write_eio;
        totals.write_enospc += c.write_enospc;
        totals.torn_writes += c.torn_writes;
        totals.read_eio += c.read_eio;
        totals.read_bit_flips += c.read_bit_flips;
        totals.dropped_syncs += c.dropped_syncs;
        totals.crashes += c.crashes;
    }
    eprintln!("faults injected over {CASES} cases: {totals:?}");
    assert!(
        totals.total() > 0 && totals.crashes > 0,
        "seed {seed}: no faults injected: {totals:?}"
    );
}
