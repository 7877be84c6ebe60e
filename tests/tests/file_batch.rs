//! FileStore batches: `get_batch` (and `lookup_batch`, `invalidate_batch`) answer every item exactly as the
//! single-key call would, in order: hits, misses of every reason, a too-small destination, a
//! wrong tenant, a caller without the read right, damaged and truncated blocks (dropped and
//! counted exactly as `get_into` drops and counts them), a key read twice, and batches longer
//! than one window. Two stores are built alike; one answers the batch, the other the same items
//! one by one, and the answers, the destinations and the stats must agree. On io_uring a batch
//! has many reads in flight at once; under the seeded faulty engine the two agree seed for
//! seed. Each test runs on psync, io_uring and io_uring with O_DIRECT.
//!
//! `GPUCACHE_BATCH_SEED` replays a run.

mod common;

use std::path::Path;
use std::sync::Arc;

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{BatchGet, Get, Invalidate, Put, Store, StoreError, StoreStats};
use gpucache_dataplane::testing::fixture::{self, caller};
use gpucache_storage::file::engine::faulty::{FaultConfig, FaultyEngine};
use gpucache_storage::file::engine::psync::PsyncEngine;
use gpucache_storage::file::engine::uring::UringEngine;
use gpucache_storage::file::engine::{DIRECT_ALIGN, EngineChoice, EngineConfig, IoEngine};
use gpucache_storage::file::{BATCH_WINDOW_ITEMS, Durability, FileStore, FileStoreConfig};

use gpucache_dataplane::rng::SplitMix64 as Rng;

const SEED_VAR: &str = "GPUCACHE_BATCH_SEED";

const VARIANTS: [(EngineChoice, bool); 3] =
    [(EngineChoice::Psync, false), (EngineChoice::Uring, false), (EngineChoice::Uring, true)];

/// Block `i` of `space` in physical form `dtype` (two forms of one `(space, i)` are the same
/// logical block).
fn form(space: u8, i: u16, dtype: KvDtype) -> PhysicalKey {
    let [a, b] = i.to_be_bytes();
    fixture::key(0, &[space, a, b], dtype, 16)
}

fn put_ok(store: &FileStore, key: &PhysicalKey, data: &[u8]) {
    match store.put(&caller(0), key, data, None) {
        Ok(Put::Committed(_)) => {}
        other => panic!("put: {other:?}"),
    }
}

/// An answer with what differs between two stores (the paths in error details) left out.
fn norm(answer: &Result<Get, StoreError>) -> String {
    match answer {
        Ok(get) => format!("{get:?}"),
        Err(StoreError::Backend { operation, retirement, .. }) => {
            format!("Backend({operation}, {retirement:?})")
        }
        // The two stores live in different folders: compare all but the path.
        Err(StoreError::Storage { operation, step, kind, effect, retirement, .. }) => {
            format!("Storage({operation}, {step}, {kind:?}, {effect:?}, {retirement:?})")
        }
        Err(e) => format!("{e:?}"),
    }
}

/// The stats two stores built alike must agree on after the same reads.
fn comparable(s: StoreStats) -> (u64, u64, u64, String) {
    (s.committed_blocks, s.usage.retained_bytes, s.evictions, format!("{:?}", s.corrupt_dropped))
}

/// One item of a scenario: who reads which key into how many bytes pre-filled with what, and
/// whether that destination starts on an O_DIRECT boundary (it is placed off one otherwise, so
/// that which reads go straight and which are staged never depends on the allocator).
struct Item {
    caller: Caller,
    key: PhysicalKey,
    cap: usize,
    fill: u8,
    aligned: bool,
}

/// Room for an item's destination wherever it must start.
fn room(item: &Item) -> Vec<u8> {
    vec![item.fill; item.cap + 2 * DIRECT_ALIGN]
}

/// The item's destination within `room`: on an O_DIRECT boundary, or 64 bytes past one.
fn place<'a>(room: &'a mut [u8], item: &Item) -> &'a mut [u8] {
    let start = room.as_ptr().addr().next_multiple_of(DIRECT_ALIGN) - room.as_ptr().addr();
    let start = if item.aligned { start } else { start + 64 };
    &mut room[start..start + item.cap]
}

/// Answers `items` with one `get_batch` on `batch` and one by one with `get_into` on `single`
/// (each item with its own caller), and checks that answers, destinations and stats agree.
/// Returns the answers.
fn compare(batch: &FileStore, single: &FileStore, items: &[Item], what: &str) -> Vec<String> {
    let mut batch_rooms: Vec<Vec<u8>> = items.iter().map(room).collect();
    let mut batch_bufs: Vec<&mut [u8]> =
        batch_rooms.iter_mut().zip(items).map(|(r, i)| place(r, i)).collect();
    let mut batch_answers = Vec::new();
    // A batch has one caller: items of other callers go as batches of their own, in order.
    let mut at = 0;
    while at < items.len() {
        let end = items[at..]
            .iter()
            .position(|i| i.caller != items[at].caller)
            .map_or(items.len(), |n| at + n);
        let mut gets: Vec<BatchGet<'_>> = items[at..end]
            .iter()
            .zip(batch_bufs[at..end].iter_mut())
            .map(|(i, dst)| BatchGet { key: &i.key, dst })
            .collect();
        let answers = batch.get_batch(&items[at].caller, &mut gets);
        assert_eq!(answers.len(), end - at, "{what}: one answer per item");
        batch_answers.extend(answers.iter().map(norm));
        at = end;
    }
    let mut single_answers = Vec::new();
    let mut single_bufs = Vec::new();
    for i in items {
        let mut room = room(i);
        let dst = place(&mut room, i);
        single_answers.push(norm(&single.get_into(&i.caller, &i.key, dst)));
        single_bufs.push(dst.to_vec());
    }
    for (n, (b, s)) in batch_answers.iter().zip(&single_answers).enumerate() {
        assert_eq!(b, s, "{what}: item {n}");
        assert!(*batch_bufs[n] == *single_bufs[n], "{what}: item {n}: destinations differ");
    }
    assert_eq!(comparable(batch.stats()), comparable(single.stats()), "{what}: stats");
    assert_eq!(batch.stats().usage.inflight_requests, 0, "{what}: reads left pinned");
    batch_answers
}

fn config(root: &Path, engine: EngineChoice, direct: bool) -> FileStoreConfig {
    let mut c = common::config(root, engine, Durability::None);
    c.direct_io = direct;
    c
}

/// Puts the scenario's blocks into `store` and damages some of them; returns the items to read.
fn scenario(store: &FileStore, root: &Path, seed: u64) -> Vec<Item> {
    let mut rng = Rng::new(seed);
    let blocks: Vec<(PhysicalKey, usize)> = (0..40u16)
        .map(|i| {
            let len = match i % 4 {
                0 => 4096 * (1 + rng.index(16)),
                _ => 1 + rng.index(70_000),
            };
            let key = form(0x40, i, KvDtype::F16);
            put_ok(store, &key, &common::payload(Rng::mix(&[seed, u64::from(i)]), len));
            (key, len)
        })
        .collect();
    // Damage: two flipped payload bytes and a truncated file.
    for i in [5, 17] {
        assert!(store.corrupt_for_test(&blocks[i].0, Rng::mix(&[seed, 99, i as u64])));
    }
    let path = common::block_file(root, &blocks[9].0);
    let (header_len, len) = common::header_fields(&path);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(header_len + len / 2))
        .expect("truncate");

    let me = caller(0);
    let item = |key: &PhysicalKey, cap: usize| Item {
        caller: me.clone(),
        key: key.clone(),
        cap,
        fill: 0xEE,
        aligned: false,
    };
    let mut items = Vec::new();
    for (i, (key, len)) in blocks.iter().enumerate() {
        let cap = match i {
            3 => len - 1,
            4 => len + 100,
            _ => *len,
        };
        items.push(item(key, cap.max(1)));
        if i == 17 {
            // The other physical form of a block this batch finds damaged: read after the drop
            // it is absent, not incompatible.
            items.push(item(&form(0x40, 17, KvDtype::Bf16), 100));
        }
    }
    items.push(item(&form(0x41, 0, KvDtype::F16), 100));
    items.push(item(&form(0x40, 2, KvDtype::Bf16), 100));
    items.push(item(&fixture::key(1, &[0x40, 0, 1], KvDtype::F16, 16), 100_000));
    // A key twice: an intact one, then a damaged one (read again after its drop).
    items.push(item(&blocks[7].0, blocks[7].1));
    items.push(item(&blocks[7].0, blocks[7].1));
    items.push(item(&blocks[5].0, blocks[5].1));
    // A caller without the read right, for a batch of its own.
    let no_read =
        Caller::new(fixture::tenant(0), Rights { read: false, write: true, admin: false });
    items.push(Item {
        caller: no_read,
        key: blocks[0].0.clone(),
        cap: blocks[0].1,
        fill: 1,
        aligned: false,
    });
    items.push(item(&blocks[0].0, blocks[0].1));
    items
}

#[test]
fn batch_answers_are_the_single_key_answers() {
    let seed = common::seed(SEED_VAR);
    for (v, &(engine, direct)) in VARIANTS.iter().enumerate() {
        let what = format!("seed {seed}, {engine:?} direct={direct}");
        let case = Rng::mix(&[seed, v as u64]);
        let (da, db) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let a = common::open(config(da.path(), engine, direct));
        let b = common::open(config(db.path(), engine, direct));
        let items = scenario(&a, da.path(), case);
        assert_eq!(scenario(&b, db.path(), case).len(), items.len());
        let answers = compare(&a, &b, &items, &what);
        // The scenario covers what it means to.
        for want in [
            "Hit",
            "Miss(Corrupt)",
            "Miss(Absent)",
            "Miss(Incompatible)",
            "BufferTooSmall",
            "WrongTenant",
            "Forbidden",
        ] {
            assert!(answers.iter().any(|a| a.contains(want)), "{what}: no {want}: {answers:?}");
        }
        let drops = a.stats().corrupt_dropped;
        assert_eq!(drops.total(), 3, "{what}: {drops:?}");
        // The damaged blocks are gone from disk too.
        assert!(common::all_block_files(da.path()).len() == 37, "{what}: damaged files left");

        // Lookups, batched and one by one, of every key the scenario names.
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| &i.key).collect();
        let batched: Vec<String> =
            a.lookup_batch(&caller(0), &keys).iter().map(|r| format!("{r:?}")).collect();
        let single: Vec<String> =
            keys.iter().map(|k| format!("{:?}", b.lookup(&caller(0), k))).collect();
        assert_eq!(batched, single, "{what}: lookups");
    }
}

#[test]
fn batches_longer_than_a_window_answer_every_item() {
    let seed = common::seed(SEED_VAR);
    for (v, &(engine, direct)) in VARIANTS.iter().enumerate() {
        let what = format!("seed {seed}, {engine:?} direct={direct}");
        let mut rng = Rng::new(Rng::mix(&[seed, 0x10, v as u64]));
        let (da, db) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let a = common::open(config(da.path(), engine, direct));
        let b = common::open(config(db.path(), engine, direct));
        let n = BATCH_WINDOW_ITEMS + 50;
        let mut items = Vec::new();
        for i in 0..n {
            let key = form(0x50, u16::try_from(i).expect("fits"), KvDtype::F16);
            let data = common::payload(rng.next_u64(), 1 + rng.index(3000));
            // Every seventh key is never written.
            if i % 7 != 3 {
                put_ok(&a, &key, &data);
                put_ok(&b, &key, &data);
            }
            items.push(Item { caller: caller(0), key, cap: 3000, fill: 0, aligned: false });
        }
        // A damaged block in the second window.
        let damaged = &items[BATCH_WINDOW_ITEMS + 10].key;
        assert!(a.corrupt_for_test(damaged, 5) && b.corrupt_for_test(damaged, 5));
        let answers = compare(&a, &b, &items, &what);
        assert_eq!(answers.iter().filter(|a| a.starts_with("Hit")).count(), n - n.div_ceil(7) - 1);
        assert_eq!(answers[BATCH_WINDOW_ITEMS + 10], "Miss(Corrupt)", "{what}");
    }
}

#[test]
fn uring_batch_has_many_reads_in_flight() {
    for direct in [false, true] {
        let what = format!("direct={direct}");
        let config = EngineConfig {
            queue_depth: 32,
            chunk_bytes: 256 << 10,
            staging_bytes: 4 * gpucache_storage::file::engine::uring::SLOT_BYTES,
        };
        let engine = Arc::new(UringEngine::new(config).expect("io_uring works here"));
        let dir = tempfile::tempdir().expect("dir");
        let mut c = FileStoreConfig::new(dir.path());
        c.direct_io = direct;
        c.durability = Durability::None;
        let store = FileStore::open_with_engine(
            c,
            Arc::clone(&engine) as Arc<dyn IoEngine>,
            Arc::new(ManualClock::default()),
        )
        .expect("open");
        // Blocks of one chunk each: a single read has one request in flight.
        let blocks: Vec<(PhysicalKey, Vec<u8>)> = (0..64u16)
            .map(|i| {
                let key = form(0x60, i, KvDtype::F16);
                let data = common::payload(u64::from(i), 16 << 10);
                put_ok(&store, &key, &data);
                (key, data)
            })
            .collect();
        engine.reset_max_in_flight();
        for (k, d) in &blocks {
            common::assert_exact(&store, k, d, &what);
        }
        assert_eq!(engine.max_in_flight(), 1, "{what}: reads one by one");
        engine.reset_max_in_flight();
        let mut bufs: Vec<Vec<u8>> = blocks.iter().map(|_| vec![0u8; 16 << 10]).collect();
        let mut gets: Vec<BatchGet<'_>> = blocks
            .iter()
            .zip(bufs.iter_mut())
            .map(|((key, _), dst)| BatchGet { key, dst })
            .collect();
        let answers = store.get_batch(&caller(0), &mut gets);
        drop(gets);
        assert!(answers.iter().all(|a| matches!(a, Ok(Get::Hit { .. }))), "{what}: {answers:?}");
        for ((_, d), buf) in blocks.iter().zip(&bufs) {
            assert!(buf == d, "{what}: wrong bytes");
        }
        assert_eq!(engine.max_in_flight(), 32, "{what}: a batch of 64 fills the queue of 32");
    }
}

type Faulty = FaultyEngine<Arc<dyn IoEngine>>;

/// A named fault configuration (from a seed), and whether the last block read is damaged.
type FaultCase = (&'static str, fn(u64) -> FaultConfig, bool);

fn faulty_store(
    root: &Path,
    engine: EngineChoice,
    direct: bool,
    config: FaultConfig,
) -> (FileStore, Arc<Faulty>) {
    let inner: Arc<dyn IoEngine> = match engine {
        EngineChoice::Uring => Arc::new(
            UringEngine::new(EngineConfig { staging_bytes: 16 << 20, ..EngineConfig::default() })
                .expect("io_uring"),
        ),
        _ => Arc::new(PsyncEngine),
    };
    let faulty = Arc::new(FaultyEngine::new(inner, config));
    faulty.set_enabled(false);
    let mut c = FileStoreConfig::new(root);
    c.direct_io = direct;
    c.durability = Durability::None;
    let store = FileStore::open_with_engine(
        c,
        Arc::clone(&faulty) as Arc<dyn IoEngine>,
        Arc::new(ManualClock::default()),
    )
    .expect("open over the faulty engine");
    (store, faulty)
}

/// Under the seeded faulty engine the batch and the single reads see the same faults, read for
/// read, wherever no read needs a second one to confirm damage (a confirming read draws too, and
/// a batch makes its confirming reads after all of its first reads): read errors alone; bit
/// flips on every read (every read is then damaged and every confirmation fails alike; sizes are
/// whole sectors so that no flip lands in O_DIRECT padding); and read errors with one damaged
/// block that comes last.
#[test]
fn batch_answers_match_single_answers_under_seeded_faults() {
    let seed = common::seed(SEED_VAR);
    let configs: [FaultCase; 3] = [
        ("read errors", |s| FaultConfig { read_eio: 0.3, ..FaultConfig::none(s) }, false),
        ("bit flips", |s| FaultConfig { read_bit_flip: 1.0, ..FaultConfig::none(s) }, false),
        (
            "read errors, last damaged",
            |s| FaultConfig { read_eio: 0.3, ..FaultConfig::none(s) },
            true,
        ),
    ];
    for (v, &(engine, direct)) in VARIANTS.iter().enumerate() {
        for (c, (name, make, damage_last)) in configs.iter().enumerate() {
            let case = Rng::mix(&[seed, 0x20, v as u64, c as u64]);
            let what = format!("seed {seed}, {name}, {engine:?} direct={direct}");
            let mut rng = Rng::new(case);
            let (da, db) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
            let (a, fa) = faulty_store(da.path(), engine, direct, make(case));
            let (b, fb) = faulty_store(db.path(), engine, direct, make(case));
            let mut items = Vec::new();
            for i in 0..24u16 {
                let key = form(0x70, i, KvDtype::F16);
                let data = common::payload(rng.next_u64(), 4096 * (1 + rng.index(8)));
                put_ok(&a, &key, &data);
                put_ok(&b, &key, &data);
                // Every third destination is aligned: under O_DIRECT those reads go straight,
                // the others through staging, and the batch still asks for them in item order.
                let aligned = i % 3 == 1;
                items.push(Item { caller: caller(0), key, cap: data.len(), fill: 0xEE, aligned });
            }
            if *damage_last {
                let last = &items[items.len() - 1].key;
                assert!(a.corrupt_for_test(last, 11) && b.corrupt_for_test(last, 11));
            }
            fa.set_enabled(true);
            fb.set_enabled(true);
            let answers = compare(&a, &b, &items, &what);
            assert_eq!(fa.counts(), fb.counts(), "{what}: faults injected");
            assert!(fa.counts().total() > 0, "{what}: no fault injected");
            if *damage_last {
                // Damaged, unless its first read failed outright.
                let last = answers.last().map_or("", String::as_str);
                assert!(
                    last == "Miss(Corrupt)" || last.starts_with("Storage(get, block read"),
                    "{what}: {last}"
                );
            }
        }
    }
}

/// An invalidation's answer with what differs between two stores (paths) left out.
fn norm_invalidate(answer: &Result<Invalidate, StoreError>) -> String {
    match answer {
        Ok(a) => format!("{a:?}"),
        Err(StoreError::Storage { operation, step, kind, effect, retirement, .. }) => {
            format!("Storage({operation}, {step}, {kind:?}, {effect:?}, {retirement:?})")
        }
        Err(e) => format!("{e:?}"),
    }
}

/// The same invalidations as one batch on `batch` and one by one on `single`; answers, stats
/// and what stays readable must agree. Returns the answers.
fn compare_invalidations(
    batch: &FileStore,
    single: &FileStore,
    who: &Caller,
    keys: &[PhysicalKey],
    what: &str,
) -> Vec<String> {
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    let batched: Vec<String> =
        batch.invalidate_batch(who, &refs).iter().map(norm_invalidate).collect();
    let one_by_one: Vec<String> =
        keys.iter().map(|k| norm_invalidate(&single.invalidate(who, k))).collect();
    assert_eq!(batched, one_by_one, "{what}");
    assert_eq!(comparable(batch.stats()), comparable(single.stats()), "{what}: stats");
    for k in keys {
        assert_eq!(
            format!("{:?}", batch.lookup(&caller(0), k)),
            format!("{:?}", single.lookup(&caller(0), k)),
            "{what}: lookup after"
        );
    }
    batched
}

#[test]
fn batch_invalidations_are_the_single_key_answers() {
    for (durability, direct) in
        [(Durability::PerBlock, false), (Durability::GroupCommit, true), (Durability::None, false)]
    {
        let what = format!("{durability:?} direct={direct}");
        let engine = if direct { EngineChoice::Uring } else { EngineChoice::Psync };
        let (da, db) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let open = |root: &Path| {
            let mut c = common::config(root, engine, durability);
            c.direct_io = direct;
            common::open(c)
        };
        let (a, b) = (open(da.path()), open(db.path()));
        let keys: Vec<PhysicalKey> = (0..12u16).map(|i| form(0x80, i, KvDtype::F16)).collect();
        for (i, k) in keys.iter().enumerate() {
            let data = common::payload(i as u64, 5000 + i);
            put_ok(&a, k, &data);
            put_ok(&b, k, &data);
        }
        // An open reservation: its key is busy.
        let open_key = form(0x80, 99, KvDtype::F16);
        for s in [&a, &b] {
            let r = s.reserve(&caller(0), &open_key, 10, None).expect("reserve");
            assert!(matches!(r, gpucache_dataplane::store::Reserve::Reserved(_)), "{r:?}");
        }
        let names = vec![
            keys[0].clone(),
            keys[1].clone(),
            form(0x81, 0, KvDtype::F16),
            open_key,
            keys[2].clone(),
            keys[2].clone(),
            fixture::key(1, &[0x80, 0, 3], KvDtype::F16, 16),
            keys[3].clone(),
            keys[0].clone(),
        ];
        let answers = compare_invalidations(&a, &b, &caller(0), &names, &what);
        for want in ["Removed", "Absent", "Busy", "WrongTenant"] {
            assert!(answers.iter().any(|x| x.contains(want)), "{what}: no {want}: {answers:?}");
        }
        let read_only = Caller::new(fixture::tenant(0), Rights::READ_ONLY);
        let answers = compare_invalidations(&a, &b, &read_only, &keys[4..6], &what);
        assert!(answers.iter().all(|x| x.contains("Forbidden")), "{what}: {answers:?}");
        // The removed blocks' files are gone, the others' stay.
        assert_eq!(common::all_block_files(da.path()).len(), 8, "{what}");
        // A batch longer than a window.
        let many: Vec<PhysicalKey> = (0..u16::try_from(BATCH_WINDOW_ITEMS + 20).expect("fits"))
            .map(|i| form(0x82, i, KvDtype::Bf16))
            .collect();
        for (i, k) in many.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
            let data = common::payload(i as u64, 100);
            put_ok(&a, k, &data);
            put_ok(&b, k, &data);
        }
        compare_invalidations(&a, &b, &caller(0), &many, &what);
    }
}

// EROFS and EIO on Linux (the tests crate has no libc).
const EROFS: i32 = 30;
const EIO: i32 = 5;

#[test]
fn batch_invalidations_fail_as_single_ones_do() {
    for (durability, fail) in [
        (Durability::PerBlock, "unlink"),
        (Durability::PerBlock, "dir sync"),
        (Durability::GroupCommit, "unlink"),
    ] {
        let what = format!("{durability:?}, failing {fail}");
        let (da, db) = (tempfile::tempdir().expect("dir"), tempfile::tempdir().expect("dir"));
        let open = |root: &Path| {
            let faulty = Arc::new(FaultyEngine::new(
                Arc::new(PsyncEngine) as Arc<dyn IoEngine>,
                FaultConfig::none(1),
            ));
            let mut c = FileStoreConfig::new(root);
            c.durability = durability;
            let store = FileStore::open_with_engine(
                c,
                Arc::clone(&faulty) as Arc<dyn IoEngine>,
                Arc::new(ManualClock::default()),
            )
            .expect("open");
            (store, faulty)
        };
        let ((a, fa), (b, fb)) = (open(da.path()), open(db.path()));
        let keys: Vec<PhysicalKey> = (0..6u16).map(|i| form(0x90, i, KvDtype::F16)).collect();
        for k in &keys {
            put_ok(&a, k, b"payload");
            put_ok(&b, k, b"payload");
        }
        for f in [&fa, &fb] {
            match fail {
                "unlink" => f.fail_unlinks(Some(EROFS)),
                _ => f.fail_dir_syncs(Some(EIO)),
            }
        }
        let answers = compare_invalidations(&a, &b, &caller(0), &keys, &what);
        let effect = if fail == "unlink" { "Unchanged" } else { "NotDurable" };
        assert!(answers.iter().all(|x| x.contains(effect)), "{what}: {answers:?}");
        // Unchanged: every block stays readable; not durable: every block is gone.
        let left = a.stats().committed_blocks;
        assert_eq!(left, if fail == "unlink" { 6 } else { 0 }, "{what}");
        for f in [&fa, &fb] {
            f.fail_unlinks(None);
            f.fail_dir_syncs(None);
        }
        compare_invalidations(&a, &b, &caller(0), &keys, &format!("{what}, then healthy"));
        assert_eq!(a.stats().committed_blocks, 0, "{what}");
    }
}

#[test]
fn aligned_destinations_are_read_in_place_under_o_direct() {
    use gpucache_storage::file::engine::AlignedBuf;
    let dir = tempfile::tempdir().expect("dir");
    let store = common::open(config(dir.path(), EngineChoice::Uring, true));
    // Whole sectors (read in place) and odd lengths (staged), one damaged of each.
    let lens = [4096, 65536, 1 << 20, 5000, 70_001, 4096 * 3];
    let blocks: Vec<(PhysicalKey, Vec<u8>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let key = form(0xA0, u16::try_from(i).expect("fits"), KvDtype::F16);
            let data = common::payload(i as u64 + 7, len);
            put_ok(&store, &key, &data);
            (key, data)
        })
        .collect();
    for i in [1, 4] {
        assert!(store.corrupt_for_test(&blocks[i].0, 3));
    }
    let mut bufs: Vec<AlignedBuf> = blocks
        .iter()
        .map(|(_, d)| {
            let mut b = AlignedBuf::zeroed(d.len() + 4096).expect("aligned");
            b.fill(0xEE);
            b
        })
        .collect();
    let mut gets: Vec<BatchGet<'_>> = blocks
        .iter()
        .zip(bufs.iter_mut())
        .map(|((key, _), buf)| BatchGet { key, dst: &mut buf[..] })
        .collect();
    let answers = store.get_batch(&caller(0), &mut gets);
    drop(gets);
    for (i, ((_, data), (answer, buf))) in blocks.iter().zip(answers.iter().zip(&bufs)).enumerate()
    {
        let len = data.len();
        if i == 1 || i == 4 {
            assert_eq!(
                answer,
                &Ok(Get::Miss(gpucache_dataplane::store::MissReason::Corrupt)),
                "{i}"
            );
            assert!(buf[..len].iter().all(|b| *b == 0), "{i}: damaged payload left in place");
        } else {
            assert!(matches!(answer, Ok(Get::Hit { .. })), "{i}: {answer:?}");
            assert!(buf[..len] == data[..], "{i}: wrong bytes");
        }
        assert!(buf[len..].iter().all(|b| *b == 0xEE), "{i}: bytes past the payload written");
    }
    // One by one into aligned buffers: the same bytes.
    for (i, (key, data)) in blocks.iter().enumerate().filter(|(i, _)| *i != 1 && *i != 4) {
        let mut buf = AlignedBuf::zeroed(data.len()).expect("aligned");
        let got = store.get_into(&caller(0), key, &mut buf[..]).expect("get_into");
        assert!(matches!(got, Get::Hit { .. }), "{i}: {got:?}");
        assert!(buf[..data.len()] == data[..], "{i}: wrong bytes one by one");
    }
    assert_eq!(store.stats().corrupt_dropped.total(), 2);
}
