//! On-disk damage to committed FileStore blocks: flipped payload and header bytes, truncation,
//! swapped block files, foreign files and a garbage store record. Whatever the damage, a damaged
//! block is never served: reads miss (`Corrupt` while the store is open, skipped at the next
//! open), the destination holds no payload, and `fsck` names every bad file and can remove it.
//!
//! Every test is seeded (`GPUCACHE_CORRUPTION_SEED` replays one) and runs each kind of damage
//! many times, on psync, io_uring and io_uring with O_DIRECT in turn.

mod common;

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{CorruptPhase, CorruptReason, Get, Lookup, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_service::metered::{ExpositionFormat, MeteredStore, Metrics};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, fsck};

use common::{assert_exact, block_file, block_files, header_fields};

const SEED_VAR: &str = "GPUCACHE_CORRUPTION_SEED";
/// Blocks per iteration.
const BLOCKS: u16 = 6;

type Blocks = Vec<(PhysicalKey, Vec<u8>)>;

/// Engine and O_DIRECT for iteration `it`.
fn engine_for(it: u16) -> (EngineChoice, bool) {
    match it % 3 {
        0 => (EngineChoice::Psync, false),
        1 => (EngineChoice::Uring, false),
        _ => (EngineChoice::Uring, true),
    }
}

fn open_store(root: &Path, it: u16) -> FileStore {
    let (engine, direct) = engine_for(it);
    let mut c = common::config(root, engine, Durability::PerBlock);
    c.direct_io = direct;
    common::open(c)
}

/// Log-uniform over 1 B ..= 256 KiB.
fn random_len(rng: &mut SplitMix64) -> usize {
    let bits = rng.range(0, 18);
    usize::try_from(rng.range(1 << bits, (2 << bits) - 1).min(256 << 10)).expect("fits")
}

/// Puts `BLOCKS` blocks of random sizes under `(space, it, 0..)`.
fn put_blocks(store: &FileStore, rng: &mut SplitMix64, space: u8, it: u16) -> Blocks {
    (0..BLOCKS)
        .map(|i| {
            let key = common::block_key(space, it, i);
            let data = common::payload(rng.next_u64(), random_len(rng));
            assert!(
                matches!(store.put(&caller(0), &key, &data, None), Ok(Put::Committed(_))),
                "put {space}/{it}/{i}"
            );
            (key, data)
        })
        .collect()
}

/// XORs the byte at `pos` of `path` with a nonzero value.
fn flip_byte(path: &Path, pos: u64, rng: &mut SplitMix64) {
    let f = OpenOptions::new().read(true).write(true).open(path).expect("open block file");
    let mut b = [0u8];
    f.read_exact_at(&mut b, pos).expect("read byte");
    b[0] ^= u8::try_from(rng.range(1, 255)).expect("byte");
    f.write_all_at(&b, pos).expect("write byte");
}

fn truncate(path: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open block file")
        .set_len(len)
        .expect("truncate");
}

fn assert_absent(store: &FileStore, key: &PhysicalKey, what: &str) {
    assert_eq!(
        store.lookup(&caller(0), key).expect("lookup"),
        Lookup::Miss(MissReason::Absent),
        "{what}: lookup"
    );
    let (got, _) = common::get(store, key, 1 << 20, 0);
    assert_eq!(got, Get::Miss(MissReason::Absent), "{what}: get");
}

/// Reads a damaged block while the store is open: it must be `Miss(Corrupt)` with nothing of the
/// payload in the buffer, the block and its file gone afterwards, and the charges released.
fn assert_corrupt_read(store: &FileStore, root: &Path, key: &PhysicalKey, data: &[u8], what: &str) {
    let before = store.stats();
    let (got, buf) = common::get(store, key, data.len(), 0xEE);
    assert_eq!(got, Get::Miss(MissReason::Corrupt), "{what}: damaged block served");
    assert!(buf.iter().all(|b| *b == 0), "{what}: destination not zeroed after a corrupt read");
    let after = store.stats();
    assert_eq!(
        after.corrupt_dropped.total(),
        before.corrupt_dropped.total() + 1,
        "{what}: corrupt_dropped"
    );
    assert_eq!(after.committed_blocks + 1, before.committed_blocks, "{what}: committed blocks");
    assert_eq!(
        after.usage.retained_bytes + data.len() as u64,
        before.usage.retained_bytes,
        "{what}: retained bytes"
    );
    assert!(block_files(root, key).is_empty(), "{what}: damaged file left on disk");
    assert_absent(store, key, what);
}

fn assert_all_exact(store: &FileStore, blocks: &[(PhysicalKey, Vec<u8>)], what: &str) {
    for (i, (k, d)) in blocks.iter().enumerate() {
        assert_exact(store, k, d, &format!("{what}: intact block {i}"));
    }
}

// ---------------------------------------------------------------------------------------------
// (a) payload bytes

#[test]
fn flipped_payload_byte_is_never_served() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xA]));
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    for it in 0..18u16 {
        let what = format!("seed {seed}, iteration {it}");
        let mut store = open_store(root, it);
        let mut blocks = put_blocks(&store, &mut rng, 0xA0, it);
        let (key, data) = blocks.swap_remove(rng.index(blocks.len()));
        let path = block_file(root, &key);
        let (header_len, len) = header_fields(&path);
        assert_eq!(len, data.len() as u64, "{what}: header payload length");
        flip_byte(&path, header_len + rng.below(len), &mut rng);
        // Every third time the damage is found only after a restart (open reads no payload).
        if it % 3 == 2 {
            drop(store);
            store = open_store(root, it);
            assert!(store.open_report().skipped.is_empty(), "{what}: open read a payload");
            assert_eq!(
                store.lookup(&caller(0), &key).expect("lookup"),
                Lookup::Hit { len },
                "{what}: reloaded"
            );
        }
        assert_corrupt_read(&store, root, &key, &data, &what);
        assert_all_exact(&store, &blocks, &what);
        // The key is free again and takes a fresh payload.
        let fresh = common::payload(rng.next_u64(), data.len());
        assert!(matches!(store.put(&caller(0), &key, &fresh, None), Ok(Put::Committed(_))));
        assert_exact(&store, &key, &fresh, &format!("{what}: re-put"));
        drop(store);
        let store = open_store(root, it);
        assert!(store.open_report().skipped.is_empty(), "{what}: reopen skipped files");
        assert_exact(&store, &key, &fresh, &format!("{what}: re-put after reopen"));
        for (k, _) in &blocks {
            store.invalidate(&caller(0), k).expect("invalidate");
        }
        store.invalidate(&caller(0), &key).expect("invalidate");
    }
}

// ---------------------------------------------------------------------------------------------
// (b) header bytes

#[test]
fn flipped_header_byte_is_skipped_at_open() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xB]));
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    for it in 0..15u16 {
        let what = format!("seed {seed}, iteration {it}");
        let store = open_store(root, it);
        let mut blocks = put_blocks(&store, &mut rng, 0xB0, it);
        let (key, data) = blocks.swap_remove(rng.index(blocks.len()));
        let path = block_file(root, &key);
        let (header_len, _) = header_fields(&path);
        flip_byte(&path, rng.below(header_len), &mut rng);
        // While open, the store reads the payload with what it recorded at commit: the payload
        // is intact, so it is either served exactly or not at all.
        match common::get(&store, &key, data.len(), 0xEE) {
            (Get::Hit { .. }, buf) => assert!(buf == data, "{what}: wrong bytes served"),
            (other, _) => panic!("{what}: intact payload under a damaged header: {other:?}"),
        }
        drop(store);
        let store = open_store(root, it);
        let report = store.open_report();
        assert_eq!(common::skipped_total(report), 1, "{what}: skipped: {report:?}");
        assert!(
            report.skipped.keys().all(|k| k == "corrupt" || k == "foreign"),
            "{what}: skip reason: {report:?}"
        );
        assert_eq!(report.loaded, u64::from(BLOCKS) - 1, "{what}: loaded");
        let drops = store.stats().corrupt_dropped;
        assert_eq!(drops.get(CorruptPhase::Open, CorruptReason::Header), 1, "{what}: {drops:?}");
        assert_eq!(drops.total(), 1, "{what}: {drops:?}");
        assert!(!path.exists(), "{what}: damaged file not removed");
        assert_absent(&store, &key, &what);
        assert_all_exact(&store, &blocks, &what);
        for (k, _) in &blocks {
            store.invalidate(&caller(0), k).expect("invalidate");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (c) truncation

#[test]
fn truncated_block_is_a_miss_and_skipped_at_open() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xC]));
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    for it in 0..16u16 {
        let what = format!("seed {seed}, iteration {it}");
        let store = open_store(root, it);
        let mut blocks = put_blocks(&store, &mut rng, 0xC0, it);
        let (key, data) = blocks.swap_remove(rng.index(blocks.len()));
        let path = block_file(root, &key);
        let (header_len, len) = header_fields(&path);
        let file_len = fs::metadata(&path).expect("stat").len();
        if it % 2 == 0 {
            // Read while open: a short read is a corrupt miss, and the block goes.
            truncate(&path, rng.below(header_len + len));
            assert_corrupt_read(&store, root, &key, &data, &what);
            let drops = store.stats().corrupt_dropped;
            assert_eq!(drops.get(CorruptPhase::Get, CorruptReason::Truncated), 1, "{what}");
            assert_eq!(drops.total(), 1, "{what}: {drops:?}");
            drop(store);
            let store = open_store(root, it);
            assert!(store.open_report().skipped.is_empty(), "{what}: skipped a removed file");
            assert_eq!(store.stats().corrupt_dropped.total(), 0, "{what}: counted twice");
            assert_absent(&store, &key, &what);
            assert_all_exact(&store, &blocks, &what);
            for (k, _) in &blocks {
                store.invalidate(&caller(0), k).expect("invalidate");
            }
        } else {
            // Not read before the restart: open finds the size wrong and skips the file.
            truncate(&path, rng.below(file_len));
            drop(store);
            let store = open_store(root, it);
            let report = store.open_report();
            assert_eq!(report.skipped.get("truncated"), Some(&1), "{what}: {report:?}");
            assert_eq!(common::skipped_total(report), 1, "{what}: {report:?}");
            let drops = store.stats().corrupt_dropped;
            assert_eq!(drops.get(CorruptPhase::Open, CorruptReason::Truncated), 1, "{what}");
            assert_eq!(drops.total(), 1, "{what}: {drops:?}");
            assert_eq!(report.corrupt, drops, "{what}: the open report and the stats differ");
            assert!(!path.exists(), "{what}: truncated file not removed");
            assert_absent(&store, &key, &what);
            assert_all_exact(&store, &blocks, &what);
            for (k, _) in &blocks {
                store.invalidate(&caller(0), k).expect("invalidate");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Damage found at open, counted by reason in the stats and the metrics

#[test]
fn damage_found_at_open_is_counted_by_phase_and_reason() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xC1]));
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let (blocks, intact) = {
        let store = open_store(root, 0);
        let mut blocks = put_blocks(&store, &mut rng, 0xC1, 0);
        let intact = blocks.split_off(3);
        (blocks, intact)
    };
    // A damaged header, a truncated file, a file renamed to another block's sequence, and a
    // file the store never writes.
    let header = block_file(root, &blocks[0].0);
    let (header_len, _) = header_fields(&header);
    flip_byte(&header, rng.below(header_len), &mut rng);
    let short = block_file(root, &blocks[1].0);
    truncate(&short, fs::metadata(&short).expect("stat").len() - 1);
    let moved = block_file(root, &blocks[2].0);
    let name = moved.file_name().and_then(|n| n.to_str()).expect("name").to_owned();
    let (digest, rest) = name.split_once('-').expect("digest-seq.blk");
    let seq: u64 = rest.trim_end_matches(".blk").parse().expect("seq");
    fs::rename(&moved, moved.with_file_name(format!("{digest}-{}.blk", seq + 1000)))
        .expect("rename");
    fs::write(header.with_file_name("stray.txt"), b"not a block").expect("stray file");

    let store = Arc::new(open_store(root, 0));
    let metrics = Arc::new(Metrics::new());
    let metered = MeteredStore::new(Arc::clone(&store), Arc::clone(&metrics));
    metrics.watch_store(Arc::downgrade(&store) as Weak<dyn Store>);
    let drops = metered.stats().corrupt_dropped;
    for (reason, n) in [
        (CorruptReason::Header, 1),
        (CorruptReason::Truncated, 1),
        (CorruptReason::Identity, 1),
        (CorruptReason::Foreign, 1),
        (CorruptReason::Checksum, 0),
    ] {
        assert_eq!(drops.get(CorruptPhase::Open, reason), n, "{reason:?}: {drops:?}");
    }
    assert_eq!(drops.in_phase(CorruptPhase::Get), 0, "{drops:?}");
    assert_eq!(drops.total(), 4, "{drops:?}");
    assert_eq!(store.open_report().corrupt, drops);
    for (k, _) in &blocks {
        assert_absent(&store, k, "a damaged block");
    }
    assert_all_exact(&store, &intact, "the intact blocks");

    // A payload damaged later is counted where the read found it.
    let (key, data) = &intact[0];
    assert!(store.corrupt_for_test(key, rng.next_u64()));
    let mut buf = vec![0u8; data.len()];
    assert_eq!(metered.get_into(&caller(0), key, &mut buf), Ok(Get::Miss(MissReason::Corrupt)));
    let text = metrics.encode(ExpositionFormat::Prometheus);
    for line in [
        r#"gpucache_corrupt_dropped_total{phase="open",reason="header"} 1"#,
        r#"gpucache_corrupt_dropped_total{phase="open",reason="truncated"} 1"#,
        r#"gpucache_corrupt_dropped_total{phase="open",reason="identity"} 1"#,
        r#"gpucache_corrupt_dropped_total{phase="open",reason="foreign"} 1"#,
        r#"gpucache_corrupt_dropped_total{phase="open",reason="checksum"} 0"#,
        r#"gpucache_corrupt_dropped_total{phase="get",reason="checksum"} 1"#,
        r#"gpucache_corrupt_dropped_total{phase="get",reason="truncated"} 0"#,
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
    }
    assert_eq!(
        text.lines().filter(|l| l.starts_with("gpucache_corrupt_dropped_total{")).count(),
        CorruptPhase::ALL.len() * CorruptReason::ALL.len(),
        "every phase and reason has a series from the start"
    );
}

// ---------------------------------------------------------------------------------------------
// (d) swapped block files

#[test]
fn swapped_block_files_never_serve_the_other_block() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xD]));
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    for it in 0..12u16 {
        let what = format!("seed {seed}, iteration {it}");
        let store = open_store(root, it);
        // Same payload length (different bytes), except every fourth time.
        let len_a = random_len(&mut rng);
        let len_b = if it % 4 == 3 { random_len(&mut rng) } else { len_a };
        let a = (common::block_key(0xD0, it, 0), common::payload(rng.next_u64(), len_a));
        let b = (common::block_key(0xD0, it, 1), common::payload(rng.next_u64(), len_b));
        for (k, d) in [&a, &b] {
            assert!(matches!(store.put(&caller(0), k, d, None), Ok(Put::Committed(_))));
        }
        let bystander = put_blocks(&store, &mut rng, 0xD1, it);
        let (pa, pb) = (block_file(root, &a.0), block_file(root, &b.0));
        let (ca, cb) = (fs::read(&pa).expect("read a"), fs::read(&pb).expect("read b"));
        fs::write(&pa, &cb).expect("write a");
        fs::write(&pb, &ca).expect("write b");
        if it % 2 == 0 {
            for ((k, d), (_, other)) in [(&a, &b), (&b, &a)] {
                let (got, buf) = common::get(&store, k, d.len().max(other.len()), 0xEE);
                assert_eq!(got, Get::Miss(MissReason::Corrupt), "{what}: swapped file served");
                assert!(buf[..other.len()] != other[..], "{what}: the other block's bytes");
                assert!(buf[..d.len()].iter().all(|x| *x == 0), "{what}: buffer not zeroed");
                assert_absent(&store, k, &what);
            }
            assert!(!pa.exists() && !pb.exists(), "{what}: swapped files left on disk");
            drop(store);
            let store = open_store(root, it);
            assert!(store.open_report().skipped.is_empty(), "{what}: skipped");
            assert_all_exact(&store, &bystander, &what);
            for (k, _) in &bystander {
                store.invalidate(&caller(0), k).expect("invalidate");
            }
        } else {
            drop(store);
            let store = open_store(root, it);
            let report = store.open_report();
            assert_eq!(report.skipped.get("corrupt"), Some(&2), "{what}: {report:?}");
            assert_eq!(common::skipped_total(report), 2, "{what}: {report:?}");
            for (k, _) in [&a, &b] {
                assert_absent(&store, k, &what);
            }
            assert!(!pa.exists() && !pb.exists(), "{what}: swapped files left on disk");
            assert_all_exact(&store, &bystander, &what);
            for (k, _) in &bystander {
                store.invalidate(&caller(0), k).expect("invalidate");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (e) foreign files and a garbage store record

#[test]
fn foreign_files_and_garbage_store_record_do_not_stop_open() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xE]));
    for it in 0..6u16 {
        let what = format!("seed {seed}, iteration {it}");
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let store = open_store(root, it);
        let committed_in = store.open_report().epoch;
        let blocks = put_blocks(&store, &mut rng, 0xE0, it);
        drop(store);

        // A file with a non-block name, a block-named file of random bytes, a block-named file
        // shorter than any header, and a file directly under blocks/ (not a block directory).
        let sub = root.join("blocks").join(format!("{:02x}", rng.below(256)));
        fs::create_dir_all(&sub).expect("mkdir");
        let fake_name = format!("{}-{}.blk", "ab".repeat(32), rng.range(1, 1000));
        let mut noise = common::payload(rng.next_u64(), 8192);
        noise[0] = b'X';
        let foreign_name = sub.join("notes.txt");
        let foreign_magic = sub.join(&fake_name);
        let short = sub.join(format!("{}-7.blk", "cd".repeat(32)));
        let loose = root.join("blocks").join("README");
        fs::write(&foreign_name, b"operator notes").expect("write");
        fs::write(&foreign_magic, &noise).expect("write");
        fs::write(&short, b"GPCB").expect("write");
        fs::write(&loose, b"not a block directory").expect("write");
        // The store record: random bytes of a random length, empty, or the right length with
        // the magic and a wrong checksum.
        let garbage = match it % 3 {
            0 => common::payload(rng.next_u64(), rng.index(64)),
            1 => Vec::new(),
            _ => {
                let mut r = b"GPCSTOR1".to_vec();
                r.extend_from_slice(&common::payload(rng.next_u64(), 16));
                r
            }
        };
        fs::write(root.join("STORE"), &garbage).expect("write STORE");
        // Every other iteration damages the second copy too.
        let both_lost = it % 2 == 1;
        if both_lost {
            fs::write(root.join("STORE.2"), &garbage).expect("write STORE.2");
        }

        let store = open_store(root, it);
        let report = store.open_report().clone();
        assert_eq!(report.skipped.get("foreign"), Some(&2), "{what}: {report:?}");
        assert_eq!(report.skipped.get("truncated"), Some(&1), "{what}: {report:?}");
        assert_eq!(common::skipped_total(&report), 3, "{what}: {report:?}");
        assert_eq!(report.loaded, u64::from(BLOCKS), "{what}: loaded");
        // With one record copy intact the epoch continues from it; with both lost it jumps far
        // past the newest block header, so no old epoch or region id comes back.
        let expected = if both_lost { committed_in + (1 << 20) } else { committed_in + 1 };
        assert_eq!(report.epoch, expected, "{what}: epoch");
        assert!(!foreign_name.exists() && !foreign_magic.exists() && !short.exists());
        assert!(loose.exists(), "{what}: a file outside the block directories was touched");
        assert_all_exact(&store, &blocks, &what);
        drop(store);
        // The record was rewritten: the next open counts on from it.
        let store = open_store(root, it);
        assert_eq!(store.open_report().epoch, expected + 1, "{what}: epoch after rewrite");
        assert!(store.open_report().skipped.is_empty(), "{what}: skipped again");
    }
}

// ---------------------------------------------------------------------------------------------
// (f) fsck

/// Builds a store with healthy blocks and one bad file of every kind (plus a leftover tmp file);
/// returns the healthy blocks and each bad path with the start of the reason fsck must give.
fn damage_everything(
    root: &Path,
    rng: &mut SplitMix64,
    it: u16,
) -> (Blocks, Vec<(PathBuf, &'static str)>) {
    let store = open_store(root, it);
    let mut good = put_blocks(&store, rng, 0xF0, it);
    let mut victims = put_blocks(&store, rng, 0xF1, it);
    // A same-length pair to swap.
    let len = random_len(rng);
    let pair: Vec<PhysicalKey> = (0..2)
        .map(|i| {
            let k = common::block_key(0xF2, it, i);
            let d = common::payload(rng.next_u64(), len);
            assert!(matches!(store.put(&caller(0), &k, &d, None), Ok(Put::Committed(_))));
            k
        })
        .collect();
    drop(store);
    let mut bad = Vec::new();
    let (k, _) = victims.pop().expect("victim");
    let p = block_file(root, &k);
    let (hl, len_p) = header_fields(&p);
    flip_byte(&p, hl + rng.below(len_p), rng);
    bad.push((p, "payload checksum mismatch"));
    let (k, _) = victims.pop().expect("victim");
    let p = block_file(root, &k);
    let (hl, _) = header_fields(&p);
    flip_byte(&p, rng.range(16, hl - 1), rng);
    bad.push((p, "header checksum mismatch"));
    let (k, _) = victims.pop().expect("victim");
    let p = block_file(root, &k);
    let (hl, len_p) = header_fields(&p);
    truncate(&p, hl + rng.below(len_p));
    bad.push((p, "file is "));
    let (pa, pb) = (block_file(root, &pair[0]), block_file(root, &pair[1]));
    let (ca, cb) = (fs::read(&pa).expect("read"), fs::read(&pb).expect("read"));
    fs::write(&pa, cb).expect("write");
    fs::write(&pb, ca).expect("write");
    bad.push((pa, "key digest or sequence differs from the file name"));
    bad.push((pb, "key digest or sequence differs from the file name"));
    let sub = root.join("blocks").join("00");
    fs::create_dir_all(&sub).expect("mkdir");
    let named = sub.join("stray.bin");
    fs::write(&named, b"stray").expect("write");
    bad.push((named, "file name is not"));
    let magic = sub.join(format!("{}-3.blk", "ef".repeat(32)));
    fs::write(&magic, vec![0x11u8; 4096]).expect("write");
    bad.push((magic, "not a block file"));
    fs::write(root.join("tmp").join("12345.tmp"), b"half a block").expect("write tmp");
    // The remaining victims are healthy too.
    good.append(&mut victims);
    (good, bad)
}

#[test]
fn fsck_names_every_bad_file_and_repair_removes_them() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 0xF]));
    for it in 0..6u16 {
        let what = format!("seed {seed}, iteration {it}");
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let (good, bad) = damage_everything(root, &mut rng, it);

        {
            let store = open_store(root, it);
            let refused = fsck(root, false, |_, _| {}).expect_err("fsck of an open store");
            assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock, "{what}");
            // Opening skips and removes most of the damage; fsck runs on a fresh copy below.
            drop(store);
        }
        let dir2 = tempfile::tempdir().expect("temp dir");
        let root2 = dir2.path();
        let (good2, bad2) = damage_everything(root2, &mut rng, it);

        let mut progress = Vec::new();
        let report = fsck(root2, false, |done, total| progress.push((done, total))).expect("fsck");
        let total = (good2.len() + bad2.len()) as u64;
        assert_eq!(report.files, total, "{what}: files: {report:?}");
        assert_eq!(report.ok, good2.len() as u64, "{what}: ok: {report:?}");
        let ok_bytes: u64 = good2.iter().map(|(_, d)| d.len() as u64).sum();
        assert_eq!(report.ok_bytes, ok_bytes, "{what}: ok bytes");
        assert_eq!(report.tmp_files, 1, "{what}: tmp files");
        assert_eq!(report.repaired, 0, "{what}: repaired without repair");
        assert_eq!(report.bad_count(), bad2.len() as u64, "{what}: bad: {:#?}", report.bad);
        assert_eq!(progress.last(), Some(&(total, total)), "{what}: progress");
        for (path, reason) in &bad2 {
            let found = report.bad.iter().find(|(_, paths)| paths.contains(path));
            let (label, _) = found.unwrap_or_else(|| panic!("{what}: {path:?} not reported"));
            assert!(label.starts_with(reason), "{what}: {path:?} reported as {label:?}");
            assert!(path.exists(), "{what}: fsck without repair removed {path:?}");
        }

        let repaired = fsck(root2, true, |_, _| {}).expect("fsck repair");
        assert_eq!(repaired.bad_count(), bad2.len() as u64, "{what}: bad on repair");
        assert_eq!(repaired.repaired, bad2.len() as u64 + 1, "{what}: repaired count");
        for (path, _) in &bad2 {
            assert!(!path.exists(), "{what}: repair left {path:?}");
        }
        assert!(common::tmp_files(root2).is_empty(), "{what}: repair left tmp files");
        let clean = fsck(root2, false, |_, _| {}).expect("fsck after repair");
        assert_eq!(clean.bad_count(), 0, "{what}: bad after repair");
        assert_eq!(clean.tmp_files, 0, "{what}: tmp after repair");
        assert_eq!(clean.ok, good2.len() as u64, "{what}: ok after repair");

        let store = open_store(root2, it);
        assert!(store.open_report().skipped.is_empty(), "{what}: skipped after repair");
        assert_eq!(store.open_report().loaded, good2.len() as u64, "{what}: loaded");
        assert_all_exact(&store, &good2, &what);
        drop(store);

        // The first copy, after an open removed what it could see: fsck still finds the flipped
        // payload (open reads no payloads), and nothing else.
        let report = fsck(root, false, |_, _| {}).expect("fsck");
        let flipped = &bad[0].0;
        assert_eq!(report.bad_count(), 1, "{what}: after open: {:#?}", report.bad);
        assert_eq!(
            report.bad.get("payload checksum mismatch").map(Vec::as_slice),
            Some(std::slice::from_ref(flipped)),
            "{what}: after open"
        );
        assert_eq!(report.ok, good.len() as u64, "{what}: ok after open");
    }
}
