//! The block files a FileStore keeps open for reads: never more than its limit (counted in the
//! store's stats and in the process's own descriptor table), never a descriptor of another
//! block (a key re-put after an invalidation, an eviction or a corrupt drop reads its new
//! bytes), and never an unlinked file held open once its block is gone. Each test runs on
//! psync, io_uring and io_uring with O_DIRECT.
//!
//! `GPUCACHE_OPEN_FILES_SEED` replays a run.

mod common;

use std::path::{Path, PathBuf};

use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::store::{CorruptPhase, CorruptReason, Get, Invalidate, MissReason, Put};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig};

use common::assert_exact;
use gpucache_dataplane::rng::SplitMix64 as Rng;

const SEED_VAR: &str = "GPUCACHE_OPEN_FILES_SEED";

const VARIANTS: [(EngineChoice, bool); 3] =
    [(EngineChoice::Psync, false), (EngineChoice::Uring, false), (EngineChoice::Uring, true)];

fn config(
    root: &Path,
    engine: EngineChoice,
    direct: bool,
    open_files_max: usize,
) -> FileStoreConfig {
    let mut c = common::config(root, engine, Durability::None);
    c.direct_io = direct;
    c.open_files_max = open_files_max;
    c
}

fn put_ok(store: &FileStore, key: &PhysicalKey, data: &[u8]) {
    match store.put(&caller(0), key, data, None) {
        Ok(Put::Committed(_)) => {}
        other => panic!("put: {other:?}"),
    }
}

/// The block files under `root` this process has open right now (from its descriptor table),
/// with the kernel's " (deleted)" suffix for unlinked ones.
fn open_under(root: &Path) -> Vec<PathBuf> {
    let root = std::fs::canonicalize(root).expect("canonical root").join("blocks");
    let mut out: Vec<PathBuf> = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.starts_with(&root))
        .collect();
    out.sort();
    out
}

fn deleted(paths: &[PathBuf]) -> usize {
    paths.iter().filter(|p| p.to_string_lossy().ends_with(" (deleted)")).count()
}

#[test]
fn never_more_than_the_limit_open() {
    let seed = common::seed(SEED_VAR);
    for (v, &(engine, direct)) in VARIANTS.iter().enumerate() {
        let what = format!("seed {seed}, {engine:?} direct={direct}");
        let mut rng = Rng::new(Rng::mix(&[seed, 1, v as u64]));
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        const LIMIT: usize = 3;
        let store = common::open(config(root, engine, direct, LIMIT));
        let blocks: Vec<(PhysicalKey, Vec<u8>)> = (0..10u16)
            .map(|i| {
                let k = common::block_key(0x10, 0, i);
                let d = common::payload(rng.next_u64(), 1 + rng.index(20_000));
                put_ok(&store, &k, &d);
                (k, d)
            })
            .collect();
        assert_eq!(store.open_files().kept, 0, "{what}: a PUT kept a read descriptor");
        for n in 0..60 {
            let (k, d) = &blocks[rng.index(blocks.len())];
            assert_exact(&store, k, d, &format!("{what}: read {n}"));
            let stats = store.open_files();
            assert!(stats.kept <= LIMIT, "{what}: {stats:?}");
            assert_eq!(stats.limit, LIMIT, "{what}");
            let open = open_under(root);
            assert!(open.len() <= LIMIT, "{what}: {} open: {open:?}", open.len());
            assert_eq!(deleted(&open), 0, "{what}: {open:?}");
        }
        let stats = store.open_files();
        assert!(stats.evicted > 0 && stats.reused > 0, "{what}: {stats:?}");
        assert_eq!(stats.opened, stats.evicted + stats.kept as u64, "{what}: {stats:?}");
        // Reading one block again and again opens it once.
        let before = store.open_files().opened;
        for _ in 0..5 {
            assert_exact(&store, &blocks[0].0, &blocks[0].1, &what);
        }
        assert!(store.open_files().opened <= before + 1, "{what}: reopened a kept file");
    }
}

/// Limits that retain two blocks of `len` bytes and no more.
fn room_for_two(len: usize) -> ResourceLimits {
    let len = len as u64;
    ResourceLimits {
        object_bytes_max: len,
        retained_bytes_max: 2 * len,
        tenant_retained_bytes_max: 2 * len,
        tenant_inflight_bytes_max: len,
        ..ResourceLimits::default()
    }
}

#[test]
fn a_key_put_again_reads_its_new_bytes() {
    let seed = common::seed(SEED_VAR);
    for (v, &(engine, direct)) in VARIANTS.iter().enumerate() {
        let what = format!("seed {seed}, {engine:?} direct={direct}");
        let mut rng = Rng::new(Rng::mix(&[seed, 2, v as u64]));
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let len = 1 + rng.index(50_000);
        // Room for exactly two blocks, so that a third PUT evicts the oldest.
        let mut c = config(root, engine, direct, 8);
        c.limits = room_for_two(len);
        let store = common::open(c);
        let (a, b, x) = (
            common::block_key(0x20, 0, 0),
            common::block_key(0x20, 0, 1),
            common::block_key(0x20, 0, 2),
        );

        // Invalidate, then the same key with other bytes of the same length.
        let old = common::payload(rng.next_u64(), len);
        put_ok(&store, &a, &old);
        assert_exact(&store, &a, &old, &format!("{what}: first"));
        assert_eq!(store.open_files().kept, 1, "{what}");
        assert_eq!(store.invalidate(&caller(0), &a).expect("invalidate"), Invalidate::Removed);
        assert_eq!(store.open_files().kept, 0, "{what}: an invalidated block's file kept open");
        assert_eq!(deleted(&open_under(root)), 0, "{what}: an unlinked file held open");
        let new = common::payload(rng.next_u64(), len);
        put_ok(&store, &a, &new);
        assert_exact(&store, &a, &new, &format!("{what}: re-put after invalidate"));

        // Eviction: a and b fill the store, x evicts a (the oldest), a comes back evicting b.
        put_ok(&store, &b, &old);
        assert_exact(&store, &b, &old, &format!("{what}: b"));
        put_ok(&store, &x, &old);
        assert_eq!(store.stats().evictions, 1, "{what}");
        let (got, _) = common::get(&store, &a, len, 0);
        assert_eq!(got, Get::Miss(MissReason::Absent), "{what}: evicted");
        assert_eq!(deleted(&open_under(root)), 0, "{what}: an evicted file held open");
        let newer = common::payload(rng.next_u64(), len);
        put_ok(&store, &a, &newer);
        assert_exact(&store, &a, &newer, &format!("{what}: re-put after eviction"));
        assert_exact(&store, &x, &old, &format!("{what}: x"));
        assert!(store.open_files().kept <= 2, "{what}: {:?}", store.open_files());

        // Reopen: the descriptors go with the store, the bytes stay.
        drop(store);
        let mut c = config(root, engine, direct, 8);
        c.limits = room_for_two(len);
        let store = common::open(c);
        assert_eq!(store.open_files().kept, 0, "{what}");
        assert_exact(&store, &a, &newer, &format!("{what}: after reopen"));
        assert_eq!(store.invalidate(&caller(0), &a).expect("invalidate"), Invalidate::Removed);
        let last = common::payload(rng.next_u64(), len);
        put_ok(&store, &a, &last);
        assert_exact(&store, &a, &last, &format!("{what}: re-put after reopen"));
    }
}

#[test]
fn a_damaged_block_read_through_a_kept_file_is_still_dropped() {
    let seed = common::seed(SEED_VAR);
    for (v, &(engine, direct)) in VARIANTS.iter().enumerate() {
        let what = format!("seed {seed}, {engine:?} direct={direct}");
        let mut rng = Rng::new(Rng::mix(&[seed, 3, v as u64]));
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let store = common::open(config(root, engine, direct, 8));
        let k = common::block_key(0x30, 0, 0);
        let data = common::payload(rng.next_u64(), 1 + rng.index(30_000));
        put_ok(&store, &k, &data);
        // The first read keeps the descriptor; the damage is then read through it.
        assert_exact(&store, &k, &data, &what);
        assert_eq!(store.open_files().kept, 1, "{what}");
        assert!(store.corrupt_for_test(&k, rng.next_u64()));
        let (got, buf) = common::get(&store, &k, data.len(), 0xEE);
        assert_eq!(got, Get::Miss(MissReason::Corrupt), "{what}");
        assert!(buf.iter().all(|b| *b == 0), "{what}: destination not zeroed");
        let drops = store.stats().corrupt_dropped;
        assert_eq!(drops.get(CorruptPhase::Get, CorruptReason::Checksum), 1, "{what}: {drops:?}");
        assert_eq!(store.stats().committed_blocks, 0, "{what}");
        assert_eq!(store.open_files().kept, 0, "{what}: a dropped block's file kept open");
        assert!(common::block_files(root, &k).is_empty(), "{what}: damaged file left");
        assert_eq!(deleted(&open_under(root)), 0, "{what}: an unlinked file held open");
        let fresh = common::payload(rng.next_u64(), data.len());
        put_ok(&store, &k, &fresh);
        assert_exact(&store, &k, &fresh, &format!("{what}: re-put after the drop"));
    }
}

#[test]
fn a_limit_of_zero_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let c = config(dir.path(), EngineChoice::Psync, false, 0);
    let err = c
        .open(std::sync::Arc::new(gpucache_dataplane::clock::ManualClock::default()))
        .expect_err("open_files_max = 0");
    assert!(err.to_string().contains("open_files_max"), "{err}");
}
